"""Supervised fine-tuning as one Prefect flow, on the recipe skeleton.

The run session (:mod:`prefect_tinker.flows.session`) opens or resumes the run; the data is
rendered once by the cached ``prepare-dataset`` task (:class:`~prefect_tinker.recipes.builders.SupervisedBuilder`:
format, field mapping, several weighted sources); each step trains one batch (``train-step``:
``forward_backward`` + ``optim_step``) with the shared learning-rate schedule; the step loop
(:mod:`prefect_tinker.flows.loop`) evaluates held-out NLL and checkpoints; at the end the final
sampler weights complete a few held-out prompts.

Step convention: a value recorded at step ``s`` was computed by weights that had taken ``s``
optimizer steps (train loss of the batch at index ``s``; test NLL after ``s`` updates; a
checkpoint at ``s``). Batches are a function of (seed, step), so a resumed run continues exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from prefect import get_run_logger
from pydantic import Field

from prefect_tinker.flows.config import RecipeConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.loop import StepLoop
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.builders import EXAMPLE_CHATS, SourceFields, SupervisedBuilder, SupervisedData
from prefect_tinker.recipes.data_pipeline import DataOrder, batch_at
from prefect_tinker.recipes.progress import phase
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.tasks.benchmark_evaluator import benchmark_evaluators
from prefect_tinker.tasks.clients import tokenizer
from prefect_tinker.tasks.data import prepare_dataset
from prefect_tinker.tasks.evaluators import NLLEvaluator, data_evaluators
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.sampling import sample_completions
from prefect_tinker.tasks.training import model_input_tokens, train_step
from tinker_blocks.model_names import random_init_note

__all__ = ["SFTConfig", "sft_flow"]


class SFTConfig(SourceFields, RecipeConfig):
    """Parameters of a supervised fine-tuning run (the flow's single parameter)."""

    recipe: ClassVar[str] = "sft"

    dataset: str | None = Field(
        default=EXAMPLE_CHATS,
        description=(
            "JSONL file of {'messages': [...]} (or another format), a dataset directory, 'builtin:example_chat' or a "
            "Hugging Face dataset id."
        ),
    )
    messages_field: Annotated[str, RESUME] = Field(
        default="messages", description="Field holding the message list (format=messages)."
    )
    train_on_what: Annotated[str, RESUME] = Field(
        default="all_assistant_messages", description="Which tokens get loss weight."
    )
    on_too_long: Annotated[Literal["truncate", "truncate_keep", "skip", "error"], RESUME] = Field(
        default="truncate",
        description=(
            "An example longer than max_length: truncate (skipped, counted, when nothing trained is left), "
            "truncate_keep (kept even then, with zero weights, as tinker-cookbook does), skip (counted) or error."
        ),
    )
    batch_size: Annotated[int, RESUME] = Field(default=8, ge=1, description="Conversations per step.")
    reduction: Annotated[Literal["none", "mean"], RESUME] = Field(
        default="none",
        description=(
            "Loss weights per example: none = 1 per trained token (the loss sums over tokens, every token counts the "
            "same); mean = divided by the example's trained-token count (every example counts the same: "
            "tinker-cookbook's SFT default)."
        ),
    )
    data_order: Annotated[DataOrder, RESUME] = Field(
        default="seeded",
        description=(
            "seeded: epoch e in an order seeded by (seed, e), the test split keeping file order; cookbook: "
            "tinker-cookbook 0.6.1's order (records shuffled by seed, the first test_size held out, epoch e "
            "shuffled by e alone)."
        ),
    )
    learning_rate: float = Field(
        default=5e-4, gt=0, description="Peak learning rate (LoRA wants ~10x the full fine-tuning rate)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    num_epochs: int = Field(default=1, ge=1, description="Epochs when max_steps is not set.")
    num_eval_samples: int = Field(default=3, ge=0, description="Held-out prompts to sample completions for at the end.")
    sample_max_tokens: int = Field(default=64, ge=1)
    sample_temperature: float = Field(default=0.7, ge=0)

    def dataset_builder(self, renderer: str) -> SupervisedBuilder:
        """The data of this run for the (resolved) ``renderer``."""
        specs = self.source_specs()
        if self.messages_field != "messages" and not self.sources:
            specs = [specs[0].model_copy(update={"fields": {"messages": self.messages_field, **specs[0].fields}})]
        return SupervisedBuilder(
            sources=specs,
            renderer=renderer,
            seed=self.seed,
            train_on_what=self.train_on_what,
            max_length=self.max_length,
            on_too_long=self.on_too_long,
            on_error=self.on_error,
            test_size=self.test_count(),
            data_order=self.data_order,
        )


@recipe_flow("sft", "sft-{config.run_name}")
def sft_flow(config: SFTConfig) -> dict[str, Any]:
    """Fine-tune ``config.model`` on ``config.dataset``; returns a summary (losses, steps, tokens,
    checkpoint paths, sampled completions)."""
    log = get_run_logger()
    with RunSession(config) as session:
        with phase(session.run_id, "preparing the dataset (reading, rendering, tokenizing; cached)"):
            data = cast(SupervisedData, prepare_dataset(session.dataset_builder, session.tokenizer_id))
        per_epoch = len(data.train) // config.batch_size
        total = config.max_steps or per_epoch * config.num_epochs
        test = [ex.datum() for ex in data.test if any(ex.weights[1:])]  # its media read by reference
        log.info(
            "%d train / %d test examples, %d steps (renderer %s); %s",
            len(data.train),
            len(data.test),
            total,
            data.renderer,
            data.skip_summary,
        )

        def one_step(step: int) -> dict[str, float]:
            order = batch_at(len(data.train), config.batch_size, config.seed, step, config.data_order)
            keep = config.on_too_long == "truncate_keep"
            datums = [data.train[i].datum(reduction=config.reduction, keep_untrained=keep) for i in order]
            session.run, m = train_step(
                session.credentials,
                session.run,
                step,
                quote(datums),  # quote: no input walk
                config.lr_at(step, total),
                config.adam.model_dump(),
            )
            return {**{f"train/{k}": v for k, v in m.items()}, "tokens/trained": float(model_input_tokens(datums))}

        evaluators = [
            *([NLLEvaluator(test)] if test else []),
            *data_evaluators(session.builder, data, session.tokenizer_id),
            *benchmark_evaluators(session.context),
        ]
        StepLoop(session, total, evaluators=evaluators).run(one_step)
        with phase(session.run_id, f"final sampling ({min(config.num_eval_samples, len(data.test))} prompts)"):
            samples = _sample(session, data, config)
        note = random_init_note(session.model, config.backend.is_local()) if samples else None
        return session.finish(
            {**_totals(session), **({"samples_note": note} if note else {}), "samples": samples},
            title_fields={"dataset": f"`{config.dataset}`"},
        )


def _sample(session: RunSession, data: SupervisedData, config: SFTConfig) -> list[dict]:
    """Completions of the first ``num_eval_samples`` held-out prompts (each example up to its first
    trained token) from the final sampler weights."""
    if not config.num_eval_samples or not data.test:
        return []
    from prefect_tinker.recipes.renderers import get_renderer

    sampler_path = session.save_sampler(record=True, asset=True)
    tok = tokenizer(session.tokenizer_id)
    prompts, references = [], []
    for ex in data.test[: config.num_eval_samples]:
        first = next(i for i, w in enumerate(ex.weights) if w > 0)
        prompts.append(ex.sequence()[:first])  # images / audio kept
        references.append(tok.decode([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0]))
    outs = sample_completions(
        session.credentials,
        sampler_path,
        prompts,
        max_tokens=config.sample_max_tokens,
        temperature=config.sample_temperature,
        seed=config.seed,
        stop=get_renderer(data.renderer, tok).get_stop_sequences(),
    )
    return [
        {"prompt": tok.decode(p), "completion": tok.decode(o[0]["tokens"]), "reference": r}
        for p, o, r in zip(prompts, outs, references, strict=True)
    ]


def _totals(session: RunSession) -> dict[str, Any]:
    """Loss at the first and last step, test NLL at start and end, and trained tokens of the whole
    run (all invocations), read back from the training store."""
    (first_loss, last_loss), (first_nll, last_nll) = session.metric_ends("train/loss"), session.metric_ends("test/nll")
    return {
        "first_loss": first_loss,
        "last_loss": last_loss,
        "first_test_nll": first_nll,
        "last_test_nll": last_nll,
        "tokens": session.metric_sum("train/tokens"),
    }
