"""Decisions: a model that outputs a probability distribution over N named choices.

The distribution is read from the next-token probabilities of the choice labels after the
prompt: with ``l_k`` the first token of choice ``k``'s name (as the assistant's reply would begin),

    p_k = exp(logprob(l_k | prompt)) / sum_j exp(logprob(l_j | prompt))      (renormalised over the N labels)

Records: a prompt (``prompt_field``: a string, or a list of messages ending with a user turn) and
either a hard label (``label_field``: one of the choice names) or soft labels (``probs_field``: a
``{choice: probability}`` object or a list of N probabilities summing to 1). The instruction
``Answer with one of: a, b, c.`` is appended to the last user turn.

Training (:func:`choice_loss`, run server-side as a custom loss): the cross-entropy
``-sum_k t_k log p_k`` between the target distribution ``t`` (one-hot for hard labels) and ``p``;
for soft labels this is the KL divergence ``KL(t || p)`` plus the (constant) entropy of ``t``, so
both train the same gradients. A datum is the prompt (P tokens) with rank-2 targets: every
position's target row is the N label tokens (P, N), and the weights (P, N) hold ``t`` in the last
row (the position that predicts the reply's first token) and zeros elsewhere.

Evaluation (:func:`decision_metrics`): accuracy (argmax of ``p`` = argmax of ``t``), the
multi-class Brier score ``sum_k (p_k - t_k)^2`` (Brier 1950; 0 perfect, 2 worst), the mean
negative log-likelihood, and the expected calibration error over ``n_bins`` equal-width confidence
bins (confidence = max_k p_k; Guo et al., "On Calibration of Modern Neural Networks", ICML 2017),
with :func:`reliability_bins` for the reliability diagram.

Source: the Tinker cookbook's ``decisions`` recipe (0.6.x) for the setting; written anew.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, Field, field_validator

from prefect_tinker.recipes.builders import BuiltData, DatasetBuilder
from prefect_tinker.recipes.data_reading import SkipStats, SourceSpec, iter_records
from prefect_tinker.recipes.data_sources import DatasetFormatError

__all__ = [
    "CHOICE_LOSS_RANKS",
    "DecisionBuilder",
    "DecisionData",
    "DecisionExample",
    "choice_loss",
    "choice_probs",
    "decision_datum",
    "decision_metrics",
    "label_tokens",
    "reliability_bins",
]

#: Ranks of :func:`choice_loss`'s inputs for ``ServiceClient.create_custom_loss``.
CHOICE_LOSS_RANKS = {"logprobs": 2, "weights": 2}


class DecisionExample(BaseModel):
    """One rendered prompt (P tokens), its target distribution over the choices (N,) and where
    the record came from."""

    prompt: list[int]
    target: list[float]
    source: str = ""


class DecisionData(BuiltData[DecisionExample, DecisionExample]):
    """Train and held-out examples, the choice names and their label tokens (N,)."""

    choices: list[str]
    label_tokens: list[int]


def label_tokens(tokenizer: Any, choices: Sequence[str]) -> list[int]:
    """The first token of each choice name (N,), as text encoded without special tokens.

    Raises:
        ValueError: a name that encodes to no token, or two names sharing their first token.
    """
    out = []
    for name in choices:
        ids = tokenizer.encode(name, add_special_tokens=False)
        if not ids:
            raise ValueError(f"choice {name!r} encodes to no token")
        out.append(int(ids[0]))
    seen: dict[int, str] = {}
    for name, tok in zip(choices, out, strict=True):
        if tok in seen:
            raise ValueError(
                f"choices {seen[tok]!r} and {name!r} begin with the same token ({tok}); "
                "rename one so that their first tokens differ"
            )
        seen[tok] = name
    return out


def decision_datum(example: DecisionExample, labels: Sequence[int]) -> Any:
    """The ``tinker.Datum`` of ``example`` (module docstring): model input (P,), target tokens
    (P, N) and weights (P, N) with the target distribution in the last row."""
    import tinker

    p, n = len(example.prompt), len(labels)
    targets = np.tile(np.asarray(labels, dtype=np.int64), (p, 1))
    weights = np.zeros((p, n), dtype=np.float32)
    weights[-1] = np.asarray(example.target, dtype=np.float32)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(list(example.prompt)),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(targets),
            "weights": tinker.TensorData.from_numpy(weights),
        },
    )


def choice_loss(logprobs, weights):
    """Per-datum loss for ``create_custom_loss`` (traced by torch.fx; ``CHOICE_LOSS_RANKS``):
    ``logprobs`` (P, N) of the label tokens, ``weights`` (P, N) with the target ``t`` in the last
    row. Returns the cross-entropy ``-sum_k t_k log p_k`` of the renormalised last row and the
    metrics ``custom/ce``, ``custom/kl`` (``KL(t || p)``), ``custom/brier``, ``custom/correct``
    (summed over datums)."""
    import torch

    lp, t = logprobs[-1], weights[-1]
    logq = lp - torch.logsumexp(lp, dim=-1)
    ce = -(t * logq).sum()
    kl = ce + torch.xlogy(t, t).sum()
    brier = ((logq.exp() - t) ** 2).sum()
    correct = (torch.argmax(logq) == torch.argmax(t)).float()
    return ce, {"custom/ce:sum": ce, "custom/kl:sum": kl, "custom/brier:sum": brier, "custom/correct:sum": correct}


def choice_probs(label_logprobs: Sequence[float] | np.ndarray) -> np.ndarray:
    """The choice distribution (N,) from the label tokens' logprobs (N,), renormalised."""
    lp = np.asarray(label_logprobs, dtype=np.float64)
    q = np.exp(lp - lp.max())
    return q / q.sum()


