"""The RL flow with every server loss, StableReinforce provenance, inflight samplers, and the
tokens/* and cost/* rows of every step -- against the real local server through the SDK."""

from __future__ import annotations

import httpx
import pytest

from prefect_tinker.flows.rl import RLConfig, rl_flow
from prefect_tinker.recipes.pricing import TOKEN_KINDS
from tests.test_rl_flow import _config, _sql

USAGE = {*(f"tokens/{k}" for k in TOKEN_KINDS), *(f"tokens/{k}_total" for k in TOKEN_KINDS), "cost/step_usd",
         "cost/total_usd"}
PRICES = {"prefill": 0.5, "prefill_cached": 0.1, "sample": 2.0, "train": 3.0}


def _sampling_stats(credentials) -> dict | None:
    """The server's own sampling counters (``GET /api/v1/local_stats``), or None when it has none."""
    from tinker_blocks.credentials import ensure_local_server

    info = ensure_local_server(credentials)  # the running server (started when needed)
    return httpx.get(f"{info['base_url']}/api/v1/local_stats", timeout=10).json().get("sampling")


def _usage_rows(capsys, store, run) -> dict[int, dict[str, float]]:
    rows = _sql(capsys, store, f"SELECT step, name, value FROM metrics WHERE run_id='{run}' AND "
                               "(name LIKE 'tokens/%' OR name LIKE 'cost/%') ORDER BY step")
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["step"], {})[r["name"]] = r["value"]
    return out


