"""The reference loops (``prefect_tinker.recipes.loops``) send the same requests as the full flows.

One in-process ``tinker_local`` server records every request (fp32, content-seeded sampling, LoRA
seed 0: the harness of ``test_cookbook_parity.py``); the ``sft`` / ``rl`` flow runs with a config,
the loop with the equivalent one, and ``benchmarks/parity/compare.py`` compares the two
request streams: every ``forward_backward`` (loss function and config, each datum's model input,
targets, weights / sampler logprobs / advantages) and ``optim_step`` (Adam parameters, the learning
rate included), every sampled sequence (weights, prompt, parameters, tokens, logprobs; the KL
reference's prompt logprobs too), and the final adapters tensor by tensor.  The learning rates are
also checked against the schedule computed here, and the rewards and losses each side reports
against the other's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.parity import API_KEY
from benchmarks.parity.compare import Comparison, compare, table
from benchmarks.parity.recipe import any_sample
from benchmarks.parity.requests import training_stream
from tests import inproc_server
from tests.recorded_requests import mark, since

DATA = Path(__file__).resolve().parents[1] / "prefect_tinker" / "recipes" / "data"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference-loops")
    srv = inproc_server.start(
        root / "server", ["tiny"], record_requests=root / "requests", content_seeds=True, default_lora_seed=0
    )
    srv.requests = root / "requests"  # type: ignore[attr-defined]
    yield srv
    from tinker_blocks.credentials import close_clients

    close_clients(srv.base_url)  # the flows' cached client: its heartbeat must not outlive the server
    srv.stop()


def _recorded(server, monkeypatch, run) -> tuple[object, list[dict]]:
    """``run()``'s result and the requests it sent."""
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    marked = mark(server.requests)
    out = run()
    return out, since(server.requests, marked)


def _flow_and_loop(server, monkeypatch, tmp_path, flow, config_cls, loop, shared: dict, **flow_only):
    """Run ``flow`` with ``config_cls(**shared, **flow_only)`` (backend: ``server``, store under ``tmp_path``),
    then the loop module ``loop`` with ``loop.Config(**shared)``: ``(flow result, flow requests, loop result,
    loop requests)``."""
    backend, store = {"base_url": server.base_url}, str(tmp_path / "store")
    flow_config = config_cls(**shared, **flow_only, backend=backend, store=store)
    summary, flow_requests = _recorded(server, monkeypatch, lambda: flow(config=flow_config))
    result, loop_requests = _recorded(server, monkeypatch, lambda: loop.main(loop.Config(**shared, **backend)))
    return summary, flow_requests, result, loop_requests


def _assert_same(recipe: str, flow: list[dict], loop: list[dict], steps: int, samples=None) -> Comparison:
    """The requests of ``loop`` against those of ``flow`` (in a failure's table the harness calls
    the first side "cookbook" and the second "ours": here the flow and the loop)."""
    cmp = compare(recipe, "tiny", flow, loop, 1e-6, samples)
    assert cmp.first is None, table(cmp, 1e-6)
    assert cmp.steps == steps and cmp.requests == 2 * steps, table(cmp, 1e-6)
    assert cmp.max_loss_rel <= 1e-6, table(cmp, 1e-6)
    assert cmp.max_weight_abs is not None and cmp.max_weight_abs <= 1e-6, table(cmp, 1e-6)
    return cmp


def _learning_rates(entries: list[dict]) -> list[float]:
    return [e["adam_params"]["learning_rate"] for e in training_stream(entries) if e["op"] == "optim_step"]


