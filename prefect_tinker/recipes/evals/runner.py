"""Running a sampling benchmark: render, sample k completions per example, grade, aggregate.

:func:`run_benchmark` = :func:`~prefect_tinker.recipes.evals.examples.load_examples` ->
:func:`evaluate_examples` (any batch of examples; the eval flow maps batches over workers) ->
:func:`summarize` (from the sample rows alone, so batches graded anywhere aggregate the same).

Each example's prompt is rendered by the renderer (``build_generation_prompt``), and its
``num_samples`` completions come from one ``sample`` request with the renderer's stop
sequences and seed :func:`example_seed` ``(spec.seed, example id)``: an example's seed does
not depend on which other examples run with it (on the local server a subset sampled in the
same request order repeats its completions; batched requests may differ in the last bits).
At most ``concurrency`` requests are in flight; an example whose
result is not back ``timeout_s`` after its request was sent counts as errored.

Every sample has one status (``extra_json.status``):

``ok``          ended on a stop sequence or EOS (or malformed) and the grader read an answer;
``truncated``   the renderer found neither stop sequence nor EOS (``max_tokens`` reached,
                stop reason ``length``); still graded on its text;
``unparsable``  ended properly but states no answer the grader can read (no ``####``, no
                letter); how a reply ended never makes it unparsable (the cookbook's bug #688);
``errored``     sampling failed or timed out, or the grader raised; graded incorrect.

Result rows (``eval_results``), one per metric: ``accuracy`` (mean of ``correct`` over all
samples) with ``accuracy_ci95_low``/``_high`` (Wilson score interval at 95% with the example as
the unit: ``n`` = examples, successes = ``n * accuracy``; conservative for k > 1 because an
example's mean of k samples varies less than one Bernoulli draw), ``pass@1`` ..
``pass@{num_samples}`` (unbiased estimator, Chen et al. 2021), ``f1`` (mean token F1, exact_match
grader), the counts ``truncated``, ``unparsable``, ``errored``, ``completion_tokens_mean`` and
``seconds`` (wall time, when known). ``num_samples`` is the number of samples a value aggregates
(examples for pass@k and the interval).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import tinker

from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
from prefect_tinker.recipes.evals.examples import Example, build_messages, load_examples
from prefect_tinker.recipes.evals.graders import CodeRunner, grade
from prefect_tinker.recipes.evals.metrics import mean_pass_at_k, wilson_interval
from prefect_tinker.recipes.renderers import Renderer, Termination

__all__ = ["SAMPLE_STATUSES", "example_seed", "evaluate_examples", "summarize", "run_benchmark", "metrics_dict"]

SAMPLE_STATUSES = ("ok", "truncated", "unparsable", "errored")


def example_seed(seed: int, example_id: str) -> int:
    """A 63-bit sampling seed for one example, a pure function of (seed, example id)."""
    digest = hashlib.sha256(f"{seed}:{example_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _row_base(spec: BenchmarkSpec, ex: Example, j: int, ident: dict[str, Any], prompt: str) -> dict[str, Any]:
    return {
        **ident,
        "eval_name": spec.name,
        "example_id": ex.id,
        "sample_index": j,
        "prompt": prompt,
        "reference": ex.reference_text(),
    }


def _graded_rows(
    spec: BenchmarkSpec,
    renderer: Any,
    ex: Example,
    sequences: Sequence[Any],
    seed: int,
    ident: dict[str, Any],
    prompt: str,
    run_code: CodeRunner | None,
) -> list[dict[str, Any]]:
    rows = []
    for j, seq in enumerate(sequences):
        tokens = [int(t) for t in seq.tokens]
        parsed = renderer.parse_response(tokens)
        text = parsed.message.get("content") or ""
        extra = {
            "termination": parsed.termination.value,
            "stop_reason": str(seq.stop_reason),
            "seed": seed,
            "where": ex.where,
        }
        try:
            g = grade(spec.grader, text, ex, run_code=run_code)
        except Exception as exc:  # a grader/code-runner failure is this sample's error, not the run's
            extra.update(status="errored", error=f"grader: {type(exc).__name__}: {exc}"[:500], answer=None)
            rows.append(
                {
                    **_row_base(spec, ex, j, ident, prompt),
                    "completion": text,
                    "score": 0.0,
                    "correct": False,
                    "completion_tokens": len(tokens),
                    "extra_json": json.dumps(extra),
                }
            )
            continue
        if parsed.termination is Termination.TRUNCATED:
            status = "truncated"
        else:
            status = "unparsable" if g.answer is None else "ok"
        extra.update(status=status, answer=g.answer)
        rows.append(
            {
                **_row_base(spec, ex, j, ident, prompt),
                "completion": text,
                "score": float(g.score),
                "correct": bool(g.correct),
                "completion_tokens": len(tokens),
                "extra_json": json.dumps(extra),
            }
        )
    return rows


def _errored_rows(
    spec: BenchmarkSpec, ex: Example, error: str, seed: int, ident: dict[str, Any], prompt: str
) -> list[dict[str, Any]]:
    extra = json.dumps({"status": "errored", "error": error[:500], "seed": seed, "where": ex.where})
    return [
        {
            **_row_base(spec, ex, j, ident, prompt),
            "completion": None,
            "score": 0.0,
            "correct": False,
            "completion_tokens": None,
            "extra_json": extra,
        }
        for j in range(spec.num_samples)
    ]


def evaluate_examples(
    sampling_client: Any,
    renderer: Any,
    spec: BenchmarkSpec,
    examples: Sequence[Example],
    *,
    run_id: str = "eval",
    step: int | None = None,
    checkpoint: str | None = None,
    run_code: CodeRunner | None = None,
) -> list[dict[str, Any]]:
    """Sample and grade ``examples``; return their ``eval_samples`` rows (examples x samples, in
    example order).

    Args:
        sampling_client: anything with the SDK's ``sample(prompt, num_samples, sampling_params)``
            returning a future (``.result(timeout=)``) or a ``SampleResponse``.
        renderer: a :class:`~prefect_tinker.recipes.renderers.Renderer` (prompts, stop sequences,
            response parsing).
        run_id / step / checkpoint: the row identity (training run, optimizer steps of the
            weights, ``tinker://`` sampler path or base model name).
        run_code: code graders: the runner (overrides ``spec.grader.code_runner``).

    Raises:
        RendererError: a prompt that cannot be rendered (a configuration error).
        RuntimeError: every example errored (the first error is in the message), so a broken
            backend never reads as accuracy 0.
    """
    ident = {"run_id": run_id, "step": step, "checkpoint": checkpoint}
    stop = renderer.get_stop_sequences()
    prompts = []
    for ex in examples:
        tokens = renderer.build_generation_prompt(build_messages(spec, ex)).to_ints()
        prompts.append((tokens, renderer.tokenizer.decode(tokens, skip_special_tokens=False)))
    results: dict[int, list[dict[str, Any]]] = {}
    pending: deque[tuple[int, Any, float, int]] = deque()
    errors: list[str] = []

    def submit(i: int) -> None:
        seed = example_seed(spec.seed, examples[i].id)
        params = tinker.SamplingParams(
            max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, seed=seed, stop=stop
        )
        try:
            fut = sampling_client.sample(
                prompt=tinker.ModelInput.from_ints(prompts[i][0]), num_samples=spec.num_samples, sampling_params=params
            )
        except Exception as exc:  # counted per example; the SDK already retried transient errors
            fut = exc
        pending.append((i, fut, time.monotonic(), seed))

    nxt = 0
    while nxt < len(examples) or pending:
        while nxt < len(examples) and len(pending) < spec.concurrency:
            submit(nxt)
            nxt += 1
        i, fut, sent, seed = pending.popleft()
        ex, prompt = examples[i], prompts[i][1]
        try:
            if isinstance(fut, Exception):
                raise fut
            left = None if spec.timeout_s is None else max(0.0, spec.timeout_s - (time.monotonic() - sent))
            fut = fut.result(timeout=left)
            sequences = list(fut.sequences)
            if len(sequences) != spec.num_samples:
                raise RuntimeError(f"asked for {spec.num_samples} samples, got {len(sequences)}")
        except Exception as exc:
            msg = (
                f"timed out after {spec.timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else f"sampling: {type(exc).__name__}: {exc}"
            )
            errors.append(f"example {ex.id!r}: {msg}")
            results[i] = _errored_rows(spec, ex, msg, seed, ident, prompt)
            continue
        results[i] = _graded_rows(spec, renderer, ex, sequences, seed, ident, prompt, run_code)
    if examples and len(errors) == len(examples):
        raise RuntimeError(f"benchmark {spec.name!r}: every example errored; first: {errors[0]}")
    return [row for i in range(len(examples)) for row in results[i]]


def _status(row: dict[str, Any]) -> str:
    return json.loads(row.get("extra_json") or "{}").get("status", "ok")


def summarize(
    spec: BenchmarkSpec,
    sample_rows: Sequence[dict[str, Any]],
    *,
    run_id: str = "eval",
    step: int | None = None,
    checkpoint: str | None = None,
    seconds: float | None = None,
    config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The ``eval_results`` rows of a benchmark from its ``eval_samples`` rows (see the module
    docstring for the metrics).

    Raises:
        ValueError: no rows, or an example without exactly ``spec.num_samples`` rows.
    """
    by_example: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    for row in sample_rows:
        by_example.setdefault(row["example_id"], []).append(row)
    if not by_example:
        raise ValueError(f"benchmark {spec.name!r}: no sample rows to summarize")
    k = spec.num_samples
    bad = [eid for eid, rows in by_example.items() if len(rows) != k]
    if bad:
        raise ValueError(f"benchmark {spec.name!r}: examples {bad[:5]} do not have num_samples={k} sample rows")
    n_ex, total = len(by_example), len(sample_rows)
    correct_counts = [sum(bool(r["correct"]) for r in rows) for rows in by_example.values()]
    accuracy = sum(correct_counts) / total
    low, high = wilson_interval(accuracy * n_ex, n_ex)
    values: list[tuple[str, float, int]] = [
        ("accuracy", accuracy, total),
        ("accuracy_ci95_low", low, n_ex),
        ("accuracy_ci95_high", high, n_ex),
    ]
    values += [(f"pass@{j}", mean_pass_at_k(correct_counts, k, j), n_ex) for j in range(1, k + 1)]
    if spec.grader.score_name:
        values.append((spec.grader.score_name, sum(float(r["score"] or 0.0) for r in sample_rows) / total, total))
    statuses = [_status(r) for r in sample_rows]
    values += [(s, float(statuses.count(s)), total) for s in ("truncated", "unparsable", "errored")]
    lengths = [r["completion_tokens"] for r in sample_rows if r.get("completion_tokens") is not None]
    if lengths:
        values.append(("completion_tokens_mean", sum(lengths) / len(lengths), len(lengths)))
    if seconds is not None:
        values.append(("seconds", float(seconds), total))
    config_json = json.dumps(
        config if config is not None else {"benchmark": spec.model_dump(mode="json")}, sort_keys=True, default=str
    )
    return [
        {
            "run_id": run_id,
            "step": step,
            "checkpoint": checkpoint,
            "eval_name": spec.name,
            "metric": m,
            "value": v,
            "num_samples": n,
            "config_json": config_json,
        }
        for m, v, n in values
    ]


def run_benchmark(
    sampling_client: Any,
    renderer: Renderer,
    spec: BenchmarkSpec,
    *,
    run_id: str = "eval",
    step: int | None = None,
    checkpoint: str | None = None,
    run_code: CodeRunner | None = None,
    examples: Sequence[Example] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run ``spec`` against ``sampling_client``; return ``(results, samples)``: the rows of
    ``eval_results`` and ``eval_samples`` (columns of :mod:`tinker_blocks.store_schemas`, without
    ``row_id``/``time``, which the store fills).

    Args:
        examples: already loaded examples (default: :func:`load_examples` of ``spec``).
        Others: as in :func:`evaluate_examples`.

    Raises:
        FileNotFoundError / ValueError: from :func:`load_examples`; RendererError / RuntimeError:
        from :func:`evaluate_examples`.
    """
    t0 = time.perf_counter()
    examples = list(examples) if examples is not None else load_examples(spec)
    samples = evaluate_examples(
        sampling_client, renderer, spec, examples, run_id=run_id, step=step, checkpoint=checkpoint, run_code=run_code
    )
    config = {
        "benchmark": spec.model_dump(mode="json"),
        "fingerprint": spec.fingerprint(),
        "renderer": renderer.name,
        "interval": "wilson score 95%, examples as units",
    }
    results = summarize(
        spec, samples, run_id=run_id, step=step, checkpoint=checkpoint, seconds=time.perf_counter() - t0, config=config
    )
    return results, samples


def metrics_dict(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``{metric: value}`` of result rows (for logs and tests)."""
    return {r["metric"]: r["value"] for r in results}
