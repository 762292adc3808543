"""Validation and batching of engine inputs (datums, token lists, names)."""

from __future__ import annotations

import re

import numpy as np
import torch

from .errors import EngineUserError
from .losses import REQUIRED_INPUTS, SCALAR_OK

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,199}$")


def check_name(what: str, value) -> None:
    """Names that become path components (model ids, checkpoint names): ``[A-Za-z0-9][A-Za-z0-9._-]*``,
    at most 200 characters, no ``..``; EngineUserError otherwise."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise EngineUserError(
            f"{what} {value!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (no '..', at most 200 characters)"
        )


def check_tokens(what: str, tokens, vocab_size: int, max_context: int, model: str) -> list[int]:
    """Return ``tokens`` as a list of ints; EngineUserError if empty, longer than
    ``max_context``, or holding an id outside ``[0, vocab_size)`` (the message names it)."""
    try:
        toks = [int(t) for t in tokens]
    except (TypeError, ValueError) as e:
        raise EngineUserError(f"{what} must be a list of integer token ids ({e})") from e
    if not toks:
        raise EngineUserError(f"{what} is empty")
    if len(toks) > max_context:
        raise EngineUserError(f"{what} has {len(toks)} tokens, longer than the context of {model!r} ({max_context})")
    lo, hi = min(toks), max(toks)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise EngineUserError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size}) of {model!r}")
    return toks


def check_datum(
    i: int, tokens, inputs: dict, loss_fn: str, vocab_size: int, max_context: int, model: str, device: torch.device
):
    """Validate datum ``i`` and convert it: returns ``(tokens list (N,), target_tokens int64
    tensor (N,) or (N, K) on CPU, {input name: float32 tensor on device})``.  Every loss input
    must be shaped like target_tokens (clip thresholds may be scalars).  Raises EngineUserError
    naming the datum, the field and the value."""
    toks = check_tokens(f"datum {i}: model_input", tokens, vocab_size, max_context, model)
    n = len(toks)
    inputs = inputs or {}
    if "target_tokens" not in inputs:
        raise EngineUserError(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
    tgt = np.asarray(inputs["target_tokens"])
    if tgt.ndim not in (1, 2) or tgt.shape[0] != n or tgt.dtype.kind not in "iu":
        raise EngineUserError(
            f"datum {i}: target_tokens must be integer (N,) or (N, K) with N = "
            f"{n} (model input length), got {tgt.dtype} {tgt.shape}"
        )
    if tgt.size and (tgt.min() < 0 or tgt.max() >= vocab_size):
        bad = int(tgt.min()) if tgt.min() < 0 else int(tgt.max())
        raise EngineUserError(
            f"datum {i}: target token id {bad} is outside the vocabulary [0, {vocab_size}) of {model!r}"
        )
    out = {}
    for k, v in inputs.items():
        if k == "target_tokens":
            continue
        try:
            a = np.asarray(v, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise EngineUserError(f"datum {i}: loss_fn_inputs[{k!r}] is not numeric ({e})") from e
        if k in SCALAR_OK and a.size == 1:
            out[k] = torch.tensor(float(a.reshape(())), device=device)
            continue
        if a.shape != tgt.shape:
            raise EngineUserError(
                f"datum {i}: loss_fn_inputs[{k!r}] has shape {a.shape}, expected {tgt.shape} (like target_tokens)"
            )
        if not np.isfinite(a).all():
            raise EngineUserError(f"datum {i}: loss_fn_inputs[{k!r}] contains NaN or inf")
        out[k] = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    for k in REQUIRED_INPUTS.get(loss_fn, ()):
        if k not in out:
            raise EngineUserError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{k!r}]")
    return toks, torch.from_numpy(tgt.astype(np.int64)), out


def microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group indices of ``lengths`` (longest first) so that each group's
    ``len(group) * max_length <= budget`` tokens (a single longer item gets its own group)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        groups.append(cur)
    return groups
