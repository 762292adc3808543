"""Training primitives as Prefect tasks, shared by every recipe.

A task never receives a live client: it receives the credentials block and a
:class:`~prefect_tinker.tasks.clients.TrainingRun` handle and gets the client from the registry
(:mod:`prefect_tinker.tasks.clients`), which recreates a lost client from the last checkpoint and
raises :class:`~prefect_tinker.tasks.clients.ClientRewound` when steps were lost. A failed request
poisons the SDK client, so every task drops it from the registry before re-raising (the retry then
gets a fresh one).

- :func:`open_training_run`: create, resume or initialise the run's client;
- :func:`train_step`: ``forward_backward`` + ``optim_step`` submitted back to back (any built-in
  loss); :func:`custom_step`: the same with a client-side custom loss (``forward_backward_custom``);
- :func:`forward_backward` (accumulates gradients of a built-in loss, or of a per-datum torch
  objective computed on the server where it accepts custom losses and on the client otherwise)
  and :func:`optim_step`, for recipes that accumulate several passes per update (RL minibatches);
- :func:`forward`: logprobs and the loss without gradients (evaluators);
- :func:`save_checkpoint` (state or sampler weights, as a Prefect asset) and
  :func:`save_sampler_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tinker
from prefect import task
from prefect.assets import materialize
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel
from tinker.types import LossFnType

from prefect_tinker.tasks import clients
from prefect_tinker.tasks.clients import ClientRewound, TrainingRun
from prefect_tinker.tasks.custom_losses import custom_loss, input_names
from prefect_tinker.tasks.policies import RETRY_OPTIONS

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "ClientRewound",
    "ForwardResult",
    "TrainingRun",
    "checkpoint_uri",
    "custom_step",
    "forward",
    "forward_backward",
    "model_input_tokens",
    "open_training_run",
    "optim_step",
    "save_checkpoint",
    "save_inflight_sampler",
    "save_sampler_weights",
    "train_step",
    "weights_sum",
]


class ForwardResult(BaseModel):
    """What ``forward`` / ``forward_backward`` returned.

    Attributes:
        loss_sum: the server's ``loss:sum`` (nats, summed over tokens and datums).
        logprobs: per datum, the logprobs (N,) of its target tokens (nats) before any update.
        metrics: every server metric, keys without the ``:reduction`` suffix, except that a
            custom loss's summed metrics (``custom/<name>:sum``) are named ``custom/<name>_sum``
            (so that a caller merging several passes knows to add them) and its averaged ones
            (``custom/<name>:mean``) ``custom/<name>``.
        seconds: wall time of the request.
    """

    loss_sum: float
    logprobs: list[list[float]]
    metrics: dict[str, float] = {}
    seconds: float = 0.0


def weights_sum(datums: list[tinker.Datum]) -> float:
    """Sum of the datums' ``weights`` (trained tokens; the input length when a datum has none)."""
    total = 0.0
    for d in datums:
        w = d.loss_fn_inputs.get("weights")
        total += float(w.to_numpy().astype(np.float64).sum()) if w is not None else d.model_input.length
    return total


def model_input_tokens(datums: list[tinker.Datum]) -> int:
    """Positions of the datums' model inputs (``model_input.length`` summed): the tokens a
    ``forward`` or ``forward_backward`` over them processes (the unit the service bills training
    and prefill in), whatever their loss weights."""
    return int(sum(d.model_input.length for d in datums))


def _metrics(raw: dict[str, float] | None) -> dict[str, float]:
    return {k.split(":", 1)[0]: float(v) for k, v in (raw or {}).items()}


def _pass_metrics(raw: dict[str, float] | None) -> dict[str, float]:
    """``_metrics`` of one forward(-backward) pass, but ``custom/<name>:sum`` -> ``custom/<name>_sum``."""
    out = _metrics(raw)
    for k, v in (raw or {}).items():
        name, _, reduction = k.partition(":")
        if name.startswith("custom/") and reduction == "sum":
            del out[name]
            out[f"{name}_sum"] = float(v)
    return out


def _logprobs(out: Any) -> list[list[float]]:
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64).ravel().tolist() for o in out.loss_fn_outputs]


