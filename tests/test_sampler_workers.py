"""Sampler worker processes of ``tinker_local`` (``serve --sampler-workers N``), through the
unmodified SDK against two live servers started here: ``inproc`` (one engine samples and trains
in turn, one torch thread) and ``pooled`` (``--threads 2 --sampler-workers 1``: a trainer and
one worker process with one thread each).  Same thread counts, so seeded results must be
bit-identical: base-model and trained-adapter sampling, stop conditions, sampled / top-k /
prompt logprobs, several samples per prompt, concurrent (batched) requests.  Also: sampling
overlaps a running forward_backward, a killed worker fails its request as a server error (no
hang) and is restarted, user errors stay user errors, and the thread split."""

from __future__ import annotations

import os
import signal
import sys
import time

import httpx
import numpy as np
import pytest

import tinker
from tests.local_server import API_KEY, _start, _stop, _wait_healthy, free_port
from tinker import types
from tinker_local.sampler_pool import split_threads

VOCAB = 2048  # the tiny preset


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    common = [sys.executable, "-m", "tinker_local", "serve", "--model", "tiny", "--dtype", "fp32",
              "--host", "127.0.0.1"]
    started = {
        "inproc": _start(common + ["--threads", "1"], tmp_path_factory.mktemp("sw-inproc"), free_port()),
        "pooled": _start(common + ["--threads", "2", "--sampler-workers", "1"],
                         tmp_path_factory.mktemp("sw-pooled"), free_port()),
    }
    try:
        deadline = time.monotonic() + 240
        for s in started.values():
            _wait_healthy(s, deadline)
        clients = {k: tinker.ServiceClient(base_url=s.base_url, api_key=API_KEY) for k, s in started.items()}
        yield started, clients
        for c in clients.values():
            c.close("success").result(timeout=30)
    finally:
        for s in started.values():
            _stop(s)


def _stats(server) -> dict:
    return httpx.get(f"{server.base_url}/api/v1/local_stats", headers={"X-API-Key": API_KEY}, timeout=10).json()


def _prompt(seed: int, n: int) -> types.ModelInput:
    return types.ModelInput.from_ints(np.random.default_rng(seed).integers(3, VOCAB, n).tolist())


def _same(a: types.SampleResponse, b: types.SampleResponse) -> None:
    """Bit-identical: tokens, stop reasons, logprobs, top-k and prompt logprobs."""
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences]
    assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    assert [s.topk_logprobs for s in a.sequences] == [s.topk_logprobs for s in b.sequences]
    assert a.prompt_logprobs == b.prompt_logprobs
    assert a.topk_prompt_logprobs == b.topk_prompt_logprobs


def _train_one_step(sc: tinker.ServiceClient) -> tinker.TrainingClient:
    tc = sc.create_lora_training_client("tiny", rank=4, seed=7).result(timeout=120)
    rng = np.random.default_rng(3)
    data = []
    for n in (14, 9):
        seq = rng.integers(3, VOCAB, n).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64),
                                                "weights": np.ones(n - 1, np.float32)}))
    tc.forward_backward(data, "cross_entropy").result(timeout=120)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)
    return tc


def test_thread_split_stays_within_the_total():
    assert split_threads(2, 0) == (2, 0)
    assert split_threads(2, 1) == (1, 1)
    assert split_threads(16, 1) == (8, 8)
    assert split_threads(16, 3) == (4, 4)
    assert split_threads(7, 2) == (3, 2)
    assert split_threads(1, 1) == (1, 1)  # oversubscribed: the server warns


def test_the_credentials_block_passes_sampler_workers_to_the_real_cli(tmp_path):
    from tinker_blocks.credentials import TinkerCredentials, server_command
    from tinker_local.cli import build_parser

    cmd = server_command(TinkerCredentials(local=True, local_threads=4, local_sampler_workers=2), 8123, tmp_path)
    args = build_parser().parse_args(cmd[3:])
    assert (args.threads, args.sampler_workers) == (4, 2)
    assert "--sampler-workers" not in server_command(TinkerCredentials(local=True), 8123, tmp_path)
    assert build_parser().parse_args(["serve"]).sampler_workers == 0  # default: in-process


