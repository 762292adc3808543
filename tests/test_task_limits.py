"""``prefect_tinker.tasks.limits`` against a real Prefect API: the sampling rate limit is looked up
once per 30 s, not once per sampling request, while it exists as while it does not; slot holders
still read fresh slot counts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from prefect_tinker.tasks import limits
from tinker_blocks import TinkerCredentials


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The ``time.monotonic()`` the module sees (far past anything it remembers); add to ``[0]`` to move it."""
    now = [time.monotonic() + 1e9]
    monkeypatch.setattr(limits, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


@pytest.fixture
def reads(prefect_api, monkeypatch):
    """Names passed to ``read_global_concurrency_limit_by_name`` of Prefect's sync client, in order."""
    from prefect.client.orchestration import SyncPrefectClient

    names: list[str] = []
    real = SyncPrefectClient.read_global_concurrency_limit_by_name

    def counted(self, name):
        names.append(name)
        return real(self, name)

    monkeypatch.setattr(SyncPrefectClient, "read_global_concurrency_limit_by_name", counted)
    return names


def test_an_existing_rate_limit_is_looked_up_once_for_many_sampling_requests(reads, clock):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    creds = TinkerCredentials(local=True)
    name = limits.sample_rate_limit_name(creds)
    limits.wait_sample_rate(creds)  # no limit yet: remembered as absent
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=100, slot_decay_per_second=0.001, active=True)
        )
    try:
        clock[0] += 29
        limits.wait_sample_rate(creds)
        assert reads == [name]  # the absent answer is still trusted
        clock[0] += 2  # 31 s after it
        for _ in range(5):
            limits.wait_sample_rate(creds)
            clock[0] += 5
        assert reads == [name, name]  # one look-up for five requests, each of which took a slot
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(name).active_slots == 5
        state = limits.limit_state(name)  # a slot holder's view: counted afresh
        assert state is not None and state.active_slots == 5 and state.slot_decay_per_second == 0.001
        assert reads == [name] * 4
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)


def test_a_run_says_it_waits_for_a_training_slot_only_when_it_does(prefect_api, clock, monkeypatch):
    """With ``tinker-train:local`` at 1 slot, a second run waits until the first lets go of it and
    says so once (whatever the slot counts it read before trying); a run finding the slot free
    says nothing. ``clock``: an absence of the limit remembered by an earlier test of this process
    (trusted for 30 s) is past."""
    import threading

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    said: list[str] = []
    monkeypatch.setattr(limits, "_log", said.append)
    creds = TinkerCredentials(local=True)
    name = limits.train_limit_name(creds)
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1, active=True))
    try:
        with limits.training_slot(creds, "run-c"):
            pass
        assert said == []  # free: no announcement
        held, release, events = threading.Event(), threading.Event(), []

        def first():
            with limits.training_slot(creds, "run-a"):
                held.set()
                release.wait(30)
                events.append("a released")

        t = threading.Thread(target=first)
        t.start()
        assert held.wait(60)
        # run-b read the counts just before run-a took the slot: free, as far as it knows
        real, stale = limits.limit_state, [limits.LimitState(name, 1, 0, 0.0)]
        monkeypatch.setattr(limits, "limit_state", lambda n, **kw: stale.pop() if stale else real(n, **kw))
        threading.Timer(limits.FIRST_TRY_S + 2.0, release.set).start()
        with limits.training_slot(creds, "run-b"):
            events.append("b holds")
        t.join(30)
        assert events == ["a released", "b holds"]
        assert said == [f"run-b: {name} is full (1 of 1 in use): waiting for a slot"]
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(name).active_slots == 0
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
