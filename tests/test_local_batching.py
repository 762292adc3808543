"""Batched sampling in ``tinker_local`` without HTTP: ``Engine.sample_many`` with requests joining
a running batch (continuous batching) gives each request what it gets alone, and the compute
thread's batcher (``FutureStore``) hands queued jobs to a running batch and delivers results."""

from __future__ import annotations

import threading

import pytest

from tinker_local.engine import Engine
from tinker_local.futures import FutureStore


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("batching"), dtype="fp32", device="cpu", num_threads=1)
    e.create_model("m", "tiny", 4, seed=0)
    e.optim_step("m", learning_rate=0.0)
    return e


def _req(weights, n: int, samples: int, max_tokens: int, seed: int, **kw) -> dict:
    return {"base_model": None, "weights_path": weights, "prompt_tokens": list(range(7, 7 + n)),
            "num_samples": samples, "max_tokens": max_tokens, "seed": seed, "stop": [], **kw}


def test_requests_joining_a_running_batch_match_running_alone(engine):
    w = engine.save_sampler_weights("m", "w")
    first = [_req(w, 4, 2, 10, 1), _req(w, 7, 1, 6, 2)]
    arrivals = {2: [_req(w, 3, 3, 9, 3), _req(w, 9, 1, 12, 4, top_k=5, temperature=0.7),
                    _req(None, 2, 1, 3, 5, base_model="tiny")],  # other weights: runs after
                4: [_req(w, 2, 1, 4, 6, include_prompt_logprobs=True),  # other kind: runs after
                    _req(w, 1, 1, 2, 7, stop=["never"]), _req(w, 3, 1, 5, 8, top_p=0.9)],
                5: [_req(w, 2, 1, 2, 9, prompt_tokens=[1, 99999])]}  # invalid: fails alone
    calls, finished = [0], []

    def admit():
        calls[0] += 1
        return arrivals.get(calls[0], [])

    results = engine.sample_many(first, admit=admit, on_done=lambda k, _res: finished.append(k))
    everything = first + [r for k in sorted(arrivals) for r in arrivals[k]]
    assert len(results) == len(everything) == 9 and sorted(finished) == list(range(9))
    assert finished.index(6) < finished.index(0)  # a short joined request finishes first
    assert "99999" in str(results[8])
    for kw, got in zip(everything[:8], results[:8]):
        kw = dict(kw)
        alone = engine.sample(kw.pop("base_model"), kw.pop("weights_path"), kw.pop("prompt_tokens"), **kw)
        assert [s["tokens"] for s in got.sequences] == [s["tokens"] for s in alone.sequences]
        for a, b in zip(got.sequences, alone.sequences):
            assert max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0) < 1e-4
        assert got.prompt_logprobs == pytest.approx(alone.prompt_logprobs, abs=1e-4) \
            if alone.prompt_logprobs else got.prompt_logprobs is None


def test_future_store_hands_queued_jobs_to_a_running_batch():
    store = FutureStore(batch_quiet_s=0.001, batch_max_wait_s=0.01)
    started, release, seen = threading.Event(), threading.Event(), []

    def batch_fn(payloads, admit, deliver):
        seen.append(list(payloads))
        deliver(0, {"v": payloads[0] * 10})  # early delivery of the first job
        started.set()
        release.wait(5)
        joined = admit()
        seen.append(joined)
        everything = payloads + joined
        return [ValueError("odd") if p % 2 else {"v": p * 10} for p in everything]

    store.start(None)
    try:
        first = store.submit("sample", None, batch_key="k", payload=2, batch_fn=batch_fn)
        assert started.wait(5) and store.get(first).wait_blocking(5)  # delivered while running
        later = [store.submit("sample", None, batch_key="k", payload=p, batch_fn=batch_fn) for p in (3, 4)]
        other = store.submit("op", lambda: {"other": True})
        release.set()
        for rid in later + [other]:
            assert store.get(rid).wait_blocking(5)
    finally:
        store.stop()
    assert seen == [[2], [3, 4]]
    assert store.get(first).outcome.json == {"v": 20}
    assert store.get(later[0]).outcome.category == "server" and store.get(later[1]).outcome.json == {"v": 40}
    assert store.get(other).outcome.json == {"other": True}
    assert store.stats["joined"] == 2 and store.stats["max_batch"] == 3
