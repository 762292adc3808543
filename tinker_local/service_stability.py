"""Stability information and provenance (``StabilityRecords``, a part of ``LocalService``): what SDK 0.38's
``record_stability_info`` sampling and ``Datum.with_provenance`` training requests rely on.

- A sampling request with ``record_stability_info: true`` (sampling clients made with
  ``record_stability_info=True``) records, per sampled sequence, its ``sequence_id``, the session of
  its sampling session, its prompt tokens, sampled tokens and their sampler logprobs
  (``StabilityRecord``).  Records are session-scoped and expire ``STABILITY_TTL_S`` (one day) after
  sampling; every training request that names a sequence restarts its day (Tinker docs,
  "StableReinforce", https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/).
  They live in memory: a server restart forgets them.
- A ``forward`` / ``forward_backward`` whose datums carry provenance (``model_input_spans`` tiling
  the input tokens, ``loss_fn_input_spans`` tiling ``target_tokens``; Tinker docs "Datum",
  https://tinker-docs.thinkingmachines.ai/tinker/datum/) is checked before it is queued: every span
  must name a recorded, unexpired sequence of the training model's own session, stay inside that
  sequence's prompt (``PromptProvenanceSpan``) or sampled tokens (``SampledProvenanceSpan``), carry
  exactly those tokens, and the lengths must tile their field.  Anything else is refused with HTTP
  400 naming the datum, the span and the value.  ``loss_fn="stable_reinforce"`` requires provenance.
  Every other loss leaves provenance unused, so a span naming a sequence that was not recorded
  (sampled without ``record_stability_info``) passes unchecked there, the lengths still tiling the
  field: tinker-cookbook 0.6.1's RL loop attaches provenance to every datum whose actions carry a
  ``sequence_id``, whatever its loss and sampler (``rl/data_processing.py: trajectory_to_data``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import HttpError
from .protocol import ProtocolError, tensor_from_proto
from .trace import session_of

STABILITY_TTL_S = 86400.0  # recorded sequences stay trainable one day after their last use


@dataclass
class StabilityRecord:
    """One sampled sequence recorded for training: ``session_id`` of its sampling session,
    ``prompt`` token ids (None when the prompt held media), sampled ``tokens`` and their sampler
    ``logprobs`` (float32, temperature 1), and ``expires_at`` (Unix seconds)."""

    session_id: str | None
    prompt: list[int] | None
    tokens: list[int]
    logprobs: np.ndarray
    expires_at: float


class StabilityRecords:
    """The recorded sequences of a ``LocalService`` (a part it creates in ``__init__``).

    Args:
        clock: the service's time source (Unix seconds; read at each use, so a moved clock counts).
        store: the service's ``FutureStore`` (a refused request's ``seq_id`` is consumed there).

    Attributes:
        records: ``sequence_id`` -> its ``StabilityRecord`` (expired ones are dropped when met).
        lock: guards ``records`` (sampling batches finish on several threads).
    """

    def __init__(self, clock: Callable[[], float], store: Any):
        self.clock = clock
        self.store = store
        self.records: dict[str, StabilityRecord] = {}
        self.lock = threading.Lock()

    def record(
        self, sampler_id: str | None, sequence_ids: list[str], prompt: Any, sequences: list[dict[str, Any]]
    ) -> None:
        """Record the sampled ``sequences`` of one request under their ``sequence_ids``."""
        records, lock = self.records, self.lock
        flat = [int(t) for t in prompt] if all(isinstance(t, (int, np.integer)) for t in prompt) else None
        now = float(self.clock())
        with lock:
            for expired in [k for k, r in records.items() if r.expires_at <= now]:
                del records[expired]
            for sid, seq in zip(sequence_ids, sequences, strict=True):
                records[sid] = StabilityRecord(
                    session_of(sampler_id) if sampler_id else None,
                    flat,
                    [int(t) for t in seq["tokens"]],
                    np.asarray(seq.get("logprobs") or [], dtype=np.float32),
                    now + STABILITY_TTL_S,
                )

    def get(self, sequence_id: str) -> StabilityRecord | None:
        """The unexpired record of ``sequence_id``, or None."""
        records, lock = self.records, self.lock
        with lock:
            rec = records.get(sequence_id)
            if rec is not None and rec.expires_at <= float(self.clock()):
                del records[sequence_id]
                rec = None
            return rec

    def check_provenance(self, msg: Any, model_id: str, session_id: str | None) -> None:
        """Validate the provenance of the datums of ``ForwardBackwardRequest`` ``msg`` (see the
        module docstring; datums without spans pass, except for ``stable_reinforce``) and restart
        the day of every sequence named.  Raises HttpError 400, with the model's ``seq_id``
        consumed (``FutureStore.burn``) so that its next request need not wait for it."""
        try:
            self._provenance(msg, session_id)
        except HttpError as e:
            if msg.seq_id:
                self.store.burn(model_id, int(msg.seq_id), e.detail)
            raise

    def _provenance(self, msg: Any, session_id: str | None) -> None:
        needed = msg.loss_fn == "stable_reinforce"
        if not any(len(d.model_input_spans) or len(d.loss_fn_input_spans) for d in msg.data):
            if needed:
                raise HttpError(
                    400,
                    "loss_fn 'stable_reinforce' needs provenance on every datum: build them with "
                    "Datum.with_provenance(model_input=[...], loss_fn_inputs=[...]) naming sequences "
                    "sampled with record_stability_info=True",
                )
            return
        used: dict[str, StabilityRecord] = {}
        for i, d in enumerate(msg.data):
            if not (len(d.model_input_spans) or len(d.loss_fn_input_spans)):
                if needed:
                    raise HttpError(400, f"stable_reinforce: datum {i} has no provenance (Datum.with_provenance)")
                continue
            tokens = np.concatenate(
                [
                    np.frombuffer(c.encoded_text.tokens, dtype=np.int32)
                    for c in d.model_input
                    if c.WhichOneof("chunk") == "encoded_text"
                ]
                or [np.zeros(0, np.int32)]
            )
            tgt = d.loss_fn_inputs.get("target_tokens")
            targets = None
            if tgt is not None and len(tgt.shape) == 1:
                try:
                    targets = tensor_from_proto(tgt, name="target_tokens")
                except ProtocolError as e:
                    raise HttpError(400, f"datum {i}: {e}") from e
            for field, values in (("model_input_spans", tokens), ("loss_fn_input_spans", targets)):
                self._spans(i, field, getattr(d, field), values, session_id, used, needed)
        now = float(self.clock())
        for rec in used.values():
            rec.expires_at = now + STABILITY_TTL_S

    def _spans(
        self,
        i: int,
        field: str,
        spans: Any,
        values: np.ndarray | None,
        session_id: str | None,
        used: dict[str, StabilityRecord],
        needed: bool = True,
    ) -> None:
        where = f"datum {i}: {field}"
        if values is None:
            raise HttpError(400, f"{where}: provenance needs a 1-D target_tokens to tile")
        pos = 0
        for j, span in enumerate(spans):
            kind = span.WhichOneof("span")
            if kind not in ("prompt_tokens", "sampled_tokens"):
                raise HttpError(400, f"{where}[{j}]: empty provenance span")
            s = getattr(span, kind)
            sid, off, n = s.sequence_id, int(s.offset), int(s.length)
            rec = used.get(sid) or self.get(sid)
            if rec is None and not needed:  # provenance unused by this loss: not recorded, not checked
                if off < 0 or n < 0 or pos + n > len(values):
                    raise HttpError(400, f"{where}[{j}]: span offset {off} length {n} does not fit the field")
                pos += n
                continue
            if rec is None:
                raise HttpError(
                    400,
                    f"{where}[{j}]: sequence_id {sid!r} is unknown or expired: provenance must "
                    "name a sequence sampled in this session with record_stability_info=True "
                    "within the last day",
                )
            if rec.session_id != session_id:
                raise HttpError(
                    400,
                    f"{where}[{j}]: sequence_id {sid!r} was sampled in session "
                    f"{rec.session_id!r}, not in this model's session {session_id!r}",
                )
            source = rec.prompt if kind == "prompt_tokens" else rec.tokens
            what = "prompt" if kind == "prompt_tokens" else "sampled tokens"
            if source is None:
                raise HttpError(
                    400,
                    f"{where}[{j}]: the prompt of sequence {sid!r} held media; name its text "
                    "tokens with sampled spans only",
                )
            if off < 0 or n < 0 or off + n > len(source):
                raise HttpError(
                    400,
                    f"{where}[{j}]: span offset {off} length {n} runs past the {len(source)} "
                    f"{what} of sequence {sid!r}",
                )
            if pos + n > len(values):
                raise HttpError(
                    400,
                    f"{where}: span lengths sum past the field's {len(values)} positions "
                    "(the runs must tile it exactly)",
                )
            if list(values[pos : pos + n]) != source[off : off + n]:
                raise HttpError(
                    400,
                    f"{where}[{j}]: tokens at positions {pos}..{pos + n - 1} differ from the "
                    f"{what} {off}..{off + n - 1} of sequence {sid!r}",
                )
            used[sid] = rec
            pos += n
        if pos != len(values):
            raise HttpError(
                400,
                f"{where}: spans cover {pos} positions but the field has {len(values)} (the runs must tile it exactly)",
            )
