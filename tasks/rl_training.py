"""RL training primitives as Prefect tasks: policy-gradient forward/backward, optimizer step,
sampler weights.

They share the live-client registry of :mod:`prefect_tinker.tasks.training` (a task receives the credentials
block and a :class:`~prefect_tinker.tasks.training.TrainingRun` handle, never a client). ``rl_forward_backward``
may run several times before one ``rl_optim_step`` (streaming minibatches accumulate gradients);
if the client is lost between them the accumulated gradients are gone, so the task raises
:class:`~prefect_tinker.tasks.training.ClientRewound` and the flow redoes the step from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import tinker
from prefect import task
from prefect.cache_policies import NO_CACHE

from prefect_tinker.recipes.rl.advantages import RLDatum, sample_train_kl
from prefect_tinker.tasks.policies import RETRY_OPTIONS
from prefect_tinker.tasks.training import ClientRewound, TrainingRun, _advance, _client_for, _clients, _forget, _key, _save_checkpoint

__all__ = ["RL_LOSSES", "rl_forward_backward", "rl_optim_step", "save_sampler_weights"]

#: Policy-gradient losses of the Tinker API that take ``logprobs`` + ``advantages`` inputs.
RL_LOSSES = ("importance_sampling", "ppo", "cispo")


def _has_client(credentials: Any, run: TrainingRun) -> bool:
    entry = _clients.get(_key(credentials, run.run_name))
    return entry is not None and entry[1] == run.step


@task(name="rl-forward-backward", task_run_name="fwd-bwd-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def rl_forward_backward(
    credentials: Any, run: TrainingRun, datums: list[RLDatum], loss_fn: str = "importance_sampling",
    loss_fn_config: dict[str, float] | None = None, accumulated: int = 0,
) -> dict[str, float]:
    """Accumulate the policy-gradient loss ``loss_fn`` over ``datums`` (D datums) into the
    gradients of the run's current weights (no optimizer step).

    Args:
        accumulated: forward/backward passes already accumulated since the last optimizer step.

    Returns:
        ``loss_sum`` (summed loss, Tinker's ``loss:sum``), ``action_tokens``, ``datums``,
        ``kl_sample_train_v1``/``_v2`` and ``entropy`` (see
        :func:`prefect_tinker.recipes.rl.advantages.sample_train_kl`; trainer logprobs before this update),
        ``fwd_bwd_seconds``.

    Raises:
        ValueError: ``loss_fn`` not one of :data:`RL_LOSSES`.
        ClientRewound: the client was lost (while ``accumulated > 0``, or with steps since the
            last checkpoint); continue from the returned step.
    """
    if loss_fn not in RL_LOSSES:
        raise ValueError(f"loss_fn must be one of {list(RL_LOSSES)}, got {loss_fn!r}")
    if accumulated and not _has_client(credentials, run):
        _client_for(credentials, run)  # recreated at the last checkpoint (ClientRewound if steps were lost)
        raise ClientRewound(run, run.step)  # the earlier minibatches' gradients were lost: redo the step
    client = _client_for(credentials, run)
    t0 = time.perf_counter()
    try:
        out = client.forward_backward([d.to_datum() for d in datums], loss_fn, loss_fn_config).result()
    except Exception:
        _forget(credentials, run)
        raise
    trainer_lp = [np.asarray(o["logprobs"].to_numpy() if hasattr(o["logprobs"], "to_numpy") else o["logprobs"])
                  for o in out.loss_fn_outputs]
    metrics = sample_train_kl(datums, trainer_lp)
    metrics.update({
        "loss_sum": float(out.metrics.get("loss:sum", float("nan"))),
        "action_tokens": float(sum(float(d.mask.sum()) for d in datums)),
        "datums": float(len(datums)),
        "fwd_bwd_seconds": time.perf_counter() - t0,
    })
    return metrics


@task(name="rl-optim-step", task_run_name="optim-step-{run.step}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def rl_optim_step(
    credentials: Any, run: TrainingRun, learning_rate: float, adam: dict[str, float] | None = None
) -> tuple[TrainingRun, dict[str, float]]:
    """Apply the accumulated gradients (AdamW with Tinker's parameters); returns the handle at
    ``run.step + 1`` and the server's optimizer metrics (e.g. ``grad_norm``) plus ``learning_rate``.

    Raises:
        ClientRewound: the client (and its gradients) was lost; redo from the returned step.
    """
    if not _has_client(credentials, run):
        _client_for(credentials, run)  # recreated without the accumulated gradients
        raise ClientRewound(run, run.step)
    client = _client_for(credentials, run)
    try:
        res = client.optim_step(tinker.AdamParams(learning_rate=learning_rate, **(adam or {}))).result()
    except Exception:
        _forget(credentials, run)
        raise
    _advance(credentials, run, client, run.step + 1)
    metrics = {"learning_rate": float(learning_rate)}
    for k, v in (getattr(res, "metrics", None) or {}).items():
        name = k.split(":", 1)[0]
        if name not in ("learning_rate", "step"):
            metrics[name] = float(v)
    return run.model_copy(update={"step": run.step + 1}), metrics


@task(name="save-sampler-weights", task_run_name="sampler-{name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def save_sampler_weights(credentials: Any, run: TrainingRun, name: str) -> str:
    """Save the current weights for sampling; returns the ``tinker://.../sampler_weights/<name>``
    path a fresh sampling client is made from.

    Raises:
        ClientRewound: the client was lost before the save.
    """
    _, path = _save_checkpoint(credentials, run, name, "sampler")
    return path
