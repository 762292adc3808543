"""The retrieval and code environments driven by scripted policies, on real data read in place:
a BM25 corpus and questions built at test time from the Dolly slice's context passages, and
HumanEval problems run in the real sandbox; plus ``code_pass``, the eval flow's code hook."""

from __future__ import annotations

import json

import pytest

from prefect_tinker.recipes.code_grading import code_pass, solution_program
from prefect_tinker.recipes.rl.advantages import groups_to_datums
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec
from prefect_tinker.recipes.rl.envs.humaneval import CodeProblem, HumanEvalBuilder
from prefect_tinker.recipes.rl.envs.retrieval import Retrieval, extract_answer, load_questions
from prefect_tinker.recipes.rl.message_env import EpisodeLimits
from prefect_tinker.recipes.rl.problem_env import load_renderer
from prefect_tinker.recipes.sandbox import load_code_problems
from prefect_tinker.recipes.tools import BM25Index
from prefect_tinker.tasks.rollouts import run_group_rollout
from tests.data_files import data_file
from tests.scripted_policy import ScriptedSampler, tokenizer_dirs  # noqa: F401

END = "<|im_end|>"


@pytest.fixture(scope="module")
def dolly_corpus(tmp_path_factory):
    """Documents = the Dolly slice's non-empty context passages; questions = their instructions,
    answers = the responses (written to JSONL at test time)."""
    rows = [json.loads(line) for line in data_file("sft/dolly_slice_messages.jsonl").read_text().splitlines()]
    rows = [(i, r) for i, r in enumerate(rows, 1) if r["context"].strip()]
    root = tmp_path_factory.mktemp("dolly")
    docs, questions = root / "docs.jsonl", root / "questions.jsonl"
    docs.write_text("".join(json.dumps({"id": f"dolly-{i}", "text": r["context"]}) + "\n" for i, r in rows))
    questions.write_text(
        "".join(json.dumps({"question": r["instruction"], "answer": r["response"]}) + "\n" for _, r in rows)
    )
    return str(docs), str(questions), rows


