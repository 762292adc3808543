"""Every built-in loss and a client-side custom loss (DPO), through the unmodified SDK against a
live ``tinker_local`` server, checked against reference formulas written here.

For each loss the test starts from one saved state (a tiny-preset LoRA trained two steps), runs
``forward_backward`` + ``optim_step`` through the SDK and compares: the per-datum ``logprobs``
and ``loss:sum`` with the formula evaluated on ``ReferenceLoRA`` (transformers + hand-made LoRA
hooks), and the weight update with the one Adam step implies for the reference gradient ``g``:
at step 1 (bias-corrected) ``delta = -lr * g / (|g| + eps)``, so a large ``eps`` makes the update
a faithful image of ``g`` (plain ``sign(g)`` otherwise).

Formulas (Tinker docs "Loss functions"; ``r = exp(lp - q)``, clip to [low, high]):
cross_entropy ``-sum(lp * w)`` ((N,) or (N, K) soft targets); importance_sampling ``-sum(r A)``;
ppo ``-sum(min(r A, clip(r) A))``; cispo ``-sum(sg(clip(r)) lp A)``; dro
``-sum(lp A - beta/2 (lp - q)^2)``; gspo ``-sum(min(s_t A, clip(s_t) A))`` with
``s_t = exp(mean_M(sg(lp) - q)) * exp(lp - sg(lp))`` over the tokens M of ``sequence_ratio_mask``
(default: tokens with non-zero advantage).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import tinker
from tests.local_server import API_KEY, ReferenceLoRA
from tinker import types

VOCAB = 2048
LENGTHS = (9, 14)
EPS = 1.0  # Adam eps of the checked step (see the module docstring)


@pytest.fixture(scope="module")
def start(clean, service):
    """(state path, adapter dir of that state, token sequences): a LoRA trained two steps."""
    tc = service.create_lora_training_client("tiny", rank=4, seed=7).result(timeout=120)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, VOCAB, n + 1).tolist() for n in LENGTHS]
    data = [_datum(s, {"weights": np.ones(len(s) - 1, np.float32)}) for s in seqs]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    path = tc.save_state("losses-start").result(timeout=60).path
    return path, clean.checkpoint_dir(path), seqs


def _datum(seq: list[int], inputs: dict, targets=None) -> types.Datum:
    tgt = np.asarray(seq[1:] if targets is None else targets, dtype=np.int64)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": tgt, **inputs})


def _reference(clean, adapter_dir) -> ReferenceLoRA:
    return ReferenceLoRA(clean.root / "models" / "tiny", adapter_dir)


def _keep_off_bounds(log_ratio: np.ndarray, bounds=(0.9, 1.1)) -> np.ndarray:
    """Move log-ratios within 1e-3 of a clip bound away from it (no branch flips from rounding)."""
    for b in np.log(bounds):
        near = np.abs(log_ratio - b) < 1e-3
        log_ratio[near] = b + 2e-3
    return log_ratio


def _inputs(case: str, seqs, lp0: list[np.ndarray], rng) -> tuple[list[dict], list, dict]:
    """Loss inputs per datum, explicit (N, K) targets or None per datum, and loss_fn_config."""
    targets: list = [None] * len(seqs)
    cfg: dict = {}
    out = []
    for i, (seq, lp) in enumerate(zip(seqs, lp0, strict=True)):
        n = len(seq) - 1
        if case == "cross_entropy":
            out.append({"weights": rng.uniform(-0.5, 2.0, n).astype(np.float32) * (rng.random(n) > 0.2)})
            continue
        if case == "cross_entropy_soft":
            targets[i] = rng.integers(3, VOCAB, (n, 3))
            w = rng.random((n, 3)).astype(np.float32)
            out.append({"weights": (w / w.sum(-1, keepdims=True)).astype(np.float32)})
            continue
        adv = rng.normal(0.0, 1.0, n).astype(np.float32)
        log_ratio = _keep_off_bounds(rng.normal(0.0, 0.3, n))
        inp = {"advantages": adv}
        if case == "gspo":  # sequence log-ratio exactly 0.05 (ratio inside the clip range), -0.3 (outside)
            if i == 0:
                marked = np.arange(n) >= 2
                inp["sequence_ratio_mask"] = marked.astype(np.float32)
            else:
                adv[:3] = 0.0  # prompt-like tokens: outside the default mask
                marked = adv != 0
            noise = rng.normal(0.0, 0.02, n)
            log_ratio = (0.05, -0.3)[i] + noise - noise[marked].mean()
        inp["logprobs"] = (lp.astype(np.float64) - log_ratio).astype(np.float32)
        out.append(inp)
    if case in ("ppo", "cispo", "gspo"):
        cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    if case == "dro":
        cfg = {"beta": 0.1}
    return out, targets, cfg


def _reference_loss(case: str, lp: torch.Tensor, inp: dict, cfg: dict) -> torch.Tensor:
    """The loss of one datum from the formulas in the module docstring (float64)."""
    lp = lp.double()
    t = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in inp.items()}
    if case.startswith("cross_entropy"):
        return -(lp * t["weights"]).sum()
    q, a = t["logprobs"], t["advantages"]
    low, high = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    ratio = torch.exp(lp - q)
    if case == "importance_sampling":
        return -(ratio * a).sum()
    if case == "ppo":
        return -torch.min(ratio * a, ratio.clamp(low, high) * a).sum()
    if case == "cispo":
        return -(ratio.detach().clamp(low, high) * lp * a).sum()
    if case == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    if case == "gspo":
        m = t.get("sequence_ratio_mask", (a != 0).double())
        seq_ratio = torch.exp(((lp.detach() - q) * m).sum() / m.sum())
        s = seq_ratio * torch.exp(lp - lp.detach())
        return -torch.min(s * a, s.clamp(low, high) * a).sum()
    raise AssertionError(case)


def _adam_image(grads: dict[str, torch.Tensor], lr: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: -lr * g / (g.abs() + EPS) for k, g in grads.items()}


def _update(clean, before_dir, after_path: str) -> dict[str, torch.Tensor]:
    before = load_file(str(before_dir / "adapter_model.safetensors"))
    after = load_file(str(clean.checkpoint_dir(after_path) / "adapter_model.safetensors"))
    assert before.keys() == after.keys()
    return {k: after[k] - before[k] for k in before}


def _assert_updates_match(got: dict, expected: dict) -> None:
    scale = max(float(v.abs().max()) for v in expected.values())
    assert scale > 1e-6, "the step moved nothing: the check would be vacuous"
    for k in expected:
        torch.testing.assert_close(got[k].double(), expected[k].double(), atol=5e-4 * scale, rtol=2e-3,
                                   msg=lambda m, k=k: f"{k}: {m}")


CASES = ["cross_entropy", "cross_entropy_soft", "importance_sampling", "ppo", "cispo", "dro", "gspo"]


@pytest.mark.parametrize("case", CASES)
def test_builtin_loss_matches_reference_formula(case, clean, service, start):
    path, start_dir, seqs = start
    ref = _reference(clean, start_dir)
    with torch.no_grad():
        lp0 = [ref.logprobs(s[:-1], s[1:]).numpy() for s in seqs]
    inputs, targets, cfg = _inputs(case, seqs, lp0, np.random.default_rng(CASES.index(case)))
    data = [_datum(s, inp, tgt) for s, inp, tgt in zip(seqs, inputs, targets, strict=True)]

    tc = service.create_training_client_from_state(path).result(timeout=120)  # fresh Adam state
    fb = tc.forward_backward(data, case.removesuffix("_soft"), cfg or None)
    tc.optim_step(types.AdamParams(learning_rate=1.0, eps=EPS)).result(timeout=60)
    res = fb.result(timeout=60)
    after = tc.save_weights_for_sampler(f"after-{case}").result(timeout=60).path

    total = 0.0
    for d, seq, inp, tgt, out in zip(data, seqs, inputs, targets, res.loss_fn_outputs, strict=True):
        lp = ref.logprobs(seq[:-1], seq[1:] if tgt is None else tgt)
        got = out["logprobs"].to_numpy()
        assert got.shape == tuple(d.loss_fn_inputs["target_tokens"].shape)
        np.testing.assert_allclose(got, lp.detach().numpy(), atol=1e-4, rtol=0)
        loss = _reference_loss(case, lp, inp, cfg)
        loss.backward()
        total += float(loss.detach())
    assert res.metrics["loss:sum"] == pytest.approx(total, abs=1e-3, rel=1e-4)
    _assert_updates_match(_update(clean, start_dir, after), _adam_image(ref.grads()))


def test_forward_backward_custom_dpo_matches_direct_torch(clean, service, start):
    path, start_dir, _ = start
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, VOCAB, 6).tolist()
    pairs = [(prompt + rng.integers(3, VOCAB, 5).tolist(), prompt + rng.integers(3, VOCAB, 7).tolist())
             for _ in range(2)]
    seqs = [s for pair in pairs for s in pair]  # chosen, rejected, chosen, rejected
    masks = [(np.arange(len(s) - 1) >= len(prompt) - 1).astype(np.float32) for s in seqs]
    data = [_datum(s, {"weights": m}) for s, m in zip(seqs, masks, strict=True)]
    beta = 0.5
    ref = _reference(clean, start_dir)
    with torch.no_grad():  # the DPO reference policy: the starting weights, frozen
        ref_lp = [
            float((ref.logprobs(s[:-1], s[1:]) * torch.from_numpy(m)).sum()) for s, m in zip(seqs, masks, strict=True)
        ]

    def dpo(logprobs: list[torch.Tensor]) -> torch.Tensor:
        seq_lp = [(lp * torch.from_numpy(m)).sum() - r for lp, m, r in zip(logprobs, masks, ref_lp, strict=True)]
        return sum(-F.logsigmoid(beta * (seq_lp[i] - seq_lp[i + 1])) for i in range(0, len(seqs), 2))

    def custom_loss(batch, logprobs):  # what a user passes to forward_backward_custom
        assert len(batch) == len(data)
        loss = dpo(logprobs)
        return loss, {"dpo_loss": float(loss.detach())}

    tc = service.create_training_client_from_state(path).result(timeout=120)
    fb = tc.forward_backward_custom(data, custom_loss)
    tc.optim_step(types.AdamParams(learning_rate=1.0, eps=EPS)).result(timeout=60)
    res = fb.result(timeout=120)
    after = tc.save_weights_for_sampler("after-dpo").result(timeout=60).path

    direct = dpo([ref.logprobs(s[:-1], s[1:]) for s in seqs])  # the same loss, straight in torch
    direct.backward()
    assert res.metrics["loss:sum"] == pytest.approx(float(direct), rel=1e-4)
    assert float(direct) == pytest.approx(2 * np.log(2), rel=1e-4)  # margins start at zero
    _assert_updates_match(_update(clean, start_dir, after), _adam_image(ref.grads()))
