"""The three RL schedules: the step functions the step loop runs. All share
:class:`prefect_tinker.flows.rl.RLLoop` (rollout tasks, datums, training tasks, sampler saves) and
differ only in when groups are trained.

- ``sync`` (on-policy): map ``rollout-group`` over the batch, wait for every group, train
  (``num_substeps`` optimizer steps), save fresh sampler weights, repeat.
- ``streaming`` (on-policy, overlapped): all rollouts of the batch are submitted at once; as soon
  as a minibatch worth of groups has finished (``groups_per_batch / (num_substeps x
  num_minibatches)``, ``num_minibatches`` 2 unless set) its forward/backward runs while the rest
  are still sampling; an optimizer step follows each substep's last minibatch (Tinker cookbook's
  ``StreamMinibatchConfig``; :class:`MinibatchStream`).
- ``async`` (off-policy): rollouts keep running while the trainer trains (Tinker cookbook's
  ``AsyncConfig``). Each step first starts as many rollouts as keep two batches (one with
  ``max_steps_off_policy=0``) ahead of the trainer, finished ones included, all on the sampler the
  step begins with, so they reach the sampler together and share its batches (mid-step rollouts
  start only to replace failed or stale ones); then it takes the first ``groups_per_batch``
  finished groups, those of the oldest sampler first, whose sampler lags the trainer by at most
  ``max_steps_off_policy`` batches; older ones are re-queued on the current sampler
  (``stale_groups="requeue"``) or dropped. It trains the batch once all of it is in, or, with
  ``num_minibatches`` > 1, minibatch by minibatch as the groups are taken (the cookbook's
  ``AsyncConfig`` with a ``StreamMinibatchConfig``). The data position restarts at ``step x
  groups_per_batch`` groups on resume (groups in flight at a crash are sampled again).

Each step returns ``rollout/*`` (errors, groups dropped / constant / stale, staleness), ``env/*``
(reward, correct and format rates, tokens per turn), ``train/*`` and ``time/*`` metrics.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, ClassVar, Protocol

import numpy as np
from prefect.futures import as_completed

from prefect_tinker.flows.rl_config import SCHEDULES, RLStepFields
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.rl.types import RLDataset, TrajectoryGroup

__all__ = [
    "Schedule",
    "Sync",
    "Streaming",
    "Async",
    "MinibatchStream",
    "RLLoopParts",
    "merge_metrics",
    "register_schedule",
]


class RLLoopParts(Protocol):
    """The parts of one RL step that a schedule orders (:class:`prefect_tinker.flows.rl.RLLoop`
    implements them; it hands itself to its schedule)."""

    @property
    def session(self) -> RunSession[Any]: ...
    @property
    def config(self) -> RLStepFields: ...
    @property
    def dataset(self) -> RLDataset: ...
    @property
    def k(self) -> int:
        """Optimizer substeps per batch."""
        ...

    @property
    def total(self) -> int:
        """Optimizer steps of the run (``max_steps * k``)."""
        ...

    def submit(self, builder: Any, batch_index: int, group_index: int) -> Any: ...
    def map_batch(self, batch_index: int) -> list: ...
    def collect(self, future: Any, counters: dict[str, float]) -> TrajectoryGroup | None: ...
    def prepare(self, groups: list[TrajectoryGroup]) -> tuple[list, dict[str, float]]: ...
    def forward_backward(self, datums: list, accumulated: int) -> dict[str, float]: ...
    def optim_step(self) -> dict[str, float]: ...
    def step_metrics(self, step: int, groups: list[TrajectoryGroup], extra: dict[str, float]) -> dict[str, float]: ...
    def end_step(self, t_start: float) -> dict[str, float]: ...
    def rewind(self, step: int) -> None: ...


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Merge per-minibatch metrics: sums for counts, seconds and ``*_sum`` metrics, token-weighted
    means for the rest."""
    if not parts:
        return {}
    out: dict[str, float] = {}
    weights = [p.get("action_tokens", 1.0) for p in parts]
    for k in parts[0]:
        vals = [p.get(k, 0.0) for p in parts]
        if k in ("action_tokens", "datums") or k.endswith(("seconds", "_sum")):
            out[k] = float(sum(vals))
        elif k == "learning_rate":
            out[k] = float(vals[-1])
        else:
            out[k] = float(np.average(vals, weights=weights)) if sum(weights) > 0 else float(np.mean(vals))
    return out


