"""Top-k logprobs at sampled positions (``topk_sample_logprobs``) in tinker_local, checked against
an independent fp32 forward of the base model loaded by ``transformers``, and through the SDK.

The capture endpoint's OpenAI ``top_logprobs`` rest on it.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tinker_local.engine import Engine, EngineUserError  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("topk_root"), dtype="fp32", device="cpu")


def test_topk_sample_logprobs_match_an_independent_forward(engine):
    from transformers import AutoModelForCausalLM

    base_dir = engine.load_base_model("tiny")["tokenizer_id"]
    prompt = [1, 295, 201, 19, 13, 20, 2, 201, 1, 294, 201]
    res = engine.sample("tiny", None, prompt, num_samples=2, max_tokens=7, seed=5, stop=[],
                        topk_sample_logprobs=4)
    plain = engine.sample("tiny", None, prompt, num_samples=2, max_tokens=7, seed=5, stop=[])
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    for seq, ref in zip(res.sequences, plain.sequences, strict=True):
        assert seq["tokens"] == ref["tokens"] and ref.get("topk_logprobs") is None  # same draws
        assert len(seq["topk_logprobs"]) == len(seq["tokens"]) == 7
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq["tokens"]])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: len(prompt) - 1 + 7]  # (7, V)
        want_v, want_i = torch.topk(logp, 4, dim=-1)
        for t, row in enumerate(seq["topk_logprobs"]):
            assert [tok for tok, _ in row] == want_i[t].tolist()
            assert [v for _, v in row] == pytest.approx(want_v[t].tolist(), abs=1e-4)
            assert seq["logprobs"][t] == pytest.approx(logp[t, seq["tokens"][t]].item(), abs=1e-4)
    with pytest.raises(EngineUserError, match="topk_sample_logprobs"):
        engine.sample("tiny", None, prompt, num_samples=1, max_tokens=2, topk_sample_logprobs=-1)


def test_topk_sample_logprobs_through_the_sdk(local_credentials):
    import tinker

    client = local_credentials.get_client().create_sampling_client(base_model="tiny").result()
    prompt = tinker.ModelInput.from_ints([1, 295, 201, 19, 13])
    resp = client.sample(prompt, num_samples=1, sampling_params=tinker.SamplingParams(max_tokens=5, seed=2, stop=[]),
                         topk_sample_logprobs=3).result()
    (seq,) = resp.sequences
    assert len(seq.topk_logprobs) == len(seq.tokens) == 5
    for lp, row in zip(seq.logprobs, seq.topk_logprobs, strict=True):
        vals = [v for _, v in row]
        assert len(row) == 3 and vals == sorted(vals, reverse=True) and lp <= vals[0] + 1e-5
