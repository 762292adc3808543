"""Benchmark library without a server: statistics, graders, field mapping, and the runner driven by
a scripted sampler (fixed tokens through the SDK's ``sample`` interface) for the grading paths."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import time
from types import SimpleNamespace

import pytest

from prefect_tinker.recipes.evals import (
    BenchmarkSpec,
    get_benchmark,
    grade,
    load_examples,
    mean_pass_at_k,
    metrics_dict,
    pass_at_k,
    register_code_runner,
    run_benchmark,
    wilson_interval,
)
from prefect_tinker.recipes.evals.choice import parse_choice, parse_options, resolve_reference_letter
from prefect_tinker.recipes.evals.examples import Example, build_messages
from prefect_tinker.recipes.evals.graders import GraderSpec, extract_code
from prefect_tinker.recipes.grading_text import exact_match, normalize_answer, token_f1


# ----- statistics -------------------------------------------------------------------------------
def _brute_pass_at_k(flags: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_all_k_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            flags = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(flags, k), abs=1e-12), (n, c, k)
    # large n: the product form agrees with exact binomials and stays finite
    assert pass_at_k(200, 3, 10) == pytest.approx(1 - math.comb(197, 10) / math.comb(200, 10), rel=1e-12)
    assert mean_pass_at_k([0, 2, 4], 4, 2) == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def _score_test_bounds(s: float, n: int, z: float) -> tuple[float, float]:
    """Invert the two-sided score test |p_hat - p| <= z sqrt(p(1-p)/n) by bisection (independent of
    the closed form)."""
    p_hat = s / n

    def accepted(p: float) -> bool:
        return abs(p_hat - p) <= z * math.sqrt(p * (1 - p) / n) + 1e-15

    def edge(lo: float, hi: float) -> float:  # accepted(lo) != accepted(hi)
        for _ in range(200):
            mid = (lo + hi) / 2
            if accepted(mid) == accepted(lo):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if accepted(0.0) else edge(0.0, p_hat)
    high = 1.0 if accepted(1.0) else edge(p_hat, 1.0)
    return low, high


@pytest.mark.parametrize("s,n", [(0, 10), (3, 10), (10, 10), (41, 100), (7.5, 20), (1, 1)])
def test_wilson_interval_inverts_the_score_test(s, n):
    low, high = wilson_interval(s, n)
    ref_low, ref_high = _score_test_bounds(s, n, 1.959963984540054)
    assert low == pytest.approx(ref_low, abs=1e-9) and high == pytest.approx(ref_high, abs=1e-9)
    assert 0.0 <= low <= s / n <= high <= 1.0


# ----- graders ----------------------------------------------------------------------------------
def test_squad_normalisation_exact_match_and_f1():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert exact_match("the cat sat.", "Cat sat") and not exact_match("cat", "cats")
    assert token_f1("x b c", "b c d") == pytest.approx(2 / 3)
    assert token_f1("a b c", "b c d") == pytest.approx(0.8)  # the article "a" is dropped
    assert token_f1("red red blue", "red blue blue") == pytest.approx(2 / 3)  # duplicates counted
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0
    spec = GraderSpec(kind="exact_match", answer_regex=r"Answer:\s*(.+)")
    ex = Example("e", "q", ("Paris", "paris france"))
    assert grade(spec, "Hmm.\nAnswer: The Paris", ex) == (True, 1.0, "The Paris")
    g = grade(spec, "Answer: France, Paris", ex)
    assert not g.correct and g.score == pytest.approx(1.0)  # same bag of tokens as "paris france"
    assert grade(spec, "no marker here", ex).answer is None


@pytest.mark.parametrize("reply,letter", [
    ("B", "B"), ("(B)", "B"), ("The answer is B.", "B"), ("B) Rome", "B"), ("B. Rome", "B"), ("**C**", "C"),
    ("Answer: d", "D"), ("I think the answer is (C), since A is wrong", "C"), ("I pick B", "B"),
    ("rome", "B"), ("Hmm... (D)", "D"), ("A cat sat on the mat", None), ("the answer is a number", None),
    ("B or C", None), ("", None),
])
def test_choice_letter_read_from_reply(reply, letter):
    choices = parse_options(["Paris", "Rome", "Berlin", "Madrid"])
    assert parse_choice(reply, choices) == letter


def test_options_forms_and_reference_letters():
    pre = parse_options(["A) Paris", "B) Rome"])
    assert pre.render() == "A) Paris\nB) Rome" and pre.texts == ("Paris", "Rome")
    plain = parse_options(["Paris", "Rome", "Oslo"])
    assert plain.render() == "A. Paris\nB. Rome\nC. Oslo"
    arc = parse_options({"label": ["1", "2", "3"], "text": ["x", "y", "z"]})
    assert resolve_reference_letter("3", arc) == "C" and arc.letters == ("A", "B", "C")
    assert resolve_reference_letter("(b)", plain) == "B"
    assert resolve_reference_letter(2, plain) == "C"
    assert resolve_reference_letter("Oslo", plain) == "C"
    with pytest.raises(ValueError, match="'key'.*none of the options A, B, C"):
        resolve_reference_letter("Z", plain, "key")
    with pytest.raises(ValueError, match="needs 2 to 26 options"):
        parse_options(["only"])


def test_number_and_math_graders():
    gsm = GraderSpec(kind="number")
    assert grade(gsm, "3 + 4 = 7 dollars\n#### $1,234", Example("1", "q", "1234")).correct
    assert grade(gsm, "I think 1234", Example("1", "q", "1234")).answer is None  # no #### / boxed
    last = GraderSpec(kind="number", answer_style="last_number")
    assert grade(last, "So it is 12, no, 13", Example("1", "q", "13")) == (True, 1.0, "13")
    math_g = GraderSpec(kind="math")
    assert grade(math_g, "so \\boxed{\\frac{1}{2}}", Example("1", "q", "0.5")).correct
    assert grade(math_g, "\\boxed{\\frac{\\sqrt{2}}{2}}", Example("1", "q", "\\sqrt{2}/2")).correct
    assert not grade(math_g, "\\boxed{3}", Example("1", "q", "4")).correct


def test_code_grader_hook(tmp_path):
    seen = []

    def runner(program, example):
        seen.append((program, example.id))
        return "return a + b" in program

    register_code_runner("test-sum", runner)
    spec = GraderSpec(kind="code", code_runner="test-sum")
    reply = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert grade(spec, reply, Example("p1", "q", "")).correct
    assert seen == [("def add(a, b):\n    return a + b\n", "p1")]
    assert extract_code("plain text program") == "plain text program" and extract_code("  ") is None
    imported = GraderSpec(kind="code", code_runner="json:loads")  # any module:function resolves
    with pytest.raises(ValueError, match="unknown code runner 'nope'"):
        grade(GraderSpec(kind="code", code_runner="nope"), reply, Example("p", "q", ""))
    assert imported.code_runner == "json:loads"


# ----- benchmark definitions and field mapping -------------------------------------------------
def _write_jsonl(path, rows, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def test_field_mapping_with_dotted_paths_and_own_names(tmp_path):
    math_rows = [{"problem": "Half of 3?", "solution": {"final": "\\frac{3}{2}", "steps": "3/2"}, "pid": "h1"},
                 {"problem": "Twice 4?", "solution": {"final": 8}, "pid": "t2"}]
    path = _write_jsonl(tmp_path / "algebra.jsonl.gz", math_rows, gz=True)
    spec = get_benchmark("math", dataset=str(path), question_field="problem", answer_field="solution.final",
                         id_field="pid")
    exs = load_examples(spec)
    assert [(e.id, e.question, e.reference) for e in exs] == [
        ("h1", "Half of 3?", "\\frac{3}{2}"),
        ("t2", "Twice 4?", "8"),
    ]
    assert build_messages(spec, exs[0])[-1]["content"] == "Half of 3?\nWrite the final answer inside \\boxed{}."

    mc = _write_jsonl(tmp_path / "quiz.jsonl", [{"stem": "Sky?", "choices": ["green", "blue", "red"], "key": "B"}])
    mspec = get_benchmark("multiple_choice", dataset=str(mc), question_field="stem", options_field="choices",
                          answer_field="key", system_prompt="Be brief.",
                          few_shot=[{"question": "Grass?", "options": ["green", "pink"], "response": "A"}])
    (ex,) = load_examples(mspec)
    assert ex.reference == "B" and ex.id == "0"
    msgs = build_messages(mspec, ex)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[1]["content"].startswith("Grass?\n\nA. green\nB. pink") and msgs[2]["content"] == "A"
    assert "A. green\nB. blue\nC. red" in msgs[3]["content"]


def test_bad_records_name_file_line_and_field(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "ok", "solution": {"final": "1"}},
                                                 {"problem": "no answer", "solution": {}}])
    spec = get_benchmark("math", dataset=str(path), question_field="problem", answer_field="solution.final")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*solution\.final"):
        load_examples(spec)
    broken = _write_jsonl(tmp_path / "broken.jsonl", ['{"question": "x", "answer": "1"}', '{"question": '])
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: malformed JSON"):
        load_examples(get_benchmark("exact_match", dataset=str(broken)))
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"q": "a", "a": "1", "i": 7}, {"q": "b", "a": "2", "i": 7}])
    with pytest.raises(ValueError, match="duplicate example id '7'"):
        load_examples(
            get_benchmark("exact_match", dataset=str(dup), question_field="q", answer_field="a", id_field="i")
        )
    with pytest.raises(ValueError, match="needs dataset="):
        get_benchmark("multiple_choice")
    with pytest.raises(ValueError, match="unknown benchmark 'nope'; registered: arithmetic, exact_match, gsm8k"):
        get_benchmark("nope")
    with pytest.raises(ValueError, match=r"question_template uses \['topic'\]"):
        get_benchmark("exact_match", dataset=str(dup), question_template="{topic}: {question}")
    with pytest.raises(FileNotFoundError):
        load_examples(get_benchmark("exact_match", dataset=str(tmp_path / "missing.jsonl")))


def test_fingerprint_follows_content_and_settings_not_concurrency(tmp_path):
    path = _write_jsonl(tmp_path / "s.jsonl", [{"question": "a", "answer": "1"}])
    spec = get_benchmark("exact_match", dataset=str(path))
    fp = spec.fingerprint()
    assert spec.model_copy(update={"concurrency": 64}).fingerprint() == fp
    assert get_benchmark("exact_match", dataset=str(path), num_samples=2).fingerprint() != fp
    _write_jsonl(path, [{"question": "a", "answer": "2"}])
    assert spec.fingerprint() != fp
    assert get_benchmark("gsm8k").fingerprint() == get_benchmark("gsm8k").fingerprint()  # dataset id, no file


# ----- runner grading paths with a scripted sampler ---------------------------------------------
@pytest.fixture(scope="module")
def role_colon():
    from tinker_local.tokenizer import build_tiny_tokenizer

    from prefect_tinker.recipes.renderers import get_renderer

    return get_renderer("role_colon", build_tiny_tokenizer())


class ScriptedSampler:
    """The SDK's ``sample`` interface with fixed replies: ``script[question] -> list of (text, ending)``,
    ending ``"eos"`` (EOS token appended), ``"stop"`` (the stop string appended), ``"length"``
    (nothing: the tokens ran out), or an exception to raise, or ``"sleep"``."""

    def __init__(self, renderer, script):
        self.renderer, self.script, self.requests = renderer, script, []

    def sample(self, prompt, num_samples, sampling_params):
        text = self.renderer.tokenizer.decode(prompt.to_ints())
        self.requests.append((text, num_samples, sampling_params))
        (replies,) = [v for q, v in self.script.items() if q in text]
        if isinstance(replies, Exception):
            raise replies
        seqs = []
        for reply, ending in replies:
            toks = self.renderer.encode(" " + reply)
            if ending == "eos":
                toks += self.renderer.eos_token_ids()
            elif ending == "stop":
                toks += self.renderer.encode(self.renderer.STOP)
            seqs.append(SimpleNamespace(tokens=toks, logprobs=[0.0] * len(toks),
                                        stop_reason="length" if ending == "length" else "stop"))
        return _Future(SimpleNamespace(sequences=seqs), delay=1.0 if replies and replies[0][1] == "sleep" else 0.0)


class _Future:
    def __init__(self, value, delay):
        self.value, self.ready_at = value, time.monotonic() + delay

    def result(self, timeout=None):
        if timeout is not None and time.monotonic() + timeout < self.ready_at:
            time.sleep(timeout)
            raise TimeoutError()
        return self.value


def _rows_by(samples):
    return {(r["example_id"], r["sample_index"]): r for r in samples}


def test_eos_ended_correct_reply_is_graded_correct_and_statuses_are_counted_apart(tmp_path, role_colon):
    data = _write_jsonl(tmp_path / "sums.jsonl", [
        {"q": "Q-one", "a": "7"}, {"q": "Q-two", "a": "5"}, {"q": "Q-three", "a": "9"}, {"q": "Q-four", "a": "1"}])
    spec = get_benchmark("gsm8k", dataset=str(data), question_field="q", answer_field="a", num_samples=3, seed=11)
    script = {
        "Q-one": [("It is 7.\n#### 7", "eos"), ("#### 7", "stop"), ("So 3+4 ... #### 7 and more", "length")],
        "Q-two": [("#### 5", "eos"), ("no final line", "eos"), ("#### 6", "stop")],
        "Q-three": RuntimeError("backend exploded"),
        "Q-four": [("#### 1", "sleep"), ("#### 1", "sleep"), ("#### 1", "sleep")],
    }
    sampler = ScriptedSampler(role_colon, script)
    results, samples = run_benchmark(sampler, role_colon, spec.model_copy(update={"timeout_s": 0.3}),
                                     run_id="unit", checkpoint="scripted")
    rows = _rows_by(samples)
    statuses = {k: json.loads(r["extra_json"])["status"] for k, r in rows.items()}
    terminations = {k: json.loads(r["extra_json"]).get("termination") for k, r in rows.items()}
    assert terminations[("0", 0)] == "end_of_sequence" and rows[("0", 0)]["correct"] is True
    assert statuses[("0", 0)] == "ok" and rows[("0", 0)]["completion"] == "It is 7.\n#### 7"
    assert terminations[("0", 1)] == "stop_sequence" and rows[("0", 1)]["correct"] is True
    assert statuses[("0", 2)] == "truncated" and rows[("0", 2)]["correct"] is True  # graded on its text
    assert statuses[("1", 0)] == "ok" and rows[("1", 0)]["correct"] is True
    assert statuses[("1", 1)] == "unparsable" and statuses[("1", 2)] == "ok" and not rows[("1", 2)]["correct"]
    assert all(statuses[("2", j)] == "errored" and "backend exploded" in rows[("2", j)]["extra_json"] for j in range(3))
    assert all(statuses[("3", j)] == "errored" and "timed out" in rows[("3", j)]["extra_json"] for j in range(3))
    m = metrics_dict(results)
    correct = [r["correct"] for r in samples]
    assert len(samples) == 12 and m["accuracy"] == pytest.approx(sum(correct) / 12) == pytest.approx(4 / 12)
    assert (m["truncated"], m["unparsable"], m["errored"]) == (1, 1, 6)
    flags = {eid: [rows[(eid, j)]["correct"] for j in range(3)] for eid in "0123"}
    for k in (1, 2, 3):
        assert m[f"pass@{k}"] == pytest.approx(sum(_brute_pass_at_k(f, k) for f in flags.values()) / 4)
    low, high = wilson_interval(4 / 12 * 4, 4)
    assert (m["accuracy_ci95_low"], m["accuracy_ci95_high"]) == (pytest.approx(low), pytest.approx(high))
    by_metric = {r["metric"]: r for r in results}
    assert by_metric["accuracy"]["num_samples"] == 12 and by_metric["pass@3"]["num_samples"] == 4
    # requests: k samples each, renderer's stop string, per-example seeds that differ
    assert {n for _, n, _ in sampler.requests} == {3}
    assert all(p.stop == ["\n\nUser:"] and p.max_tokens == 512 for _, _, p in sampler.requests)
    assert len({p.seed for _, _, p in sampler.requests}) == 4


def test_every_example_errored_raises(tmp_path, role_colon):
    data = _write_jsonl(tmp_path / "one.jsonl", [{"question": "Q-one", "answer": "1"}])
    sampler = ScriptedSampler(role_colon, {"Q-one": ConnectionError("refused")})
    with pytest.raises(RuntimeError, match="every example errored.*refused"):
        run_benchmark(sampler, role_colon, get_benchmark("exact_match", dataset=str(data)))


def test_code_runner_exception_is_an_errored_sample(tmp_path, role_colon):
    data = _write_jsonl(tmp_path / "code.jsonl", [{"prompt": "Q-one"}])

    def runner(program, example):
        if "boom" in program:
            raise RuntimeError("sandbox died")
        return True

    spec = BenchmarkSpec(name="code-unit", source=str(data), fields={"question": "prompt"},
                         grader=GraderSpec(kind="code"), num_samples=2)
    sampler = ScriptedSampler(role_colon, {"Q-one": [("print(1)", "eos"), ("boom", "eos")]})
    results, samples = run_benchmark(sampler, role_colon, spec, run_code=runner)
    extras = [json.loads(r["extra_json"]) for r in samples]
    assert [e["status"] for e in extras] == ["ok", "errored"] and "sandbox died" in extras[1]["error"]
    assert metrics_dict(results)["pass@2"] == 1.0 and metrics_dict(results)["accuracy"] == 0.5


def test_arithmetic_builtin_generates_sums_and_overrides_apply():
    spec = get_benchmark("arithmetic", limit=5, eval_name="sums-5", num_samples=2, grader={"answer_style": "hash"})
    assert spec.name == "sums-5" and spec.grader.kind == "number" and spec.grader.answer_style == "hash"
    exs = load_examples(spec)
    assert len(exs) == 5 and len({e.id for e in exs}) == 5
    for e in exs:
        a, b = (int(x) for x in e.question.removeprefix("What is ").removesuffix("?").split(" + "))
        assert 0 <= a <= 20 and 0 <= b <= 20 and e.reference == str(a + b)
    assert [e.question for e in exs] == [e.question for e in load_examples(spec)]  # generator seed, not sampling seed
    assert get_benchmark("arithmetic", seed=9).fingerprint() != get_benchmark("arithmetic").fingerprint()
