"""Sampling of the local torch engine (tinker_local.engine_sampling): sampled and prompt logprobs
against an fp32 ``forward`` of the same tokens, seeds, ``prompt_logprobs_last_n``, sampling controls
and stops. On the ``tiny`` preset in fp32 on CPU (tests/engine_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_helpers import engine, make_datums, train_a_bit  # noqa: F401  (engine: a fixture)
from tinker_local.engine import Datum, Engine, EngineUserError


def test_sample_logprobs_match_forward_and_seed(engine):
    engine.create_model("smp", "tiny", 4, seed=6)
    train_a_bit(engine, "smp", steps=2, lr=1e-2)
    path = engine.save_sampler_weights("smp", "w")
    prompt = [1, 295, 201, 19, 13, 20, 2, 201, 1, 294, 201]
    kw = dict(num_samples=3, max_tokens=12, seed=42, stop=[], include_prompt_logprobs=True,
              topk_prompt_logprobs=3)
    r1 = engine.sample(None, path, prompt, **kw)
    r2 = engine.sample("tiny", path, prompt, **kw)
    assert r1.sequences == r2.sequences
    assert r1.sequences != engine.sample(None, path, prompt, **{**kw, "seed": 43}).sequences
    for seq in r1.sequences:
        assert len(seq["tokens"]) == 12 and seq["stop_reason"] == "length"
        full = prompt + seq["tokens"]
        d = Datum(tokens=full[:-1], inputs={"target_tokens": np.array(full[1:], np.int64)})
        lp = engine.forward("smp", [d], "cross_entropy", None).outputs[0]["logprobs"]
        np.testing.assert_allclose(seq["logprobs"], lp[len(prompt) - 1:], atol=1e-4, rtol=0)
    d = Datum(tokens=prompt[:-1], inputs={"target_tokens": np.array(prompt[1:], np.int64)})
    lp = engine.forward("smp", [d], "cross_entropy", None).outputs[0]["logprobs"]
    assert r1.prompt_logprobs[0] is None and len(r1.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose(r1.prompt_logprobs[1:], lp, atol=1e-4, rtol=0)
    top = r1.topk_prompt_logprobs
    assert top[0] is None and all(len(t) == 3 for t in top[1:])
    assert all(t[0][1] >= t[1][1] >= t[2][1] >= lp_i - 1e-4 or prompt[i + 1] not in [x[0] for x in t]
               for i, (t, lp_i) in enumerate(zip(top[1:], lp, strict=False)))


def test_prompt_logprobs_last_n_keeps_fewer_logits(engine):
    """With ``prompt_logprobs_last_n`` the prefill keeps only the last N + 1 logits: the last N
    entries (and their top-k) equal an independent forward's, across a left-padded batch of
    prompts of different lengths and last_n values, and the samples are unchanged."""
    engine.create_model("lastn", "tiny", 4, seed=8)
    train_a_bit(engine, "lastn", steps=2, lr=1e-2)
    path = engine.save_sampler_weights("lastn", "w")
    prompts = [[1, 295, 201, 19, 13, 20, 2, 201, 1, 294, 201], [1, 40, 41, 42, 201], [7, 8, 9, 10, 11, 12, 13]]
    lasts = [2, 4, 1]
    base = dict(base_model=None, weights_path=path, num_samples=2, max_tokens=5, seed=3, stop=[],
                include_prompt_logprobs=True, topk_prompt_logprobs=4)
    cut = engine.sample_many(
        [dict(base, prompt_tokens=p, prompt_logprobs_last_n=n) for p, n in zip(prompts, lasts, strict=True)]
    )
    full = engine.sample_many([dict(base, prompt_tokens=p) for p in prompts])
    for p, n, c, f in zip(prompts, lasts, cut, full, strict=True):
        d = Datum(tokens=p[:-1], inputs={"target_tokens": np.array(p[1:], np.int64)})
        ref = engine.forward("lastn", [d], "cross_entropy", None).outputs[0]["logprobs"]
        assert len(c.prompt_logprobs) == len(p) and all(v is None for v in c.prompt_logprobs[: len(p) - max(lasts)])
        np.testing.assert_allclose(c.prompt_logprobs[-n:], ref[-n:], atol=1e-4, rtol=0)
        for ct, ft in zip(c.topk_prompt_logprobs[-n:], f.topk_prompt_logprobs[-n:], strict=False):
            assert [t for t, _ in ct] == [t for t, _ in ft]
            np.testing.assert_allclose([v for _, v in ct], [v for _, v in ft], atol=1e-4, rtol=0)
        assert [s["tokens"] for s in c.sequences] == [s["tokens"] for s in f.sequences]
    with pytest.raises(EngineUserError, match="prompt_logprobs_last_n"):
        engine.sample(None, path, prompts[0], num_samples=1, max_tokens=1, include_prompt_logprobs=True,
                      prompt_logprobs_last_n=-1)


def test_sampling_controls_and_stops(engine):
    prompt = [1, 295, 201, 19, 13, 20]
    greedy = engine.sample("tiny", None, prompt, num_samples=2, max_tokens=10, temperature=0.0, stop=[])
    assert greedy.sequences[0]["tokens"] == greedy.sequences[1]["tokens"]
    top1 = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=10, top_k=1, seed=1, stop=[])
    tiny_p = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=10, top_p=1e-6, seed=2, stop=[])
    assert top1.sequences[0]["tokens"] == greedy.sequences[0]["tokens"] == tiny_p.sequences[0]["tokens"]

    tok = engine._bases["tiny"].tokenizer
    base = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=24, seed=9, stop=[]).sequences[0]
    toks = base["tokens"]
    # stop token id: ends right after its first occurrence
    sid = toks[6]
    cut = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=24, seed=9, stop=[sid]).sequences[0]
    assert cut["tokens"] == toks[: toks.index(sid) + 1] and cut["stop_reason"] == "stop"
    # stop string: ends with the token completing the first occurrence in the decoded text
    text = tok.decode(toks[5:8])
    s = text[len(text) // 2:][:3] or text
    cut = engine.sample("tiny", None, prompt, num_samples=1, max_tokens=24, seed=9, stop=[s]).sequences[0]
    n = next(i for i in range(1, len(toks) + 1) if s in tok.decode(toks[:i]))
    assert cut["tokens"] == toks[:n] and cut["stop_reason"] == "stop"
    assert cut["logprobs"] == base["logprobs"][:n]
    # stop=None: the EOS tokens of the model
    eos = engine.sample("tiny", None, [1, 2], num_samples=4, max_tokens=48, seed=0, stop=None)
    for seq in eos.sequences:
        assert (seq["stop_reason"] == "stop") == (seq["tokens"][-1] in (0, 2))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, 4, 1.0), (1.3, -1, 0.8)])
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p):
    """``_choose`` (inverse-CDF, one uniform per row) draws from softmax(logits / T) restricted by
    top-k / top-p: empirical frequencies of 60,000 draws within 5 standard errors of each token's
    probability, filtered tokens never drawn, and a seed gives the same draws again."""
    import torch

    from tinker_local.sampling import _choose

    logits = torch.tensor([[2.0, 1.5, 0.3, -0.2, -1.0, -3.0, 0.9]])
    n = 60_000
    probs = torch.softmax(logits[0].double() / temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep &= probs >= torch.topk(probs, top_k).values[-1]
    if top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(sp, 0) - sp
        keep &= torch.zeros_like(keep).scatter(0, idx, before < top_p)
    expected = torch.where(keep, probs, 0.0)
    expected = expected / expected.sum()
    gen = torch.Generator().manual_seed(11)
    draws = _choose(logits.expand(n, -1).contiguous(), temperature, top_k, top_p, gen)
    freq = torch.bincount(draws, minlength=logits.shape[1]).double() / n
    se = (expected * (1 - expected) / n).sqrt()
    assert bool(((freq - expected).abs() <= 5 * se + 1e-12).all()), (freq, expected)
    assert bool((freq[~keep] == 0).all())
    again = _choose(logits.expand(n, -1).contiguous(), temperature, top_k, top_p, torch.Generator().manual_seed(11))
    assert torch.equal(draws, again)


def test_cache_growing_in_place_equals_concatenation(engine, monkeypatch):
    """The preallocated KV cache (``_GrowingLayer``, here with room for 2 positions, so it grows
    several times) gives the samples and logprobs of transformers' concatenating cache."""
    import tinker_local.sampling as S

    prompts = [[1, 295, 201, 19, 13, 20], [1, 40, 41, 42, 201, 7, 8, 9]]  # left padding, too
    reqs = [dict(base_model="tiny", weights_path=None, prompt_tokens=p, num_samples=3, max_tokens=n, seed=s,
                 stop=[]) for p, n, s in zip(prompts, (12, 5), (4, 5), strict=True)]
    real = S._with_room
    monkeypatch.setattr(S, "_with_room", lambda cache, room: real(cache, 2))
    grown = engine.sample_many(reqs)
    monkeypatch.setattr(S, "_with_room", lambda cache, room: cache)
    plain = engine.sample_many(reqs)
    for a, b in zip(grown, plain, strict=True):
        assert [s["tokens"] for s in a.sequences] == [s["tokens"] for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-6, rtol=0)


