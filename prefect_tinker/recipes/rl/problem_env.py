"""One-step problem environments: a question, one sampled answer, a graded reward.

:class:`ProblemEnv` renders the question as a chat prompt (optional system prompt and few-shot
turns), takes one sampled reply, and rewards it with

    reward = correct + format_coef * (format_ok - 1)

(1 for a correct, well-formed answer; ``-format_coef`` for a malformed one; a well-formed wrong
answer gets 0), as in the Tinker cookbook's ``ProblemEnv``. A reply is well-formed when it ended
properly (the renderer's stop sequence, or the end-of-sequence token; only the stop sequence with
``format_needs_stop``, the cookbook's ``require_stop_sequence_for_format=True``) and passes
:meth:`ProblemEnv.check_format`. Subclasses implement
:meth:`ProblemEnv.check_format` and :meth:`ProblemEnv.check_answer` on the reply text.

:class:`ProblemGroupBuilder` is the picklable group builder (problem, env class, renderer name,
tokenizer id): the renderer is resolved inside the worker through a per-process cache.
:class:`ProblemDataset` serves problems in seeded per-epoch permutations, ``groups_per_batch``
problems per batch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefect_tinker.recipes.renderers.base import Termination
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult, StopCondition

__all__ = ["Problem", "ProblemEnv", "ProblemGroupBuilder", "ProblemDataset", "load_renderer", "freeze_messages"]

_renderer_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _load_renderer(renderer_name: str, tokenizer_id: str) -> Any:
    from transformers import AutoTokenizer

    from prefect_tinker.recipes.renderers import get_renderer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_id)
    return get_renderer(renderer_name, tokenizer)


def load_renderer(renderer_name: str, tokenizer_id: str) -> Any:
    """The renderer ``renderer_name`` ("auto" guesses from the chat template) for the tokenizer in
    ``tokenizer_id`` (a local directory or hub id), cached per process.

    Raises:
        RendererError: unknown renderer name. OSError: the tokenizer cannot be loaded.
    """
    with _renderer_lock:
        return _load_renderer(renderer_name, tokenizer_id)


@dataclass(frozen=True)
class Problem:
    """One problem: ``question`` (shown to the model), ``answer`` (the reference the grader
    compares with) and ``id`` (where it came from, e.g. ``file.jsonl:12`` or ``arith-3-5``)."""

    question: str
    answer: str
    id: str = ""


class ProblemEnv(Env):
    """A one-turn question/answer episode (see the module docstring for the reward).

    Args:
        problem: the question and its reference answer.
        renderer: a :class:`prefect_tinker.recipes.renderers.Renderer`.
        convo_prefix: messages before the question (system prompt, few-shot turns).
        format_coef: penalty for a malformed reply (reward ``-format_coef`` instead of 0).
        question_suffix: text appended to the question (e.g. an answer-format instruction).
        format_needs_stop: only a reply ended by the stop sequence is well-formed (not one ended
            by the end-of-sequence token).
    """

    def __init__(
        self,
        problem: Problem,
        renderer: Any,
        *,
        convo_prefix: Sequence[dict] = (),
        format_coef: float = 0.1,
        question_suffix: str = "",
        format_needs_stop: bool = False,
    ):
        self.problem = problem
        self.format_needs_stop = format_needs_stop
        self.renderer = renderer
        self.convo_prefix = [dict(m) for m in convo_prefix]
        self.format_coef = float(format_coef)
        self.question_suffix = question_suffix

    # ---- to implement ---------------------------------------------------------------------
    def check_format(self, response: str) -> bool:
        """Whether the reply text has the expected answer format."""
        raise NotImplementedError

    def check_answer(self, response: str) -> bool:
        """Whether the reply text's answer equals the reference ``self.problem.answer``."""
        raise NotImplementedError

    # ---- Env --------------------------------------------------------------------------------
    def messages(self) -> list[dict]:
        """The prompt conversation: prefix messages, then the question as a user message."""
        return self.convo_prefix + [{"role": "user", "content": self.problem.question + self.question_suffix}]

    def initial_observation(self) -> tuple[list[int], StopCondition]:
        prompt = self.renderer.build_generation_prompt(self.messages())
        return prompt.to_ints(), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        text = parsed.message.get("content") or ""
        well_ended = parsed.termination is Termination.STOP_SEQUENCE if self.format_needs_stop else parsed.ok
        format_ok = bool(well_ended and self.check_format(text))
        correct = bool(self.check_answer(text))
        reward = float(correct) + self.format_coef * (float(format_ok) - 1.0)
        return StepResult(
            reward=reward,
            episode_done=True,
            metrics={"correct": float(correct), "format": float(format_ok)},
            logs={"response": text, "reference": self.problem.answer, "problem_id": self.problem.id},
        )


@dataclass(frozen=True)
class ProblemGroupBuilder(EnvGroupBuilder):
    """Builds ``group_size`` :class:`ProblemEnv` s (of class ``env_cls``) for one problem.

    All fields are plain values, so the builder pickles cheaply and its ``repr`` is stable (the
    rollout cache key hashes it).
    """

    env_cls: type
    problem: Problem
    group_size: int
    renderer_name: str
    tokenizer_id: str
    format_coef: float = 0.1
    convo_prefix: tuple[tuple[tuple[str, str], ...], ...] = ()
    question_suffix: str = ""
    tags: tuple[str, ...] = field(default=())
    format_needs_stop: bool = False

    def make_envs(self) -> list[ProblemEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        prefix = [dict(m) for m in self.convo_prefix]
        return [
            self.env_cls(
                self.problem,
                renderer,
                convo_prefix=prefix,
                format_coef=self.format_coef,
                question_suffix=self.question_suffix,
                format_needs_stop=self.format_needs_stop,
            )
            for _ in range(self.group_size)
        ]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


def freeze_messages(messages: Sequence[dict]) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Messages as nested tuples (hashable, stable repr) for :class:`ProblemGroupBuilder`."""
    return tuple(tuple(sorted((str(k), str(v)) for k, v in m.items())) for m in messages)


class ProblemDataset(RLDataset):
    """Batches of ``groups_per_batch`` problems: epochs are permutations seeded by ``seed + epoch``
    (the last incomplete batch of an epoch is dropped), one group of ``group_size`` envs each.

    Args:
        problems: the problems (P >= groups_per_batch).
        make_builder: ``problem -> EnvGroupBuilder``.
        shuffle: False: every epoch in the problems' own order.

    Raises:
        ValueError: fewer problems than ``groups_per_batch``.
    """

    def __init__(
        self, problems: Sequence[Any], groups_per_batch: int, make_builder, seed: int = 0, shuffle: bool = True
    ):
        if len(problems) < groups_per_batch:
            raise ValueError(
                f"groups_per_batch={groups_per_batch} is larger than the number of problems ({len(problems)})"
            )
        self.problems = list(problems)
        self.groups_per_batch = groups_per_batch
        self.make_builder = make_builder
        self.seed = seed
        self.shuffle = shuffle

    def num_batches(self) -> int:
        return len(self.problems) // self.groups_per_batch

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        epoch, i = divmod(index, self.num_batches())
        n = len(self.problems)
        order = np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)
        chosen = order[i * self.groups_per_batch : (i + 1) * self.groups_per_batch]
        return [self.make_builder(self.problems[int(j)]) for j in chosen]
