"""Comparing what two sessions sent (the cookbook's and ours): the training requests step by step, the
sampled sequences, the loss of every step and the final LoRA weights (integers exact, floats within a
relative tolerance) into a :class:`Comparison`, and its report (:func:`table`, :func:`summary`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .requests import by_optimizer_step, final_adapter, from_training_start, sample_stream, training_stream


@dataclass
class Difference:
    where: str
    field: str
    cookbook: Any
    ours: Any

    def __str__(self) -> str:
        return f"{self.where}, {self.field}: cookbook {_short(self.cookbook)} vs ours {_short(self.ours)}"


def _short(v: Any, n: int = 80) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


@dataclass
class Comparison:
    recipe: str
    model: str
    requests: int = 0
    sequences: int = 0
    first: Difference | None = None
    max_float_rel: float = 0.0
    max_loss_rel: float = 0.0
    max_weight_abs: float | None = None
    steps: int = 0
    notes: list[str] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)

    def differ(self, d: Difference) -> None:
        if self.first is None:
            self.first = d

    def identical(self, rtol: float) -> bool:
        return (
            self.first is None
            and self.max_loss_rel <= rtol
            and (self.max_weight_abs is not None and self.max_weight_abs <= rtol)
        )


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_values(cmp: Comparison, where: str, name: str, a: Any, b: Any, rtol: float) -> None:
    """Integers and strings exact, floats within ``rtol`` (relative, with an absolute floor of
    ``rtol`` for values near 0); lists element by element."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                cmp.differ(Difference(where, f"{name}.{k}", a.get(k, "<absent>"), b.get(k, "<absent>")))
                continue
            compare_values(cmp, where, f"{name}.{k}", a[k], b[k], rtol)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            cmp.differ(Difference(where, f"{name} (length)", len(a), len(b)))
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if isinstance(x, (list, dict)):
                compare_values(cmp, where, f"{name}[{i}]", x, y, rtol)
            elif isinstance(x, float) or isinstance(y, float):
                if x is None or y is None:
                    if x is not y:
                        cmp.differ(Difference(where, f"{name}[{i}]", x, y))
                    continue
                r = _rel(float(x), float(y))
                if abs(float(x) - float(y)) <= rtol * 1e-3:  # both ~0
                    r = 0.0
                cmp.max_float_rel = max(cmp.max_float_rel, r)
                if r > rtol:
                    cmp.differ(Difference(where, f"{name}[{i}]", x, y))
            elif x != y:
                cmp.differ(Difference(where, f"{name}[{i}]", x, y))
        return
    if isinstance(a, float) or isinstance(b, float):
        r = _rel(float(a), float(b)) if a is not None and b is not None else (0.0 if a is b else math.inf)
        cmp.max_float_rel = max(cmp.max_float_rel, r)
        if r > rtol:
            cmp.differ(Difference(where, name, a, b))
    elif a != b:
        cmp.differ(Difference(where, name, a, b))


