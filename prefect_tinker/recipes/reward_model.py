"""A pairwise reward model: an LM that answers which of two completions is better.

Layout of one comparison (rendered with the run's renderer)::

    <prompt messages>                         the conversation both completions continue
    user:      Completion A:\\n<a>\\n\\nCompletion B:\\n<b>\\n\\n<question>
    assistant: <label>                        "A" or "B": the only trained tokens

Training (:class:`RewardModelBuilder`): supervised fine-tuning with weight 1 on the label tokens
only (not the end-of-turn marker: scoring never samples past the label). Position bias is
removed by training each comparison in both orders (``orders="both"``: chosen as A with label
A, and chosen as B with label B) or in one order drawn by a generator seeded with (seed, index)
(``orders="swap"``).

Scoring reads probabilities, not a sampled token: with ``lA = log p(label A | prompt)`` and
``lB`` (sums over each label's tokens), the probability that B is better, normalised over the two
labels, is ``sigmoid(lB - lA)`` (:func:`prob_second`). Both orders of a pair are scored and
averaged (:func:`debiased_prob`), so a reward model that always answers "A" scores every pair
0.5. The Tinker cookbook's ``PreferenceModelFromChatRenderer`` samples one token at temperature 0
instead (its own TODO says to use probabilities).

Group rewards for RL (:func:`matchups`, :func:`win_minus_loss`, :func:`group_rewards`): the
members of a group play matchups (all pairs, or all pairs within chunks of ``matchup_size``);
matchup ``(i, j)`` has the debiased score ``d = 2 P(j better) - 1`` in [-1, 1]; member ``j``
gains ``d`` and ``i`` loses it; each member's total is divided by its number of matchups, and a
reply that did not end on a stop sequence gets ``- format_coef`` (as the cookbook's
``PairwisePreferenceGroupBuilder``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from prefect_tinker.recipes.builders import BuiltData, Example
from prefect_tinker.recipes.data_reading import SkipStats
from prefect_tinker.recipes.data_sources import DatasetFormatError
from prefect_tinker.recipes.datasets import split_conversations
from prefect_tinker.recipes.preference import ComparisonBuilder

__all__ = [
    "DEFAULT_QUESTION",
    "ComparisonFormat",
    "RenderedComparison",
    "RMComparison",
    "RMTrainPair",
    "RewardModelBuilder",
    "RewardModelData",
    "brier",
    "comparison_messages",
    "debiased_prob",
    "group_rewards",
    "label_token_ids",
    "matchups",
    "prob_second",
    "render_comparison",
    "win_minus_loss",
]

#: The question after the two completions.
DEFAULT_QUESTION = "Which completion is the better next reply in the conversation above? Answer with A or B."


class ComparisonFormat(BaseModel):
    """How a comparison is put to the reward model: the question and the two labels.

    The reward model must be scored with the format it was trained with (the RL env and the
    evaluators take the same fields).
    """

    question: str = Field(default=DEFAULT_QUESTION, description="Question after the two completions.")
    labels: tuple[str, str] = Field(default=("A", "B"), description="Answers meaning 'A is better' and 'B is better'.")

    @field_validator("labels")
    @classmethod
    def _distinct(cls, v: tuple[str, str]) -> tuple[str, str]:
        if not v[0].strip() or not v[1].strip() or v[0].strip() == v[1].strip():
            raise ValueError(f"labels must be two different non-empty strings, got {v!r}")
        return v


def comparison_messages(prompt: Sequence[dict], reply_a: str, reply_b: str, question: str) -> list[dict]:
    """The reward model's conversation for one ordered comparison (without the label)."""
    text = f"Completion A:\n{reply_a}\n\nCompletion B:\n{reply_b}\n\n{question}"
    return [dict(m) for m in prompt] + [{"role": "user", "content": text}]


