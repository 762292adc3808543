"""Distillation as one Prefect flow with four modes, on the recipe skeleton.

``distill_flow(config)`` (:class:`~prefect_tinker.flows.distill_config.DistillConfig`):

1. the teachers are opened and checked before anything trains (``check-teacher``: the checkpoint
   exists, the tokenizer is the student's, the server returns top-``topk`` logprobs);
2. the mode runs in a :class:`~prefect_tinker.flows.session.RunSession` with the shared step loop:

   - ``on_policy``: the RL schedules (``sync`` / ``streaming`` / ``async``) on the ``prompts``
     env, with :class:`~prefect_tinker.flows.distill_loop.DistillLoop` (teacher logprobs ->
     reverse-KL advantages) -- rollouts, sampler saves, trajectory rows as in RL;
   - ``sdft``: rollouts on the prompts (questions), top-K soft targets from the frozen teacher shown
     the golden answer, :class:`~prefect_tinker.flows.distill_loop.SDFTStep`;
   - ``off_policy`` / ``prompt``: :mod:`prefect_tinker.flows.distill_offline` (teacher samples ->
     SFT or top-K soft targets; held-out agreement with the teacher).

Teacher logprobs, top-K rows and samples are cached tasks keyed by (teacher weights, sequences),
so a resumed run gets them from the cache. Step convention as in RL and SFT: a metric at step
``s`` belongs to the batch trained from optimizer step ``s``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from prefect_tinker.flows.config import resolve_credentials
from prefect_tinker.flows.distill_config import DistillConfig, TeacherSpec
from prefect_tinker.flows.distill_loop import DistillLoop, SDFTStep, Teacher
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.rl_config import SCHEDULES
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.rl.envs import build_rl_dataset
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.teacher import check_teacher, teacher_asset, weights_tokenizer

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["DistillConfig", "TeacherSpec", "distill_flow", "open_teachers"]


def open_teachers(config: DistillConfig, student_credentials: TinkerCredentials, *, topk: int = 0) -> list[Teacher]:
    """Open and check every teacher of ``config`` (``check-teacher``), before training.

    Raises:
        TeacherError: a missing checkpoint, another tokenizer than the student's, a top-K the
            teacher's server does not return.
        RendererError: an unknown teacher renderer.
    """
    from prefect_tinker.recipes.renderers import get_renderer, resolve_renderer_name

    student = config.start_weights()[0]  # the base model (a model= reference resolved)
    student_tok = weights_tokenizer(student_credentials, f"base:{student}")
    out = []
    for i, spec in enumerate(config.resolved_teachers()):
        creds = resolve_credentials(spec.backend) if spec.backend is not None else student_credentials
        info = check_teacher.with_options(task_run_name=f"check-teacher-{i}")(
            creds, spec.weights, quote(student_tok), student, topk
        )
        name = resolve_renderer_name(spec.renderer, student_tok)
        out.append(
            Teacher(i, spec.weights, creds, name, get_renderer(name, student_tok), spec.view(), info["vocab_size"])
        )
    return out


def _loop(session: RunSession[DistillConfig], config: DistillConfig, teachers: list[Teacher]) -> DistillLoop:
    from prefect_tinker.recipes.renderers import get_renderer
    from prefect_tinker.tasks.clients import tokenizer

    if session.step not in session.samplers:
        session.save_sampler(record=True)
    spec = config.prompt_spec()
    dataset = build_rl_dataset(
        spec,
        renderer_name=session.renderer,
        tokenizer_id=session.tokenizer_id,
        group_size=config.group_size,
        groups_per_batch=config.groups_per_batch,
        seed=config.seed,
    )
    return DistillLoop(session, dataset, teachers, get_renderer(session.renderer, tokenizer(session.tokenizer_id)))


def _on_policy(config: DistillConfig) -> dict[str, Any]:
    credentials = resolve_credentials(config.backend)
    teachers = open_teachers(config, credentials)
    with RunSession(
        config,
        credentials=credentials,
        upstream=[teacher_asset(t.weights) for t in teachers],
    ) as session:
        last = session.resumed_from
        if last and last["step"] % config.num_substeps:
            raise ValueError(
                f"run {config.run_name!r}: last checkpoint at optimizer step {last['step']} is not a "
                f"multiple of num_substeps={config.num_substeps}"
            )
        loop = _loop(session, config, teachers)
        schedule = SCHEDULES[config.schedule](loop)
        t0 = time.perf_counter()
        try:
            StepLoop(session, loop.total, step_size=loop.k, on_rewind=schedule.rewind).run(schedule.step)
        finally:
            schedule.close()
        first, last_kl = session.metric_ends("train/teacher_kl")
        return session.finish(
            {
                "mode": config.mode,
                "first_teacher_kl": first,
                "last_teacher_kl": last_kl,
                "teacher_kl": [k for _, k in loop.kl],
                "seconds": time.perf_counter() - t0,
                "sampler_path": loop.sampler_path,
                "teachers": [t.weights for t in teachers],
            },
            title_fields={"mode": config.mode, "teachers": ", ".join(f"`{t.weights}`" for t in teachers)},
        )


def _check_answers(config: DistillConfig) -> None:
    """SDFT's teacher is shown each prompt's golden answer: refuse, before training, a dataset
    whose records have none (naming the first)."""
    from prefect_tinker.recipes.distill.prompts import load_prompts
    from prefect_tinker.recipes.rl.envs.prompts import prompt_sources

    spec = config.prompt_spec()
    for i, source in enumerate(prompt_sources(spec)):
        missing = next((r for r in load_prompts(source, source=i) if r.answer is None), None)
        if missing is not None:
            raise ValueError(
                f"mode=sdft: {missing.id} has no golden answer (its last message must be the "
                "assistant's reply the teacher is shown)"
            )


def _sdft(config: DistillConfig) -> dict[str, Any]:
    _check_answers(config)
    credentials = resolve_credentials(config.backend)
    teachers = open_teachers(config, credentials, topk=config.topk)
    with RunSession(
        config,
        credentials=credentials,
        upstream=[teacher_asset(t.weights) for t in teachers],
    ) as session:
        loop = _loop(session, config, teachers)
        step = SDFTStep(loop)
        StepLoop(session, loop.total, on_rewind=step.rewind).run(step.step)
        (first, last_kl), (first_h, last_h) = (
            session.metric_ends("sdft/kl"),
            session.metric_ends("sdft/teacher_entropy"),
        )
        return session.finish(
            {
                "mode": config.mode,
                "reverse": config.reverse,
                "first_kl": first,
                "last_kl": last_kl,
                "kl": [k for _, k in step.kls],
                "first_teacher_entropy": first_h,
                "last_teacher_entropy": last_h,
                "sampler_path": loop.sampler_path,
                "teachers": [t.weights for t in teachers],
            },
            title_fields={"mode": "sdft" + (" (reverse KL)" if config.reverse else ""), "topk": config.topk},
        )


@recipe_flow("distill", "distill-{config.mode}-{config.run_name}")
def distill_flow(config: DistillConfig) -> dict[str, Any]:
    """Distil ``config.teacher`` (or ``teachers``) into ``config.model`` in ``config.mode``;
    returns a summary (the mode's first and last distillation metrics, steps, checkpoints)."""
    get_run_logger().info("distill mode %s: teachers %s", config.mode, [t.weights for t in config.resolved_teachers()])
    if config.mode == "on_policy":
        return _on_policy(config)
    if config.mode == "sdft":
        return _sdft(config)
    from prefect_tinker.flows.distill_offline import run_offline

    credentials = resolve_credentials(config.backend)
    return run_offline(
        config, open_teachers(config, credentials, topk=config.topk if config.soft_targets else 0), credentials
    )
