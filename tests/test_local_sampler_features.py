"""Engine-level tests of the sampler features of SDK 0.38 (tinker_local.sampling / engine_sampling):
``target_prompt_logprobs``, ``prompt_alt_tokens_k`` and prefix reuse, checked against an
independent fp32 forward of the base model loaded by transformers (no tinker_local code).

Everything runs on the ``tiny`` preset in fp32 on CPU with a temporary root.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tinker_local.engine import Engine, EngineUserError  # noqa: E402

VOCAB = 2048


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("sampler_features_root"), dtype="fp32", device="cpu",
                  num_threads=1)


@pytest.fixture(scope="module")
def reference(engine):
    """``logp(prompt)`` -> (P - 1, V) float32 log-softmax rows of an independent fp32 forward."""
    from transformers import AutoModelForCausalLM

    base_dir = engine.load_base_model("tiny")["tokenizer_id"]
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    def logp(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return logp


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, VOCAB, n).tolist()


def test_target_prompt_logprobs_match_forward(engine, reference):
    prompt = _prompt(1, 12)
    rng = np.random.default_rng(2)
    target = rng.integers(0, VOCAB, (11, 3))
    target[:, 0] = prompt[1:]  # column 0: the prompt's own tokens
    target[rng.random((11, 3)) < 0.3] = -1  # cells asking nothing
    res = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=1, seed=0,
                        target_prompt_logprobs=target)
    ref = reference(prompt)
    want = np.where(target >= 0, ref.gather(-1, torch.as_tensor(np.maximum(target, 0))).numpy(), 0.0)
    assert res.target_prompt_logprobs.shape == (11, 3)
    assert res.target_prompt_logprobs.dtype == np.float32
    np.testing.assert_allclose(res.target_prompt_logprobs, want, atol=1e-4)
    assert (res.target_prompt_logprobs[target < 0] == 0.0).all()


def test_prompt_alt_tokens_are_draws_with_forward_logprobs(engine, reference):
    prompt = _prompt(3, 9)
    ref = reference(prompt)
    res = engine.sample("tiny", None, prompt, num_samples=2, max_tokens=3, seed=5, prompt_alt_tokens_k=400)
    ids, lps = res.prompt_alt_tokens
    assert ids.shape == lps.shape == (8, 400) and ids.dtype == np.int64 and lps.dtype == np.float32
    np.testing.assert_allclose(lps, ref.gather(-1, torch.as_tensor(ids)).numpy(), atol=1e-4)
    # draws follow the model's distribution at temperature 1 (independent, with replacement). One
    # token's probability is ~0.001 here, too small to measure with 400 draws, so each row's vocabulary
    # is cut into 8 bins of ~1/8 of the model's probability each (tokens by probability, cut at
    # cumulative mass j/8): Pearson's chi-square of the rows' bin counts against 400 x each bin's mass
    # has 8 x 7 = 56 degrees of freedom, and exceeds 121.3 (scipy.stats.chi2.ppf(1 - 1e-6, 56)) once
    # in a million runs of a correct sampler. Draws that ignore the model (uniform over the
    # vocabulary, which the tiny model's near-flat rows resemble: ~380) or sharpen it (temperature
    # 0.5) score above it.
    def chi_square(draws: np.ndarray) -> float:
        stat = 0.0
        for row, probs in zip(draws, ref.exp().double().numpy(), strict=True):
            order = np.argsort(-probs)
            bin_of = np.empty(VOCAB, dtype=np.int64)
            bin_of[order] = np.minimum((np.cumsum(probs[order]) - probs[order]) * 8, 7).astype(np.int64)
            expected = np.bincount(bin_of, weights=probs, minlength=8) * len(row)
            observed = np.bincount(bin_of[row], minlength=8)
            stat += float(((observed - expected) ** 2 / expected).sum())
        return stat

    assert chi_square(ids) < 121.3
    gen = torch.Generator().manual_seed(0)  # the check rejects what a broken sampler would draw
    assert chi_square(torch.randint(0, VOCAB, ids.shape, generator=gen).numpy()) > 121.3
    sharp = torch.multinomial(torch.softmax(2 * ref, -1), ids.shape[1], replacement=True, generator=gen)
    assert chi_square(sharp.numpy()) > 121.3
    top = ref.argmax(-1)
    # greedy: the argmax k times; the samples are unchanged by asking for draws
    greedy = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=1, temperature=0.0,
                           seed=5, prompt_alt_tokens_k=2)
    assert (greedy.prompt_alt_tokens[0] == top[:, None].numpy()).all()
    plain = engine.sample("tiny", None, prompt, num_samples=2, max_tokens=3, seed=5)
    assert [s["tokens"] for s in plain.sequences] == [s["tokens"] for s in res.sequences]


def test_shared_prompts_are_prefilled_once(engine, monkeypatch):
    import tinker_local.sampling as S

    widths = []
    real = S._forward

    def counting(model, ids, keep, kw, split):
        widths.append(tuple(ids.shape))
        return real(model, ids, keep, kw, split)

    monkeypatch.setattr(S, "_forward", counting)
    p, q = _prompt(7, 10), _prompt(8, 6)
    reqs = [dict(base_model="tiny", weights_path=None, prompt_tokens=x, num_samples=n, max_tokens=4, seed=s)
            for x, n, s in ((p, 3, 1), (p, 2, 2), (q, 1, 3), (p, 1, 4))]
    out = engine.sample_many(reqs)
    assert widths[0] == (2, 10)  # one prefill row per distinct prompt, then decode steps of 7 rows
    assert set(widths[1:]) == {(7, 1)} and len(widths) == 4
    assert [r.prompt_cache_hit_tokens for r in out] == [0, 10, 0, 10]
    monkeypatch.setattr(S, "_forward", real)
    alone = [engine.sample_many([r])[0] for r in reqs]  # same seeds alone: same samples
    for a, b in zip(alone, out, strict=True):
        assert [s["tokens"] for s in a.sequences] == [s["tokens"] for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
        assert a.prompt_cache_hit_tokens == 0


def test_bad_targets_are_user_errors(engine):
    prompt = _prompt(9, 5)
    with pytest.raises(EngineUserError, match=r"\[len\(prompt\) - 1, K\] = \[4, K\]"):
        engine.sample("tiny", None, prompt, num_samples=1, max_tokens=1,
                      target_prompt_logprobs=np.zeros((5, 2), np.int64))
    with pytest.raises(EngineUserError, match="token id 99999"):
        engine.sample("tiny", None, prompt, num_samples=1, max_tokens=1,
                      target_prompt_logprobs=np.full((4, 1), 99999, np.int64))
    with pytest.raises(EngineUserError, match="prompt_alt_tokens_k"):
        engine.sample("tiny", None, prompt, num_samples=1, max_tokens=1, prompt_alt_tokens_k=5000)
