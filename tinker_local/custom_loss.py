"""Server-side custom losses: the graphs ``ServiceClient.create_custom_loss`` uploads, rebuilt
from an allow-list and run per datum on the trainer's logprobs.

The SDK traces ``fn(logprobs, *inputs) -> (loss, {"custom/<name>:sum|mean": tensor})`` with
``torch.fx`` and sends it as plain data (``CustomLossGraph``: nodes in execution order, ``target``
the qualified name of the function or the method name; arguments encoded as JSON with one-key
objects for node refs, tuples, dicts, slices, ``...``, non-finite floats, dtypes, devices,
layouts and memory formats; see ``tinker.types.CustomLossGraph``).  Nothing of the upload is
executed as code: ``compile_graph`` maps every ``call_function`` target to a callable on an
explicit list (pure torch / torch.nn.functional / math / operator functions; no creation of
tensors of a size the inputs do not bound, no randomness, no I/O), every ``call_method`` to an
allowed ``torch.Tensor`` method (no in-place ``*_``, no ``backward``, no ``item``/``tolist``),
and ``getattr`` to a few tensor attributes (``shape``, ``ndim``, ``dtype``, ``T``, ``mT``);
``get_attr`` / ``call_module`` nodes, unknown targets, ``out=`` arguments and unknown argument
encodings are refused as a ``CustomLossError`` (a user error naming the node and the op).

Semantics match the SDK's client-side ``run_loss_handle``: the graph runs once per datum with
``logprobs`` (shaped like that datum's ``target_tokens``) and the datum's ``loss_fn_inputs`` named
by the loss (float32 / int64 tensors of the declared rank, 0 = scalar, 1 = [T], 2 = [T, K]); the
per-datum scalar losses are summed; ``:sum`` metrics are summed over datums and ``:mean`` metrics
averaged.  Gradients flow from the summed loss into the LoRA weights on the server, so a custom
loss costs one ``forward_backward`` request instead of a forward plus a forward_backward.
"""

from __future__ import annotations

import math
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .loss_limits import PROBE_K, PROBE_T, GraphLimitError, GraphLimits, Meter, predict
from .outcomes import UserError

MAX_INPUTS = 16
MAX_ARG_DEPTH = 16  # nesting of one node's arguments (lists, tuples, dicts, slices)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_INPUT_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_METRIC_KEY = re.compile(r"^custom/[a-z0-9_./-]{1,64}:(sum|mean)$")


class CustomLossError(UserError):
    """An uploaded loss tinker_local will not run, or one that failed on its inputs (user error)."""


# -- the allow-list -------------------------------------------------------------------------------
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
_DTYPES = {
    n: getattr(torch, n)
    for n in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "long",
        "int",
        "float",
        "double",
        "half",
    )
}
_MEMORY_FORMATS = {n: getattr(torch, n) for n in ("contiguous_format", "preserve_format")}


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
    table["operator.mul"] = _safe_mul
    table["operator.pow"] = _safe_pow
    table["getattr"] = _safe_getattr
    table["builtins.getattr"] = _safe_getattr
    return table


MAX_INT_EXPONENT = 1024


def _safe_mul(a: Any, b: Any) -> Any:
    """``operator.mul`` without sequence repetition (``[0] * 10**10`` would exhaust memory)."""
    if isinstance(a, (list, tuple, str, bytes)) or isinstance(b, (list, tuple, str, bytes)):
        raise CustomLossError("operator.mul on a list, tuple or string is not allowed")
    return operator.mul(a, b)


def _safe_pow(a: Any, b: Any) -> Any:
    """``operator.pow`` without huge Python-integer powers (``10 ** 10**9`` would run for ages)."""
    if isinstance(a, int) and isinstance(b, int) and abs(b) > MAX_INT_EXPONENT:
        raise CustomLossError(f"integer power with exponent {b} is not allowed (at most {MAX_INT_EXPONENT})")
    return operator.pow(a, b)