def test_gspo_records_tokens_and_cost_of_every_step(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    before = _sampling_stats(local_credentials)
    config = _config(local_credentials, store, "gspo-usage", loss_fn="gspo", prices={"tiny": PRICES})
    assert config.loss_fn_config() == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    summary = rl_flow(config)
    assert summary["steps"] == 2
    after = _sampling_stats(local_credentials)
    usage = _usage_rows(capsys, store, "gspo-usage")
    assert sorted(usage) == [0, 1] and all(USAGE <= set(m) for m in usage.values())
    for step, m in usage.items():
        assert m["tokens/sampled"] > 0 and m["tokens/prefill_uncached"] + m["tokens/prefill_cached"] > 0
        # each trained sequence is its group's prompt (prefilled once per group) and a reply, less one position
        prompts = m["tokens/prefill_uncached"] + m["tokens/prefill_cached"]
        assert 0 < m["tokens/trained"] <= config.group_size * prompts + m["tokens/sampled"] - 1
        want = (m["tokens/sampled"] * 2.0 + m["tokens/prefill_cached"] * 0.1 + m["tokens/prefill_uncached"] * 0.5
                + m["tokens/trained"] * 3.0) / 1e6
        assert m["cost/step_usd"] == pytest.approx(want, rel=1e-9)
    for k in TOKEN_KINDS:
        assert usage[1][f"tokens/{k}_total"] == pytest.approx(usage[0][f"tokens/{k}"] + usage[1][f"tokens/{k}"])
    assert usage[1]["cost/total_usd"] == pytest.approx(usage[0]["cost/step_usd"] + usage[1]["cost/step_usd"])
    if before is not None and after is not None:  # the server's own counters agree (no other sampling ran)
        total = {k: sum(m[f"tokens/{k}"] for m in usage.values())
                 for k in ("sampled", "prefill_cached", "prefill_uncached")}
        assert after["sampled_tokens"] - before["sampled_tokens"] == total["sampled"]
        assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == total["prefill_cached"]
        assert after["prompt_tokens_uncached"] - before["prompt_tokens_uncached"] == total["prefill_uncached"]


def test_dro_sends_beta_and_an_unpriced_local_model_costs_nothing(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    config = _config(
        local_credentials, store, "dro-run", loss_fn="dro", loss_options={"beta": 0.1}, max_steps=1, save_every=0
    )
    assert config.loss_fn_config() == {"beta": 0.1}
    rl_flow(config)
    usage = _usage_rows(capsys, store, "dro-run")
    assert usage[0]["tokens/trained"] > 0 and usage[0]["cost/step_usd"] == 0.0 and usage[0]["cost/total_usd"] == 0.0


def test_async_schedule_on_inflight_samplers(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    config = _config(local_credentials, store, "inflight-run", schedule="async", sampler_kind="inflight",
                     max_steps_off_policy=1)
    summary = rl_flow(config)
    assert summary["steps"] == 2 and summary["sampler_path"].startswith("inflight:")
    usage = _usage_rows(capsys, store, "inflight-run")
    assert sorted(usage) == [0, 1] and all(m["tokens/sampled"] > 0 and m["tokens/trained"] > 0 for m in usage.values())


def test_stable_reinforce_wires_provenance_through_rollouts(prefect_api, local_credentials, tmp_path, capsys):
    """Rollouts sample with ``record_stability_info=True`` clients and every datum names its
    sequences; the server checks the provenance before the loss runs. tinker_local refuses the
    loss itself by name (its objective is not documented in a reproducible form:
    docs/local-server-features.md), so the run ends with that refusal, which comes only after
    every datum's provenance passed: a datum without it, or naming an unknown sequence, gets a
    400 saying so instead."""
    store = tmp_path / "store"
    config = _config(local_credentials, store, "sr-run", loss_fn="stable_reinforce", max_steps=1, save_every=0)
    assert config.provenance and config.loss_fn_config() is None
    with pytest.raises(Exception) as refused:  # noqa: PT011 - matched by its text below
        rl_flow(config)
    msg = str(refused.value)
    assert "'stable_reinforce' is not implemented by tinker_local" in msg, msg
    assert "provenance" not in msg.split("is not implemented")[0]  # not a provenance refusal
    assert not _usage_rows(capsys, store, "sr-run")  # no step was recorded as trained


def test_inflight_needs_the_async_schedule():
    with pytest.raises(ValueError, match="sampler_kind='inflight' needs an off-policy schedule such as 'async'"):
        RLConfig(model="tiny", sampler_kind="inflight", store="/nonexistent-store-is-not-read")


def test_numerics_check_kl_is_in_the_healthy_range(prefect_api, local_credentials, tmp_path, capsys):
    """Long page-by-page episodes: the trainer's logprobs of every sampled token differ from the
    sampler's as docs/numerics.md gives for the dtype the embedded server trains in (``auto``: bf16
    where the CPU has it, else fp32; the sampler is fp32 in both). Sampler and trainer run the same
    weights, so the measure shows numerics only, and each range is tight on both sides: fp32 agrees
    to float rounding (a wrong position after a KV-cache reuse or a mask error is far above it);
    bf16 differs by its rounding, ~3e-6 nats^2, not 0 (a trainer handing back the sampler's
    logprobs, or training in fp32 when it claims bf16, falls below it)."""
    import torch

    from tinker_local.compute import bf16_supported

    store = tmp_path / "store"
    opts = {"num_pages_min": 4, "num_pages_max": 4, "page_words": 30, "max_trajectory_tokens": 2000}
    rl_flow(_config(local_credentials, store, "numerics", env="numerics_check", env_options=opts, max_steps=1,
                    save_every=0, max_tokens=8))
    rows = _sql(capsys, store, "SELECT name, value FROM metrics WHERE run_id='numerics'")
    got = {r["name"]: r["value"] for r in rows}
    assert got["env/turns_per_episode"] == 5.0 and got["tokens/trained"] > 4 * 4 * 30  # one long datum per episode
    v1, v2 = got["train/kl_sample_train_v1"], got["train/kl_sample_train_v2"]
    assert abs(v1) <= (2 * v2) ** 0.5 + 1e-12  # |mean(q - p)| <= RMS(q - p): one set of differences
    if bf16_supported(torch.device("cpu")):  # measured 3.4e-6 to 3.9e-6 (docs/numerics.md)
        assert 3e-7 < v2 < 4e-5 and abs(v1) < 1e-3
    else:  # measured 7e-14, |v1| < 2e-8
        assert v2 < 1e-10 and abs(v1) < 1e-6
