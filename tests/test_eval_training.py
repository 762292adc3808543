"""Benchmarks during training and the eval flow over a training run's checkpoints: SFT runs with
``evaluators``, ``model=run:<id>`` (sampler checkpoints, and a state without sampler weights),
incremental re-runs over a growing run, the training curves and the SQL join of docs/stores.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.eval import EvalConfig, eval_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from tests.conftest import ROOT
from tests.data_files import synthetic_file


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def _sft(local_credentials, store, run_name, **kw) -> SFTConfig:
    base = dict(model="tiny", dataset=str(synthetic_file("chats")), batch_size=2,
                learning_rate=2e-3, lora_rank=4, max_steps=2, eval_every=1, save_every=1, run_name=run_name,
                store=str(store), max_length=128, num_eval_samples=0, test_size=0,
                backend={"local_root": local_credentials.local_root})
    base.update(kw)
    return SFTConfig(**base)


def _samples_sent(local_credentials) -> int:
    local_credentials.get_client()
    return (Path(local_credentials.local_root) / "server.log").read_text().count("POST /api/v1/asample")


def _readme_sql() -> str:
    text = (ROOT / "docs" / "stores.md").read_text()
    m = re.search(r'prefect-tinker sql --store s3://bucket/pt "(SELECT r\.run_id.*?)"\n', text, re.S)
    assert m, "the eval_results x runs query of docs/stores.md is gone"
    return " ".join(m.group(1).split())


def test_training_evaluators_then_eval_flow_over_the_growing_run(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    gsm8k = {"benchmark": "gsm8k", "dataset": str(synthetic_file("word_problems")), "limit": 2, "max_tokens": 4}
    # run A: the benchmark at steps 0, 1, 2 (sampler checkpoints saved for it)
    sft_flow(_sft(local_credentials, store, "sft-a", evaluators=[gsm8k]))
    # run B: no evaluator, one state checkpoint (no sampler weights)
    sft_flow(_sft(local_credentials, store, "sft-b", max_steps=1, learning_rate=1e-3))

    ev = _sql(capsys, store, "SELECT step, checkpoint, value FROM eval_results WHERE run_id = 'sft-a' "
                             "AND eval_name = 'gsm8k' AND metric = 'accuracy' ORDER BY step")
    assert [r["step"] for r in ev] == [0, 1, 2] and all("/sampler_weights/" in r["checkpoint"] for r in ev)
    curve = _sql(
        capsys,
        store,
        "SELECT step, value FROM metrics WHERE run_id = 'sft-a' AND name = 'eval/gsm8k/accuracy' ORDER BY step",
    )
    assert [(c["step"], c["value"]) for c in curve] == [(r["step"], r["value"]) for r in ev]  # in the run's curves
    from prefect_tinker.tasks.reporting import eval_curve_names

    assert eval_curve_names(str(store), "sft-a") == ["eval/gsm8k/accuracy"]
    samplers = _sql(
        capsys, store, "SELECT step, path FROM checkpoints WHERE run_id = 'sft-a' AND kind = 'sampler' ORDER BY step"
    )
    # the loop records a sampler with the checkpoint of its step: the one of step 0 only served the evaluation
    assert [(s["step"], s["path"]) for s in samplers] == [(r["step"], r["checkpoint"]) for r in ev[1:]]

    def evaluate() -> dict:
        cfg = EvalConfig(
            model=["run:sft-a", "run:sft-b"],
            benchmarks=[gsm8k, {"benchmark": "arithmetic", "limit": 2, "max_tokens": 4}],
            run_name="suite",
            store=str(store),
            backend={"local_root": local_credentials.local_root},
        )
        return eval_flow(cfg)

    sent = _samples_sent(local_credentials)
    first = evaluate()
    # gsm8k on A's sampler checkpoints (steps 1, 2): already done during training (same weights, settings)
    cached = {(r["run_id"], r["step"], r["eval_name"]) for r in first["results"] if r["cached"]}
    assert cached == {("sft-a", s, "gsm8k") for s in (1, 2)}
    assert first["evaluated"] == 4  # gsm8k on B@1, arithmetic on A@1, A@2 and B@1
    assert _samples_sent(local_credentials) - sent == 4 * 2  # two examples each
    b_samplers = _sql(capsys, store, "SELECT step FROM checkpoints WHERE run_id = 'sft-b' AND kind = 'sampler'")
    assert b_samplers == [{"step": 1}]  # B's state got sampler weights, recorded with the run

    sft_flow(_sft(local_credentials, store, "sft-a", max_steps=3, evaluators=[gsm8k]))  # a checkpoint more
    sent = _samples_sent(local_credentials)
    second = evaluate()
    new = [(r["run_id"], r["step"], r["eval_name"]) for r in second["results"] if not r["cached"]]
    assert new == [("sft-a", 3, "arithmetic")] and second["cached"] == 7  # gsm8k@3 ran during training
    assert _samples_sent(local_credentials) - sent == 2

    # every accuracy row is the mean of its samples
    rows = _sql(
        capsys,
        store,
        "SELECT r.run_id, r.eval_name, r.step, r.value, avg(CASE WHEN s.correct THEN 1.0 ELSE 0.0 END) AS m "
        "FROM eval_results r JOIN eval_samples s USING (run_id, eval_name, step, checkpoint) "
        "WHERE r.metric = 'accuracy' GROUP BY ALL",
    )
    assert len(rows) == 9 and all(r["value"] == pytest.approx(r["m"]) for r in rows)

    # docs/stores.md's join of eval_results with runs.config_json, as written
    joined = _sql(capsys, store, _readme_sql())
    assert [(r["run_id"], r["step"]) for r in joined if r["run_id"] == "sft-a"] == [("sft-a", s) for s in range(4)]
    assert [(r["run_id"], r["step"]) for r in joined if r["run_id"] == "sft-b"] == [("sft-b", 1)]
    lr = {r["run_id"]: float(json.loads(r["lr"]) if isinstance(r["lr"], str) else r["lr"]) for r in joined}
    assert lr == {"sft-a": 2e-3, "sft-b": 1e-3}
    by_key = {(r["run_id"], r["step"]): r["value"] for r in rows if r["eval_name"] == "gsm8k"}
    assert all(r["gsm8k"] == pytest.approx(by_key[(r["run_id"], r["step"])]) for r in joined)
    assert [r["step"] for r in joined] == sorted(r["step"] for r in joined)

    capsys.readouterr()
    assert cli_main(["evals", "--store", str(store), "--run", "sft-a", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["eval_name"], r["step"]) for r in listed] == [("arithmetic", s) for s in (1, 2, 3)] + [
        ("gsm8k", s) for s in range(4)]
    assert second["accuracy_png"] and Path(second["accuracy_png"]).stat().st_size > 1000
