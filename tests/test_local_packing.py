"""Padding-free training in tinker_local's engine (``tinker_local.packing``): the packed path gives
the padded path's logprobs, losses and gradients (fp32, tiny preset), for every loss function, soft
targets and several micro-batches, and so do datums sharing their common prefixes (one pass over
the prefix, segment attention); media models fall back to the padded path; a model whose
attention ignores the segments is refused by the probe.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tinker_local.engine import Datum, Engine  # noqa: E402
from tinker_local.losses import LOSS_FNS, REQUIRED_INPUTS  # noqa: E402
from tinker_local.packing import packed_batch, packing_supported, split_microbatches  # noqa: E402

VOCAB = 2048
LENGTHS = (17, 1, 30, 9, 25, 3, 14, 40, 8)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("packing_root"), dtype="fp32", device="cpu")


def _datums(seed: int, loss: str = "cross_entropy", soft_k: int = 0, lengths=LENGTHS) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        toks = rng.integers(0, VOCAB, n + 1)
        shape = (n, soft_k) if soft_k else (n,)
        inputs = {"target_tokens": rng.integers(0, VOCAB, shape) if soft_k else toks[1:].astype(np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = rng.uniform(-1.0, 2.0, shape).astype(np.float32)
        for k in REQUIRED_INPUTS[loss]:  # behaviour logprobs near the model's, advantages of both signs
            inputs[k] = (rng.uniform(-9.0, -6.0, shape) if k == "logprobs" else rng.normal(0, 1, shape)).astype(
                np.float32
            )
        out.append(Datum(tokens=toks[:-1].tolist(), inputs=inputs))
    return out


def _run(engine, model_id, datums, loss, packing: bool, backward: bool = True):
    """(result, gradients) of one call with packing on or off; the gradients are then cleared."""
    engine.packing = packing
    try:
        call = engine.forward_backward if backward else engine.forward
        res = call(model_id, datums, loss, None)
    finally:
        engine.packing = True
    st = engine._models[model_id]
    grads = [p.grad.clone() if p.grad is not None else None for p in st.params.values()]
    st.optimizer.zero_grad(set_to_none=True)
    return res, grads


def _assert_same(a, b, ga, gb):
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x["logprobs"].shape == y["logprobs"].shape
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)
    gmax = max(float(g.abs().max()) for g in gb if g is not None)
    assert gmax > 0
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5 * gmax, rtol=1e-5)


def test_layout_one_row_per_microbatch_within_the_budget():
    lengths = list(LENGTHS)
    assert split_microbatches(lengths, budget=10**6) == [list(range(len(lengths)))]
    for budget in (40, 80, 100):
        groups = split_microbatches(lengths, budget)
        assert [i for g in groups for i in g] == list(range(len(lengths)))  # in order, each once
        for g, nxt in zip(groups, groups[1:] + [None], strict=True):
            assert sum(lengths[i] for i in g) <= budget or len(g) == 1
            if nxt is not None:  # a micro-batch closes only where the next unit would not fit
                assert sum(lengths[i] for i in g) + lengths[nxt[0]] > budget
    assert split_microbatches([], 100) == []

    toks = [list(range(100, 100 + n)) for n in (3, 1, 4)]
    pb = packed_batch([2, 0, 1], toks)
    assert pb.ids.tolist() == [[100, 101, 102, 103, 100, 101, 102, 100]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert pb.items == [2, 0, 1] and pb.spans == [(0, 4), (4, 7), (7, 8)]
    assert pb.index.tolist() == list(range(8))
    assert pb.segments == [(0, 4, None), (4, 7, None), (7, 8, None)]
    assert packed_batch([2, 0, 1], toks, segments=False).segments is None
    pb = packed_batch([1, 0], [[7, 8], [9, 10]])  # datums of one length: a plain causal batch
    assert pb.ids.tolist() == [[9, 10], [7, 8]] and pb.position_ids is None and pb.segments is None
    assert pb.items == [1, 0] and pb.index.tolist() == [0, 1, 2, 3] and pb.spans == [(0, 2), (2, 4)]


@pytest.mark.parametrize("loss", sorted(LOSS_FNS))
def test_packed_equals_padded_for_every_loss(engine, loss):
    mid = f"pk-{loss}"
    engine.create_model(mid, "tiny", 4, seed=3)
    assert engine._packs(engine._bases["tiny"]) is True
    datums = _datums(5, loss)
    a, ga = _run(engine, mid, datums, loss, packing=True)
    b, gb = _run(engine, mid, datums, loss, packing=False)
    _assert_same(a, b, ga, gb)
    engine.delete_model(mid)


def test_soft_targets_forward_and_microbatches(engine):
    engine.create_model("pk-soft", "tiny", 4, seed=4)
    datums = _datums(6, soft_k=3)
    b, gb = _run(engine, "pk-soft", datums, "cross_entropy", packing=False)
    a, ga = _run(engine, "pk-soft", datums, "cross_entropy", packing=True)
    _assert_same(a, b, ga, gb)
    engine.max_batch_tokens = 60  # several packed micro-batches
    try:
        c, gc = _run(engine, "pk-soft", datums, "cross_entropy", packing=True)
    finally:
        engine.max_batch_tokens = None
    _assert_same(c, b, gc, gb)
    mixed = _datums(7, lengths=(5, 12, 2)) + _datums(8, soft_k=2, lengths=(6, 11))
    f_packed, _ = _run(engine, "pk-soft", mixed, "cross_entropy", packing=True, backward=False)
    f_padded, _ = _run(engine, "pk-soft", mixed, "cross_entropy", packing=False, backward=False)
    _assert_same(f_packed, f_padded, gb, gb)


def test_probe_refuses_attention_that_ignores_segments(engine):
    """Attention that keeps datums apart by restarting positions only (``transformers``' SDPA,
    not given the segments) lets the second branch of a shared prefix lose its prefix: refused;
    segment attention passes, and the restarting-positions layout passes with plain SDPA."""
    engine.load_base_model("tiny")
    model = engine._bases["tiny"].model
    before = model.config._attn_implementation
    assert before == "sdpa_segments"
    assert packing_supported(model, VOCAB, torch.device("cpu"))
    try:
        model.set_attn_implementation("sdpa")
        assert not packing_supported(model, VOCAB, torch.device("cpu"))
        assert packing_supported(model, VOCAB, torch.device("cpu"), segments=False)
    finally:
        model.set_attn_implementation(before)
    assert packing_supported(model, VOCAB, torch.device("cpu"))


def test_a_model_failing_the_probe_trains_padded_said_once_and_counted(engine, caplog):
    """A text-only model whose attention ignores the segments fails the probe: every call trains
    padded (the logprobs of the padded path), one warning names the model, and each call is
    counted in ``engine.stats["packing_fallbacks"]``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinker_local.attention import SEGMENT_ATTENTION, register_segment_attention

    def ignores_segments(module, q, k, v, attention_mask, segments=None, **kw):
        return sdpa_attention_forward(module, q, k, v, attention_mask, **kw)

    engine.create_model("pk-fallback", "tiny", 4, seed=3)
    b = engine._bases[engine._models["pk-fallback"].base_key]
    checked, count = b.packs, engine.stats["packing_fallbacks"]
    datums = _datums(4)
    expected, _ = _run(engine, "pk-fallback", datums, "cross_entropy", packing=False, backward=False)
    try:
        AttentionInterface.register(SEGMENT_ATTENTION, ignores_segments)  # what the model runs
        b.packs = None  # checked anew
        with caplog.at_level("WARNING", logger="tinker_local.engine"):
            got = [_run(engine, "pk-fallback", datums, "cross_entropy", packing=True, backward=False)[0]
                   for _ in range(3)]
    finally:
        register_segment_attention()
        b.packs = checked
    assert engine.stats["packing_fallbacks"] == count + 3
    said = [r.getMessage() for r in caplog.records if r.name == "tinker_local.engine"]
    assert len(said) == 1 and said[0].startswith("base model tiny: two datums packed into one row")
    for res in got:  # the padded path's numbers (right padding is exact under causal attention)
        for x, y in zip(res.outputs, expected.outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5, rtol=0)