def label_token_ids(renderer: Any, labels: Sequence[str]) -> list[list[int]]:
    """The tokens of each label as the reply of an assistant turn (its body, without the
    end-of-turn marker), for ``renderer``.

    Renderers encode the assistant header and the reply separately (the prefix property), so
    these tokens follow every generation prompt unchanged.

    Raises:
        ValueError: the renderer breaks the prefix property, or a label's tokens cannot be
            isolated (the message names the label).
    """
    convo = [{"role": "user", "content": "?"}]
    prompt = renderer.build_generation_prompt(convo).to_ints()
    out = []
    for label in labels:
        model_input, _ = renderer.build_supervised_example(
            convo + [{"role": "assistant", "content": label}], "last_assistant_message"
        )
        tokens = model_input.to_ints()
        if tokens[: len(prompt)] != prompt:
            raise ValueError(
                f"renderer {type(renderer).__name__}: the generation prompt is not a prefix of the example"
            )
        rest = tokens[len(prompt) :]
        k = next(
            (k for k in range(1, len(rest) + 1) if renderer.tokenizer.decode(rest[:k]).strip() == label.strip()), None
        )
        if k is None:
            raise ValueError(f"label {label!r}: its tokens cannot be isolated from the end-of-turn marker")
        out.append(rest[:k])
    if out[0] == out[1]:
        raise ValueError(f"labels {list(labels)!r} encode to the same tokens")
    return out


class RenderedComparison(BaseModel):
    """One ordered comparison as tokens: ``prompt`` (P,) ends with the assistant header; the
    reward model's answer is ``labels[0]`` ("A is better") or ``labels[1]`` after it."""

    prompt: list[int]
    labels: tuple[list[int], list[int]]


def render_comparison(
    renderer: Any,
    prompt: Sequence[dict],
    reply_a: str,
    reply_b: str,
    fmt: ComparisonFormat,
    labels: Sequence[list[int]] | None = None,
) -> RenderedComparison:
    """Tokens of one ordered comparison (``labels``: :func:`label_token_ids`, computed when None)."""
    labels = labels if labels is not None else label_token_ids(renderer, fmt.labels)
    tokens = renderer.build_generation_prompt(comparison_messages(prompt, reply_a, reply_b, fmt.question)).to_ints()
    return RenderedComparison(prompt=tokens, labels=(list(labels[0]), list(labels[1])))


def prob_second(lp_a: float, lp_b: float) -> float:
    """P(B is better) normalised over the two labels: ``sigmoid(lp_b - lp_a)`` for the label
    log-probabilities ``lp_a``, ``lp_b`` (nats)."""
    x = float(lp_b) - float(lp_a)
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def debiased_prob(forward: tuple[float, float], backward: tuple[float, float]) -> float:
    """P(y is better than x) from both orders: ``forward`` = label logprobs (lA, lB) with x as A
    and y as B, ``backward`` = the same with y as A and x as B; the mean of
    ``P(B | forward)`` and ``P(A | backward)``. Exactly 0.5 for a model that ignores content."""
    return 0.5 * (prob_second(*forward) + 1.0 - prob_second(*backward))


def brier(p_correct: Sequence[float] | np.ndarray) -> float:
    """Brier score ``mean((1 - p)^2)`` of the probabilities given to the correct answers (0 is
    perfect, 0.25 is an uninformed 0.5 everywhere)."""
    p = np.asarray(p_correct, dtype=np.float64)
    return float(np.mean((1.0 - p) ** 2)) if p.size else float("nan")


def matchups(n: int, matchup_size: int | None = None) -> list[tuple[int, int]]:
    """Unordered pairs ``(i, j)``, ``i < j``, of ``n`` group members: all of them, or all pairs
    within consecutive chunks of ``matchup_size`` members (linear in ``n`` rather than quadratic).
    Each pair is scored in both orders."""
    size = n if not matchup_size or matchup_size >= n else int(matchup_size)
    return [
        (s + i, s + j)
        for s in range(0, n, size)
        for i in range(min(size, n - s))
        for j in range(i + 1, min(size, n - s))
    ]


def win_minus_loss(n: int, pairs: Sequence[tuple[int, int]], scores: Sequence[float]) -> list[float]:
    """Per member (n,): the sum over its matchups of its score (``+d`` for ``j``, ``-d`` for ``i``
    of pair ``(i, j)`` with score ``d`` in [-1, 1], positive when ``j`` is better), divided by its
    number of matchups (0 for a member in none)."""
    total, count = [0.0] * n, [0] * n
    for (i, j), d in zip(pairs, scores, strict=True):
        total[j] += float(d)
        total[i] -= float(d)
        count[i] += 1
        count[j] += 1
    return [t / c if c else 0.0 for t, c in zip(total, count, strict=True)]


