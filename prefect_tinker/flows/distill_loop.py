"""The on-policy parts of distillation, on the RL machinery.

:class:`Teacher` is an opened teacher (weights, credentials, its own renderer and view).
:class:`DistillLoop` is an :class:`~prefect_tinker.flows.rl.RLLoop` (rollout tasks on the
``prompts`` env, sampler saves, trajectory rows) whose ``prepare`` turns groups into datums with
the teachers' signal instead of rewards:

- on-policy (:meth:`DistillLoop.prepare`, run by any RL schedule): each completion is framed for
  its teacher (:func:`~prefect_tinker.recipes.distill.align.align_completion`), the cached
  ``teacher-logprobs`` task scores it, and the per-token reverse-KL advantages
  (:func:`~prefect_tinker.recipes.distill.targets.kl_advantages`) are added to the datum's
  (reward) advantages; ``train/teacher_kl`` is the mean ``logp_student - logp_teacher`` over the
  aligned completion tokens (nats per token), per teacher ``train/teacher_kl/<i>`` when several;
- SDFT (:meth:`DistillLoop.soft_datums` and :class:`SDFTStep`): the teacher's top-K at each
  completion position (cached ``teacher-topk``) become ``(N, K)`` soft targets; the step trains
  them with ``cross_entropy`` (forward KL, ``train-step``) or the reverse KL
  (:class:`~prefect_tinker.recipes.distill.targets.ReverseKLLoss`, ``custom-step``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker

from prefect_tinker.flows.distill_config import DistillConfig
from prefect_tinker.flows.rl import RLLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.distill.align import Alignment, align_completion, gather_teacher
from prefect_tinker.recipes.distill.prompts import PromptRecord, TeacherView
from prefect_tinker.recipes.distill.targets import ReverseKLLoss, SoftTargets, kl_advantages, soft_targets
from prefect_tinker.recipes.renderers.base import Renderer
from prefect_tinker.recipes.rl.advantages import RLDatum, compute_advantages, trajectory_to_datums
from prefect_tinker.recipes.rl.envs.prompts import PromptGroupBuilder
from prefect_tinker.recipes.rl.types import RLDataset, TrajectoryGroup
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.teacher import teacher_logprobs, teacher_topk
from prefect_tinker.tasks.training import custom_step, model_input_tokens, train_step
from prefect_tinker.tasks.usage import run_task

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["DistillLoop", "SDFTStep", "Teacher", "soft_datum"]


@dataclass
class Teacher:
    """An opened teacher: ``weights`` (``base:<model>`` / ``tinker://...``), the ``credentials``
    of its backend, its ``renderer`` (built on the shared tokenizer) and ``view``."""

    index: int
    weights: str
    credentials: TinkerCredentials
    renderer_name: str
    renderer: Any
    view: TeacherView
    vocab_size: int

    def prompt_tokens(self, record: PromptRecord) -> list[int]:
        """The teacher renderer's generation prompt of the teacher's messages for ``record``."""
        return self.renderer.build_generation_prompt(self.view.messages(record)).to_ints()

    def align(
        self,
        record: PromptRecord,
        student_prompt_len: int,
        completion: list[int],
        student_renderer: Any,
        student_renderer_name: str,
    ) -> Alignment:
        return align_completion(
            student_prompt_len,
            completion,
            self.prompt_tokens(record),
            student_renderer=student_renderer,
            teacher_renderer=self.renderer,
            same_format=self.renderer_name == student_renderer_name,
        )


def soft_datum(tokens: list[int], st: SoftTargets) -> tinker.Datum:
    """The ``cross_entropy`` datum of a sequence (L,) with ``(L-1, K)`` soft targets."""
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.ascontiguousarray(st.target_tokens, dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ascontiguousarray(st.weights, dtype=np.float32)),
        },
    )


class DistillLoop(RLLoop):
    """:class:`~prefect_tinker.flows.rl.RLLoop` with the teachers' signal (see the module docstring).

    Args:
        teachers: opened teachers; a prompt record's ``source`` picks its teacher.
        student_renderer: the run's renderer object (its name is ``session.renderer``).
    """

    config: DistillConfig  # the session's config (a DistillConfig here)

    def __init__(
        self,
        session: RunSession[DistillConfig],
        dataset: RLDataset,
        teachers: list[Teacher],
        student_renderer: Renderer,
    ):
        super().__init__(session, dataset, reference="")
        self.teachers, self.student_renderer = teachers, student_renderer
        self.kl: list[tuple[int, float]] = []

    def rewind(self, step: int) -> None:
        super().rewind(step)
        self.kl = [k for k in self.kl if k[0] < step]

    def _members(self, groups: list[TrajectoryGroup]):
        """``(record, transition, datum)`` of every single-turn trajectory with a completion."""
        c = self.config
        for g in groups:
            builder = self.dataset.get_batch(g.batch_index)[g.group_index]
            if not isinstance(builder, PromptGroupBuilder):
                raise TypeError(f"distillation rolls out prompt records, got {type(builder).__name__}")
            record = builder.record
            adv = compute_advantages(g.total_rewards(), c.normalize_advantages_std)
            for i, (traj, a) in enumerate(zip(g.trajectories_G, adv, strict=True)):
                ds = trajectory_to_datums(traj, float(a), g.group_index, i)
                if len(ds) != 1 or len(traj.transitions) != 1:
                    raise ValueError(
                        f"distillation needs single-turn episodes; batch {g.batch_index} group "
                        f"{g.group_index} member {i} gave {len(traj.transitions)} turns"
                    )
                yield record, traj.transitions[0], ds[0]

    def count_teacher(self, sequences: list[list[int]], cached: bool) -> None:
        """Add the teacher requests' inputs (``sequences``) to the step's ``teacher_prefill``
        tokens, unless the task cache answered them (``cached``)."""
        n = 0.0 if cached else float(sum(len(seq) for seq in sequences))
        self.usage["teacher_prefill"] = self.usage.get("teacher_prefill", 0.0) + n

    def prepare(self, groups: list[TrajectoryGroup]) -> tuple[list[RLDatum], dict[str, float]]:
        c, step = self.config, self.session.step
        items = list(self._members(groups))
        per: dict[int, list[tuple[RLDatum, Alignment]]] = {}
        for record, t, d in items:
            teacher = self.teachers[record.source]
            al = teacher.align(
                record, len(t.observation), list(t.action_tokens), self.student_renderer, self.session.renderer
            )
            per.setdefault(teacher.index, []).append((d, al))
        kl_sum, n_sum, metrics = 0.0, 0.0, {}
        for ti, pairs in sorted(per.items()):
            teacher = self.teachers[ti]
            sequences = [al.teacher_tokens for _, al in pairs]
            lps, cached = run_task(
                teacher_logprobs.with_options(task_run_name=f"teacher-logprobs-step-{step}-t{ti}"),
                teacher.credentials,
                teacher.weights,
                quote(sequences),
            )
            self.count_teacher(sequences, cached)
            t_kl = t_n = 0.0
            for (d, al), lp in zip(pairs, lps, strict=True):
                values, aligned = gather_teacher(al, lp, len(d.mask))
                mask = aligned * d.mask
                adv, kl = kl_advantages(
                    d.sampler_logprobs, values, mask, coef=c.kl_penalty_coef, discount=c.kl_discount_factor
                )
                d.advantages = (d.advantages + adv).astype(np.float32)
                t_kl, t_n = t_kl + float(kl.sum()), t_n + float(mask.sum())
            if len(self.teachers) > 1:
                metrics[f"train/teacher_kl/{ti}"] = t_kl / max(t_n, 1.0)
            kl_sum, n_sum = kl_sum + t_kl, n_sum + t_n
        metrics["train/teacher_kl"] = kl_sum / max(n_sum, 1.0)
        metrics["train/teacher_tokens"] = n_sum
        self.kl.append((step, metrics["train/teacher_kl"]))
        datums = [d for _, _, d in items]
        metrics["train/advantage_abs_mean"] = (
            float(np.mean([np.abs(d.advantages[d.mask > 0]).mean() for d in datums if d.mask.any()])) if datums else 0.0
        )
        return datums, metrics

    def soft_datums(self, groups: list[TrajectoryGroup]) -> tuple[list[tinker.Datum], dict[str, float]]:
        """SDFT: one ``(N, K)`` soft-target datum per trajectory; metrics ``sdft/teacher_entropy``
        (mean renormalised teacher entropy per distilled position, nats), ``sdft/positions``,
        ``sdft/dropped_ids`` and the sums the step needs."""
        c, step = self.config, self.session.step
        items = list(self._members(groups))
        per: dict[int, list[tuple[list[int], Alignment, int]]] = {}
        for record, t, d in items:
            teacher = self.teachers[record.source]
            al = teacher.align(
                record, len(t.observation), list(t.action_tokens), self.student_renderer, self.session.renderer
            )
            per.setdefault(teacher.index, []).append((d.tokens, al, len(t.observation) - 1))
        datums, positions, entropy, dropped = [], 0, 0.0, 0
        for ti, rows in sorted(per.items()):
            teacher = self.teachers[ti]
            sequences = [al.teacher_tokens for _, al, _ in rows]
            topk, cached = run_task(
                teacher_topk.with_options(task_run_name=f"teacher-topk-step-{step}-t{ti}"),
                teacher.credentials,
                teacher.weights,
                quote(sequences),
                c.topk,
            )
            self.count_teacher(sequences, cached)
            for (tokens, al, s0), (ids, lps) in zip(rows, topk, strict=True):
                pairs = [(s, t) for s, t in al.one_to_one() if s - s0 >= c.skip_first_tokens]
                st = soft_targets(
                    ids,
                    lps,
                    pairs,
                    n_targets=len(tokens) - 1,
                    k=c.topk,
                    vocab_size=min(teacher.vocab_size, self.student_vocab),
                )
                datums.append(soft_datum(tokens, st))
                positions, entropy, dropped = positions + st.positions, entropy + st.entropy_sum, dropped + st.dropped
        return datums, {
            "sdft/positions": float(positions),
            "sdft/entropy_sum": entropy,
            "sdft/teacher_entropy": entropy / max(positions, 1),
            "sdft/dropped_ids": float(dropped),
        }

    @property
    def student_vocab(self) -> int:
        return len(self.tokenizer)


class SDFTStep:
    """One SDFT step: rollouts on the current sampler, soft-target datums, one optimizer step
    (forward KL with ``cross_entropy``, or reverse KL through a client-side custom loss), fresh
    sampler weights. Metrics: ``sdft/kl`` (mean per distilled position, nats: forward ``CE - H``,
    from the loss before the update; reverse: the custom loss), ``sdft/teacher_entropy``,
    ``train/soft_ce`` (forward), ``env/*``, ``time/*``."""

    def __init__(self, loop: DistillLoop):
        self.loop = loop
        self.kls: list[tuple[int, float]] = []

    def rewind(self, step: int) -> None:
        self.loop.rewind(step)
        self.kls = [k for k in self.kls if k[0] < step]

    def step(self, step: int) -> dict[str, float]:
        loop, c, s = self.loop, self.loop.config, self.loop.session
        t0, counters = time.perf_counter(), dict[str, float]()
        groups = [g for f in loop.map_batch(step) if (g := loop.collect(f, counters)) is not None]
        if not groups:
            raise RuntimeError(f"step {step}: no rollout group survived ({int(counters.get('errors', 0))} errors)")
        t_roll = time.perf_counter() - t0
        datums, m = loop.soft_datums(groups)
        n = max(m["sdft/positions"], 1.0)
        lr = c.lr_at(step, loop.total)
        loop.usage["trained"] += float(model_input_tokens(datums))
        if c.reverse:  # forward_backward_custom: a forward, then the training pass
            loop.usage["prefill_uncached"] += float(model_input_tokens(datums))
            s.run, out = custom_step(
                s.credentials, s.run, step, quote(datums), ReverseKLLoss(), lr, c.adam.model_dump()
            )
            m["sdft/kl"] = out.get("kl", 0.0) / n
            m["sdft/student_entropy"] = out.get("student_entropy", 0.0) / n
        else:
            s.run, out = train_step(
                s.credentials, s.run, step, quote(datums), lr, c.adam.model_dump(), loss_fn="cross_entropy"
            )
            m["train/soft_ce"] = out["loss_sum"] / n
            m["sdft/kl"] = (out["loss_sum"] - m["sdft/entropy_sum"]) / n
        m.update({f"train/{k}": v for k, v in out.items() if k in ("learning_rate", "grad_norm", "step_seconds")})
        m.update({"rollout/errors": float(counters.get("errors", 0)), "time/rollout_seconds": t_roll})
        self.kls.append((step, m["sdft/kl"]))
        rows = loop.step_metrics(step, groups, m)
        rows.update(loop.end_step(t0))
        return rows

    def close(self) -> None:
        """Nothing in flight."""
