"""Off-policy and prompt distillation: the teacher's replies (or its top-K distribution) as a
supervised dataset, trained with the SFT pieces.

1. Prompts come from ``dataset`` (the ``prompts`` env's sources). For ``mode=prompt`` a seeded
   ``test_size`` share is held out and the teacher labels it greedily (``teacher-labels``).
2. ``sequences=teacher`` (and ``mode=prompt``): the ``teacher-samples`` task writes the teacher's
   replies to the training prompts into the store as a chat JSONL dataset (an asset, the
   teacher's weights upstream; cached); ``sequences=dataset``: the dataset's own conversations.
3. In the run session: ``prepare-dataset`` renders the sequences for the student --
   :class:`~prefect_tinker.recipes.builders.SupervisedBuilder` for SFT on the teacher's tokens, or
   :class:`~prefect_tinker.recipes.distill.soft_data.SoftTargetBuilder` with
   ``soft_targets=true``; each step trains one batch with ``train-step`` (``cross_entropy``;
   soft targets: the cached ``teacher-topk`` rows of the batch's sequences as ``(N, K)`` targets,
   the teacher shown its own rendering of the prompt).
4. Evaluators: held-out NLL of the sequences' reply tokens (``test/nll``) and, for
   ``mode=prompt``, :class:`~prefect_tinker.tasks.distill_eval.TeacherAgreementEvaluator`
   (``eval/teacher_agreement``).

Metrics: ``train/loss`` (nats per trained token; SFT), or ``train/soft_ce`` (cross-entropy with
the teacher's renormalised top-K per position), ``train/soft_kl`` (``soft_ce`` minus the
teacher's entropy) and ``train/teacher_entropy``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

from prefect import get_run_logger

from prefect_tinker.flows.distill_config import DistillConfig
from prefect_tinker.flows.distill_loop import Teacher, soft_datum
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.builders import Example, SupervisedData
from prefect_tinker.recipes.data_pipeline import batch_at
from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.datasets import datum_from_example, split_conversations
from prefect_tinker.recipes.distill.prompts import PromptRecord, load_prompts
from prefect_tinker.recipes.distill.soft_data import SoftData, SoftExample
from prefect_tinker.recipes.distill.targets import soft_targets
from prefect_tinker.recipes.rl.envs.prompts import PromptEnv, prompt_sources
from prefect_tinker.tasks.clients import tokenizer
from prefect_tinker.tasks.data import prepare_dataset
from prefect_tinker.tasks.distill_eval import TeacherAgreementEvaluator
from prefect_tinker.tasks.evaluators import NLLEvaluator
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.teacher import TeacherSamples, read_samples, teacher_asset, teacher_samples, teacher_topk
from prefect_tinker.tasks.training import model_input_tokens, train_step

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["run_offline"]


def _sources_uris(sources: list[SourceSpec]) -> list[str]:
    from pathlib import Path

    from prefect_tinker.recipes.builtin_datasets import resolve_source_path

    out = []
    for s in sources:
        p = Path(resolve_source_path(s.path))
        out.append(p.resolve().as_uri() if p.exists() else f"hf://datasets/{s.path}")
    return out


def _sample(
    config: DistillConfig,
    teacher: Teacher,
    records: list[PromptRecord],
    tokenizer_id: str,
    upstream: list[str],
    *,
    temperature: float,
    num_samples: int,
    keep_truncated: bool,
    name: str,
) -> TeacherSamples:
    return teacher_samples(
        teacher.credentials,
        teacher.weights,
        records,
        renderer=teacher.renderer_name,
        tokenizer_id=tokenizer_id,
        view=teacher.view,
        max_tokens=config.teacher_max_tokens,
        temperature=temperature,
        seed=config.seed,
        num_samples=num_samples,
        keep_truncated=keep_truncated,
        store=config.store,
        upstream=upstream,
        name=name,
    )


def _labels(uri: str, records: list[PromptRecord]) -> list[str]:
    by_id: dict[str, str] = {}
    with open(read_samples(uri), encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            by_id.setdefault(row["prompt_id"], row["messages"][-1]["content"])
    return [by_id[r.id] for r in records]


def run_offline(config: DistillConfig, teachers: list[Teacher], credentials: TinkerCredentials) -> dict[str, Any]:
    """Run ``mode=off_policy`` or ``mode=prompt`` (see the module docstring) with the student's
    backend ``credentials`` (resolved once, by the flow); returns the summary."""
    log = get_run_logger()
    (teacher,) = teachers
    sources = prompt_sources(config.prompt_spec())
    upstream = [teacher_asset(teacher.weights), *_sources_uris(sources)]
    held_out: list[PromptRecord] = []
    labels: list[str] = []
    samples: TeacherSamples | None = None
    tok_id = teacher.renderer.tokenizer.name_or_path
    if config.sequences == "teacher" or config.mode == "prompt":
        records = [r for i, s in enumerate(sources) for r in load_prompts(s, source=i)]
        if config.mode == "prompt" and config.test_size:
            records, held_out = split_conversations(records, config.test_count(), seed=config.seed)
        samples = _sample(
            config,
            teacher,
            records,
            tok_id,
            upstream,
            temperature=config.teacher_temperature,
            num_samples=config.samples_per_prompt,
            keep_truncated=config.keep_truncated,
            name="teacher-samples",
        )
        log.info("teacher samples: %d rows (%d truncated dropped) at %s", samples.rows, samples.dropped, samples.uri)
        if held_out:
            lab = _sample(
                config,
                teacher,
                held_out,
                tok_id,
                upstream,
                temperature=0.0,
                num_samples=1,
                keep_truncated=True,
                name="teacher-labels",
            )
            labels = _labels(lab.uri, held_out)
        opts = {"system_prompt": config.system_prompt} if config.system_prompt else {}
        data_sources = [SourceSpec(path=read_samples(samples.uri), format="messages", options=opts)]
        test_size = 0 if config.mode == "prompt" else config.test_count()
    else:
        data_sources, test_size = sources, config.test_count()

    extra = [samples.uri] if samples else []
    with RunSession(
        config.with_sequences(data_sources, test_size), credentials=credentials, upstream=[*upstream, *extra]
    ) as session:
        data = cast(SupervisedData | SoftData, prepare_dataset(session.dataset_builder, session.tokenizer_id))
        from prefect_tinker.recipes.renderers import get_renderer

        student_renderer = get_renderer(session.renderer, tokenizer(session.tokenizer_id))
        total = config.max_steps
        log.info(
            "%d train / %d test sequences, %d steps (renderer %s); %s",
            len(data.train),
            len(data.test),
            total,
            data.renderer,
            data.skip_summary,
        )
        evaluators: list = []
        test = [_hard_datum(ex) for ex in data.test]
        if test:
            evaluators.append(NLLEvaluator(test))
        if labels:
            prompts = [
                student_renderer.build_generation_prompt(PromptEnv(r, None, config.system_prompt).messages()).to_ints()
                for r in held_out
            ]
            evaluators.append(
                TeacherAgreementEvaluator(
                    prompts,
                    labels,
                    student_renderer,
                    max_tokens=config.eval_max_tokens,
                    first_line=config.agreement_first_line,
                )
            )

        def one_step(step: int) -> dict[str, float]:
            batch = [data.train[i] for i in batch_at(len(data.train), config.batch_size, config.seed, step)]
            if not config.soft_targets:  # a SupervisedBuilder built the data: Examples
                datums = [datum_from_example(ex.tokens, ex.weights) for ex in cast(list[Example], batch)]
                session.run, m = train_step(
                    session.credentials,
                    session.run,
                    step,
                    quote(datums),
                    config.lr_at(step, total),
                    config.adam.model_dump(),
                )
                return {**{f"train/{k}": v for k, v in m.items()}, "tokens/trained": float(model_input_tokens(datums))}
            datums, positions, entropy = _soft_batch(  # a SoftTargetBuilder built the data: SoftExamples
                config,
                teacher,
                cast(list[SoftExample], batch),
                student_renderer,
                session.renderer,
                step,
                len(student_renderer.tokenizer),
            )
            session.run, m = train_step(
                session.credentials,
                session.run,
                step,
                quote(datums),
                config.lr_at(step, total),
                config.adam.model_dump(),
                loss_fn="cross_entropy",
            )
            n = max(positions, 1)
            out = {f"train/{k}": v for k, v in m.items() if k not in ("loss", "tokens")}
            out.update(
                {
                    "train/soft_ce": m["loss_sum"] / n,
                    "train/soft_kl": (m["loss_sum"] - entropy) / n,
                    "train/teacher_entropy": entropy / n,
                    "train/positions": float(positions),
                    "tokens/trained": float(model_input_tokens(datums)),
                }
            )
            return out

        StepLoop(session, total, evaluators=evaluators).run(one_step)
        loss = "train/soft_ce" if config.soft_targets else "train/loss"
        (first, last), (nll0, nll1) = session.metric_ends(loss), session.metric_ends("test/nll")
        (agree0, agree1) = session.metric_ends("eval/teacher_agreement")
        return session.finish(
            {
                "mode": config.mode,
                "first_loss": first,
                "last_loss": last,
                "first_test_nll": nll0,
                "last_test_nll": nll1,
                "first_agreement": agree0,
                "last_agreement": agree1,
                "teacher_samples": samples.uri if samples else None,
                "teacher_rows": samples.rows if samples else None,
                "teachers": [teacher.weights],
            },
            title_fields={
                "mode": config.mode,
                "teacher": f"`{teacher.weights}`",
                "targets": "top-K soft" if config.soft_targets else "teacher tokens",
            },
        )


def _hard_datum(ex: Any):
    """The held-out datum of a supervised example or of a soft-target sequence (its reply tokens)."""
    if isinstance(ex, SoftExample):
        w = [0.0] * ex.prompt_len + [1.0] * (len(ex.tokens) - ex.prompt_len)
        return datum_from_example(ex.tokens, w)
    return datum_from_example(ex.tokens, ex.weights)


def _soft_batch(
    config: DistillConfig,
    teacher: Teacher,
    batch: list[SoftExample],
    student_renderer: Any,
    student_renderer_name: str,
    step: int,
    vocab: int,
) -> tuple[list, int, float]:
    aligned = [
        teacher.align(ex.prompt, ex.prompt_len, ex.tokens[ex.prompt_len :], student_renderer, student_renderer_name)
        for ex in batch
    ]
    rows = teacher_topk.with_options(task_run_name=f"teacher-topk-step-{step}")(
        teacher.credentials, teacher.weights, quote([al.teacher_tokens for al in aligned]), config.topk
    )
    datums, positions, entropy = [], 0, 0.0
    for ex, al, (ids, lps) in zip(batch, aligned, rows, strict=True):
        st = soft_targets(
            ids,
            lps,
            al.one_to_one(),
            n_targets=len(ex.tokens) - 1,
            k=config.topk,
            vocab_size=min(vocab, teacher.vocab_size),
        )
        datums.append(soft_datum(ex.tokens, st))
        positions, entropy = positions + st.positions, entropy + st.entropy_sum
    return datums, positions, entropy
