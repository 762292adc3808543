"""The async RL schedule's bookkeeping, without a server: which rollouts it starts, on which
sampler, and which finished groups each step trains on.

The loop below is the part of ``RLLoop`` the schedule calls; its rollouts finish as soon as they
are submitted (an infinitely fast sampler), so every in-flight group is always ready and the
schedule's own choices alone decide what is trained when.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from types import SimpleNamespace

import pytest
from prefect.futures import PrefectConcurrentFuture
from prefect.states import Completed

from prefect_tinker.flows.rl_schedules import Async


class _Loop:
    def __init__(self, steps: int, gpb: int, failing: set[tuple[int, int]] = frozenset(), minibatches=None):
        self.config = SimpleNamespace(groups_per_batch=gpb, max_steps_off_policy=1, stale_groups="requeue",
                                      num_minibatches=minibatches)
        self.k, self.total, self.session = 1, steps, SimpleNamespace(step=0)
        self.dataset = SimpleNamespace(get_batch=lambda b: [(b, g) for g in range(gpb)])
        self.failing = set(failing)
        self.submitted: list[tuple[int, int, int]] = []  # (trainer step at submission, batch, group)
        self.trained: list[list[tuple[int, int, int]]] = []  # per step: (sampler step, batch, group)
        self.passes: list[tuple[int, int]] = []  # forward_backward: (trainer step, accumulated)

    def submit(self, builder, b, g):
        assert builder == (b, g)
        self.submitted.append((self.session.step, b, g))
        fut = concurrent.futures.Future()
        failed = (b, g) in self.failing
        fut.set_result(Completed(data="failed" if failed else SimpleNamespace(
            sampler_step=self.session.step, batch_index=b, group_index=g)))
        return PrefectConcurrentFuture(uuid.uuid4(), fut)

    def collect(self, fut, counters):
        group = fut.result()
        if group == "failed":  # as RLLoop.collect: counted, dropped
            counters["errors"] = counters.get("errors", 0) + 1
            return None
        return group

    def prepare(self, groups):
        self.trained.append([(x.sampler_step, x.batch_index, x.group_index) for x in groups])
        return list(groups), {}

    def forward_backward(self, datums, accumulated):
        self.passes.append((self.session.step, accumulated))
        return {"loss_sum": float(len(datums)), "action_tokens": 1.0, "datums": float(len(datums))}

    def optim_step(self):
        self.session.step += 1
        return {}

    def step_metrics(self, step, groups, extra):
        return extra

    def end_step(self, t0):
        return {}


def _run(loop: _Loop) -> list[dict]:
    sched = Async(loop)
    out = []
    while loop.session.step < loop.total:
        out.append(sched.step(loop.session.step))
    sched.close()
    return out


def test_async_starts_each_steps_rollouts_together_on_the_newest_sampler():
    steps, gpb = 6, 4
    loop = _Loop(steps, gpb)
    metrics = _run(loop)
    per_step = [[b for s, b, _ in loop.submitted if s == k] for k in range(steps)]
    # step 0 fills two batches (max_steps_off_policy=1); each later step starts exactly one batch,
    # the next one, on the sampler it just got, and the last step starts none: no rollout is wasted
    assert [len(x) for x in per_step] == [2 * gpb] + [gpb] * (steps - 2) + [0]
    assert [set(x) for x in per_step[1:-1]] == [{k + 1} for k in range(1, steps - 1)]
    # from step 1 on, step k trains on groups of sampler k - 1 only (the stalest allowed), never on
    # fresher ones while older ones would go stale; every group of the data once
    assert [sorted({s for s, _, _ in t}) for t in loop.trained] == [[0]] + [[k - 1] for k in range(1, steps)]
    assert sorted((b, g) for t in loop.trained for _, b, g in t) == [(b, g) for b in range(steps) for g in range(gpb)]
    assert [m["rollout/staleness_mean"] for m in metrics] == [0.0] + [1.0] * (steps - 1)
    assert all(m["rollout/groups_stale"] == 0 for m in metrics)


def test_async_refills_after_failed_rollouts_and_trains_every_step_full():
    steps, gpb = 5, 3
    loop = _Loop(steps, gpb, failing={(0, 1), (2, 0), (2, 2)})
    metrics = _run(loop)
    assert [len(t) for t in loop.trained] == [gpb] * steps
    trained = [(b, g) for t in loop.trained for _, b, g in t]
    assert len(set(trained)) == len(trained) and not set(trained) & loop.failing
    assert (
        sorted(trained)
        == [(b, g) for b in range(steps + 1) for g in range(gpb) if (b, g) not in loop.failing][: steps * gpb]
    )
    assert sum(m["rollout/errors"] for m in metrics) == 3
    assert len(loop.submitted) == steps * gpb + 3  # one extra rollout per failed one, none unused
    for k, t in enumerate(loop.trained):
        assert all(0 <= k - s <= 1 for s, _, _ in t), (k, t)


@pytest.mark.parametrize("steps", [1, 2])
def test_async_short_runs_start_no_more_than_they_train(steps):
    loop = _Loop(steps, 2)
    _run(loop)
    assert len(loop.submitted) == steps * 2 and len(loop.trained) == steps


def test_async_with_minibatches_trains_each_as_its_groups_are_taken():
    """num_minibatches=2 (the cookbook's AsyncConfig with a StreamMinibatchConfig): the same groups
    per step as without, in two accumulated forward/backward passes before each optimizer step."""
    steps, gpb = 4, 4
    whole, streamed = _Loop(steps, gpb), _Loop(steps, gpb, minibatches=2)
    _run(whole)
    metrics = _run(streamed)
    # (which finished group comes first is as_completed's order: compare what each step may train)
    assert sorted(x[1:] for t in streamed.trained for x in t) == sorted(x[1:] for t in whole.trained for x in t)
    for k, (a, b) in enumerate(zip(streamed.trained[::2], streamed.trained[1::2], strict=True)):
        assert all(0 <= k - s <= 1 for s, _, _ in a + b), (k, a, b)
    assert [len(t) for t in streamed.trained] == [gpb // 2] * (2 * steps)
    assert streamed.passes == [(k, a) for k in range(steps) for a in (0, 1)]
    assert whole.passes == [(k, 0) for k in range(steps)]
    assert [m["train/loss_sum"] for m in metrics] == [float(gpb)] * steps  # summed over both passes
    assert streamed.submitted == whole.submitted


def test_async_minibatches_must_fit_the_batch():
    from prefect_tinker.flows.rl import RLConfig

    with pytest.raises(ValueError, match=r"async needs groups_per_batch >= num_minibatches x num_substeps \(2 x 2"):
        RLConfig(schedule="async", groups_per_batch=3, num_minibatches=2, num_substeps=2)
    assert RLConfig(schedule="async", groups_per_batch=3, num_substeps=2).num_minibatches is None
