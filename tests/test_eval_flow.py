"""The eval flow end to end: ``prefect-tinker run eval`` -> cached evaluate-benchmark tasks ->
mapped eval-batch tasks -> tinker SDK -> local server -> eval store -> SQL. Tiny model, few
examples, few tokens. Values are checked against independent computations: SQL over the sample
rows, greedy completions sampled directly through the SDK, and the local server's request log
(what was sampled)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinker

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.eval import EvalConfig, eval_flow
from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
from prefect_tinker.recipes.renderers import get_renderer, resolve_renderer_name
from tests.data_files import synthetic_file

QUESTIONS = ["What is 2 + 2?", "Say hello to the world.", "Name a colour.", "Count to three."]
MISS = "zq-not-in-any-output-qz"


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def _samples_sent(local_credentials) -> int:
    """Sample requests the local server has answered so far (its request log)."""
    local_credentials.get_client()  # the server (and its log) exists
    log = Path(local_credentials.local_root) / "server.log"
    return log.read_text().count("POST /api/v1/asample")


def _parts(root: Path, table: str) -> list[str]:
    return sorted(str(p) for p in (root / "eval" / table).rglob("*.parquet"))


def test_cli_gsm8k_accuracy_is_the_mean_of_its_samples_and_a_rerun_is_cached(prefect_api, local_credentials,
                                                                              tmp_path, capsys):
    store = tmp_path / "store"
    args = ["run", "eval", "model=tiny", "benchmark=gsm8k", f"dataset={synthetic_file('word_problems')}",
            "limit=20", "num_samples=2", "max_tokens=8", "run_name=E", f"store={store}", "batch_size=8",
            f"backend.local_root={local_credentials.local_root}"]
    before = _samples_sent(local_credentials)
    capsys.readouterr()
    assert cli_main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["evaluated"] == 1 and first["cached"] == 0
    assert _samples_sent(local_credentials) - before == 20  # one request (2 samples) per example
    # independent SQL over the sample rows
    (row,) = _sql(
        capsys, store, "SELECT value, num_samples FROM eval_results WHERE run_id = 'E' AND metric = 'accuracy'"
    )
    (mean,) = _sql(capsys, store, "SELECT avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) AS acc, count(*) AS n, "
                                  "count(DISTINCT example_id) AS examples FROM eval_samples WHERE run_id = 'E'")
    assert mean["n"] == 40 and mean["examples"] == 20 and row["num_samples"] == 40
    assert row["value"] == pytest.approx(mean["acc"], abs=1e-12)
    metrics = {r["metric"] for r in _sql(capsys, store, "SELECT metric FROM eval_results WHERE run_id = 'E'")}
    assert {"accuracy", "accuracy_ci95_low", "accuracy_ci95_high", "pass@1", "pass@2", "truncated"} <= metrics
    batches = json.loads(
        _sql(capsys, store, "SELECT config_json FROM eval_results WHERE metric = 'accuracy'")[0]["config_json"]
    )
    assert batches["batches"] == 3 and batches["eval_run"] == "E"  # 20 examples in eval-batch tasks of 8

    parts, sent = _parts(store, "eval_samples"), _samples_sent(local_credentials)
    assert cli_main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["evaluated"] == 0 and second["cached"] == 1
    assert second["results"][0]["metrics"] == first["results"][0]["metrics"]
    assert _samples_sent(local_credentials) == sent  # nothing sampled
    assert _parts(store, "eval_samples") == parts  # no row written
    assert _sql(capsys, store, "SELECT count(*) AS n FROM eval_samples")[0]["n"] == 40

    capsys.readouterr()
    assert cli_main(["evals", "--store", str(store), "--run", "E", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["eval_name"] == "gsm8k" and listed["checkpoint"] == "tiny" and listed["step"] is None
    assert listed["accuracy"] == pytest.approx(mean["acc"]) and listed["samples"] == 40


def _greedy(local_credentials, max_tokens: int) -> tuple[list[str], str]:
    service = local_credentials.get_client()
    client = service.create_sampling_client(base_model="tiny").result()
    tok = sampler_tokenizer(service, client)
    name = resolve_renderer_name("auto", tok)
    renderer = get_renderer(name, tok)
    out = []
    for q in QUESTIONS:
        prompt = renderer.build_generation_prompt([{"role": "user", "content": q}])
        params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.get_stop_sequences())
        seq = client.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        out.append(renderer.parse_response(list(seq.tokens)).message["content"] or "")
    return out, name


def test_exact_match_accuracy_equals_greedy_replies_graded_by_hand(prefect_api, local_credentials, tmp_path, capsys):
    completions, renderer = _greedy(local_credentials, max_tokens=6)
    # the first two references are the model's own greedy replies, the others cannot match
    refs = [completions[0], completions[1], MISS, MISS]
    data = tmp_path / "own_names.jsonl"
    data.write_text("".join(json.dumps({"prompt": {"text": q}, "gold": [r], "uid": f"q{i}"}) + "\n"
                            for i, (q, r) in enumerate(zip(QUESTIONS, refs, strict=False))))
    store = tmp_path / "store"
    cfg = EvalConfig(
        model="tiny",
        benchmark="exact_match",
        dataset=str(data),
        question_field="prompt.text",
        answer_field="gold",
        id_field="uid",
        max_tokens=6,
        temperature=0.0,
        num_samples=2,
        batch_size=1,
        run_name="em",
        store=str(store),
        backend={"local_root": local_credentials.local_root},
    )
    summary = eval_flow(cfg)
    (out,) = summary["results"]
    expected = sum(bool(c.strip()) for c in completions[:2]) / 4  # empty replies never equal a reference
    assert out["metrics"]["accuracy"] == pytest.approx(expected)
    assert out["metrics"]["pass@2"] == pytest.approx(expected)  # greedy: both samples alike
    rows = _sql(capsys, store, "SELECT example_id, sample_index, completion, correct, reference FROM eval_samples "
                               "ORDER BY example_id, sample_index")
    assert [r["example_id"] for r in rows] == ["q0", "q0", "q1", "q1", "q2", "q2", "q3", "q3"]
    assert [r["completion"] for r in rows] == [c for c in completions for _ in range(2)]
    config = json.loads(
        _sql(capsys, store, "SELECT config_json FROM eval_results WHERE metric='accuracy'")[0]["config_json"]
    )
    assert config["renderer"] == renderer and config["batches"] == 4  # one eval-batch task per example


def test_a_state_checkpoint_is_evaluated_on_one_saved_sampler_and_a_rerun_is_cached(prefect_api, local_credentials,
                                                                                    tmp_path, capsys):
    from tinker_blocks.stores import TrainingStore

    trainer = local_credentials.get_client().create_lora_training_client(base_model="tiny", rank=4).result()
    state = trainer.save_state("s-1").result().path
    store = tmp_path / "store"
    training = TrainingStore(root=str(store))
    training.record_run("S", status="completed", base_model="tiny", backend="local", lora_rank=4)
    training.record_checkpoint("S", step=1, name="s-1", kind="state", path=state, renderer="role_colon")
    backend = {"local_root": local_credentials.local_root}
    cfg = EvalConfig(model=state, benchmark="gsm8k", dataset=str(synthetic_file("word_problems")), limit=2,
                     max_tokens=2, run_name="st", store=str(store), backend=backend)
    first, second = eval_flow(cfg), eval_flow(cfg)
    samplers = _sql(capsys, store, "SELECT path FROM checkpoints WHERE run_id = 'S' AND kind = 'sampler'")
    assert len(samplers) == 1  # saved once, for the first evaluation; the second found it
    assert first["results"][0]["checkpoint"] == second["results"][0]["checkpoint"] == samplers[0]["path"]
    assert (first["evaluated"], second["evaluated"], second["cached"]) == (1, 0, 1)
    assert first["results"][0]["step"] == 1 and first["results"][0]["run_id"] == "S"


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="given without benchmark"):
        EvalConfig(model="tiny", dataset="x.jsonl")
    with pytest.raises(ValueError, match="no benchmark"):
        EvalConfig(model="tiny")
    with pytest.raises(ValueError, match="dataset file not found"):
        EvalConfig(model="tiny", benchmark="gsm8k", dataset=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        EvalConfig(model="tiny", benchmarks=["nope"])
    with pytest.raises(ValueError, match="unique"):
        EvalConfig(model="tiny", benchmarks=["arithmetic", {"benchmark": "arithmetic", "limit": 3}])
    cfg = EvalConfig(
        model=["tiny", "run:r1"],
        benchmarks=["arithmetic", {"kind": "inspect", "task": "t.py", "name": "t"}],
        limit=3,
        num_samples=2,
    )
    arith, insp = cfg.specs()
    assert (arith.limit, arith.num_samples, insp.limit, insp.epochs) == (3, 2, 3, 2)
    assert EvalConfig.model_validate(json.loads(cfg.model_dump_json())).specs() == cfg.specs()  # round trip


def test_example_configs_validate():
    from prefect_tinker.flows.registry import example_configs, load_example

    assert {"arithmetic", "suite"} <= set(example_configs("eval"))
    for name in example_configs("eval"):
        EvalConfig.model_validate(load_example("eval", name))


def test_inspect_kind_records_its_scores(prefect_api, local_credentials, tmp_path, capsys):
    pytest.importorskip("inspect_ai", reason="inspect-ai is not installed (extra 'inspect')")
    completions, _ = _greedy(local_credentials, max_tokens=6)
    targets = [completions[0][:3], MISS, completions[2][-2:], MISS]
    expected = sum(bool(t) and t.lower() in c.lower() for t, c in zip(targets, completions, strict=True)) / 4
    samples = ", ".join(
        f"Sample(input={q!r}, target={t!r}, id={i})" for i, (q, t) in enumerate(zip(QUESTIONS, targets, strict=False))
    )
    task = tmp_path / "user-project" / "inc_task.py"  # a task file outside the repository
    task.parent.mkdir()
    task.write_text(
        "from inspect_ai import Task, task\nfrom inspect_ai.dataset import Sample\n"
        "from inspect_ai.scorer import includes\nfrom inspect_ai.solver import generate\n\n\n"
        f"@task\ndef inc():\n    return Task(dataset=[{samples}], solver=[generate()], scorer=includes())\n"
    )
    store = tmp_path / "store"
    cfg = EvalConfig(model="tiny", benchmarks=[{"kind": "inspect", "task": str(task), "name": "inc", "temperature": 0.0,
                                                "max_tokens": 6, "model_args": {"max_connections": 1}}],
                     run_name="insp", store=str(store), inspect_log_dir=str(tmp_path / "logs"),
                     backend={"local_root": local_credentials.local_root})
    first = eval_flow(cfg)
    rows = {
        r["metric"]: r
        for r in _sql(
            capsys,
            store,
            "SELECT metric, value, num_samples, step, checkpoint "
            "FROM eval_results WHERE run_id = 'insp' AND eval_name = 'inc'",
        )
    }
    assert rows["includes/accuracy"]["value"] == pytest.approx(expected)
    assert rows["accuracy"]["value"] == pytest.approx(expected) and rows["accuracy"]["num_samples"] == 4
    assert rows["accuracy"]["checkpoint"] == "tiny" and rows["accuracy"]["step"] is None
    assert first["evaluated"] == 1 and eval_flow(cfg)["cached"] == 1  # cached like the sampling benchmarks