def reliability_bins(probs: np.ndarray, targets: np.ndarray, n_bins: int = 10) -> list[dict[str, float]]:
    """Equal-width confidence bins over [0, 1] of the predictions ``probs`` (D, N) against
    ``targets`` (D, N): per bin ``lo``, ``hi``, ``count``, ``confidence`` (mean max-probability)
    and ``accuracy`` (fraction whose argmax matches the target's); empty bins have count 0."""
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == targets.argmax(axis=1)).astype(np.float64)
    idx = np.minimum((conf * n_bins).astype(int), n_bins - 1)
    out = []
    for b in range(n_bins):
        sel = idx == b
        n = int(sel.sum())
        out.append(
            {
                "lo": b / n_bins,
                "hi": (b + 1) / n_bins,
                "count": float(n),
                "confidence": float(conf[sel].mean()) if n else math.nan,
                "accuracy": float(correct[sel].mean()) if n else math.nan,
            }
        )
    return out


def decision_metrics(probs: np.ndarray, targets: np.ndarray, n_bins: int = 10) -> dict[str, float]:
    """``accuracy``, ``brier`` (mean over D of ``sum_k (p_k - t_k)^2``), ``nll`` (mean
    ``-sum_k t_k log p_k``), ``ece`` (``sum_b count_b / D * |accuracy_b - confidence_b|``) and
    ``count`` of predictions ``probs`` (D, N) against targets ``targets`` (D, N).

    Raises:
        ValueError: shapes differ or D = 0.
    """
    if probs.shape != targets.shape or not len(probs):
        raise ValueError(f"probs {probs.shape} and targets {targets.shape} must be the same non-empty (D, N)")
    d = len(probs)
    ece = sum(
        b["count"] / d * abs(b["accuracy"] - b["confidence"])
        for b in reliability_bins(probs, targets, n_bins)
        if b["count"]
    )
    return {
        "accuracy": float((probs.argmax(1) == targets.argmax(1)).mean()),
        "brier": float(((probs - targets) ** 2).sum(1).mean()),
        "nll": float(-(targets * np.log(np.clip(probs, 1e-12, None))).sum(1).mean()),
        "ece": float(ece),
        "count": float(d),
    }


