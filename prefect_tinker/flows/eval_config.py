"""The eval flow's configuration (its single parameter).

One benchmark from flat fields (the command line's form)::

    prefect-tinker run eval model=tiny benchmark=gsm8k dataset=gsm8k_test.jsonl limit=20 num_samples=2

or several (``benchmarks:``, items as in :mod:`prefect_tinker.recipes.evals.specs`) from
``--config FILE.yaml``; ``limit``, ``num_samples``, ``temperature``, ``max_tokens`` and ``seed``,
when set, override every benchmark's own value (a quick smoke run of a whole suite).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from prefect_tinker.flows.config import (
    BackendConfig,
    PreflightChecks,
    default_run_name,
    default_store_root,
    weights_ref,
)
from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec, get_benchmark
from prefect_tinker.recipes.evals.specs import EvalSpec, InspectSpec, with_overrides
from prefect_tinker.tasks.runners import TaskRunnerFields
from tinker_blocks.model_registry import is_weights_ref

__all__ = ["EvalConfig", "FLAT_BENCHMARK_KEYS"]

#: Flat fields that customise ``benchmark`` (the keys of :func:`~prefect_tinker.recipes.evals.get_benchmark`).
FLAT_BENCHMARK_KEYS = (
    "dataset",
    "split",
    "dataset_config",
    "question_field",
    "answer_field",
    "options_field",
    "id_field",
    "system_prompt",
    "question_template",
    "answer_style",
    "answer_regex",
    "eval_name",
)
#: Flat settings applied to every benchmark when set.
OVERRIDE_KEYS = ("limit", "num_samples", "temperature", "max_tokens", "seed")


class EvalConfig(PreflightChecks, TaskRunnerFields):
    """Parameters of an evaluation run: which weights (``model``), which benchmarks, where the
    results go. Not a training run: no training client, no lease, no ``runs`` row; its rows are
    ``eval_results`` / ``eval_samples`` in the eval store."""

    recipe: ClassVar[str] = "eval"

    model: str | list[str] = Field(
        default="tiny",
        description=(
            "Weights to evaluate: a base model name, a tinker:// sampler (or state) path, run:<run_id> (every sampler "
            "checkpoint of that training run; states without sampler weights get them saved), alias:LINE@ALIAS (what "
            "the alias of the model line holds now), or a list of these."
        ),
    )
    benchmark: str | None = Field(
        default=None,
        description=(
            "A built-in benchmark (gsm8k, math, arithmetic, multiple_choice, exact_match), customised by the flat "
            "fields below."
        ),
    )
    dataset: str | None = Field(
        default=None, description="benchmark: JSONL file or dataset id replacing the built-in source."
    )
    split: str | None = Field(default=None, description="benchmark: dataset split.")
    dataset_config: str | None = Field(default=None, description="benchmark: dataset config name.")
    question_field: str | None = Field(default=None, description="benchmark: record path of the question (dots, [i]).")
    answer_field: str | None = Field(default=None, description="benchmark: record path of the reference answer.")
    options_field: str | None = Field(
        default=None, description="benchmark: record path of the options (multiple choice)."
    )
    id_field: str | None = Field(default=None, description="benchmark: record path of a unique example id.")
    system_prompt: str | None = Field(default=None, description="benchmark: system message.")
    question_template: str | None = Field(
        default=None, description="benchmark: user message template ({question}, {options}, ...)."
    )
    answer_style: str | None = Field(
        default=None, description="benchmark: how the grader finds the answer (see the grader)."
    )
    answer_regex: str | None = Field(default=None, description="benchmark: regex whose first group is the answer.")
    eval_name: str | None = Field(
        default=None, description="benchmark: name in the eval store (default: the built-in name)."
    )
    benchmarks: list[EvalSpec] = Field(
        default_factory=list,
        description=(
            "Several benchmarks: built-in names, {benchmark: NAME, ...overrides}, full specs or {kind: inspect, task: "
            "FILE.py, name: N}."
        ),
    )
    limit: int | None = Field(default=None, ge=1, description="Override: first N examples of every benchmark.")
    num_samples: int | None = Field(
        default=None, ge=1, le=1024, description="Override: completions per example (pass@k); inspect: epochs."
    )
    temperature: float | None = Field(default=None, ge=0, description="Override: sampling temperature.")
    max_tokens: int | None = Field(default=None, ge=1, description="Override: most tokens per completion.")
    seed: int | None = Field(default=None, description="Override: sampling seed.")
    renderer: str = Field(
        default="auto",
        description="Renderer; auto: the one recorded with a checkpoint, else resolved from the tokenizer.",
    )
    batch_size: int = Field(
        default=16, ge=1, description="Examples per eval-batch task (the unit spread over task-runner workers)."
    )
    run_name: str | None = Field(
        default=None,
        description=(
            "Name of this evaluation (rows of base models and unrecorded paths use it as run_id; artifact keys)."
        ),
    )
    store: str = Field(
        default_factory=default_store_root,
        description="Training store root (run:<id> checkpoints and alias: references are read there).",
    )
    line: str | None = Field(
        default=None,
        description=(
            "Model line the evaluated weights belong to (their candidates): labels the prefect-tinker.eval.completed "
            "events, which the 'consider promotion' automation reacts to."
        ),
    )
    eval_store: str | None = Field(default=None, description="Eval store root; default: the training store's root.")
    inspect_log_dir: str | None = Field(
        default=None, description="inspect-ai log folder; default $PREFECT_TINKER_HOME/inspect-logs."
    )
    backend: BackendConfig = Field(default_factory=BackendConfig)

    @field_validator("model")
    @classmethod
    def _models(cls, v: str | list[str]) -> str | list[str]:
        items = [v] if isinstance(v, str) else list(v)
        if not items:
            raise ValueError(
                "give at least one model (a base model, a tinker:// path, run:<run_id> or alias:LINE@ALIAS)"
            )
        for m in items:
            if not isinstance(m, str) or not m.strip() or m.strip() in ("run:", "alias:"):
                raise ValueError(
                    f"bad model {m!r}: a base model name, a tinker:// path, run:<run_id> or alias:LINE@ALIAS"
                )
        return v

    def preflight(self) -> None:
        """Every ``run:<id>`` model is a run with a checkpoint in the training store and every
        ``alias:`` model an alias that is set (before the evaluation starts).

        Raises:
            ValueError: one line naming the reference and the store.
        """
        for m in self.models():
            if is_weights_ref(m):
                weights_ref(self.store, m, "model")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.backend.is_local():  # the embedded server can tell a model it cannot serve, now
            from tinker_blocks.model_names import check_model_name
            from tinker_local.launcher import default_root

            root = self.backend.local_root or default_root()
            fixed = [
                m if m.startswith(("run:", "alias:", "tinker://")) else check_model_name(m, root) for m in self.models()
            ]
            self.model = fixed[0] if isinstance(self.model, str) else fixed
        specs = self.specs()  # bad benchmark settings fail now, naming the benchmark
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmark names must be unique (eval_name in the store), got {names}")
        from prefect_tinker.recipes.data_reading import missing_local_source

        for s in specs:
            missing = missing_local_source(s.source.path) if isinstance(s, BenchmarkSpec) and s.source else None
            if missing is not None:
                raise ValueError(f"benchmark {s.name!r}: dataset file not found: {missing}")
        if self.run_name is None:
            self.run_name = default_run_name("eval", self)
        if not self.line:  # an automation's template renders a missing line as ""
            self.line = None
        return self

    def models(self) -> list[str]:
        """``model`` as a list."""
        return [self.model] if isinstance(self.model, str) else list(self.model)

    def specs(self) -> list[BenchmarkSpec | InspectSpec]:
        """The benchmarks of this run: ``benchmark`` with the flat fields, then ``benchmarks``, each
        with the set overrides applied.

        Raises:
            ValueError: no benchmark at all; flat fields without ``benchmark``; bad values.
        """
        flat = {k: getattr(self, k) for k in FLAT_BENCHMARK_KEYS if getattr(self, k) is not None}
        if flat and not self.benchmark:
            raise ValueError(
                f"{', '.join(sorted(flat))} given without benchmark=<name> (built-in: gsm8k, math, "
                "arithmetic, multiple_choice, exact_match)"
            )
        specs: list[Any] = [get_benchmark(self.benchmark, **flat)] if self.benchmark else []
        specs += list(self.benchmarks)
        if not specs:
            raise ValueError("no benchmark: give benchmark=<name> or a benchmarks: list")
        over = {k: getattr(self, k) for k in OVERRIDE_KEYS}
        return [with_overrides(s, **over) for s in specs]

    def eval_root(self) -> str:
        """Where the rows go: ``eval_store``, else ``store``."""
        return self.eval_store or self.store
