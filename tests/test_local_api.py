"""The rest of the Tinker API on ``tinker_local``, through the unmodified SDK against live servers
(``tests/local_server.py``): sampling features and batching, tokenizers of sampling clients,
REST (runs, checkpoints, lookup by path, deletion, sessions, capabilities), several LoRA runs at
once, user errors, and fault injection.  References are computed here with plain transformers."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import torch

import tinker
from tests.local_server import API_KEY
from tinker import types
from tinker.lib.telemetry import is_user_error

VOCAB = 2048


@pytest.fixture(scope="module")
def base_ref(clean):
    """The tiny preset's base model in fp32, loaded by transformers from the server's cache."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(clean.root / "models" / "tiny"), dtype=torch.float32).eval()


def _datum(seq: list[int], weights=None) -> types.Datum:
    w = np.ones(len(seq) - 1, np.float32) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64), "weights": w})


def _seqs(seed: int, lengths=(12, 7)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _prompt_logp(model, tokens: list[int]) -> torch.Tensor:
    """(P-1, V) log-softmax: row i is the distribution of tokens[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, :-1].float(), -1)


# ------------------------------------------------------------------------------------------------
# sampling


def test_prompt_logprobs_topk_compute_logprobs_and_many_samples(service, base_ref):
    sc = service.create_sampling_client(base_model="tiny").result(timeout=60)
    prompt = _seqs(1, (11,))[0]
    logp = _prompt_logp(base_ref, prompt)
    expected = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].numpy()
    lps = sc.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=60)
    assert lps[0] is None and len(lps) == len(prompt)
    np.testing.assert_allclose(np.array(lps[1:], np.float32), expected, atol=1e-4)

    res = sc.sample(types.ModelInput.from_ints(prompt), 16, types.SamplingParams(max_tokens=5, seed=4, stop=[]),
                    include_prompt_logprobs=True, topk_prompt_logprobs=4).result(timeout=60)
    np.testing.assert_allclose(np.array(res.prompt_logprobs[1:], np.float32), expected, atol=1e-4)
    top_v, top_i = torch.topk(logp, 4, dim=-1)
    assert res.topk_prompt_logprobs[0] is None
    for row, ids, vals in zip(res.topk_prompt_logprobs[1:], top_i.tolist(), top_v.tolist(), strict=False):
        assert [t for t, _ in row] == ids
        np.testing.assert_allclose([v for _, v in row], vals, atol=1e-4)
    assert len(res.sequences) == 16 and len({s.sequence_id for s in res.sequences}) == 16
    assert all(len(s.tokens) == 5 == len(s.logprobs) for s in res.sequences)
    assert len({tuple(s.tokens) for s in res.sequences}) > 8  # independent draws


def test_concurrent_sample_requests_are_batched_and_match_sequential(clean, service):
    other = tinker.ServiceClient(base_url=clean.base_url, api_key=API_KEY)  # a second session
    try:
        clients = [service.create_sampling_client(base_model="tiny").result(timeout=60),
                   service.create_sampling_client(base_model="tiny").result(timeout=60),
                   other.create_sampling_client(base_model="tiny").result(timeout=60)]
        rng = np.random.default_rng(9)
        reqs = [(clients[i % 3], types.ModelInput.from_ints(rng.integers(3, VOCAB, 3 + i).tolist()), 1 + i % 3,
                 types.SamplingParams(max_tokens=6 + i, seed=100 + i, stop=[], temperature=0.8 + 0.1 * (i % 3),
                                      top_k=(-1, 50)[i % 2]))
                for i in range(9)]
        sequential = [c.sample(p, n, sp).result(timeout=60) for c, p, n, sp in reqs]
        before = clean.stats()["compute"]
        futures = [c.sample(p, n, sp) for c, p, n, sp in reqs]  # all in flight at once
        concurrent = [f.result(timeout=120) for f in futures]
        after = clean.stats()["compute"]
    finally:
        other.close("success").result(timeout=30)
    for a, b in zip(sequential, concurrent, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-4)
    batches = after["batches"] - before["batches"]
    assert after["batched_jobs"] - before["batched_jobs"] == len(reqs)
    assert batches < len(reqs) and after["max_batch"] >= 2, (before, after)


def test_sampling_clients_load_their_tokenizer(clean, service, hf_model_dir):
    tc = service.create_lora_training_client("tiny", rank=2, seed=1).result(timeout=120)
    text = "hello world 12 + 34"
    expected = tc.get_tokenizer().encode(text)
    sc = tc.save_weights_and_get_sampling_client().result(timeout=60)
    assert sc.get_tokenizer().encode(text) == expected
    path = tc.save_weights_for_sampler("tok").result(timeout=60).path
    by_path = service.create_sampling_client(model_path=path).result(timeout=60)
    assert by_path.get_tokenizer().encode(text) == expected
    # the reported base model name is a local directory that names the same base model
    by_name = service.create_sampling_client(base_model=by_path.get_base_model()).result(timeout=60)
    prompt = types.ModelInput.from_ints(expected)
    params = types.SamplingParams(max_tokens=4, seed=3, stop=[])
    a = by_name.sample(prompt, 1, params).result(timeout=60)
    b = (
        service.create_sampling_client(base_model="tiny")
        .result(timeout=60)
        .sample(prompt, 1, params)
        .result(timeout=60)
    )
    assert a.sequences[0].tokens == b.sequences[0].tokens
    hf = service.create_sampling_client(base_model=str(hf_model_dir)).result(timeout=60)
    assert hf.get_tokenizer().decode(hf.get_tokenizer().encode("hello world")) == "hello world"


# ------------------------------------------------------------------------------------------------
# REST, sessions, several runs


def test_runs_checkpoints_lookup_deletion_sessions(clean, service, hf_model_dir):
    tc = service.create_lora_training_client("tiny", rank=4, seed=2, user_metadata={"owner": "t"}).result(timeout=120)
    tc.forward_backward([_datum(s) for s in _seqs(2)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    state = tc.save_state("s1").result(timeout=60).path
    sampler = tc.save_weights_for_sampler("w1").result(timeout=60).path
    rc = tinker.RestClient(base_url=clean.base_url, api_key=API_KEY)

    caps = {m.model_name: m for m in rc.get_server_capabilities().result(timeout=30).supported_models}
    assert caps["tiny"].max_context_length == 2048 and caps[str(hf_model_dir)].max_context_length == 512
    cks = {c.tinker_path: c for c in rc.list_checkpoints(tc.model_id).result(timeout=30).checkpoints}
    assert cks[state].checkpoint_type == "training" and cks[sampler].checkpoint_type == "sampler"
    assert cks[state].size_bytes > 0
    assert state in [c.tinker_path for c in rc.list_user_checkpoints().result(timeout=30).checkpoints]
    run = rc.get_training_run_by_tinker_path(sampler).result(timeout=30)
    assert (run.training_run_id, run.base_model, run.lora_rank) == (tc.model_id, "tiny", 4)
    assert run.user_metadata == {"owner": "t"} and run.last_checkpoint.tinker_path == state
    assert tc.model_id in [r.training_run_id for r in rc.list_training_runs(limit=100).result(timeout=30).training_runs]

    rc.delete_checkpoint_from_tinker_path(state).result(timeout=30)
    assert state not in [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result(timeout=30).checkpoints]
    assert not clean.checkpoint_dir(state).exists() and clean.checkpoint_dir(sampler).exists()
    with pytest.raises(tinker.NotFoundError):
        service.create_training_client_from_state(state).result(timeout=60)

    sid = service.holder.get_session_id()
    assert sid in rc.list_sessions(limit=100).result(timeout=30).sessions
    assert tc.model_id in rc.get_session(sid).result(timeout=30).training_run_ids
    # session finish: later heartbeats of that session answer 410 (the SDK stops heartbeating)
    short = tinker.ServiceClient(base_url=clean.base_url, api_key=API_KEY)
    short.create_sampling_client(base_model="tiny").result(timeout=60)
    short_id = short.holder.get_session_id()
    hb = {"X-API-Key": API_KEY}
    assert httpx.post(f"{clean.base_url}/api/v1/session_heartbeat", json={"session_id": short_id},
                      headers=hb).status_code == 200
    short.close("success").result(timeout=30)
    assert httpx.post(f"{clean.base_url}/api/v1/session_heartbeat", json={"session_id": short_id},
                      headers=hb).status_code == 410


def test_several_lora_runs_on_one_base_do_not_interfere(service):
    data_a = [_datum(s) for s in _seqs(3)]
    data_b = [_datum(s) for s in _seqs(4, (20, 5, 9))]
    a = service.create_lora_training_client("tiny", rank=4, seed=11).result(timeout=120)
    b = service.create_lora_training_client("tiny", rank=8, seed=12, train_mlp=False).result(timeout=120)
    adam = types.AdamParams(learning_rate=5e-3)
    for _ in range(3):  # interleaved on the server: a, b, a, b, ...
        futs = [a.forward_backward(data_a, "cross_entropy"), b.forward_backward(data_b, "cross_entropy"),
                a.optim_step(adam), b.optim_step(adam)]
        [f.result(timeout=60) for f in futs]
    alone = service.create_lora_training_client("tiny", rank=4, seed=11).result(timeout=120)
    for _ in range(3):
        alone.forward_backward(data_a, "cross_entropy")
        alone.optim_step(adam).result(timeout=60)
    got = a.forward(data_a, "cross_entropy").result(timeout=60)
    ref = alone.forward(data_a, "cross_entropy").result(timeout=60)
    for x, y in zip(got.loss_fn_outputs, ref.loss_fn_outputs, strict=True):
        np.testing.assert_array_equal(x["logprobs"].to_numpy(), y["logprobs"].to_numpy())
    other = b.forward(data_a, "cross_entropy").result(timeout=60)
    assert abs(other.metrics["loss:sum"] - got.metrics["loss:sum"]) > 1e-3


# ------------------------------------------------------------------------------------------------
# errors


def _count(server, route: str) -> int:
    return server.stats()["requests"].get(f"/api/v1/{route}", 0)


def test_user_errors_are_user_category_not_retried_and_leave_the_client_usable(clean, service):
    tc = service.create_lora_training_client("tiny", rank=2, seed=5).result(timeout=120)
    good = [_datum(s) for s in _seqs(5)]
    before = tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"]
    cases = [([_datum([1, 2, 5000])], "vocabulary"), ([_datum([1] * 2050)], "context")]
    for data, words in cases:
        n = _count(clean, "forward_backward")
        with pytest.raises(tinker.RequestFailedError) as e:
            tc.forward_backward(data, "cross_entropy").result(timeout=60)
        assert e.value.category == types.RequestErrorCategory.User and is_user_error(e.value)
        assert words in str(e.value) and _count(clean, "forward_backward") == n + 1
    with pytest.raises(tinker.RequestFailedError, match="beta1") as e:
        tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result(timeout=60)
    # the failed requests left no gradient behind and the model's request order intact
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"] == before
    n = _count(clean, "save_weights")
    with pytest.raises(tinker.UnprocessableEntityError) as e:  # refused at submission (HTTP 422)
        tc.save_state("no spaces allowed").result(timeout=60)
    assert is_user_error(e.value) and _count(clean, "save_weights") == n + 1
    t0 = time.monotonic()
    tc.forward_backward(good, "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    assert time.monotonic() - t0 < 15  # no wait for the refused request's seq_id
    assert tc.forward(good, "cross_entropy").result(timeout=60).metrics["loss:sum"] < before

    n = _count(clean, "create_model")
    with pytest.raises(tinker.RequestFailedError, match="no-such/model") as e:
        service.create_lora_training_client("no-such/model", rank=2).result(timeout=60)
    assert is_user_error(e.value) and _count(clean, "create_model") == n + 1
    for call in (lambda: service.create_training_client_from_state("tinker://nope:train:0/weights/x"),
                 lambda: service.create_sampling_client(model_path="tinker://nope:train:0/sampler_weights/x")):
        with pytest.raises(tinker.NotFoundError) as e:
            call().result(timeout=60)
        assert is_user_error(e.value)
    h = {"X-API-Key": API_KEY}
    assert httpx.post(f"{clean.base_url}/api/v1/forward_backward", content=b"\x07garbage", headers={
        **h, "Content-Type": "application/x-protobuf"}).status_code == 422
    assert httpx.post(f"{clean.base_url}/api/v1/create_model", json={"session_id": "x"}, headers=h).status_code == 422
    assert httpx.post(f"{clean.base_url}/api/v1/asample", json={
        "base_model": "tiny", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
        "sampling_params": {"stop": [1.5]}}, headers=h).status_code == 422


# ------------------------------------------------------------------------------------------------
# fault injection


def _sft_run(base_url: str) -> tuple[list[float], float, list[int]]:
    sc = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    try:
        tc = sc.create_lora_training_client("tiny", rank=4, seed=21).result(timeout=120)
        data = [_datum(s) for s in _seqs(21, (30, 17, 25))]
        losses = []
        for _ in range(6):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
            losses.append(fb.result(timeout=120).metrics["loss:sum"])
            opt.result(timeout=120)
        final = tc.forward(data, "cross_entropy").result(timeout=120).metrics["loss:sum"]
        sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
        tokens = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2, types.SamplingParams(
            max_tokens=8, seed=5, stop=[])).result(timeout=120).sequences
        return losses, final, [t for s in tokens for t in s.tokens]
    finally:
        sc.close("success").result(timeout=60)


def test_sft_run_through_injected_faults_is_identical(local_servers):
    faulty = local_servers["faulty"]
    before = faulty.stats()["faults"]
    got = _sft_run(faulty.base_url)
    after = faulty.stats()["faults"]
    assert after["failed"] > before["failed"] and after["dropped"] > before["dropped"], after
    assert got == _sft_run(local_servers["clean"].base_url)
