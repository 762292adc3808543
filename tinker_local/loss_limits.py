"""Bounds on the work of an uploaded custom loss (``tinker_local.custom_loss``), checked before
each step runs.

An uploaded loss is a graph of allowed calls; every node runs on the compute thread that all
users share, so a graph must not be able to stall or exhaust the server.  ``GraphLimits`` names
the bounds; ``check_call`` predicts what one call will produce from the call and its inputs
*before* it runs, and refuses it with ``GraphLimitError`` (one line naming the limit) when the
prediction is over a bound:

- ``max_nodes``: nodes in a graph (checked at upload);
- ``max_elements``: elements of any one intermediate tensor (its shape is predicted from the
  input shapes: element-wise calls by broadcasting, anything else by running the call on
  ``meta`` tensors, which have a shape and a dtype but no storage, so no data is computed; a
  data-dependent shape, e.g. ``x[mask]``, is bounded as if every mask element were true);
- ``max_request_elements``: elements of all intermediates of one request summed (what autograd
  may keep for the backward pass);
- ``max_macs``: multiply-adds of one matrix product (``matmul``, ``mm``, ``mv``, ``dot``, ``@``);
- ``max_int_bits``: bits of any Python integer (an integer power is predicted from the bit length
  of its base times its exponent before it is computed; lists and strings are bounded by
  ``max_sequence`` items before they are concatenated);
- ``time_budget_s``: seconds of graph evaluation per request, the model's passes not counted
  (checked between nodes).

The upload itself is checked once at probe shapes (``PROBE_T`` tokens, ``PROBE_K`` columns), which
catches chains whose growth does not depend on the data (40 nested ``pow(x, 1024)``, 40 nested
``cat([x, x])``); every request is then checked node by node at its real shapes.

``CustomLossError`` (a user error) is what the custom-loss modules raise for a loss they refuse
or that failed on its inputs; a ``GraphLimitError`` is reported as one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from .outcomes import UserError

PROBE_T = 64  # tokens of a datum when an upload is checked
PROBE_K = 8  # columns of rank-2 inputs when an upload is checked


class CustomLossError(UserError):
    """An uploaded loss tinker_local will not run, or one that failed on its inputs (user error)."""


class GraphLimitError(UserError):
    """A custom loss that would go over one of the server's ``GraphLimits`` (the message names it)."""


@dataclass(frozen=True)
class GraphLimits:
    """Bounds on one custom loss (see the module docstring); ``serve`` flags set the first three."""

    max_nodes: int = 1024
    max_elements: int = 1 << 24  # 16.8 M (64 MiB of float32)
    time_budget_s: float = 30.0
    max_request_elements: int = 1 << 28  # 268 M (1 GiB of float32)
    max_macs: int = 1 << 31
    max_int_bits: int = 63
    max_sequence: int = 4096


# element-wise calls: the output has the broadcast shape of the tensor arguments
_ELEMENTWISE = frozenset(
    """abs absolute acos acosh add addcdiv addcmul asin asinh atan atan2 atanh ceil clamp clamp_max
clamp_min clip cos cosh div divide eq erf erfc exp exp2 expm1 floor floor_divide fmax fmin fmod frac
ge greater greater_equal gt hypot isclose isfinite isinf isnan isneginf isposinf le lerp less
less_equal lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or
logical_xor logit lt masked_fill maximum minimum mul multiply nan_to_num ne neg negative not_equal
pow reciprocal relu remainder round rsqrt sgn sigmoid sign signbit sin sinc sinh sqrt square sub
subtract tan tanh true_divide trunc where xlogy detach clone contiguous float double long int bool
type_as log_softmax softmax softmin cumsum cumprod logcumsumexp elu gelu hardtanh leaky_relu
logsigmoid log_sigmoid relu6 selu silu softplus softsign tanhshrink threshold special_entr
special_expit special_logit special_xlogy special_log_ndtr special_ndtr and_ or_ xor invert pos
truediv floordiv mod""".split()
)
_MATMUL = frozenset({"matmul", "mm", "mv", "dot"})


class _Shape:
    """A predicted tensor known only by its shape (element-wise calls, checked on real inputs)."""

    def __init__(self, shape: torch.Size):
        self.shape = shape

    def numel(self) -> int:
        return math.prod(self.shape)


