"""Shared parts of the one-step problem environments: loading problems from files or datasets,
and the prompt prefix (system prompt, one solved example) a spec asks for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from prefect_tinker.recipes.rl.grading import extract_boxed, extract_hash_answer
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemGroupBuilder, freeze_messages

__all__ = ["convo_prefix", "load_problems", "problem_builder"]


def _reference(raw: str) -> str:
    """The final answer inside a reference field: after ``####``, else the last ``\\boxed{}``, else the field."""
    return extract_hash_answer(raw) or extract_boxed(raw) or raw.strip()


def load_problems(
    source: str,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    split: str = "train",
    config_name: str | None = None,
    max_problems: int | None = None,
) -> list[Problem]:
    """Problems from a JSONL file (optionally gzipped) or a Hugging Face dataset.

    ``question_field``/``answer_field`` are record paths (``meta.answer``, ``choices[0]``); the
    reference answer is extracted from the answer field (``#### n``, ``\\boxed{}``, else as is).

    Raises:
        FileNotFoundError: a path-like source that does not exist.
        ValueError: a malformed line or a missing/empty field; the message names ``file:line``
            and the field.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    spec = SourceSpec(path=source, split=split, config_name=config_name, max_records=max_problems)
    problems = []
    for raw in iter_records(spec):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            question, answer = get_field(raw.record, question_field), get_field(raw.record, answer_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        for name, value in ((question_field, question), (answer_field, answer)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{raw.where}: field {name!r} must be a non-empty string, got {value!r:.60}")
        problems.append(Problem(question=question.strip(), answer=_reference(answer), id=raw.where))
    if not problems:
        raise ValueError(f"no problems in {source!r}")
    return problems


def convo_prefix(spec: Any, shot: Sequence[dict]) -> list[dict]:
    """Messages before the question: ``spec.system_prompt`` as a system message, then the solved
    example ``shot`` (a user and an assistant message) when ``spec.few_shot``."""
    prefix: list[dict] = []
    if spec.system_prompt:
        prefix.append({"role": "system", "content": spec.system_prompt})
    if spec.few_shot:
        prefix += [dict(m) for m in shot]
    return prefix


def problem_builder(
    env_cls: type,
    spec: Any,
    ctx: Any,
    shot: Sequence[dict],
    suffix: str,
    tag: str,
    *,
    builder: type[ProblemGroupBuilder] = ProblemGroupBuilder,
) -> Callable[[Problem], ProblemGroupBuilder]:
    """The ``make_builder`` of a problem environment: ``make(problem) -> ProblemGroupBuilder``, the
    builder of one group of ``ctx.group_size`` envs of class ``env_cls`` for one :class:`Problem`,
    with the prompt settings of ``spec`` and the run's renderer.

    An environment's :meth:`~prefect_tinker.recipes.rl.envs.Environment.build` makes it once and
    its dataset calls it for each problem of a batch (``RLDataset.get_batch(i) -> [make(p), ...]``).
    Each env's prompt is ``[system message] + [shot user, shot assistant] + [user: question +
    suffix]``, rendered by the renderer the env is given; its reward is the
    :class:`~prefect_tinker.recipes.rl.problem_env.ProblemEnv` one (``correct + format_coef *
    (format_ok - 1)``).

    Args:
        env_cls: the :class:`~prefect_tinker.recipes.rl.problem_env.ProblemEnv` subclass of the envs
            (its ``check_format`` and ``check_answer`` grade the reply text); made as
            ``env_cls(problem, renderer, convo_prefix=..., format_coef=..., question_suffix=...,
            format_needs_stop=...)``.
        spec: the ``spec`` given to ``build`` (the RL config's
            :class:`~prefect_tinker.recipes.rl.envs.EnvSpec`); read: ``system_prompt`` (a system
            message first, when set), ``few_shot`` (whether ``shot`` is put before the question),
            ``format_coef`` (the penalty of a malformed reply) and ``format_needs_stop`` (only a reply
            ended by the renderer's stop sequence is well-formed).
        ctx: the :class:`~prefect_tinker.recipes.rl.envs.EnvContext` given to ``build``; read:
            ``group_size`` (envs per problem), ``renderer_name`` and ``tokenizer_id`` (the renderer
            the envs get, loaded once per process inside the rollout).
        shot: one solved example, a user then an assistant message (``[{"role": "user", "content":
            ...}, {"role": "assistant", "content": ...}]``), used only when ``spec.few_shot``;
            ``()`` for none.
        suffix: text appended to every question (e.g. an answer-format instruction such as ``"
            Give the final answer as '#### <number>'."``); ``""`` for none.
        tag: the builders' tag, usually the environment's name (``cls.name``): what their
            ``logging_tags()`` return; like every field of a builder, part of its rollout cache key.
        builder: the builder class, :class:`ProblemGroupBuilder` or a subclass of it (declared
            ``@dataclass(frozen=True)``; a new field needs a default), e.g. one whose
            ``make_envs_in(ctx)`` gives its envs a service of the rollout (``ctx.service(KEY)``)
            after ``make_envs()``.

    Returns:
        ``make``: a :func:`functools.partial` of ``builder`` (picklable); ``make(problem)`` is a
        builder of plain values, whose ``make_envs()`` loads the renderer and makes the envs.

    Raises:
        AttributeError: ``spec`` or ``ctx`` lacks one of the fields above. Nothing is loaded here:
            an unknown renderer name (``RendererError``) or a tokenizer that does not load
            (``OSError``) fails the builder's ``make_envs()``, inside the rollout.
    """
    return partial(
        builder,
        env_cls,
        group_size=ctx.group_size,
        renderer_name=ctx.renderer_name,
        tokenizer_id=ctx.tokenizer_id,
        format_coef=spec.format_coef,
        format_needs_stop=spec.format_needs_stop,
        convo_prefix=freeze_messages(convo_prefix(spec, shot)),
        question_suffix=suffix,
        tags=(tag,),
    )