def group_rewards(wml: Sequence[float], valid: Sequence[bool], format_coef: float) -> list[float]:
    """Rewards (n,): win-minus-loss plus ``format_coef * (valid - 1)`` (``-format_coef`` for a
    reply that did not end on a stop sequence)."""
    return [float(w) + float(format_coef) * (float(v) - 1.0) for w, v in zip(wml, valid, strict=True)]


# ----- training data ----------------------------------------------------------------------------
class RMTrainPair(BaseModel):
    """The training examples of one comparison: both orders, or one seeded order."""

    examples: list[Example]
    source: str = ""


class RMComparison(BaseModel):
    """A held-out comparison in both orders: ``chosen_a`` (chosen as A, rejected as B) and
    ``chosen_b`` (the other order)."""

    chosen_a: RenderedComparison
    chosen_b: RenderedComparison
    source: str = ""


class RewardModelData(BuiltData[RMTrainPair, RMComparison]):
    """Rendered train comparisons and held-out comparisons of a :class:`RewardModelBuilder`."""


class RewardModelBuilder(ComparisonBuilder):
    """Comparisons read like DPO's (:class:`~prefect_tinker.recipes.preference.ComparisonBuilder`:
    formats, field mapping, counted skips), rendered as reward-model examples (see the module
    docstring). A comparison longer than ``max_length`` tokens (prompt, both replies, question,
    label) is skipped and counted (``too_long``); ``test_size`` comparisons of those left are
    held out (split with ``seed``)."""

    kind: ClassVar[str] = "reward_model"
    orders: Literal["both", "swap"] = "both"
    question: str = DEFAULT_QUESTION
    labels: tuple[str, str] = ("A", "B")
    max_length: int = 1024

    def format(self) -> ComparisonFormat:
        return ComparisonFormat(question=self.question, labels=self.labels)

    def build(self, tokenizer: Any) -> RewardModelData:
        from prefect_tinker.recipes.renderers import get_renderer

        rend = get_renderer(self.renderer, tokenizer, **self.renderer_options)
        fmt, stats = self.format(), SkipStats()
        label_ids = label_token_ids(rend, fmt.labels)

        def rendered(where, prompt, chosen, rejected):
            c, r = chosen[0]["content"], rejected[0]["content"]
            both = (
                render_comparison(rend, prompt, c, r, fmt, label_ids),
                render_comparison(rend, prompt, r, c, fmt, label_ids),
            )
            longest = max(len(x.prompt) + max(len(t) for t in x.labels) for x in both)
            if longest > self.max_length:
                stats.skip("too_long", f"{where}: {longest} tokens, more than max_length={self.max_length}")
                return None
            return RMComparison(chosen_a=both[0], chosen_b=both[1], source=where)

        # rendered first, then split: test_size counts comparisons that fit max_length
        comparisons = [r for spec in self.sources for item in self._read(spec, stats) if (r := rendered(*item))]
        if len(comparisons) < 2 and self.test_size:
            raise DatasetFormatError(
                f"fewer than 2 usable comparisons in {', '.join(s.path for s in self.sources)} ({stats.summary()})"
            )
        train, data_test = (
            split_conversations(comparisons, self.test_size, seed=self.seed) if self.test_size else (comparisons, [])
        )
        data_train = []
        for index, c in enumerate(train):
            examples = [_example(c.chosen_a, 0), _example(c.chosen_b, 1)]  # chosen as A -> "A"; chosen as B -> "B"
            if self.orders == "swap":
                examples = [examples[int(np.random.default_rng([self.seed, index]).integers(2))]]
            data_train.append(RMTrainPair(examples=examples, source=c.source))
        if not data_train:
            raise DatasetFormatError(f"no training comparison ({stats.summary()})")
        return RewardModelData(
            fingerprint=self.fingerprint(),
            renderer=self.renderer,
            train=data_train,
            test=data_test,
            skipped=stats.total,
            skip_summary=stats.summary(),
        )


def _example(c: RenderedComparison, label: int) -> Example:
    tokens = c.prompt + c.labels[label]
    return Example(tokens=tokens, weights=[0.0] * len(c.prompt) + [1.0] * len(c.labels[label]))
