"""The RLHF flow end to end through the real command line: ``prefect-tinker run rlhf`` (tiny
model, a few steps per stage) killed with SIGKILL during its RL stage, then run again: SFT and
RM are not redone (their rows untouched), RL resumes after its last checkpoint, three completed
runs, one metric row per (run, step, name). Then a changed SFT stage: SFT continues, the reward
model is skipped and the RL run, started from the old SFT state, is refused. Plus the config's
checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data_files import data_file, synthetic_file

CLI = str(Path(sys.executable).parent / "prefect-tinker")


def _args(store, local_root, hh, sft_steps: int = 2) -> list[str]:
    return [
        CLI,
        "run",
        "rlhf",
        "model=tiny",
        "run_name=pipe",
        f"store={store}",
        f"backend.local_root={local_root}",
        "lora_rank=4",
        f"sft.max_steps={sft_steps}",
        "sft.batch_size=2",
        "sft.num_eval_samples=0",
        "sft.eval_every=0",
        f"rm.sources=[{{path: '{hh}', format: dialogue, max_records: 300}}]",
        "rm.max_steps=2",
        "rm.batch_size=2",
        "rm.max_length=256",
        "rm.test_size=8",
        "rm.eval_every=0",
        "rl.max_steps=4",
        "rl.save_every=1",
        "rl.group_size=3",
        "rl.groups_per_batch=2",
        "rl.max_tokens=6",
        "rl.env_options.max_prompt_tokens=96",
        "rl.env_options.test_prompts=3",
    ]


def _sql(store, query: str, params=None) -> list[dict]:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=str(store)).query(query, params)


def _snapshot(store, runs: tuple[str, ...]) -> dict[str, list]:
    marks = ", ".join("?" * len(runs))
    return {t: _sql(store, f"SELECT * FROM {t} WHERE run_id IN ({marks}) ORDER BY ALL", list(runs))
            for t in ("runs", "metrics", "checkpoints")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL of a real process group")
def test_rlhf_killed_during_rl_resumes_without_redoing_sft_or_rm(prefect_api, local_credentials, tmp_path):
    from prefect.settings import PREFECT_API_URL

    hh = str(synthetic_file("dialogues"))
    store = tmp_path / "store"
    env = dict(
        os.environ, PREFECT_API_URL=PREFECT_API_URL.value()
    )  # the session's Prefect API: no start-up per command
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_TINKER_HOME=str(tmp_path / "home"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    log = open(tmp_path / "first.log", "wb")
    proc = subprocess.Popen(_args(store, local_credentials.local_root, hh), stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:  # kill it once the RL stage has a checkpoint after step 1
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the RL stage did not checkpoint in time"
            if (store / "training" / "checkpoints" / "run_id=pipe-rl").exists():
                rows = _sql(store, "SELECT max(step) AS s FROM checkpoints WHERE run_id = 'pipe-rl' AND kind = 'state'")
                if rows and rows[0]["s"] is not None and rows[0]["s"] >= 1:
                    break
            time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
    status = {r["run_id"]: r["status"] for r in _sql(store, "SELECT run_id, status FROM runs")}
    assert status == {"pipe-sft": "completed", "pipe-rm": "completed", "pipe-rl": "running"}  # killed inside RL
    before = _snapshot(store, ("pipe-sft", "pipe-rm"))
    killed_at = _sql(store, "SELECT max(step) AS s FROM checkpoints WHERE run_id = 'pipe-rl' AND kind = 'state'")[0][
        "s"
    ]
    assert killed_at is not None, "the RL stage was killed before its first state checkpoint"
    assert killed_at < 4, "the RL stage finished before the kill"  # 4 steps: killed mid-stage

    again = subprocess.run(_args(store, local_credentials.local_root, hh), capture_output=True, text=True, env=env,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    out = json.loads(again.stdout[again.stdout.index("{"):])
    assert {k: v["status"] for k, v in out["stages"].items()} == {"sft": "skipped", "rm": "skipped", "rl": "ran"}
    assert f"resuming run pipe-rl after its checkpoint at step {killed_at}" in again.stderr
    assert _snapshot(store, ("pipe-sft", "pipe-rm")) == before  # SFT and RM untouched: not redone
    runs = _sql(store, "SELECT run_id, status, config_json FROM runs ORDER BY run_id")
    assert [(r["run_id"], r["status"]) for r in runs] == [("pipe-rl", "completed"), ("pipe-rm", "completed"),
                                                          ("pipe-sft", "completed")]
    rl_config = json.loads(runs[0]["config_json"])
    assert rl_config["load_checkpoint_path"] == out["sft_state"] and out["sft_state"].endswith(
        "/weights/pipe-sft-step-000002"
    )
    assert rl_config["env_options"]["reward_model"] == out["reward_model"] == out["stages"]["rm"]["sampler_path"]
    assert _sql(store, "SELECT run_id, step, name, count(*) AS n FROM metrics GROUP BY ALL HAVING n > 1") == []
    steps = lambda name: [r["step"] for r in _sql(store, "SELECT step FROM metrics WHERE run_id = 'pipe-rl' AND "  # noqa: E731
                                                         "name = ? ORDER BY step", [name])]
    assert steps("env/win_minus_loss") == steps("env/format_rate") == [0, 1, 2, 3]
    assert steps("eval/win_rate") == [0, 4] and out["first_win_rate"] == 0.5  # step 0: the SFT model itself
    states = _sql(store, "SELECT step FROM checkpoints WHERE run_id = 'pipe-rl' AND kind = 'state' ORDER BY step")
    assert [r["step"] for r in states] == [1, 2, 3, 4]

    # the SFT stage changed: it continues to step 3, the reward model is skipped, and the RL run
    # (started from the old SFT state) is refused instead of silently training the old policy
    changed = subprocess.run(_args(store, local_credentials.local_root, hh, sft_steps=3), capture_output=True,
                             text=True, env=env, timeout=900)
    assert changed.returncode == 1
    assert "stage rl: run 'pipe-rl' was started with load_checkpoint_path=" in changed.stderr
    assert "stage rm: run pipe-rm already completed with this config and data; skipped" in changed.stderr
    assert _sql(store, "SELECT max(step) AS s FROM checkpoints WHERE run_id = 'pipe-sft'")[0]["s"] == 3
    assert _snapshot(store, ("pipe-rm",)) == {k: [r for r in v if r["run_id"] == "pipe-rm"] for k, v in before.items()}


def test_rlhf_config_refuses_shared_fields_in_sections(tmp_path):
    from prefect_tinker.flows.rlhf import RLHFConfig

    hh = str(synthetic_file("dialogues"))
    with pytest.raises(
        ValueError, match=r"sft\.model: set model at the top level.*rl\.load_checkpoint_path: filled in"
    ):
        RLHFConfig(rm={"dataset": hh}, sft={"model": "smollm2"}, rl={"load_checkpoint_path": "tinker://x/weights/y"})
    with pytest.raises(ValueError, match=r"rl\.env_options\.reward_model: filled in by the pipeline"):
        RLHFConfig(rm={"dataset": hh}, rl={"env_options": {"reward_model": "base:tiny"}})
    with pytest.raises(ValueError, match="rm.dataset: required"):
        RLHFConfig()
    c = RLHFConfig(model="tiny", run_name="p", store=str(tmp_path), lora_rank=4, seed=3,
                   rm={"dataset": hh, "format": "dialogue", "question": "Better, A or B?"},
                   rl={"env_options": {"matchup_size": 2}})
    sft, rm = c.sft_config(), c.rm_config()
    assert (sft.run_name, rm.run_name, sft.lora_rank, rm.seed, sft.store) == ("p-sft", "p-rm", 4, 3, str(tmp_path))
    rl = c.rl_config("tinker://s/weights/p-sft-step-000002", "tinker://r/sampler_weights/p-rm-step-000002")
    assert rl.run_name == "p-rl" and rl.load_checkpoint_path == "tinker://s/weights/p-sft-step-000002"
    assert rl.dataset == hh and rl.env == "pairwise_preference"
    assert rl.model_dump(mode="json")["env_options"] == {"matchup_size": 2, "format": "dialogue", "fields": {},
                              "reward_model": "tinker://r/sampler_weights/p-rm-step-000002",
                              "question": "Better, A or B?", "labels": ["A", "B"]}


@pytest.mark.parametrize("recipe", ["reward_model", "rlhf"])
def test_show_config_and_hh_example_validate(recipe, capsys):
    """``show-config`` and ``run --example hh --dry-run`` of both recipes through the CLI entry
    point: the example's stage sections validate, the data path is the shared HH-RLHF file."""
    from prefect_tinker.cli.main import main

    assert main(["show-config", recipe]) == 0 and "run_name" in capsys.readouterr().out
    data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz")  # skips where the example's data is not found
    assert main(["run", recipe, "--example", "hh", "--dry-run"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    rm = cfg if recipe == "reward_model" else cfg["rm"]
    assert cfg["model"] == "tiny" and rm["format"] == "dialogue"
    assert rm["dataset"].endswith("prefs/hh_rlhf_harmless_base_test.jsonl.gz")
    if recipe == "rlhf":
        assert (cfg["sft"]["max_steps"], rm["max_steps"], cfg["rl"]["max_steps"]) == (20, 40, 10)
        assert cfg["rl"]["env"] == "pairwise_preference" and cfg["sft"]["dataset"]  # default: the bundled chats