@pytest.mark.slow  # the flow (~10 s) and the loop (~2 s)
def test_sl_loop_sends_what_the_sft_flow_sends(server, tmp_path, monkeypatch, prefect_api):
    from prefect_tinker.flows.sft import SFTConfig, sft_flow
    from prefect_tinker.recipes.loops import sl_loop

    data = tmp_path / "chat.jsonl"
    data.write_text((DATA / "example_chat.jsonl").read_text())
    steps, lr = 3, 1e-3
    shared = dict(
        model="tiny", dataset=str(data), renderer="role_colon", max_length=64, batch_size=4, test_size=2, seed=0,
        learning_rate=lr, lr_schedule="linear", warmup_steps=1, lora_rank=4, max_steps=steps, reduction="mean",
        on_too_long="truncate_keep",
    )  # fmt: skip
    summary, flow, result, loop = _flow_and_loop(
        server, monkeypatch, tmp_path, sft_flow, SFTConfig, sl_loop, shared,
        eval_every=0, save_every=0, num_eval_samples=0, run_name="loops-sft",
    )  # fmt: skip

    _assert_same("sft", flow, loop, steps)
    # warmup to the peak, then linear decay (prefect_tinker/recipes/schedule.py's formula, computed here)
    expected = [lr, lr * (1 - 0 / 2), lr * (1 - 1 / 2)]  # step 0: warmup 1/1; then (step - 1) / (3 - 1) decayed
    assert _learning_rates(loop) == pytest.approx(expected, rel=1e-12) and result["learning_rates"] == expected
    # the loss each side reports (the loop: from the response; the flow: read back from its store, float32)
    assert math.isclose(result["losses"][0], summary["first_loss"], rel_tol=1e-6)
    assert math.isclose(result["losses"][-1], summary["last_loss"], rel_tol=1e-6)
    assert result["test_nll"] is not None and math.isclose(result["test_nll"], summary["last_test_nll"], rel_tol=1e-6)
    assert len(result["checkpoints"]) == 1 and result["checkpoints"][0].startswith("tinker://")


@pytest.mark.slow  # the flow (~15 s) and the loop (~3 s)
def test_rl_loop_sends_what_the_rl_flow_sends(server, tmp_path, monkeypatch, prefect_api):
    """Partial-credit rewards (they differ within a group even for the untrained ``tiny`` model),
    constant-reward groups dropped, and the KL penalty against the base model folded in."""
    from prefect_tinker.flows.rl import RLConfig, rl_flow
    from prefect_tinker.recipes.loops import rl_loop

    steps, groups, group_size = 2, 2, 2
    shared = dict(
        model="tiny", env="arithmetic", few_shot=True, renderer="role_colon_cookbook", group_size=group_size,
        groups_per_batch=groups, max_tokens=6, learning_rate=1e-3, lr_schedule="cosine", lora_rank=4,
        max_steps=steps, seed=0, kl_penalty_coef=0.05, remove_constant_reward_groups=True, save_every=0,
        env_options={"max_operand": 20, "reward": "partial"},
    )  # fmt: skip
    summary, flow, result, loop = _flow_and_loop(
        server, monkeypatch, tmp_path, rl_flow, RLConfig, rl_loop, shared,
        kl_reference="base:tiny", eval_every=0, log_trajectories=0, run_name="loops-rl",
    )  # fmt: skip

    cmp = _assert_same("rl", flow, loop, steps, samples=any_sample)
    # rollouts (steps x groups x group_size) and the KL reference's logprobs of each datum trained
    trained = [d for e in training_stream(loop) if e["op"] == "forward_backward" for d in e["datums"]]
    assert cmp.sequences == steps * groups * group_size + len(trained) and trained
    assert _learning_rates(loop) == pytest.approx([1e-3, 1e-3 * 0.5], rel=1e-12)  # cosine over 2 steps
    # the comparison covers reward-driven advantages (partial credit is in [0, 0.5): group differences ~0.01-0.5)
    assert max(abs(x) for d in trained for x in d["loss_fn_inputs"]["advantages"]["data"]) > 1e-3
    assert result["rewards"] == pytest.approx(summary["rewards"], rel=1e-12)
    assert len(result["kl_policy_ref"]) == steps and all(math.isfinite(k) for k in result["kl_policy_ref"])
