"""Evaluation by rollouts: an environment's evaluation sets (:meth:`Environment.eval_builders`,
e.g. tic-tac-toe games against a random and an optimal player) rolled out on sampler weights.

:class:`RolloutEvaluator` maps the ``rollout-group`` task (cached by sampler path and builder like
training rollouts) over one set's builders and reports the means of
:func:`~prefect_tinker.recipes.rl.advantages.rollout_metrics` as
``{prefix}/{set}/{metric}`` (``test/vs_minimax/draw``, ``test/vs_random/reward_mean``, ...).
:func:`env_evaluators` builds one per set of the run's environment; :func:`session_env_evaluators`
does it for an RL run (``StepLoop(..., evaluators=[..., *session_env_evaluators(config, env)])`` with the
run's :class:`EnvContext`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect import unmapped

from prefect_tinker.recipes.rl.advantages import rollout_metrics
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec, get_env
from prefect_tinker.tasks.evaluators import SamplingClientEvaluator
from prefect_tinker.tasks.rollouts import RolloutPolicy, rollout_group

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["RolloutEvaluator", "env_evaluators", "session_env_evaluators"]


class RolloutEvaluator(SamplingClientEvaluator):
    """Roll out ``builders`` on the evaluated sampler weights; metrics ``{prefix}/{name}/{k}``, and
    the rollouts' sampling tokens as ``tokens/eval_sampled`` / ``tokens/eval_prefill``.

    Args:
        name: the set's name (``vs_random``).
        builders: its group builders (picklable).
        max_tokens, temperature: sampling of each action (temperature 1.0: the policy as trained).
        seed: sampling seed of the set (group ``i`` samples with ``group_seed(seed, -1, i)``).
    """

    def __init__(
        self,
        name: str,
        builders: list,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        prefix: str = "test",
    ):
        self.name, self.builders, self.prefix = name, list(builders), prefix
        self.max_tokens, self.temperature, self.seed = int(max_tokens), float(temperature), int(seed)

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
        if not self.builders:
            return {}
        policy = RolloutPolicy(mode="min_viable", min_group_size=1)
        futures = rollout_group.with_options(
            task_run_name=f"eval-{self.name}-b{{batch_index}}-g{{group_index}}-step-{step}"
        ).map(
            unmapped(credentials),
            unmapped(sampler_path),
            self.builders,
            unmapped(-1),
            list(range(len(self.builders))),
            unmapped(self.seed),
            unmapped(self.max_tokens),
            unmapped(self.temperature),
            unmapped(policy),
            unmapped(step),
        )
        groups = [g for g in (f.result() for f in futures) if g.trajectories_G]
        out = {f"{self.prefix}/{self.name}/{k}": v for k, v in rollout_metrics(groups).items()}
        out[f"{self.prefix}/{self.name}/errors"] = float(sum(g.errors for g in (f.result() for f in futures)))
        # every group's sampling requests, kept or not; a group the task cache answered sent none
        usage = [f.result().usage for f in futures if f.state.name != "Cached"]
        out["tokens/eval_sampled"] = float(sum(u.get("sampled", 0.0) for u in usage))
        out["tokens/eval_prefill"] = float(
            sum(u.get("prefill_cached", 0.0) + u.get("prefill_uncached", 0.0) for u in usage)
        )
        return out


def env_evaluators(
    spec: Any, ctx: EnvContext, *, max_tokens: int, temperature: float = 1.0, seed: int = 0
) -> list[RolloutEvaluator]:
    """One :class:`RolloutEvaluator` per evaluation set of ``spec.env`` (none for most envs)."""
    sets = get_env(spec.env).eval_builders(spec, ctx)
    return [
        RolloutEvaluator(name, builders, max_tokens=max_tokens, temperature=temperature, seed=seed)
        for name, builders in sets.items()
    ]


def session_env_evaluators(spec: EnvSpec, env: EnvContext) -> list[Any]:
    """The evaluators an RL run gets from its environment: one :class:`RolloutEvaluator` per
    evaluation set (:meth:`Environment.eval_builders`) and the env's own evaluators
    (:meth:`Environment.evaluators`, e.g. a win rate against the starting weights, which
    ``env.initial_sampler`` names), for ``spec``'s env on the run's environment context ``env``
    (resolved renderer and tokenizer, group sizes, seed, ``max_tokens`` and ``temperature``);
    empty for most envs."""
    return [
        *env_evaluators(spec, env, max_tokens=env.max_tokens, temperature=env.temperature, seed=env.seed),
        *get_env(spec.env).evaluators(spec, env),
    ]
