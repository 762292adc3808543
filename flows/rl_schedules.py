"""The three RL schedules; all share :class:`prefect_tinker.flows.rl.RLLoop` (rollout tasks, datums, training
tasks, sampler saves, checkpoints) and differ only in when groups are trained.

- ``sync`` (on-policy): map ``rollout-group`` over the batch, wait for every group, train
  (``num_substeps`` optimizer steps), save fresh sampler weights, repeat.
- ``streaming`` (on-policy, overlapped): all rollouts of the batch are submitted at once; as soon
  as a minibatch worth of groups has finished (``groups_per_batch / (num_substeps x
  num_minibatches)``) its forward/backward runs while the rest are still sampling; an optimizer
  step follows each substep's last minibatch (Tinker cookbook's ``StreamMinibatchConfig``).
- ``async`` (off-policy): rollouts run continuously (up to two batches in flight) on whatever
  sampler is newest when they start; the trainer takes the first ``groups_per_batch`` finished
  groups whose sampler lags the trainer by at most ``max_steps_off_policy`` batches; older ones
  are re-queued on the current sampler (``stale_groups="requeue"``) or dropped (Tinker cookbook's
  ``AsyncConfig``). The data position restarts at ``step x groups_per_batch`` groups on resume
  (groups in flight at a crash are sampled again).

Each step writes ``rollout/*`` (errors, groups dropped / constant / stale, staleness),
``env/*`` (reward, correct and format rates, tokens per turn), ``train/*`` and ``time/*`` metrics.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np
from prefect.futures import as_completed

from prefect_tinker.flows.rl import RLLoop, _merge
from prefect_tinker.recipes.rl.types import TrajectoryGroup
from prefect_tinker.tasks.training import ClientRewound

__all__ = ["SCHEDULES", "run_sync", "run_streaming", "run_async"]

MAX_REWINDS = 3


def _prefixed(prefix: str, m: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in m.items()}


def _train(loop: RLLoop, groups: list[TrajectoryGroup]) -> dict[str, float]:
    """``num_substeps`` optimizer steps on ``groups`` (split evenly by group); metrics prefixed."""
    fb, opt, prep = [], [], []
    for idx in np.array_split(np.arange(len(groups)), loop.k):
        datums, pm = loop.prepare([groups[i] for i in idx])
        prep.append(pm)
        if datums:
            fb.append(loop.forward_backward(datums, 0))
        opt.append(loop.optim_step())
    return {**_merge_prep(prep), **_prefixed("train", _merge(fb)), **_prefixed("train", _merge(opt))}


def _merge_prep(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in {k for p in parts for k in p}:
        vals = [p[k] for p in parts if k in p]
        out[k] = float(sum(vals)) if k == "rollout/groups_constant" else float(np.mean(vals))
    return out


def _require(groups: list, step: int, counters: dict[str, float]) -> None:
    if not groups:
        raise RuntimeError(f"step {step}: no rollout group survived ({int(counters.get('errors', 0))} errors); "
                           "see the rollout-group task logs")


def _rollout_counters(counters: dict[str, float], keys=("errors", "groups_dropped")) -> dict[str, float]:
    return {f"rollout/{k}": float(counters.get(k, 0)) for k in keys}


def _with_rewinds(loop: RLLoop, body: Callable[[], None]) -> None:
    rewinds = 0
    while loop.run.step < loop.total:
        try:
            body()
        except ClientRewound as rew:
            rewinds += 1
            if rewinds > MAX_REWINDS:
                raise
            loop.rewind(rew)


def run_sync(loop: RLLoop) -> None:
    """Synchronous on-policy schedule (see the module docstring)."""

    def one_step() -> None:
        step, t0 = loop.run.step, time.perf_counter()
        counters: dict[str, float] = {}
        futures = loop.map_batch(step // loop.k)
        groups = [g for f in futures if (g := loop.collect(f, counters)) is not None]
        _require(groups, step, counters)
        t_roll = time.perf_counter() - t0
        metrics = _train(loop, groups)
        metrics.update(_rollout_counters(counters))
        metrics.update({"time/rollout_seconds": t_roll, "time/train_seconds": time.perf_counter() - t0 - t_roll})
        loop.step_metrics(step, groups, metrics)
        loop.end_step(t0, step)

    _with_rewinds(loop, one_step)


def run_streaming(loop: RLLoop) -> None:
    """Streaming-minibatch on-policy schedule (see the module docstring)."""
    c = loop.config

    def one_step() -> None:
        step, t0 = loop.run.step, time.perf_counter()
        counters: dict[str, float] = {}
        futures = loop.map_batch(step // loop.k)
        # minibatch j of the batch closes when `bounds[j]` rollouts have finished (dropped ones count)
        sizes = [len(a) for a in np.array_split(np.arange(len(futures)), loop.k * c.num_minibatches)]
        bounds = list(np.cumsum(sizes))
        groups: list[TrajectoryGroup] = []
        arrived: list[TrajectoryGroup] = []
        fb, opt, prep = [], [], []
        finished = accumulated = mb = 0
        t_wait = 0.0
        tw = time.perf_counter()
        for fut in as_completed(futures):
            finished += 1
            g = loop.collect(fut, counters)
            if g is not None:
                arrived.append(g)
            while mb < len(bounds) and finished >= bounds[mb]:
                t_wait += time.perf_counter() - tw
                datums, pm = loop.prepare(arrived)
                prep.append(pm)
                groups += arrived
                arrived = []
                if datums:
                    fb.append(loop.forward_backward(datums, accumulated))
                    accumulated += 1
                mb += 1
                if mb % c.num_minibatches == 0:  # the substep's last minibatch: optimizer step
                    _require(groups, step, counters)
                    opt.append(loop.optim_step())
                    accumulated = 0
                tw = time.perf_counter()
        metrics = {**_merge_prep(prep), **_prefixed("train", _merge(fb)), **_prefixed("train", _merge(opt))}
        metrics.update(_rollout_counters(counters))
        metrics.update({"time/rollout_seconds": t_wait, "time/train_seconds": time.perf_counter() - t0 - t_wait})
        loop.step_metrics(step, groups, metrics)
        loop.end_step(t0, step)

    _with_rewinds(loop, one_step)


def run_async(loop: RLLoop) -> None:
    """Asynchronous off-policy schedule (see the module docstring)."""
    c = loop.config
    gpb, k = c.groups_per_batch, loop.k
    limit = c.max_steps_off_policy * k  # most optimizer steps a sampler may lag
    state = {"cursor": (loop.run.step // k) * gpb}
    batches: dict[int, list] = {}
    requeued: deque = deque()
    in_flight: dict = {}
    ready: list[TrajectoryGroup] = []
    max_in_flight = gpb * (2 if c.max_steps_off_policy > 0 else 1)

    def next_work():
        if requeued:
            return requeued.popleft()
        b, g = divmod(state["cursor"], gpb)
        state["cursor"] += 1
        if b not in batches:
            batches.clear()
            batches[b] = loop.dataset.get_batch(b)
        return batches[b][g], b, g

    def top_up() -> None:
        needed = (loop.total - loop.run.step) // k * gpb - len(ready)  # groups the remaining steps still take
        while len(in_flight) < min(max_in_flight, max(needed, 1)):
            builder, b, g = work = next_work()
            in_flight[loop.submit(builder, b, g)] = work

    def one_step() -> None:
        step, t0 = loop.run.step, time.perf_counter()
        counters: dict[str, float] = {"groups_stale": 0.0}
        fresh = [g for g in ready if 0 <= step - g.sampler_step <= limit]  # < 0: sampled by weights a rewind undid
        counters["groups_stale"] += len(ready) - len(fresh)
        if c.stale_groups == "requeue":
            requeued.extend((None, g.batch_index, g.group_index) for g in ready if g not in fresh)
        ready[:] = fresh
        while len(ready) < gpb:
            _resolve_requeued()
            top_up()
            fut = next(iter(as_completed(list(in_flight))))
            work = in_flight.pop(fut)
            g = loop.collect(fut, counters)
            if g is None:
                continue
            if not 0 <= step - g.sampler_step <= limit:
                counters["groups_stale"] += 1
                if c.stale_groups == "requeue":
                    requeued.append(work)
                continue
            ready.append(g)
        t_roll = time.perf_counter() - t0
        take, ready[:] = ready[:gpb], ready[gpb:]
        metrics = _train(loop, take)
        metrics.update(_rollout_counters(counters, ("errors", "groups_dropped", "groups_stale")))
        metrics["rollout/staleness_mean"] = float(np.mean([(step - g.sampler_step) / k for g in take]))
        metrics.update({"time/rollout_seconds": t_roll, "time/train_seconds": time.perf_counter() - t0 - t_roll})
        loop.step_metrics(step, take, metrics)
        loop.end_step(t0, step)

    def _resolve_requeued() -> None:
        # requeued groups taken out of `ready` carry no builder: look it up again from the dataset
        for i, (builder, b, g) in enumerate(requeued):
            if builder is None:
                requeued[i] = (loop.dataset.get_batch(b)[g], b, g)

    try:
        _with_rewinds(loop, one_step)
    finally:
        for fut in in_flight:  # let in-flight rollouts finish (results unused); nothing is cancelled mid-request
            try:
                fut.wait()
            except Exception:  # pragma: no cover
                pass


SCHEDULES: dict[str, Callable[[RLLoop], None]] = {"sync": run_sync, "streaming": run_streaming, "async": run_async}