def test_media_model_falls_back_to_padding(engine):
    from prefect_tinker.recipes.audio_features import tensor_container
    from tinker_local.datatypes import MediaChunk

    engine.create_model("pk-audio", "tiny-audio", 4, seed=5)
    b = engine._bases[engine._models["pk-audio"].base_key]
    assert engine._packs(b) is False
    frames = np.random.default_rng(1).integers(0, 16, (7, 80)).astype(np.uint8)
    pre, post = [1, 9, 10], [11, 12, 2]
    n = len(pre) + 7 + len(post)
    rng = np.random.default_rng(2)
    media = Datum(tokens=pre + post, inputs={"target_tokens": rng.integers(3, 1000, n)},
                  chunks=[pre, MediaChunk(kind="dmel", data=tensor_container(frames)), post])
    datums = [media] + [Datum(tokens=rng.integers(3, 1000, k).tolist(),
                              inputs={"target_tokens": rng.integers(3, 1000, k)}) for k in (4, 19)]
    count = engine.stats["packing_fallbacks"]
    a, ga = _run(engine, "pk-audio", datums, "cross_entropy", packing=True)
    c, gc = _run(engine, "pk-audio", datums, "cross_entropy", packing=False)
    _assert_same(a, c, ga, gc)
    assert engine.stats["packing_fallbacks"] == count  # padded by design, not a fallback


