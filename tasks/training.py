"""Training primitives as Prefect tasks.

A task never receives a live client. It receives the credentials block (picklable) and a small
:class:`TrainingRun` handle, and gets the live ``tinker.TrainingClient`` from a per-process
registry. When the registry has none — a new worker, a crash, or a client poisoned by a failed
request — the client is recreated from the handle's last checkpoint (weights and optimizer state)
and :class:`ClientRewound` tells the caller to continue from that checkpoint's step, so no update
is ever applied twice or lost.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import tinker
from prefect import task
from prefect.assets import materialize
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from prefect_tinker.tasks.policies import RETRY_OPTIONS

__all__ = [
    "TrainingRun",
    "ClientRewound",
    "open_training_run",
    "train_step",
    "save_checkpoint",
    "evaluate_nll",
    "checkpoint_uri",
]


class TrainingRun(BaseModel):
    """A small, picklable handle on one training run (never holds a live client).

    ``step`` counts completed optimizer steps; ``last_checkpoint`` is the ``tinker://.../weights/...``
    path of the newest saved state (weights + optimizer), taken at ``last_checkpoint_step``.
    """

    run_name: str
    base_model: str
    lora_rank: int
    backend: str = Field(description="'local', 'remote' or 'hosted'.")
    seed: int | None = None
    model_id: str | None = None
    tokenizer_id: str | None = None
    step: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_step: int = 0


class ClientRewound(RuntimeError):
    """The live client was lost and was recreated from the checkpoint at ``step``.

    The caller must continue training from ``step`` (the data position is a function of the step).
    """

    def __init__(self, run: TrainingRun, step: int):
        super().__init__(f"training client of run {run.run_name!r} was recreated from its checkpoint at step {step}")
        self.run = run
        self.step = step


_lock = threading.Lock()
_clients: dict[tuple[str, str], tuple[tinker.TrainingClient, int]] = {}


def _key(credentials: Any, run_name: str) -> tuple[str, str]:
    if getattr(credentials, "local", False):
        where = f"local:{credentials.resolved_local_root()}"
    else:
        where = f"{credentials.backend_name()}:{credentials.base_url_for_sdk()}"
    return (where, run_name)


def _register(credentials: Any, run: TrainingRun, client: tinker.TrainingClient) -> TrainingRun:
    info = client.get_info()
    with _lock:
        _clients[_key(credentials, run.run_name)] = (client, run.step)
    return run.model_copy(update={"model_id": str(client.model_id), "tokenizer_id": info.model_data.tokenizer_id})


def _client_for(credentials: Any, run: TrainingRun) -> tinker.TrainingClient:
    """The live client of ``run`` at step ``run.step``, recreating it from the last checkpoint.

    Raises:
        ClientRewound: the client had to be recreated from a checkpoint older than ``run.step``.
    """
    with _lock:
        entry = _clients.get(_key(credentials, run.run_name))
    if entry is not None and entry[1] == run.step:
        return entry[0]
    _forget(credentials, run)
    service = credentials.get_client()
    if run.last_checkpoint is None:
        if run.step != 0:
            raise ClientRewound(run.model_copy(update={"step": 0}), 0)
        client = service.create_lora_training_client(base_model=run.base_model, rank=run.lora_rank, seed=run.seed).result()
    else:
        client = service.create_training_client_from_state_with_optimizer(run.last_checkpoint).result()
    new_run = _register(credentials, run.model_copy(update={"step": run.last_checkpoint_step if run.last_checkpoint else 0}), client)
    if new_run.step != run.step:
        raise ClientRewound(new_run, new_run.step)
    return client


def _forget(credentials: Any, run: TrainingRun) -> None:
    with _lock:
        _clients.pop(_key(credentials, run.run_name), None)


def _advance(credentials: Any, run: TrainingRun, client: tinker.TrainingClient, step: int) -> None:
    with _lock:
        _clients[_key(credentials, run.run_name)] = (client, step)


def checkpoint_uri(run: TrainingRun, name: str, kind: str = "state") -> str:
    """The ``tinker://`` URI a checkpoint named ``name`` of the run's current client gets."""
    folder = "weights" if kind == "state" else "sampler_weights"
    return f"tinker://{run.model_id}/{folder}/{name}"


@task(name="open-training-run", task_run_name="open-{run_name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def open_training_run(
    credentials: Any,
    run_name: str,
    base_model: str,
    lora_rank: int,
    backend: str,
    seed: int | None = None,
    resume_from: str | None = None,
    resume_step: int = 0,
    init_from: str | None = None,
) -> TrainingRun:
    """Create a LoRA training client (or restore one from ``resume_from`` with its optimizer state,
    or start a new run from the weights of ``init_from`` with a fresh optimizer, e.g. RL after SFT;
    save a state checkpoint at step 0 then, so the client can be recreated).

    Returns the run handle at step ``resume_step`` (0 for a new run). Raises the SDK's errors
    for an unknown model or checkpoint (user errors; not retried).
    """
    run = TrainingRun(
        run_name=run_name,
        base_model=base_model,
        lora_rank=lora_rank,
        backend=backend,
        seed=seed,
        step=resume_step if resume_from else 0,
        last_checkpoint=resume_from,
        last_checkpoint_step=resume_step if resume_from else 0,
    )
    _forget(credentials, run)
    service = credentials.get_client()
    if resume_from:
        client = service.create_training_client_from_state_with_optimizer(resume_from).result()
    elif init_from:
        client = service.create_training_client_from_state(init_from).result()
    else:
        client = service.create_lora_training_client(base_model=base_model, rank=lora_rank, seed=seed).result()
    return _register(credentials, run, client)


