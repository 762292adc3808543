"""Evaluators: what the step loop runs every ``eval_every`` steps (and at the start and the end).

Two kinds, by the client they need:

- :class:`TrainingClientEvaluator`: runs on the training client (``forward``, no gradient), e.g.
  :class:`NLLEvaluator` (held-out negative log-likelihood);
- :class:`SamplingClientEvaluator`: runs on sampler weights of the evaluated step (the loop saves
  them when the step has none), e.g. benchmarks that sample and grade.

``evaluate`` returns metric rows ``{full name: value}`` (e.g. ``{"test/nll": 2.31}``) recorded at
the evaluated step in the training store; evaluators that also keep per-sample results write them
to the eval store themselves. The evaluators here also return the tokens their requests cost,
``tokens/eval_prefill`` and ``tokens/eval_sampled`` (:data:`~prefect_tinker.recipes.pricing.
EVAL_TOKEN_KINDS`; requests the task cache answered count nothing), which the step loop sums over
the evaluators and prices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal

import tinker

from prefect_tinker.tasks.clients import TrainingRun
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.training import forward, model_input_tokens, weights_sum
from prefect_tinker.tasks.usage import run_task

if TYPE_CHECKING:
    from prefect_tinker.recipes.builders import DatasetBuilder, SupervisedData
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "ClassifierAccuracyEvaluator",
    "Evaluator",
    "NLLEvaluator",
    "PreferenceEvaluator",
    "SamplingClientEvaluator",
    "TrainingClientEvaluator",
    "TranscriptionEvaluator",
    "data_evaluators",
]


class Evaluator(ABC):  # noqa: B024 -- a marker base: its two kinds below declare evaluate()
    """Base class of evaluators (see the module docstring). ``name`` prefixes nothing by itself:
    :meth:`evaluate` returns full metric names."""

    name: str = "eval"


class TrainingClientEvaluator(Evaluator):
    """An evaluator on the training client's current weights."""

    @abstractmethod
    def evaluate(self, credentials: TinkerCredentials, run: TrainingRun) -> dict[str, float]:
        """Metrics of the weights after ``run.step`` optimizer steps."""


class SamplingClientEvaluator(Evaluator):
    """An evaluator on saved sampler weights."""

    @abstractmethod
    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        """Metrics of the sampler weights ``sampler_path`` (taken after ``step`` optimizer steps)."""


class NLLEvaluator(TrainingClientEvaluator):
    """Mean negative log-likelihood of held-out datums, nats per trained token.

    Returns ``{prefix}/nll`` (``loss:sum`` of a ``cross_entropy`` forward / the sum of weights),
    ``{prefix}/tokens`` (the sum of weights) and ``tokens/eval_prefill`` (the forward's inputs).

    Args:
        datums: held-out datums (D); weights select the scored tokens.
        prefix: metric prefix (default ``test``).
    """

    name = "nll"

    def __init__(self, datums: list[tinker.Datum], prefix: str = "test"):
        self.datums, self.prefix = list(datums), prefix

    def evaluate(self, credentials: TinkerCredentials, run: TrainingRun) -> dict[str, float]:
        if not self.datums:
            return {}
        out = forward.with_options(task_run_name=f"eval-nll-step-{run.step}")(credentials, run, quote(self.datums))
        tokens = weights_sum(self.datums)
        return {
            f"{self.prefix}/nll": out.loss_sum / max(tokens, 1e-9),
            f"{self.prefix}/tokens": tokens,
            "tokens/eval_prefill": float(model_input_tokens(self.datums)),
        }