def _sharing(seed: int, loss: str) -> list[Datum]:
    """Datums in groups with common prefixes: GRPO-like (one prompt, four replies), a DPO-like
    pair, a datum that is a prefix of another, two identical datums and loners."""
    rng = np.random.default_rng(seed)
    prompt, other = rng.integers(0, VOCAB, 21).tolist(), rng.integers(0, VOCAB, 12).tolist()
    seqs = [prompt + rng.integers(0, VOCAB, k).tolist() for k in (7, 3, 9, 1)]
    seqs += [other + rng.integers(0, VOCAB, k).tolist() for k in (5, 11)]
    seqs += [seqs[0][:25], list(seqs[4]), rng.integers(0, VOCAB, 16).tolist(), rng.integers(0, VOCAB, 2).tolist()]
    out = []
    for s in seqs:
        n = len(s)
        inputs = {"target_tokens": rng.integers(0, VOCAB, n).astype(np.int64)}
        if loss == "cross_entropy":
            inputs["weights"] = rng.uniform(-1.0, 2.0, n).astype(np.float32)
        for k in REQUIRED_INPUTS[loss]:
            inputs[k] = (rng.uniform(-9.0, -6.0, n) if k == "logprobs" else rng.normal(0, 1, n)).astype(np.float32)
        out.append(Datum(tokens=s, inputs=inputs))
    return out


def test_shared_prefix_units_group_common_prefixes():
    from tinker_local.models import tiny_config
    from tinker_local.packing import layout_costs, shared_prefix_units, unit_length

    costs = layout_costs(tiny_config())
    toks = [d.tokens for d in _sharing(0, "cross_entropy")]
    units = shared_prefix_units(toks, costs)
    lengths = [len(t) for t in toks]
    assert sorted(i for u in units for i in ([u] if isinstance(u, int) else u[1])) == list(range(len(toks)))
    groups = sorted((u[0], sorted(u[1])) for u in units if not isinstance(u, int))
    assert groups == [(12, [4, 5, 7]), (21, [0, 1, 2, 3, 6])]
    assert sum(unit_length(u, lengths) for u in units) == sum(lengths) - 4 * 21 - 2 * 12
    assert shared_prefix_units(toks, costs, min_shared=30) == list(range(len(toks)))  # nothing shares 30

    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 24).tolist()  # a chat template's system prompt: every datum begins with it
    prompts = [system + rng.integers(0, VOCAB, 40).tolist() for _ in range(4)]
    grpo = [p + rng.integers(0, VOCAB, 32).tolist() for p in prompts for _ in range(4)]
    units = shared_prefix_units(grpo, costs)  # each group shares its prompt, groups only the system prompt
    assert sorted(sorted(u[1]) for u in units) == [[4 * g + k for k in range(4)] for g in range(4)]
    assert all(u[0] == 64 for u in units)
    dpo = [p + rng.integers(0, VOCAB, n).tolist() for p in prompts for n in (150, 190)]
    units = shared_prefix_units(dpo, costs)  # each pair's prompt: saves more than the system prompt of all
    assert sorted(sorted(u[1]) for u in units) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    big = [[1] * 8 + [k] * 300 for k in range(5)]  # a unit stays within MAX_UNIT slots
    assert all(unit_length(u, [308] * 5) <= 1024 for u in shared_prefix_units(big, costs))


