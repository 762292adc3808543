"""What an evaluation runs: a sampling benchmark (:class:`BenchmarkSpec`) or an inspect-ai task
(:class:`InspectSpec`), as one config type, :data:`EvalSpec`.

:data:`EvalSpec` is the item type of the eval flow's ``benchmarks`` and of the training recipes'
``evaluators``. It accepts, in YAML or JSON:

- a built-in name: ``gsm8k``;
- a built-in with overrides (the flat keys of :func:`~prefect_tinker.recipes.evals.get_benchmark`):
  ``{benchmark: multiple_choice, dataset: quiz.jsonl, options_field: choices, limit: 50}``;
- a full :class:`BenchmarkSpec`: ``{name: mine, source: data.jsonl, fields: {...}, grader: {...}}``;
- an inspect-ai task: ``{kind: inspect, task: tasks/arc.py@arc_easy, name: arc_easy, limit: 100}``.

Validation turns each into a :class:`BenchmarkSpec` or :class:`InspectSpec` (dumped back as the
full model, so a stored config validates again).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, GetJsonSchemaHandler, Tag

from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec, get_benchmark

__all__ = ["EvalSpec", "InspectSpec", "parse_eval_spec", "with_overrides"]


class InspectSpec(BaseModel):
    """An inspect-ai task run against the evaluated weights (through
    :func:`prefect_tinker.inspect_provider.run_inspect_task`); its scores become ``eval_results``
    rows ``<scorer>/<metric>`` (plus ``accuracy`` when exactly one scorer reports one).

    ``task`` is a task file (``path/task.py``, ``path/task.py@name``) or a registered task name;
    a relative file path is read from the working directory of the flow.
    """

    kind: Literal["inspect"] = "inspect"
    name: str = Field(description="Eval name in the eval store.", pattern=r"^[A-Za-z0-9][A-Za-z0-9._@/-]{0,127}$")
    task: str = Field(description="inspect-ai task: a file (task.py, task.py@name) or a registered task name.")
    task_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the task function.")
    limit: int | None = Field(default=None, ge=1, description="Evaluate only the first N samples.")
    epochs: int | None = Field(default=None, ge=1, description="Times each sample is run (inspect's epochs).")
    temperature: float | None = Field(
        default=None, ge=0, description="Sampling temperature (inspect's default when empty)."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens per generation (the provider's default 1024 when empty)."
    )
    seed: int | None = Field(default=None, description="Sampling seed.")
    model_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra provider args (e.g. max_connections); the backend and renderer are set by the flow.",
    )

    def eval_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``inspect_ai.eval`` from the generation settings that are set."""
        return self.model_dump(include={"epochs", "temperature", "max_tokens", "seed"}, exclude_none=True)

    def fingerprint(self) -> str:
        """Hex SHA-256 of the settings and, for a local task file, its content."""
        payload = self.model_dump(mode="json")
        path = Path(self.task.split("@", 1)[0]).expanduser()
        payload["task_content"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def parse_eval_spec(value: Any) -> Any:
    """The short forms of an eval spec turned into a model (see the module docstring); anything
    else is returned for pydantic to validate.

    Raises:
        ValueError: an unknown built-in name or bad overrides (the message of ``get_benchmark``).
    """
    if isinstance(value, str):
        return get_benchmark(value)
    if isinstance(value, dict) and "benchmark" in value:
        rest = {k: v for k, v in value.items() if k not in ("benchmark", "kind")}
        return get_benchmark(value["benchmark"], **rest)
    return value


def _kind(value: Any) -> str:
    if isinstance(value, InspectSpec) or (isinstance(value, dict) and value.get("kind") == "inspect"):
        return "inspect"
    return "sampling"


class _ShortForms:
    """The JSON schema of :data:`EvalSpec`: any of its forms (``anyOf``: a built-in name, a
    built-in with overrides, a full benchmark, an inspect task). Pydantic's ``oneOf`` of the two
    models is wrong for the short forms, and Prefect validates deployment parameters with the
    ``required`` keywords left out, under which a dict matches both models: a deployment whose
    config lists ``{benchmark: gsm8k, limit: 20}`` was refused (HTTP 422)."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        schema = handler(core_schema)
        branches = schema.pop("oneOf", None) or schema.pop("anyOf", None) or []
        schema.pop("discriminator", None)
        schema["anyOf"] = [
            {"type": "string", "description": "A built-in benchmark: gsm8k, math, arithmetic, ..."},
            {
                "type": "object",
                "properties": {"benchmark": {"type": "string", "description": "The built-in benchmark."}},
                "required": ["benchmark"],
                "description": "A built-in benchmark with overrides (dataset, limit, max_tokens, ...).",
            },
            *branches,
        ]
        return schema


#: One evaluation of a config: a sampling benchmark or an inspect task (see the module docstring).
EvalSpec = Annotated[
    Annotated[BenchmarkSpec, Tag("sampling")] | Annotated[InspectSpec, Tag("inspect")],
    Discriminator(_kind),
    BeforeValidator(parse_eval_spec),
    _ShortForms(),
]


def with_overrides(spec: BenchmarkSpec | InspectSpec, **overrides: Any) -> BenchmarkSpec | InspectSpec:
    """``spec`` with the settings in ``overrides`` that are not None (``limit``, ``num_samples``,
    ``temperature``, ``max_tokens``, ``seed``); for an inspect task ``num_samples`` sets
    ``epochs``. Raises ``ValueError`` (pydantic's) for invalid values."""
    update = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(spec, InspectSpec) and "num_samples" in update:
        update["epochs"] = update.pop("num_samples")
    fields = type(spec).model_fields
    update = {k: v for k, v in update.items() if k in fields}
    return type(spec).model_validate({**spec.model_dump(), **update}) if update else spec
