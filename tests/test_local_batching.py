"""How the local server's compute thread groups sampling jobs into batches (``FutureStore``).

Batch composition depends on arrival timing by design; these tests use wide margins (quiet
windows of 0.5 s against 0.1 s delays) so they hold on a loaded machine.  That each request's
samples do not depend on its batch is tested end to end in ``test_local_api.py``
(``test_concurrent_sample_requests_are_batched_and_match_sequential``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from tinker_local.futures import FutureStore


def _store(**kw):
    store = FutureStore(**kw)
    batches: list[list[int]] = []

    def batch_fn(payloads):
        batches.append(list(payloads))
        return [{"payload": p} for p in payloads]

    def submit(p, **extra):
        return store.submit("sample", None, batch_key="k", payload=p, batch_fn=batch_fn, **extra)

    return store, batches, submit


@contextmanager
def _running(**kw):
    """``_store(**kw)`` with its compute thread started; stopped on exit."""
    store, batches, submit = _store(**kw)
    store.start(None)
    try:
        yield store, batches, submit
    finally:
        store.stop()


def _done(store, *rids):
    for rid in rids:
        assert store.get(rid).wait_blocking(10)


def test_a_request_arriving_within_the_quiet_window_joins_the_batch():
    with _running(batch_quiet_s=0.5, batch_max_wait_s=5.0) as (store, batches, submit):
        a = submit(1)
        time.sleep(0.1)
        b = submit(2)
        _done(store, a, b)
        assert batches == [[1, 2]]
        assert store.get(b).outcome.json == {"payload": 2}


def test_the_batch_waits_for_requests_still_being_received():
    with _running(batch_quiet_s=0.2, batch_max_wait_s=10.0) as (store, batches, submit):
        store.incoming(+1)  # the HTTP layer is reading a sampling request's body
        a = submit(1)
        time.sleep(0.8)  # well past the quiet window
        assert store.get(a).outcome is None
        b = submit(2)
        store.incoming(-1)
        _done(store, a, b)
        assert batches == [[1, 2]]


def test_max_linger_bounds_the_wait_of_a_short_request():
    with _running(batch_quiet_s=5.0, batch_max_wait_s=10.0) as (store, batches, submit):
        t0 = time.monotonic()
        a = submit(1, max_linger_s=0.0)
        _done(store, a)
        assert time.monotonic() - t0 < 2.0  # not the 5 s quiet window
        b = submit(2, max_linger_s=0.0)
        _done(store, b)
        assert batches == [[1], [2]]
