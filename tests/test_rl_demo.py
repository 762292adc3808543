"""scripts/rl_arithmetic_demo.py end to end on the tiny model (no SFT; a second run starting from
the first run's weights), on a private embedded server that the script stops at the end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from tinker_blocks.stores import TrainingStore

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rl_arithmetic_demo.py"


def _demo_module():
    spec = importlib.util.spec_from_file_location("rl_arithmetic_demo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_without_sft_then_from_its_checkpoint(prefect_api, tmp_path, capsys):
    demo = _demo_module()
    root, store = tmp_path / "server", str(tmp_path / "store")
    common = ["--max-operand", "9", "--group-size", "2", "--groups-per-batch", "2", "--eval-problems", "4",
              "--few-shot", "--system-prompt", "Reply with the number only.", "--max-tokens", "4",
              "--local-root", str(root), "--store", store]
    first = demo.main(["--sft-steps", "0", "--rl-steps", "2", "--tag", "first", *common])

    rl = first["rl"]
    assert rl["steps"] == 2 and len(rl["reward_per_step"]) == 2
    assert all(-0.1 - 1e-9 <= r <= 1.0 + 1e-9 for r in rl["reward_per_step"])
    assert abs(rl["reward_mean_first_2"] - float(np.mean(rl["reward_per_step"]))) < 1e-3  # per-step values are rounded
    for key in ("greedy_accuracy_before_rl", "greedy_accuracy_after_rl"):
        assert first[key] * 4 == round(first[key] * 4) and 0.0 <= first[key] <= 1.0
    assert not (root / "server.json").exists(), "the script must stop the server it started under --local-root"

    # the options reached the env: system prompt and the few-shot turn precede every question
    prompts = [r["prompt"] for r in TrainingStore(root=store).query(
        "SELECT prompt FROM trajectories WHERE run_id = ?", [rl["run_name"]])]
    assert prompts and all("Reply with the number only." in p and "What is 4 + 5?" in p for p in prompts)

    # start a second RL run from the first run's final weights (a restarted server on the same root):
    # its starting greedy accuracy is the first run's final one (same weights, same problems, temperature 0)
    state = TrainingStore(root=store).last_checkpoint(rl["run_name"], kind="state")
    assert state["step"] == 2 and "/weights/" in state["path"]
    second = demo.main(["--init-checkpoint", state["path"], "--rl-steps", "1", "--tag", "second", *common])
    assert "sft" not in second
    assert second["greedy_accuracy_before_rl"] == first["greedy_accuracy_after_rl"]
    assert not (root / "server.json").exists()