def _calling(
    credentials: TinkerCredentials,
    run: TrainingRun,
    fn: Callable[[tinker.TrainingClient, Callable[[Any], Any]], Any],
    what: str,
) -> tuple[Any, Any]:
    """``(client, fn(client, wait))`` where ``wait(future)`` is the future's result, watched for a
    dead server and bounded by the deadline (:func:`prefect_tinker.tasks.clients.result`); a
    failure drops the (now poisoned) client before re-raising."""
    client = clients.training_client(credentials, run)
    label = f"{what} of run {run.run_name!r} at step {run.step}"
    try:
        return client, fn(client, lambda fut: clients.result(credentials, fut, label))
    except Exception:
        clients.forget(credentials, run)
        raise


@task(name="open-training-run", task_run_name="open-{run_name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def open_training_run(
    credentials: TinkerCredentials,
    run_name: str,
    base_model: str,
    lora_rank: int,
    backend: str,
    seed: int | None = None,
    resume_from: str | None = None,
    resume_step: int = 0,
    init_from: str | None = None,
) -> TrainingRun:
    """Create a LoRA training client, restore one from ``resume_from`` (a state checkpoint, with
    its optimizer state, at step ``resume_step``), or start a new run from the weights of
    ``init_from`` with a fresh optimizer (e.g. RL or DPO after SFT).

    Returns the run handle (``step`` = ``resume_step`` when resuming, else 0). Raises the SDK's
    errors for an unknown model or checkpoint (user errors; not retried).
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
        init_from=init_from,
    )
    clients.forget(credentials, run)
    service = credentials.get_client()
    if resume_from:
        fut = service.create_training_client_from_state_with_optimizer(resume_from)
    elif init_from:
        fut = service.create_training_client_from_state(init_from)
    else:
        fut = service.create_lora_training_client(base_model=base_model, rank=lora_rank, seed=seed)
    return clients.register(
        credentials, run, clients.result(credentials, fut, f"the training client of run {run_name!r}")
    )


def _adam(learning_rate: float, adam: dict[str, float] | None) -> tinker.AdamParams:
    return tinker.AdamParams(learning_rate=learning_rate, **(adam or {}))


@task(name="train-step", task_run_name="step-{step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def train_step(
    credentials: TinkerCredentials,
    run: TrainingRun,
    step: int,
    datums: list[tinker.Datum],
    learning_rate: float,
    adam: dict[str, float] | None = None,
    loss_fn: LossFnType = "cross_entropy",
    loss_fn_config: dict[str, float] | None = None,
) -> tuple[TrainingRun, dict[str, float]]:
    """One optimizer step: ``forward_backward(datums, loss_fn)`` and ``optim_step`` submitted back to
    back, then awaited.

    Args:
        run: handle at ``step`` (the number of steps already taken).
        datums: the batch (D datums).
        learning_rate: this step's rate (the caller applies the schedule).
        adam: other ``tinker.AdamParams`` fields (beta1, beta2, eps, weight_decay, grad_clip_norm).

    Returns:
        The handle at ``step + 1`` and metrics: ``loss`` (``loss_sum`` / trained tokens, nats per
        token), ``loss_sum``, ``tokens`` (sum of weights), ``learning_rate``, ``step_seconds``, and
        the optimizer's metrics (e.g. ``grad_norm``).

    Raises:
        ValueError: ``run`` is not at ``step``. ClientRewound: the client was lost.
    """
    if run.step != step:
        raise ValueError(f"run {run.run_name!r} is at step {run.step}, not {step}")
    t0 = time.perf_counter()

    def call(client, wait):
        fb = client.forward_backward(datums, loss_fn, loss_fn_config)
        opt = client.optim_step(_adam(learning_rate, adam))
        return wait(fb), wait(opt)

    client, (out, opt) = _calling(credentials, run, call, "forward_backward + optim_step")
    clients.advance(credentials, run, client, step + 1)
    tokens = weights_sum(datums)
    loss_sum = float(out.metrics.get("loss:sum", float("nan")))
    metrics = {k: v for k, v in _metrics(opt.metrics).items() if k not in ("learning_rate", "step")}
    metrics.update(
        {
            "loss": loss_sum / max(tokens, 1e-9),
            "loss_sum": loss_sum,
            "tokens": tokens,
            "learning_rate": float(learning_rate),
            "step_seconds": time.perf_counter() - t0,
        }
    )
    return run.model_copy(update={"step": step + 1}), metrics


@task(name="custom-step", task_run_name="step-{step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def custom_step(
    credentials: TinkerCredentials,
    run: TrainingRun,
    step: int,
    datums: list[tinker.Datum],
    loss: Any,
    learning_rate: float,
    adam: dict[str, float] | None = None,
) -> tuple[TrainingRun, dict[str, float]]:
    """One optimizer step with a client-side custom loss: ``forward_backward_custom(datums, loss)``
    (a forward for the logprobs, ``loss(datums, logprobs_D) -> (loss, metrics)`` in torch on the
    client, then a backward with the loss's gradient as cross-entropy weights) and ``optim_step``.

    Returns the handle at ``step + 1`` and metrics: the loss's own metrics (``name:reduction``
    suffix removed), ``loss_sum``, ``learning_rate``, ``step_seconds`` and the optimizer's.
    """
    if run.step != step:
        raise ValueError(f"run {run.run_name!r} is at step {run.step}, not {step}")
    t0 = time.perf_counter()

    def call(client, wait):
        fb = client.forward_backward_custom(datums, loss)
        opt = client.optim_step(_adam(learning_rate, adam))
        return wait(fb), wait(opt)

    client, (out, opt) = _calling(credentials, run, call, "forward_backward_custom + optim_step")
    clients.advance(credentials, run, client, step + 1)
    metrics = {k: v for k, v in _metrics(opt.metrics).items() if k not in ("learning_rate", "step")}
    metrics.update({k: v for k, v in _metrics(out.metrics).items() if k != "surrogate_loss"})
    metrics.update({"learning_rate": float(learning_rate), "step_seconds": time.perf_counter() - t0})
    return run.model_copy(update={"step": step + 1}), metrics


@task(name="forward-backward", task_run_name="fwd-bwd-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def forward_backward(
    credentials: TinkerCredentials,
    run: TrainingRun,
    datums: list[tinker.Datum],
    loss_fn: LossFnType = "cross_entropy",
    loss_fn_config: dict[str, float] | None = None,
    accumulated: int = 0,
    objective: Callable[..., Any] | None = None,
) -> ForwardResult:
    """Accumulate the gradients of ``loss_fn`` over ``datums`` (no optimizer step).

    Args:
        accumulated: passes already accumulated since the last optimizer step; if the client is
            lost meanwhile their gradients are gone, so the step must be redone.
        objective: instead of ``loss_fn``, a per-datum torch loss ``objective(logprobs, *inputs) ->
            (loss, {"custom/<name>:sum|mean": ...})`` whose parameters after ``logprobs`` name rank-1
            ``loss_fn_inputs``: run on the server where it accepts custom losses, else on the client
            (:func:`~prefect_tinker.tasks.custom_losses.custom_loss`). ``loss_sum`` is then the
            summed objective and ``metrics`` carry its ``custom/*`` metrics on both paths.

    Raises:
        ClientRewound: the client was lost (with ``accumulated > 0``, or with steps since the last
            checkpoint); continue from the returned step.
    """
    if accumulated and not clients.has_training_client(credentials, run):
        clients.training_client(credentials, run)  # recreated at the last checkpoint (may rewind)
        raise ClientRewound(run, run.step)  # the earlier passes' gradients were lost: redo the step
    t0 = time.perf_counter()
    if objective is None:
        _, out = _calling(
            credentials,
            run,
            lambda c, wait: wait(c.forward_backward(datums, loss_fn, loss_fn_config)),
            "forward_backward",
        )
    else:
        ranks = {"logprobs": 1, **dict.fromkeys(input_names(objective), 1)}
        loss = custom_loss(credentials, objective, ranks)
        _, out = _calling(
            credentials, run, lambda c, wait: wait(c.forward_backward_custom(datums, loss)), "forward_backward_custom"
        )
    return ForwardResult(
        loss_sum=float(out.metrics.get("loss:sum", float("nan"))),
        logprobs=_logprobs(out),
        metrics={k: v for k, v in _pass_metrics(out.metrics).items() if k != "surrogate_loss"},
        seconds=time.perf_counter() - t0,
    )


@task(name="optim-step", task_run_name="optim-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def optim_step(
    credentials: TinkerCredentials,
    run: TrainingRun,
    learning_rate: float,
    adam: dict[str, float] | None = None,
) -> tuple[TrainingRun, dict[str, float]]:
    """Apply the accumulated gradients (AdamW with Tinker's parameters); returns the handle at
    ``run.step + 1`` and the optimizer's metrics (e.g. ``grad_norm``) plus ``learning_rate``.

    Raises:
        ClientRewound: the client (and its gradients) was lost; redo from the returned step.
    """
    if not clients.has_training_client(credentials, run):
        clients.training_client(credentials, run)  # recreated without the accumulated gradients
        raise ClientRewound(run, run.step)
    client, res = _calling(
        credentials, run, lambda c, wait: wait(c.optim_step(_adam(learning_rate, adam))), "optim_step"
    )
    clients.advance(credentials, run, client, run.step + 1)
    metrics = {k: v for k, v in _metrics(res.metrics).items() if k not in ("learning_rate", "step")}
    metrics["learning_rate"] = float(learning_rate)
    return run.model_copy(update={"step": run.step + 1}), metrics


@task(name="forward", task_run_name="forward-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def forward(
    credentials: TinkerCredentials, run: TrainingRun, datums: list[tinker.Datum], loss_fn: LossFnType = "cross_entropy"
) -> ForwardResult:
    """``forward(datums, loss_fn)`` under the run's current weights: the loss and per-datum
    logprobs, no gradients."""
    t0 = time.perf_counter()
    _, out = _calling(credentials, run, lambda c, wait: wait(c.forward(datums, loss_fn)), "forward")
    return ForwardResult(
        loss_sum=float(out.metrics.get("loss:sum", float("nan"))),
        logprobs=_logprobs(out),
        metrics=_metrics(out.metrics),
        seconds=time.perf_counter() - t0,
    )


def checkpoint_uri(run: TrainingRun, name: str, kind: str = "state") -> str:
    """The ``tinker://`` URI a checkpoint named ``name`` of the run's current client gets."""
    folder = "weights" if kind == "state" else "sampler_weights"
    return f"tinker://{run.model_id}/{folder}/{name}"


def _save_checkpoint(
    credentials: TinkerCredentials, run: TrainingRun, name: str, kind: str = "state"
) -> tuple[TrainingRun, str]:
    """Save the run's current weights: ``kind="state"`` (weights + optimizer, resumable) or
    ``"sampler"`` (weights for a sampling client). Returns the updated handle and the path.

    Raises:
        ValueError: unknown ``kind``. ClientRewound: the client was lost before the save.
    """
    if kind not in ("state", "sampler"):
        raise ValueError(f"checkpoint kind must be 'state' or 'sampler', got {kind!r}")
    save = (
        (lambda c, wait: wait(c.save_state(name)).path)
        if kind == "state"
        else (lambda c, wait: wait(c.save_weights_for_sampler(name)).path)
    )
    _, path = _calling(credentials, run, save, f"save {kind} checkpoint {name!r}")
    if kind == "state":
        run = run.model_copy(update={"last_checkpoint": path, "last_checkpoint_step": run.step})
    return run, path


def save_checkpoint(
    credentials: TinkerCredentials,
    run: TrainingRun,
    name: str,
    kind: str = "state",
    upstream: list[str] | None = None,
) -> tuple[TrainingRun, str]:
    """Run the ``save-checkpoint`` task as a Prefect asset materialization.

    The asset key is the checkpoint's ``tinker://`` URI; ``upstream`` (e.g. the dataset URI, the
    checkpoint the run started from) are recorded as its dependencies, so the lineage dataset ->
    checkpoint shows in Prefect's events.
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


@task(name="save-sampler-weights", task_run_name="sampler-{name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def save_sampler_weights(credentials: TinkerCredentials, run: TrainingRun, name: str) -> str:
    """Save the current weights for sampling; returns the ``tinker://.../sampler_weights/<name>``
    path a sampling client is made from.

    Raises:
        ClientRewound: the client was lost before the save.
    """
    _, path = _save_checkpoint(credentials, run, name, "sampler")
    return path


@task(
    name="save-inflight-sampler",
    task_run_name="inflight-sampler-step-{run.step}",
    cache_policy=NO_CACHE,
    **RETRY_OPTIONS,
)
def save_inflight_sampler(credentials: TinkerCredentials, run: TrainingRun, record_stability_info: bool = False) -> Any:
    """Publish the current weights as the run's *inflight* sampler target
    (``save_weights_and_get_sampling_client(kind="inflight")``): every inflight sampling client of
    the run, earlier ones included, moves to these weights; returns a new inflight client (a fresh
    KV-cache namespace; picklable). See the SDK's ``tinker.types.SamplingClientKind``.

    Raises:
        ClientRewound: the client was lost before the save.
    """

    def save(client, wait):
        return wait(
            client.save_weights_and_get_sampling_client(record_stability_info=record_stability_info, kind="inflight")
        )

    _, sampler = _calling(credentials, run, save, "inflight sampler save")
    return sampler
