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

This module validates an upload into a ``CompiledLoss`` (``compile_graph``, with a probe at upload)
and runs it for one request (``BoundLoss``).  What a graph may call: ``tinker_local.loss_allowlist``;
how its arguments are encoded: ``tinker_local.loss_args``; the bounds on its work and
``CustomLossError``: ``tinker_local.loss_limits``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .loss_allowlist import ALLOWED_FUNCTIONS, TENSOR_ATTRS, TENSOR_METHODS, safe_getattr, tensor_method
from .loss_args import Ref, decode_arg, refs, resolve
from .loss_limits import PROBE_K, PROBE_T, CustomLossError, GraphLimitError, GraphLimits, Meter, predict

MAX_INPUTS = 16
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_INPUT_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")
_METRIC_KEY = re.compile(r"^custom/[a-z0-9_./-]{1,64}:(sum|mean)$")


@dataclass
class _Node:
    op: str
    name: str
    target: str
    fn: Callable[..., Any] | None
    args: tuple
    kwargs: dict


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
        if set(refs([node.args, node.kwargs])) & unknown or node.fn is None:
            unknown.add(node.name)
            continue
        where = f"custom loss {loss.name!r}, node {node.name} ({node.target})"
        try:
            value = predict(
                node.target,
                node.fn,
                resolve(node.args, env, meta),
                resolve(node.kwargs, env, meta),
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
        args = tuple(decode_arg(where, a) for a in (nd.get("args") or []))
        kwargs = {str(key): decode_arg(where, a) for key, a in (nd.get("kwargs") or {}).items()}
        for ref in refs([args, kwargs]):
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
            if fn is safe_getattr and (len(args) != 2 or args[1] not in TENSOR_ATTRS):
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
            fn = tensor_method(target)
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
            args = resolve(node.args, env, device)
            kwargs = resolve(node.kwargs, env, device)
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
