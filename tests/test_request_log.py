"""The local server's request log (``--record-requests``) and content-derived sampling seeds
(``--sampling-seed content``), through the real SDK against an in-process server."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker

from tests import inproc_server
from tinker_local.request_log import ContentSeeds, content_key, content_seed


def test_content_seeds_count_occurrences_per_session_and_content():
    seeds = ContentSeeds()
    k = content_key([1, 2, 3], {"max_tokens": 4, "temperature": 1.0, "seed": 5}, "base:tiny")
    assert k == content_key([1, 2, 3], {"max_tokens": 4, "temperature": 1.0, "seed": 99}, "base:tiny")  # seed ignored
    assert k != content_key([1, 2, 4], {"max_tokens": 4, "temperature": 1.0}, "base:tiny")
    assert k != content_key([1, 2, 3], {"max_tokens": 4, "temperature": 1.0}, "sha256:other")
    first = seeds.take("s1", k, 3)
    assert first == [content_seed(k, i) for i in range(3)] and len(set(first)) == 3
    assert seeds.take("s1", k, 1) == [content_seed(k, 3)]  # continues
    assert seeds.take("s2", k, 2) == first[:2]  # another session starts again


def _sample(sampler, prompt, params, n: int, times: int) -> list[list[int]]:
    """The tokens of ``times`` requests of ``n`` samples each."""
    out = []
    for _ in range(times):
        out += [s.tokens for s in sampler.sample(prompt, num_samples=n, sampling_params=params).result().sequences]
    return out


def test_requests_are_recorded_and_identical_requests_sample_identically(tmp_path):
    log = tmp_path / "requests"
    srv = inproc_server.start(tmp_path / "root", ["tiny"], record_requests=log, content_seeds=True, default_lora_seed=7)
    try:
        outs = []
        for k in range(2):  # two sessions asking the same things, the second the sampling in another shape first
            with tinker.ServiceClient(base_url=srv.base_url, api_key="tml-request-log") as sc:  # ends its heartbeat
                tc = sc.create_lora_training_client(base_model="tiny", rank=2).result()
                tok = [5, 6, 7, 8, 9]
                datum = tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tok[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(tok[1:], dtype=np.int64),
                        "weights": np.ones(4, np.float32),
                    },
                )
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
                sampler = tc.save_weights_and_get_sampling_client().result()
                params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=None)
                prompt = tinker.ModelInput.from_ints([5, 6, 7])

                if k == 0:
                    outs.append((_sample(sampler, prompt, params, 4, 1), _sample(sampler, prompt, params, 1, 4)))
                else:
                    ones = _sample(sampler, prompt, params, 1, 4)
                    outs.append((_sample(sampler, prompt, params, 4, 1), ones))
        # the same request in two sessions gets the same completions: 4 samples in one request are the
        # 4 samples of 4 requests of one (occurrences 0-3 of that content, then 4-7)
        assert outs[0][0] == outs[1][1] and outs[0][1] == outs[1][0]
        assert len({tuple(t) for t in outs[0][0]}) > 1  # not one completion repeated
        sessions = sorted(log.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
        assert len(sessions) == 2
        entries = [json.loads(line) for line in sessions[0].read_text().splitlines()]
        ops = [e["op"] for e in entries]
        assert ops[:3] == ["create_model", "forward_backward", "optim_step"] and ops.count("sample") == 5
        assert entries[0]["seed"] == 7 and entries[0]["lora_rank"] == 2  # --lora-seed filled the missing seed
        fb = entries[1]
        assert fb["loss_fn"] == "cross_entropy" and fb["datums"][0]["model_input"] == [5, 6, 7, 8]
        assert fb["datums"][0]["loss_fn_inputs"]["target_tokens"] == {"shape": [4], "data": [6, 7, 8, 9]}
        assert fb["metrics"]["loss:sum"] == pytest.approx(-sum(fb["logprobs"][0]), rel=1e-6)  # weights 1: sum of NLLs
        assert entries[2]["adam_params"]["learning_rate"] == 1e-3
        s = next(e for e in entries if e["op"] == "sample")
        assert s["prompt"] == [5, 6, 7] and s["weights"].startswith("sha256:") and len(s["seeds"]) == 4
        assert [q["tokens"] for q in s["sequences"]] == outs[0][0]
    finally:
        srv.stop()


def test_seq_order_admits_a_sessions_requests_in_seq_id_order():
    """Requests arriving in the order 2, 0, 1 (concurrent HTTP requests overtake each other) are
    handled 0, 1, 2; another session is not held up; a request whose predecessor never comes goes
    on after the timeout."""
    import asyncio

    from tinker_local.request_log import SEQ_BLOCK, SeqOrder

    async def run() -> tuple[list[tuple[str, int]], float]:
        order, handled = SeqOrder(timeout_s=0.5), []

        async def request(session: str, seq: int, delay: float) -> None:
            await asyncio.sleep(delay)
            await order.admit(session, seq)
            handled.append((session, seq))
            await order.done(session, seq)

        base = 3 * SEQ_BLOCK  # a cloned client's block
        await asyncio.gather(
            request("s", base + 2, 0.0), request("s", base, 0.05), request("s", base + 1, 0.1), request("t", 0, 0.02)
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await request("u", 5, 0.0)  # 0..4 never come: admitted after the timeout
        return handled, loop.time() - t0

    handled, waited = asyncio.run(run())
    assert [s for s in handled if s[0] == "s"] == [("s", 3 * SEQ_BLOCK + k) for k in range(3)]
    assert handled.index(("t", 0)) < handled.index(("s", 3 * SEQ_BLOCK + 1))
    assert handled[-1] == ("u", 5) and 0.4 < waited < 5
