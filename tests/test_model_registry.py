"""The model registry (``models`` table), the one resolver of weights references, the promotion
gate's paired bootstrap (checked against scipy's) and ``prefect-tinker models``: no Prefect server,
no training (checkpoint rows are written as a run would)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefect_tinker.cli import main as cli
from prefect_tinker.recipes.gate import GateConfig, decide, item_scores, paired_bootstrap
from prefect_tinker.tasks.models import alias_row
from tinker_blocks.model_registry import (
    AliasChangedError,
    ModelRegistry,
    WeightsRefError,
    parse_alias_ref,
    resolve_weights,
)
from tinker_blocks.stores import TrainingStore


def _run(store: TrainingStore, run_id: str, steps: tuple[int, ...], sampler_at: tuple[int, ...] = ()) -> None:
    store.record_run(run_id, status="completed", base_model="tiny", backend="local", lora_rank=8)
    for s in steps:
        store.record_checkpoint(run_id, step=s, name=f"{run_id}-{s}", kind="state",
                                path=f"tinker://m-{run_id}/weights/{run_id}-{s}", renderer="role_colon")
    for s in sampler_at:
        store.record_checkpoint(run_id, step=s, name=f"{run_id}-{s}", kind="sampler",
                                path=f"tinker://m-{run_id}/sampler_weights/{run_id}-{s}", renderer="role_colon")


@pytest.fixture
def store(tmp_path):
    st = TrainingStore(root=str(tmp_path / "store"))
    _run(st, "a", (5, 10), sampler_at=(10,))
    _run(st, "b", (4,))
    return st


def test_resolver_names_runs_paths_aliases_and_base_models(store):
    a = resolve_weights(store, "run:a")
    assert (a.checkpoint, a.state_path, a.step, a.base_model, a.renderer) == (
        "tinker://m-a/sampler_weights/a-10", "tinker://m-a/weights/a-10", 10, "tiny", "role_colon")
    b = resolve_weights(store, "run:b")  # no sampler weights: the state itself
    assert b.checkpoint == b.state_path == "tinker://m-b/weights/b-4" and b.sampler == b.checkpoint
    p = resolve_weights(store, "tinker://m-a/weights/a-10")  # a state path finds its sampler twin
    assert (p.checkpoint, p.run_id, p.step) == ("tinker://m-a/sampler_weights/a-10", "a", 10)
    base = resolve_weights(store, "tiny")
    assert base.is_base and base.sampler == "base:tiny" and base.state_path is None
    assert parse_alias_ref("alias:assistant") == ("assistant", "champion")
    with pytest.raises(WeightsRefError, match=r"^teacher=run:nope: the training store .* has no checkpoint of run"):
        resolve_weights(store, "run:nope", "teacher")
    with pytest.raises(WeightsRefError, match=r"model=alias:assistant@champion: model line 'assistant' has no alias"):
        resolve_weights(store, "alias:assistant@champion")
    with pytest.raises(WeightsRefError, match="model line 'bad line'"):
        resolve_weights(store, "alias:bad line@champion")


def test_aliases_are_append_only_history_with_rollback(store):
    reg = ModelRegistry(store)
    w_base, w_a, w_b = resolve_weights(store, "tiny"), resolve_weights(store, "run:a"), resolve_weights(store, "run:b")
    for w in (w_base, w_a, w_b):
        reg.write(alias_row(store, "assistant", "champion", "promote", w, {"reason": "test"}))
    reg.write(alias_row(store, "assistant", "candidate", "set", w_b))
    assert resolve_weights(store, "alias:assistant@champion").checkpoint == w_b.checkpoint
    champ = resolve_weights(store, "alias:assistant")
    assert (champ.line, champ.alias, champ.run_id, champ.state_path) == ("assistant", "champion", "b", w_b.state_path)

    back = alias_row(store, "assistant", "champion", "rollback")
    assert (back["checkpoint"], back["previous"]) == (w_a.checkpoint, w_b.checkpoint)
    reg.write(back)
    assert resolve_weights(store, "alias:assistant@champion").checkpoint == w_a.checkpoint
    reg.write(alias_row(store, "assistant", "champion", "rollback"))  # back past a, to the base model
    assert resolve_weights(store, "alias:assistant@champion").checkpoint == "tiny"
    with pytest.raises(WeightsRefError, match="nothing to roll back to"):
        alias_row(store, "assistant", "champion", "rollback")

    # SQL over the table: the history is every row; the alias now is the latest row of each (line, alias)
    rows = store.query("SELECT alias, action, checkpoint FROM models WHERE line = 'assistant' ORDER BY time")
    assert [(r["alias"], r["action"]) for r in rows] == [
        ("champion", "promote"), ("champion", "promote"), ("champion", "promote"), ("candidate", "set"),
        ("champion", "rollback"), ("champion", "rollback")]
    now = {r["alias"]: (r["checkpoint"], r["changes"]) for r in reg.lines()}
    assert now == {"champion": ("tiny", 5), "candidate": (w_b.checkpoint, 1)}
    latest = store.query("SELECT alias, arg_max(checkpoint, time) AS c FROM models GROUP BY alias ORDER BY alias")
    assert [(r["alias"], r["c"]) for r in latest] == [("candidate", w_b.checkpoint), ("champion", "tiny")]

    # a change undone (its transaction rolled back) leaves no row
    parts = reg.write(alias_row(store, "assistant", "champion", "promote", w_a))
    assert resolve_weights(store, "alias:assistant@champion").checkpoint == w_a.checkpoint
    reg.undo(parts)
    assert resolve_weights(store, "alias:assistant@champion").checkpoint == "tiny"


def test_a_change_computed_from_a_stale_value_is_refused_and_a_retried_write_lands_once(store):
    reg = ModelRegistry(store)
    w_a, w_b = resolve_weights(store, "run:a"), resolve_weights(store, "run:b")
    reg.write(alias_row(store, "assistant", "champion", "promote", w_a))
    first = alias_row(store, "assistant", "champion", "promote", w_b)  # both computed while a is champion
    second = alias_row(store, "assistant", "champion", "promote", resolve_weights(store, "tiny"))
    assert first["previous"] == second["previous"] == w_a.checkpoint and first["row_id"] != second["row_id"]
    assert reg.write(first)
    assert reg.write(first) == []  # the same change again (a retried task whose write had landed): no new row
    stale = rf"assistant@champion holds {w_b.checkpoint} now, not {w_a.checkpoint}"
    with pytest.raises(AliasChangedError, match=stale):
        reg.write(second)
    rows = store.query("SELECT checkpoint FROM models WHERE line = 'assistant' ORDER BY time")
    assert [r["checkpoint"] for r in rows] == [w_a.checkpoint, w_b.checkpoint]
    assert [r["checkpoint"] for r in reg.stack("assistant")] == [w_a.checkpoint, w_b.checkpoint]


def test_model_field_reference_starts_the_run_from_the_alias(store):
    from prefect_tinker.flows.sft import SFTConfig
    from tinker_blocks.model_registry import WeightsRefError

    reg = ModelRegistry(store)
    reg.write(alias_row(store, "assistant", "champion", "promote", resolve_weights(store, "tiny")))
    cfg = SFTConfig(model="alias:assistant@champion", store=store.root, run_name="x")
    assert cfg.start_weights()[:2] == ("tiny", None)  # a base-model champion: a fresh LoRA on it
    reg.write(alias_row(store, "assistant", "champion", "promote", resolve_weights(store, "run:a")))
    base, start, ref = cfg.start_weights()
    assert (base, start, ref.line) == ("tiny", "tinker://m-a/weights/a-10", "assistant")
    assert SFTConfig(model="alias:assistant@champion", store=store.root).run_name.startswith("sft-assistant-")
    with pytest.raises(WeightsRefError, match="leave load_checkpoint_path"):
        SFTConfig(model="run:a", load_checkpoint_path="tinker://x/weights/y", store=store.root).start_weights()
    ref_start = SFTConfig(model="tiny", load_checkpoint_path="alias:assistant", store=store.root).start_weights()
    assert ref_start[1] == "tinker://m-a/weights/a-10"


def test_paired_bootstrap_matches_scipy_and_the_gate_applies_margins():
    from scipy.stats import bootstrap

    rng = np.random.default_rng(3)
    d = rng.normal(0.1, 0.5, size=60)
    (mean, low, high), per = paired_bootstrap({"x": d}, resamples=20000, seed=1)
    ref = bootstrap((d,), np.mean, n_resamples=20000, method="percentile", random_state=7).confidence_interval
    assert mean == pytest.approx(d.mean()) and per["x"][0] == pytest.approx(d.mean())
    assert low == pytest.approx(ref.low, abs=0.01) and high == pytest.approx(ref.high, abs=0.01)
    # stratified: the suite's interval comes from resampling each benchmark within itself
    (m2, l2, h2), per2 = paired_bootstrap({"x": d, "y": np.zeros(20)}, resamples=5000, seed=1)
    assert m2 == pytest.approx(d.sum() / 80) and per2["y"] == (0.0, 0.0, 0.0) and l2 < m2 < h2

    rows = [{"example_id": i, "correct": c} for i, c in [("1", True), ("1", False), ("2", True), ("2", True)]]
    assert item_scores(rows) == {"1": 0.5, "2": 1.0}
    champion = {"a": {str(i): 0.0 for i in range(30)}, "b": {str(i): 1.0 for i in range(10)}}
    better = {"a": {str(i): 1.0 if i < 20 else 0.0 for i in range(30)}, "b": dict(champion["b"])}
    yes = decide(better, champion, GateConfig())
    assert yes.promote and yes.low > 0 and yes.items == 40 and yes.benchmarks["a"]["difference"] == pytest.approx(2 / 3)
    worse_b = {"a": better["a"], "b": {str(i): 0.0 if i < 3 else 1.0 for i in range(10)}}
    no = decide(worse_b, champion, GateConfig(margins={"b": 0.1}))  # the suite is better, b drops by 0.3
    assert not no.promote and no.low > 0 and not no.benchmarks["b"]["ok"]
    assert "b: difference -0.3000 < -0.1" in no.reasons[1]
    same = decide(champion, champion, GateConfig())
    assert not same.promote and same.low == same.high == 0.0
    with pytest.raises(ValueError, match="different examples"):
        decide({"a": {"1": 1.0}}, {"a": {"2": 1.0}}, GateConfig())


def test_models_cli_promote_show_rollback(store, capsys):
    root = ["--store", store.root]
    assert cli.main(["models", "promote", "assistant", "tiny", *root]) == 0
    assert cli.main(["models", "promote", "assistant", "run:a", "--reason", "better on evals", *root]) == 0
    assert "assistant@champion -> tinker://m-a/sampler_weights/a-10 (was tiny)" in capsys.readouterr().out
    assert cli.main(["models", "list", "--json", *root]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["line"], r["alias"], r["checkpoint"]) for r in listed] == [
        ("assistant", "champion", "tinker://m-a/sampler_weights/a-10")]
    assert cli.main(["models", "rollback", "assistant", *root]) == 0
    assert "assistant@champion -> tiny (was tinker://m-a/sampler_weights/a-10)" in capsys.readouterr().out
    assert cli.main(["models", "show", "assistant", "--json", *root]) == 0
    hist = json.loads(capsys.readouterr().out)
    assert [h["action"] for h in hist] == ["promote", "promote", "rollback"]
    assert json.loads(hist[1]["decision_json"]) == {"reason": "better on evals"}
    assert cli.main(["models", "rollback", "assistant", *root]) == 2
    assert "nothing to roll back to" in capsys.readouterr().err
    assert cli.main(["models", "promote", "assistant", "run:missing", *root]) == 2
    assert "WEIGHTS=run:missing" in capsys.readouterr().err
