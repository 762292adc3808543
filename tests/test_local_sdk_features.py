"""SDK 0.38 request features through the unmodified SDK against a live ``tinker_local`` server
(the session's ``clean`` server, tiny preset, fp32), checked against an independent fp32 forward
(transformers + hand-made LoRA hooks, ``tests.local_server.ReferenceLoRA``):

- inflight sampling clients move to the newest inflight save, snapshot clients never move;
- ``target_prompt_logprobs`` (dense and sparse CSR) and ``prompt_alt_tokens_k``; ``sequence_id`` on
  every sequence; ``prompt_cache_hit_tokens`` and the server's prompt-token counters;
- ``record_stability_info`` sampling and ``Datum.with_provenance``: valid provenance trains, unknown
  sequence ids, spans that do not tile, tokens that differ and other sessions' sequences are 400s,
  ``stable_reinforce`` is refused by name; Dimuon is refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinker
from tests.local_server import API_KEY, ReferenceLoRA
from tinker import types

VOCAB = 2048


@pytest.fixture(scope="module")
def trainer(service):
    return service.create_lora_training_client("tiny", rank=4, seed=11).result(timeout=120)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, VOCAB, n).tolist()


def _train_step(tc, seed: int) -> None:
    seq = _prompt(seed, 12)
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64)})
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)


def _logprobs(client, prompt: list[int]) -> np.ndarray:
    return np.asarray(client.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=60)[1:])


def test_inflight_clients_follow_the_newest_inflight_save(clean, trainer):
    prompt = _prompt(1, 10)
    inflight_a = trainer.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)
    snapshot = trainer.save_weights_and_get_sampling_client().result(timeout=60)
    a0, s0 = _logprobs(inflight_a, prompt), _logprobs(snapshot, prompt)
    np.testing.assert_allclose(a0, s0, atol=1e-5)
    _train_step(trainer, 2)
    inflight_b = trainer.save_weights_and_get_sampling_client(kind="inflight").result(timeout=60)
    a1, b1, s1 = _logprobs(inflight_a, prompt), _logprobs(inflight_b, prompt), _logprobs(snapshot, prompt)
    assert np.abs(a1 - a0).max() > 1e-2  # the old inflight client moved ...
    np.testing.assert_allclose(a1, b1, atol=1e-5)  # ... to the newest inflight weights
    np.testing.assert_array_equal(s1, s0)  # the snapshot did not
    # the weights it samples are the trainer's now: an independent forward of the saved adapter
    newest = sorted((clean.root / "checkpoints").glob("*/sampler_weights/*"), key=lambda p: p.stat().st_mtime)[-1]
    ref = ReferenceLoRA(clean.root / "models" / "tiny", newest)
    with torch.no_grad():
        want = ref.logprobs(prompt[:-1], prompt[1:]).numpy()
    np.testing.assert_allclose(a1, want, atol=1e-4)
    # a snapshot save after that leaves the inflight clients where they are
    _train_step(trainer, 3)
    trainer.save_weights_and_get_sampling_client().result(timeout=60)
    np.testing.assert_allclose(_logprobs(inflight_a, prompt), b1, atol=1e-5)


@pytest.fixture(scope="module")
def base_logp(clean):
    """``logp(prompt)`` -> (P - 1, V) log-softmax rows of the tiny base model (transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(clean.root / "models" / "tiny"), dtype=torch.float32).eval()

    def logp(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)

    return logp


