"""What the local server would otherwise skip without a word is counted and said once: sampling
requests whose sequences could not be recorded for ``record_stability_info`` (their ids came too
late); and the sampling counters themselves, which batches finishing on several threads update
under one lock, so that a reader sees each batch's counts together
(``tinker_local.service_sampling``). The packing fallback is checked in tests/test_local_packing.py."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

import tinker
from tests import inproc_server
from tinker import types
from tinker.proto import tinker_public_pb2 as pb


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    live = inproc_server.start(tmp_path_factory.mktemp("counters-root"), ["tiny"])
    yield live
    live.stop()


def _local_stats(base_url: str) -> dict:
    req = urllib.request.Request(base_url + "/api/v1/local_stats", headers={"X-API-Key": "tml-counters"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
        return json.loads(resp.read())


class _YieldingCounts(dict):
    """The service's counters, giving other threads the interpreter between reading a counter
    and storing its new value (``time.sleep(0)``), as a computation between the two would: the
    window where unlocked read-add-write steps of two threads lose one of the updates."""

    def __setitem__(self, key, value):
        time.sleep(0)
        super().__setitem__(key, value)


def test_sampling_counters_of_one_batch_appear_together_and_add_up(server):
    """Writer threads add one batch's counts at a time (1 request, 3 sampled tokens, 2 cached
    prompt tokens) while a reader takes snapshots: every snapshot holds whole batches only, and
    the totals are exact (without the lock, updates are lost and snapshots fall between two
    counters of one batch)."""
    svc = server.service
    counters = svc.sampling.counters
    counters.counts = _YieldingCounts(counters.counts)
    base = svc.sampling.sampling_stats
    torn: list[dict] = []
    done = threading.Event()

    def add() -> None:
        for _ in range(500):
            counters.add(requests=1, sampled_tokens=3, prompt_tokens_cached=2)

    def read() -> None:
        while not done.is_set():
            now = svc.sampling.sampling_stats
            n = now["requests"] - base["requests"]
            if (now["sampled_tokens"] - base["sampled_tokens"], now["prompt_tokens_cached"]
                    - base["prompt_tokens_cached"]) != (3 * n, 2 * n):
                torn.append(now)
            time.sleep(0)

    try:
        writers = [threading.Thread(target=add) for _ in range(4)]
        reader = threading.Thread(target=read)
        reader.start()
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        done.set()
        reader.join()
        after = svc.sampling.sampling_stats
    finally:
        counters.counts = dict(counters.counts)
    assert torn == []
    assert after["requests"] - base["requests"] == 2000
    assert after["sampled_tokens"] - base["sampled_tokens"] == 6000
    assert after["prompt_tokens_cached"] - base["prompt_tokens_cached"] == 4000


def test_sequences_whose_ids_came_late_are_counted_and_said_once(server, monkeypatch, caplog):
    """The request thread is held up after queueing (its sequence ids come only once the batch gave
    up waiting for them, after 0.05 s): each such request is counted in ``local_stats``, one
    warning says so, and provenance naming its sequences is refused as unknown."""
    from tinker_local import protocol_sampling, service_sampling

    made = protocol_sampling.sequence_ids
    calls: list[str] = []

    def late(request_id: str, n: int) -> list[str]:  # the ids come once the batch gave up on them
        calls.append(request_id)
        deadline = time.monotonic() + 30
        while server.service.sampling.sampling_stats["stability_not_recorded"] < before + len(calls):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return made(request_id, n)

    monkeypatch.setattr(service_sampling, "SEQUENCE_IDS_WAIT_S", 0.05)
    sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-counters")
    try:
        tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=120)
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=60)
        before = _local_stats(server.base_url)["sampling"]["stability_not_recorded"]
        monkeypatch.setattr(protocol_sampling, "sequence_ids", late)
        prompt = [5, 6, 7, 8]
        with caplog.at_level("WARNING", logger="tinker_local.sampling"):
            results = [sampler.sample(types.ModelInput.from_ints(prompt), 1,
                                      types.SamplingParams(max_tokens=3, seed=k, stop=[])).result(timeout=60)
                       for k in range(2)]
        assert _local_stats(server.base_url)["sampling"]["stability_not_recorded"] == before + 2
        said = [r.getMessage() for r in caplog.records if r.name == "tinker_local.sampling"]
        assert len(said) == 1 and "its sequences are not recorded" in said[0]
        seq = results[0].sequences[0]
        assert seq.sequence_id  # the client got ids, but the server recorded nothing under them
        n = len(seq.tokens)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(prompt + list(seq.tokens)[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(prompt[1:] + list(seq.tokens), np.int64),
                            "logprobs": np.asarray([0.0] * (len(prompt) - 1) + list(seq.logprobs), np.float32),
                            "advantages": np.asarray([0.0] * (len(prompt) - 1) + [1.0] * n, np.float32)},
            model_input_spans=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(prompt)),
                               types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=n - 1)],
            loss_fn_input_spans=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1,
                                                            length=len(prompt) - 1),
                                 types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=n)],
        )
        # a loss that uses provenance (checked before the server refuses stable_reinforce by name); losses
        # that do not use it take unrecorded spans, as tinker-cookbook's RL loop sends them
        with pytest.raises(tinker.BadRequestError, match="is unknown or expired"):
            tc.forward_backward([datum], "stable_reinforce").result(timeout=60)
    finally:
        sc.close("success").result(timeout=30)


def test_the_service_state_is_set_at_start(server):
    """``LocalService`` is its state plus parts built on it, each setting all of its attributes in
    its ``__init__``: after sampling (stability records, counters) nothing new appears on the
    service or on any part, and each part works on the service's own state."""
    from tinker_local.rest import RestEndpoints
    from tinker_local.rest_sessions import SessionEndpoints
    from tinker_local.service import LocalService
    from tinker_local.service_export import ExportEndpoints
    from tinker_local.service_losses import CustomLosses
    from tinker_local.service_sampling import SamplingEndpoints

    kinds = {
        "rest": RestEndpoints,
        "sessions": SessionEndpoints,
        "sampling": SamplingEndpoints,
        "export": ExportEndpoints,
        "losses": CustomLosses,
    }

    def attributes(s: LocalService) -> dict[str, set[str]]:
        out = {"service": set(vars(s))}
        for name, kind in kinds.items():
            part = getattr(s, name)
            assert isinstance(part, kind) and part.state is s
            out[name] = set(vars(part))
        return out

    svc = server.service
    fresh = attributes(LocalService(svc.engine, server.root / "fresh-service"))
    assert fresh["service"] >= {"engine", "store", "registry", "tenancy", *kinds}
    assert fresh["sampling"] == {"state", "sampler_pool", "sample_step_s", "counters", "inflight", "stability"}
    with tinker.ServiceClient(base_url=server.base_url, api_key="tml-counters") as sc:
        sampler = sc.create_sampling_client(base_model="tiny", record_stability_info=True).result(timeout=60)
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result(timeout=60)
    assert attributes(svc) == fresh
