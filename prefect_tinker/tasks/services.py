"""The built-in service providers (:mod:`prefect_tinker.recipes.rl.services`), registered on import.

Each gives an environment one thing of the task layer, made from the rollout task's backend
credentials (:class:`~prefect_tinker.recipes.rl.services.ServiceResources`):

- ``judge`` (:data:`~prefect_tinker.recipes.rl.services.JUDGE`): the cached ``judge-reply`` task
  (:func:`prefect_tinker.tasks.judge.judge_reply`);
- ``pair_preferences`` (:data:`~prefect_tinker.recipes.rl.services.PAIR_PREFERENCES`): the cached
  ``reward-label-logprobs`` task (:func:`prefect_tinker.tasks.reward_model.pair_preferences`);
- ``sampler`` (:data:`~prefect_tinker.recipes.rl.services.SAMPLER`): the per-process client
  registry's sampling clients (:func:`prefect_tinker.tasks.clients.sampling_client`);
- ``sandbox`` (:data:`~prefect_tinker.recipes.rl.services.SANDBOX`, no credentials): the local
  sandbox's :func:`~prefect_tinker.recipes.sandbox.run_tests`;
- ``retrieval`` (:data:`~prefect_tinker.recipes.rl.services.RETRIEVAL`, no credentials): BM25 over
  the collection (:func:`~prefect_tinker.recipes.rl.envs.retrieval.search_index`, cached per process);
- ``win_rate_evaluator`` (:data:`~prefect_tinker.recipes.rl.services.WIN_RATE_EVALUATOR`, build
  time, no credentials): :class:`prefect_tinker.tasks.reward_model.WinRateEvaluator`.

The rollout task and the RL flow import this module; a plugin replaces one of them, or adds its
own, with :func:`~prefect_tinker.recipes.rl.services.register_service` or an entry point of the
``prefect_tinker.services`` group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prefect_tinker.recipes.rl.envs.retrieval import search_index
from prefect_tinker.recipes.rl.services import (
    JUDGE,
    PAIR_PREFERENCES,
    RETRIEVAL,
    SAMPLER,
    SANDBOX,
    WIN_RATE_EVALUATOR,
    CodeTester,
    Judge,
    PairPreferences,
    Retriever,
    Sampler,
    ServiceResources,
    register_service,
)
from prefect_tinker.recipes.sandbox import run_tests
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.judge import judge_reply
from prefect_tinker.tasks.reward_model import WinRateEvaluator, pair_preferences

__all__ = [
    "judge",
    "register_builtin_services",
    "retrieval",
    "reward_model",
    "sampler",
    "sandbox",
    "win_rate_evaluator",
]


def judge(resources: ServiceResources) -> Judge:
    """``request -> answer text`` through the cached ``judge-reply`` task on the task's backend."""
    return functools.partial(judge_reply, resources.require_credentials(JUDGE.name))


def reward_model(resources: ServiceResources) -> PairPreferences:
    """``(reward model path, comparison pairs) -> preferences`` through the cached
    ``reward-label-logprobs`` task on the task's backend."""
    return functools.partial(pair_preferences, resources.require_credentials(PAIR_PREFERENCES.name))


def sampler(resources: ServiceResources) -> Sampler:
    """``path -> sampling client`` from the per-process client registry of the task's backend."""
    return functools.partial(sampling_client, resources.require_credentials(SAMPLER.name))


def sandbox(resources: ServiceResources) -> CodeTester:
    """The local sandbox's test runner (a fresh isolated process per call)."""
    return run_tests


def retrieval(resources: ServiceResources) -> Retriever:
    """BM25 indexes of JSONL collections, built once per process, collection and fields."""
    return search_index


def win_rate_evaluator(resources: ServiceResources) -> Callable[..., Any]:
    """The win-rate evaluator class (needs no credentials: it gets them when it runs)."""
    return WinRateEvaluator


@functools.cache
def register_builtin_services() -> None:
    """Register the six built-in providers under their keys, once per process (a later call does
    nothing, so a plugin's registration made after the first call stays). Called when the rollout
    task's and the RL config's modules load."""
    register_service(JUDGE, judge)
    register_service(PAIR_PREFERENCES, reward_model)
    register_service(SAMPLER, sampler)
    register_service(SANDBOX, sandbox)
    register_service(RETRIEVAL, retrieval)
    register_service(WIN_RATE_EVALUATOR, win_rate_evaluator)
