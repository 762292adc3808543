"""Examples that need an earlier run name it (`teacher=run:NAME`, `model=run:NAME`): a run that is
not in the store is one line before anything starts; a run that is resolves to its last checkpoint
(sampler weights preferred at that step)."""

from __future__ import annotations

import json

import pytest

from prefect_tinker.cli import main as cli
from tinker_blocks.store_io import ParquetStore
from tinker_blocks.store_schemas import TRAINING_TABLES


@pytest.mark.parametrize("recipe,example,field", [("distill", "on_policy", "teacher"),
                                                  ("distill", "off_policy", "teacher"),
                                                  ("eval", "suite", "model")])
def test_example_needing_a_run_names_it(recipe, example, field, tmp_path, capsys):
    store = tmp_path / "store"
    rc = cli.main(["run", recipe, "--example", example, f"store={store}", "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err == (f"error: invalid data for flow {recipe!r}: {field}=run:sft-teacher: the training store {store} "
                   f"does not exist (train it first, e.g. prefect-tinker run sft --example tiny run_name=sft-teacher "
                   f"store={store})\n")

    io = ParquetStore(str(store), "training", TRAINING_TABLES)
    with io.writer("checkpoints") as w:  # another run only: still one line, naming the run
        w.write(run_id="other", step=5, name="s5", kind="state", path="tinker://o/weights/s5")
    assert cli.main(["run", recipe, "--example", example, f"store={store}", "--dry-run"]) == 2
    assert f"has no checkpoint of run 'sft-teacher'" in capsys.readouterr().err

    with io.writer("checkpoints") as w:
        for step, kind in ((10, "state"), (10, "sampler"), (30, "state"), (30, "sampler"), (20, "state")):
            folder = "sampler_weights" if kind == "sampler" else "weights"
            w.write(run_id="sft-teacher", step=step, name=f"s{step}", kind=kind, path=f"tinker://t/{folder}/s{step}")
    assert cli.main(["run", recipe, "--example", example, f"store={store}", "--dry-run"]) == 0
    config = json.loads(capsys.readouterr().out)
    if recipe == "distill":
        from prefect_tinker.flows.distill_config import DistillConfig

        (teacher,) = DistillConfig.model_validate(config).resolved_teachers()
        assert config["teacher"]["weights"] == "run:sft-teacher" and teacher.weights == "tinker://t/sampler_weights/s30"