class PreferenceEvaluator(TrainingClientEvaluator):
    """DPO-family loss and accuracy of held-out comparisons under the current weights.

    Returns ``{prefix}/dpo_loss`` (mean over pairs of ``loss``'s per-pair value),
    ``{prefix}/accuracy`` (fraction of pairs whose chosen log-ratio exceeds the rejected one, ties
    one half: :func:`~prefect_tinker.recipes.preference.pair_accuracy`) and
    ``{prefix}/margin`` (mean ``beta h``); the reference log-probabilities come from the cached
    ``reference-sequence-logprobs`` task. ``tokens/eval_prefill``: the forward's inputs, and the
    reference requests' when the cache did not answer them.

    Args:
        pairs: held-out :class:`~prefect_tinker.recipes.preference.PairExample` s.
        loss: the name of a DPO variant (:data:`~prefect_tinker.recipes.preference.DPO_LOSSES`); beta,
            label smoothing; its reference values are replaced).
        reference: the reference weights; via: ``trainer`` or ``sampler`` (see
            :mod:`prefect_tinker.tasks.reference`).
    """

    name = "preference"

    def __init__(
        self,
        pairs: list[Any],
        *,
        beta: float,
        loss: str,
        label_smoothing: float,
        reference: str,
        via: Literal["trainer", "sampler"] = "trainer",
        prefix: str = "test",
        seed: int | None = None,
    ):
        from prefect_tinker.recipes.preference import pair_datums

        self.datums, self.prefix = pair_datums(list(pairs)), prefix
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.reference, self.via, self.seed = reference, via, seed

    def evaluate(self, credentials: TinkerCredentials, run: TrainingRun) -> dict[str, float]:
        import torch

        from prefect_tinker.recipes.preference import DPOLoss, pair_accuracy
        from prefect_tinker.tasks.reference import reference_input_tokens, reference_sequence_logprobs

        if not self.datums:
            return {}
        ref, cached = run_task(
            reference_sequence_logprobs.with_options(task_run_name=f"reference-{self.prefix}"),
            credentials,
            self.reference,
            quote(self.datums),
            self.via,
            self.seed,
        )
        prefill = float(model_input_tokens(self.datums))
        if not cached:
            prefill += reference_input_tokens(self.datums, self.via)
        out = forward.with_options(task_run_name=f"eval-pairs-step-{run.step}")(credentials, run, quote(self.datums))
        loss = DPOLoss(ref, self.beta, self.loss, self.label_smoothing)
        with torch.no_grad():
            # float32, as the training step's custom loss gets them: the policy's and the reference's sums are the
            # same float32 dot product, so an unchanged policy ties exactly (h = 0)
            h, _, _ = loss.pair_terms(self.datums, [torch.tensor(lp, dtype=torch.float32) for lp in out.logprobs])
            values = loss.values(h)
        return {
            f"{self.prefix}/dpo_loss": float(values.mean()),
            f"{self.prefix}/accuracy": pair_accuracy(h),
            f"{self.prefix}/margin": float((self.beta * h).mean()),
            f"{self.prefix}/pairs": float(len(h)),
            "tokens/eval_prefill": prefill,
        }


class ClassifierAccuracyEvaluator(SamplingClientEvaluator):
    """Accuracy of a classifier trained to answer ``"{answer_prefix} {label}"`` (e.g. the VLM
    classifier: "What is the name of the subject in this photo?" / "The subject in this photo is:
    <label>"), sampled greedily (temperature 0) as in the Tinker cookbook's classifier eval.

    For each held-out example: the prompt is the example up to its first trained token (images
    and audio kept) followed by ``answer_prefix`` (prefill); the model completes it up to the
    renderer's stop sequence; the prediction is the text after the last ``:`` of prefix +
    completion, stripped and lower-cased, and the label is read the same way from the example's
    trained text.  Returns ``{prefix}/accuracy`` (fraction correct) and ``{prefix}/accuracy_n``.

    Args:
        examples: held-out :class:`~prefect_tinker.recipes.builders.Example` s (the first
            ``limit`` are scored).
        renderer_name, tokenizer_id: the run's renderer and tokenizer.
        answer_prefix: the text every answer starts with.
        max_tokens: most sampled tokens per answer.
    """

    name = "accuracy"

    def __init__(
        self,
        examples: list,
        renderer_name: str,
        tokenizer_id: str,
        *,
        answer_prefix: str,
        max_tokens: int = 16,
        limit: int = 100,
        prefix: str = "test",
    ):
        self.examples = list(examples)[:limit]
        self.renderer_name, self.tokenizer_id = renderer_name, tokenizer_id
        self.answer_prefix, self.max_tokens, self.prefix = answer_prefix, max_tokens, prefix

    @staticmethod
    def answer(text: str) -> str:
        """The class name in an answer: after the last ``:``, stripped, lower case."""
        return text.split(":")[-1].strip().lower()

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        from prefect_tinker.recipes.rl.problem_env import load_renderer
        from prefect_tinker.tasks.sampling import completion_tokens, sample_completions

        if not self.examples:
            return {}
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        prefill = renderer.encode(self.answer_prefix)
        prompts, labels = [], []
        for ex in self.examples:
            prompts.append(ex.prompt() + prefill)
            trained = [t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0]
            labels.append(self.answer(renderer.parse_response(trained).message.get("content") or ""))
        outs, cached = run_task(
            sample_completions.with_options(task_run_name=f"eval-accuracy-step-{step}"),
            credentials,
            sampler_path,
            quote(prompts),
            max_tokens=self.max_tokens,
            temperature=0.0,
            stop=renderer.get_stop_sequences(),
        )
        hits = []
        for out, label in zip(outs, labels, strict=True):
            text = renderer.parse_response(out[0]["tokens"]).message.get("content") or ""
            hits.append(float(self.answer(self.answer_prefix + text) == label))
        return {
            f"{self.prefix}/accuracy": sum(hits) / len(hits),
            f"{self.prefix}/accuracy_n": float(len(hits)),
            **({} if cached else completion_tokens(prompts, outs)),
        }