def _safe_getattr(obj: Any, attr: Any, *default: Any) -> Any:
    if not isinstance(obj, torch.Tensor) or attr not in TENSOR_ATTRS or default:
        raise CustomLossError(
            f"getattr({type(obj).__name__}, {attr!r}) is not allowed; a custom "
            f"loss may read {sorted(TENSOR_ATTRS)} of a tensor"
        )
    return getattr(obj, attr)


ALLOWED_FUNCTIONS = _allowed_functions()


# -- decoding -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ref:
    name: str


class _Device:
    """An encoded ``torch.device``: replaced by the device the loss runs on."""


def _decode(where: str, v: Any, depth: int = 0) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if depth >= MAX_ARG_DEPTH:
        raise CustomLossError(f"{where}: arguments nested more than {MAX_ARG_DEPTH} levels deep")
    depth += 1
    if isinstance(v, list):
        return [_decode(where, x, depth) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise CustomLossError(f"{where}: cannot decode argument {str(v)[:80]!r}")
    ((key, x),) = v.items()
    if key == "ref" and isinstance(x, str):
        return Ref(x)
    if key == "tuple" and isinstance(x, list):
        return tuple(_decode(where, a, depth) for a in x)
    if key == "dict" and isinstance(x, dict):
        return {str(k): _decode(where, a, depth) for k, a in x.items()}
    if key == "slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(_decode(where, a, depth) for a in x))
    if key == "ellipsis" and x is True:
        return Ellipsis
    if key == "float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if key == "dtype" and x in _DTYPES:
        return _DTYPES[x]
    if key == "device" and isinstance(x, str):
        return _Device()
    if key == "layout" and x == "strided":
        return torch.strided
    if key == "memory_format" and x in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[x]
    raise CustomLossError(f"{where}: argument encoding {key!r} with value {str(x)[:40]!r} is not allowed")


def _refs(v: Any):
    if isinstance(v, Ref):
        yield v.name
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _refs(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _refs(x)
    elif isinstance(v, slice):
        yield from _refs([v.start, v.stop, v.step])


@dataclass
class _Node:
    op: str
    name: str
    target: str
    fn: Callable[..., Any] | None
    args: tuple
    kwargs: dict


def _method(name: str) -> Callable[..., Any]:
    """``self.<name>(*args, **kwargs)`` of an allowed tensor method, as a plain callable."""

    def call(self_arg: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self_arg, torch.Tensor):
            raise CustomLossError(f"method {name!r} called on a {type(self_arg).__name__}")
        return getattr(self_arg, name)(*args, **kwargs)

    return call


@dataclass
class CompiledLoss:
    """A validated loss: ``inputs`` = [(name, rank)] with logprobs first; run with ``bind``;
    ``limits``: the bounds every request's evaluation is held to (``tinker_local.loss_limits``)."""

    name: str
    inputs: list[tuple[str, int]]
    nodes: list[_Node]
    loss_ref: Any
    metric_refs: dict[str, Any]
    limits: GraphLimits = GraphLimits()

    def bind(self, n_datums: int) -> BoundLoss:
        """This loss for one request of ``n_datums`` datums; its time budget starts now."""
        return BoundLoss(self, n_datums)


def _probe(loss: CompiledLoss) -> None:
    """Walk the graph once on ``meta`` inputs of probe shapes (``loss_limits.PROBE_T`` tokens,
    ``PROBE_K`` columns), checking every node's predicted output against ``loss.limits``: a graph
    whose growth does not depend on the data is refused here, at upload.  A node the prediction
    cannot follow (a dtype or shape error at these shapes) leaves its dependents unchecked until a
    request runs them at their real shapes."""
    meta = torch.device("meta")
    env: dict[str, Any] = {}
    unknown: set[str] = set()
    meter = Meter(loss.limits, f"custom loss {loss.name!r}")
    for iname, rank in loss.inputs:
        env[iname] = torch.empty((PROBE_T, PROBE_K)[:rank], device=meta)
    for node in loss.nodes:
        if node.op == "placeholder":
            continue
        if set(_refs([node.args, node.kwargs])) & unknown or node.fn is None:
            unknown.add(node.name)
            continue
        where = f"custom loss {loss.name!r}, node {node.name} ({node.target})"
        try:
            value = predict(
                node.target,
                node.fn,
                _resolve(node.args, env, meta),
                _resolve(node.kwargs, env, meta),
                loss.limits,
                where,
                fast=False,
            )
        except (GraphLimitError, CustomLossError):
            raise
        except Exception:  # not predictable at probe shapes: checked per request
            unknown.add(node.name)
            continue
        meter.add(value, where)
        env[node.name] = value


def compile_graph(name: str, inputs: Any, graph: Any, limits: GraphLimits | None = None) -> CompiledLoss:
    """Validate an uploaded ``CreateCustomLossRequest`` (its ``name``, ``inputs`` and ``graph``),
    rebuild it from the allow-list and check it against ``limits`` (default ``GraphLimits()``) at
    probe shapes.  Raises ``CustomLossError`` naming what is refused (a ``GraphLimitError`` names
    the limit)."""
    limits = limits or GraphLimits()
    who = f"custom loss {str(name)[:64]!r}"
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise CustomLossError(f"{who}: 'inputs' must list 1 to {MAX_INPUTS} inputs, logprobs first")
    ins: list[tuple[str, int]] = []
    for i, x in enumerate(inputs):
        iname, rank = (x or {}).get("name"), (x or {}).get("rank")
        if not isinstance(iname, str) or not _INPUT_NAME.match(iname) or rank not in (0, 1, 2):
            raise CustomLossError(f"{who}: input {i} must be {{name: lowercase identifier, rank: 0|1|2}}, got {x!r}")
        ins.append((iname, int(rank)))
    if ins[0][0] != "logprobs" or ins[0][1] == 0:
        raise CustomLossError(f"{who}: the first input must be logprobs with rank 1 or 2")
    if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(graph.get("nodes"), list):
        raise CustomLossError(f"{who}: graph must be {{format: 1, nodes: [...]}}")
    raw = graph["nodes"]
    if not raw or len(raw) > limits.max_nodes:
        raise CustomLossError(
            f"{who}: graph must have 1 to {limits.max_nodes} nodes (node limit; serve --loss-max-nodes), got {len(raw)}"
        )
    nodes: list[_Node] = []
    seen: set[str] = set()
    placeholders: list[str] = []
    output = None
    for k, nd in enumerate(raw):
        if not isinstance(nd, dict):
            raise CustomLossError(f"{who}: node {k} is not an object")
        op, nname, target = nd.get("op"), nd.get("name"), nd.get("target")
        if not isinstance(nname, str) or not _NAME.match(nname) or nname in seen:
            raise CustomLossError(f"{who}: node {k} has a missing, malformed or repeated name {nname!r}")
        if not isinstance(target, str):
            raise CustomLossError(f"{who}: node {nname} has no target")
        where = f"{who}, node {nname}"
        if output is not None:
            raise CustomLossError(f"{where}: nodes after the output node")
        args = tuple(_decode(where, a) for a in (nd.get("args") or []))
        kwargs = {str(key): _decode(where, a) for key, a in (nd.get("kwargs") or {}).items()}
        for ref in _refs([args, kwargs]):
            if ref not in seen:
                raise CustomLossError(f"{where}: refers to {ref!r}, which no earlier node defines")
        if "out" in kwargs:
            raise CustomLossError(f"{where}: out= arguments are not allowed")
        fn = None
        if op == "placeholder":
            if nodes and nodes[-1].op != "placeholder":
                raise CustomLossError(f"{where}: placeholders must come first")
            placeholders.append(target)
        elif op == "call_function":
            fn = ALLOWED_FUNCTIONS.get(target)
            if fn is None:
                raise CustomLossError(
                    f"{where}: calls {target!r}, which tinker_local does not run; a "
                    "server-side custom loss may call listed torch, "
                    "torch.nn.functional, math and operator functions only"
                )
            if fn is _safe_getattr and (len(args) != 2 or args[1] not in TENSOR_ATTRS):
                raise CustomLossError(
                    f"{where}: getattr of {args[1:]!r} is not allowed; a custom loss "
                    f"may read {sorted(TENSOR_ATTRS)} of a tensor"
                )
        elif op == "call_method":
            if target not in TENSOR_METHODS:
                raise CustomLossError(
                    f"{where}: calls tensor method {target!r}, which tinker_local does "
                    "not run (no in-place, autograd, host-transfer or unlisted methods)"
                )
            if not args or not isinstance(args[0], Ref):
                raise CustomLossError(f"{where}: method {target!r} must be called on a node's value")
            fn = _method(target)
        elif op == "output":
            output = args
        else:
            raise CustomLossError(f"{where}: {op!r} nodes are not allowed (no modules, no captured tensors)")
        seen.add(nname)
        nodes.append(_Node(op, nname, target, fn, args, kwargs))
    if placeholders != [n for n, _ in ins]:
        raise CustomLossError(
            f"{who}: the graph's parameters {placeholders} do not match its inputs {[n for n, _ in ins]}"
        )
    if output is None or len(output) != 1 or not isinstance(output[0], (tuple, list)) or len(output[0]) != 2:
        raise CustomLossError(f"{who}: the graph must end in an output node returning (loss, metrics)")
    loss_ref, metrics = output[0]
    if not isinstance(loss_ref, Ref) or not isinstance(metrics, dict):
        raise CustomLossError(f"{who}: the output must be (loss tensor, {{metric: tensor}})")
    for key, ref in metrics.items():
        if not _METRIC_KEY.match(key) or not isinstance(ref, Ref):
            raise CustomLossError(
                f"{who}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean and be a tensor"
            )
    compiled = CompiledLoss(str(name), ins, [n for n in nodes if n.op != "output"], loss_ref, metrics, limits)
    try:
        _probe(compiled)
    except GraphLimitError as e:
        raise CustomLossError(str(e)) from None
    except CustomLossError as e:
        raise CustomLossError(f"{who}: {e}") from None
    except RecursionError:
        raise CustomLossError(f"{who}: arguments nested too deeply") from None
    return compiled


# -- running --------------------------------------------------------------------------------------
def _resolve(v: Any, env: dict[str, Any], device: torch.device) -> Any:
    if isinstance(v, Ref):
        return env[v.name]
    if isinstance(v, _Device):
        return device
    if isinstance(v, list):
        return [_resolve(x, env, device) for x in v]
    if isinstance(v, tuple):
        return tuple(_resolve(x, env, device) for x in v)
    if isinstance(v, dict):
        return {k: _resolve(x, env, device) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(*(_resolve(x, env, device) for x in (v.start, v.stop, v.step)))
    return v


class BoundLoss:
    """One request's use of a ``CompiledLoss``: the engine calls ``prepare`` per datum, then
    ``self(lp, inputs, cfg)`` for its scalar loss; ``metrics()`` reduces the recorded metrics."""

    def __init__(self, loss: CompiledLoss, n_datums: int):
        self.loss = loss
        self._metrics: list[dict[str, float] | None] = [None] * n_datums
        self.meter = Meter(loss.limits, f"custom loss {loss.name!r}")

    def __call__(self, lp: torch.Tensor, inputs: dict[str, Any], cfg: dict) -> torch.Tensor:
        """Datum ``inputs["__index__"]``'s scalar loss.  Before each node runs, its output is
        predicted from its real inputs and checked against the loss's ``GraphLimits``, and the
        request's time budget is checked; CustomLossError names the datum, the node and the limit
        (or what the node raised)."""
        i = inputs["__index__"]
        env: dict[str, Any] = {"logprobs": lp}
        for iname, _ in self.loss.inputs[1:]:
            env[iname] = inputs[iname]
        who = f"custom loss {self.loss.name!r}, datum {i}"
        t0 = time.monotonic()
        try:
            self._evaluate(env, lp.device, who, t0)
        finally:
            self.meter.spent += time.monotonic() - t0
        loss = env[self.loss.loss_ref.name]
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CustomLossError(f"{who}: must return a scalar loss, got {shape}")
        out = {}
        for key, ref in self.loss.metric_refs.items():
            v = env[ref.name]
            out[key] = float(v.detach().reshape(()).item()) if isinstance(v, torch.Tensor) else float(v)
        self._metrics[i] = out
        return loss

    def _evaluate(self, env: dict[str, Any], device: torch.device, who: str, t0: float) -> None:
        """Run the graph's nodes into ``env`` (see ``__call__``); ``t0``: when this datum's
        evaluation started (time budget)."""
        meter = self.meter
        for node in self.loss.nodes:
            if node.op == "placeholder":
                continue
            args = _resolve(node.args, env, device)
            kwargs = _resolve(node.kwargs, env, device)
            where = f"{who}, node {node.name} ({node.target})"
            try:
                meter.check_time(t0)
                if node.fn is None:  # compile_graph resolves every node
                    raise CustomLossError(f"{node.op} {node.target!r} was not resolved")
                try:
                    predicted = predict(node.target, node.fn, args, kwargs, self.loss.limits, where)
                except GraphLimitError:
                    raise
                except Exception:  # not predictable: the real call raises, or is checked after it ran
                    predicted = None
                if predicted is not None:
                    meter.add(predicted, where)
                value = node.fn(*args, **kwargs)
                if predicted is None:
                    meter.add(value, where)
            except GraphLimitError as e:
                raise CustomLossError(str(e)) from None
            except CustomLossError as e:
                raise CustomLossError(f"{who}, node {node.name}: {e}") from None
            except Exception as e:
                raise CustomLossError(f"{where} failed: {type(e).__name__}: {e}") from None
            env[node.name] = value

    def prepare(
        self, i: int, raw_inputs: dict[str, np.ndarray], target: torch.Tensor, device: torch.device
    ) -> dict[str, Any]:
        """Datum ``i``'s inputs as tensors of their declared ranks (float32 / int64 as sent);
        CustomLossError naming the datum and the field otherwise."""
        out: dict[str, Any] = {"__index__": i}
        lp_rank = self.loss.inputs[0][1]
        if target.ndim != lp_rank:
            raise CustomLossError(
                f"datum {i}: target_tokens has rank {target.ndim}, but loss "
                f"{self.loss.name!r} declared logprobs with rank {lp_rank}"
            )
        for iname, rank in self.loss.inputs[1:]:
            if iname not in raw_inputs:
                raise CustomLossError(
                    f"datum {i} has no loss_fn_inputs[{iname!r}], which loss {self.loss.name!r} takes"
                )
            a = np.asarray(raw_inputs[iname])
            if rank == 0 and a.size == 1:
                a = a.reshape(())
            if a.ndim != rank:
                raise CustomLossError(
                    f"datum {i}: loss_fn_inputs[{iname!r}] has rank {a.ndim}, but loss "
                    f"{self.loss.name!r} declared it with rank {rank}"
                )
            if a.dtype.kind == "f":
                a = a.astype(np.float32, copy=False)
            elif a.dtype.kind in "iub":
                a = a.astype(np.int64, copy=False)
            out[iname] = torch.from_numpy(np.array(a, order="C")).to(device)  # keeps 0-d
        return out

    def metrics(self) -> dict[str, float]:
        """``:sum`` metrics summed over datums (in datum order), ``:mean`` ones averaged."""
        done = [m for m in self._metrics if m is not None]
        out: dict[str, float] = {}
        for key in self.loss.metric_refs:
            total = 0.0
            for m in done:
                total += m[key]
            out[key] = total / len(done) if key.endswith(":mean") and done else total
        return out