def _weights_sum(datums: list[tinker.Datum]) -> float:
    total = 0.0
    for d in datums:
        w = d.loss_fn_inputs.get("weights")
        total += float(np.asarray(w.data if hasattr(w, "data") else w, dtype=np.float64).sum()) if w is not None else d.model_input.length
    return total


@task(name="train-step", task_run_name="step-{step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def train_step(
    credentials: Any,
    run: TrainingRun,
    step: int,
    datums: list[tinker.Datum],
    learning_rate: float,
    adam: dict[str, float] | None = None,
    loss_fn: str = "cross_entropy",
) -> tuple[TrainingRun, dict[str, float]]:
    """One optimizer step: ``forward_backward`` and ``optim_step`` submitted back to back, then awaited.

    Args:
        run: handle at ``step`` (the number of steps already taken).
        datums: the batch (D datums).
        learning_rate: this step's learning rate (the schedule is applied by the caller).
        adam: other ``tinker.AdamParams`` fields (beta1, beta2, eps, weight_decay, grad_clip_norm).

    Returns:
        The handle at ``step + 1`` and metrics: ``loss`` (summed loss / trained tokens, nats per
        token), ``loss_sum``, ``tokens`` (sum of weights), ``learning_rate``, ``step_seconds``.

    Raises:
        ClientRewound: the client was lost; continue from the returned step.
    """
    if run.step != step:
        raise ValueError(f"run {run.run_name!r} is at step {run.step}, not {step}")
    client = _client_for(credentials, run)
    t0 = time.perf_counter()
    try:
        fb = client.forward_backward(datums, loss_fn)
        opt = client.optim_step(tinker.AdamParams(learning_rate=learning_rate, **(adam or {})))
        out = fb.result()
        opt.result()
    except Exception:
        _forget(credentials, run)  # a failed request poisons the client; recreate on retry
        raise
    _advance(credentials, run, client, step + 1)
    tokens = _weights_sum(datums)
    loss_sum = float(out.metrics.get("loss:sum", float("nan")))
    metrics = {
        "loss": loss_sum / max(tokens, 1e-9),
        "loss_sum": loss_sum,
        "tokens": tokens,
        "learning_rate": float(learning_rate),
        "step_seconds": time.perf_counter() - t0,
    }
    return run.model_copy(update={"step": step + 1}), metrics


def _save_checkpoint(credentials: Any, run: TrainingRun, name: str, kind: str = "state") -> tuple[TrainingRun, str]:
    """Save the run's current weights: ``kind="state"`` (weights + optimizer, resumable) or
    ``"sampler"`` (weights for a sampling client). Returns the updated handle and the ``tinker://`` path.

    Raises:
        ClientRewound: the client was lost before the save.
    """
    if kind not in ("state", "sampler"):
        raise ValueError(f"checkpoint kind must be 'state' or 'sampler', got {kind!r}")
    client = _client_for(credentials, run)
    try:
        if kind == "state":
            path = client.save_state(name).result().path
        else:
            path = client.save_weights_for_sampler(name).result().path
    except Exception:
        _forget(credentials, run)
        raise
    if kind == "state":
        run = run.model_copy(update={"last_checkpoint": path, "last_checkpoint_step": run.step})
    return run, path


def save_checkpoint(
    credentials: Any, run: TrainingRun, name: str, kind: str = "state", upstream: list[str] | None = None
) -> tuple[TrainingRun, str]:
    """Run the ``save-checkpoint`` task as a Prefect asset materialization.

    The asset key is the checkpoint's ``tinker://`` URI; ``upstream`` (e.g. the dataset URI) are
    recorded as its dependencies, so lineage dataset -> checkpoint shows in Prefect's events.
    """
    materializing = materialize(
        checkpoint_uri(run, name, kind),
        asset_deps=list(upstream or []),
        name="save-checkpoint",
        task_run_name=f"save-{kind}-{name}",
        cache_policy=NO_CACHE,
        **RETRY_OPTIONS,
    )(_save_checkpoint)
    return materializing(credentials, run, name, kind)


@task(name="evaluate-nll", task_run_name="eval-nll-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def evaluate_nll(credentials: Any, run: TrainingRun, datums: list[tinker.Datum]) -> dict[str, float]:
    """Mean negative log-likelihood (nats per trained token) of ``datums`` under the current weights.

    Uses ``forward`` (no gradient). Returns ``{"nll": ..., "tokens": ...}``.
    """
    client = _client_for(credentials, run)
    try:
        out = client.forward(datums, "cross_entropy").result()
    except Exception:
        _forget(credentials, run)
        raise
    tokens = _weights_sum(datums)
    return {"nll": float(out.metrics["loss:sum"]) / max(tokens, 1e-9), "tokens": tokens}