def test_seeded_sampling_in_workers_equals_in_process(servers):
    started, clients = servers
    base = {k: c.create_sampling_client(base_model="tiny").result(timeout=60) for k, c in clients.items()}
    trained = {k: _train_one_step(c).save_weights_and_get_sampling_client().result(timeout=120)
               for k, c in clients.items()}
    cases = [  # (prompt, num_samples, params, extra sample() kwargs)
        (_prompt(1, 9), 3, types.SamplingParams(max_tokens=12, seed=11, stop=[]), {}),
        (_prompt(2, 5), 2, types.SamplingParams(max_tokens=10, seed=12, temperature=0.7, top_k=40, top_p=0.9,
                                                 stop=[17, 23, 101]), {"topk_sample_logprobs": 3}),
        (_prompt(3, 7), 1, types.SamplingParams(max_tokens=6, seed=13, stop=[]),
         {"include_prompt_logprobs": True, "topk_prompt_logprobs": 2}),
        (_prompt(4, 6), 4, types.SamplingParams(max_tokens=8, seed=14, temperature=0.0), {}),
    ]
    for which in (base, trained):
        for prompt, n, params, kw in cases:
            a = which["inproc"].sample(prompt, n, params, **kw).result(timeout=120)
            b = which["pooled"].sample(prompt, n, params, **kw).result(timeout=120)
            _same(a, b)
    # the adapter reached the worker: trained samples differ from the base model's
    prompt, n, params, _ = cases[0]
    tb = trained["pooled"].sample(prompt, n, params).result(timeout=60)
    bb = base["pooled"].sample(prompt, n, params).result(timeout=60)
    assert [s.logprobs for s in tb.sequences] != [s.logprobs for s in bb.sequences]
    # compute_logprobs (prompt logprobs through asample) matches too
    seq = _prompt(5, 12)
    assert (trained["inproc"].compute_logprobs(seq).result(timeout=60)
            == trained["pooled"].compute_logprobs(seq).result(timeout=60))
    stats = _stats(started["pooled"])
    assert stats["sampler_workers"]["requests"][0] >= 2 * len(cases) + 3
    assert _stats(started["inproc"])["sampler_workers"] is None


def test_concurrent_requests_batch_in_the_worker_like_in_process(servers):
    started, clients = servers
    reqs = [(_prompt(20 + i, 4 + i % 3), 1 + i % 2,
             types.SamplingParams(max_tokens=5 + i, seed=200 + i, stop=[], temperature=0.9))
            for i in range(8)]
    out = {}
    for k, c in clients.items():
        sc = c.create_sampling_client(base_model="tiny").result(timeout=60)
        sequential = [sc.sample(p, n, sp).result(timeout=60) for p, n, sp in reqs]
        before = _stats(started[k])["compute"]
        concurrent = [f.result(timeout=120) for f in [sc.sample(p, n, sp) for p, n, sp in reqs]]
        after = _stats(started[k])["compute"]
        assert after["batched_jobs"] - before["batched_jobs"] == len(reqs)
        assert after["batches"] - before["batches"] < len(reqs), (k, before, after)
        out[k] = (sequential, concurrent)
    for a, b in zip(out["inproc"][0], out["pooled"][0], strict=True):
        _same(a, b)
    for run in (out["inproc"][1], out["pooled"][1]):  # a request's samples do not depend on its batch
        for a, b in zip(out["pooled"][0], run, strict=True):
            assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
            for sa, sb in zip(a.sequences, b.sequences, strict=True):
                np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-4)