def test_target_and_alternative_prompt_logprobs(clean, service, base_logp):
    sampler = service.create_sampling_client(base_model="tiny").result(timeout=60)
    prompt = _prompt(4, 11)
    ref = base_logp(prompt)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, (10, 4))
    ids[:, 0] = prompt[1:]
    ids[rng.random((10, 4)) < 0.25] = -1
    params = types.SamplingParams(max_tokens=3, seed=1)
    mi = types.ModelInput.from_ints(prompt)
    dense = sampler.sample(mi, 2, params, target_prompt_logprobs=types.TensorData.from_numpy(ids),
                           prompt_alt_tokens_k=6).result(timeout=60)
    want = np.where(ids >= 0, ref.gather(-1, torch.as_tensor(np.maximum(ids, 0))).numpy(), 0.0)
    got = dense.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [10, 4] and got.sparse_crow_indices is None
    np.testing.assert_allclose(got.to_numpy(), want, atol=1e-4)
    alt = dense.prompt_alt_tokens
    alt_ids, alt_lp = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert alt_ids.shape == alt_lp.shape == (10, 6) and alt.tokens.dtype == "int64"
    np.testing.assert_allclose(alt_lp, ref.gather(-1, torch.as_tensor(alt_ids)).numpy(), atol=1e-4)
    assert len({s.sequence_id for s in dense.sequences}) == 2 and all(s.sequence_id for s in dense.sequences)

    # sparse CSR: only the listed cells are asked; the answer has the same layout
    sparse_ids = np.full((10, 8), -1)
    sparse_ids[:, 0], sparse_ids[::3, 5] = prompt[1:], 7  # 14 of 80 cells listed
    td = types.TensorData.from_torch_sparse(torch.as_tensor(sparse_ids), pad_value=-1)
    assert td.sparse_crow_indices is not None
    sparse = sampler.sample(mi, 1, params, target_prompt_logprobs=td).result(timeout=60)
    out = sparse.target_prompt_logprobs
    assert out.sparse_crow_indices == td.sparse_crow_indices and out.sparse_col_indices == td.sparse_col_indices
    want = np.where(sparse_ids >= 0, ref.gather(-1, torch.as_tensor(np.maximum(sparse_ids, 0))).numpy(), 0.0)
    np.testing.assert_allclose(out.to_numpy(), want, atol=1e-4)
    assert sparse.prompt_alt_tokens is None and dense.prompt_cache_hit_tokens == 0

    with pytest.raises(tinker.RequestFailedError, match=r"shape \[len\(prompt\) - 1, K\] = \[10, K\]"):
        sampler.sample(mi, 1, params, target_prompt_logprobs=types.TensorData.from_numpy(
            np.zeros((4, 1), np.int64))).result(timeout=60)


def test_prompt_cache_counters(clean, service):
    sampler = service.create_sampling_client(base_model="tiny").result(timeout=60)
    prompt = types.ModelInput.from_ints(_prompt(6, 40))
    before = clean.stats()["sampling"]
    futures = [sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2, seed=s)) for s in range(6)]
    results = [f.result(timeout=60) for f in futures]
    after = clean.stats()["sampling"]
    hits = sum(r.prompt_cache_hit_tokens for r in results)
    assert after["requests"] - before["requests"] == 6
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == hits
    assert (after["prompt_tokens_uncached"] - before["prompt_tokens_uncached"]) + hits == 6 * 40
    assert all(r.prompt_cache_hit_tokens in (0, 40) for r in results)
    assert after["sampled_tokens"] - before["sampled_tokens"] == sum(len(s.tokens) for r in results
                                                                     for s in r.sequences)


def _provenance_datum(prompt, seq, adv=1.0, prompt_spans=None, sampled_spans=None, tokens=None) -> types.Datum:
    full = prompt + seq.tokens
    inp = full[:-1] if tokens is None else tokens
    n = len(inp)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(inp),
        loss_fn_inputs={"target_tokens": np.asarray(full[1:], np.int64),
                        "logprobs": np.asarray([0.0] * (len(prompt) - 1) + list(seq.logprobs), np.float32),
                        "advantages": np.asarray([0.0] * (len(prompt) - 1) + [adv] * len(seq.tokens), np.float32)})
    sid = seq.sequence_id
    mi = prompt_spans or [types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=len(prompt)),
                          types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n - len(prompt))]
    lf = sampled_spans or [types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                           types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=len(seq.tokens))]
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs,
                       model_input_spans=mi, loss_fn_input_spans=lf)


