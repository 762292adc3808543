"""Supervised fine-tuning in one function: the ``sft`` recipe's algorithm, read top to bottom.

``main(Config(...))`` does what ``prefect-tinker run sft`` does, with the tinker SDK and the same
components, and nothing else:

1. a LoRA training client of ``model`` on the server at ``base_url`` (the hosted service when None;
   ``TINKER_API_KEY`` as the SDK reads it), and the tokenizer the server names for the model;
2. the data: :class:`~prefect_tinker.recipes.builders.SupervisedBuilder` reads the conversations,
   holds out ``test_size`` of them and renders each as ``(tokens, weights)`` with the renderer
   (loss weight 1 on the tokens ``train_on_what`` names);
3. for each step, the batch :func:`~prefect_tinker.recipes.data_pipeline.batch_at` picks (epochs in
   a seeded order, the last incomplete batch of an epoch dropped) as next-token datums,
   ``forward_backward`` with ``cross_entropy`` and ``optim_step`` (Adam, Tinker's defaults) at the
   rate :func:`~prefect_tinker.recipes.schedule.lr_at` gives that step;
4. a state checkpoint every ``save_every`` steps and at the end, and the held-out NLL of the final
   weights.

What the flow adds around the same requests (:mod:`prefect_tinker.flows.sft`): Prefect tasks with
retries and caching, a run session that resumes after the last checkpoint, metrics and checkpoints
rows in the store, evaluators during the run, Ctrl-C handling, a client rebuilt when the server
loses it, and sampled completions at the end. ``tests/test_reference_loops.py`` checks that this loop
and the flow send the same training requests and end with the same weights.

Run: ``python -m prefect_tinker.recipes.loops.sl_loop --base-url http://127.0.0.1:8000 --model tiny``
(the options are :class:`Config`'s fields).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Literal

import tinker
from pydantic import Field

from prefect_tinker.recipes.builders import EXAMPLE_CHATS, SupervisedBuilder
from prefect_tinker.recipes.data_pipeline import DataOrder, batch_at
from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.renderers import resolve_renderer_name
from prefect_tinker.recipes.schedule import LRScheduleFields
from prefect_tinker.recipes.tokenizers import resolve_tokenizer

__all__ = ["Config", "main", "train"]

log = logging.getLogger(__name__)


class Config(LRScheduleFields):
    """A run of the loop (the defaults of :class:`~prefect_tinker.flows.sft.SFTConfig` where it has
    the same field; ``learning_rate``, ``lr_schedule``, ``warmup_steps``, ``min_lr``: the shared
    schedule's fields)."""

    base_url: str | None = Field(default=None, description="Tinker-compatible server; None: the hosted service.")
    model: str = "tiny"
    tokenizer: str | None = Field(default=None, description="Tokenizer directory or id; None: the server's.")
    lora_rank: int = Field(default=32, ge=1)
    seed: int = 0
    dataset: str = Field(default=EXAMPLE_CHATS, description="JSONL of {'messages': [...]} (or another format).")
    format: str = "messages"
    renderer: str = Field(default="auto", description="A registered renderer, or auto (from the chat template).")
    train_on_what: str = "all_assistant_messages"
    max_length: int = Field(default=512, ge=8)
    on_too_long: Literal["truncate", "truncate_keep", "skip", "error"] = "truncate"
    test_size: float = Field(default=0.1, ge=0, description="Held-out fraction (<1) or count (>=1).")
    data_order: DataOrder = "seeded"
    batch_size: int = Field(default=8, ge=1)
    reduction: Literal["none", "mean"] = "none"
    learning_rate: float = 5e-4
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    max_steps: int | None = Field(default=None, ge=1, description="Steps; None: num_epochs over the data.")
    num_epochs: int = Field(default=1, ge=1)
    save_every: int = Field(default=0, ge=0, description="State checkpoint every n steps (0: at the end only).")
    name: str = Field(default="sl-loop", description="Checkpoint names start with it.")


def main(config: Config) -> dict[str, Any]:
    """:func:`train` with a service client of ``config.base_url``, closed at the end."""
    with tinker.ServiceClient(base_url=config.base_url) as service:
        return train(service, config)


def train(service: tinker.ServiceClient, config: Config) -> dict[str, Any]:
    """Train as the module docstring says; returns ``losses`` (per step, nats per trained token),
    ``learning_rates``, ``test_nll`` (nats per token; None without held-out examples),
    ``checkpoints`` (``tinker://`` state paths) and ``steps``.

    Raises:
        ValueError: fewer training examples than ``batch_size``; the server names no tokenizer and
            ``tokenizer`` is unset; the builder's errors for bad data (naming file, line and field).
    """
    # 1. the clients: one LoRA training client; the tokenizer the server names for the model
    training = service.create_lora_training_client(
        base_model=config.model, rank=config.lora_rank, seed=config.seed
    ).result()
    tokenizer_id = config.tokenizer or training.get_info().model_data.tokenizer_id
    if tokenizer_id is None:
        raise ValueError(f"the server names no tokenizer for model {config.model!r}: give tokenizer=<directory or id>")
    tokenizer = resolve_tokenizer(tokenizer_id)
    renderer = resolve_renderer_name(config.renderer, tokenizer)

    # 2. the data: read, split, render (tokens and loss weights per example)
    data = SupervisedBuilder(
        sources=[SourceSpec(path=config.dataset, format=config.format)],
        renderer=renderer,
        seed=config.seed,
        train_on_what=config.train_on_what,
        max_length=config.max_length,
        on_too_long=config.on_too_long,
        test_size=int(config.test_size) if config.test_size >= 1 else config.test_size,
        data_order=config.data_order,
    ).build(tokenizer)
    if len(data.train) < config.batch_size:
        raise ValueError(f"batch_size={config.batch_size} is larger than the training set ({len(data.train)} examples)")
    total = config.max_steps or len(data.train) // config.batch_size * config.num_epochs
    keep_untrained = config.on_too_long == "truncate_keep"

    # 3. the steps: batch -> forward_backward -> optim_step at the schedule's rate
    losses, rates, checkpoints = [], [], []
    for step in range(total):
        batch = batch_at(len(data.train), config.batch_size, config.seed, step, config.data_order)
        datums = [data.train[i].datum(reduction=config.reduction, keep_untrained=keep_untrained) for i in batch]
        lr = config.lr_at(step, total)
        # submitted back to back: the server runs them in order; the futures are awaited after
        fwd_bwd = training.forward_backward(datums, "cross_entropy")
        optim = training.optim_step(tinker.AdamParams(learning_rate=lr))
        loss_sum = fwd_bwd.result().metrics["loss:sum"]
        optim.result()
        trained = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in datums)
        losses.append(loss_sum / max(trained, 1e-9))
        rates.append(lr)
        log.info("step %d/%d: loss %.4f, lr %.3g", step + 1, total, losses[-1], lr)

        # 4. checkpoints: every save_every steps and at the end (weights and optimizer state)
        if step + 1 == total or (config.save_every and (step + 1) % config.save_every == 0):
            checkpoints.append(training.save_state(f"{config.name}-step-{step + 1:06d}").result().path)

    # the held-out NLL of the final weights (forward only: no gradients)
    test = [ex.datum() for ex in data.test if any(ex.weights[1:])]
    test_nll = None
    if test:
        out = training.forward(test, "cross_entropy").result()
        test_nll = out.metrics["loss:sum"] / sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in test)
    return {"steps": total, "losses": losses, "learning_rates": rates, "test_nll": test_nll, "checkpoints": checkpoints}


def _args() -> Config:
    """``Config`` from ``--field value`` options (``--base-url``, ``--model``, ``--dataset``, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, field in Config.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, help=field.description)
    given = {k: v for k, v in vars(parser.parse_args()).items() if v is not None}
    return Config.model_validate(given)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(main(_args()))
