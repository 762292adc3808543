"""A pairwise reward model as one Prefect flow, on the recipe skeleton.

The run session opens or resumes the run; comparisons are read like DPO's and rendered once by
the cached ``prepare-dataset`` task as reward-model examples
(:class:`~prefect_tinker.recipes.reward_model.RewardModelBuilder`: the prompt messages, the two
completions, the question, and the label as the only trained tokens; both orders, or one seeded
order); each step trains ``batch_size`` comparisons (all their orders) with ``cross_entropy``
(``train-step``). Held-out accuracy and calibration from the label probabilities of the step's
sampler weights (:class:`~prefect_tinker.tasks.reward_model.RewardModelEvaluator`) at the start,
every ``eval_every`` steps and at the end. The final sampler weights are recorded (the RL stage
of RLHF scores with them) and returned as ``sampler_path``.

Metrics: ``train/loss`` (nats per label token; ``ln 2`` is a model that says A and B equally),
``train/tokens``, ``train/learning_rate``; ``eval/rm_accuracy``, ``eval/rm_accuracy_stderr``,
``eval/rm_brier``, ``eval/rm_prob_a``, ``eval/rm_pairs`` at evaluation steps.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from prefect import get_run_logger
from pydantic import Field, model_validator

from prefect_tinker.flows.config import RecipeConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.builders import PreferenceSourceFields
from prefect_tinker.recipes.data_pipeline import batch_at
from prefect_tinker.recipes.datasets import datum_from_example
from prefect_tinker.recipes.progress import phase
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.recipes.reward_model import DEFAULT_QUESTION, ComparisonFormat, RewardModelBuilder, RewardModelData
from prefect_tinker.tasks.data import prepare_dataset
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.reward_model import RewardModelEvaluator
from prefect_tinker.tasks.training import train_step

__all__ = ["RewardModelConfig", "reward_model_flow"]


class RewardModelConfig(PreferenceSourceFields, RecipeConfig):
    """Parameters of a reward-model run (the flow's single parameter)."""

    recipe: ClassVar[str] = "reward_model"

    batch_size: Annotated[int, RESUME] = Field(
        default=8, ge=1, description="Comparisons per step (each trained in all its orders)."
    )
    num_epochs: int = Field(default=1, ge=1, description="Epochs when max_steps is not set.")
    learning_rate: float = Field(default=3e-4, gt=0, description="Peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    max_length: int = Field(
        default=1024, ge=8, description="Most tokens of one rendered comparison (longer ones are skipped and counted)."
    )
    test_size: float = Field(
        default=64, ge=0, description="Held-out comparisons: a count (>=1) or a fraction (<1), split with `seed`."
    )
    orders: Annotated[Literal["both", "swap"], RESUME] = Field(
        default="both",
        description="Train each comparison in both orders, or in one order drawn with the seed (position bias).",
    )
    question: Annotated[str, RESUME] = Field(
        default=DEFAULT_QUESTION, description="The question after the two completions."
    )
    labels: Annotated[tuple[str, str], RESUME] = Field(
        default=("A", "B"), description="The answers meaning 'A is better' and 'B is better'."
    )

    @model_validator(mode="after")
    def _check(self) -> RewardModelConfig:
        if self.format not in ("preference", "dialogue", "hh") and not self.sources:
            raise ValueError(
                f"format {self.format!r}: a reward model's dataset is 'preference' or 'dialogue' (HH-RLHF)"
            )
        ComparisonFormat(question=self.question, labels=self.labels)
        return self

    def run_name_prefix(self) -> str:
        return f"rm-{self.model.replace('/', '-')}"

    def dataset_builder(self, renderer: str) -> RewardModelBuilder:
        """The comparisons of this run for the (resolved) ``renderer``."""
        return RewardModelBuilder(
            sources=self.source_specs(),
            renderer=renderer,
            seed=self.seed,
            max_length=self.max_length,
            on_error=self.on_error,
            test_size=self.test_count(),
            orders=self.orders,
            question=self.question,
            labels=self.labels,
        )


@recipe_flow("reward_model", "rm-{config.run_name}")
def reward_model_flow(config: RewardModelConfig) -> dict[str, Any]:
    """Train ``config.model`` to judge the comparisons of ``config.dataset``; returns a summary
    (losses, held-out accuracy and Brier score at the start and the end, ``sampler_path``)."""
    log = get_run_logger()
    with RunSession(config) as session:
        with phase(session.run_id, "preparing the dataset (reading, rendering, tokenizing; cached)"):
            data = cast(RewardModelData, prepare_dataset(session.dataset_builder, session.tokenizer_id))
        total = config.max_steps or len(data.train) // config.batch_size * config.num_epochs
        log.info(
            "%d train / %d test comparisons (%s orders), %d steps (renderer %s); %s",
            len(data.train),
            len(data.test),
            config.orders,
            total,
            data.renderer,
            data.skip_summary,
        )

        def one_step(step: int) -> dict[str, float]:
            chosen = [data.train[i] for i in batch_at(len(data.train), config.batch_size, config.seed, step)]
            datums = [datum_from_example(ex.tokens, ex.weights) for pair in chosen for ex in pair.examples]
            session.run, m = train_step(
                session.credentials,
                session.run,
                step,
                quote(datums),
                config.lr_at(step, total),
                config.adam.model_dump(),
            )
            return {f"train/{k}": v for k, v in m.items()}

        evaluators = [RewardModelEvaluator(data.test)] if data.test else []
        StepLoop(session, total, evaluators=evaluators).run(one_step)
        if session.step not in session.samplers:
            session.save_sampler(record=True, asset=True)
        sampler = session.samplers[session.step]
        (first_loss, last_loss) = session.metric_ends("train/loss")
        (first_acc, last_acc), (_, last_brier) = (
            session.metric_ends("eval/rm_accuracy"),
            session.metric_ends("eval/rm_brier"),
        )
        return session.finish(
            {
                "first_loss": first_loss,
                "last_loss": last_loss,
                "first_accuracy": first_acc,
                "last_accuracy": last_acc,
                "last_brier": last_brier,
                "sampler_path": sampler,
            },
            title_fields={"dataset": f"`{config.dataset}`", "orders": config.orders},
        )