def test_sampler_slots_are_reused_with_the_right_weights(engine):
    """Past ``MAX_SAMPLER_ADAPTERS`` sampler checkpoints, a new one is loaded into the least
    recently used slot (same LoRA config: no new injection); sampling a checkpoint again after
    its slot was reused gives the samples it gave the first time."""
    from tinker_local.engine_sampling import MAX_SAMPLER_ADAPTERS

    engine.create_model("slots", "tiny", 4, seed=9)
    prompt = [1, 295, 201, 19, 13, 20]
    kw = dict(num_samples=2, max_tokens=6, seed=3, stop=[])
    first = {}
    paths = []
    for k in range(MAX_SAMPLER_ADAPTERS + 2):
        train_a_bit(engine, "slots", steps=1, lr=2e-2)
        paths.append(engine.save_sampler_weights("slots", f"c{k}"))
        first[k] = engine.sample(None, paths[k], prompt, **kw).sequences
    b = engine._bases["tiny"]
    assert len(b.sampler_adapters) == MAX_SAMPLER_ADAPTERS
    assert sum(1 for n in b.peft.peft_config if n.startswith("s")) == MAX_SAMPLER_ADAPTERS
    again = engine.sample(None, paths[0], prompt, **kw).sequences  # evicted, then loaded into a reused slot
    assert again == first[0] and first[0] != first[1]

def test_the_base_samples_after_deleting_the_active_adapter_when_the_rest_target_other_layers(tmp_path):
    # peft names no new active adapter when none left targets its first LoRA layer (attention here)
    eng, fresh = (Engine(tmp_path / n, dtype="fp32", device="cpu") for n in ("e", "fresh"))
    eng.create_model("mlp_only", "tiny", 4, seed=1, train_attn=False, train_unembed=False)
    eng.create_model("all", "tiny", 4, seed=2)
    eng.forward_backward("all", make_datums(1), "cross_entropy", None)  # its adapter is the active one
    eng.delete_model("all")
    after, plain = (
        e.sample("tiny", None, [1, 295, 201], num_samples=2, max_tokens=4, seed=3, stop=[],
                 include_prompt_logprobs=True)
        for e in (eng, fresh)
    )  # raised KeyError('t2') in peft's disable_adapter before
    assert after.sequences == plain.sequences and after.prompt_logprobs == plain.prompt_logprobs
    eng.forward_backward("mlp_only", make_datums(2), "cross_entropy", None)  # the remaining one still trains
