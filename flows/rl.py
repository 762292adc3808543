"""RL with verifiable rewards as one Prefect flow (GRPO-style group-centred advantages).

Pipeline: resolve the backend -> open (or resume, or initialise from ``load_checkpoint_path``) the
training run -> the env's dataset -> sampler weights of the current step -> the schedule's loop
(:mod:`prefect_tinker.flows.rl_schedules`: ``sync``, ``streaming`` or ``async``) -> summary artifact.

Each step: ``rollout-group`` tasks (mapped over the batch's groups; cached by sampler checkpoint,
batch, group and seed) -> advantages and datums (:mod:`prefect_tinker.recipes.rl.advantages`; optional removal of
constant-reward groups and KL penalty against a reference) -> ``rl-forward-backward`` +
``rl-optim-step`` per substep -> fresh sampler weights (``save-sampler-weights``; every rollout
after an update samples from them) -> every ``save_every`` steps a state checkpoint, with the
buffered metrics and trajectory rows written to the store before its row. At the end of a successful
run its store tables are compacted to one part each (``compact-run``).

Step convention (as in SFT): a metric recorded at step ``s`` belongs to the batch trained from
optimizer step ``s`` (with ``num_substeps = k``, steps are multiples of k); in the async schedule
``rollout/staleness_mean`` says how many steps older its samplers were. Re-running with the same
``run_name`` resumes after the last state checkpoint; the sampler checkpoint recorded with it is
reused, so the rollouts of the resumed step come from the cache when they had run.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote

from prefect_tinker.flows.config import resolve_credentials
from prefect_tinker.flows.rl_config import RLConfig
from prefect_tinker.recipes.rl.advantages import (
    apply_kl_penalty, compute_advantages, groups_to_datums, remove_constant_reward_groups, rollout_metrics,
)
from prefect_tinker.recipes.rl.envs import build_rl_dataset
from prefect_tinker.recipes.rl.types import TrajectoryGroup
from prefect_tinker.tasks.records import (
    check_store, compact_finished_run, record_checkpoint, record_run, write_metrics, write_trajectories,
)
from prefect_tinker.tasks.reporting import RL_CURVES, report_run
from prefect_tinker.tasks.rl_training import rl_forward_backward, rl_optim_step, save_sampler_weights
from prefect_tinker.tasks.rollouts import reference_logprobs, rollout_group
from prefect_tinker.tasks.training import ClientRewound, TrainingRun, open_training_run, save_checkpoint

__all__ = ["RLConfig", "rl_flow", "RLLoop", "rl_lr_at"]


def rl_lr_at(config: RLConfig, step: int, total: int) -> float:
    """Learning rate at optimizer step ``step`` of ``total``: constant, or linear / cosine decay to 0."""
    frac = min(step / max(total, 1), 1.0)
    if config.lr_schedule == "linear":
        return config.learning_rate * (1.0 - frac)
    if config.lr_schedule == "cosine":
        return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * frac))
    return config.learning_rate


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """Merge per-minibatch metrics: sums for counts/seconds, token-weighted means for the rest."""
    if not parts:
        return {}
    out: dict[str, float] = {}
    weights = [p.get("action_tokens", 1.0) for p in parts]
    for k in parts[0]:
        vals = [p.get(k, 0.0) for p in parts]
        if k in ("loss_sum", "action_tokens", "datums") or k.endswith("seconds"):
            out[k] = float(sum(vals))
        elif k == "learning_rate":
            out[k] = float(vals[-1])
        else:
            out[k] = float(np.average(vals, weights=weights)) if sum(weights) > 0 else float(np.mean(vals))
    return out


class RLLoop:
    """State shared by the schedules: the run handle, the current sampler, buffered store rows.

    Attributes:
        run: the training run handle (``run.step`` = optimizer steps taken).
        sampler_path: ``tinker://.../sampler_weights/...`` of the current weights.
        samplers: optimizer step -> sampler path, for every sampler saved (rewinds use it).
        pending / pending_traj: metric rows ``(step, name, value)`` and trajectory rows not yet written.
    """

    def __init__(self, config: RLConfig, credentials: Any, run: TrainingRun, dataset: Any, tokenizer: Any,
                 samplers: dict[int, str], reference: str):
        self.config, self.credentials, self.run = config, credentials, run
        self.dataset, self.tokenizer, self.reference = dataset, tokenizer, reference
        self.samplers = dict(samplers)
        self.sampler_path = samplers[run.step]
        self.pending: list[tuple[int, str, float]] = []
        self.pending_traj: list[dict] = []
        self.checkpoints: list[str] = []
        self.rewards: list[tuple[int, float]] = []
        self.k = config.num_substeps
        self.total = config.max_steps * self.k
        self.log = get_run_logger()

    # ----- rollouts --------------------------------------------------------------------------
    def submit(self, builder: Any, batch_index: int, group_index: int):
        """Submit one ``rollout-group`` task on the current sampler; returns its future."""
        c = self.config
        return rollout_group.submit(
            self.credentials, self.sampler_path, builder, batch_index, group_index, c.seed, c.max_tokens,
            c.temperature, c.rollout, self.run.step,
        )

    def map_batch(self, batch_index: int) -> list:
        """``rollout-group`` mapped over the groups of batch ``batch_index``; returns the futures."""
        from prefect import unmapped

        c = self.config
        builders = self.dataset.get_batch(batch_index)
        return list(rollout_group.map(
            unmapped(self.credentials), unmapped(self.sampler_path), builders, unmapped(batch_index),
            list(range(len(builders))), unmapped(c.seed), unmapped(c.max_tokens), unmapped(c.temperature),
            unmapped(c.rollout), unmapped(self.run.step),
        ))

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
            self.log.warning("no learning signal: all %d groups got constant rewards (zero advantages), "
                             "so this step leaves the policy unchanged; check the reward (e.g. every reply "
                             "malformed: try a few-shot prompt, a system prompt, more max_tokens or an SFT warm-up)",
                             len(groups))
        if c.remove_constant_reward_groups:
            groups, _ = remove_constant_reward_groups(groups)
        datums, advs = groups_to_datums(groups, c.normalize_advantages_std)
        metrics["train/advantage_abs_mean"] = float(np.mean(np.abs(np.concatenate(advs)))) if advs else 0.0
        if c.kl_penalty_coef > 0 and datums:
            ref = reference_logprobs(self.credentials, self.reference, quote([d.tokens for d in datums]))
            kl = apply_kl_penalty(datums, [np.asarray(r) for r in ref], c.kl_penalty_coef)
            metrics["train/kl_policy_ref"] = kl["kl_policy_ref"]
        return datums, metrics

    def forward_backward(self, datums: list, accumulated: int) -> dict[str, float]:
        c = self.config
        # quote: Prefect does not walk the datums looking for futures (~10 ms per 1,000 tokens)
        return rl_forward_backward(self.credentials, self.run, quote(datums), c.loss_fn, c.loss_fn_config(), accumulated)

    def optim_step(self) -> dict[str, float]:
        c = self.config
        self.run, m = rl_optim_step(self.credentials, self.run, rl_lr_at(c, self.run.step, self.total), c.adam.model_dump())
        return m

    # ----- bookkeeping -----------------------------------------------------------------------
    def step_metrics(self, step: int, groups: list[TrajectoryGroup], extra: dict[str, float]) -> None:
        """Buffer the step's metrics (one row per name) and its sample of trajectories."""
        env = rollout_metrics(groups)
        rows = {f"env/{k}": v for k, v in env.items()}
        rows.update(extra)
        self.pending += [(step, k, float(v)) for k, v in rows.items()]
        self.rewards.append((step, env["reward_mean"]))
        self._log_trajectories(step, groups)
        self.log.info("step %d: reward %.3f correct %.3f (%d groups)", step, env["reward_mean"],
                      env.get("correct_rate", float("nan")), len(groups))

    def _log_trajectories(self, step: int, groups: list[TrajectoryGroup]) -> None:
        n = self.config.log_trajectories
        for g in groups:
            adv = compute_advantages(g.total_rewards(), self.config.normalize_advantages_std)
            for i, (traj, reward) in enumerate(zip(g.trajectories_G, g.total_rewards())):
                if n <= 0:
                    return
                n -= 1
                first = traj.transitions[0]
                info = {**{k: v for t in traj.transitions for k, v in t.metrics.items()},
                        **{k: v for t in traj.transitions for k, v in t.logs.items() if k != "response"}}
                self.pending_traj.append(dict(
                    step=step, sampler_step=g.sampler_step, batch_index=g.batch_index, group_index=g.group_index,
                    member=i, prompt=self.tokenizer.decode(first.observation),
                    response="".join(self.tokenizer.decode(t.action_tokens) for t in traj.transitions),
                    reward=float(reward), advantage=float(adv[i]), metrics_json=json.dumps(info, default=str),
                ))

    def end_step(self, t_start: float, step: int) -> None:
        """After an update: fresh sampler weights; a state checkpoint when due (store rows first)."""
        c, done = self.config, self.run.step
        t0 = time.perf_counter()
        name = f"{self.run.run_name}-step-{done:06d}"
        self.sampler_path = save_sampler_weights(self.credentials, self.run, name)
        self.samplers[done] = self.sampler_path
        due = done >= self.total or (c.save_every and (done // self.k) % c.save_every == 0)
        self.pending += [(step, "time/save_seconds", time.perf_counter() - t0),
                         (step, "time/step_seconds", time.perf_counter() - t_start)]
        if due:
            self.checkpoint(name)
        _after_step(done)

    def checkpoint(self, name: str) -> None:
        """State checkpoint at ``run.step``; writes buffered metrics and trajectories, then the
        sampler row and the state row (the resume marker) to the store."""
        c, done = self.config, self.run.step
        self.run, path = save_checkpoint(self.credentials, self.run, name, "state")
        write_metrics(c.store, c.run_name, self.pending)
        write_trajectories(c.store, c.run_name, self.pending_traj)
        self.pending, self.pending_traj = [], []
        record_checkpoint(c.store, c.run_name, done, self.sampler_path, "sampler")
        record_checkpoint(c.store, c.run_name, done, path, "state")
        report_run(c.store, c.run_name, done, kind="rl", curves=RL_CURVES)  # metrics table + curves picture
        self.checkpoints.append(path)

    def rewind(self, rew: ClientRewound) -> None:
        """Continue from the checkpoint at ``rew.step`` after the client was lost."""
        self.log.warning("%s; continuing from step %d", rew, rew.step)
        self.run = rew.run
        self.pending = [p for p in self.pending if p[0] < rew.step]
        self.pending_traj = [p for p in self.pending_traj if p["step"] < rew.step]
        self.rewards = [r for r in self.rewards if r[0] < rew.step]
        self.sampler_path = self.samplers[rew.step]


def _after_step(step: int) -> None:
    """Hook called after every completed step (tests use it to interrupt a run)."""


def _before_compaction(run_id: str) -> None:
    """Hook called when the run's rows are all written, before they are compacted (tests use it
    to read the parts as written)."""


def _checkpoint_rows(store: str, run_id: str) -> list[dict]:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=store).query(
        "SELECT step, kind, path FROM checkpoints WHERE run_id = ? ORDER BY step, time", [run_id])


@flow(name="rl", flow_run_name="rl-{config.run_name}", log_prints=True)
def rl_flow(config: RLConfig) -> dict[str, Any]:
    """Train ``config.model`` with RL on ``config.env``; returns a summary (steps, mean reward of
    the first and last steps of this invocation, checkpoints, store)."""
    from transformers import AutoTokenizer

    log = get_run_logger()
    credentials = resolve_credentials(config.backend)
    backend, run_id = credentials.backend_name(), config.run_name
    check_store(config.store)  # wrong credentials / unwritable store: fail before any training
    rows = _checkpoint_rows(config.store, run_id)
    states = [r for r in rows if r["kind"] == "state"]
    samplers = {int(r["step"]): r["path"] for r in rows if r["kind"] == "sampler"}
    last = states[-1] if states else None
    if last and last["step"] % config.num_substeps:
        raise ValueError(f"run {run_id!r}: last checkpoint at optimizer step {last['step']} is not a multiple of "
                         f"num_substeps={config.num_substeps}; resume with the num_substeps it was started with")
    run = open_training_run(
        credentials, run_id, config.model, config.lora_rank, backend, seed=config.seed,
        resume_from=last["path"] if last else None, resume_step=last["step"] if last else 0,
        init_from=None if last else config.load_checkpoint_path,
    )
    record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "running")
    try:
        if last:
            log.info("resuming run %s after its checkpoint at step %d (%s)", run_id, last["step"], last["path"])
        elif config.load_checkpoint_path:  # a state at step 0, so a lost client is recreated with these weights
            run, path = save_checkpoint(credentials, run, f"{run_id}-step-{0:06d}", "state")
            record_checkpoint(config.store, run_id, 0, path, "state")
        if run.step not in samplers:
            samplers[run.step] = save_sampler_weights(credentials, run, f"{run_id}-step-{run.step:06d}")
            record_checkpoint(config.store, run_id, run.step, samplers[run.step], "sampler")
        reference = config.kl_reference or samplers.get(0) or f"base:{config.model}"
        tokenizer = AutoTokenizer.from_pretrained(run.tokenizer_id)
        dataset = build_rl_dataset(config, renderer_name=config.renderer, tokenizer_id=run.tokenizer_id,
                                   group_size=config.group_size, groups_per_batch=config.groups_per_batch, seed=config.seed)
        loop = RLLoop(config, credentials, run, dataset, tokenizer, samplers, reference)
        from prefect_tinker.flows.rl_schedules import SCHEDULES

        t0 = time.perf_counter()
        SCHEDULES[config.schedule](loop)
        seconds = time.perf_counter() - t0
        if loop.pending or loop.pending_traj:
            write_metrics(config.store, run_id, loop.pending)
            write_trajectories(config.store, run_id, loop.pending_traj)
    except BaseException:
        record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "failed")
        raise
    record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "completed")
    _before_compaction(run_id)
    compact_finished_run(config.store, run_id)  # one part per table: S3 queries cost a request per part
    steps_run = len(loop.rewards)
    summary = {
        "run_name": run_id, "steps": loop.run.step // config.num_substeps, "optimizer_steps": loop.run.step,
        "schedule": config.schedule, "steps_this_invocation": steps_run, "seconds": seconds,
        "steps_per_minute": 60.0 * steps_run / seconds if seconds > 0 else float("nan"),
        "first_reward": loop.rewards[0][1] if loop.rewards else None,
        "last_reward": loop.rewards[-1][1] if loop.rewards else None,
        "rewards": [r for _, r in loop.rewards], "checkpoints": loop.checkpoints,
        "sampler_path": loop.sampler_path, "tokenizer_id": loop.run.tokenizer_id, "store": config.store,
    }
    _summary_artifact(summary, config)
    return summary


def _summary_artifact(summary: dict, config: RLConfig) -> None:
    lines = [
        f"# RL run `{summary['run_name']}`", "", "| field | value |", "|---|---|",
        f"| model | `{config.model}` |", f"| env | `{config.env}` |", f"| schedule | {config.schedule} |",
        f"| steps | {summary['steps']} |", f"| steps per minute | {summary['steps_per_minute']:.2f} |",
        f"| reward (first step of this invocation) | {summary['first_reward']} |",
        f"| reward (last step) | {summary['last_reward']} |", f"| store | `{summary['store']}` |",
        "", "## Checkpoints", "", *[f"- `{p}`" for p in summary["checkpoints"]],
    ]
    key = "rl-" + "".join(ch if ch.isalnum() else "-" for ch in summary["run_name"].lower())[:60]
    create_markdown_artifact("\n".join(lines), key=key, description="RL run summary")
