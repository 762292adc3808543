"""Opt-in record of every request's full payload, by session, and content-derived sampling seeds.

``serve --record-requests DIR`` writes one JSON Lines file per session, ``DIR/<session id>.jsonl``,
one line per request in the order the server ran it (for one training model that is its seq_id
order).  Unlike the timeline of ``tinker_local.trace`` (times and counts), a line holds what was
asked and what came back, so two programs can be compared request by request
(``benchmarks/cookbook_parity.py``):

- ``{"op": "create_model", "model", "base_model", "lora_rank", "seed"}`` (``seed``: the LoRA
  initialisation seed used, after ``--lora-seed``);
- ``{"op": "forward_backward" | "forward", "model", "seq_id", "loss_fn", "loss_fn_config",
  "datums": [{"model_input": [token ids], "loss_fn_inputs": {name: {"shape", "data"}}}],
  "metrics", "logprobs": [[...] per datum]}`` (``data`` flattened row-major, float32 values as
  Python floats, exact);
- ``{"op": "optim_step", "model", "seq_id", "adam_params": {learning_rate, beta1, ...}, "metrics"}``;
- ``{"op": "save_weights" | "save_weights_for_sampler", "model", "name", "path"}`` (``path``: the
  folder on this server's disk);
- ``{"op": "sample", "sampler", "weights", "prompt", "num_samples", "sampling_params",
  "prompt_logprobs", "seeds", "sequences": [{"tokens", "logprobs", "stop_reason"}],
  "prompt_logprobs_out"}`` (``weights``: the identity of the sampled weights, see
  :func:`weights_identity`; ``seeds``: the seed each sequence was drawn with).

Content-derived sampling seeds (``serve --sampling-seed content``): a sample request's
sequences are drawn one by one, sequence ``i`` with seed :func:`content_seed` of (prompt tokens,
sampling parameters except the seed, weights identity, occurrence), where the occurrence counts
earlier sequences of the same session with the same content.  Two programs that ask the same
thing in the same order therefore get the same completions, whether they ask for ``n`` samples
in one request or in ``n`` requests of one, and whatever seeds they pass; a difference in what is
asked still changes what comes back.  Each sequence is then drawn alone (a batch of one, prompt
logprobs included), since the shape of a batch changes float results in their last bits: what a
request gets back does not depend on which other requests the server served with it.  The requests
of one sampling session are admitted in ``seq_id`` order (:class:`SeqOrder`), so occurrences count
in the order the client made its requests, not the order concurrent HTTP requests happened to
arrive in (the cookbook samples a group's members as concurrent requests of one sample each).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .datatypes import Datum
    from .protocol import WireDatum

__all__ = [
    "RequestLog",
    "ContentSeeds",
    "SeqOrder",
    "content_key",
    "content_seed",
    "weights_identity",
    "datum_record",
]


def _array(a: Any) -> dict[str, Any]:
    arr = np.asarray(a)
    return {"shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def datum_record(datum: Datum | WireDatum) -> dict[str, Any]:
    """One engine datum (``tokens``, ``inputs``, optional ``chunks``) as JSON-ready data; media
    chunks appear as ``{"media": kind, "sha256": ...}`` in ``model_input``."""
    if datum.chunks:
        model_input: list[Any] = []
        for c in datum.chunks:
            if isinstance(c, list):
                model_input.extend(int(t) for t in c)
            else:
                model_input.append({"media": c.kind, "sha256": hashlib.sha256(c.data).hexdigest()})
    else:
        model_input = [int(t) for t in datum.tokens]
    return {
        "model_input": model_input,
        "loss_fn_inputs": {k: _array(v) for k, v in sorted(datum.inputs.items())},
    }


class RequestLog:
    """Thread-safe JSON Lines writer, one file per session under ``folder`` (created)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder).expanduser().resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, session_id: str) -> Path:
        """The file of ``session_id``."""
        return self.folder / f"{session_id.replace('/', '_')}.jsonl"

    def write(self, session_id: str | None, entry: dict[str, Any]) -> None:
        """Append ``entry`` to the session's file (no-op without a session)."""
        if not session_id:
            return
        line = json.dumps(entry, default=_jsonable) + "\n"
        with self._lock, self.path(session_id).open("a") as f:
            f.write(line)


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, Path):
        return str(v)
    return repr(v)