def _sample_during_forward_backward(server, sc: tinker.ServiceClient) -> bool:
    """Submit a long forward_backward, then a short sample; whether the forward_backward was
    still running when the sample's result arrived."""
    tc = sc.create_lora_training_client("tiny", rank=4, seed=9).result(timeout=120)
    sampler = sc.create_sampling_client(base_model="tiny").result(timeout=60)
    sampler.sample(_prompt(7, 4), 1, types.SamplingParams(max_tokens=2, seed=1)).result(timeout=60)  # warm
    rng = np.random.default_rng(4)
    big = []
    for _ in range(8):
        seq = rng.integers(3, VOCAB, 257).tolist()
        big.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                               loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64)}))
    route = "/api/v1/forward_backward"
    seen = _stats(server)["requests"].get(route, 0)
    fb = tc.forward_backward(big, "cross_entropy")
    deadline = time.monotonic() + 60
    while _stats(server)["requests"].get(route, 0) == seen:  # counted once it is queued
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)  # the idle compute thread has taken it
    sampler.sample(_prompt(8, 4), 1, types.SamplingParams(max_tokens=3, seed=2, stop=[])).result(timeout=300)
    running = not _future_done(fb)
    fb.result(timeout=300)
    assert _future_done(fb)
    return running


def test_sampling_overlaps_a_running_forward_backward(servers):
    started, clients = servers
    # with a worker the sample comes back while the trainer is still busy ...
    assert _sample_during_forward_backward(started["pooled"], clients["pooled"])
    # ... in-process it waits behind the forward_backward
    assert not _sample_during_forward_backward(started["inproc"], clients["inproc"])


def _future_done(fut) -> bool:
    try:
        fut.result(timeout=0.01)
        return True
    except Exception:  # concurrent.futures.TimeoutError (or its tinker wrapper): still running
        return False


def test_a_killed_worker_fails_its_request_as_a_server_error_and_is_restarted(servers):
    started, clients = servers
    server = started["pooled"]
    sampler = clients["pooled"].create_sampling_client(base_model="tiny").result(timeout=60)
    old = _stats(server)["sampler_workers"]
    long = sampler.sample(_prompt(9, 4), 8, types.SamplingParams(max_tokens=1900, seed=3, stop=[]))
    deadline = time.monotonic() + 60
    while not _stats(server)["sampler_workers"]["busy"][0]:
        assert time.monotonic() < deadline, "the long request never reached the worker"
        time.sleep(0.05)
    os.kill(old["pids"][0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as err:
        long.result(timeout=120)
    assert time.monotonic() - t0 < 60
    assert "sampler worker 0" in str(err.value) and "exit code -9" in str(err.value)
    assert err.value.category is types.RequestErrorCategory.Server
    # the worker was restarted: the next request is served by a new process, same results
    params = types.SamplingParams(max_tokens=6, seed=31, stop=[])
    again = sampler.sample(_prompt(10, 5), 2, params).result(timeout=240)
    ref = clients["inproc"].create_sampling_client(base_model="tiny").result(timeout=60)
    _same(again, ref.sample(_prompt(10, 5), 2, params).result(timeout=60))
    new = _stats(server)["sampler_workers"]
    assert new["deaths"] == old["deaths"] + 1 and new["starts"][0] == old["starts"][0] + 1
    assert new["pids"][0] not in (None, old["pids"][0])


def test_user_errors_from_a_worker_stay_user_errors(servers):
    _, clients = servers
    sampler = clients["pooled"].create_sampling_client(base_model="tiny").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="vocab|outside|range") as err:
        sampler.sample(types.ModelInput.from_ints([5, VOCAB + 7]), 1,
                       types.SamplingParams(max_tokens=2, seed=1)).result(timeout=60)
    assert err.value.category is types.RequestErrorCategory.User
    ok = sampler.sample(_prompt(11, 3), 1, types.SamplingParams(max_tokens=2, seed=1)).result(timeout=60)
    assert len(ok.sequences[0].tokens) >= 1
