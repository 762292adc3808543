"""``retrieval``: questions answered with a search tool over a document collection.

The model gets one tool, ``search(query)``, over the index the run's ``retrieval`` service builds
(``ctx.service(RETRIEVAL)``; built in: BM25, the ``bm25s`` library, Lucene variant, see
:mod:`prefect_tinker.recipes.tools.retrieval` and :func:`search_index`) of ``env_options.documents``, a JSONL collection
``{id, text}`` (or any JSONL: ``text_field`` names the passage, ``id_field`` its id, None for
``file:line``; records with an empty passage are left out), returning the ``top_k`` passages.
It may search over several turns and ends with a
reply without a tool call stating its answer (the text after the last ``Answer:``, else the whole
reply). Reward:

    reward = score + format_coef * (format_ok - 1)

``score`` is the SQuAD token F1 (``reward="f1"``, default) or exact match (``"exact_match"``) of the
answer against the reference(s) (:mod:`prefect_tinker.recipes.grading_text`); ``format_ok``: the
reply has an ``Answer:`` line. Metrics per episode: ``env/f1``, ``env/exact_match``,
``env/correct_rate`` (= exact match), ``env/format_rate``, ``env/tool_calls``, ...

Questions: ``env_options.questions``, JSONL with ``question_field`` (default ``question``) and
``answer_field`` (``answer``: a string or a list of accepted strings).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from prefect_tinker.recipes.grading_text import best_over_references, exact_match, token_f1
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.message_env import (
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    freeze,
    thaw,
)
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, load_renderer
from prefect_tinker.recipes.rl.services import RETRIEVAL
from prefect_tinker.recipes.rl.types import RLDataset, RolloutContext

__all__ = [
    "Retrieval",
    "RetrievalBuilder",
    "RetrievalEnv",
    "RetrievalOptions",
    "RETRIEVAL_SYSTEM",
    "extract_answer",
    "load_collection",
    "load_questions",
    "search_index",
]

RETRIEVAL_SYSTEM = (
    "Answer the question using the search tool to find the relevant document. When you know "
    "the answer, reply without a tool call and end with a line 'Answer: <short answer>'."
)

_ANSWER = re.compile(r"answer\s*:\s*(.*)", re.IGNORECASE)


class RetrievalOptions(MessageEnvOptions):
    documents: str = Field(description="JSONL document collection {id, text} (BM25 index).")
    text_field: str = Field(
        default="text", description="Document record field holding the passage (empty ones are left out)."
    )
    id_field: str | None = Field(default="id", description="Document record field holding its id; None: file:line.")
    questions: str = Field(description="JSONL questions with their reference answer(s).")
    question_field: str = Field(default="question", description="Record field holding the question.")
    answer_field: str = Field(
        default="answer", description="Record field holding the answer (string or list of strings)."
    )
    top_k: int = Field(default=3, ge=1, le=20, description="Passages per search.")
    max_passage_chars: int = Field(default=1000, ge=50, description="Each passage is cut to this many characters.")
    reward: Literal["f1", "exact_match"] = Field(
        default="f1", description="Score of the answer: token F1 or exact match."
    )

    @field_validator("documents", "questions")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).expanduser().is_file():
            raise ValueError(f"file not found: {Path(v).expanduser().resolve()}")
        return v


def extract_answer(text: str) -> tuple[str, bool]:
    """``(answer, format_ok)``: the rest of the line after the last ``Answer:`` (True), else the
    whole stripped reply (False)."""
    found = _ANSWER.findall(text or "")
    if found:
        return found[-1].strip(), True
    return (text or "").strip(), False


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


def load_collection(path: str, text_field: str = "text", id_field: str | None = "id") -> list[dict[str, str]]:
    """``[{"id", "text"}, ...]`` from the JSONL records of ``path``: ``text_field`` (a dotted
    path) is the passage, ``id_field`` the id (a string or integer; None: ``file:line``). Records
    whose passage is empty or blank are left out.

    Raises:
        ValueError: malformed JSON, a missing field, a passage that is not a string, a repeated id
            or no passage at all; the message names ``file:line`` and the field.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    docs: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    for raw in iter_records(SourceSpec(path=str(Path(path).expanduser()))):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            text = get_field(raw.record, text_field)
            doc_id = raw.where if id_field is None else get_field(raw.record, id_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if not isinstance(text, str):
            raise ValueError(f"{raw.where}: field {text_field!r} must be a string, got {text!r:.60}")
        if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
            raise ValueError(f"{raw.where}: field {id_field!r} must be a string or integer, got {doc_id!r:.60}")
        if not text.strip():
            continue
        if str(doc_id) in seen:
            raise ValueError(f"{raw.where}: id {str(doc_id)!r} repeats {seen[str(doc_id)]}")
        seen[str(doc_id)] = raw.where
        docs.append({"id": str(doc_id), "text": text})
    if not docs:
        raise ValueError(f"no non-empty {text_field!r} passages in {path!r}")
    return docs


@functools.lru_cache(maxsize=4)
def search_index(documents: str, sha256: str, text_field: str = "text", id_field: str | None = "id") -> Any:
    """The :class:`~prefect_tinker.recipes.tools.BM25Index` of a JSONL collection (see
    :func:`load_collection`), built once per process, content and fields (``sha256`` of the file
    keys the cache)."""
    from prefect_tinker.recipes.tools import BM25Index

    return BM25Index(load_collection(documents, text_field, id_field))


def load_questions(
    path: str, question_field: str = "question", answer_field: str = "answer"
) -> list[tuple[str, tuple[str, ...], str]]:
    """``(question, answers, where)`` from a JSONL file (``where`` is ``file:line``).

    Raises:
        ValueError: a malformed line, a missing field, an empty question or no answer string;
            the message names ``file:line`` and the field.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    out = []
    for raw in iter_records(SourceSpec(path=str(Path(path).expanduser()))):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            question, answer = get_field(raw.record, question_field), get_field(raw.record, answer_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        answers = [answer] if isinstance(answer, str) else answer
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{raw.where}: field {question_field!r} must be a non-empty string, got {question!r:.60}")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(
                f"{raw.where}: field {answer_field!r} must be a string or a list of strings, got {answer!r:.60}"
            )
        out.append((question.strip(), tuple(a.strip() for a in answers), raw.where))
    if not out:
        raise ValueError(f"no questions in {path!r}")
    return out


class RetrievalEnv(MessageEnv):
    """One question with the search tool (see the module docstring)."""

    outcome_metrics = ("f1", "exact_match", "correct", "format")

    def __init__(
        self,
        renderer: Any,
        messages: list[dict],
        toolset: Any,
        answers: tuple[str, ...],
        *,
        reward: str,
        format_coef: float,
        problem_id: str = "",
        **kw: Any,
    ):
        super().__init__(renderer, messages, toolset=toolset, **kw)
        self.answers, self.reward_kind, self.format_coef, self.problem_id = (
            answers,
            reward,
            float(format_coef),
            problem_id,
        )

    def finish(self, reply: dict) -> Reaction:
        answer, format_ok = extract_answer(reply.get("content") or "")
        em = best_over_references(exact_match, answer, self.answers)
        f1 = best_over_references(token_f1, answer, self.answers)
        score = f1 if self.reward_kind == "f1" else em
        return Reaction(
            done=True,
            reward=score + self.format_coef * (float(format_ok) - 1.0),
            metrics={"f1": f1, "exact_match": em, "correct": em, "format": float(format_ok)},
            logs={"reference": self.answers[0], "answer": answer[:200], "problem_id": self.problem_id},
        )


@dataclass(frozen=True, kw_only=True)
class RetrievalBuilder(MessageGroupBuilder):
    """One question's group; the collection is named by path and content hash."""

    question: str
    answers: tuple[str, ...]
    documents: str
    documents_sha256: str
    text_field: str = "text"
    id_field: str | None = "id"
    problem_id: str = ""
    prefix: tuple = ()
    top_k: int = 3
    max_passage_chars: int = 1000
    reward: str = "f1"
    format_coef: float = 0.1

    def make_envs(self) -> list[MessageEnv]:
        raise RuntimeError("retrieval envs need the retrieval service: make them with make_envs_in(ctx)")

    def make_envs_in(self, ctx: RolloutContext) -> list[MessageEnv]:
        from prefect_tinker.recipes.tools import Toolset

        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        index = ctx.service(RETRIEVAL)(self.documents, self.documents_sha256, self.text_field, self.id_field)
        messages = thaw(self.prefix) + [{"role": "user", "content": self.question}]
        return [
            RetrievalEnv(
                renderer,
                messages,
                Toolset([index.as_tool(self.top_k, max_passage_chars=self.max_passage_chars)]),
                self.answers,
                reward=self.reward,
                format_coef=self.format_coef,
                problem_id=self.problem_id,
                limits=self.limits,
            )
            for _ in range(self.group_size)
        ]


@register_env
class Retrieval(Environment):
    name = "retrieval"
    description = (
        "Questions answered with a BM25 search tool over a JSONL {id, text} collection; reward: F1 / exact match."
    )
    Options = RetrievalOptions

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        opts = cls.options(spec)
        load_questions(opts.questions, opts.question_field, opts.answer_field)
        load_collection(opts.documents, opts.text_field, opts.id_field)

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        questions = load_questions(opts.questions, opts.question_field, opts.answer_field)
        if spec.max_problems:
            questions = questions[: spec.max_problems]
        sha = _sha256(opts.documents)
        ctx.service(RETRIEVAL)(opts.documents, sha, opts.text_field, opts.id_field)  # a bad collection fails here
        prefix = freeze([{"role": "system", "content": spec.system_prompt or RETRIEVAL_SYSTEM}])
        documents = str(Path(opts.documents).expanduser().resolve())

        def make(q: tuple[str, tuple[str, ...], str]) -> RetrievalBuilder:
            return RetrievalBuilder(
                question=q[0],
                answers=q[1],
                problem_id=q[2],
                documents=documents,
                documents_sha256=sha,
                prefix=prefix,
                text_field=opts.text_field,
                id_field=opts.id_field,
                top_k=opts.top_k,
                max_passage_chars=opts.max_passage_chars,
                reward=opts.reward,
                format_coef=spec.format_coef,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=opts.limits(),
                tags=(cls.name,),
            )

        return ProblemDataset(questions, ctx.groups_per_batch, make, ctx.seed)
