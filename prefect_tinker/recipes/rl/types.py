"""Types of RL environments and their rollouts, in the Tinker cookbook's terms.

- :class:`Env`: one single-use episode. ``initial_observation()`` gives the first observation
  (tokens the policy continues) and the stop condition for sampling; ``step(action_tokens)``
  returns a :class:`StepResult` (reward, done, next observation, metrics).
- :class:`EnvGroupBuilder`: makes the G envs of one group (G attempts at one problem) and may add
  group-level rewards (e.g. pairwise comparisons). Builders are small picklable values, so a
  rollout task can receive one on any worker (thread, process, Dask, Ray) and its fields can key
  the rollout cache.
- :class:`RLDataset`: a sequence of batches, each a list of builders (one per group).
- :class:`RolloutContext`: what a rollout task lends a builder (the policy's sampler, the group's
  seed, services by key: :mod:`~prefect_tinker.recipes.rl.services`): envs that talk to another
  model (an answerer, a judge) ask it for the service in :meth:`EnvGroupBuilder.make_envs_in`, and
  builders whose envs play one shared episode (the two players of a game, ``shared_episode =
  True``) step them together in :meth:`EnvGroupBuilder.run_group` instead of the task running each
  env's episode to the end, one env after another.
- :class:`Transition`, :class:`Trajectory`, :class:`TrajectoryGroup`: what a rollout produced.

Observations are plain token lists (``list[int]``) here rather than ``tinker.ModelInput`` so that
rollout results are small, picklable and cacheable; text-only envs lose nothing, and images or
audio ride along as :class:`~prefect_tinker.recipes.media.MediaToken` runs (by reference).

Source: Tinker cookbook ``tinker_cookbook/rl/types.py`` (concepts and names; written anew, with
synchronous ``initial_observation``/``step`` because rollouts run inside Prefect tasks).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from prefect_tinker.recipes.rl.services import ServiceKey, Services

T = TypeVar("T")

__all__ = [
    "StopCondition",
    "StepResult",
    "Env",
    "Transition",
    "Trajectory",
    "TrajectoryGroup",
    "EnvGroupBuilder",
    "RLDataset",
    "RolloutContext",
    "SampledAction",
]

#: Stop strings or stop token ids for ``tinker.SamplingParams(stop=...)``.
StopCondition = list[str] | list[int]


@dataclass
class StepResult:
    """Outcome of :meth:`Env.step`.

    Attributes:
        reward: reward of this step (env units; the math envs give 1.0 for a correct answer).
        episode_done: True when the episode ended with this step.
        next_observation: tokens the policy continues next (None when done).
        next_stop_condition: stop condition for the next action (None when done).
        metrics: per-step numbers averaged into the step's ``env/...`` metrics (e.g. ``correct``).
        logs: short texts kept with the trajectory (e.g. the parsed response).
    """

    reward: float
    episode_done: bool
    next_observation: list[int] | None = None
    next_stop_condition: StopCondition | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)


class Env(ABC):
    """A single-use environment (one episode). Not picklable in general: made by a builder
    inside the rollout task and discarded after the episode."""

    @abstractmethod
    def initial_observation(self) -> tuple[list[int], StopCondition]:
        """The first observation (token ids, length P) and the stop condition of the first action."""

    @abstractmethod
    def step(self, action: list[int]) -> StepResult:
        """Apply the sampled action tokens (length T, stop sequence included if sampled).

        Raises:
            Exception: any error is a failed rollout, handled by the rollout failure policy.
        """


@dataclass
class Transition:
    """One (observation, action, reward) step of a trajectory.

    Attributes:
        observation: tokens the policy saw (P,).
        action_tokens: sampled tokens (T,).
        action_logprobs: the sampler's logprobs of ``action_tokens`` (T,), nats, temperature 1.
        reward: the step's reward.
        episode_done: whether the episode ended here.
        stop_reason: the sampler's ``"stop"`` or ``"length"``.
        metrics: the step's env metrics; logs: the step's texts.
        sequence_id: the server's ``SampledSequence.sequence_id`` of the action (``""`` when unknown,
            e.g. actions of shared-episode builders); names it in provenance spans.
    """

    observation: list[int]
    action_tokens: list[int]
    action_logprobs: list[float]
    reward: float
    episode_done: bool
    stop_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    sequence_id: str = ""


@dataclass
class Trajectory:
    """The transitions of one episode, and the observation after the last one (empty if done)."""

    transitions: list[Transition]
    final_observation: list[int] = field(default_factory=list)

    @property
    def step_reward(self) -> float:
        """Sum of the per-step rewards."""
        return float(sum(t.reward for t in self.transitions))


@dataclass
class TrajectoryGroup:
    """The G trajectories of one group, as returned by a rollout task.

    Attributes:
        trajectories_G: trajectories that finished (failed ones are absent; see ``errors``).
        final_rewards_G: group-level rewards from :meth:`EnvGroupBuilder.compute_group_rewards`.
        metrics_G: group-level metrics per trajectory.
        batch_index, group_index: where the group sits in the dataset.
        sampler_path: the ``tinker://.../sampler_weights/...`` checkpoint that sampled it.
        sampler_step: optimizer steps taken by those weights (staleness in async schedules).
        errors: trajectories that failed (env or sampling errors), dropped from the group.
        error_messages: the first few error messages.
        seconds: wall time of the rollout.
        usage: tokens the rollout's sampling requests cost: ``sampled``, ``prefill_cached`` and
            ``prefill_uncached`` (see :mod:`prefect_tinker.recipes.pricing`).
    """

    trajectories_G: list[Trajectory]
    final_rewards_G: list[float]
    metrics_G: list[dict[str, float]]
    batch_index: int = 0
    group_index: int = 0
    sampler_path: str = ""
    sampler_step: int = 0
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    seconds: float = 0.0
    usage: dict[str, float] = field(default_factory=dict)

    def total_rewards(self) -> list[float]:
        """Per-trajectory total reward (G,): sum of step rewards plus the group-level reward."""
        return [t.step_reward + r for t, r in zip(self.trajectories_G, self.final_rewards_G, strict=True)]


#: One sampled action: tokens (T,), the sampler's logprobs of them (T,), stop reason ("stop"/"length").
SampledAction = tuple[list[int], list[float], str]


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout task lends the builder of the group it rolls out.

    Attributes:
        sample: ``sample(observation, stop, seed) -> SampledAction``: one action of the policy
            being trained (the task's ``max_tokens`` and temperature).
        seed: the group's sampling seed (derive per-action seeds from it).
        services: what :meth:`service` resolves keys with (the task's backend credentials given
            to the registered providers; :mod:`prefect_tinker.recipes.rl.services`).
    """

    sample: Callable[[list[int], StopCondition, int], SampledAction]
    seed: int = 0
    services: Services = field(default_factory=Services)

    def service(self, key: ServiceKey[T]) -> T:
        """The service of ``key`` (a judge, a reward model, sampling clients, a plugin's own),
        made by its registered provider once per process.

        Raises:
            MissingServiceError: no provider is registered for ``key`` (names it and the registered ones).
            RuntimeError: the provider cannot make it here (e.g. no backend credentials outside a task).
        """
        return self.services.get(key)


