"""Rollouts as Prefect tasks: one task per group, mapped over the groups of a batch.

``rollout_group`` samples the G envs of one :class:`~prefect_tinker.recipes.rl.types.EnvGroupBuilder` from a
sampler checkpoint and steps them to the end of their episodes. It is cached across flow runs
under (sampler checkpoint path, batch index, group index, seed, sampling settings, failure
policy, the builder's content, the task's source): re-running a step whose sampler checkpoint is
unchanged (a resumed run continuing from the checkpoint where it stopped) reuses its rollouts.

Failures (an env that raises, a reply the env cannot handle) follow :class:`RolloutPolicy`:

- ``fail_fast``: the first failed trajectory fails the task (and the step);
- ``retry``: a failed trajectory is re-sampled from a fresh env (new seed) up to ``retries``
  times, then the task fails;
- ``min_viable``: failed trajectories are dropped; the group survives with at least
  ``min_group_size`` members, otherwise it comes back empty (the flow drops it).

Builders may take part (:class:`~prefect_tinker.recipes.rl.types.RolloutContext`): envs made by
``make_envs_in(ctx)`` can sample other weights through the task's client registry (an answerer),
and a ``shared_episode`` builder steps its envs itself in ``run_group(envs, ctx)`` (the two players
of one game); a failure there fails the whole episode (``retry`` replays it, ``min_viable`` drops
the group).

Errors are counted in :attr:`TrajectoryGroup.errors`. Transient server errors (HTTP 5xx,
timeouts) are retried by the SDK and by the task's ``RETRY_OPTIONS`` in every mode.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import tinker
from prefect import task
from pydantic import BaseModel, Field

from prefect_tinker.recipes.media import has_media, media_key, model_input_from_tokens
from prefect_tinker.recipes.rl.services import ServiceResources, Services
from prefect_tinker.recipes.rl.types import (
    EnvGroupBuilder,
    RolloutContext,
    Trajectory,
    TrajectoryGroup,
    Transition,
)
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.policies import cached_options
from prefect_tinker.tasks.services import register_builtin_services

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

register_builtin_services()  # the providers environments ask for by key (judge, sampler, ...)

__all__ = [
    "RolloutPolicy",
    "RolloutError",
    "group_seed",
    "new_usage",
    "run_group_rollout",
    "rollout_group",
    "reference_logprobs",
    "sampling_client",
]

#: Most turns an episode may take before the rollout counts it as failed.
MAX_TURNS = 32


class RolloutPolicy(BaseModel):
    """What a rollout task does when a trajectory fails (see the module docstring)."""

    mode: Literal["fail_fast", "retry", "min_viable"] = Field(
        default="min_viable", description="fail_fast, retry or min_viable."
    )
    retries: int = Field(default=2, ge=0, description="retry: re-samples of a failed trajectory.")
    min_group_size: int = Field(default=2, ge=1, description="min_viable: fewest surviving members that keep a group.")


class RolloutError(RuntimeError):
    """A trajectory failed under ``fail_fast`` / after ``retry`` retries; names batch, group and member."""


def group_seed(seed: int, batch_index: int, group_index: int) -> int:
    """A 63-bit sampling seed for one group, a pure function of (seed, batch, group)."""
    digest = hashlib.sha256(f"{seed}:{batch_index}:{group_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def new_usage() -> dict[str, float]:
    """An empty token-usage tally of a rollout: ``sampled``, ``prefill_cached`` and
    ``prefill_uncached`` tokens (see :mod:`prefect_tinker.recipes.pricing`)."""
    return {"sampled": 0.0, "prefill_cached": 0.0, "prefill_uncached": 0.0}


def _sample(
    sampler: Any,
    prompt: list[int],
    n: int,
    stop: Any,
    seed: int,
    max_tokens: int,
    temperature: float,
    usage: dict[str, float] | None = None,
) -> list[tuple[list[int], list[float], str, str]]:
    """``n`` samples of ``prompt``: ``(tokens, logprobs, stop_reason, sequence_id)`` each (the id is
    ``""`` when the server sets none); the request's tokens are added to ``usage``: its prompt once
    (split by the server's ``prompt_cache_hit_tokens``) and every sampled token."""
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=int(seed), stop=stop)
    model_input = model_input_from_tokens(prompt)
    resp = sampler.sample(prompt=model_input, num_samples=n, sampling_params=params).result()
    if usage is not None:
        cached = min(int(resp.prompt_cache_hit_tokens or 0), model_input.length)
        usage["prefill_cached"] += cached
        usage["prefill_uncached"] += model_input.length - cached
        usage["sampled"] += sum(len(s.tokens) for s in resp.sequences)
    return [
        (
            list(s.tokens),
            [float(x) for x in (s.logprobs or [])],
            str(s.stop_reason),
            str(s.sequence_id or ""),
        )
        for s in resp.sequences
    ]