def test_shared_prefix_layout_and_segments():
    toks = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [3, 4], [5, 6, 7]]
    pb = packed_batch([(3, [0, 1, 3]), 2], toks)
    assert pb.ids.tolist() == [[5, 6, 7, 8, 9, 9, 3, 4]]
    assert pb.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert pb.items == [0, 1, 3, 2]
    assert pb.index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1, 2, 6, 7]  # item 3 is the prefix itself
    # the prefix alone, each branch after the prefix, the next datum alone
    assert pb.segments == [(0, 3, None), (3, 4, (0, 3)), (4, 6, (0, 3)), (6, 8, None)]
    with pytest.raises(ValueError):
        packed_batch([(3, [0, 1])], toks, segments=False)


def test_segment_attention_equals_a_block_mask():
    """Segment attention (a prefix, two branches of it, a datum alone, two datums of one length
    side by side; with and without a sliding window of 3) equals SDPA over the whole row with the
    block mask those segments mean, outputs and input gradients, with grouped-query heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tinker_local.attention import segment_attention, segments_on

    spans = [(0, 4, None), (4, 7, (0, 4)), (7, 9, (0, 4)), (9, 14, None), (14, 17, None), (17, 20, None)]
    T, H, KV, D = 20, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, T, D, generator=gen, dtype=torch.float64, requires_grad=True) for h in (H, KV, KV))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = H // KV, True
    pos = [0, 1, 2, 3, 4, 5, 6, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2]
    for window in (None, 3):
        block = torch.zeros(T, T, dtype=torch.bool)
        for a, b, prefix in spans:
            keys = list(range(prefix[0], prefix[1])) if prefix else []
            for i in range(a, b):
                for j in keys + list(range(a, i + 1)):
                    block[i, j] = window is None or pos[i] - pos[j] < window
        got, _ = segment_attention(module, q, k, v, None, scaling=D**-0.5, segments=segments_on(spans, q.device),
                                   sliding_window=window)
        want, _ = sdpa_attention_forward(module, q, k, v, block[None, None], scaling=D**-0.5)
        assert got.shape == (1, T, H, D)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g = torch.randn(got.shape, generator=gen, dtype=torch.float64)
        d_got = torch.autograd.grad(got, (q, k, v), g)
        d_want = torch.autograd.grad(want, (q, k, v), g)
        for x, y in zip(d_got, d_want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_segments_build_no_row_mask(engine, monkeypatch):
    """A packed forward with segments makes transformers build no (1, 1, W, W) mask for the row
    (segment attention reads none): no packed-sequence detection, SDPA's mask function skipped."""
    import transformers.masking_utils as mu

    from tinker_local.packing import packed_logits

    built = []
    real = mu.sdpa_mask

    def counting(*a, **kw):
        out = real(*a, **kw)
        built.append(out)
        return out

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda *a, **kw: pytest.fail("packed detection ran"))
    monkeypatch.setattr(mu, "sdpa_mask", counting)
    from transformers import AttentionMaskInterface

    AttentionMaskInterface.register("sdpa_segments", counting)
    try:
        engine.load_base_model("tiny")
        toks = [[5, 6, 7, 8], [5, 6, 7, 9, 9], [3, 4]]
        pb = packed_batch([(3, [0, 1]), 2], toks)
        with torch.no_grad():
            logits = packed_logits(engine._bases["tiny"].model, pb, torch.device("cpu"))
    finally:
        AttentionMaskInterface.register("sdpa_segments", real)
    assert logits.shape[0] == 8 and built and all(m is None for m in built)


@pytest.mark.parametrize("loss", ["cross_entropy", "gspo"])  # per-token and per-sequence
def test_shared_prefixes_equal_padded(engine, loss):
    mid = f"sp-{loss}"
    engine.create_model(mid, "tiny", 4, seed=7)
    datums = _sharing(11, loss)
    layout = engine._layout(engine._bases["tiny"], [d.tokens for d in datums], 16384, packed=True)
    assert sum(1 for mb in layout for u in mb if not isinstance(u, int)) == 2  # prefixes shared
    a, ga = _run(engine, mid, datums, loss, packing=True)
    b, gb = _run(engine, mid, datums, loss, packing=False)
    _assert_same(a, b, ga, gb)
    engine.share_prefixes = False
    try:
        c, gc = _run(engine, mid, datums, loss, packing=True)
    finally:
        engine.share_prefixes = True
    _assert_same(c, b, gc, gb)
    engine.delete_model(mid)
