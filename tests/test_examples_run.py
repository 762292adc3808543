"""Every shipped example config (``prefect_tinker/configs/<recipe>/<name>.yaml``, what ``prefect-tinker ls`` lists)
runs through ``prefect-tinker run RECIPE --example NAME`` in a short mode: the example's own config
with the step count capped (and batch, group, token and turn counts cut where a step would take long
on the tiny model), on the session's embedded server. Each run must finish and leave its rows in the
store, with values that an untrained first step fixes (``check_short_run``): training metrics
(``metrics``), evaluation results (``eval_results``) or, for an export, the exported files.
Examples that need an earlier run (``teacher=run:sft-teacher``, ``model=run:sft-teacher``,
an export's checkpoint) take it from the run the module fixture trains first with ``sft --example tiny``.

Whether the examples *learn* is not checked here (docs/training.md has the arithmetic example's
measured reward curve)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from prefect_tinker.cli.main import main as cli_main
from tests.conftest import ROOT
from prefect_tinker.cli.examples import example_inputs, smollm2_installed
from tests.data_files import data_file, word_problems, write_jsonl
from tinker_blocks.stores import TrainingStore

EXAMPLES = sorted((p.parent.name, p.stem) for p in (ROOT / "prefect_tinker" / "configs").glob("*/*.yaml"))
TEACHER = "sft-teacher"  # the run the examples needing an earlier run name
TINY_VOCAB = 2048  # the tiny preset's vocabulary
RL_SHORT = ["max_steps=1", "group_size=2", "groups_per_batch=2", "max_tokens=8", "save_every=0"]

#: Overrides that make each example one short step (or a few examples), on top of its own config.
SHORT: dict[tuple[str, str], list[str]] = {
    ("decisions", "tiny"): ["max_steps=1", "max_records=12", "test_size=4", "eval_every=0", "save_every=0"],
    ("distill", "off_policy"): [
        "max_steps=1",
        "max_problems=4",
        "batch_size=2",
        "teacher_max_tokens=8",
        "keep_truncated=true",
    ],
    ("distill", "on_policy"): ["max_steps=1", "group_size=2", "groups_per_batch=2", "max_tokens=8", "save_every=0"],
    ("distill", "prompt"): [
        "max_steps=1",
        "max_problems=6",
        "batch_size=2",
        "test_size=2",
        "eval_every=0",
        "save_every=0",
    ],
    ("distill", "sdft"): ["max_steps=1", "group_size=2", "groups_per_batch=1", "max_tokens=8", "save_every=0"],
    ("dpo", "hh_rlhf"): [
        "max_steps=1",
        "max_records=200",
        "batch_size=2",
        "test_size=2",
        "max_length=128",
        "save_every=0",
    ],
    ("dpo", "tiny"): ["max_steps=1", "batch_size=2", "test_size=2", "save_every=0"],
    ("eval", "arithmetic"): ["limit=2"],
    ("eval", "checkpoint"): ["limit=2"],
    ("eval", "suite"): ["limit=2", "max_tokens=8"],  # + local gsm8k / MATH files (the test below)
    ("export", "merged"): [],  # + checkpoint and out (the test below)
    ("export", "peft"): [],
    # + captures rated in the store (the test below): one training step, two examples per evaluation
    ("flywheel", "tiny"): ["limit=2", "min_examples=2", "training.max_steps=1", "training.batch_size=2",
                           "training.test_size=0", "training.save_every=0"],
    ("promote", "candidate"): ["limit=2"],
    ("reward_model", "hh"): [
        "max_steps=1",
        "max_records=200",
        "batch_size=2",
        "test_size=2",
        "max_length=128",
        "save_every=0",
    ],
    ("rl", "arithmetic"): RL_SHORT,
    ("rl", "calculator"): [*RL_SHORT, "env_options.max_turns=2"],
    ("rl", "forecasting"): RL_SHORT,
    ("rl", "guess_number"): [*RL_SHORT, "env_options.max_turns=2"],
    ("rl", "humaneval"): RL_SHORT,
    ("rl", "numerics_check"): [*RL_SHORT, "env_options.num_pages_min=2", "env_options.num_pages_max=2"],
    ("rl", "retrieval"): [*RL_SHORT, "env_options.max_turns=2"],
    ("rl", "rubric"): [*RL_SHORT, "env_options.judge_max_tokens=8"],
    ("rl", "tictactoe"): RL_SHORT,
    ("rl", "twenty_questions"): [*RL_SHORT, "env_options.max_turns=2"],
    ("rl", "verifiers_reverse_word"): [*RL_SHORT, "env_options.eval_examples=2"],
    ("rlhf", "hh"): [
        "sft.max_steps=1",
        "sft.save_every=0",
        "rm.max_steps=1",
        "rm.max_records=200",
        "rm.batch_size=2",
        "rm.test_size=2",
        "rm.max_length=128",
        "rm.save_every=0",
        "rl.max_steps=1",
        "rl.group_size=2",
        "rl.groups_per_batch=1",
        "rl.max_tokens=8",
        "rl.env_options.test_prompts=2",
        "rl.save_every=0",
    ],
    ("sft", "calculator_warmup"): [
        "max_steps=1",
        "max_records=12",
        "test_size=2",
        "num_eval_samples=0",
        "save_every=0",
    ],
    ("sft", "tiny"): ["max_steps=1", "num_eval_samples=0", "save_every=0"],
}


def _sql(capsys, store: Path, query: str) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def example_store(prefect_api, local_credentials, tmp_path_factory):
    """A store holding run ``sft-teacher`` (one step of ``sft --example tiny``)."""
    store = tmp_path_factory.mktemp("examples") / "store"
    rc = cli_main(
        [
            "run",
            "sft",
            "--example",
            "tiny",
            *SHORT["sft", "tiny"],
            f"run_name={TEACHER}",
            f"store={store}",
            f"backend.local_root={local_credentials.local_root}",
            "--quiet",
        ]
    )
    assert rc == 0
    return store


def _rated_captures(store: Path) -> None:
    """Chat captures of the last hour, as capture serve and POST /v1/feedback write them: two
    questions, each answered twice (n=2), one answer rated good and one bad -- two comparisons, so
    the flywheel (method auto) trains DPO."""
    from tinker_blocks.stores import CaptureStore

    captures = CaptureStore(root=str(store))
    rows = [{"run_id": "ex-traffic", "request_id": f"chatcmpl-ex{i}", "sequence_index": j,
             "endpoint": "chat.completions", "model": "tiny", "checkpoint": "tiny", "finish_reason": "stop",
             "prompt": json.dumps([{"role": "user", "content": f"What is {i} + {i}?"}]),
             "completion": reply, "response_json": json.dumps({"message": {"role": "assistant", "content": reply}})}
            for i in range(2) for j, reply in enumerate((f"{2 * i}", "no idea"))]
    captures.write_rows("captures", rows)
    captures.write_rows("ratings", [{"run_id": "ex-traffic", "request_id": r["request_id"],
                                     "sequence_index": r["sequence_index"], "source": "client",
                                     "rating": 1.0 if r["sequence_index"] == 0 else -1.0} for r in rows])


def test_every_example_has_a_short_mode():
    assert sorted(SHORT) == EXAMPLES, "add the new example's short-mode overrides to SHORT"


@pytest.mark.parametrize("recipe,example", EXAMPLES, ids=[f"{r}/{e}" for r, e in EXAMPLES])
def test_example_runs_in_short_mode(recipe, example, example_store, local_credentials, tmp_path, capsys):
    inputs = example_inputs(recipe, example, ROOT / "prefect_tinker" / "configs" / recipe / f"{example}.yaml")
    for relative in inputs.data:
        data_file(relative)  # skips when the data is not found; the run resolves example-data: the same way
    if inputs.smollm2 and not smollm2_installed():
        pytest.skip("SmolLM2-135M-Instruct is not installed (prefect-tinker examples fetch smollm2)")
    run = f"ex-{recipe}-{example}".replace("_", "-")
    args = [
        "run",
        recipe,
        "--example",
        example,
        *SHORT[recipe, example],
        "--quiet",
        f"backend.local_root={local_credentials.local_root}",
    ]
    if recipe == "export":  # no run name: a checkpoint in (a tinker:// path, or run:NAME), files out
        state = TrainingStore(root=str(example_store)).last_checkpoint(TEACHER, kind="state")
        checkpoint = state["path"] if example == "merged" else f"run:{TEACHER}"
        args += [f"checkpoint={checkpoint}", f"store={example_store}", f"out={tmp_path / 'out'}"]
    elif recipe in ("promote", "flywheel"):  # no run name: a model line's runs are named by the flow
        args.append(f"store={example_store}")
        if recipe == "flywheel":
            _rated_captures(example_store)
    else:
        args += [f"run_name={run}", f"store={example_store}"]
    if (recipe, example) == ("eval", "suite"):  # the suite's benchmarks on local files (tests are offline)
        math = tmp_path / "math.jsonl"
        math.write_text(
            "".join(json.dumps({"problem": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n" for a in range(3))
        )
        gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", word_problems(4))
        args.append(
            "benchmarks="
            + json.dumps(
                [
                    {"benchmark": "gsm8k", "dataset": str(gsm8k)},
                    {"benchmark": "math", "dataset": str(math)},
                    {"benchmark": "arithmetic"},
                ]
            )
        )

    capsys.readouterr()
    assert cli_main(args) == 0, f"{recipe}/{example} failed"
    if recipe in ("promote", "flywheel"):
        out = json.loads(capsys.readouterr().out)
        rows = _sql(capsys, example_store, "SELECT alias, action FROM models WHERE line = 'assistant'")
        assert ("candidate", "set") in {(r["alias"], r["action"]) for r in rows}  # the gate judged a candidate
        assert isinstance(out["promoted"], bool)
        if recipe == "flywheel":  # the rated pairs became comparisons: DPO from the champion
            assert out["trained"] and out["snapshot"]["method"] == "dpo" and out["counts"] == {"sft": 2, "dpo": 2}
    elif recipe == "export":
        assert any((tmp_path / "out").rglob("*.safetensors")), "the export wrote no weights"
    elif recipe == "eval":  # results are filed under the evaluated run (the base model's: the eval's own name)
        evaluated = TEACHER if example == "suite" else run
        rows = _sql(capsys, example_store, f"SELECT DISTINCT eval_name FROM eval_results WHERE run_id = '{evaluated}'")
        assert {r["eval_name"] for r in rows} == (
            {"gsm8k", "math", "arithmetic"} if example == "suite" else {"arithmetic"}
        )
    else:
        check_short_run(capsys, example_store, recipe, run)


def check_short_run(capsys, store: Path, recipe: str, run: str) -> None:
    """What a one-step run must leave, by values: every run (an rlhf run's stages too) completed;
    every metric finite; training metrics of step 0 only (``max_steps=1``); the step-0 learning
    rate the config's schedule gives; and what an untrained start fixes: DPO's loss is ln 2 with
    zero margin (policy = reference), a tiny model's next-token loss is near ln(vocabulary) (its
    random weights predict almost uniformly), RL's ``env/reward_mean``/``reward_std`` are those of
    the step's trajectories in the store, the reward model's accuracy stderr is the binomial one."""
    runs: dict[str, dict] = {}
    query = f"SELECT run_id, status, config_json FROM runs WHERE run_id LIKE '{run}%' ORDER BY time"
    for r in _sql(capsys, store, query):
        runs[r["run_id"]] = {**runs.get(r["run_id"], {}), "status": r["status"],
                             **({"config": json.loads(r["config_json"])} if r["config_json"] else {})}
    assert runs and {k: v["status"] for k, v in runs.items()} == dict.fromkeys(runs, "completed"), runs
    rows = _sql(capsys, store, f"SELECT run_id, step, name, value FROM metrics WHERE run_id LIKE '{run}%'")
    assert rows, f"{run} wrote no metrics"
    bad = [r for r in rows if not math.isfinite(r["value"])]
    assert not bad, bad
    for run_id, info in runs.items():
        cfg = info.get("config", {})
        got = {(r["step"], r["name"]): r["value"] for r in rows if r["run_id"] == run_id}
        trained = {step for step, name in got if name.startswith("train/")}
        assert trained <= {0}, (run_id, sorted(trained))
        if (0, "train/learning_rate") in got:
            want = cfg["learning_rate"] / max(int(cfg.get("warmup_steps") or 0), 1)  # step 0 of any schedule
            assert got[0, "train/learning_rate"] == pytest.approx(want, rel=1e-6), run_id
        if (0, "train/dpo_loss") in got:
            assert got[0, "train/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
            assert got[0, "train/margin"] == pytest.approx(0.0, abs=1e-4)
        next_token = recipe in ("sft", "reward_model", "rlhf") or run == "ex-distill-off-policy"  # mean NLL/token
        if next_token and cfg.get("model") == "tiny" and (0, "train/loss") in got:
            assert abs(got[0, "train/loss"] - math.log(TINY_VOCAB)) < 0.5, (run_id, got[0, "train/loss"])
        if (0, "eval/rm_accuracy_stderr") in got:
            acc, n = got[0, "eval/rm_accuracy"], int(cfg["test_size"])
            assert got[0, "eval/rm_accuracy_stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / n), rel=1e-6)
        if (0, "env/reward_mean") in got and recipe == "rl":
            trajs = _sql(capsys, store, f"SELECT reward FROM trajectories WHERE run_id = '{run_id}' AND step = 0")
            rewards = [t["reward"] for t in trajs]
            if len(rewards) == cfg["group_size"] * cfg["groups_per_batch"]:  # every trajectory logged
                mean = sum(rewards) / len(rewards)
                assert got[0, "env/reward_mean"] == pytest.approx(mean, abs=1e-9)
                std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
                assert got[0, "env/reward_std"] == pytest.approx(std, abs=1e-6)