def _run_episode(
    env: Any,
    first: tuple[list[int], list[float], str, str] | None,
    sampler: Any,
    seed: int,
    max_tokens: int,
    temperature: float,
    usage: dict[str, float] | None = None,
) -> Trajectory:
    """Step one env to the end; ``first`` is an already sampled first action (or None)."""
    ob, stop = env.initial_observation()
    transitions: list[Transition] = []
    for turn in range(MAX_TURNS):
        if turn == 0 and first is not None:
            tokens, lps, reason, sequence_id = first
        else:
            tokens, lps, reason, sequence_id = _sample(
                sampler, list(ob), 1, stop, seed + 104729 * turn, max_tokens, temperature, usage
            )[0]
        res = env.step(tokens)
        transitions.append(
            Transition(
                list(ob),
                tokens,
                lps,
                float(res.reward),
                bool(res.episode_done),
                reason,
                dict(res.metrics),
                dict(res.logs),
                sequence_id,
            )
        )
        if res.episode_done:
            return Trajectory(transitions, [])
        if res.next_observation is None:
            raise RuntimeError("env returned episode_done=False without a next observation")
        ob, stop = list(res.next_observation), res.next_stop_condition
    raise RuntimeError(f"episode did not end within {MAX_TURNS} turns")


def run_group_rollout(
    sampler: Any,
    builder: EnvGroupBuilder,
    *,
    seed: int,
    max_tokens: int,
    temperature: float = 1.0,
    policy: RolloutPolicy | None = None,
    batch_index: int = 0,
    group_index: int = 0,
    sampler_path: str = "",
    sampler_step: int = 0,
    services: Services | None = None,
) -> TrajectoryGroup:
    """Roll out the envs of ``builder`` with ``sampler`` (anything with the SDK's ``sample``).

    Members sharing an initial observation are sampled in one request (``num_samples`` = their
    count, seed ``seed``); later turns and retries are sampled one by one with derived seeds.
    A ``shared_episode`` builder steps its envs itself (:meth:`EnvGroupBuilder.run_group`): a
    failure there fails the whole episode (counted once), which ``retry`` replays with fresh envs
    and ``min_viable`` drops.

    Args:
        services: what the builder's ``ctx.service(KEY)`` resolves with
            (:class:`~prefect_tinker.recipes.rl.services.Services`: the backend credentials its
            providers get, and services given ready-made); default: registered providers, no
            credentials.

    Returns:
        The group (failed members removed, ``errors`` counted); ``trajectories_G`` empty when
        ``min_viable`` left fewer than ``min_group_size`` members.

    Raises:
        RolloutError: ``fail_fast`` or exhausted ``retry`` (the first error chained).
    """
    policy = policy or RolloutPolicy()
    t0 = time.perf_counter()
    usage = new_usage()
    ctx = RolloutContext(
        sample=lambda ob, stop, s: _sample(sampler, list(ob), 1, stop, s, max_tokens, temperature, usage)[0][:3],
        seed=seed,
        services=services or Services(),
    )
    where = f"batch {batch_index} group {group_index}"
    try:
        envs = list(builder.make_envs_in(ctx))
    except Exception as exc:  # the whole group's envs are broken: no member can run
        raise RolloutError(f"{where}: make_envs failed: {exc}") from exc
    if builder.shared_episode:
        trajs, errors, messages = _run_shared(builder, envs, ctx, policy, where)
    else:
        trajs, errors, messages = _run_members(
            builder, envs, ctx, sampler, policy, where, max_tokens, temperature, usage
        )
    if policy.mode == "min_viable" and len(trajs) < min(policy.min_group_size, len(envs)):
        trajs = []
    rewards = builder.compute_group_rewards_in(ctx, trajs) if trajs else []
    return TrajectoryGroup(
        trajectories_G=trajs,
        final_rewards_G=[float(r) for r, _ in rewards],
        metrics_G=[dict(m) for _, m in rewards],
        batch_index=batch_index,
        group_index=group_index,
        sampler_path=sampler_path,
        sampler_step=sampler_step,
        errors=errors,
        error_messages=messages,
        seconds=time.perf_counter() - t0,
        usage=usage,
    )