class TranscriptionEvaluator(SamplingClientEvaluator):
    """Word error rate of greedy transcripts of held-out (audio, transcript) examples.

    The prompt is each example up to its first trained token (the audio kept); the reply, up to
    the renderer's stop sequence, is compared with the example's trained text by
    :func:`~prefect_tinker.recipes.grading_text.word_error_rate`.  Returns ``{prefix}/wer``
    (mean over examples), ``{prefix}/exact`` (fraction with WER 0) and ``{prefix}/wer_n``.
    """

    name = "wer"

    def __init__(
        self,
        examples: list,
        renderer_name: str,
        tokenizer_id: str,
        *,
        max_tokens: int = 32,
        limit: int = 100,
        prefix: str = "test",
    ):
        self.examples = list(examples)[:limit]
        self.renderer_name, self.tokenizer_id = renderer_name, tokenizer_id
        self.max_tokens, self.prefix = max_tokens, prefix

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        from prefect_tinker.recipes.grading_text import word_error_rate
        from prefect_tinker.recipes.rl.problem_env import load_renderer
        from prefect_tinker.tasks.sampling import completion_tokens, sample_completions

        if not self.examples:
            return {}
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        refs = [
            renderer.parse_response([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0]).message.get(
                "content"
            )
            or ""
            for ex in self.examples
        ]
        prompts = [ex.prompt() for ex in self.examples]
        outs, cached = run_task(
            sample_completions.with_options(task_run_name=f"eval-wer-step-{step}"),
            credentials,
            sampler_path,
            quote(prompts),
            max_tokens=self.max_tokens,
            temperature=0.0,
            stop=renderer.get_stop_sequences(),
        )
        wers = [
            word_error_rate(renderer.parse_response(o[0]["tokens"]).message.get("content") or "", r)
            for o, r in zip(outs, refs, strict=True)
        ]
        return {
            f"{self.prefix}/wer": sum(wers) / len(wers),
            f"{self.prefix}/exact": sum(w == 0 for w in wers) / len(wers),
            f"{self.prefix}/wer_n": float(len(wers)),
            **({} if cached else completion_tokens(prompts, outs)),
        }


def data_evaluators(builder: DatasetBuilder | None, data: SupervisedData, tokenizer_id: str) -> list[Evaluator]:
    """The evaluators a dataset's format asks for besides held-out NLL: a
    :class:`ClassifierAccuracyEvaluator` for classification formats (``image_folder``,
    ``image_classification``: option ``answer_prefix``), a :class:`TranscriptionEvaluator` for
    ``audio_transcript``; each on the first ``eval_limit`` (option, default 100) test examples."""
    from prefect_tinker.recipes.media_sources import CLASSIFICATION_FORMATS, ClassificationOptions, TranscriptOptions

    sources = list(builder.sources) if builder is not None else []
    if not sources or not data.test:
        return []
    out: list[Evaluator] = []
    classify = [s.options for s in sources if s.format in CLASSIFICATION_FORMATS]
    if classify and isinstance(classify[0], ClassificationOptions):
        opts = classify[0]
        out.append(
            ClassifierAccuracyEvaluator(
                data.test, data.renderer, tokenizer_id, answer_prefix=opts.answer_prefix, limit=opts.eval_limit
            )
        )
    speech = [s.options for s in sources if s.format == "audio_transcript"]
    if speech and isinstance(speech[0], TranscriptOptions):
        out.append(TranscriptionEvaluator(data.test, data.renderer, tokenizer_id, limit=speech[0].eval_limit))
    return out
