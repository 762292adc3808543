"""Decisions (a distribution over named choices) as one Prefect flow, on the recipe skeleton.

The run session opens or resumes the run; the records are rendered once by the cached
``prepare-dataset`` task (:class:`~prefect_tinker.recipes.decisions.DecisionBuilder`); each step
takes ``batch_size`` examples (a function of seed and step) and trains them in one
``forward_backward_custom`` request with the server-side custom loss
:func:`~prefect_tinker.recipes.decisions.choice_loss` (cross-entropy to hard labels, or to soft
labels = KL plus a constant) in the ``custom-step`` task. The
:class:`~prefect_tinker.tasks.decisions.DecisionEvaluator` scores the held-out examples at the
start, every ``eval_every`` steps and at the end, and draws their reliability diagram.

Metrics per step: ``train/ce`` (mean cross-entropy to the targets, nats), ``train/kl``
(``KL(target || p)``), ``train/brier``, ``train/accuracy`` (of the batch before the update),
``train/loss_sum``, ``train/learning_rate``; ``test/accuracy``, ``test/brier``, ``test/nll``,
``test/ece`` at evaluation steps.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, cast

from prefect import get_run_logger
from pydantic import Field, field_validator

from prefect_tinker.flows.config import RecipeConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.builders import SourceFields
from prefect_tinker.recipes.data_pipeline import batch_at
from prefect_tinker.recipes.decisions import DecisionBuilder, DecisionData, decision_datum
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.tasks.data import prepare_dataset
from prefect_tinker.tasks.decisions import DecisionEvaluator, choice_loss_handle
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.training import custom_step

__all__ = ["DecisionsConfig", "decisions_flow"]


class DecisionsConfig(SourceFields, RecipeConfig):
    """Parameters of a decisions run (the flow's single parameter)."""

    recipe: ClassVar[str] = "decisions"

    dataset: str | None = Field(
        default="builtin:sentiment_sentences",
        description=(
            "Records: a JSONL file, dataset directory or Hugging Face id (default: 64 sentences labelled "
            "positive/negative)."
        ),
    )
    choices: Annotated[list[str], RESUME] = Field(
        default_factory=lambda: ["positive", "negative"],
        min_length=2,
        description="The choice names (their first tokens must differ).",
    )
    prompt_field: Annotated[str, RESUME] = Field(
        default="text", description="Record field holding the prompt (a string or messages)."
    )
    label_field: Annotated[str, RESUME] = Field(
        default="label", description="Record field holding a hard label (one of the choices)."
    )
    probs_field: Annotated[str, RESUME] = Field(
        default="probs",
        description=(
            "Record field holding soft labels ({choice: p} or N probabilities); preferred over label_field when "
            "present."
        ),
    )
    instruction: Annotated[bool, RESUME] = Field(
        default=True, description="Append 'Answer with one of: ...' to the prompt."
    )
    batch_size: Annotated[int, RESUME] = Field(default=8, ge=1, description="Examples per step.")
    num_epochs: int = Field(default=1, ge=1, description="Epochs when max_steps is not set.")
    learning_rate: float = Field(default=1e-4, gt=0, description="Peak learning rate.")
    test_size: float = Field(
        default=0.25, ge=0, description="Held-out fraction (<1) or count (>=1), split with `seed`."
    )
    calibration_bins: int = Field(
        default=10, ge=2, description="Confidence bins of the ECE and the reliability diagram."
    )

    @field_validator("choices")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v) or any(not c.strip() for c in v):
            raise ValueError(f"choices must be distinct non-empty names, got {v}")
        return v

    def dataset_builder(self, renderer: str) -> DecisionBuilder:
        """The decision records of this run for the (resolved) ``renderer``."""
        return DecisionBuilder(
            sources=self.source_specs(),
            renderer=renderer,
            seed=self.seed,
            choices=self.choices,
            prompt_field=self.prompt_field,
            label_field=self.label_field,
            probs_field=self.probs_field,
            instruction=self.instruction,
            max_length=self.max_length,
            on_error=self.on_error,
            test_size=self.test_count(),
        )


@recipe_flow("decisions", "decisions-{config.run_name}")
def decisions_flow(config: DecisionsConfig) -> dict[str, Any]:
    """Train ``config.model`` to put calibrated probabilities on ``config.choices``; returns a
    summary (first and last held-out accuracy, Brier and ECE, steps, checkpoints)."""
    log = get_run_logger()
    with RunSession(config) as session:
        data = cast(DecisionData, prepare_dataset(session.dataset_builder, session.tokenizer_id))
        total = config.max_steps or len(data.train) // config.batch_size * config.num_epochs
        log.info(
            "%d train / %d test examples over %s (label tokens %s), %d steps; %s",
            len(data.train),
            len(data.test),
            data.choices,
            data.label_tokens,
            total,
            data.skip_summary,
        )
        loss = choice_loss_handle(session.credentials)

        def one_step(step: int) -> dict[str, float]:
            batch = [data.train[i] for i in batch_at(len(data.train), config.batch_size, config.seed, step)]
            datums = [decision_datum(ex, data.label_tokens) for ex in batch]
            session.run, m = custom_step(
                session.credentials,
                session.run,
                step,
                quote(datums),
                loss,
                config.lr_at(step, total),
                config.adam.model_dump(),
            )
            n = float(len(batch))
            out = {f"train/{k}": v for k, v in m.items() if not k.startswith("custom/")}
            out.update(
                {
                    "train/ce": m["custom/ce"] / n,
                    "train/kl": m["custom/kl"] / n,
                    "train/brier": m["custom/brier"] / n,
                    "train/accuracy": m["custom/correct"] / n,
                    "train/examples": n,
                }
            )
            return out

        evaluators = (
            [
                DecisionEvaluator(
                    data.test,
                    data.label_tokens,
                    store=str(config.store),
                    run_id=session.run_id,
                    n_bins=config.calibration_bins,
                )
            ]
            if data.test
            else []
        )
        StepLoop(session, total, evaluators=evaluators).run(one_step)
        ends = {name: session.metric_ends(f"test/{name}") for name in ("accuracy", "brier", "ece")}
        return session.finish(
            {f"{end}_test_{name}": v[i] for name, v in ends.items() for i, end in enumerate(("first", "last"))},
            title_fields={"dataset": f"`{config.dataset}`", "choices": ", ".join(config.choices)},
        )
