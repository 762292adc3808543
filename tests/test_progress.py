"""Live progress in the terminal (prefect_tinker/recipes/progress.py, the step loop, `prefect-tinker run --quiet |
--json-progress`): the lines carry the values the run writes to its store."""

from __future__ import annotations

import io
import json

from prefect_tinker.cli import main as cli
from prefect_tinker.recipes.progress import PROGRESS_ENV, StepProgress, phase


def test_step_lines_and_phases_format(monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "lines")
    out = io.StringIO()
    p = StepProgress("sft", "r1", total=4, start=1, stream=out)
    p.update(2, {"train/loss": 2.5, "train/tokens": 100, "test/nll": 3.25, "train/learning_rate": 1e-3})
    (line,) = out.getvalue().splitlines()
    fields = line.split("  ")
    assert fields[:5] == ["SFT r1", "step 2/4", "loss 2.5000", "test_nll 3.2500", fields[4]]
    assert (
        fields[4].startswith("tok/s ") and fields[5].startswith("elapsed 0:00:0") and fields[6].startswith("ETA 0:00:0")
    )
    assert "learning_rate" not in line  # only the key metrics
    out = io.StringIO()
    with phase("r1", "final sampling (3 prompts)", stream=out):
        pass
    assert out.getvalue().splitlines() == ["r1: final sampling (3 prompts) ...",
                                           "r1: final sampling (3 prompts) done in 0:00:00"]
    monkeypatch.setenv(PROGRESS_ENV, "off")
    out = io.StringIO()
    StepProgress("sft", "r1", 4, stream=out).update(1, {"train/loss": 1.0})
    with phase("r1", "x", stream=out):
        pass
    assert out.getvalue() == ""


def _losses(capsys, store, run):
    capsys.readouterr()
    assert cli.main(["sql", "--store", str(store), "--json", "SELECT step, value FROM metrics WHERE "
                     f"run_id = '{run}' AND name = 'train/loss' ORDER BY step"]) == 0
    return {r["step"]: r["value"] for r in json.loads(capsys.readouterr().out)}


def test_cli_progress_lines_carry_the_stored_losses(prefect_api, local_credentials, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    store = tmp_path / "store"
    common = ["sft", "model=tiny", "batch_size=2", "max_steps=3", "learning_rate=1e-3", "lora_rank=4",
              "eval_every=0", "save_every=0", "num_eval_samples=1", f"store={store}",
              f"backend.local_root={local_credentials.local_root}"]
    capsys.readouterr()
    # human-readable lines (the default)
    assert cli.main(["run", *common, "run_name=prog-lines"]) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [ln for ln in err if ln.startswith("SFT prog-lines  step ")]
    losses = _losses(capsys, store, "prog-lines")
    assert len(steps) == 3 and len(losses) == 3
    for done, ln in enumerate(steps, start=1):  # the line after update `done` shows the loss stored at done - 1
        assert ln.startswith(f"SFT prog-lines  step {done}/3  loss {losses[done - 1]:.4f}  "), ln
        assert "tok/s " in ln and "elapsed " in ln and "ETA " in ln
    for name in ("preparing the dataset", "final sampling (1 prompts)"):
        assert any(ln.startswith(f"prog-lines: {name}") and " done in " in ln for ln in err), name

    # machine-readable
    assert cli.main(["run", *common, "run_name=prog-json", "--json-progress"]) == 0
    events = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.startswith('{"event"')]
    losses = _losses(capsys, store, "prog-json")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and all(e["total"] == 3 and e["run"] == "prog-json" for e in steps)
    assert [e["metrics"]["train/loss"] for e in steps] == [losses[0], losses[1], losses[2]]  # exact floats
    assert steps[-1]["eta_s"] == 0 and all(e["tokens_per_s"] > 0 for e in steps)
    phases = [(e["event"], e["phase"]) for e in events if e["event"].startswith("phase_")]
    assert ("phase_end", "final sampling (1 prompts)") in phases

    # quiet: no progress at all
    assert cli.main(["run", *common, "run_name=prog-quiet", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "prog-quiet  step" not in err and '"event"' not in err and "prog-quiet: " not in err
    assert len(_losses(capsys, store, "prog-quiet")) == 3
