"""A student's completion as the teacher must read it, and which positions correspond.

The teacher scores the student's completion **in its own format**: its prompt is the teacher
renderer's generation prompt of the teacher's messages (:class:`~.prompts.TeacherView`), never the
student's rendering (the Tinker cookbook's issue #796: a chat teacher fed the student's
``role_colon`` text gives biased logprobs). The completion tokens themselves are re-used (student
and teacher must share the tokenizer: :func:`tokenizer_fingerprint`):

- same renderer: ``teacher tokens = teacher prompt + completion``; every completion token
  corresponds to one teacher token;
- different renderers: the student's end-of-turn marker is its format, not its answer, so it is
  replaced by the teacher's (:func:`split_reply`, :func:`end_marker`): ``teacher tokens = teacher
  prompt + body + teacher end marker``. Body tokens correspond one to one; the student's first
  end token corresponds to the teacher's whole end marker (the teacher's log-probability of
  ending the turn there), its other end tokens to nothing (they get no teacher signal). A
  truncated completion (no end marker) keeps all its tokens as body.

Positions are *target* indices: target ``i`` of a sequence ``s`` is the prediction of ``s[i+1]``
from ``s[:i+1]`` (datum convention: ``model_input = s[:-1]``, ``target_tokens = s[1:]``); the
logprobs of ``compute_logprobs(s)[1:]`` and the top-K rows ``topk_prompt_logprobs[1:]`` are
indexed the same way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Alignment", "align_completion", "end_marker", "gather_teacher", "split_reply", "tokenizer_fingerprint"]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """``sha256:<hex>`` of a tokenizer's vocabulary (token -> id, added tokens included): two
    tokenizers with the same fingerprint encode and decode every id alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return "sha256:" + hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _stop_ids(renderer: Any) -> tuple[list[int], list[str]]:
    stops = list(renderer.get_stop_sequences())
    return [int(s) for s in stops if isinstance(s, (int, np.integer))], [s for s in stops if isinstance(s, str)]


def end_marker(renderer: Any) -> list[int]:
    """The tokens ``renderer`` ends an assistant turn with: its first stop token id, else its
    first stop string encoded as markup (``role_colon``: ``"\\n\\nUser:"``)."""
    ids, strings = _stop_ids(renderer)
    if ids:
        return [ids[0]]
    return list(renderer.encode(strings[0]))


def split_reply(renderer: Any, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(body, end)`` of sampled reply ``tokens``: ``end`` is the end-of-turn marker the reply
    stopped with (the first stop token or EOS; for stop strings the shortest run of final tokens
    whose text contains the stop string), ``[]`` when it has none (truncated); ``body + end`` is
    the reply up to and including the marker."""
    tokens = [int(t) for t in tokens]
    ids, strings = _stop_ids(renderer)
    ends = set(ids) | set(renderer.eos_token_ids())
    first_id = next((i for i, t in enumerate(tokens) if t in ends), None)
    limit = len(tokens) if first_id is None else first_id
    if strings:
        decode = renderer.tokenizer.decode
        window = 4 * max(len(s) for s in strings) + 4
        for j in range(1, limit + 1):
            lo = max(0, j - window)
            if any(s in decode(tokens[lo:j]) for s in strings):
                start = next(s for s in range(j - 1, lo - 1, -1) if any(x in decode(tokens[s:j]) for x in strings))
                return tokens[:start], tokens[start:j]
    if first_id is not None:
        return tokens[:first_id], [tokens[first_id]]
    return tokens, []


@dataclass
class Alignment:
    """The teacher's sequence for one student completion and the position map.

    Attributes:
        teacher_tokens: what the teacher scores (L_t,).
        pairs: ``(student target index, (teacher target indices ...))`` for every completion token
            that has a teacher counterpart; the teacher logprob of a student target is the sum
            over its teacher targets.
        teacher_prompt_len: tokens of the teacher's prompt.
    """

    teacher_tokens: list[int]
    pairs: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    teacher_prompt_len: int = 0

    def one_to_one(self) -> list[tuple[int, int]]:
        """The pairs whose student target has exactly one teacher target (top-K positions)."""
        return [(s, t[0]) for s, t in self.pairs if len(t) == 1]


def align_completion(
    student_prompt_len: int,
    completion: Sequence[int],
    teacher_prompt: Sequence[int],
    *,
    student_renderer: Any,
    teacher_renderer: Any,
    same_format: bool,
) -> Alignment:
    """Frame ``completion`` (sampled after ``student_prompt_len`` prompt tokens) for the teacher
    (see the module docstring).

    Args:
        student_prompt_len: P_s, tokens of the student's prompt (its first completion token is
            target ``P_s - 1``).
        completion: the student's completion tokens (C,).
        teacher_prompt: the teacher renderer's generation prompt of the teacher's messages (P_t,).
        same_format: student and teacher render alike (same renderer name): every completion
            token is re-used as it is.

    Raises:
        ValueError: an empty prompt.
    """
    if student_prompt_len < 1 or not teacher_prompt:
        raise ValueError("student and teacher prompts must have at least one token")
    completion, teacher_prompt = [int(t) for t in completion], [int(t) for t in teacher_prompt]
    s0, t0 = student_prompt_len - 1, len(teacher_prompt) - 1
    pairs: list[tuple[int, tuple[int, ...]]]
    if same_format:
        pairs = [(s0 + k, (t0 + k,)) for k in range(len(completion))]
        return Alignment(teacher_prompt + completion, pairs, len(teacher_prompt))
    body, end = split_reply(student_renderer, completion)
    pairs = [(s0 + k, (t0 + k,)) for k in range(len(body))]
    tokens = teacher_prompt + body
    if end:
        marker = end_marker(teacher_renderer)
        pairs.append((s0 + len(body), tuple(t0 + len(body) + j for j in range(len(marker)))))
        tokens += marker
    return Alignment(tokens, pairs, len(teacher_prompt))


def gather_teacher(
    alignment: Alignment, teacher_logprobs: Sequence[float], n_targets: int
) -> tuple[np.ndarray, np.ndarray]:
    """Teacher logprobs on the student's targets.

    Args:
        teacher_logprobs: the teacher's logprobs of its targets (L_t - 1,), nats.
        n_targets: the student datum's target count N.

    Returns:
        ``(values, mask)``, float64 (N,): the summed teacher logprob of each aligned student
        target, and 1.0 where a target is aligned.

    Raises:
        ValueError: ``teacher_logprobs`` does not cover the alignment, or a pair lies outside N.
    """
    lp = np.asarray(teacher_logprobs, dtype=np.float64)
    if lp.shape != (len(alignment.teacher_tokens) - 1,):
        raise ValueError(f"teacher logprobs have shape {lp.shape}, expected ({len(alignment.teacher_tokens) - 1},)")
    values, mask = np.zeros(n_targets), np.zeros(n_targets)
    for s, ts in alignment.pairs:
        if not 0 <= s < n_targets:
            raise ValueError(f"student target {s} outside the datum's {n_targets} targets")
        values[s], mask[s] = float(lp[list(ts)].sum()), 1.0
    return values, mask
