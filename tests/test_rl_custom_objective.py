"""A plugin RL loss defined as a torch objective (``RLLoss.objective``), run by the RL training
task (``forward_backward`` with ``objective=``) against the real local server through the SDK on
three paths: uploaded and computed on the server (one ``forward_backward`` request), on a server
whose client config says custom losses run client-side, and on a server that refuses the upload
(both: the client-side fallback, a forward plus a backward). All three give the same loss, the
same metrics and the same weights after one optimizer step (next-step logprobs), and equal an
independent computation: the objective written out again on the logprobs of an fp32 reference
model with the same LoRA, its gradient by autograd and the AdamW update applied by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict

import tinker
from prefect_tinker.plugin import LOSSES, RLLoss, register_loss
from prefect_tinker.recipes.rl.advantages import RLDatum
from prefect_tinker.tasks.custom_losses import ClientSideLoss, custom_loss
from prefect_tinker.tasks.training import forward, forward_backward, open_training_run, optim_step
from tests import inproc_server
from tests.local_server import ReferenceLoRA, make_hf_model_dir
from tinker_blocks.credentials import TinkerCredentials, close_clients

EPS = 0.2
LR = 0.05
# beta1 = beta2 = 0: one AdamW step moves each weight by lr * g / (|g| + eps), computed by hand below
ADAM = {"beta1": 0.0, "beta2": 0.0, "eps": 1e-3, "weight_decay": 0.0}
TEXTS = ["the quick brown fox jumps over the lazy dog", "one two three four five", "hello world hello tinker"]


class ClippedPGOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    epsilon: float = 0.2


class ClippedPG(RLLoss):
    """PPO's clipped surrogate written as a torch objective (no server built-in named)."""

    name = "test_clipped_pg"
    description = "PPO clipped surrogate as a custom objective"
    Options = ClippedPGOptions
    options: ClippedPGOptions

    def objective(self):
        lo, hi = 1 - self.options.epsilon, 1 + self.options.epsilon

        def clipped_pg(logprobs, advantages, sampling_logprobs, mask):
            ratio = torch.exp(logprobs - sampling_logprobs)
            surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages)
            loss = -(surrogate * mask).sum()
            clipped = ((ratio < lo) | (ratio > hi)).float() * mask
            return loss, {"custom/clipped:sum": clipped.sum(), "custom/ratio:mean": (ratio * mask).sum() / mask.sum()}

        return clipped_pg


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    register_loss(ClippedPG)
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("objective-model") / "model")
    server = inproc_server.start(tmp_path_factory.mktemp("objective-root"), [str(model_dir)])
    creds = {p: TinkerCredentials(base_url=server.base_url, api_key=f"tml-objective-{p}")
             for p in ("server", "client", "refused")}
    for path, creds_ in creds.items():  # each service client reads the client config now
        server.service.custom_loss_server_side = path != "client"
        creds_.get_client().holder  # noqa: B018
    server.service.custom_loss_server_side = True
    tc = creds["server"].get_client().create_lora_training_client(str(model_dir), rank=4, seed=3).result(timeout=120)
    tok = tc.get_tokenizer()
    warm = []
    for text in TEXTS:
        ids = tok.encode(text)
        warm.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                                 loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)}))
    for _ in range(2):  # LoRA A and B both non-zero
        tc.forward_backward(warm, "cross_entropy")
        tc.optim_step(tinker.AdamParams(learning_rate=2e-2)).result(timeout=60)
    state = tc.save_state("objective-init").result(timeout=60).path
    now = [np.asarray(o["logprobs"].to_numpy()) for o in tc.forward(warm, "cross_entropy").result(timeout=60)
           .loss_fn_outputs]
    yield {"server": server, "creds": creds, "tok": tok, "state": state, "model_dir": model_dir,
           "datums": _rl_datums(tok, now)}
    close_clients(server.base_url)
    server.stop()
    del LOSSES[ClippedPG.name]