def _failed(policy: RolloutPolicy, attempt: int, what: str, exc: Exception, messages: list[str]) -> None:
    """Record a failure; raise RolloutError when the policy gives up on it."""
    if len(messages) < 5:
        messages.append(f"{what}: {type(exc).__name__}: {exc}")
    if policy.mode == "fail_fast" or (policy.mode == "retry" and attempt >= policy.retries):
        raise RolloutError(f"{what} failed ({policy.mode}): {exc}") from exc


def _run_members(
    builder: EnvGroupBuilder,
    envs: list,
    ctx: RolloutContext,
    sampler: Any,
    policy: RolloutPolicy,
    where: str,
    max_tokens: int,
    temperature: float,
    usage: dict[str, float],
) -> tuple[list[Trajectory], int, list[str]]:
    """Each env's episode to the end, one env after another (first actions batched)."""
    seed = ctx.seed
    firsts: list[Any] = [None] * len(envs)
    try:
        obs = [env.initial_observation() for env in envs]
    except Exception as exc:  # the whole group's envs are broken: no member can run
        raise RolloutError(f"{where}: initial_observation failed: {exc}") from exc
    shared: dict[str, list[int]] = {}
    for i, (ob, stop) in enumerate(obs):  # media_key: observations with different media never share
        shared.setdefault(json.dumps([media_key(ob), stop]), []).append(i)
    for k, members in enumerate(shared.values()):
        ob, stop = obs[members[0]]
        outs = _sample(sampler, list(ob), len(members), stop, seed + k, max_tokens, temperature, usage)
        for i, out in zip(members, outs, strict=True):
            firsts[i] = out
    trajs: list[Trajectory] = []
    errors, messages = 0, list[str]()
    for i, env in enumerate(envs):
        attempt = 0
        while True:
            try:
                trajs.append(
                    _run_episode(env, firsts[i], sampler, seed + 7919 * attempt + i, max_tokens, temperature, usage)
                )
                break
            except Exception as exc:
                errors += 1
                _failed(policy, attempt, f"{where} member {i}", exc, messages)
                if policy.mode == "min_viable":
                    break
                attempt += 1
                env = builder.make_envs_in(ctx)[i]
                firsts[i] = None
    return trajs, errors, messages


