"""RL with verifiable rewards as one Prefect flow (GRPO-style group-centred advantages), on the
recipe skeleton.

The run session opens (or resumes, or initialises from ``load_checkpoint_path``) the run; the
registered environment (:mod:`prefect_tinker.recipes.rl.envs`) gives the batches of group
builders; the schedule (:mod:`prefect_tinker.flows.rl_schedules`: ``sync``, ``streaming`` or
``async``) is the step function of the shared step loop.

Each step: ``rollout-group`` tasks (mapped over the batch's groups; cached by sampler checkpoint,
batch, group and seed) -> advantages and datums (:mod:`prefect_tinker.recipes.rl.advantages`;
optional removal of constant-reward groups and KL penalty against a reference) ->
``forward-backward`` + ``optim-step`` per substep -> fresh sampler weights (every rollout after an
update samples from them) -> every ``save_every`` steps a state checkpoint, the buffered metrics
and trajectory rows written before its row.

Losses: ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo`` and ``stable_reinforce``
(``RLConfig.loss_fn_config``); with ``stable_reinforce`` the rollouts sample with
``record_stability_info=True`` clients and every datum carries ``Datum.with_provenance`` spans
naming the sampled sequences (:meth:`~prefect_tinker.recipes.rl.advantages.RLDatum.to_datum`).
With ``sampler_kind="inflight"`` (async schedule) each update publishes the weights to the run's
inflight sampling clients (``save_weights_and_get_sampling_client(kind="inflight")``), so
rollouts already in flight move to them without restarting.

Usage: each step reports ``tokens/sampled``, ``tokens/prefill_cached`` / ``tokens/prefill_uncached``
(the sampling requests of the groups it collected), ``tokens/reference_prefill`` (the KL-penalty
reference's logprob requests) and ``tokens/trained`` (the inputs of its ``forward_backward``
passes); the step loop adds their cost
and the run's totals (:mod:`prefect_tinker.recipes.pricing`).

Step convention (as in SFT): a metric recorded at step ``s`` belongs to the batch trained from
optimizer step ``s`` (with ``num_substeps = k``, steps are multiples of k); in the async schedule
``rollout/staleness_mean`` says how many steps older its samplers were. A resumed run reuses the
sampler checkpoint recorded with its last state, so the rollouts of the resumed step come from the
cache when they had run.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, cast

import numpy as np
from prefect import get_run_logger, unmapped
from tinker.types import LossFnType

from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.rl_config import SCHEDULES, RLConfig, RLTrainingConfig
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.rl.advantages import (
    apply_kl_penalty,
    groups_to_datums,
    remove_constant_reward_groups,
    rollout_metrics,
    sample_train_kl,
)
from prefect_tinker.recipes.rl.envs import get_env
from prefect_tinker.recipes.rl.types import RLDataset, TrajectoryGroup
from prefect_tinker.tasks.benchmark_evaluator import benchmark_evaluators
from prefect_tinker.tasks.clients import tokenizer
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.rollout_eval import session_env_evaluators
from prefect_tinker.tasks.rollouts import new_usage, reference_logprobs, rollout_group
from prefect_tinker.tasks.runners import map_task, submit_task
from prefect_tinker.tasks.training import forward_backward, model_input_tokens, optim_step, save_inflight_sampler
from prefect_tinker.tasks.usage import run_task

__all__ = ["RLConfig", "RLLoop", "rl_flow"]


class RLLoop:
    """What the schedules share: rollout tasks on the current sampler, datums, training tasks,
    sampler saves and the step's metrics, over an open :class:`RunSession`.

    Attributes:
        sampler_path: ``tinker://.../sampler_weights/...`` of the current weights (inflight:
            ``inflight:<model id>/step-<n>``, a label of the publication rollouts start on).
        sampler_client: the newest inflight sampling client (None for snapshot samplers).
        rewards: ``(step, mean reward)`` of every step of this invocation.
        k: optimizer steps per step (``num_substeps``); total: optimizer steps of the run.
        usage: tokens of the step so far (``sampled``, ``prefill_cached``, ``prefill_uncached``,
            ``reference_prefill``, ``trained``), reported and reset by :meth:`step_metrics`.
    """

    def __init__(self, session: RunSession[RLTrainingConfig], dataset: RLDataset, reference: str):
        self.session, self.config, self.dataset, self.reference = session, session.config, dataset, reference
        self.tokenizer = tokenizer(session.tokenizer_id)
        self.sampler_path = session.sampler_at(session.step)
        self.provenance = self.config.provenance
        self.inflight = self.config.sampler_kind == "inflight"
        self.sampler_client: Any = None
        # sequence ids live in one server session, inflight weights move: such rollouts are cached per invocation
        self.cache_scope = uuid.uuid4().hex if (self.provenance or self.inflight) else ""
        if self.inflight:
            self._publish()
        self.rewards: list[tuple[int, float]] = []
        self.k = self.config.num_substeps
        self.total = self.config.max_steps * self.k
        self.loss, self.loss_fn_config = self.config.loss(), self.config.loss_fn_config()
        self.objective, self.objective_inputs = self.loss.objective(), self.loss.objective_inputs()
        self.estimator = self.config.estimator()
        self.usage = {**new_usage(), "trained": 0.0, "reference_prefill": 0.0}
        self.log = get_run_logger()

    def _publish(self) -> None:
        """Publish the current weights to the run's inflight sampling clients."""
        s = self.session
        self.sampler_client = save_inflight_sampler(s.credentials, s.run, self.provenance)
        self.sampler_path = f"inflight:{s.run.model_id}/step-{s.step}"

    # ----- rollouts --------------------------------------------------------------------------
    def _args(self) -> tuple:
        c = self.config
        return (
            c.seed,
            c.max_tokens,
            c.temperature,
            c.rollout,
            self.session.step,
            self.provenance,
            self.sampler_client,
            self.cache_scope,
        )

    def submit(self, builder: Any, batch_index: int, group_index: int):
        """Submit one ``rollout-group`` task on the current sampler; returns its future."""
        return submit_task(
            self.config,
            rollout_group,
            self.session.credentials,
            self.sampler_path,
            builder,
            batch_index,
            group_index,
            *self._args(),
        )

    def map_batch(self, batch_index: int) -> list:
        """``rollout-group`` mapped over the groups of batch ``batch_index``; returns the futures."""
        builders = self.dataset.get_batch(batch_index)
        return list(
            map_task(
                self.config,
                rollout_group,
                unmapped(self.session.credentials),
                unmapped(self.sampler_path),
                builders,
                unmapped(batch_index),
                list(range(len(builders))),
                *(unmapped(a) for a in self._args()),
            )
        )

    def collect(self, future, counters: dict[str, float]) -> TrajectoryGroup | None:
        """The group of a finished rollout future, or None when it failed / came back empty
        (counted in ``counters``). Re-raises under the ``fail_fast`` and ``retry`` policies."""
        try:
            group = future.result()
        except Exception as exc:
            if self.config.rollout.mode != "min_viable":
                raise
            counters["errors"] = counters.get("errors", 0) + 1
            counters["groups_dropped"] = counters.get("groups_dropped", 0) + 1
            self.log.warning("rollout failed, group dropped: %s", exc)
            return None
        for k, v in group.usage.items():  # a collected group's sampling counts, kept or dropped
            self.usage[k] = self.usage.get(k, 0.0) + float(v)
        counters["errors"] = counters.get("errors", 0) + group.errors
        for msg in group.error_messages[:1]:
            self.log.warning("rollout error (%s policy): %s", self.config.rollout.mode, msg)
        if not group.trajectories_G:
            counters["groups_dropped"] = counters.get("groups_dropped", 0) + 1
            return None
        return group

    # ----- training --------------------------------------------------------------------------
    def prepare(self, groups: list[TrajectoryGroup]) -> tuple[list, dict[str, float]]:
        """Datums of ``groups`` (constant-reward groups removed if configured; KL penalty folded
        in) and the metrics of that preparation."""
        c = self.config
        metrics: dict[str, float] = {}
        constant = sum(np.ptp(np.asarray(g.total_rewards() or [0.0])) <= 1e-9 for g in groups)
        metrics["rollout/groups_constant"] = float(constant)
        if groups and constant == len(groups):
            self.log.warning(
                "no learning signal: all %d groups got constant rewards (zero advantages), "
                "so this step leaves the policy unchanged; check the reward (e.g. every reply "
                "malformed: try a few-shot prompt, a system prompt, more max_tokens or an SFT warm-up)",
                len(groups),
            )
        if c.remove_constant_reward_groups:
            groups, _ = remove_constant_reward_groups(groups)
        datums, advs = groups_to_datums(groups, estimator=self.estimator)
        metrics["train/advantage_abs_mean"] = float(np.mean(np.abs(np.concatenate(advs)))) if advs else 0.0
        if c.kl_penalty_coef > 0 and datums:
            ref, cached = run_task(
                reference_logprobs, self.session.credentials, self.reference, quote([d.tokens for d in datums])
            )
            if not cached:
                self.usage["reference_prefill"] += float(sum(len(d.tokens) for d in datums))
            kl = apply_kl_penalty(datums, [np.asarray(r) for r in ref], c.kl_penalty_coef)
            metrics["train/kl_policy_ref"] = kl["kl_policy_ref"]
        return datums, metrics

    def forward_backward(self, datums: list, accumulated: int) -> dict[str, float]:
        """The policy-gradient loss over ``datums`` accumulated into the gradients; returns
        ``loss_sum``, ``action_tokens``, ``datums``, sampler-vs-trainer KL and entropy
        (:func:`~prefect_tinker.recipes.rl.advantages.sample_train_kl`), ``fwd_bwd_seconds``, and an
        objective loss's own ``custom/*`` metrics (``custom/<name>_sum`` for its summed ones)."""
        s = self.session
        sdk_datums = [d.to_datum(self.provenance, self.objective_inputs) for d in datums]
        # quote: Prefect does not walk the datums looking for futures (~10 ms per 1,000 tokens);
        # a registered loss names one of the server's loss functions or defines its objective
        loss_fn = cast(LossFnType, self.loss.loss_fn or "cross_entropy")
        out = forward_backward(
            s.credentials, s.run, quote(sdk_datums), loss_fn, self.loss_fn_config, accumulated, self.objective
        )
        self.usage["trained"] += float(model_input_tokens(sdk_datums))
        metrics = sample_train_kl(datums, [np.asarray(lp) for lp in out.logprobs])
        metrics.update(
            {
                "loss_sum": out.loss_sum,
                "action_tokens": float(sum(float(d.mask.sum()) for d in datums)),
                "datums": float(len(datums)),
                "fwd_bwd_seconds": out.seconds,
            }
        )
        metrics.update({k: v for k, v in out.metrics.items() if k.startswith("custom/")})
        return metrics

    def optim_step(self) -> dict[str, float]:
        c, s = self.config, self.session
        s.run, m = optim_step(s.credentials, s.run, c.lr_at(s.step, self.total), c.adam.model_dump())
        return m

    # ----- bookkeeping -----------------------------------------------------------------------
    def step_metrics(self, step: int, groups: list[TrajectoryGroup], extra: dict[str, float]) -> dict[str, float]:
        """The step's metrics (``env/*`` from the groups, plus ``extra``); buffers a sample of the
        trajectories."""
        env = rollout_metrics(groups)
        rows = {f"env/{k}": v for k, v in env.items()}
        rows.update(extra)
        rows.update({f"tokens/{k}": float(v) for k, v in self.usage.items()})
        self.usage = {k: 0.0 for k in self.usage}
        self.rewards.append((step, env["reward_mean"]))
        self.session.buffer("trajectories", self._trajectories(step, groups))
        self.log.info(
            "step %d: reward %.3f correct %.3f (%d groups)",
            step,
            env["reward_mean"],
            env.get("correct_rate", float("nan")),
            len(groups),
        )
        return rows

    def _trajectories(self, step: int, groups: list[TrajectoryGroup]) -> list[dict[str, Any]]:
        n, out = self.config.log_trajectories, list[dict[str, Any]]()
        for g in groups:
            adv = self.estimator(g.total_rewards())
            for i, (traj, reward) in enumerate(zip(g.trajectories_G, g.total_rewards(), strict=True)):
                if len(out) >= n:
                    return out
                first = traj.transitions[0]
                info = {
                    **{k: v for t in traj.transitions for k, v in t.metrics.items()},
                    **{k: v for t in traj.transitions for k, v in t.logs.items() if k != "response"},
                }
                out.append(
                    dict(
                        step=step,
                        sampler_step=g.sampler_step,
                        batch_index=g.batch_index,
                        group_index=g.group_index,
                        member=i,
                        prompt=self.tokenizer.decode(first.observation),
                        response="".join(self.tokenizer.decode(t.action_tokens) for t in traj.transitions),
                        reward=float(reward),
                        advantage=float(adv[i]),
                        metrics_json=json.dumps(info, default=str),
                    )
                )
        return out

    def end_step(self, t_start: float) -> dict[str, float]:
        """After an update: fresh sampler weights (recorded with the next checkpoint); returns
        the ``time/*`` metrics of the save and the whole step."""
        t0 = time.perf_counter()
        if self.inflight:
            self._publish()
        else:
            self.sampler_path = self.session.save_sampler()
        return {"time/save_seconds": time.perf_counter() - t0, "time/step_seconds": time.perf_counter() - t_start}

    def rewind(self, step: int) -> None:
        """After a rewind to ``step``: sample from that step's weights again."""
        self.rewards = [r for r in self.rewards if r[0] < step]
        self.usage = {k: 0.0 for k in self.usage}
        if self.inflight:
            self._publish()
        else:
            self.sampler_path = self.session.samplers[step]