def _rl_datums(tok, policy_logprobs) -> list[RLDatum]:
    """Each text as prompt (its first 3 tokens) + action; sampler logprobs off the policy's by a
    few tenths (so some ratios leave [1 - eps, 1 + eps]), advantages of both signs."""
    rng = np.random.default_rng(0)
    out = []
    for i, (text, lp) in enumerate(zip(TEXTS, policy_logprobs, strict=True)):
        ids = tok.encode(text)
        mask = np.zeros(len(ids) - 1, np.float32)
        mask[2:] = 1.0
        sampler = np.where(mask > 0, lp + rng.uniform(-0.4, 0.4, mask.size), 0.0).astype(np.float32)
        adv = (mask * (1.0 if i % 2 == 0 else -0.7)).astype(np.float32)
        out.append(RLDatum(tokens=ids, mask=mask, sampler_logprobs=sampler, advantages=adv))
    return out


def _run(env, path: str):
    """One pass of the RL training task with the objective, then an optimizer step; returns the
    forward_backward result, the request count and the logprobs after the step."""
    creds, server = env["creds"][path], env["server"]
    loss = LOSSES.get_or_raise(ClippedPG.name).from_options({"epsilon": EPS})
    datums = [d.to_datum(objective_inputs=loss.objective_inputs()) for d in env["datums"]]
    run = open_training_run.fn(creds, f"objective-{path}", str(env["model_dir"]), 4, "remote",
                               init_from=env["state"])
    counts = server.service.request_counts
    before = counts.get("/api/v1/forward", 0) + counts.get("/api/v1/forward_backward", 0)
    if path == "refused":  # the client config said server-side; the upload is refused (HTTP 400)
        server.service.custom_loss_server_side = False
        try:
            resolved = custom_loss(creds, loss.objective(), {"logprobs": 1, "advantages": 1,
                                                            "sampling_logprobs": 1, "mask": 1})
        finally:
            server.service.custom_loss_server_side = True
        assert isinstance(resolved, ClientSideLoss)
    out = forward_backward.fn(creds, run, datums, objective=loss.objective())
    requests = counts.get("/api/v1/forward", 0) + counts.get("/api/v1/forward_backward", 0) - before
    run, _ = optim_step.fn(creds, run, LR, ADAM)
    after = forward.fn(creds, run, [_plain(d) for d in datums])
    return out, requests, [np.asarray(lp) for lp in after.logprobs]


def _plain(d: tinker.Datum) -> tinker.Datum:
    return tinker.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})


def _by_hand(env):
    """The objective written out again on an independent fp32 reference, its gradient, and the
    logprobs after one AdamW step with beta1 = beta2 = 0 (update lr * g / (|g| + eps))."""
    server = env["server"]
    ref = ReferenceLoRA(env["model_dir"], Path(server.service.registry.checkpoints[env["state"]].path))
    total, clipped, ratios = torch.zeros(()), 0.0, []
    for d in env["datums"]:
        lp = ref.logprobs(d.tokens[:-1], np.asarray(d.tokens[1:]))
        on = torch.as_tensor(d.mask) > 0
        r = torch.exp(lp[on] - torch.as_tensor(d.sampler_logprobs)[on])
        a = torch.as_tensor(d.advantages)[on]
        total = total - torch.where(a >= 0, torch.minimum(r, torch.tensor(1 + EPS)),
                                    torch.maximum(r, torch.tensor(1 - EPS))).mul(a).sum()
        clipped += float(((r < 1 - EPS) | (r > 1 + EPS)).sum())
        ratios.append(float(r.detach().mean()))
    total.backward()
    with torch.no_grad():
        for k, p in ref.params.items():
            g = ref.grads()[k]
            p -= LR * g / (g.abs() + ADAM["eps"])
        after = [ref.logprobs(d.tokens[:-1], np.asarray(d.tokens[1:])).numpy() for d in env["datums"]]
    return float(total.detach()), clipped, float(np.mean(ratios)), after


