"""Supervised fine-tuning as one Prefect flow.

Pipeline: resolve the backend -> open (or resume) the training run -> prepare the dataset (cached by
content) -> loop over steps (``train-step`` tasks; NLL evaluation every ``eval_every``; a state
checkpoint every ``save_every``, recorded in the training store with the metrics before it) ->
sampler weights -> sample completions for held-out prompts -> the run's store tables compacted to one
part each (``compact-run``) -> summary artifact.

Step convention: a value recorded at step ``s`` was computed by weights that had taken ``s``
optimizer steps (train loss of the batch at index ``s``; test NLL after ``s`` updates; a checkpoint
at ``s``). Re-running with the same ``run_name`` resumes after the last state checkpoint: weights,
optimizer state and data position (batches are a function of seed and step).
"""

from __future__ import annotations

import math
import time
from importlib import resources
from typing import Any, Literal

import numpy as np
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.utilities.annotations import quote
from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_tinker.flows.config import AdamConfig, BackendConfig, default_run_name, default_store_root, resolve_credentials
from prefect_tinker.recipes.data_reading import check_local_source
from prefect_tinker.tasks.data import PreparedDataset, dataset_uri, prepare_sft_dataset
from prefect_tinker.tasks.records import check_store, compact_finished_run, record_checkpoint, record_run, write_metrics
from prefect_tinker.tasks.reporting import Progress, report_run
from prefect_tinker.tasks.sampling import sample_completions
from prefect_tinker.tasks.training import ClientRewound, TrainingRun, evaluate_nll, open_training_run, save_checkpoint, train_step

__all__ = ["SFTConfig", "sft_flow", "lr_at", "batch_indices"]


def _example_dataset() -> str:
    return str(resources.files("prefect_tinker.recipes") / "data" / "example_chat.jsonl")