def _prefixed(prefix: str, m: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{k}": float(v) for k, v in m.items()}


def _merge_prep(parts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in {k for p in parts for k in p}:
        vals = [p[k] for p in parts if k in p]
        out[k] = float(sum(vals)) if k == "rollout/groups_constant" else float(np.mean(vals))
    return out


def _require(groups: list, step: int, counters: dict[str, float]) -> None:
    if not groups:
        raise RuntimeError(
            f"step {step}: no rollout group survived ({int(counters.get('errors', 0))} errors); "
            "see the rollout-group task logs"
        )


def _rollout_counters(counters: dict[str, float], keys=("errors", "groups_dropped")) -> dict[str, float]:
    return {f"rollout/{k}": float(counters.get(k, 0)) for k in keys}


def _minibatches(config: RLStepFields, default: int) -> int:
    """Forward/backward passes per optimizer step: ``config.num_minibatches``, else ``default``."""
    return config.num_minibatches if config.num_minibatches is not None else default


def _check_minibatches(name: str, config: RLStepFields, minibatches: int) -> None:
    if minibatches * config.num_substeps > config.groups_per_batch:
        raise ValueError(
            f"{name} needs groups_per_batch >= num_minibatches x num_substeps "
            f"({minibatches} x {config.num_substeps} > {config.groups_per_batch})"
        )


class MinibatchStream:
    """One batch trained minibatch by minibatch as its groups arrive (the Tinker cookbook's
    ``StreamMinibatchConfig``): the batch's ``n`` items split evenly into ``num_substeps x
    minibatches`` minibatches; once ``bounds[j]`` items have finished, the groups that arrived and
    are not trained yet get one ``forward_backward`` (accumulated), and the last minibatch of each
    substep an optimizer step. Gradients are the sum over minibatches, as one pass over the batch
    would give. ``step`` and ``counters`` name the step and its rollout counters in the error
    raised when a substep ends with no group at all."""

    def __init__(self, loop: RLLoopParts, n: int, minibatches: int, step: int, counters: dict[str, float]):
        self.loop, self.minibatches, self.step, self.counters = loop, minibatches, step, counters
        sizes = [len(a) for a in np.array_split(np.arange(n), loop.k * minibatches)]
        self.bounds = [int(b) for b in np.cumsum(sizes)]
        self.mb = self.accumulated = 0
        self.groups: list[TrajectoryGroup] = []  # trained so far, in order
        self.pending: list[TrajectoryGroup] = []
        self.fb: list[dict[str, float]] = []
        self.opt: list[dict[str, float]] = []
        self.prep: list[dict[str, float]] = []
        self.seconds = 0.0  # spent training (preparing datums, forward/backward, optimizer steps)

    def advance(self, finished: int, arrived: list[TrajectoryGroup]) -> None:
        """``arrived``: the groups kept since the last call; ``finished``: the batch's items done so
        far (dropped ones included). Trains every minibatch whose bound ``finished`` reached."""
        t0 = time.perf_counter()
        self.pending += arrived
        while self.mb < len(self.bounds) and finished >= self.bounds[self.mb]:
            datums, pm = self.loop.prepare(self.pending)
            self.prep.append(pm)
            self.groups += self.pending
            self.pending = []
            if datums:
                self.fb.append(self.loop.forward_backward(datums, self.accumulated))
                self.accumulated += 1
            self.mb += 1
            if self.mb % self.minibatches == 0:  # the substep's last minibatch: optimizer step
                _require(self.groups, self.step, self.counters)
                self.opt.append(self.loop.optim_step())
                self.accumulated = 0
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {
            **_merge_prep(self.prep),
            **_prefixed("train", merge_metrics(self.fb)),
            **_prefixed("train", merge_metrics(self.opt)),
        }


class Schedule:
    """A schedule: ``step(step) -> metrics`` (one batch: rollouts, update(s), fresh sampler),
    ``rewind(step)`` after a lost client, ``close()`` at the end.

    A new schedule subclasses this, implements :meth:`step` with the loop's parts
    (:class:`RLLoopParts`) and is registered by name (:func:`register_schedule`, or the entry-point
    group ``prefect_tinker.schedules``); the config's ``schedule`` field
    (:class:`~prefect_tinker.flows.rl_config.RLStepFields`: RL and distillation) names it.
    """

    off_policy: ClassVar[bool] = False
    """Whether rollouts may run on weights older than the trainer's (needed by ``sampler_kind="inflight"``)."""

    def __init__(self, loop: RLLoopParts):
        self.loop = loop

    @classmethod
    def check_config(cls, config: RLStepFields) -> None:
        """Raise ``ValueError`` (one line naming the fields) for a config this schedule cannot run;
        called by the validation of ``RLStepFields`` (RL and distillation configs), before anything
        starts. Nothing to check by default."""

    def step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def rewind(self, step: int) -> None:
        self.loop.rewind(step)

    def close(self) -> None:
        """Nothing in flight by default."""

    def train(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """``num_substeps`` optimizer steps on ``groups`` (split evenly by group, one
        forward/backward each); metrics prefixed."""
        stream = MinibatchStream(self.loop, len(groups), 1, self.loop.session.step, {})
        for finished, g in enumerate(groups, 1):
            stream.advance(finished, [g])
        return stream.metrics()

    def finish(self, step: int, t0: float, t_roll: float, groups: list[TrajectoryGroup], metrics: dict) -> dict:
        metrics.update({"time/rollout_seconds": t_roll, "time/train_seconds": time.perf_counter() - t0 - t_roll})
        out = self.loop.step_metrics(step, groups, metrics)
        out.update(self.loop.end_step(t0))
        return out


class Sync(Schedule):
    """Synchronous on-policy schedule (see the module docstring)."""

    def step(self, step: int) -> dict[str, float]:
        loop, t0 = self.loop, time.perf_counter()
        counters: dict[str, float] = {}
        futures = loop.map_batch(step // loop.k)
        groups = [g for f in futures if (g := loop.collect(f, counters)) is not None]
        _require(groups, step, counters)
        t_roll = time.perf_counter() - t0
        metrics = self.train(groups)
        metrics.update(_rollout_counters(counters))
        return self.finish(step, t0, t_roll, groups, metrics)


class Streaming(Schedule):
    """Streaming-minibatch on-policy schedule (see the module docstring)."""

    @classmethod
    def check_config(cls, config: RLStepFields) -> None:
        _check_minibatches("streaming", config, _minibatches(config, 2))

    def step(self, step: int) -> dict[str, float]:
        loop, t0 = self.loop, time.perf_counter()
        counters: dict[str, float] = {}
        futures = loop.map_batch(step // loop.k)
        # minibatch j of the batch closes when its bound of rollouts have finished (dropped ones count)
        stream = MinibatchStream(loop, len(futures), _minibatches(loop.config, 2), step, counters)
        for finished, fut in enumerate(as_completed(futures), 1):
            g = loop.collect(fut, counters)
            stream.advance(finished, [g] if g is not None else [])
        metrics = stream.metrics()
        metrics.update(_rollout_counters(counters))
        return self.finish(step, t0, time.perf_counter() - t0 - stream.seconds, stream.groups, metrics)


class Async(Schedule):
    """Asynchronous off-policy schedule (see the module docstring)."""

    off_policy = True

    @classmethod
    def check_config(cls, config: RLStepFields) -> None:
        _check_minibatches("async", config, _minibatches(config, 1))

    def __init__(self, loop: RLLoopParts):
        super().__init__(loop)
        c = loop.config
        self.gpb, self.limit = (
            c.groups_per_batch,
            c.max_steps_off_policy * loop.k,
        )  # most optimizer steps a sampler may lag
        self.cursor = (loop.session.step // loop.k) * self.gpb
        self.batches: dict[int, list] = {}
        self.requeued: deque = deque()
        self.in_flight: dict = {}
        self.max_in_flight = self.gpb * (2 if c.max_steps_off_policy > 0 else 1)

    def _next_work(self):
        if self.requeued:
            return self.requeued.popleft()
        b, g = divmod(self.cursor, self.gpb)
        self.cursor += 1
        return self._batch(b)[g], b, g

    def _batch(self, b: int) -> list:
        if b not in self.batches:
            if len(self.batches) > 4:
                self.batches.clear()
            self.batches[b] = self.loop.dataset.get_batch(b)
        return self.batches[b]

    def _top_up(self, taken: int = 0) -> None:
        """Start rollouts until, with the ``taken`` groups this step already holds, the trainer has
        ``max_in_flight`` groups ahead of it (fewer near the end of the run)."""
        loop = self.loop
        needed = (loop.total - loop.session.step) // loop.k * self.gpb  # groups the remaining steps take
        while len(self.in_flight) + taken < min(self.max_in_flight, max(needed, 1)):
            builder, b, g = work = self._next_work()
            self.in_flight[loop.submit(builder, b, g)] = (work, loop.session.step)

    def _next_finished(self):
        """The next finished in-flight rollout, of those started on the oldest sampler (the first
        to go stale): a step's groups are collected in the order their cohorts were started."""
        oldest = min(v for _, v in self.in_flight.values())
        return next(iter(as_completed([f for f, (_, v) in self.in_flight.items() if v == oldest])))

    def _fresh(self, g: TrajectoryGroup, step: int) -> bool:
        return 0 <= step - g.sampler_step <= self.limit  # < 0: sampled by weights a rewind undid

    def step(self, step: int) -> dict[str, float]:
        loop, c, t0 = self.loop, self.loop.config, time.perf_counter()
        counters: dict[str, float] = {"groups_stale": 0.0}
        self._top_up()  # all of this step's new rollouts start here, on the newest sampler
        # with minibatches, each trains as soon as its groups are in (the batch: the first gpb taken)
        m = _minibatches(c, 1)
        stream = MinibatchStream(loop, self.gpb, m, step, counters) if m > 1 else None
        take: list[TrajectoryGroup] = []
        while len(take) < self.gpb:
            if len(take) + len(self.in_flight) < self.gpb:  # errors or stale groups: refill
                self._top_up(len(take))
            fut = self._next_finished()
            work, _ = self.in_flight.pop(fut)
            g = loop.collect(fut, counters)
            if g is None:
                continue
            if not self._fresh(g, step):
                counters["groups_stale"] += 1
                if c.stale_groups == "requeue":
                    self.requeued.append(work)
                continue
            take.append(g)
            if stream is not None:
                stream.advance(len(take), [g])
        if stream is not None:
            t_roll, metrics = time.perf_counter() - t0 - stream.seconds, stream.metrics()
        else:
            t_roll = time.perf_counter() - t0
            metrics = self.train(take)
        metrics.update(_rollout_counters(counters, ("errors", "groups_dropped", "groups_stale")))
        metrics["rollout/staleness_mean"] = float(np.mean([(step - g.sampler_step) / loop.k for g in take]))
        return self.finish(step, t0, t_roll, take, metrics)

    def close(self) -> None:
        for fut in self.in_flight:  # let in-flight rollouts finish (results unused); nothing is cancelled mid-request
            try:
                fut.wait()
            except Exception:  # pragma: no cover
                pass


def register_schedule(name: str, schedule: type[Schedule]) -> type[Schedule]:
    """Register ``schedule`` as RL schedule ``name`` (the config's ``schedule``); returns it. A later
    registration of a name replaces the earlier one."""
    return SCHEDULES.register(name, schedule)


register_schedule("sync", Sync)
register_schedule("streaming", Streaming)
register_schedule("async", Async)