def _run_shared(
    builder: EnvGroupBuilder, envs: list, ctx: RolloutContext, policy: RolloutPolicy, where: str
) -> tuple[list[Trajectory], int, list[str]]:
    """One shared episode of all envs (``builder.run_group``, which samples through ``ctx``), replayed
    under ``retry``."""
    errors, messages, attempt = 0, list[str](), 0
    while True:
        try:
            trajs = list(builder.run_group(envs, replace(ctx, seed=ctx.seed + 7919 * attempt)))
            if len(trajs) != len(envs):
                raise RuntimeError(f"run_group returned {len(trajs)} trajectories for {len(envs)} envs")
            return trajs, errors, messages
        except Exception as exc:
            errors += 1
            _failed(policy, attempt, f"{where} (shared episode)", exc, messages)
            if policy.mode == "min_viable":
                return [], errors, messages
            attempt += 1
            envs = list(builder.make_envs_in(ctx))


def _rollout_cache_key(context: Any, params: dict[str, Any]) -> str:
    keyed = {k: v for k, v in params.items() if k not in ("credentials", "builder", "policy", "sampler")}
    keyed["builder"] = params["builder"].cache_key()
    keyed["policy"] = params["policy"].model_dump() if params.get("policy") else None
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()


@task(
    name="rollout-group",
    # batch and group, then the training step of the sampler weights it rolls out (the policy version)
    task_run_name="rollout-b{batch_index}-g{group_index}-step-{sampler_step}",
    **cached_options(_rollout_cache_key),
)
def rollout_group(
    credentials: TinkerCredentials,
    sampler_path: str,
    builder: EnvGroupBuilder,
    batch_index: int,
    group_index: int,
    seed: int,
    max_tokens: int,
    temperature: float = 1.0,
    policy: RolloutPolicy | None = None,
    sampler_step: int = 0,
    record_stability_info: bool = False,
    sampler: Any = None,
    cache_scope: str = "",
) -> TrajectoryGroup:
    """Roll out one group from the sampler checkpoint ``sampler_path`` (see :func:`run_group_rollout`).

    Args:
        seed: the run's seed; the group's sampling seed is :func:`group_seed` of (seed, batch, group).
        max_tokens: most tokens per action; temperature: sampling temperature (the returned
            logprobs are temperature-1 logprobs: keep 1.0 for unbiased importance ratios).
        record_stability_info: sample with a client that records every sequence (StableReinforce).
        sampler: a live sampling client to use instead of one made from ``sampler_path`` (an
            inflight client, which has no path; it pickles to other workers).
        cache_scope: part of the cache key: ``""`` caches across flow runs; a value unique to one
            invocation keeps results whose sequence ids belong to one server session, or whose
            weights an inflight client chose, from being reused by another.
    """
    if sampler is None:
        sampler = sampling_client(credentials, sampler_path, record_stability_info)
    return run_group_rollout(
        sampler,
        builder,
        seed=group_seed(seed, batch_index, group_index),
        max_tokens=max_tokens,
        temperature=temperature,
        policy=policy,
        batch_index=batch_index,
        group_index=group_index,
        sampler_path=sampler_path,
        sampler_step=sampler_step,
        services=Services(ServiceResources(credentials, credentials.backend_identity())),
    )


def _ref_cache_key(context: Any, params: dict[str, Any]) -> str:
    h = hashlib.sha256(params["reference"].encode())
    for seq in params["sequences"]:
        h.update(np.asarray(seq, dtype=np.int64).tobytes() + b"|")
        if has_media(seq):
            h.update(json.dumps(media_key(seq)).encode() + b"|")
    return h.hexdigest()


@task(
    name="reference-logprobs",
    **cached_options(_ref_cache_key),
)
def reference_logprobs(credentials: TinkerCredentials, reference: str, sequences: list[list[int]]) -> list[list[float]]:
    """Logprobs (L-1,) of tokens 1..L-1 of each sequence (L,) under the reference weights
    (``tinker://.../sampler_weights/...`` or ``base:<model>``), via ``compute_logprobs``."""
    client = sampling_client(credentials, reference)
    futures = [client.compute_logprobs(model_input_from_tokens(list(s))) for s in sequences]
    out = []
    for fut in futures:
        lp = fut.result()
        out.append([float(x) if x is not None else 0.0 for x in list(lp)[1:]])
    return out
