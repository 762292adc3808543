"""A run name belongs to one recipe, and the CLI's listings say which: another recipe's run of the same
name is refused in one line; ``runs`` has a recipe column; default names start with the recipe;
``checkpoints`` prints whole ``tinker://`` paths."""

from __future__ import annotations

import json

from prefect_tinker.cli.main import main as cli_main
from tinker_blocks.stores import TrainingStore


def test_default_run_names_say_the_recipe():
    from prefect_tinker.flows.decisions import DecisionsConfig
    from prefect_tinker.flows.dpo import DPOConfig
    from prefect_tinker.flows.rl import RLConfig
    from prefect_tinker.flows.sft import SFTConfig

    assert SFTConfig(model="tiny").run_name.startswith("sft-tiny-")
    assert DPOConfig(model="tiny", dataset="builtin:example_prefs").run_name.startswith("dpo-tiny-")
    assert RLConfig(model="tiny").run_name.startswith("rl-arithmetic-tiny-")
    assert DecisionsConfig(model="tiny", choices=["a", "b"]).run_name.startswith("decisions-tiny-")


def test_a_name_of_another_recipe_is_one_line_and_the_listings_show_recipe_and_paths(
        prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    common = [f"store={store}", f"backend.local_root={local_credentials.local_root}", "run_name=intr2", "max_steps=1",
              "save_every=0", "eval_every=0", "--quiet"]
    assert cli_main(["run", "sft", "--example", "tiny", "num_eval_samples=1", "test_size=1", *common]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["samples"]) == 1  # from the random-init tiny model, which the result says
    assert result["samples_note"].startswith("'tiny' is a random-init test model (no pretraining)")

    assert cli_main(["run", "dpo", "--example", "tiny", *common]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "error: flow 'dpo' failed: ResumeConfigError: intr2 is an sft run; give this dpo run another run_name"), err
    assert "allow_config_change" not in err
    ts = TrainingStore(root=str(store))
    assert ts.get_run("intr2")["status"] == "completed"  # the sft run's row untouched

    assert cli_main(["runs", "--store", str(store), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["run_id"], row["recipe"], row["status"], row["steps_done"]) == ("intr2", "sft", "completed", 1)
    assert cli_main(["runs", "--store", str(store)]) == 0
    head, _, line, *_ = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in head.split("|")][:3] == ["run_id", "recipe", "status"]
    assert [c.strip() for c in line.split("|")][:3] == ["intr2", "sft", "completed"]

    assert cli_main(["sql", "--store", str(store), "--json",  # the example of `sql --help`, on this run
                     "SELECT step, value FROM metrics WHERE name = 'train/loss'"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1

    assert cli_main(["checkpoints", "intr2", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    paths = [r["path"] for r in ts.query("SELECT path FROM checkpoints WHERE run_id = 'intr2'")]
    assert paths and all(len(p) > 60 and f" {p} " in f"{out.replace('|', ' ')} " for p in paths), out


def test_ls_and_sql_help_show_whole_names_that_exist(capsys):
    assert cli_main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "humaneval, numerics_check" in out and "verifiers_reverse_word" in out
    assert cli_main(["sql", "--help"]) == 0
    assert "WHERE name = 'train/loss'" in " ".join(capsys.readouterr().out.split())  # a metric every SFT run has