def _leaf(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def _tensors(v: Any, out: list[Any]) -> list[Any]:
    if isinstance(v, (torch.Tensor, _Shape)):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _tensors(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _tensors(x, out)
    return out


def to_meta(v: Any) -> Any:
    """``v`` with every tensor replaced by a ``meta`` tensor of its shape, strides and dtype."""
    if isinstance(v, torch.Tensor):
        return v if v.device.type == "meta" else torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, list):
        return [to_meta(x) for x in v]
    if isinstance(v, tuple):
        return tuple(to_meta(x) for x in v)
    if isinstance(v, dict):
        return {k: to_meta(x) for k, x in v.items()}
    return v


class Meter:
    """One request's (or one upload check's) running totals against ``limits``: elements of all
    intermediates so far, and seconds spent evaluating the loss graph (``spent``: the model's
    forward and backward passes do not count)."""

    def __init__(self, limits: GraphLimits, who: str):
        self.limits = limits
        self.who = who
        self.elements = 0
        self.spent = 0.0

    def check_time(self, since: float) -> None:
        """GraphLimitError once the request has evaluated its loss for ``time_budget_s`` seconds
        (``spent`` plus the time since ``since``, a ``time.monotonic()`` of the evaluation going on)."""
        spent = self.spent + time.monotonic() - since
        if spent > self.limits.time_budget_s:
            raise GraphLimitError(
                f"{self.who}: over the time budget of {self.limits.time_budget_s:g} s per request "
                f"(custom-loss time budget; serve --loss-time-budget) after {spent:.1f} s"
            )

    def add(self, value: Any, where: str) -> None:
        """Check one predicted (or computed) output of node ``where`` against the per-value bounds
        and add its elements to the request's total."""
        lim = self.limits
        for t in _tensors(value, []):
            n = t.numel()
            if n > lim.max_elements:
                raise GraphLimitError(
                    f"{where}: an intermediate of {n} elements {tuple(t.shape)} is over the limit of "
                    f"{lim.max_elements} elements per intermediate (serve --loss-max-elements)"
                )
            self.elements += n
        if self.elements > lim.max_request_elements:
            raise GraphLimitError(
                f"{where}: the loss's intermediates reach {self.elements} elements in all, over the limit "
                f"of {lim.max_request_elements} per request"
            )
        _check_scalars(value, lim, where)


def _check_scalars(v: Any, lim: GraphLimits, where: str) -> None:
    if isinstance(v, bool):
        return
    if isinstance(v, int):
        if v.bit_length() > lim.max_int_bits:
            raise GraphLimitError(
                f"{where}: an integer of {v.bit_length()} bits is over the limit of {lim.max_int_bits} bits"
            )
    elif isinstance(v, (str, bytes, list, tuple)):
        if len(v) > lim.max_sequence:
            raise GraphLimitError(
                f"{where}: a {type(v).__name__} of {len(v)} items is over the limit of {lim.max_sequence} items"
            )
        if isinstance(v, (list, tuple)):
            for x in v:
                _check_scalars(x, lim, where)
    elif isinstance(v, dict):
        for x in v.values():
            _check_scalars(x, lim, where)


def _precheck_scalars(target: str, args: tuple, lim: GraphLimits, where: str) -> None:
    """Refuse a Python-scalar or sequence call whose result would be over a bound, before computing it."""
    for a in args:
        _check_scalars(a, lim, where)
    leaf = _leaf(target)
    if len(args) != 2:
        return
    a, b = args
    if leaf == "pow" and isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and b > 0:
        bits = max(a.bit_length() - 1, 0) * b + 1  # |a| >= 2**(bits(a) - 1)
        if bits > lim.max_int_bits:
            raise GraphLimitError(
                f"{where}: {a.bit_length()}-bit integer to the power {b} makes at least {bits} bits, over the "
                f"limit of {lim.max_int_bits} bits"
            )
    seq = (str, bytes, list, tuple)
    if leaf in ("add", "concat") and isinstance(a, seq) and isinstance(b, seq):
        if len(a) + len(b) > lim.max_sequence:
            raise GraphLimitError(
                f"{where}: joining sequences of {len(a)} and {len(b)} items is over the limit of "
                f"{lim.max_sequence} items"
            )
    if leaf == "mod" and isinstance(a, (str, bytes)):
        raise GraphLimitError(f"{where}: string formatting with % is not allowed in a custom loss")


def predict(
    target: str, call: Any, args: tuple, kwargs: dict, limits: GraphLimits, where: str, *, fast: bool = True
) -> Any:
    """The output of ``call(*args, **kwargs)`` (node ``target``) as far as the bounds need it,
    computed before the call runs: for tensor calls a ``meta`` value (shape and dtype, no data) or,
    with ``fast`` for an element-wise call, a ``_Shape`` (its broadcast shape only); for Python
    scalars the value itself (after ``_precheck_scalars``).  Raises GraphLimitError for
    a call over a bound (matrix-product multiply-adds here, sizes in ``Meter.add``), or whatever
    the call raises on meta tensors (a call tinker_local cannot predict)."""
    _precheck_scalars(target, args, limits, where)
    tensors = _tensors([args, kwargs], [])
    if not tensors:
        return call(*args, **kwargs)
    leaf = _leaf(target)
    if fast and _elementwise(leaf, args, kwargs):
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        return _Shape(shape)
    with _assume_all_nonzero():
        out = call(*to_meta(args), **to_meta(kwargs))
    if leaf in _MATMUL:
        a = tensors[0]
        inner = a.shape[-1] if a.ndim else 1
        macs = max(out.numel(), 1) * inner
        if macs > limits.max_macs:
            raise GraphLimitError(
                f"{where}: a matrix product of {macs} multiply-adds is over the limit of {limits.max_macs}"
            )
    return out


def _elementwise(leaf: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call's output is one tensor of its tensor arguments' broadcast shape: an
    element-wise name, no sequence argument, and not one-argument ``where`` (a tuple of index
    tensors, like ``nonzero(as_tuple=True)``)."""
    if leaf not in _ELEMENTWISE or any(isinstance(a, (list, tuple)) for a in args):
        return False
    return not (leaf == "where" and len(args) + len(kwargs) == 1)


class _assume_all_nonzero:
    """Within: meta ``nonzero`` (boolean-mask indexing, one-argument ``where``) answers as if every
    element were non-zero, an upper bound on the real size."""

    def __enter__(self):
        import torch.fx.experimental._config as fx_config

        self._patch = fx_config.patch(meta_nonzero_assume_all_nonzero=True)
        self._patch.__enter__()

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)
