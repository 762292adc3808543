"""RL toolkit: environment types, problem envs (arithmetic, GSM8K, generic math), answer grading,
and the trajectory -> advantage -> datum pipeline (GRPO-style group-centred advantages).

- :mod:`prefect_tinker.recipes.rl.types`: ``Env``, ``StepResult``, ``EnvGroupBuilder``, ``RLDataset``,
  ``Transition``, ``Trajectory``, ``TrajectoryGroup``.
- :mod:`prefect_tinker.recipes.rl.problem_env`: ``ProblemEnv`` (one question, one graded reply),
  ``ProblemGroupBuilder``, ``ProblemDataset``.
- :mod:`prefect_tinker.recipes.rl.envs`: the environment registry (``Environment``,
  ``register_env``, ``EnvSpec``, ``build_rl_dataset``), one module per environment: ``arithmetic``,
  ``gsm8k``, ``math`` (``load_problems`` in ``envs.problems``).
- :mod:`prefect_tinker.recipes.rl.grading`: ``answers_match`` and answer extraction (``#### n``, ``\\boxed{}``).
- :mod:`prefect_tinker.recipes.rl.advantages`: ``compute_advantages``, ``trajectory_to_datums``, KL penalty,
  rollout metrics.
"""

from prefect_tinker.recipes.rl.advantages import (
    RLDatum,
    apply_kl_penalty,
    compute_advantages,
    groups_to_datums,
    remove_constant_reward_groups,
    rollout_metrics,
    sample_train_kl,
    trajectory_to_datums,
)
from prefect_tinker.recipes.rl.envs import Environment, EnvSpec, build_rl_dataset, env_names, get_env, register_env
from prefect_tinker.recipes.rl.envs.arithmetic import write_arithmetic_sft_jsonl
from prefect_tinker.recipes.rl.envs.problems import load_problems
from prefect_tinker.recipes.rl.grading import (
    answers_match,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    parse_number,
)
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemDataset, ProblemEnv, ProblemGroupBuilder
from prefect_tinker.recipes.rl.types import (
    Env,
    EnvGroupBuilder,
    RLDataset,
    StepResult,
    Trajectory,
    TrajectoryGroup,
    Transition,
)

__all__ = [
    "Env",
    "EnvGroupBuilder",
    "EnvSpec",
    "Environment",
    "env_names",
    "get_env",
    "register_env",
    "Problem",
    "ProblemDataset",
    "ProblemEnv",
    "ProblemGroupBuilder",
    "RLDataset",
    "RLDatum",
    "StepResult",
    "Trajectory",
    "TrajectoryGroup",
    "Transition",
    "answers_match",
    "apply_kl_penalty",
    "build_rl_dataset",
    "compute_advantages",
    "extract_boxed",
    "extract_final_answer",
    "extract_hash_answer",
    "groups_to_datums",
    "load_problems",
    "parse_number",
    "remove_constant_reward_groups",
    "rollout_metrics",
    "sample_train_kl",
    "trajectory_to_datums",
    "write_arithmetic_sft_jsonl",
]
