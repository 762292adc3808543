"""Reading the server's request logs (one JSONL file per session, ``--record-requests``) into what is
compared: the training stream (``forward_backward`` / ``optim_step`` with their step), the sampled
sequences in a canonical order, the last saved adapter; from the creation of the model that trains
on, optionally merged per optimizer step."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_sessions(folder: Path, sessions: list[str]) -> list[dict[str, Any]]:
    """The request-log entries of ``sessions`` (files ``folder/<session>.jsonl``), session after session."""
    out: list[dict[str, Any]] = []
    for s in sessions:
        out.extend(json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines() if line)
    return out


def training_stream(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``forward_backward`` and ``optim_step`` requests, in the order the server ran them,
    each with its step (optimizer steps before it)."""
    out, step = [], 0
    for e in entries:
        if e["op"] in ("forward_backward", "optim_step"):
            out.append({**e, "step": step})
            if e["op"] == "optim_step":
                step += 1
    return out


def sample_stream(entries: list[dict[str, Any]], include: Callable[[dict], bool]) -> list[dict[str, Any]]:
    """One entry per sampled sequence: (weights, prompt, parameters without the seed, what came
    back), in a canonical order (sorted), for the sample requests ``include`` accepts."""
    out = []
    for e in entries:
        if e["op"] != "sample" or not include(e):
            continue
        params = {k: v for k, v in e["sampling_params"].items() if k != "seed"}
        for s in e["sequences"]:
            out.append(
                {
                    "weights": e["weights"],
                    "prompt": e["prompt"],
                    "sampling_params": params,
                    "prompt_logprobs": e["prompt_logprobs"],
                    "tokens": s["tokens"],
                    "logprobs": s["logprobs"],
                    "prompt_logprobs_out": e.get("prompt_logprobs_out"),
                }
            )
    out.sort(key=lambda r: json.dumps([r["weights"], r["prompt"], r["sampling_params"], r["tokens"]]))
    return out


def final_adapter(entries: list[dict[str, Any]]) -> Path | None:
    saves = [e for e in entries if e["op"] in ("save_weights", "save_weights_for_sampler")]
    return Path(saves[-1]["path"]) / "adapter_model.safetensors" if saves else None


def from_training_start(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` from the creation of the model that trains (the one the first ``forward_backward``
    names) on: what a side asked before it (our distillation's teacher check: a probe
    ``compute_logprobs`` of the teacher) is a check before the run, not part of the recipe's requests."""
    model = next((e["model"] for e in entries if e["op"] == "forward_backward"), None)
    start = next((i for i, e in enumerate(entries) if e["op"] == "create_model" and e["model"] == model), 0)
    return entries[start:]


def by_optimizer_step(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``stream`` (see :func:`training_stream`) with each step's ``forward_backward`` requests merged
    into one: their datums in a canonical order (sorted), their ``loss:sum`` added, their count
    kept as ``requests``; then the step's ``optim_step``."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for e in stream:
        if e["op"] == "forward_backward":
            pending.append(e)
            continue
        if pending:
            datums = sorted((d for p in pending for d in p["datums"]), key=lambda d: json.dumps(d, sort_keys=True))
            loss = sum(p["metrics"].get("loss:sum", math.nan) for p in pending)
            first = pending[0]
            out.append({**first, "datums": datums, "metrics": {"loss:sum": loss}, "requests": len(pending)})
            pending = []
        out.append(e)
    return out
