"""Preference comparisons: reading them, rendering them into datum pairs, and the DPO family of
losses.

Records (JSONL, gzipped JSONL, local dataset files or a Hugging Face dataset id), by ``format``:

- ``preference`` (default): ``{"prompt": messages | text, "chosen": ..., "rejected": ...}`` where
  chosen/rejected are a reply text, an assistant message or a list of messages; or
  ``{"chosen": messages, "rejected": messages}`` (no prompt) sharing a prefix;
- ``dialogue`` (``hh``): HH-RLHF transcripts ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` in
  ``chosen`` and ``rejected``.

Field names are mapped with ``fields`` (``{"prompt": "question", "chosen": "answers.good"}``).
A comparison is the shared prompt (the messages both continuations share) and the two final
assistant replies; a pair whose continuations differ before the last assistant turn is dropped
and counted (``differs_before_last_turn``), as are identical pairs (``identical``), empty replies
(``empty_reply``) and pairs longer than ``max_length`` (``too_long``: truncating one reply would
bias its log-probability). Malformed records (missing field, wrong type) raise
:class:`~prefect_tinker.recipes.data_sources.DatasetFormatError` naming file, line and field, or are
counted with ``on_error="skip"``.

Losses (:class:`DPOLoss`), with ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``
over each pair's reply tokens (sequence log-probabilities are weighted sums, not length-normalised):

- ``dpo``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` (Rafailov et al. 2023,
  "Direct Preference Optimization"; ``eps`` = ``label_smoothing``: conservative DPO, Mitchell 2023);
- ``ipo``: ``(h - 1 / (2 beta))^2`` (Azar et al. 2023, "A General Theoretical Paradigm to
  Understand Learning from Human Preferences");
- ``hinge``: ``max(0, 1 - beta h)`` (SLiC-HF, Zhao et al. 2023).

The loss is the mean over pairs. The variants are a registry, :data:`DPO_LOSSES` (entry-point group
``prefect_tinker.dpo_losses``; :func:`register_dpo_loss`): a variant is a :class:`DPOVariant`,
``variant(h, beta, label_smoothing) -> per-pair losses``, selected by ``dpo_loss=<name>``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol

import numpy as np
import tinker
from pydantic import BaseModel

from prefect_tinker.recipes.builders import BuiltData, DatasetBuilder, Example
from prefect_tinker.recipes.data_reading import OnError, SkipStats, SourceSpec, iter_records
from prefect_tinker.recipes.data_sources import PAIR_FORMATS, DatasetFormatError, RecordError, pairs_from_record
from prefect_tinker.recipes.datasets import split_conversations
from prefect_tinker.recipes.registry import Registry

__all__ = [
    "ComparisonBuilder",
    "DPO_LOSSES",
    "DPOLoss",
    "DPOVariant",
    "PairExample",
    "PreferenceBuilder",
    "PreferenceData",
    "pair_accuracy",
    "pair_datums",
    "pairs_from_record",
    "register_dpo_loss",
    "sequence_logprob",
]


class DPOVariant(Protocol):
    """A loss of the DPO family: ``variant(h, beta, label_smoothing) -> losses``, the per-pair
    losses (P,) of the log-ratio differences ``h`` (P,) (torch tensors; differentiable in ``h``),
    for the KL strength ``beta`` > 0 and the label smoothing ``0 <= eps < 0.5`` (a variant may
    ignore it). Registered by name in :data:`DPO_LOSSES`."""

    def __call__(self, h: Any, beta: float, label_smoothing: float) -> Any: ...


#: DPO variants by name (``dpo_loss=<name>``): ``dpo``, ``ipo``, ``hinge`` (module docstring);
#: plugins add more through the entry-point group ``prefect_tinker.dpo_losses``.
DPO_LOSSES: Registry[DPOVariant] = Registry("DPO loss", "prefect_tinker.dpo_losses")


def register_dpo_loss(name: str, variant: DPOVariant) -> DPOVariant:
    """Register ``variant(h, beta, label_smoothing) -> per-pair losses`` (:class:`DPOVariant`)
    under ``name`` (overwrites); the same as an entry point of group ``prefect_tinker.dpo_losses``."""
    return DPO_LOSSES.register(name, variant)


def _dpo(h: Any, beta: float, label_smoothing: float) -> Any:
    import torch.nn.functional as F

    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


def _ipo(h: Any, beta: float, label_smoothing: float) -> Any:
    return (h - 1.0 / (2.0 * beta)) ** 2


def _hinge(h: Any, beta: float, label_smoothing: float) -> Any:
    import torch

    return torch.relu(1.0 - beta * h)


register_dpo_loss("dpo", _dpo)
register_dpo_loss("ipo", _ipo)
register_dpo_loss("hinge", _hinge)


class PairExample(BaseModel):
    """One rendered comparison: the chosen and rejected sequences (prompt + reply each; weights 1
    on the reply tokens), and where it came from (``file:line``)."""

    chosen: Example
    rejected: Example
    source: str = ""


class PreferenceData(BuiltData[PairExample, PairExample]):
    """Rendered train and held-out comparisons of a :class:`PreferenceBuilder`."""


def _problem(chosen: list[dict], rejected: list[dict]) -> str | None:
    """Why a comparison cannot be trained on (a skip reason), or None."""
    if (
        len(chosen) != 1
        or len(rejected) != 1
        or chosen[0].get("role") != "assistant"
        or rejected[0].get("role") != "assistant"
    ):
        return "differs_before_last_turn"
    if not chosen[0]["content"].strip() or not rejected[0]["content"].strip():
        return "empty_reply"
    if chosen[0]["content"] == rejected[0]["content"]:
        return "identical"
    return None


class ComparisonBuilder(DatasetBuilder):
    """Comparisons read from preference records (formats of :func:`pairs_from_record`, field
    mapping, counted skips); a subclass renders them (:class:`PreferenceBuilder` for DPO,
    :class:`~prefect_tinker.recipes.reward_model.RewardModelBuilder` for a reward model)."""

    max_length: int = 512
    on_error: OnError = "raise"
    test_size: float | int = 0.1
    max_test: int | None = None  # a fraction's held-out count is capped here (evaluation cost)
    renderer_options: dict[str, Any] = {}

    build_version: ClassVar[int] = 2  # 2: test_size counts the comparisons that fit max_length

    def _check_source(self, spec: SourceSpec) -> None:
        for _ in self._read(spec, SkipStats(keep=0)):  # build() logs skips
            pass

    def _read(self, spec: SourceSpec, stats: SkipStats):
        fmt = spec.format if spec.format in PAIR_FORMATS else "preference"
        for raw in iter_records(spec):
            if raw.error is not None:
                self._bad(stats, "malformed_json", f"{raw.where}: {raw.error}")
                continue
            try:
                prompt, chosen, rejected = pairs_from_record(raw.record, fmt, spec.fields)
            except RecordError as exc:
                self._bad(stats, "bad_record", f"{raw.where}: {exc}")
                continue
            reason = _problem(chosen, rejected)
            if reason:
                stats.skip(reason, f"{raw.where}: {reason.replace('_', ' ')}")
                continue
            yield raw.where, prompt, chosen, rejected

    def _bad(self, stats: SkipStats, reason: str, message: str) -> None:
        if self.on_error == "raise":
            raise DatasetFormatError(message)
        stats.skip(reason, message)


class PreferenceBuilder(ComparisonBuilder):
    """Comparisons rendered with the run's renderer: each reply is the last assistant message
    after the shared prompt (its tokens, end-of-turn marker included, get weight 1)."""

    kind: ClassVar[str] = "preference"

    def build(self, tokenizer: Any) -> PreferenceData:
        from prefect_tinker.recipes.renderers import get_renderer

        rend = get_renderer(self.renderer, tokenizer, **self.renderer_options)
        stats = SkipStats()
        comparisons = [c for spec in self.sources for c in self._read(spec, stats)]
        if not comparisons:
            raise DatasetFormatError(
                f"no usable comparison in {', '.join(s.path for s in self.sources)} ({stats.summary()})"
            )
        pairs = self._render(rend, comparisons, stats)  # the split counts comparisons that fit max_length
        test_size = self.test_size
        if isinstance(test_size, float) and 0 < test_size < 1 and self.max_test is not None:
            test_size = min(max(1, round(len(pairs) * test_size)), self.max_test)
        data_train, data_test = (
            split_conversations(pairs, test_size, seed=self.seed) if test_size and pairs else (pairs, [])
        )
        if not data_train:
            raise DatasetFormatError(f"no training comparison left ({stats.summary()})")
        return PreferenceData(
            fingerprint=self.fingerprint(),
            renderer=self.renderer,
            train=data_train,
            test=data_test,
            skipped=stats.total,
            skip_summary=stats.summary(),
        )

    def _render(self, rend: Any, comparisons: list, stats: SkipStats) -> list[PairExample]:
        """Each ``(where, prompt, chosen, rejected)`` as a :class:`PairExample` (the reply's tokens
        weighted), skipping pairs whose longer sequence exceeds ``max_length`` (counted)."""
        out = []
        for where, prompt, chosen, rejected in comparisons:
            pair = []
            for reply in (chosen, rejected):
                model_input, weights = rend.build_supervised_example(prompt + reply, "last_assistant_message")
                pair.append(Example(tokens=model_input.to_ints(), weights=[float(w) for w in weights]))
            longest = max(len(p.tokens) for p in pair)
            if longest > self.max_length:
                stats.skip("too_long", f"{where}: {longest} tokens, more than max_length={self.max_length}")
                continue
            out.append(PairExample(chosen=pair[0], rejected=pair[1], source=where))
        return out


def pair_datums(pairs: list[PairExample]) -> list:
    """Datums ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]`` (2P) with target weights on
    the reply tokens."""
    from prefect_tinker.recipes.datasets import datum_from_example

    return [datum_from_example(ex.tokens, ex.weights) for p in pairs for ex in (p.chosen, p.rejected)]


def pair_accuracy(h: Any) -> float:
    """Fraction of pairs whose chosen log-ratio exceeds the rejected one (``h > 0``); a tie
    (``h == 0``, e.g. every pair at step 0, where the policy is the reference) counts one half,
    so chance is 0.5 and the step-0 value is a real baseline."""
    import torch

    h = torch.as_tensor(h).detach().double()
    return float(((h > 0).double() + 0.5 * (h == 0).double()).mean()) if h.numel() else float("nan")


def sequence_logprob(logprobs: Any, datum: tinker.Datum) -> Any:
    """Weighted sum of a datum's target logprobs (N,) with its ``weights`` (N,): the reply's
    log-probability, nats. Works on torch tensors (differentiable) and numpy arrays."""
    raw = datum.loss_fn_inputs["weights"]
    w = raw.to_numpy() if isinstance(raw, tinker.TensorData) else np.asarray(raw)
    import torch  # here, not at the top: reading a preference dataset needs no torch

    # a float32 dot product over fresh torch tensors, as tinker-cookbook's DPO computes it (its reference
    # and policy alike), so the same logprobs give the same bits on both sides
    # (tests/test_cookbook_parity.py): torch.tensor copies into torch's own (64-byte aligned) memory, where
    # a view of a numpy buffer may start elsewhere, and on AVX-512 CPUs the dot kernel's summation order
    # depends on where its inputs start (seen: sums a few float32 ulps apart)
    weights = torch.tensor(np.asarray(w, dtype=np.float32).reshape(-1))
    if isinstance(logprobs, torch.Tensor):
        return torch.dot(logprobs.reshape(-1), weights.to(logprobs.dtype))
    return float(torch.dot(torch.tensor(np.asarray(logprobs, dtype=np.float32).reshape(-1)), weights))


class DPOLoss:
    """The loss of one batch of comparisons for ``forward_backward_custom`` (see the module
    docstring): ``loss(datums, logprobs_D) -> (loss, metrics)`` with datums ordered as
    :func:`pair_datums` makes them.

    Args:
        reference: the reference reply log-probabilities, one per datum (2P,), same order.
        beta: the KL strength (``h`` is scaled by it); loss: a name of :data:`DPO_LOSSES`
            (``dpo``, ``ipo``, ``hinge``, or a plugin's);
        label_smoothing: ``dpo`` only: the assumed probability that a label is flipped (0 <= eps < 0.5).

    Metrics (``name:mean`` / ``name:sum``): ``dpo_loss`` (mean over pairs), ``accuracy``
    (:func:`pair_accuracy`), ``margin`` (mean ``beta h``), ``chosen_reward`` / ``rejected_reward``
    (mean ``beta (log pi - log ref)`` of each side), ``pairs``, ``tokens`` (reply tokens).

    Raises:
        UnknownComponentError: ``loss`` is not registered (the message lists the registered names).
        ValueError: ``beta``, ``label_smoothing`` or the reference's length out of range.
    """

    def __init__(self, reference: list[float], beta: float = 0.1, loss: str = "dpo", label_smoothing: float = 0.0):
        self.variant = DPO_LOSSES.get_or_raise(loss)
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if len(reference) % 2:
            raise ValueError(f"reference needs one value per datum of whole pairs, got {len(reference)}")
        self.reference, self.beta, self.loss, self.label_smoothing = (
            [float(r) for r in reference],
            beta,
            loss,
            label_smoothing,
        )

    def pair_terms(self, datums: list, logprobs: list) -> tuple[Any, Any, Any]:
        """``(h (P,), chosen log-ratio (P,), rejected log-ratio (P,))`` as torch tensors."""
        import torch

        if len(datums) != len(self.reference) or len(logprobs) != len(datums):
            raise ValueError(
                f"{len(datums)} datums / {len(logprobs)} logprobs for {len(self.reference)} reference values"
            )
        seq = torch.stack([sequence_logprob(lp, d) for lp, d in zip(logprobs, datums, strict=True)])
        ratio = seq - torch.as_tensor(self.reference, dtype=seq.dtype)
        chosen, rejected = ratio[0::2], ratio[1::2]
        return chosen - rejected, chosen, rejected

    def values(self, h: Any) -> Any:
        """Per-pair losses (P,) for log-ratio differences ``h`` (P,): the variant ``loss``."""
        return self.variant(h, self.beta, self.label_smoothing)

    def __call__(self, datums: list, logprobs: list) -> tuple[Any, dict[str, float]]:
        h, chosen, rejected = self.pair_terms(datums, logprobs)
        losses = self.values(h)
        loss = losses.mean()
        tokens = sum(float(np.asarray(d.loss_fn_inputs["weights"].to_numpy()).sum()) for d in datums)
        return loss, {
            "dpo_loss:mean": float(loss.detach()),
            "accuracy:mean": pair_accuracy(h),
            "margin:mean": float((self.beta * h).detach().mean()),
            "chosen_reward:mean": float((self.beta * chosen).detach().mean()),
            "rejected_reward:mean": float((self.beta * rejected).detach().mean()),
            "pairs:sum": float(len(h)),
            "tokens:sum": tokens,
        }


#: The loss of every pair when the policy equals the reference (``dpo``: ``ln 2``).
LN2 = math.log(2.0)
