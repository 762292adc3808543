"""Preference learning (DPO, IPO, hinge) as one Prefect flow, on the recipe skeleton.

The run session opens or resumes the run; comparisons are rendered once by the cached
``prepare-dataset`` task (:class:`~prefect_tinker.recipes.preference.PreferenceBuilder`); each step
takes ``batch_size`` pairs (a function of seed and step), gets the reference reply
log-probabilities of the pairs it has not met before from the cached ``reference-sequence-logprobs``
task (the initial weights -- the base model or ``load_checkpoint_path`` -- frozen; with
``reference_via=sampler`` a sampler snapshot of the run's initial weights, saved at step 0 and
recorded with the run, as tinker-cookbook's ``save_weights_and_get_sampling_client()``; one pass
per pair for the whole run, kept by pair, so later epochs ask nothing), and trains chosen and
rejected datums in one ``forward_backward_custom`` request with
:class:`~prefect_tinker.recipes.preference.DPOLoss` (``custom-step``; the engine computes each
pair's shared prompt once and packs both replies padding-free). Held-out loss and accuracy every
``eval_every`` steps; checkpoints, resume, store rows and artifacts as for SFT.

Metrics per step: ``train/dpo_loss`` (``ln 2`` at step 0 for ``dpo``: the policy is the
reference), ``train/accuracy``, ``train/margin``, ``train/chosen_reward``,
``train/rejected_reward``, ``train/pairs``, ``train/tokens``; ``test/dpo_loss``,
``test/accuracy``, ``test/margin`` at evaluation steps.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from prefect import get_run_logger
from pydantic import Field, field_validator, model_validator

from prefect_tinker.flows.config import RecipeConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.builders import PreferenceSourceFields
from prefect_tinker.recipes.data_pipeline import DataOrder, batch_at
from prefect_tinker.recipes.preference import DPO_LOSSES, DPOLoss, PreferenceBuilder, PreferenceData, pair_datums
from prefect_tinker.recipes.progress import phase
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.tasks.benchmark_evaluator import benchmark_evaluators
from prefect_tinker.tasks.data import prepare_dataset
from prefect_tinker.tasks.evaluators import PreferenceEvaluator
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.reference import reference_input_tokens, reference_sequence_logprobs
from prefect_tinker.tasks.training import custom_step, model_input_tokens
from prefect_tinker.tasks.usage import run_task

__all__ = ["DPOConfig", "dpo_flow"]


class DPOConfig(PreferenceSourceFields, RecipeConfig):
    """Parameters of a preference-learning run (the flow's single parameter)."""

    recipe: ClassVar[str] = "dpo"

    dataset: str | None = Field(
        default="builtin:example_prefs",
        description=(
            "Comparisons: a JSONL file, dataset directory, Hugging Face id, or builtin:example_prefs (40 bundled "
            "comparisons)."
        ),
    )
    batch_size: Annotated[int, RESUME] = Field(default=8, ge=1, description="Comparisons (pairs) per step.")
    num_epochs: int = Field(default=1, ge=1, description="Epochs when max_steps is not set.")
    learning_rate: float = Field(default=1e-5, gt=0, description="Peak learning rate.")
    test_size: float = Field(
        default=0.1,
        ge=0,
        description=(
            "Held-out comparisons: a count (>=1) or a fraction (<1, at most max_test pairs), split with `seed`."
        ),
    )
    max_test: Annotated[int, RESUME] = Field(
        default=64,
        ge=1,
        description="Most held-out comparisons a test_size fraction gives (each evaluation scores them all).",
    )
    dpo_loss: Annotated[str, RESUME] = Field(
        default="dpo",
        description="DPO variant by name (registry DPO_LOSSES): dpo (sigmoid), ipo, hinge, or a plugin's.",
    )
    beta: Annotated[float, RESUME] = Field(
        default=0.1, gt=0, description="Strength of the implicit KL to the reference (scales the log-ratio)."
    )
    label_smoothing: Annotated[float, RESUME] = Field(
        default=0.0, ge=0, lt=0.5, description="dpo: assumed probability of a flipped label (conservative DPO)."
    )
    reference: Annotated[str | None, RESUME] = Field(
        default=None,
        description="Reference weights: base:<model> or tinker://.../weights/...; default the run's initial weights.",
    )
    reference_via: Annotated[Literal["trainer", "sampler"], RESUME] = Field(
        default="trainer",
        description=(
            "Reference logprobs from a frozen training client (same numerics as the policy) or a sampling client "
            "(without `reference`: of a snapshot of the run's initial weights saved at step 0, as tinker-cookbook "
            "does)."
        ),
    )

    data_order: Annotated[DataOrder, RESUME] = Field(
        default="seeded",
        description=(
            "seeded: epoch e in an order seeded by (seed, e); cookbook: epoch e shuffled by e alone, as "
            "tinker-cookbook 0.6.1's DPO orders a comparison file."
        ),
    )

    @field_validator("dpo_loss")
    @classmethod
    def _known_dpo_loss(cls, name: str) -> str:
        DPO_LOSSES.get_or_raise(name)  # an unknown variant fails here, listing the registered ones
        return name

    @model_validator(mode="after")
    def _check(self) -> DPOConfig:
        if self.dataset is None and not self.sources:
            raise ValueError(
                "dataset: required: a JSONL file of comparisons, a dataset directory or a Hugging Face id "
                "(or sources=[...])"
            )
        if self.format not in ("preference", "dialogue", "hh") and not self.sources:
            raise ValueError(f"format {self.format!r}: a DPO dataset is 'preference' or 'dialogue' (HH-RLHF)")
        if self.reference_via == "sampler" and "/weights/" in (self.reference or ""):
            raise ValueError("reference_via=sampler needs a base:<model> or .../sampler_weights/... reference")
        return self

    def reference_weights(self) -> str:
        """The reference: ``reference``, else the initial weights (``load_checkpoint_path`` or the base model)."""
        return self.reference or self.load_checkpoint_path or f"base:{self.model}"

    def dataset_builder(self, renderer: str) -> PreferenceBuilder:
        """The comparisons of this run for the (resolved) ``renderer``."""
        return PreferenceBuilder(
            sources=self.source_specs(),
            renderer=renderer,
            seed=self.seed,
            max_length=self.max_length,
            on_error=self.on_error,
            test_size=self.test_count(),
            max_test=self.max_test,
        )


def initial_reference(session: RunSession[DPOConfig], config: DPOConfig) -> str:
    """The run's reference weights: ``config.reference_weights()``, except with
    ``reference_via="sampler"`` and no ``reference``: the sampler snapshot of the run's initial
    weights (saved at step 0 and recorded with the run, so a resumed run finds it again), as
    tinker-cookbook 0.6.1's ``train_dpo`` takes its reference from
    ``save_weights_and_get_sampling_client()`` of the fresh training client. A run resumed
    without such a record (started before this snapshot existed) keeps ``reference_weights()``."""
    if config.reference_via != "sampler" or config.reference is not None:
        return config.reference_weights()
    if 0 not in session.samplers and session.step == 0:
        session.save_sampler(record=True)
    return session.samplers.get(0) or config.reference_weights()


@recipe_flow("dpo", "dpo-{config.run_name}")
def dpo_flow(config: DPOConfig) -> dict[str, Any]:
    """Train ``config.model`` on the comparisons of ``config.dataset``; returns a summary (losses,
    accuracies, steps, checkpoints)."""
    log = get_run_logger()
    with RunSession(config) as session:
        with phase(session.run_id, "preparing the dataset (reading, rendering, tokenizing; cached)"):
            data = cast(PreferenceData, prepare_dataset(session.dataset_builder, session.tokenizer_id))
        total = config.max_steps or len(data.train) // config.batch_size * config.num_epochs
        reference = initial_reference(session, session.config)  # references in model= resolved
        log.info(
            "%d train / %d test comparisons, %d steps, reference %s (renderer %s); %s",
            len(data.train),
            len(data.test),
            total,
            reference,
            data.renderer,
            data.skip_summary,
        )
        evaluators = (
            [
                PreferenceEvaluator(
                    data.test,
                    beta=config.beta,
                    loss=config.dpo_loss,
                    reference=reference,
                    label_smoothing=config.label_smoothing,
                    via=config.reference_via,
                    seed=config.seed,
                )
            ]
            if data.test
            else []
        )

        reference_of: dict[int, tuple[float, float]] = {}  # train pair -> (chosen, rejected) reference logprob

        def one_step(step: int) -> dict[str, float]:
            index = batch_at(len(data.train), config.batch_size, config.seed, step, config.data_order)
            pairs = [data.train[i] for i in index]
            datums = pair_datums(pairs)
            new = list(dict.fromkeys(i for i in index if i not in reference_of))  # each pair once per run
            ref_tokens = 0.0
            if new:
                todo = pair_datums([data.train[i] for i in new])
                values, cached = run_task(
                    reference_sequence_logprobs.with_options(task_run_name=f"reference-step-{step}"),
                    session.credentials,
                    reference,
                    quote(todo),
                    config.reference_via,
                    config.seed,
                )
                reference_of.update({i: (values[2 * k], values[2 * k + 1]) for k, i in enumerate(new)})
                ref_tokens = 0.0 if cached else reference_input_tokens(todo, config.reference_via)
            ref = [x for i in index for x in reference_of[i]]
            loss = DPOLoss(ref, config.beta, config.dpo_loss, config.label_smoothing)
            session.run, m = custom_step(
                session.credentials,
                session.run,
                step,
                quote(datums),
                loss,
                config.lr_at(step, total),
                config.adam.model_dump(),
            )
            n = float(model_input_tokens(datums))  # forward_backward_custom: one training pass
            return {
                **{f"train/{k}": v for k, v in m.items()},
                "tokens/trained": n,
                "tokens/prefill_uncached": n,
                "tokens/reference_prefill": ref_tokens,
            }

        StepLoop(session, total, evaluators=[*evaluators, *benchmark_evaluators(session.context)]).run(one_step)
        (first_loss, last_loss), (first_acc, last_acc) = (
            session.metric_ends("train/dpo_loss"),
            session.metric_ends("test/accuracy"),
        )
        return session.finish(
            {
                "first_loss": first_loss,
                "last_loss": last_loss,
                "first_test_accuracy": first_acc,
                "last_test_accuracy": last_acc,
                "pairs": session.metric_sum("train/pairs"),
            },
            title_fields={"dataset": f"`{config.dataset}`", "loss": config.dpo_loss, "beta": config.beta},
        )
