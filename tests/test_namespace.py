"""Nothing generic is installed: the package lives in ``prefect_tinker`` (plus the specific
``tinker_blocks`` and ``tinker_local``), so the CLI and the flows run from a Prefect user's project
that has its own ``tasks.py``, ``flows/`` and ``recipes/``. (The deployment case is in
tests/test_deployments.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.user_project import make_user_project

BIN = Path(sys.executable).parent


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # pytest's rootdir is not the user's
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0", **extra)
    return env


def test_no_generic_top_level_names_are_installed(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("tasks", "flows", "recipes", "configs"):
        res = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=empty, env=_env(), capture_output=True, text=True
        )
        assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr, (name, res.stderr)
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import prefect_tinker.flows.sft, tinker_blocks, tinker_local; print(prefect_tinker.flows.sft.__name__)",
        ],
        cwd=empty,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout.strip() == "prefect_tinker.flows.sft", res.stderr


def test_cli_and_flow_run_from_a_users_project(prefect_api, local_credentials, tmp_path):
    from prefect.settings import PREFECT_API_URL

    project = make_user_project(tmp_path / "project")
    env = _env(PREFECT_API_URL=PREFECT_API_URL.value(), PREFECT_TINKER_HOME=str(tmp_path / "home"))
    common = ["model=tiny", "batch_size=2", "max_steps=2", "lora_rank=4", "num_eval_samples=0", "eval_every=0",
              f"store={tmp_path / 'store'}", f"backend.local_root={local_credentials.local_root}"]
    res = subprocess.run([str(BIN / "prefect-tinker"), "run", "sft", "run_name=from-cli", *common], cwd=project,
                         env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads(res.stdout[res.stdout.index("{"):])["steps"] == 2
    code = ("from prefect_tinker.flows.sft import SFTConfig, sft_flow; "
            f"print(sft_flow(SFTConfig(run_name='from-python', model='tiny', batch_size=2, max_steps=2, lora_rank=4, "
            f"num_eval_samples=0, eval_every=0, store={str(tmp_path / 'store')!r}, "
            f"backend={{'local_root': {str(local_credentials.local_root)!r}}}))['steps'])")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("2"), res.stdout[-2000:] + res.stderr[-3000:]
    res = subprocess.run(
        [str(BIN / "prefect-tinker"), "ls", "--json"], cwd=project, env=env, capture_output=True, text=True
    )
    listed = json.loads(res.stdout)
    assert {"sft", "rl", "dpo"} <= {r["recipe"] for r in listed["recipes"]}
    assert {"arithmetic", "gsm8k", "math"} <= {e["env"] for e in listed["envs"]}


@pytest.mark.parametrize("recipe", ["sft", "rl", "dpo"])
def test_show_config_and_examples_from_the_registry(recipe, tmp_path, capsys):
    from prefect_tinker.cli.examples import example_inputs
    from prefect_tinker.cli.main import main
    from prefect_tinker.flows.registry import example_configs

    assert main(["show-config", recipe]) == 0 and "run_name" in capsys.readouterr().out
    for name in example_configs(recipe):
        if example_inputs(recipe, name, example_configs(recipe)[name]).missing():
            continue  # its data file (or SmolLM2) is not here: `run` says so in one line (tests/test_example_data.py)
        assert main(["run", recipe, "--example", name, "--dry-run"]) == 0, name
        # the embedded default's tiny model, or SmolLM2-135M-Instruct where the example must learn
        # something in minutes (rl/arithmetic: a random tiny model never answers with a number)
        declared = re.search(r"^model: (\S+)", example_configs(recipe)[name].read_text(), re.M)
        assert declared is not None and declared[1] in ("tiny", "smollm2"), name
        assert json.loads(capsys.readouterr().out)["model"] == declared[1]


def test_prefect_yaml_deployments_come_from_the_registry(capsys):
    """The committed prefect.yaml is what `prefect-tinker deployments` makes from the registry."""
    from prefect_tinker.cli.main import main

    root = Path(__file__).resolve().parents[1]
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(["deployments"]) == 0
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out == (root / "prefect.yaml").read_text(), \
        "prefect.yaml is out of date: run `prefect-tinker deployments --write prefect.yaml`"
