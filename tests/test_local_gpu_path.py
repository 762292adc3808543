"""The engine's GPU path, forced on the CPU where it can be (no GPU is needed): base weights held in
the compute dtype with an fp32 output head (``weights_dtype="bf16"``), the choice and record of the
attention kernels (flash-attention 2 on CUDA where installed, else SDPA), and the packed layout
flash-attention 2 gets (restarting positions, no 4D mask, no shared prefixes) against the padded
path.  Sampling on the device (device generators, logits and KV cache never copied to the host)
is the code path the CPU runs too (tests/test_engine_sampling.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_helpers import make_datums  # noqa: E402
from tinker_local.compute import choose_attn_implementation, to_weights_dtype  # noqa: E402
from tinker_local.engine import Datum, Engine  # noqa: E402


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_path_root")
    return (Engine(root / "bf16w", dtype="bf16", device="cpu", weights_dtype="bf16"),
            Engine(root / "fp32w", dtype="bf16", device="cpu"))


def test_attention_choice(monkeypatch):
    import importlib.util

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name))
    assert choose_attn_implementation(cuda, torch.bfloat16) == "flash_attention_2"
    assert choose_attn_implementation(cuda, torch.float32) == "sdpa_segments"  # its kernels take no fp32
    assert choose_attn_implementation(cpu, torch.bfloat16) == "sdpa_segments"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name))
    assert choose_attn_implementation(cuda, torch.bfloat16) == "sdpa_segments"


def test_weights_dtype_defaults_and_record(engines):
    bf16w, fp32w = engines
    assert fp32w.weights_dtype == "fp32"  # the CPU samples in fp32
    assert Engine(bf16w.root, dtype="fp32", device="cpu").weights_dtype == "fp32"
    with pytest.raises(ValueError, match="weights_dtype"):
        Engine(bf16w.root, dtype="bf16", device="cpu", weights_dtype="fp16")
    info = bf16w.load_base_model("tiny")
    assert info["weights_dtype"] == "bf16" and info["attn_implementation"] == "sdpa_segments"


def test_tied_head_gets_its_own_fp32_weight():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    emb = model.get_input_embeddings().weight.detach().clone()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    to_weights_dtype(model, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.float32 and torch.equal(model.lm_head.weight, emb)
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are left as they are
    model.tie_weights()  # nothing ties them back
    assert model.lm_head.weight.dtype == torch.float32


def test_bf16_weights_train_and_sample_like_fp32_weights(engines):
    """bf16 weights with bf16 autocast give the logprobs of fp32 weights under the same autocast
    (the same bf16 matmuls: autocast casts fp32 weights to bf16 anyway) to bf16 rounding, train,
    and sample with logprobs matching a forward of the sampled tokens (bf16 decoder, fp32 head)."""
    bf16w, fp32w = engines
    for e in engines:
        e.create_model("g", "tiny", 8, seed=3)
    b = bf16w._bases["tiny"]
    assert b.model.model.layers[0].mlp.up_proj.base_layer.weight.dtype == torch.bfloat16
    head = b.model.get_output_embeddings()
    assert getattr(head, "base_layer", head).weight.dtype == torch.float32
    datums = make_datums(3)
    outs = [e.forward_backward("g", datums, "cross_entropy", None) for e in engines]
    for x, y in zip(outs[0].outputs, outs[1].outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=0.05)
    assert outs[0].metrics["loss:sum"] == pytest.approx(outs[1].metrics["loss:sum"], rel=1e-2)
    first = outs[0].metrics["loss:sum"]
    for _ in range(3):
        bf16w.optim_step("g", learning_rate=1e-2)
        out = bf16w.forward_backward("g", datums, "cross_entropy", None)
    assert out.metrics["loss:sum"] < first - 1.0  # weights of -1..2: the loss goes down
    path = bf16w.save_sampler_weights("g", "w")
    prompt = [1, 295, 201, 19, 13, 20]
    res = bf16w.sample(None, path, prompt, num_samples=2, max_tokens=8, seed=7, stop=[])
    again = bf16w.sample(None, path, prompt, num_samples=2, max_tokens=8, seed=7, stop=[])
    assert res.sequences == again.sequences
    for seq in res.sequences:
        full = prompt + seq["tokens"]
        d = Datum(tokens=full[:-1], inputs={"target_tokens": np.array(full[1:], np.int64)})
        lp = bf16w.forward("g", [d], "cross_entropy", None).outputs[0]["logprobs"]
        np.testing.assert_allclose(seq["logprobs"], lp[len(prompt) - 1:], atol=0.1)


def test_flash_attention_layout_equals_padded(engines, monkeypatch):
    """The layout flash-attention 2 gets (restarting positions only; no shared prefixes) gives
    the padded path's logprobs and gradients; SDPA keeps datums apart by those positions too,
    so this runs on the CPU."""
    from tinker_local.engine_core import EngineCore
    from tinker_local.packing import packing_supported

    _, e = engines
    e.create_model("fa", "tiny", 4, seed=5)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 2000, 12).tolist()
    datums = make_datums(4, lengths=(7, 3, 19, 5)) + [
        Datum(tokens=prompt + rng.integers(3, 2000, k).tolist(),
              inputs={"target_tokens": rng.integers(3, 2000, 12 + k)}) for k in (4, 6)]
    monkeypatch.setattr(EngineCore, "_segments", staticmethod(lambda b: False))
    assert packing_supported(e._bases["tiny"].model, 2048, torch.device("cpu"), segments=False)
    e.dtype = "fp32"
    try:
        results = []
        for packing in (True, False):
            e.packing = packing
            out = e.forward_backward("fa", datums, "cross_entropy", None)
            st = e._models["fa"]
            results.append((out, [p.grad.clone() for p in st.params.values()]))
            st.optimizer.zero_grad(set_to_none=True)
    finally:
        e.packing, e.dtype = True, "bf16"
    (a, ga), (b, gb) = results
    assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-5)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