def compare(
    recipe: str,
    model: str,
    cb: list[dict],
    ours: list[dict],
    rtol: float,
    samples: Callable[[dict], bool] | None,
    sample_fields: tuple[str, ...] | None = None,
    by_step: bool = False,
) -> Comparison:
    cmp = Comparison(recipe, model)
    cb, ours = from_training_start(cb), from_training_start(ours)
    ta, tb = training_stream(cb), training_stream(ours)
    if by_step:
        ta, tb = by_optimizer_step(ta), by_optimizer_step(tb)
    cmp.steps = sum(e["op"] == "optim_step" for e in ta)
    if len(ta) != len(tb):
        cmp.differ(Difference("training requests", "count", len(ta), len(tb)))
    for k, (a, b) in enumerate(zip(ta, tb, strict=False)):
        where = f"step {a['step']}, request {k} ({a['op']})"
        cmp.requests += 1
        if a["op"] != b["op"]:
            cmp.differ(Difference(where, "op", a["op"], b["op"]))
            break
        if a["op"] == "optim_step":
            compare_values(cmp, where, "adam_params", a["adam_params"], b["adam_params"], rtol)
            continue
        for f in ("loss_fn", "loss_fn_config", "requests"):
            if f in a or f in b:
                compare_values(cmp, where, f, a.get(f), b.get(f), rtol)
        if len(a["datums"]) != len(b["datums"]):
            cmp.differ(Difference(where, "datums (count)", len(a["datums"]), len(b["datums"])))
        for d, (x, y) in enumerate(zip(a["datums"], b["datums"], strict=False)):
            compare_values(cmp, f"{where}, datum {d}", "model_input", x["model_input"], y["model_input"], rtol)
            compare_values(cmp, f"{where}, datum {d}", "loss_fn_inputs", x["loss_fn_inputs"], y["loss_fn_inputs"], rtol)
        la, lb = a["metrics"].get("loss:sum", math.nan), b["metrics"].get("loss:sum", math.nan)
        cmp.losses.append((la, lb))
        cmp.max_loss_rel = max(cmp.max_loss_rel, _rel(la, lb))
    if samples is not None:
        sa, sb = sample_stream(cb, samples), sample_stream(ours, samples)
        if len(sa) != len(sb):
            cmp.differ(Difference("sampled sequences", "count", len(sa), len(sb)))
        for k, (a, b) in enumerate(zip(sa, sb, strict=False)):
            cmp.sequences += 1
            if sample_fields is not None:
                a, b = ({f: x[f] for f in sample_fields} for x in (a, b))
            compare_values(cmp, f"sampled sequence {k}", "sequence", a, b, rtol)
    fa, fb = final_adapter(cb), final_adapter(ours)
    if fa is None or fb is None:
        cmp.notes.append(f"final weights: a side saved none (cookbook {fa}, ours {fb})")
    else:
        cmp.max_weight_abs = max_weight_difference(fa, fb)
    return cmp


def max_weight_difference(a: Path, b: Path) -> float:
    """Largest |a - b| over the LoRA tensors of two adapter files (inf when their names or shapes
    differ)."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if set(x) != set(y) or any(x[k].shape != y[k].shape for k in x):
        return math.inf
    return max((float(abs(x[k].astype("float64") - y[k].astype("float64")).max()) for k in x), default=0.0)


def table(cmp: Comparison, rtol: float) -> str:
    rows = [
        ("recipe", cmp.recipe),
        ("model", cmp.model),
        ("optimizer steps", str(cmp.steps)),
        ("training requests compared", str(cmp.requests)),
        ("sampled sequences compared", str(cmp.sequences)),
        ("first difference", str(cmp.first) if cmp.first else "none (identical)"),
        ("largest float difference (relative)", f"{cmp.max_float_rel:.3g}"),
        ("largest per-step loss difference (relative)", f"{cmp.max_loss_rel:.3g}"),
        ("largest final LoRA weight difference", "n/a" if cmp.max_weight_abs is None else f"{cmp.max_weight_abs:.3g}"),
        ("verdict", "IDENTICAL" if cmp.identical(rtol) else "DIFFERENT"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(w)}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in cmp.notes]
    if cmp.losses:
        pairs = ", ".join(f"{a:.6g}/{b:.6g}" for a, b in cmp.losses[:8])
        lines.append(f"  loss:sum of the first steps (cookbook/ours): {pairs}")
    return "\n".join(lines)


def summary(cmp: Comparison, rtol: float) -> str:
    verdict = "identical" if cmp.identical(rtol) else f"DIFFERENT ({cmp.first or 'tolerance'})"
    w = "n/a" if cmp.max_weight_abs is None else f"{cmp.max_weight_abs:.2g}"
    return (
        f"{cmp.recipe} [{cmp.model}]: {cmp.requests} requests + {cmp.sequences} sequences, {cmp.steps} steps, "
        f"max loss diff {cmp.max_loss_rel:.2g}, max weight diff {w}: {verdict}"
    )