@recipe_flow("rl", "rl-{config.run_name}")
def rl_flow(config: RLConfig) -> dict[str, Any]:
    """Train ``config.model`` with RL on ``config.env``; returns a summary (steps, mean reward of
    the first and last steps of this invocation, checkpoints, store)."""
    with RunSession(config) as session:
        last = session.resumed_from
        if last and last["step"] % config.num_substeps:
            raise ValueError(
                f"run {config.run_name!r}: last checkpoint at optimizer step {last['step']} is not a "
                f"multiple of num_substeps={config.num_substeps}; resume with the num_substeps it was started with"
            )
        if session.step not in session.samplers:
            session.save_sampler(record=True)
        reference = config.kl_reference or session.samplers.get(0) or f"base:{session.model}"
        ctx = session.context
        assert ctx.env is not None  # the RL config's env_context gave one
        dataset = get_env(config.env).build(config, ctx.env)
        loop = RLLoop(session, dataset, reference)
        schedule = SCHEDULES[config.schedule](loop)
        t0 = time.perf_counter()
        try:
            StepLoop(
                session,
                loop.total,
                step_size=loop.k,
                on_rewind=schedule.rewind,
                evaluators=[
                    *benchmark_evaluators(ctx),
                    *session_env_evaluators(config, replace(ctx.env, initial_sampler=session.samplers.get(0))),
                ],
            ).run(schedule.step)
        finally:
            schedule.close()
        seconds, steps_run = time.perf_counter() - t0, len(loop.rewards)
        return session.finish(
            {
                "steps": session.step // config.num_substeps,
                "optimizer_steps": session.step,
                "schedule": config.schedule,
                "steps_this_invocation": steps_run,
                "seconds": seconds,
                "steps_per_minute": 60.0 * steps_run / seconds if seconds > 0 else float("nan"),
                "first_reward": loop.rewards[0][1] if loop.rewards else None,
                "last_reward": loop.rewards[-1][1] if loop.rewards else None,
                "rewards": [r for _, r in loop.rewards],
                "sampler_path": loop.sampler_path,
                "tokenizer_id": session.tokenizer_id,
            },
            title_fields={"env": f"`{config.env}`", "schedule": config.schedule},
        )