def _target(record: dict, choices: list[str], label_field: str, probs_field: str, where: str) -> list[float]:
    if probs_field in record:
        raw = record[probs_field]
        if isinstance(raw, dict):
            unknown = sorted(set(raw) - set(choices))
            if unknown:
                raise ValueError(f"{where}: field {probs_field!r}: unknown choice(s) {unknown} (choices: {choices})")
            raw = [raw.get(c, 0.0) for c in choices]
        if (
            not isinstance(raw, list)
            or len(raw) != len(choices)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in raw)
        ):
            raise ValueError(
                f"{where}: field {probs_field!r} must be {len(choices)} non-negative numbers or "
                f"{{choice: probability}}, got {record[probs_field]!r:.80}"
            )
        if abs(sum(raw) - 1.0) > 1e-3:
            raise ValueError(f"{where}: field {probs_field!r} sums to {sum(raw):.4f}, not 1")
        return [float(x) / sum(raw) for x in raw]
    if label_field not in record:
        raise ValueError(f"{where}: neither {label_field!r} nor {probs_field!r} (record has: {', '.join(record)})")
    label = record[label_field]
    if label not in choices:
        raise ValueError(f"{where}: field {label_field!r} = {label!r} is not one of the choices {choices}")
    return [1.0 if c == label else 0.0 for c in choices]


def _prompt(record: dict, field: str, where: str) -> list[dict]:
    if field not in record:
        raise ValueError(f"{where}: no field {field!r} (record has: {', '.join(record) or 'no fields'})")
    value = record[field]
    msgs = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs)
        or msgs[-1].get("role") != "user"
    ):
        raise ValueError(f"{where}: field {field!r} must be a string or messages ending with a user turn")
    return [dict(m) for m in msgs]


class DecisionBuilder(DatasetBuilder):
    """Decision records rendered with the run's renderer (module docstring)."""

    choices: list[str] = Field(min_length=2, description="The choice names (N >= 2).")
    prompt_field: str = "prompt"
    label_field: str = "label"
    probs_field: str = "probs"
    instruction: bool = True
    max_length: int = 512
    on_error: str = "raise"
    test_size: float | int = 0.2

    kind: ClassVar[str] = "decisions"

    @field_validator("choices")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not c.strip() for c in v):
            raise ValueError(f"choices must be distinct non-empty names, got {v}")
        return v

    def _records(self, spec: SourceSpec, stats: SkipStats):
        """``(where, messages, target)`` of each good record; a bad one raises (``on_error=raise``)
        or is counted."""
        for raw in iter_records(spec):
            try:
                if raw.error is not None:
                    raise ValueError(f"{raw.where}: {raw.error}")
                if not isinstance(raw.record, dict):
                    raise ValueError(f"{raw.where}: a record must be a JSON object")
                msgs = _prompt(raw.record, self.prompt_field, raw.where)
                target = _target(raw.record, self.choices, self.label_field, self.probs_field, raw.where)
            except ValueError as exc:
                if self.on_error == "raise":
                    raise DatasetFormatError(str(exc)) from None
                stats.skip("bad_record", str(exc))
                continue
            yield raw.where, msgs, target

    def _check_source(self, spec: SourceSpec) -> None:
        for _ in self._records(spec, SkipStats(keep=0)):
            pass

    def build(self, tokenizer: Any) -> DecisionData:
        from prefect_tinker.recipes.datasets import split_conversations
        from prefect_tinker.recipes.renderers import get_renderer

        rend = get_renderer(self.renderer, tokenizer)
        labels = label_tokens(tokenizer, self.choices)
        suffix = "\n\nAnswer with one of: " + ", ".join(self.choices) + "." if self.instruction else ""
        stats, out = SkipStats(), []
        for spec in self.sources:
            for where, msgs, target in self._records(spec, stats):
                msgs[-1]["content"] += suffix
                prompt = rend.build_generation_prompt(msgs).to_ints()
                if len(prompt) > self.max_length:
                    stats.skip("too_long", f"{where}: {len(prompt)} tokens, more than max_length={self.max_length}")
                    continue
                out.append(DecisionExample(prompt=prompt, target=target, source=where))
        if not out:
            raise DatasetFormatError(
                f"no usable record in {', '.join(s.path for s in self.sources)} ({stats.summary()})"
            )
        train, test = split_conversations(out, self.test_size, seed=self.seed) if self.test_size else (out, [])
        if not train:
            raise DatasetFormatError(f"no training record left after holding out test_size={self.test_size}")
        return DecisionData(
            fingerprint=self.fingerprint(),
            renderer=self.renderer,
            train=train,
            test=test,
            skipped=stats.total,
            skip_summary=stats.summary(),
            choices=list(self.choices),
            label_tokens=labels,
        )
