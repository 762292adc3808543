"""Tokens and cost of the requests around training steps -- reference logprobs (DPO), a
distillation teacher, evaluators -- in the store's ``metrics`` rows, against the real local server
through the SDK (see prefect_tinker.recipes.pricing)."""

from __future__ import annotations

import pytest

from prefect_tinker.flows.distill import DistillConfig, distill_flow
from prefect_tinker.flows.dpo import dpo_flow
from prefect_tinker.recipes.pricing import EVAL_TOKEN_KINDS, TOKEN_KINDS, TokenPrices, eval_cost
from tests.test_dpo import _config as _dpo_config
from tests.test_dpo import _sql
from tests.test_rl_losses_flow import _sampling_stats

PRICES = {"prefill": 0.5, "prefill_cached": 0.1, "sample": 2.0, "train": 3.0}


def _usage(store, run: str) -> dict[tuple[int, str], float]:
    rows = _sql(
        store,
        f"SELECT step, name, value FROM metrics WHERE run_id = '{run}' AND "
        "(name LIKE 'tokens/%' OR name LIKE 'cost/%')",
    )
    return {(r["step"], r["name"]): r["value"] for r in rows}


def _step_usd(use: dict, step: int) -> float:
    t = {k: use[(step, f"tokens/{k}")] for k in TOKEN_KINDS}
    return (
        t["sampled"] * 2.0
        + t["prefill_cached"] * 0.1
        + t["prefill_uncached"] * 0.5
        + t["trained"] * 3.0
        + t["teacher_prefill"] * 0.5
        + t["reference_prefill"] * 0.5
    ) / 1e6


def test_eval_cost_prices_sampled_and_prefill_tokens():
    prices = TokenPrices(prefill=0.2, prefill_cached=0.05, sample=0.6)
    assert eval_cost(prices, {"eval_sampled": 1000, "eval_prefill": 5000}) == pytest.approx((600 + 1000) / 1e6)
    assert eval_cost(TokenPrices(), {"eval_sampled": 1e6}) == 0.0 and EVAL_TOKEN_KINDS == (
        "eval_sampled",
        "eval_prefill",
    )


def test_dpo_counts_reference_and_evaluation_tokens(prefect_api, local_credentials, tmp_path):
    store = tmp_path / "store"
    # a batch size and test split of their own: no other test's cached reference logprobs answer these
    config = _dpo_config(
        local_credentials,
        store,
        "dpo-usage",
        batch_size=3,
        max_steps=2,
        eval_every=1,
        save_every=2,
        test_size=8,
        prices={"tiny": PRICES},
    )
    dpo_flow(config)
    use = _usage(store, "dpo-usage")
    for s in (0, 1):
        # the reference (a frozen trainer of the initial weights) runs one forward over the step's datums
        assert use[(s, "tokens/reference_prefill")] == use[(s, "tokens/trained")] > 0
        assert use[(s, "cost/step_usd")] == pytest.approx(_step_usd(use, s), rel=1e-9)
    assert (
        use[(1, "tokens/reference_prefill_total")]
        == use[(0, "tokens/reference_prefill")] + use[(1, "tokens/reference_prefill")]
    )
    assert use[(1, "cost/total_usd")] == pytest.approx(use[(0, "cost/step_usd")] + use[(1, "cost/step_usd")])
    # evaluations at steps 0, 1, 2: a forward over the test pairs, and at step 0 the test pairs'
    # reference logprobs too (later evaluations get them from the task cache: they cost nothing)
    evals = [use[(s, "tokens/eval_prefill")] for s in (0, 1, 2)]
    assert evals[0] == 2 * evals[1] == 2 * evals[2] > 0
    for s in (0, 1, 2):
        assert use[(s, "tokens/eval_sampled")] == 0.0
        assert use[(s, "cost/eval_usd")] == pytest.approx(use[(s, "tokens/eval_prefill")] * 0.5 / 1e6, rel=1e-12)
    # evaluation tokens stay out of the steps' cost and the run's totals
    assert (2, "cost/step_usd") not in use


def test_distillation_counts_teacher_tokens(prefect_api, local_credentials, tmp_path):
    store = tmp_path / "store"
    # a seed of its own: no other test's cached teacher top-K answers these rollouts
    config = DistillConfig(
        model="tiny",
        group_size=2,
        groups_per_batch=4,
        max_tokens=12,
        lora_rank=8,
        mode="sdft",
        topk=8,
        max_steps=2,
        learning_rate=5e-3,
        save_every=2,
        seed=11,
        run_name="sdft-usage",
        store=str(store),
        backend={"local_root": local_credentials.local_root},
        prices={"tiny": PRICES},
    )
    before = _sampling_stats(local_credentials)
    distill_flow(config)
    after = _sampling_stats(local_credentials)
    use = _usage(store, "sdft-usage")
    for s in (0, 1):
        assert use[(s, "tokens/teacher_prefill")] > use[(s, "tokens/trained")] > 0
        assert use[(s, "cost/step_usd")] == pytest.approx(_step_usd(use, s), rel=1e-9)
    assert (
        use[(1, "tokens/teacher_prefill_total")]
        == use[(0, "tokens/teacher_prefill")] + use[(1, "tokens/teacher_prefill")]
    )
    if before is not None and after is not None:  # the server's own prompt counters: rollouts plus teacher
        prompts = sum(
            use[(s, f"tokens/{k}")] for s in (0, 1) for k in ("prefill_cached", "prefill_uncached", "teacher_prefill")
        )
        served = (
            after["prompt_tokens_cached"]
            + after["prompt_tokens_uncached"]
            - before["prompt_tokens_cached"]
            - before["prompt_tokens_uncached"]
        )
        assert served == prompts