def test_objective_loss_is_declared_and_checked():
    loss = ClippedPG.from_options({"epsilon": 0.1})
    assert loss.objective_inputs() == ("advantages", "sampling_logprobs", "mask")

    class Both(ClippedPG):
        loss_fn = "ppo"

    class Neither(RLLoss):
        name = "test_neither"

    for cls in (Both, Neither):
        with pytest.raises(ValueError, match="exactly one"):
            register_loss(cls)

    class Unknown(RLLoss):
        name = "test_unknown_input"

        def objective(self):
            def f(logprobs, rewards):
                return -(logprobs * rewards).sum(), {}
            return f

    with pytest.raises(ValueError, match=r"reads \['rewards'\]"):
        Unknown().objective_inputs()


def test_server_side_and_client_side_paths_agree_with_a_computation_by_hand(env):
    results = {p: _run(env, p) for p in ("server", "client", "refused")}
    want_loss, want_clipped, want_ratio, want_after = _by_hand(env)
    assert want_clipped > 0  # the clip is exercised
    server_out, server_requests, server_after = results["server"]
    assert server_requests == 1  # one forward_backward computed on the server
    for path, (out, requests, after) in results.items():
        if path != "server":
            assert requests == 2, path  # forward for the logprobs, backward with -dloss/dlogprobs
        assert out.loss_sum == pytest.approx(want_loss, rel=1e-4, abs=1e-5), path
        assert out.loss_sum == pytest.approx(server_out.loss_sum, rel=1e-5, abs=1e-6), path
        assert out.metrics["custom/clipped_sum"] == want_clipped, path  # custom/clipped:sum
        assert out.metrics["custom/ratio"] == pytest.approx(want_ratio, rel=1e-4), path
        assert set(out.metrics) == set(server_out.metrics), path
        for got, ref, base in zip(after, want_after, server_after, strict=True):
            np.testing.assert_allclose(got, base, atol=2e-5, err_msg=path)
            np.testing.assert_allclose(got, ref, atol=2e-4, err_msg=path)
    moved = max(float(np.abs(a - np.asarray(d)).max())
                for a, d in zip(server_after, [o for o in server_out.logprobs], strict=True))
    assert moved > 1e-3  # the step changed the weights


def test_the_rl_flow_trains_with_the_objective_on_the_server(env, prefect_api, local_credentials, tmp_path, capsys):
    """``loss_fn=<the plugin's objective loss>`` through the whole RL flow: the loss was uploaded in
    the credentials' session (the SDK refuses a second upload of it) and runs on the server; the
    step's rows are recorded, the objective's own ``custom/*`` metrics among them: in the first
    step the policy is the sampler, so the mean ratio is 1 and nothing is clipped."""
    from prefect_tinker.flows.rl import rl_flow
    from tests.test_rl_flow import REQUIRED, _config, _sql

    store = tmp_path / "store"
    config = _config(local_credentials, store, "objective-run", loss_fn=ClippedPG.name,
                     loss_options={"epsilon": 0.15}, max_steps=1, save_every=0)
    assert rl_flow(config)["steps"] == 1
    fn = ClippedPG.from_options({"epsilon": 0.15}).objective()
    ranks = {"logprobs": 1, "advantages": 1, "sampling_logprobs": 1, "mask": 1}
    with pytest.raises(ValueError, match="already created"):
        local_credentials.get_client().create_custom_loss(fn, ranks).result(timeout=60)
    assert custom_loss(local_credentials, fn, ranks).loss_id is not None  # the flow's: computed on the server
    rows = {r["name"]: r["value"] for r in _sql(capsys, store, "SELECT name, value FROM metrics "
                                                            "WHERE run_id='objective-run'")}
    assert REQUIRED <= set(rows) and np.isfinite(rows["train/loss_sum"])
    assert rows["train/custom/ratio"] == pytest.approx(1.0, abs=1e-3)
    assert rows["train/custom/clipped_sum"] == 0.0
