"""A plugin package extends prefect-tinker through entry points only (docs/recipes.md).

``tests/plugins/demo_plugin`` is installed into a temporary folder (its package files plus the
``.dist-info`` metadata an installer writes: ``METADATA`` and ``entry_points.txt`` from its
``pyproject.toml``), put on ``PYTHONPATH`` of ``prefect-tinker`` command-line processes, and run:
a new RL environment (``subtraction``, one file plus an example config), a new loss
(``symmetric_ppo``, one class), a new advantage estimator (``mean_only``), a new benchmark
(``differences``) and a new recipe (``memorize``, one folder). The dev environment never sees the plugin.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prefect_tinker.cli.main import main as cli_main

PLUGIN = Path(__file__).resolve().parent / "plugins" / "demo_plugin"


def install_plugin(target: Path) -> None:
    """Install the plugin's files into ``target`` as an installer lays out a pure-Python
    distribution: the package folder and ``<name>-<version>.dist-info`` (``METADATA``,
    ``entry_points.txt``: the groups of ``[project.entry-points]``)."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    shutil.copytree(PLUGIN / "demo_plugin", target / "demo_plugin")
    dist = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
        for group, eps in project["entry-points"].items()))


@pytest.fixture(scope="module")
def plugin_cli(tmp_path_factory, local_credentials, prefect_api):
    """``run(*argv) -> stdout`` of ``prefect-tinker`` in a process that has the plugin installed,
    against this session's Prefect API and local server; and the store folder."""
    from prefect.settings import PREFECT_API_URL

    site = tmp_path_factory.mktemp("plugin-site")
    install_plugin(site)
    home = tmp_path_factory.mktemp("plugin-home")
    store = home / "store"
    env = {**os.environ, "PYTHONPATH": str(site), "PREFECT_API_URL": PREFECT_API_URL.value(),
           "PREFECT_TINKER_HOME": str(home), "PREFECT_TINKER_STORE": str(store), "HF_HUB_OFFLINE": "1"}
    local_root = f"backend.local_root={local_credentials.resolved_local_root()}"

    def run(*argv: str) -> str:
        args = [*argv, local_root] if argv[0] == "run" else list(argv)
        proc = subprocess.run([sys.executable, "-m", "prefect_tinker.cli.main", *args], env=env, cwd=home,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, \
            f"prefect-tinker {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def sql(query: str) -> list[dict]:  # reading the store needs no plugin: in this process
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
        return json.loads(out.getvalue())

    return run, sql, site


def test_plugin_components_are_listed_but_not_installed_here(plugin_cli):
    run, _, _ = plugin_cli
    listing = run("ls")
    assert "memorize" in listing and "subtraction" in listing and "tiny" in listing
    from prefect_tinker.flows.registry import RECIPES
    from prefect_tinker.recipes.rl.envs import ENVS

    assert "memorize" not in RECIPES and "subtraction" not in ENVS  # the dev environment is untouched


def test_ls_lists_each_registry_with_the_plugin_components(tmp_path):
    """``python -m prefect_tinker ls --all`` in a process that has the plugin installed: one line per
    registry, the plugin's benchmark, loss and estimator among the built-ins (no Prefect API needed)."""
    site = tmp_path / "site"
    site.mkdir()
    install_plugin(site)
    root = Path(__file__).resolve().parent.parent  # this checkout's prefect_tinker, not another install's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "prefect_tinker", "ls", "--all", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = {r["registry"]: (r["group"], r["names"]) for r in json.loads(proc.stdout)["registries"]}
    assert listed["benchmarks"] == ("prefect_tinker.benchmarks", sorted(listed["benchmarks"][1]))
    assert {"differences", "gsm8k"} <= set(listed["benchmarks"][1])
    assert {"symmetric_ppo", "ppo"} <= set(listed["RL losses"][1])
    assert {"mean_only", "group_mean"} <= set(listed["advantage estimators"][1])
    assert {"sync", "async"} <= set(listed["RL schedules"][1])
    assert {"judge", "sandbox"} <= set(listed["services"][1])
    assert {"jsonl", "parquet"} <= set(listed["file types"][1])


def test_ls_lists_a_component_registered_in_process(monkeypatch, capsys):
    from prefect_tinker.recipes.evals.benchmarks import BENCHMARKS

    monkeypatch.setitem(BENCHMARKS, "zz_trivia", {"source": {"path": "trivia.jsonl"}})
    assert cli_main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(x for x in lines if x.startswith("benchmarks (prefect_tinker.benchmarks): "))
    assert line.endswith(", zz_trivia") and "gsm8k" in line
    assert any(x.startswith("RL schedules and services: prefect-tinker ls --all") for x in lines)
    assert not any(x.startswith("services (") for x in lines)  # they import Prefect: with --all only


def test_python_m_prefect_tinker_is_the_command_line():
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "prefect_tinker", "--help"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: prefect-tinker"), proc.stderr[-2000:]


def test_plugin_env_loss_and_estimator_run_rl(plugin_cli):
    """The plugin's env trains with its loss and estimator; ``symmetric_ppo`` with epsilon 0.25 and
    ``mean_only`` give the same rows, bit for bit, as the built-in ``ppo`` with clip thresholds
    0.75/1.25 and ``group_mean`` (the same server loss and config, the same advantages)."""
    run, sql, site = plugin_cli
    config = str(site / "demo_plugin" / "subtraction.yaml")
    run("run", "rl", "--config", config, "run_name=plugin", "loss_fn=symmetric_ppo", "loss_options.epsilon=0.25",
        "advantage_estimator=mean_only")
    run("run", "rl", "--config", config, "run_name=builtin", "loss_fn=ppo", "clip_low_threshold=0.75",
        "clip_high_threshold=1.25")
    rows = sql("SELECT run_id, step, name, value FROM metrics WHERE run_id IN ('plugin', 'builtin') "
               "AND name NOT LIKE 'time/%' AND name NOT LIKE '%seconds%' AND name NOT LIKE '%per_s%' ORDER BY ALL")
    by_run = {r: {(x["step"], x["name"]): x["value"] for x in rows if x["run_id"] == r} for r in ("plugin", "builtin")}
    assert by_run["plugin"] and by_run["plugin"] == by_run["builtin"]
    assert {"env/reward_mean", "train/loss_sum"} <= {n for _, n in by_run["plugin"]}
    prompts = sql("SELECT prompt FROM trajectories WHERE run_id = 'plugin'")
    assert prompts and all(" - " in p["prompt"] for p in prompts)  # the plugin's problems
    stored = sql("SELECT config_json FROM runs WHERE run_id = 'plugin' AND config_json IS NOT NULL")
    assert json.loads(stored[-1]["config_json"])["loss_options"] == {"epsilon": 0.25}
    assert json.loads(stored[-1]["config_json"])["env_options"] == {"max_operand": 5}  # as the config gave them


def test_plugin_env_options_are_a_branch_of_the_tagged_union(plugin_cli):
    """``env_options`` is typed by the environment ``env`` names: the JSON schema of the RL config,
    printed in a process that has the plugin, has a branch for the plugin's environment, and a JSON
    Schema validator applies it to the plugin's example config."""
    import jsonschema
    import yaml

    run, _, site = plugin_cli
    schema = json.loads(run("show-config", "rl", "--schema"))
    branches = {b["if"]["properties"]["env"]["const"]: b["then"]["properties"]["env_options"]
                for b in schema["allOf"] if "properties" in b["if"]}  # (and one branch for env left out: arithmetic)
    assert {"arithmetic", "math", "tictactoe", "subtraction"} <= set(branches)
    options = schema["$defs"][branches["subtraction"]["$ref"].rsplit("/", 1)[-1]]
    assert set(options["properties"]) == {"max_operand"} and options["additionalProperties"] is False
    example = yaml.safe_load((site / "demo_plugin" / "subtraction.yaml").read_text())
    jsonschema.validate(example, schema)
    for bad in ({"max_operand": 0}, {"max_operandd": 5}, {"max_operand": 5, "reward": "partial"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**example, "env_options": bad}, schema)
    jsonschema.validate({**example, "env": "arithmetic", "env_options": {"max_operand": 5, "reward": "partial"}},
                        schema)  # arithmetic's options: its branch, not subtraction's


def test_plugin_benchmark_runs_in_the_eval_flow(plugin_cli):
    """The plugin's benchmark (a dict of BenchmarkSpec fields naming its own JSONL file) runs by name:
    one sample per question of the file, the reference its answer, and the stored accuracy is the mean
    of the samples' grades."""
    run, sql, site = plugin_cli
    config = site / "eval_differences.yaml"
    config.write_text("model: tiny\nrun_name: plugin-eval\nbenchmarks:\n  - benchmark: differences\n")
    run("run", "eval", "--config", str(config))
    samples = sql("SELECT example_id, reference, correct FROM eval_samples WHERE run_id = 'plugin-eval' "
                  "AND eval_name = 'differences' ORDER BY example_id")
    answers = [json.loads(line)["answer"] for line in (site / "demo_plugin" / "differences.jsonl").open()]
    assert [s["reference"] for s in samples] == answers
    accuracy = sql("SELECT value FROM eval_results WHERE run_id = 'plugin-eval' AND eval_name = 'differences' "
                   "AND metric = 'accuracy'")
    assert accuracy and accuracy[-1]["value"] == sum(s["correct"] for s in samples) / len(samples)


def test_plugin_recipe_runs_from_its_example(plugin_cli):
    run, sql, _ = plugin_cli
    run("run", "memorize", "--example", "tiny", "run_name=mem")
    loss = [r["value"] for r in sql("SELECT step, value FROM metrics WHERE run_id = 'mem' AND name = 'train/loss' "
                                    "ORDER BY step")]
    assert len(loss) == 4 and loss[-1] < loss[0]  # four steps on one sentence: the loss falls
    assert sql("SELECT status FROM runs WHERE run_id = 'mem' ORDER BY time DESC LIMIT 1") == [{"status": "completed"}]


def test_a_broken_plugin_beside_a_good_one(tmp_path):
    """A second installed plugin whose recipe module does not import: ``prefect-tinker ls`` (a
    listing it may concern) fails with one line naming its entry point, the same in every process;
    the demo plugin's recipe still resolves by name."""
    install_plugin(tmp_path)
    (tmp_path / "broken_plugin.py").write_text("import a_dependency_that_is_not_installed\n")
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prefect_tinker.recipes]\nbroken = broken_plugin:RECIPE\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PREFECT_TINKER_HOME": str(tmp_path / "home")}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefect_tinker.cli.main", *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    listing = cli("ls")
    assert listing.returncode == 1 and listing.stdout == ""
    assert listing.stderr == ("error: entry point broken = 'broken_plugin:RECIPE' of group prefect_tinker.recipes "
                              "does not import: ModuleNotFoundError: No module named "
                              "'a_dependency_that_is_not_installed'\n")
    shown = cli("show-config", "memorize")
    assert shown.returncode == 0, shown.stderr
    assert "text:" in shown.stdout  # the demo plugin's config model, printed as YAML defaults
