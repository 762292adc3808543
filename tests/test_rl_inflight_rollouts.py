"""The RL recipe's async schedule on inflight sampling clients, against the real local server
through the SDK: after an update publishes new weights, the inflight client the rollouts already
hold samples from them (no new client, no restart), while a snapshot client of the old weights
keeps returning the old logprobs."""

from __future__ import annotations

import numpy as np
import tinker
from prefect import flow

from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.rl import RLLoop
from prefect_tinker.flows.rl_config import SCHEDULES
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.rl.envs import build_rl_dataset
from prefect_tinker.tasks.clients import sampling_client
from tests.test_rl_flow import _config  # also registers the test env "parity" (dense rewards)

PROMPT = "What is 17 + 25? Answer: 42. What is 3 + 9? Answer: 12."


def _logprobs(client, tokens: list[int]) -> np.ndarray:
    """Prompt logprobs of ``tokens`` from a sampling client (the first position has none)."""
    out = client.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result(timeout=120)
    return np.asarray(out[1:], dtype=np.float64)


@flow(name="inflight-rollouts-probe")
def _probe(config) -> dict:
    """One async RL step, as ``rl_flow`` runs it, with the sampling clients read around it."""
    with RunSession(config) as session:
        session.save_sampler(record=True)
        dataset = build_rl_dataset(
            config,
            renderer_name=session.renderer,
            tokenizer_id=session.tokenizer_id,
            group_size=config.group_size,
            groups_per_batch=config.groups_per_batch,
            seed=config.seed,
        )
        loop = RLLoop(session, dataset, f"base:{config.model}")
        first = loop.sampler_client  # the inflight client the first rollouts sample from
        snapshot = sampling_client(session.credentials, session.samplers[0])
        tokens = list(loop.tokenizer.encode(PROMPT))
        before = {"inflight": _logprobs(first, tokens), "snapshot": _logprobs(snapshot, tokens)}
        schedule = SCHEDULES["async"](loop)
        try:
            StepLoop(session, loop.k, step_size=loop.k, on_rewind=schedule.rewind).run(schedule.step)
        finally:
            schedule.close()
        now = sampling_client(session.credentials, session.save_sampler("after-update"))
        return {
            "before": before,
            "after": {
                "inflight": _logprobs(first, tokens),
                "snapshot": _logprobs(snapshot, tokens),
                "newest_inflight": _logprobs(loop.sampler_client, tokens),
                "new_weights": _logprobs(now, tokens),
            },
            "same_client": loop.sampler_client is first,
            "step": session.step,
        }


def test_inflight_rollout_clients_move_to_each_update(prefect_api, local_credentials, tmp_path):
    config = _config(
        local_credentials,
        tmp_path / "store",
        "inflight-move",
        schedule="async",
        sampler_kind="inflight",
        max_steps_off_policy=1,
        max_steps=1,
        save_every=0,
        env="parity",
    )
    out = _probe(config)
    before, after = out["before"], out["after"]
    assert out["step"] == 1 and not out["same_client"]  # the update published a newer inflight client
    np.testing.assert_allclose(before["inflight"], before["snapshot"], atol=1e-5)  # both on step-0 weights
    # the old inflight client now samples the updated weights, exactly as a snapshot of them does
    assert np.max(np.abs(after["inflight"] - before["inflight"])) > 1e-3
    np.testing.assert_allclose(after["inflight"], after["new_weights"], atol=1e-5)
    np.testing.assert_allclose(after["newest_inflight"], after["new_weights"], atol=1e-5)
    # the snapshot client never moves
    np.testing.assert_allclose(after["snapshot"], before["snapshot"], atol=1e-6)
