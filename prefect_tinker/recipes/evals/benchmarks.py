"""Benchmark definitions: where the examples come from, how they are prompted, graded and sampled.

A :class:`BenchmarkSpec` is a plain pydantic model (a flow config field, a YAML block):

- ``source``: a JSONL file (optionally gzipped), any file/dir ``datasets.load_dataset`` reads, or
  a Hugging Face dataset id with ``split`` / ``config_name``
  (:class:`~prefect_tinker.recipes.data_reading.SourceSpec`); or ``generate`` (generated sums);
- ``fields``: logical name -> record path with dots and indices (``solution.final``,
  ``choices[0]``): ``question``, ``answer`` (the reference), ``options`` (multiple choice),
  ``id``; any other name is read too and can be used in the question template;
- ``prompt``: system prompt, few-shot turns and the question template (:class:`PromptTemplate`);
- ``grader``: a :class:`~prefect_tinker.recipes.evals.graders.GraderSpec`;
- settings: ``num_samples`` (k completions per example), ``temperature``, ``top_p``,
  ``max_tokens``, ``limit`` (first N examples), ``seed``, ``concurrency`` (requests in flight),
  ``timeout_s`` (per example).

Built-in names (:func:`get_benchmark`): ``gsm8k``, ``math``, ``arithmetic``, ``multiple_choice``,
``exact_match``; :meth:`BenchmarkSpec.fingerprint` is the cache key (settings + content hash of
local files).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_tinker.recipes.data_reading import SourceSpec, looks_local
from prefect_tinker.recipes.evals.graders import GraderSpec
from prefect_tinker.recipes.registry import Registry

__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "GeneratedSpec",
    "PromptTemplate",
    "benchmark_names",
    "get_benchmark",
    "template_fields",
]

GSM8K_INSTRUCTION = (
    "Solve it step by step, then give the final answer as a number on the last line, as '#### <number>'."
)
MATH_INSTRUCTION = "Write the final answer inside \\boxed{}."
CHOICE_INSTRUCTION = "Answer with the letter of the correct option."
#: a ``{name}`` placeholder of a prompt template (``{{`` and ``}}`` are literal braces)
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_]\w*)\}")


def template_fields(template: str) -> list[str]:
    """Placeholder names of a question template: ``{name}`` with ``name`` an identifier; ``{{`` and
    ``}}`` are literal braces, and other braces (``\\boxed{}``, ``{0}``) are kept as they are."""
    return [m.group(1) for m in PLACEHOLDER.finditer(template) if m.group(1) is not None]


class PromptTemplate(BaseModel):
    """The prompt of each example: ``[system], few-shot turns..., user(question_template)``.

    ``question_template`` placeholders: ``{question}``, ``{options}`` (the lettered options, one
    per line), ``{letters}`` (``"A, B, C, D"``) and any other mapped field. ``few_shot``: solved
    examples, each a dict of the same fields (``question``, ``options``, ...) and ``response``
    (the assistant's reply), rendered through the same template.
    """

    system: str | None = Field(default=None, description="System message (none when empty).")
    question_template: str = Field(
        default="{question}", description="User message; placeholders {question}, {options}, {letters}, mapped fields."
    )
    few_shot: list[dict[str, Any]] = Field(default_factory=list, description="Solved examples: fields + 'response'.")

    @field_validator("few_shot")
    @classmethod
    def _shots(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, shot in enumerate(v):
            if not isinstance(shot.get("response"), str):
                raise ValueError(f"few_shot[{i}] needs 'response' (the assistant's reply, a string)")
        return v


class GeneratedSpec(BaseModel):
    """Generated examples: ``arithmetic`` = ``"What is a + b?"`` with ``a, b`` uniform in
    ``[0, max_operand]`` drawn by ``numpy.random.default_rng(seed)``; the reference is the sum."""

    kind: Literal["arithmetic"] = "arithmetic"
    num_examples: int = Field(default=100, ge=1, description="Examples to generate.")
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from [0, max_operand].")
    seed: int = Field(default=0, description="Seed of the generator (not of sampling).")


class BenchmarkSpec(BaseModel):
    """One sampling benchmark (see the module docstring).

    Raises (at validation):
        ValueError: neither or both of ``source`` and ``generate``; a template placeholder that is
            no mapped field; ``{options}`` or a choice grader without an ``options`` field.
    """

    name: str = Field(
        description="Eval name in the eval store (e.g. 'gsm8k').", pattern=r"^[A-Za-z0-9][A-Za-z0-9._@/-]{0,127}$"
    )
    source: SourceSpec | None = Field(
        default=None, description="Where the examples are (a path / dataset id or a SourceSpec)."
    )
    generate: GeneratedSpec | None = Field(default=None, description="Generated examples instead of a source.")
    fields: dict[str, str] = Field(
        default_factory=lambda: {"question": "question", "answer": "answer"},
        description="Logical field -> record path (question, answer, options, id, ...).",
    )
    prompt: PromptTemplate = Field(default_factory=PromptTemplate)
    grader: GraderSpec = Field(default_factory=GraderSpec)
    num_samples: int = Field(default=1, ge=1, le=1024, description="Completions per example (k of pass@k).")
    temperature: float = Field(default=0.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_tokens: int = Field(default=512, ge=1, description="Most tokens per completion.")
    limit: int | None = Field(default=None, ge=1, description="Evaluate only the first N examples.")
    seed: int = Field(default=0, description="Sampling seed; example i gets a seed derived from (seed, example id).")
    concurrency: int = Field(default=8, ge=1, description="Sampling requests in flight at once.")
    timeout_s: float | None = Field(
        default=600.0, gt=0, description="Seconds an example's sampling may take; then it counts as errored."
    )

    @field_validator("source", mode="before")
    @classmethod
    def _source(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, (str, Path)) else v

    @model_validator(mode="after")
    def _consistent(self) -> BenchmarkSpec:
        if (self.source is None) == (self.generate is None):
            raise ValueError(f"benchmark {self.name!r}: give exactly one of source (a dataset) and generate")
        if self.source is not None:
            if "question" not in self.fields:
                raise ValueError(f"benchmark {self.name!r}: fields must map 'question' to a record path")
            if "answer" not in self.fields and self.grader.kind != "code":
                raise ValueError(f"benchmark {self.name!r}: fields must map 'answer' to a record path")
        has_options = "options" in self.fields
        allowed = {"question", *self.fields, *(("options", "letters") if has_options else ())}
        unknown = [n for n in template_fields(self.prompt.question_template) if n not in allowed]
        if unknown:
            raise ValueError(
                f"benchmark {self.name!r}: question_template uses {unknown}, which are no mapped fields "
                f"(available: {sorted(allowed)}; map options with fields.options)"
            )
        if self.grader.kind == "choice" and not has_options:
            raise ValueError(f"benchmark {self.name!r}: the choice grader needs fields.options (the record's options)")
        return self

    def fingerprint(self) -> str:
        """Hex SHA-256 of everything that decides the results: the settings (not ``concurrency``)
        and, for local files, their content (so an edited file gets a new key).

        Raises:
            FileNotFoundError: a local source that does not exist.
        """
        payload = self.model_dump(mode="json", exclude={"concurrency"})
        payload["source_content"] = _content_hash(self.source.path) if self.source is not None else None
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _content_hash(source: str) -> str | None:
    """SHA-256 of a local file (or of a directory's files, by relative path); None for dataset ids."""
    path = Path(source).expanduser()
    if not path.exists():
        if looks_local(source):
            raise FileNotFoundError(f"dataset file not found: {path.absolute()}")
        return None
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


#: The benchmarks by name: :class:`BenchmarkSpec` fields (without ``name``) as a dict, or a
#: ``BenchmarkSpec``; plugins add theirs through the entry-point group ``prefect_tinker.benchmarks``.
BENCHMARKS: Registry[dict[str, Any] | BenchmarkSpec] = Registry("benchmark", "prefect_tinker.benchmarks")

_BUILTIN: dict[str, dict[str, Any]] = {
    "gsm8k": {
        "source": {"path": "openai/gsm8k", "config_name": "main", "split": "test"},
        "fields": {"question": "question", "answer": "answer"},
        "prompt": {"question_template": "{question}\n" + GSM8K_INSTRUCTION},
        # "####", then \boxed{}, then the reply's last number (lm-eval's "flexible extract"): chat models
        # that were never taught "####" still get graded; answer_style=any is the strict variant
        "grader": {"kind": "number", "answer_style": "last_number"},
        "max_tokens": 512,
    },
    "math": {
        "source": {"path": "HuggingFaceH4/MATH-500", "split": "test"},
        "fields": {"question": "problem", "answer": "answer"},
        "prompt": {"question_template": "{question}\n" + MATH_INSTRUCTION},
        "grader": {"kind": "math", "answer_style": "boxed"},
        "max_tokens": 1024,
    },
    "arithmetic": {
        "generate": {"kind": "arithmetic", "num_examples": 100, "max_operand": 20},
        "prompt": {"question_template": "{question}"},
        "grader": {"kind": "number", "answer_style": "last_number"},
        "max_tokens": 16,
    },
    "multiple_choice": {
        "fields": {"question": "question", "options": "options", "answer": "answer"},
        "prompt": {"question_template": "{question}\n\n{options}\n\n" + CHOICE_INSTRUCTION},
        "grader": {"kind": "choice"},
        "max_tokens": 32,
    },
    "exact_match": {
        "fields": {"question": "question", "answer": "answer"},
        "prompt": {"question_template": "{question}"},
        "grader": {"kind": "exact_match"},
        "max_tokens": 64,
    },
}
for _name, _fields in _BUILTIN.items():
    BENCHMARKS.register(_name, _fields)

_SOURCE_KEYS = {"dataset": "path", "split": "split", "dataset_config": "config_name", "streaming": "streaming"}
_FIELD_KEYS = {"question_field": "question", "answer_field": "answer", "options_field": "options", "id_field": "id"}
_PROMPT_KEYS = {"system_prompt": "system", "question_template": "question_template", "few_shot": "few_shot"}
_GRADER_KEYS = {"answer_style", "answer_regex", "code_runner"}


def benchmark_names() -> list[str]:
    """The registered benchmark names (built-in and plugins'), sorted."""
    return BENCHMARKS.names()


def get_benchmark(name: str, **overrides: Any) -> BenchmarkSpec:
    """The registered benchmark ``name`` (:data:`BENCHMARKS`) with ``overrides``.

    Overrides are BenchmarkSpec fields (``num_samples=4``, ``grader={...}``, ``source=...``) or the
    flat keys of the command line: ``dataset`` (path or dataset id; replaces the built-in source,
    its split defaults to the built-in one and its config to none), ``split``,
    ``dataset_config``, ``question_field``, ``answer_field``, ``options_field``, ``id_field``,
    ``system_prompt``, ``question_template``, ``few_shot``, ``answer_style``, ``answer_regex``,
    ``code_runner``. ``eval_name`` renames the result (default: ``name``).

    Raises:
        ValueError: unknown name (the message lists the registered ones); ``multiple_choice`` or
            ``exact_match`` without ``dataset``; invalid values (pydantic's message).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; registered: {', '.join(benchmark_names())}")
    entry = BENCHMARKS[name]
    data = entry.model_dump(exclude={"name"}) if isinstance(entry, BenchmarkSpec) else copy.deepcopy(entry)
    data["name"] = overrides.pop("eval_name", None) or name
    source_over = {_SOURCE_KEYS[k]: overrides.pop(k) for k in list(overrides) if k in _SOURCE_KEYS}
    if "path" in source_over:
        base = {"split": data.get("source", {}).get("split", "train")}
        data["source"] = {**base, **source_over}
        data.pop("generate", None)
    elif source_over:
        if "source" not in data:
            raise ValueError(f"benchmark {name!r}: {sorted(source_over)} given without dataset=")
        data["source"].update(source_over)
    for key, field in _FIELD_KEYS.items():
        if key in overrides:
            data.setdefault("fields", {})[field] = overrides.pop(key)
    for key, field in _PROMPT_KEYS.items():
        if key in overrides:
            data.setdefault("prompt", {})[field] = overrides.pop(key)
    for key in _GRADER_KEYS & set(overrides):
        data.setdefault("grader", {})[key] = overrides.pop(key)
    for key in ("fields", "prompt", "grader"):
        if isinstance(overrides.get(key), dict) and key != "fields":
            data[key] = {**data.get(key, {}), **overrides.pop(key)}
    data.update(overrides)
    if "source" not in data and "generate" not in data:
        raise ValueError(f"benchmark {name!r} needs dataset=<JSONL path or dataset id> (and its field names)")
    return BenchmarkSpec.model_validate(data)