class SFTConfig(BaseModel):
    """Parameters of a supervised fine-tuning run (the flow's single parameter)."""

    model: str = Field(default="tiny", description="Base model: 'tiny', 'smollm2', a local HF directory, or a hosted model name.")
    dataset: str = Field(default_factory=_example_dataset, description="JSONL file of {'messages': [...]} or a Hugging Face dataset id.")
    messages_field: str = Field(default="messages", description="Field holding the message list.")
    renderer: str = Field(default="auto", description="'auto' (the tokenizer's chat template, else role_colon), 'chat_template' or 'role_colon'.")
    train_on_what: str = Field(default="all_assistant_messages", description="Which tokens get loss weight.")
    max_length: int = Field(default=512, ge=8, description="Truncate examples to this many tokens.")
    test_size: float = Field(default=0.1, ge=0, description="Held-out fraction (<1) or count (>=1).")
    batch_size: int = Field(default=8, ge=1, description="Conversations per step.")
    learning_rate: float = Field(default=5e-4, gt=0, description="Peak learning rate (LoRA wants ~10x the full fine-tuning rate).")
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(default=0, ge=0)
    lora_rank: int = Field(default=32, ge=1)
    max_steps: int | None = Field(default=None, ge=1, description="Total optimizer steps; default num_epochs x batches per epoch.")
    num_epochs: int = Field(default=1, ge=1)
    eval_every: int = Field(default=10, ge=0, description="Test NLL every n steps (0 = start and end only).")
    save_every: int = Field(default=20, ge=0, description="State checkpoint every n steps (0 = end only).")
    run_name: str | None = Field(default=None, description="Run id; re-running with the same name resumes.")
    store: str = Field(default_factory=default_store_root, description="Training store root: a folder or s3://bucket/prefix; default $PREFECT_TINKER_STORE, else ~/.prefect-tinker/store (where prefect-tinker sql/runs look).")
    seed: int = 0
    adam: AdamConfig = Field(default_factory=AdamConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    num_eval_samples: int = Field(default=3, ge=0, description="Held-out prompts to sample completions for at the end.")
    sample_max_tokens: int = Field(default=64, ge=1)
    sample_temperature: float = Field(default=0.7, ge=0)

    _dataset_exists = field_validator("dataset")(check_local_source)  # a missing file fails here

    @model_validator(mode="after")
    def _name(self) -> "SFTConfig":
        if self.run_name is None:  # stable across retries of a deployment's flow run (resumes)
            self.run_name = default_run_name(self.model.replace("/", "-"), self)
        return self


def lr_at(config: SFTConfig, step: int, total: int) -> float:
    """Learning rate at ``step`` (0-based) of ``total``: linear warmup, then constant / linear
    decay to 0 / cosine decay to 0."""
    if config.warmup_steps and step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(total - config.warmup_steps, 1)
    frac = (step - config.warmup_steps) / span
    if config.lr_schedule == "linear":
        return config.learning_rate * (1.0 - frac)
    if config.lr_schedule == "cosine":
        return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * frac))
    return config.learning_rate


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Example indices of the batch at ``step``: epochs are reshuffled permutations (seed + epoch);
    the last incomplete batch of an epoch is dropped. Raises ValueError when ``n_examples < batch_size``."""
    per_epoch = n_examples // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size={batch_size} is larger than the training set ({n_examples} examples)")
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(n_examples)
    return [int(i) for i in order[index * batch_size : (index + 1) * batch_size]]


def _datums(data: PreparedDataset, examples: list, max_length: int) -> list:
    from prefect_tinker.recipes.datasets import datum_from_example

    return [datum_from_example(ex.tokens, ex.weights, max_length) for ex in examples]


@flow(name="sft", flow_run_name="sft-{config.run_name}", log_prints=True)
def sft_flow(config: SFTConfig) -> dict[str, Any]:
    """Fine-tune ``config.model`` on ``config.dataset``; returns a summary (losses, steps, tokens,
    checkpoint paths, sampled completions)."""
    log = get_run_logger()
    credentials = resolve_credentials(config.backend)
    backend = credentials.backend_name()
    run_id = config.run_name
    check_store(config.store)  # wrong credentials / unwritable store: fail before any training
    last = _last_state_checkpoint(config.store, run_id)
    run: TrainingRun = open_training_run(
        credentials, run_id, config.model, config.lora_rank, backend, seed=config.seed,
        resume_from=last["path"] if last else None, resume_step=last["step"] if last else 0,
    )
    if last:
        log.info("resuming run %s after its checkpoint at step %d (%s)", run_id, last["step"], last["path"])
    record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "running")
    try:
        return _train(config, credentials, backend, run, last)
    except BaseException:
        record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "failed")
        raise


def _train(config: SFTConfig, credentials: Any, backend: str, run: TrainingRun, last: dict | None) -> dict[str, Any]:
    log = get_run_logger()
    run_id = run.run_name
    data = prepare_sft_dataset(
        config.dataset, run.tokenizer_id, config.renderer, config.max_length, config.test_size,
        config.seed, config.train_on_what, config.messages_field,
    )
    per_epoch = len(data.train) // config.batch_size
    total = config.max_steps or per_epoch * config.num_epochs
    test_datums = _datums(data, data.test, config.max_length)
    log.info("%d train / %d test examples, %d steps (renderer %s)%s", len(data.train), len(data.test), total,
             data.renderer, f"; {data.skipped} conversation(s) skipped: no trained token within max_length="
             f"{config.max_length}" if getattr(data, "skipped", 0) else "")

    pending: list[tuple[int, str, float]] = []
    progress = Progress(f"SFT {run_id}: steps done of {total}", total, run.step)
    if run.step == 0 and test_datums:
        pending += _nll_rows(credentials, run, test_datums, 0)
    rewinds = 0
    while run.step < total:
        step = run.step
        batch = [data.train[i] for i in batch_indices(len(data.train), config.batch_size, config.seed, step)]
        try:
            run, m = train_step(
                credentials, run, step, quote(_datums(data, batch, config.max_length)),  # quote: no input walk
                lr_at(config, step, total), config.adam.model_dump(),
            )
            done = run.step
            pending += [(step, f"train/{k}", v) for k, v in m.items()]
            _after_step(done)
            if test_datums and config.eval_every and done % config.eval_every == 0 and done < total:
                pending += _nll_rows(credentials, run, test_datums, done)
            if (config.save_every and done % config.save_every == 0) or done == total:
                if done == total and test_datums:
                    pending += _nll_rows(credentials, run, test_datums, done)
                run, path = _save(credentials, run, f"{run_id}-step-{done:06d}", data, config)
                write_metrics(config.store, run_id, pending)  # metrics first, then the checkpoint row
                pending = []
                record_checkpoint(config.store, run_id, done, path, "state")
                report_run(config.store, run_id, done)  # latest-metrics table + curves picture
        except ClientRewound as rew:
            rewinds += 1
            if rewinds > 3:
                raise
            log.warning("%s; continuing from step %d", rew, rew.step)
            run = rew.run
            pending = [p for p in pending if p[0] < rew.step]
        progress.update(run.step)
    if pending:
        write_metrics(config.store, run_id, pending)

    samples = _sample(credentials, run, data, config)
    record_run(config.store, run_id, config.model, backend, config.lora_rank, config.model_dump_json(), "completed")
    _before_compaction(run_id)
    compact_finished_run(config.store, run_id)  # one part per table: S3 queries cost a request per part
    summary = {
        "run_name": run_id, "steps": run.step, **_run_totals(config.store, run_id),
        "checkpoints": _checkpoint_paths(config.store, run_id), "samples": samples, "store": config.store,
    }
    _summary_artifact(summary, config)
    return summary


def _after_step(step: int) -> None:
    """Hook called after every completed step (tests use it to interrupt a run)."""


def _nll_rows(credentials: Any, run: TrainingRun, test_datums: list, step: int) -> list[tuple[int, str, float]]:
    """``(step, "test/<name>", value)`` metric rows of the test NLL of ``run``'s current weights
    (quoted: Prefect does not walk the datums looking for futures)."""
    return [(step, f"test/{k}", v) for k, v in evaluate_nll(credentials, run, quote(test_datums)).items()]


def _before_compaction(run_id: str) -> None:
    """Hook called when the run's rows are all written, before they are compacted (tests use it
    to read the parts as written)."""


def _save(credentials: Any, run: TrainingRun, name: str, data: PreparedDataset, config: SFTConfig):
    return save_checkpoint(credentials, run, name, "state", upstream=[dataset_uri(config.dataset)])


def _sample(credentials: Any, run: TrainingRun, data: PreparedDataset, config: SFTConfig) -> list[dict]:
    if not config.num_eval_samples or not data.test:
        return []
    from transformers import AutoTokenizer

    from prefect_tinker.recipes.renderers import get_renderer

    run, sampler_path = save_checkpoint(
        credentials, run, f"{run.run_name}-step-{run.step:06d}", "sampler", upstream=[dataset_uri(config.dataset)]
    )
    record_checkpoint(config.store, run.run_name, run.step, sampler_path, "sampler")
    tokenizer = AutoTokenizer.from_pretrained(run.tokenizer_id)
    renderer = get_renderer(data.renderer, tokenizer)
    prompts, references = [], []
    for ex in data.test[: config.num_eval_samples]:
        # the prompt is the example up to its first trained token
        first = next(i for i, w in enumerate(ex.weights) if w > 0)
        prompts.append(ex.tokens[:first])
        references.append(tokenizer.decode([t for t, w in zip(ex.tokens, ex.weights) if w > 0]))
    outs = sample_completions(
        credentials, sampler_path, prompts, max_tokens=config.sample_max_tokens,
        temperature=config.sample_temperature, seed=config.seed, stop=renderer.get_stop_sequences(),
    )
    return [
        {"prompt": tokenizer.decode(p), "completion": tokenizer.decode(o[0]["tokens"]), "reference": r}
        for p, o, r in zip(prompts, outs, references)
    ]


def _last_state_checkpoint(store: str, run_id: str) -> dict | None:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=store).last_checkpoint(run_id, kind="state")


def _run_totals(store: str, run_id: str) -> dict[str, Any]:
    """Loss at the first and last step, test NLL at start and end, and trained tokens of the whole
    run (all invocations), read back from the training store."""
    from tinker_blocks.stores import TrainingStore

    def ends(name: str) -> tuple[Any, Any]:
        rows = TrainingStore(root=store).query(
            "SELECT arg_min(value, step) AS first, arg_max(value, step) AS last FROM metrics "
            "WHERE run_id = ? AND name = ?", [run_id, name],
        )
        return (rows[0]["first"], rows[0]["last"]) if rows else (None, None)

    first_loss, last_loss = ends("train/loss")
    first_nll, last_nll = ends("test/nll")
    tokens = TrainingStore(root=store).query(
        "SELECT coalesce(sum(value), 0) AS t FROM metrics WHERE run_id = ? AND name = 'train/tokens'", [run_id]
    )[0]["t"]
    return {"first_loss": first_loss, "last_loss": last_loss, "first_test_nll": first_nll,
            "last_test_nll": last_nll, "tokens": float(tokens)}


def _checkpoint_paths(store: str, run_id: str) -> list[str]:
    from tinker_blocks.stores import TrainingStore

    rows = TrainingStore(root=store).query(
        "SELECT path FROM checkpoints WHERE run_id = ? ORDER BY step, kind", [run_id]
    )
    return [r["path"] for r in rows]


def _summary_artifact(summary: dict, config: SFTConfig) -> None:
    lines = [
        f"# SFT run `{summary['run_name']}`",
        "",
        "| field | value |", "|---|---|",
        f"| model | `{config.model}` |",
        f"| dataset | `{config.dataset}` |",
        f"| steps | {summary['steps']} |",
        f"| train loss at start (nats/token) | {summary['first_loss']} |",
        f"| train loss at end (nats/token) | {summary['last_loss']} |",
        f"| test NLL start -> end (nats/token) | {summary['first_test_nll']} -> {summary['last_test_nll']} |",
        f"| trained tokens | {summary['tokens']:.0f} |",
        f"| store | `{summary['store']}` |",
        "", "## Checkpoints", "",
        *[f"- `{p}`" for p in summary["checkpoints"]],
        "", "## Samples", "",
    ]
    for s in summary["samples"]:
        lines += [f"**prompt**: `{s['prompt'][-200:]!r}`", "", f"**completion**: `{s['completion']!r}`", ""]
    create_markdown_artifact("\n".join(lines), key=_artifact_key(summary["run_name"]), description="SFT run summary")


def _artifact_key(run_name: str) -> str:
    return "sft-" + "".join(c if c.isalnum() else "-" for c in run_name.lower())[:60]