class EnvGroupBuilder(ABC):
    """Makes the envs of one group. Subclasses should be dataclasses of plain values (picklable,
    with a stable ``repr`` that :meth:`cache_key` hashes)."""

    #: True: the group's envs play one shared episode (e.g. the two players of one game, turns
    #: kept by a coordinator they share); the rollout task then calls :meth:`run_group` instead of
    #: running each env's episode to the end, one env after another.
    shared_episode: ClassVar[bool] = False

    @abstractmethod
    def make_envs(self) -> Sequence[Env]:
        """G fresh envs (G >= 1), all for the same problem."""

    def make_envs_in(self, ctx: RolloutContext) -> Sequence[Env]:
        """The G envs made inside a rollout task (default: :meth:`make_envs`). Envs that talk to
        another model (an answerer, an opponent checkpoint) take its client from
        ``ctx.service(SAMPLER)`` (:mod:`prefect_tinker.recipes.rl.services`)."""
        return self.make_envs()

    def run_group(self, envs: Sequence[Env], ctx: RolloutContext) -> list[Trajectory]:
        """``shared_episode`` builders: step ``envs`` together to the end of their shared episode
        with actions from ``ctx.sample``; one trajectory per env, in env order (G,).

        Raises:
            Exception: any error fails the whole group (the rollout failure policy then replays
                the episode with fresh envs or drops the group).
        """
        raise NotImplementedError(f"{type(self).__name__} sets shared_episode but does not implement run_group")

    def compute_group_rewards(self, trajectories_G: Sequence[Trajectory]) -> list[tuple[float, dict[str, float]]]:
        """Group-level reward and metrics per trajectory, added to the step rewards (default 0)."""
        return [(0.0, {}) for _ in trajectories_G]

    def compute_group_rewards_in(
        self, ctx: RolloutContext, trajectories_G: Sequence[Trajectory]
    ) -> list[tuple[float, dict[str, float]]]:
        """The group rewards computed inside a rollout task (default: :meth:`compute_group_rewards`).
        Builders rewarded by another model (a pairwise reward model) take its client from
        ``ctx.service(PAIR_PREFERENCES)``."""
        return self.compute_group_rewards(trajectories_G)

    def logging_tags(self) -> list[str]:
        """Tags (e.g. the env name) under which metrics may also be reported."""
        return []

    def cache_key(self) -> str:
        """Hex digest identifying this builder's content (part of the rollout cache key)."""
        return hashlib.sha256(repr(self).encode("utf-8")).hexdigest()


class RLDataset(ABC):
    """Batches of group builders: ``get_batch(i)`` is a pure function of ``i`` (and the dataset's
    seed), so a resumed run gets the same batches."""

    @abstractmethod
    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        """The builders (one per group) of batch ``index`` (0-based)."""

    def num_batches(self) -> int | None:
        """Batches per epoch, or None for an unbounded (generated) dataset."""
        return None
