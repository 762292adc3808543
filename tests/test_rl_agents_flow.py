"""The agent environments through the real RL flow: ``prefect-tinker run rl env=<env> model=tiny
...`` -> rollout-group tasks (multi-turn episodes, the sandbox, a shared self-play game) -> tinker
SDK -> local server -> training store; the metrics land in the store, one row per step and name.
Tiny sizes: 2 steps of 1-2 groups of 2, short replies. Also the rollout evaluator (games against the
random and minimax players) on real sampler weights."""

from __future__ import annotations

import json

import pytest

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec
from prefect_tinker.tasks.rollout_eval import env_evaluators
from tests.data_files import data_file


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def _run(capsys, local_credentials, store, run, *args, groups: int = 2) -> tuple[dict[tuple[str, int], float], dict]:
    """``prefect-tinker run rl ...`` with ``groups`` groups per batch: the metrics ``{(name, step): value}`` it
    stored, and its summary."""
    argv = ["run", "rl", f"run_name={run}", "model=tiny", "max_steps=2", "group_size=2", f"groups_per_batch={groups}",
            "lora_rank=8", "save_every=2", "learning_rate=5e-3", f"store={store}", "log_trajectories=2",
            f"backend.local_root={local_credentials.local_root}", *args]
    capsys.readouterr()
    rc = cli_main(argv)
    out = capsys.readouterr()
    assert rc in (0, None), out.err[-3000:]
    summary = json.loads(out.out[out.out.index("{"):])
    rows = _sql(capsys, store, f"SELECT step, name, value, count(*) OVER (PARTITION BY step, name) AS n "
                               f"FROM metrics WHERE run_id='{run}'")
    assert rows and all(r["n"] == 1 for r in rows)
    assert _sql(capsys, store, f"SELECT status FROM runs WHERE run_id='{run}'") == [{"status": "completed"}]
    return {(r["name"], r["step"]): r["value"] for r in rows}, summary


def _has(metrics, *names):
    for name in names:
        for step in (0, 1):
            assert (name, step) in metrics, (name, step, sorted({n for n, _ in metrics}))


def test_tictactoe_selfplay_run_then_evaluation_against_random_and_minimax(prefect_api, local_credentials, tmp_path,
                                                                            capsys):
    from prefect import flow

    store = tmp_path / "store"
    m, summary = _run(capsys, local_credentials, store, "ttt", "env=tictactoe", "max_tokens=4",
                      "remove_constant_reward_groups=false")
    _has(m, "env/reward_mean", "env/win", "env/loss", "env/illegal", "env/turns_per_episode", "train/loss_sum")
    for s in (0, 1):  # every game has one winner and one loser, or an illegal move and its victim, or a draw
        assert m[("env/win", s)] == pytest.approx(m[("env/loss", s)])
        assert m[("env/illegal", s)] == pytest.approx(m[("env/opponent_illegal", s)])
    traj = _sql(capsys, store, "SELECT prompt, metrics_json FROM trajectories WHERE run_id='ttt'")
    assert traj and all("tic-tac-toe" in t["prompt"] and "board" in json.loads(t["metrics_json"]) for t in traj)

    @flow
    def evaluate() -> dict[str, float]:
        spec = EnvSpec(env="tictactoe", env_options={"eval_games": 2})
        ctx = EnvContext(renderer_name="chatml", tokenizer_id=summary["tokenizer_id"], group_size=2, groups_per_batch=1)
        out: dict[str, float] = {}
        for ev in env_evaluators(spec, ctx, max_tokens=4, seed=3):
            out.update(ev.evaluate(local_credentials, summary["sampler_path"], step=2))
        return out

    metrics = evaluate()
    for opponent in ("vs_random", "vs_minimax"):
        assert metrics[f"test/{opponent}/trajectories"] == 2.0 and metrics[f"test/{opponent}/errors"] == 0.0
        rates = [metrics[f"test/{opponent}/{k}"] for k in ("win", "draw", "loss", "illegal")]
        assert sum(rates) == pytest.approx(1.0)
    assert metrics["test/vs_minimax/win"] == 0.0


def test_calculator_and_humaneval_runs(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    gsm8k = data_file("math/gsm8k_train.jsonl")
    m, _ = _run(capsys, local_credentials, store, "calc", "env=calculator", f"dataset={gsm8k}", "max_problems=4",
                "max_tokens=12", "env_options.max_turns=2", groups=1)
    _has(m, "env/reward_mean", "env/tool_calls", "env/correct_rate", "env/parse_failed", "train/loss_sum")
    assert all(0.0 <= m[("env/tool_calls", s)] <= 2.0 for s in (0, 1))

    humaneval = data_file("code/humaneval.jsonl.gz")
    m, _ = _run(capsys, local_credentials, store, "code", "env=humaneval", f"dataset={humaneval}", "max_problems=4",
                "max_tokens=12", groups=1)
    _has(m, "env/reward_mean", "env/all_passed", "env/format_rate", "train/loss_sum")
    assert all(-0.1 - 1e-9 <= m[("env/reward_mean", s)] <= 1.0 for s in (0, 1))