def test_stability_info_and_provenance(clean, service, trainer):
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=60)
    prompt = _prompt(7, 8)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                         types.SamplingParams(max_tokens=5, seed=3, stop=[])).result(timeout=60)
    seq = res.sequences[0]
    good = _provenance_datum(prompt, seq)
    out = trainer.forward_backward([good], "importance_sampling").result(timeout=60)
    assert out.loss_fn_outputs[0]["logprobs"].shape == [len(prompt) + 4]

    unknown = _provenance_datum(prompt, seq, sampled_spans=[
        types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
        types.SampledProvenanceSpan(sequence_id="no-such-sequence", offset=0, length=5)])
    with pytest.raises(tinker.BadRequestError, match="is unknown or expired"):
        trainer.forward_backward([unknown], "stable_reinforce").result(timeout=60)
    # a loss that does not use provenance takes spans naming unrecorded sequences (sampled without
    # record_stability_info), as tinker-cookbook's RL loop sends them; the logprobs are those without spans
    same = trainer.forward_backward([unknown], "importance_sampling").result(timeout=60)
    np.testing.assert_allclose(same.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               out.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-6)
    with pytest.raises(tinker.BadRequestError, match="must tile it exactly"):
        short = _provenance_datum(prompt, seq, sampled_spans=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=3)])
        trainer.forward_backward([short], "importance_sampling").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="differ from the sampled tokens"):
        other = res.sequences[1]
        swapped = _provenance_datum(prompt, seq, sampled_spans=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=other.sequence_id, offset=0, length=5)])
        if list(other.tokens) == list(seq.tokens):
            pytest.skip("both samples drew the same tokens")
        trainer.forward_backward([swapped], "importance_sampling").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="needs provenance"):
        plain = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
        trainer.forward_backward([plain], "stable_reinforce").result(timeout=60)
    with pytest.raises(tinker.RequestFailedError, match="'stable_reinforce' is not implemented by tinker_local"):
        trainer.forward_backward([good], "stable_reinforce").result(timeout=60)

    # another session cannot name this session's sequences
    other_sc = tinker.ServiceClient(base_url=clean.base_url, api_key=API_KEY)
    try:
        tc2 = other_sc.create_lora_training_client("tiny", rank=4, seed=1).result(timeout=120)
        with pytest.raises(tinker.BadRequestError, match="was sampled in session"):
            tc2.forward_backward([good], "importance_sampling").result(timeout=60)
    finally:
        other_sc.close("success").result(timeout=30)
    # the training client still works after the refusals; datums without provenance may sit beside
    # datums with it (except for stable_reinforce)
    plain = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
    both = trainer.forward_backward([good, plain], "importance_sampling").result(timeout=60)
    np.testing.assert_allclose(both.loss_fn_outputs[0]["logprobs"].to_numpy(),
                               both.loss_fn_outputs[1]["logprobs"].to_numpy(), atol=1e-6)


def test_recorded_sequences_expire_a_day_after_their_last_use():
    from tinker.proto import tinker_public_pb2 as pb

    from tinker_local.errors import HttpError
    from tinker_local.futures import FutureStore
    from tinker_local.service_stability import STABILITY_TTL_S, StabilityMixin

    class Service(StabilityMixin):
        now = 1000.0

        def clock(self):
            return self.now

        store = FutureStore()

    svc = Service()
    svc.record_stability("sess-a:sample:0", ["r:0"], [5, 6, 7], [{"tokens": [8, 9], "logprobs": [-1.0, -2.0]}])
    # stable_reinforce: the loss that needs provenance (for the others an unrecorded sequence passes unchecked)
    msg = pb.ForwardBackwardRequest(model_id="m", loss_fn="stable_reinforce")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([5, 6, 7, 8], np.int32).tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.asarray([6, 7, 8, 9], np.int64).tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].shape.append(4)
    for field, runs in (("model_input_spans", (("prompt_tokens", 0, 3), ("sampled_tokens", 0, 1))),
                        ("loss_fn_input_spans", (("prompt_tokens", 1, 2), ("sampled_tokens", 0, 2)))):
        for kind, off, n in runs:
            span = getattr(getattr(d, field).add(), kind)
            span.sequence_id, span.offset, span.length = "r:0", off, n
    svc.now += STABILITY_TTL_S - 1
    svc.check_provenance(msg, "m", "sess-a")  # valid, and restarts the day
    svc.now += STABILITY_TTL_S - 1
    svc.check_provenance(msg, "m", "sess-a")
    with pytest.raises(HttpError, match="was sampled in session 'sess-a'"):
        svc.check_provenance(msg, "m", "sess-b")
    svc.now += STABILITY_TTL_S
    with pytest.raises(HttpError, match="'r:0' is unknown or expired"):
        svc.check_provenance(msg, "m", "sess-a")


def test_dimuon_is_refused_by_name(service):
    with pytest.raises(tinker.UnprocessableEntityError, match="optimizer 'dimuon'"):
        service.create_lora_training_client("tiny", rank=4, optimizer=types.DimuonOptimizerConfig()).result(timeout=60)
