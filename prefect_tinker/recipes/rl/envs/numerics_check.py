"""``numerics_check``: long multi-turn episodes whose purpose is to compare the sampler's and the
trainer's logprobs, not to teach a task.

Every RL step logs ``train/kl_sample_train_v1`` (mean over sampled tokens of sampler logprob minus
trainer logprob) and ``train/kl_sample_train_v2`` (half the mean squared difference). On a short
prompt they say little; numerical mismatches between the two engines (a different attention path
at long context, KV-cache reuse, precision) grow with the context. This environment makes every
episode long and many-turned, so those metrics measure the trainer against the sampler over the
depths that matter. ``docs/numerics.md`` gives the healthy range measured on the local server.

The task: count how often a word occurs in a document shown one page per turn. The first message
states the word and the number of pages and shows page 1; each reply (whatever it says) is answered
with the next page; after the last page the environment asks for the count, and the reply to that
is graded: ``max(0, 1 - |predicted - true| / (tolerance * true))`` (1 for the exact count; 0 with
no ``Answer: <n>``). So an episode of an N-page document takes exactly N + 1 turns whatever the
policy writes (a reply cut off at ``max_tokens`` is kept as text,
:attr:`~prefect_tinker.recipes.rl.message_env.MessageEnv.keep_unparsed_replies`): the length of the
check does not depend on the policy following a protocol, so it works on an untrained model too.
Every observation extends the previous one, so a whole episode trains as one sequence.

Pages are consecutive windows of ``page_words`` words of ``corpus`` (a UTF-8 text file) or, by
default, of English-like text generated from a fixed vocabulary (seeded by the run's seed and the
group's place), in which the target words occur at natural rates. Matching is case-insensitive over
whole words (maximal runs of ASCII letters).

Metrics per episode: ``env/correct_rate`` (exact count), ``env/answer_parsed``, ``env/abs_error``,
``env/true_count``, ``env/pages``.

Source: the Tinker cookbook's ``rl_numerics_check`` recipe (its idea and its reward: a long,
many-turn word-count task whose only use is the sampler-vs-trainer KL; there the model reads pages
with a ``read_page`` tool call); written anew, with the environment turning the pages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, register_env
from prefect_tinker.recipes.rl.message_env import (
    EPISODE_TURNS_LIMIT,
    EpisodeLimits,
    GeneratedDataset,
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    problem_rng,
)
from prefect_tinker.recipes.rl.types import RLDataset

__all__ = [
    "DEFAULT_WORDS",
    "NumericsCheck",
    "NumericsCheckBuilder",
    "NumericsCheckEnv",
    "NumericsCheckOptions",
    "closeness_reward",
    "count_word",
    "generated_text",
    "parse_count",
]

#: Words to count: common function words with a steady rate in English text.
DEFAULT_WORDS: tuple[str, ...] = (
    "after",
    "before",
    "between",
    "during",
    "into",
    "many",
    "most",
    "only",
    "over",
    "such",
    "their",
    "then",
    "through",
    "under",
    "until",
    "when",
    "while",
)

_FILLER = (
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "was",
    "is",
    "for",
    "on",
    "as",
    "with",
    "by",
    "he",
    "it",
    "at",
    "from",
    "his",
    "an",
    "were",
    "are",
    "which",
    "this",
    "also",
    "be",
    "or",
    "had",
    "first",
    "one",
    "new",
    "two",
    "its",
    "has",
    "other",
    "city",
    "war",
    "album",
    "river",
    "team",
    "year",
    "game",
    "church",
    "season",
    "film",
    "school",
    "station",
    "village",
    "king",
    "army",
    "world",
    "party",
)
_NOUNS = (
    "city",
    "river",
    "song",
    "army",
    "court",
    "valley",
    "bridge",
    "museum",
    "harbour",
    "council",
    "novel",
    "station",
    "forest",
    "castle",
    "league",
    "record",
    "company",
    "island",
    "temple",
    "festival",
)
_WORD = re.compile(r"[a-z]+")
_ANSWER = re.compile(r"answer\s*:\s*\**\s*(-?\d[\d,]*)", re.IGNORECASE)


def count_word(text: str, word: str) -> int:
    """Case-insensitive whole-word occurrences of ``word`` in ``text`` (a word is a maximal run of
    ASCII letters: "time's" holds "time" once, "times" does not)."""
    return sum(1 for w in _WORD.findall(text.lower()) if w == word)


def parse_count(text: str) -> int | None:
    """The integer after the last ``Answer:`` in ``text`` (commas allowed), or None."""
    found = _ANSWER.findall(text or "")
    return int(found[-1].replace(",", "")) if found else None


def closeness_reward(predicted: int, true_count: int, tolerance: float) -> float:
    """``max(0, 1 - |predicted - true| / (tolerance * max(true, 1)))``: 1 for the exact count, 0 at
    a relative error of ``tolerance``."""
    return max(0.0, 1.0 - abs(predicted - true_count) / max(true_count, 1) / tolerance)


def generated_text(rng: Any, n_words: int, words: tuple[str, ...]) -> list[str]:
    """``n_words`` words of English-like sentences from a fixed vocabulary: each word of ``words``
    has a ~1% chance per position; sentences of 8-20 words start with a capital and end with a
    period. ``rng`` is a ``numpy.random.Generator``."""
    out: list[str] = []
    while len(out) < n_words:
        length = int(rng.integers(8, 21))
        sentence = []
        for _ in range(length):
            r = float(rng.random())
            if r < 0.01 * len(words):
                sentence.append(words[int(rng.integers(len(words)))])
            elif r < 0.01 * len(words) + 0.15:
                sentence.append(_NOUNS[int(rng.integers(len(_NOUNS)))])
            else:
                sentence.append(_FILLER[int(rng.integers(len(_FILLER)))])
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out += sentence
    return out[:n_words]


@lru_cache(maxsize=4)
def _corpus_words(path: str) -> tuple[str, ...]:
    return tuple(Path(path).read_text(encoding="utf-8").split())


class NumericsCheckOptions(MessageEnvOptions):
    """``env_options`` of ``numerics_check`` (an episode takes pages + 1 turns: ``max_turns`` is not
    an option here)."""

    num_pages_min: int = Field(default=8, ge=1, le=EPISODE_TURNS_LIMIT - 1, description="Fewest pages of a document.")
    num_pages_max: int = Field(
        default=12, ge=1, le=EPISODE_TURNS_LIMIT - 1, description="Most pages of a document (turns = pages + 1)."
    )
    page_words: int = Field(default=150, ge=1, description="Words per page.")
    words: tuple[str, ...] = Field(
        default=DEFAULT_WORDS, min_length=1, description="Words to count (one per problem, drawn at random)."
    )
    corpus: str | None = Field(
        default=None, description="UTF-8 text file the pages are cut from (default: generated text)."
    )
    reward_tolerance: float = Field(
        default=0.2, gt=0, description="Relative count error at which the reward reaches 0."
    )
    max_trajectory_tokens: int = Field(
        default=32768,
        ge=8,
        description="Longest observation (tokens); a longer episode ends with context_overflow_reward.",
    )

    @field_validator("words")
    @classmethod
    def _words(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [w for w in v if not _WORD.fullmatch(w)]
        if bad:
            raise ValueError(f"words must be lowercase ASCII letters, got {bad[0]!r}")
        return v

    @field_validator("corpus")
    @classmethod
    def _corpus(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"corpus {v!r}: no such file")
        return v

    @model_validator(mode="after")
    def _pages(self) -> NumericsCheckOptions:
        if "max_turns" in self.model_fields_set:
            raise ValueError("max_turns: numerics_check episodes take (pages + 1) turns; set num_pages_min/max instead")
        if self.num_pages_min > self.num_pages_max:
            raise ValueError(f"num_pages_min ({self.num_pages_min}) exceeds num_pages_max ({self.num_pages_max})")
        return self

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            self.num_pages_max + 1, self.max_trajectory_tokens, self.failed_parse_reward, self.context_overflow_reward
        )


class NumericsCheckEnv(MessageEnv):
    """One document read page by page (see the module docstring)."""

    outcome_metrics = ("correct", "answer_parsed")
    keep_unparsed_replies = True

    def __init__(self, renderer: Any, word: str, pages: tuple[str, ...], tolerance: float, **kw: Any):
        n = len(pages)
        intro = (
            f'Count how many times the word "{word}" appears in a document of {n} pages. Matching is '
            "case-insensitive and counts whole words only. I will show you one page per message; reply with "
            "your running count after each page. When I ask for the total, end your reply with "
            f'"Answer: <count>".\n\n[Page 1 of {n}]\n{pages[0]}'
        )
        super().__init__(renderer, [{"role": "user", "content": intro}], **kw)
        self.word, self.pages, self.tolerance = word, pages, tolerance
        self.true_count = sum(count_word(p, word) for p in pages)

    def react(self, reply: dict) -> Reaction:
        n = len(self.pages)
        if self.turns < n:
            return Reaction([{"role": "user", "content": f"[Page {self.turns + 1} of {n}]\n{self.pages[self.turns]}"}])
        if self.turns == n:
            return Reaction(
                [
                    {
                        "role": "user",
                        "content": f'That was the last page. How many times does "{self.word}" '
                        'appear in the document? End with "Answer: <count>".',
                    }
                ]
            )
        return self.finish(reply)

    def finish(self, reply: dict) -> Reaction:
        predicted = parse_count(reply.get("content") or "")
        metrics = {
            "answer_parsed": float(predicted is not None),
            "true_count": float(self.true_count),
            "pages": float(len(self.pages)),
            "correct": float(predicted == self.true_count),
        }
        if predicted is not None:
            metrics["abs_error"] = float(abs(predicted - self.true_count))
        reward = closeness_reward(predicted, self.true_count, self.tolerance) if predicted is not None else 0.0
        return Reaction(done=True, reward=reward, metrics=metrics, logs={"reference": str(self.true_count)})


@dataclass(frozen=True, kw_only=True)
class NumericsCheckBuilder(MessageGroupBuilder):
    """Every member of a group reads the same document (its pages are part of the builder)."""

    word: str
    pages: tuple[str, ...]
    tolerance: float = 0.2

    def make_env(self, renderer: Any) -> NumericsCheckEnv:
        return NumericsCheckEnv(renderer, self.word, self.pages, self.tolerance, limits=self.limits)


@register_env
class NumericsCheck(Environment):
    name = "numerics_check"
    description = (
        "Numerics health check: long multi-turn documents read page by page (count a word); watch "
        "train/kl_sample_train_v1/v2."
    )
    Options = NumericsCheckOptions

    @classmethod
    def build(cls, spec: Any, ctx: EnvContext) -> RLDataset:
        opts: NumericsCheckOptions = cls.options(spec)
        corpus = _corpus_words(opts.corpus) if opts.corpus else None

        def make(batch: int, group: int) -> NumericsCheckBuilder:
            rng = problem_rng(ctx.seed, batch, group)
            word = opts.words[int(rng.integers(len(opts.words)))]
            n = int(rng.integers(opts.num_pages_min, opts.num_pages_max + 1))
            total = n * opts.page_words
            if corpus is None:
                text = generated_text(rng, total, opts.words)
            elif len(corpus) < total:
                raise ValueError(
                    f"corpus {opts.corpus!r} has {len(corpus)} words; a document of {n} pages of "
                    f"{opts.page_words} words needs {total}"
                )
            else:
                start = int(rng.integers(len(corpus) - total + 1))
                text = list(corpus[start : start + total])
            pages = tuple(" ".join(text[i * opts.page_words : (i + 1) * opts.page_words]) for i in range(n))
            return NumericsCheckBuilder(
                word=word,
                pages=pages,
                tolerance=opts.reward_tolerance,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=opts.limits(),
                tags=(cls.name,),
            )

        return GeneratedDataset(ctx.groups_per_batch, make)