_IDENTITY_CACHE: dict[tuple[str, int], str] = {}
_IDENTITY_LOCK = threading.Lock()


def weights_identity(base_model: str, weights_path: Path | str | None) -> str:
    """What sampled weights are, independent of where they are stored: ``base:<model>`` for the
    base model alone, else ``sha256:<hex>`` over the base model name and the adapter's tensors
    (names, dtypes, shapes, bytes, in name order) of ``weights_path/adapter_model.safetensors``.
    Two runs whose adapters are bit-equal get the same identity.  Cached by (path, mtime)."""
    if weights_path is None:
        return f"base:{base_model}"
    f = Path(weights_path) / "adapter_model.safetensors"
    key = (str(f.resolve()), f.stat().st_mtime_ns)
    with _IDENTITY_LOCK:
        hit = _IDENTITY_CACHE.get(key)
    if hit is not None:
        return hit
    from safetensors.numpy import load_file

    h = hashlib.sha256(base_model.encode())
    tensors = load_file(str(f))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{t.shape}".encode())
        h.update(np.ascontiguousarray(t).tobytes())
    out = "sha256:" + h.hexdigest()
    with _IDENTITY_LOCK:
        _IDENTITY_CACHE[key] = out
    return out


def content_key(prompt: Any, params: dict[str, Any], weights: str) -> str:
    """Hex digest of what a sample request asks: prompt tokens (media chunks by content hash),
    sampling parameters (without ``seed``) and the weights identity."""
    body = {
        "prompt": [c if isinstance(c, int) else repr(c) for c in prompt],
        "params": {k: params[k] for k in sorted(params) if k != "seed"},
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()


def content_seed(key: str, occurrence: int) -> int:
    """The 63-bit seed of the ``occurrence``-th sequence (0-based) with content ``key``."""
    return int.from_bytes(hashlib.sha256(f"{key}:{occurrence}".encode()).digest()[:8], "big") >> 1


#: The SDK numbers a sampling client's requests from a multiple of this (its clone block; 0 for
#: the client that created the session).
SEQ_BLOCK = 1_000_000_000


class SeqOrder:
    """Admits the sample requests of each sampling session in ``seq_id`` order (asyncio, on the
    server's event loop): a request whose predecessor has not arrived waits for it, at most
    ``timeout_s`` seconds (a request the client never sent must not stall the session), then goes
    on.  A session's first expected ``seq_id`` is the start of the SDK's block the first request
    falls in (:data:`SEQ_BLOCK`)."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._next: dict[str, int] = {}
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def admit(self, session: str, seq: int) -> None:
        """Wait until every earlier ``seq_id`` of ``session`` was admitted (or the timeout)."""
        cond = self._condition()
        async with cond:
            self._next.setdefault(session, seq - seq % SEQ_BLOCK)
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._next[session] >= seq), self.timeout_s)
            except TimeoutError:
                pass

    async def done(self, session: str, seq: int) -> None:
        """``seq`` of ``session`` is queued: let its successor in."""
        cond = self._condition()
        async with cond:
            self._next[session] = max(self._next.get(session, 0), seq + 1)
            cond.notify_all()


class ContentSeeds:
    """Occurrence counters by (session, content key); ``take(session, key, n)`` returns the seeds
    of the next ``n`` sequences. ``order`` admits each sampling session's requests in ``seq_id``
    order (:class:`SeqOrder`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self.order = SeqOrder()

    def take(self, session_id: str, key: str, n: int) -> list[int]:
        with self._lock:
            start = self._counts.get((session_id, key), 0)
            self._counts[(session_id, key)] = start + n
        return [content_seed(key, start + i) for i in range(n)]
