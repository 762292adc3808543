"""The benchmark runner against the real local server (tiny model, unmodified SDK): rows, metrics
recomputed independently from the sample rows, the eval store round trip and seeded sampling."""

from __future__ import annotations

import itertools
import json

import pytest

from prefect_tinker.recipes.evals import get_benchmark, load_examples, metrics_dict, run_benchmark
from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
from prefect_tinker.recipes.evals.graders import GraderSpec
from prefect_tinker.recipes.evals.runner import evaluate_examples
from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
from prefect_tinker.recipes.renderers import get_renderer
from tinker_blocks.store_schemas import EVAL_TABLES, normalize_row


@pytest.fixture(scope="module")
def tiny(local_credentials):
    service = local_credentials.get_client()
    client = service.create_sampling_client(base_model="tiny").result()
    renderer = get_renderer("chatml", sampler_tokenizer(service, client))
    return client, renderer


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _brute_pass_at_k(flags, k):
    subsets = list(itertools.combinations(flags, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_math_set_in_own_field_names_through_the_eval_store(tmp_path, tiny):
    from tinker_blocks.stores import EvalStore

    client, renderer = tiny
    data = _write(
        tmp_path / "fractions.jsonl",
        [
            {
                "problem": f"What is {a}/{b} plus {c}?",
                "solution": {"final": f"\\frac{{{a + b * c}}}{{{b}}}"},
                "tag": f"f{a}",
            }
            for a, b, c in [(1, 2, 3), (2, 3, 1), (3, 4, 2), (5, 6, 1), (7, 8, 2)]
        ],
    )
    spec = get_benchmark("math", dataset=str(data), question_field="problem", answer_field="solution.final",
                         id_field="tag", limit=4, num_samples=3, temperature=1.0, max_tokens=8, seed=5)
    results, samples = run_benchmark(client, renderer, spec, run_id="tiny-evals", checkpoint="tiny")
    assert len(samples) == 4 * 3 and {r["example_id"] for r in samples} == {"f1", "f2", "f3", "f5"}
    for row in samples:
        extra = json.loads(row["extra_json"])
        assert extra["termination"] in ("stop_sequence", "end_of_sequence", "truncated")
        assert (extra["status"] == "truncated") == (extra["termination"] == "truncated")
        assert row["reference"].startswith("\\frac{")
        # the sampler ran out of tokens exactly when the renderer found no end: then exactly 8 tokens
        assert (extra["stop_reason"].lower().endswith("length")) == (extra["termination"] == "truncated"), extra
        if extra["termination"] == "truncated":
            assert row["completion_tokens"] == 8
        assert row["prompt"].startswith("<|im_start|>user\nWhat is ") and row["prompt"].endswith(
            "<|im_start|>assistant\n"
        )
    m = metrics_dict(results)
    assert m["accuracy"] == pytest.approx(sum(r["correct"] for r in samples) / 12)
    assert m["truncated"] == sum(json.loads(r["extra_json"])["status"] == "truncated" for r in samples)
    assert m["errored"] == 0
    # the rows are exactly the store's columns: validate, write, and re-aggregate in SQL
    for table, rows in (("eval_results", results), ("eval_samples", samples)):
        for row in rows:
            normalize_row(table, EVAL_TABLES[table], row)
    store = EvalStore(root=str(tmp_path / "store"))
    store.write_rows("eval_results", results)
    store.write_rows("eval_samples", samples)
    (sql,) = store.query(
        "SELECT (SELECT value FROM eval_results WHERE metric = 'accuracy') AS acc, "
        "(SELECT avg(CASE WHEN correct THEN 1.0 ELSE 0.0 END) FROM eval_samples) AS mean_correct, "
        "(SELECT count(*) FROM eval_samples) AS n")
    assert sql["n"] == 12 and sql["acc"] == pytest.approx(sql["mean_correct"])


def test_pass_at_k_over_real_samples_equals_subset_enumeration(tmp_path, tiny):
    client, renderer = tiny
    data = _write(tmp_path / "tasks.jsonl", [{"spec": f"Write a function number {i}.", "n": i} for i in range(5)])

    def parity(program, example):  # a stand-in sandbox: passes on an even number of characters
        return len(program) % 2 == 0

    spec = BenchmarkSpec(name="parity", source=str(data), fields={"question": "spec", "id": "n"},
                         grader=GraderSpec(kind="code"), num_samples=4, temperature=1.0, max_tokens=6, seed=3,
                         concurrency=1)
    results, samples = run_benchmark(client, renderer, spec, run_code=parity)
    flags = {}
    for row in samples:
        extra = json.loads(row["extra_json"])
        passed = extra["answer"] is not None and len(extra["answer"]) % 2 == 0
        assert row["correct"] == passed
        flags.setdefault(row["example_id"], []).append(row["correct"])
    m = metrics_dict(results)
    assert 0 < m["accuracy"] < 1, "tiny's random replies should pass some and fail some"
    assert m["accuracy"] == pytest.approx(sum(sum(f) for f in flags.values()) / 20)
    for k in range(1, 5):
        assert m[f"pass@{k}"] == pytest.approx(sum(_brute_pass_at_k(f, k) for f in flags.values()) / 5, abs=1e-12)
    # seeds are per example id: a subset sampled again (same sequential order of requests) repeats them
    examples = load_examples(spec)
    again = evaluate_examples(client, renderer, spec, examples[2:4], run_code=parity)
    first = {(r["example_id"], r["sample_index"]): r["completion"] for r in samples}
    assert {(r["example_id"], r["sample_index"]): r["completion"] for r in again} == {
        k: v for k, v in first.items() if k[0] in ("2", "3")}


def test_multiple_choice_set_in_own_field_names(tmp_path, tiny):
    client, renderer = tiny
    data = _write(tmp_path / "quiz.jsonl", [
        {"stem": "Which is a colour?", "choices": ["dog", "blue", "seven"], "key": "B"},
        {"stem": "Which is a number?", "choices": ["seven", "cat", "tree"], "key": "A"},
        {"stem": "Which is an animal?", "choices": ["red", "one", "horse"], "key": "C"}])
    spec = get_benchmark("multiple_choice", dataset=str(data), question_field="stem", options_field="choices",
                         answer_field="key", num_samples=2, temperature=1.0, max_tokens=4)
    results, samples = run_benchmark(client, renderer, spec)
    assert [r["reference"] for r in samples] == ["B", "B", "A", "A", "C", "C"]
    assert "A. dog\nB. blue\nC. seven" in samples[0]["prompt"]
    for row in samples:
        extra = json.loads(row["extra_json"])
        assert row["correct"] == (extra["answer"] == row["reference"])
        if extra["status"] not in ("truncated", "errored"):
            assert (extra["status"] == "unparsable") == (extra["answer"] is None)
    assert metrics_dict(results)["accuracy"] == pytest.approx(sum(r["correct"] for r in samples) / 6)