def test_retrieval_episode_searches_then_answers(tokenizer_dirs, dolly_corpus, tmp_path):
    docs, questions, rows = dolly_corpus
    spec = EnvSpec(env="retrieval", env_options={"documents": docs, "questions": questions, "top_k": 2})
    ctx = EnvContext(renderer_name="chatml", tokenizer_id=tokenizer_dirs["tiny"], group_size=2, groups_per_batch=4)
    dataset = Retrieval.build(spec, ctx)
    assert dataset.num_batches() == len(rows) // 4
    builder = next(
        b for i in range(dataset.num_batches()) for b in dataset.get_batch(i) if "Suzanne Collins" in b.question
    )
    line = next(i for i, r in rows if "Suzanne Collins" in r["instruction"])
    assert builder.answers == ("Theater Arts, Theater, Telecommunications, Fine Arts in dramatic writing",)

    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    search = '<tool_call>\n{"name": "search", "arguments": {"query": "Suzanne Collins majors"}}\n</tool_call>' + END
    sampler = ScriptedSampler(
        tok,
        [
            search,
            search,
            "She studied theater.\nAnswer: Theater Arts, Telecommunications" + END,
            "I do not know." + END,
        ],
    )
    group = run_group_rollout(sampler, builder, seed=0, max_tokens=64)
    hits = BM25Index.from_jsonl(docs).search("Suzanne Collins majors", 2)
    assert hits[0].id == f"dolly-{line}"  # the passage the question was written about ranks first
    listing = "\n\n".join(f"[{h.rank}] (id: {h.id}) {h.text[:1000]}" for h in hits)
    for traj in group.trajectories_G:
        t1, t2 = traj.transitions
        result = tok.decode(t2.observation[len(t1.observation) + len(t1.action_tokens):])
        assert result.startswith("\n<|im_start|>tool\n<tool_response>\n" + listing + "\n</tool_response>")
    # F1 by hand: 3 common tokens (theater, arts, telecommunications), precision 3/3, recall 3/9 -> 0.5
    won, lost = (t.transitions[-1].metrics for t in group.trajectories_G)
    assert won["f1"] == pytest.approx(0.5) and won["exact_match"] == 0.0 and won["format"] == 1.0
    assert lost["format"] == 0.0 and lost["tool_calls"] == 1.0
    assert group.total_rewards() == pytest.approx([0.5, lost["f1"] - 0.1])
    assert extract_answer("x\nAnswer: Paris\n") == ("Paris", True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "q", "answer": "a"}) + "\n" + json.dumps({"question": "q", "answer": 3}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'answer' must be a string or a list"):
        load_questions(str(bad))


@pytest.fixture(scope="module")
def humaneval():
    return load_code_problems(data_file("code/humaneval.jsonl.gz"))


def _fenced(code: str) -> str:
    return f"Here it is.\n```python\n{code}\n```{END}"


def test_humaneval_rewards_from_the_sandbox(tokenizer_dirs, humaneval):
    p = humaneval[0]
    problem = CodeProblem(p["prompt"], p["tests"], p["entry_point"], p["task_id"])
    builder = HumanEvalBuilder(
        problem=problem, group_size=3, renderer_name="chatml", tokenizer_id=tokenizer_dirs["tiny"]
    )
    right = p["prompt"] + p["canonical_solution"]
    wrong = f"def {p['entry_point']}(numbers, threshold):\n    return False\n"
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    group = run_group_rollout(ScriptedSampler(tok, [_fenced(right), _fenced(wrong), "no code" + END]), builder,
                              seed=0, max_tokens=512)
    assert group.total_rewards() == [1.0, 0.0, -0.1]
    metrics = [t.transitions[-1].metrics for t in group.trajectories_G]
    assert [m["all_passed"] for m in metrics] == [1.0, 0.0, 0.0] and [m["format"] for m in metrics] == [1.0, 1.0, 0.0]
    assert "AssertionError" in group.trajectories_G[1].transitions[-1].logs["detail"]

    # two attempts: the failure comes back, the second reply is graded
    builder2 = HumanEvalBuilder(
        problem=problem,
        group_size=1,
        renderer_name="chatml",
        tokenizer_id=tokenizer_dirs["tiny"],
        limits=EpisodeLimits(max_turns=2),
    )
    group = run_group_rollout(ScriptedSampler(tok, [_fenced(wrong), _fenced(p["canonical_solution"].strip("\n"))]),
                              builder2, seed=0, max_tokens=512)
    (traj,) = group.trajectories_G
    assert len(traj.transitions) == 2 and group.total_rewards() == [1.0]
    feedback = tok.decode(traj.transitions[1].observation)
    assert "The tests failed:" in feedback and "AssertionError" in feedback
    assert traj.transitions[1].metrics["attempts"] == 2.0
    (d,) = groups_to_datums([group])[0]
    assert d.mask.sum() == sum(len(t.action_tokens) for t in traj.transitions)


def test_code_pass_is_the_eval_code_hook(humaneval):
    class Example:  # the eval flow's Example: problem fields under .fields (HumanEval names the tests "test")
        def __init__(self, rec):
            self.id, self.fields = (
                rec["task_id"],
                {"prompt": rec["prompt"], "test": rec["tests"], "entry_point": rec["entry_point"]},
            )

    for rec in humaneval[:3]:
        ex = Example(rec)
        assert code_pass(rec["canonical_solution"], ex)  # a body continuing the prompt
        assert code_pass(_fenced(rec["prompt"] + rec["canonical_solution"]), ex)  # the whole function, fenced
        assert not code_pass("    return None\n", ex)
    rec = humaneval[0]
    assert solution_program("import os\ndef f():\n    '''d'''\n", "def f():\n    return 1\n", "f").startswith(
        "import os"
    )
    assert code_pass(
        rec["canonical_solution"], {"prompt": rec["prompt"], "tests": rec["tests"], "entry_point": rec["entry_point"]}
    )
    with pytest.raises(ValueError, match="entry_point"):
        code_pass("x", {"prompt": "", "tests": ""})


def test_humaneval_benchmark_graded_in_the_sandbox_by_the_eval_code_grader(humaneval):
    """The eval flow's path: HumanEval read as a benchmark (its own field names), graded by the
    ``code`` grader with ``code_runner`` naming :func:`code_pass` (a fenced canonical solution
    passes, a wrong body fails, a reply without code is unparsable)."""
    from prefect_tinker.recipes.evals import load_examples
    from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
    from prefect_tinker.recipes.evals.graders import GraderSpec, grade

    spec = BenchmarkSpec(
        name="humaneval",
        source=str(data_file("code/humaneval.jsonl.gz")),
        limit=2,
        fields={
            "question": "prompt",
            "id": "task_id",
            "prompt": "prompt",
            "test": "test",
            "entry_point": "entry_point",
        },
        grader=GraderSpec(kind="code", code_runner="prefect_tinker.recipes.code_grading:code_pass"),
    )
    examples = load_examples(spec)
    assert [ex.id for ex in examples] == [rec["task_id"] for rec in humaneval[:2]]
    for ex, rec in zip(examples, humaneval, strict=False):
        right = grade(spec.grader, _fenced(rec["prompt"] + rec["canonical_solution"]), ex)
        assert right.correct and right.score == 1.0
        wrong = grade(spec.grader, _fenced(rec["prompt"] + "    return None\n"), ex)
        assert not wrong.correct and wrong.score == 0.0
    assert grade(spec.grader, "", examples[0]).answer is None


def test_preflight_names_the_bad_record_before_a_run(dolly_corpus, tmp_path):
    """``Environment.preflight`` (run by the session before any server starts) reads each data
    file of calculator, humaneval and retrieval; a bad record fails there, naming file and line."""
    from prefect_tinker.recipes.rl.envs import get_env

    docs, questions, _ = dolly_corpus
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}) + "\n{not json\n")
    get_env("calculator").preflight(EnvSpec(env="calculator", dataset=str(good)))
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        get_env("calculator").preflight(EnvSpec(env="calculator", dataset=str(bad)))

    code = tmp_path / "code.jsonl"
    code.write_text(
        json.dumps({"prompt": "def f():\n", "tests": "def check(c):\n    pass\n", "entry_point": "f"})
        + "\n"
        + json.dumps({"prompt": "def g():\n", "entry_point": "g"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"code\.jsonl:2.*test"):
        get_env("humaneval").preflight(EnvSpec(env="humaneval", dataset=str(code)))

    get_env("retrieval").preflight(EnvSpec(env="retrieval", env_options={"documents": docs, "questions": questions}))
    bad_docs = tmp_path / "docs.jsonl"
    bad_docs.write_text(json.dumps({"id": 1, "text": "a"}) + "\n" + json.dumps({"id": 1, "text": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: id '1' repeats .*docs\.jsonl:1"):
        get_env("retrieval").preflight(
            EnvSpec(env="retrieval", env_options={"documents": str(bad_docs), "questions": questions})
        )
    bad_q = tmp_path / "q.jsonl"
    bad_q.write_text(json.dumps({"question": "Who?", "answer": 3}) + "\n")
    with pytest.raises(ValueError, match=r"q\.jsonl:1.*'answer'"):
        get_env("retrieval").preflight(
            EnvSpec(env="retrieval", env_options={"documents": docs, "questions": str(bad_q)})
        )


def test_collection_from_any_jsonl_by_field(dolly_corpus):
    """``text_field``/``id_field``: the Dolly slice's own records as the collection (``context``
    passages, ids ``file:line``, empty contexts left out) give the same BM25 hits as the
    ``{id, text}`` file written from them."""
    from prefect_tinker.recipes.rl.envs.retrieval import load_collection, search_index

    docs, _, rows = dolly_corpus
    source = str(data_file("sft/dolly_slice_messages.jsonl"))
    collection = load_collection(source, "context", None)
    assert [d["id"] for d in collection] == [f"{source}:{i}" for i, _ in rows]
    assert [d["text"] for d in collection] == [r["context"] for _, r in rows]
    by_field = search_index(source, "sha", "context", None).search("Suzanne Collins majors", 3)
    by_file = BM25Index.from_jsonl(docs).search("Suzanne Collins majors", 3)
    assert [p.id.rsplit(":", 1)[1] for p in by_field] == [p.id.removeprefix("dolly-") for p in by_file]
    assert [p.score for p in by_field] == pytest.approx([p.score for p in by_file])
    with pytest.raises(ValueError, match=r"dolly_slice_messages\.jsonl:1.*'passage'"):
        load_collection(source, "passage", None)
