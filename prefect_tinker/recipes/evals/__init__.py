"""Sampling benchmarks: definitions, graders, a runner and their statistics (no Prefect here).

- :mod:`~prefect_tinker.recipes.evals.benchmarks`: :class:`BenchmarkSpec` (source, field mapping,
  prompt template, grader, sampling settings), built-ins ``gsm8k``, ``math``, ``arithmetic``,
  ``multiple_choice``, ``exact_match`` (:func:`get_benchmark`), ``fingerprint()`` cache keys;
- :mod:`~prefect_tinker.recipes.evals.examples`: reading examples through the field mapping and
  rendering their prompts;
- :mod:`~prefect_tinker.recipes.evals.graders`: number (GSM8K), math (``\\boxed{}``), choice
  letter, exact match / token F1, code pass@k through a ``run_code`` hook;
- :mod:`~prefect_tinker.recipes.evals.runner`: :func:`run_benchmark` -> ``eval_results`` and
  ``eval_samples`` rows;
- :mod:`~prefect_tinker.recipes.evals.metrics`: unbiased pass@k, Wilson score interval.
"""

from prefect_tinker.recipes.evals.benchmarks import (
    BENCHMARKS,
    BenchmarkSpec,
    GeneratedSpec,
    PromptTemplate,
    benchmark_names,
    get_benchmark,
)
from prefect_tinker.recipes.evals.examples import Example, build_messages, load_examples
from prefect_tinker.recipes.evals.graders import (
    Grade,
    GraderSpec,
    grade,
    register_code_runner,
)
from prefect_tinker.recipes.evals.metrics import mean_pass_at_k, pass_at_k, wilson_interval
from prefect_tinker.recipes.evals.runner import (
    evaluate_examples,
    example_seed,
    metrics_dict,
    run_benchmark,
    summarize,
)

__all__ = [
    "BENCHMARKS",
    "BenchmarkSpec",
    "Example",
    "GeneratedSpec",
    "Grade",
    "GraderSpec",
    "PromptTemplate",
    "benchmark_names",
    "build_messages",
    "evaluate_examples",
    "example_seed",
    "get_benchmark",
    "grade",
    "load_examples",
    "mean_pass_at_k",
    "metrics_dict",
    "pass_at_k",
    "register_code_runner",
    "run_benchmark",
    "summarize",
    "wilson_interval",
]
