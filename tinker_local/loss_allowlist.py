"""The allow-list of a server-side custom loss (``tinker_local.custom_loss``): the only callables an
uploaded graph may name, and the guarded stand-ins for the few whose plain form could exhaust
the server.

- ``ALLOWED_FUNCTIONS``: ``call_function`` target (qualified name, as the SDK's trace writes it)
  -> callable: pure torch / torch.nn.functional / math / operator functions, none that creates a
  tensor of a size its inputs do not bound, draws random numbers or does I/O;
  ``operator.mul`` / ``operator.pow`` / ``getattr`` are replaced by ``safe_mul`` / ``safe_pow`` /
  ``safe_getattr``.
- ``TENSOR_METHODS``: ``call_method`` targets (no in-place ``*_``, no ``backward``, no
  ``item`` / ``tolist``), called through ``tensor_method``.
- ``TENSOR_ATTRS``: the tensor attributes ``getattr`` may read.

A refused call raises ``CustomLossError`` (``tinker_local.loss_limits``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .loss_limits import CustomLossError

_TORCH = """abs absolute acos acosh add addcdiv addcmul all amax amin any argmax argmin asin asinh
atan atan2 atanh cat ceil chunk clamp clamp_max clamp_min clip cos cosh count_nonzero cummax cummin
cumprod cumsum detach diag diagonal diff div divide dot eq erf erfc exp exp2 expm1 flatten flip
floor floor_divide fmax fmin fmod frac full_like gather ge greater greater_equal gt hypot
index_select isclose isfinite isinf isnan isneginf isposinf le less less_equal lerp lgamma log
log10 log1p log2 log_softmax logaddexp logaddexp2 logcumsumexp logical_and logical_not logical_or
logical_xor logit logsumexp lt masked_fill matmul max maximum mean median min minimum mm movedim
mul multiply mv nan_to_num nanmean nanmedian nansum narrow ne neg negative norm not_equal numel
ones_like permute pow prod quantile reciprocal relu remainder reshape round rsqrt select sgn
sigmoid sign signbit sin sinc sinh softmax sort split sqrt square squeeze stack std std_mean sub
subtract sum swapaxes t take_along_dim tan tanh tensor topk transpose tril triu true_divide trunc
unbind unsqueeze var var_mean where xlogy zeros_like""".split()
_NN_FUNCTIONAL = """binary_cross_entropy binary_cross_entropy_with_logits cosine_similarity
cross_entropy elu gelu glu hardtanh huber_loss kl_div l1_loss leaky_relu log_softmax logsigmoid
mse_loss nll_loss normalize relu relu6 selu silu smooth_l1_loss softmax softmin softplus
softsign tanhshrink threshold""".split()
_NN_C = "elu gelu hardtanh leaky_relu log_sigmoid softplus".split()  # torch._C._nn.<name>
_SPECIAL_C = "special_entr special_expit special_logit special_xlogy special_log_ndtr special_ndtr".split()
_MATH = """acos asin atan atan2 ceil copysign cos cosh erf erfc exp expm1 fabs floor fmod hypot isfinite
isinf isnan lgamma log log10 log1p log2 pow sin sinh sqrt tan tanh trunc""".split()
_OPERATOR = """abs add and_ eq floordiv ge getitem gt invert le lt matmul mod mul ne neg or_ pos pow
sub truediv xor""".split()
TENSOR_METHODS = frozenset(
    """abs add all amax amin any argmax argmin bool ceil clamp clamp_max
clamp_min clip clone contiguous cos cumsum detach diff dim div double eq exp exp2 expm1 flatten flip
float floor gather ge gt int isfinite isinf isnan le lerp log log10 log1p log2 log_softmax
logical_and logical_not logical_or logsumexp long lt masked_fill matmul max maximum mean min
minimum mul nan_to_num nansum ne neg norm numel permute pow prod reciprocal relu reshape round
rsqrt sigmoid sign sin size softmax sort sqrt square squeeze std sub sum t tanh topk transpose
type_as unsqueeze var view view_as where xlogy""".split()
)
TENSOR_ATTRS = frozenset({"shape", "ndim", "dtype", "T", "mT"})


def _allowed_functions() -> dict[str, Callable[..., Any]]:
    table: dict[str, Callable[..., Any]] = {}
    for name in _TORCH:
        if hasattr(torch, name):
            table[f"torch.{name}"] = getattr(torch, name)
    for name in _NN_FUNCTIONAL:
        if hasattr(F, name):
            table[f"torch.nn.functional.{name}"] = getattr(F, name)
    for name in _NN_C:
        if hasattr(torch._C._nn, name):
            table[f"torch._C._nn.{name}"] = getattr(torch._C._nn, name)
    special_c = torch._C._special  # type: ignore[attr-defined]  # torch's stubs omit torch._C._special
    for name in _SPECIAL_C:
        if hasattr(special_c, name):
            table[f"torch._C._special.{name}"] = getattr(special_c, name)
    for name in _MATH:
        table[f"math.{name}"] = getattr(math, name)
    for name in _OPERATOR:
        table[f"operator.{name}"] = getattr(operator, name)
    table["operator.mul"] = safe_mul
    table["operator.pow"] = safe_pow
    table["getattr"] = safe_getattr
    table["builtins.getattr"] = safe_getattr
    return table


MAX_INT_EXPONENT = 1024


def safe_mul(a: Any, b: Any) -> Any:
    """``operator.mul`` without sequence repetition (``[0] * 10**10`` would exhaust memory)."""
    if isinstance(a, (list, tuple, str, bytes)) or isinstance(b, (list, tuple, str, bytes)):
        raise CustomLossError("operator.mul on a list, tuple or string is not allowed")
    return operator.mul(a, b)


def safe_pow(a: Any, b: Any) -> Any:
    """``operator.pow`` without huge Python-integer powers (``10 ** 10**9`` would run for ages)."""
    if isinstance(a, int) and isinstance(b, int) and abs(b) > MAX_INT_EXPONENT:
        raise CustomLossError(f"integer power with exponent {b} is not allowed (at most {MAX_INT_EXPONENT})")
    return operator.pow(a, b)


def safe_getattr(obj: Any, attr: Any, *default: Any) -> Any:
    """``getattr`` of one of ``TENSOR_ATTRS`` of a tensor (no default); anything else is refused."""
    if not isinstance(obj, torch.Tensor) or attr not in TENSOR_ATTRS or default:
        raise CustomLossError(
            f"getattr({type(obj).__name__}, {attr!r}) is not allowed; a custom "
            f"loss may read {sorted(TENSOR_ATTRS)} of a tensor"
        )
    return getattr(obj, attr)


ALLOWED_FUNCTIONS = _allowed_functions()


def tensor_method(name: str) -> Callable[..., Any]:
    """``self.<name>(*args, **kwargs)`` of an allowed tensor method, as a plain callable."""

    def call(self_arg: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self_arg, torch.Tensor):
            raise CustomLossError(f"method {name!r} called on a {type(self_arg).__name__}")
        return getattr(self_arg, name)(*args, **kwargs)

    return call
