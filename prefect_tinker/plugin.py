"""The public API of prefect-tinker: everything a plugin package imports, from one module.

A plugin (a separate distribution; see ``docs/plugins.md``) registers components through Python
entry points and imports only from here::

    from prefect_tinker.plugin import Environment, EnvContext, register_env

The names below are the ones we keep stable: a rename or removal is a breaking change, checked by
``tests/test_plugin_api.py`` (the list is pinned there) and the import contract "plugins import the
public API only" (the demo plugin of the tests imports nothing else). Everything else in
``prefect_tinker``, ``tinker_blocks`` and ``tinker_local`` is internal and may move.

Names are imported on first use (PEP 562 module ``__getattr__``), so a plugin that registers only an
environment does not pay for importing the flows (Prefect, the run session) and listing recipes stays
quick. Groups:

- **recipes**: :class:`Recipe` and :data:`RECIPES` (entry-point group ``prefect_tinker.recipes``),
  :class:`RecipeConfig` (a recipe's config model: the recipe protocol the run session and the
  CLI call), :data:`RESUME` (the marker of a field a resumed run must keep), :func:`recipe_flow`
  (its flow decorator),
  :class:`RunSession` (credentials, store, resume point, run context), :class:`StepLoop`,
  :class:`RunContext`, the tasks :func:`train_step` and :func:`tokenizer`;
- **RL environments**: :class:`Environment`, :class:`EnvContext`, :func:`register_env`, :data:`ENVS`
  (group ``prefect_tinker.envs``), :class:`Env`, :class:`ProblemEnv`, :class:`MessageEnv`,
  :class:`Problem`, :func:`problem_builder` and the :class:`ProblemGroupBuilder` it makes,
  :class:`EnvGroupBuilder`, :class:`RLDataset`, :class:`StepResult`, :class:`RolloutContext`,
  :class:`Trajectory` and its :class:`Transition` s;
- **services** an environment asks its context for (``ctx.service(KEY)``): :class:`ServiceKey`,
  :func:`register_service`, :data:`SERVICES` (group ``prefect_tinker.services``),
  :class:`ServiceResources`, :class:`Services`, :class:`MissingServiceError`, and the built-in keys
  :data:`JUDGE`, :data:`PAIR_PREFERENCES`, :data:`SAMPLER`, :data:`SANDBOX`, :data:`RETRIEVAL`,
  :data:`WIN_RATE_EVALUATOR`;
- **RL objectives**: :class:`RLLoss`, :func:`register_loss`, :data:`LOSSES` (group
  ``prefect_tinker.losses``), :data:`OBJECTIVE_INPUTS` (what a loss's torch ``objective`` may read),
  :class:`AdvantageEstimator`, :func:`register_advantage_estimator`,
  :data:`ADVANTAGE_ESTIMATORS` (group ``prefect_tinker.advantages``);
- **RL schedules**: :class:`Schedule` (orders one RL step over :class:`RLLoopParts`),
  :func:`register_schedule`, :data:`SCHEDULES` (group ``prefect_tinker.schedules``);
- **renderers, graders, data formats**: :class:`Renderer`, :func:`register_renderer`,
  :data:`RENDERERS`; :data:`GRADERS`, :func:`register_grader`, :data:`CODE_RUNNERS`,
  :func:`register_code_runner`; :class:`DataFormat`, :class:`FormatOptions`, :data:`CONVERTERS`,
  :func:`register_converter`;
- **data files**: :class:`FileType`, :func:`register_file_type`, :data:`FILE_TYPES` (group
  ``prefect_tinker.file_types``: how a local data file is read), :class:`RawRecord` (what a file
  type yields), :class:`SourceSpec`; :func:`register_builtin_dataset`, :data:`BUILTIN_DATASETS`
  (group ``prefect_tinker.builtin_datasets``: the ``builtin:<name>`` sources);
- **DPO variants**: :class:`DPOVariant`, :func:`register_dpo_loss`, :data:`DPO_LOSSES` (group
  ``prefect_tinker.dpo_losses``);
- **benchmarks**: :data:`BENCHMARKS` (group ``prefect_tinker.benchmarks``: a dict of
  :class:`BenchmarkSpec` fields, or a ``BenchmarkSpec``), :class:`BenchmarkSpec`;
- **the registry class**: :class:`Registry`, :class:`UnknownComponentError`;
- **blocks and stores**: :class:`TinkerCredentials`, :class:`TrainingStore`, :class:`EvalStore`,
  :class:`CaptureStore`, :class:`S3Credentials`, :func:`connect_stores` (DuckDB over the stores).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it (the one table; the TYPE_CHECKING imports below repeat it
# for type checkers and editors, and tests/test_plugin_api.py checks that the two agree)
_MODULES: dict[str, str] = {
    # recipes
    "Recipe": "prefect_tinker.flows.registry",
    "RECIPES": "prefect_tinker.flows.registry",
    "RecipeConfig": "prefect_tinker.flows.config",
    "RESUME": "prefect_tinker.recipes.resume_marker",
    "recipe_flow": "prefect_tinker.flows.interrupts",
    "RunSession": "prefect_tinker.flows.session",
    "StepLoop": "prefect_tinker.flows.loop",
    "RunContext": "prefect_tinker.tasks.run_context",
    "train_step": "prefect_tinker.tasks.training",
    "tokenizer": "prefect_tinker.tasks.clients",
    # RL environments
    "Environment": "prefect_tinker.recipes.rl.envs",
    "EnvContext": "prefect_tinker.recipes.rl.envs",
    "register_env": "prefect_tinker.recipes.rl.envs",
    "ENVS": "prefect_tinker.recipes.rl.envs",
    "Env": "prefect_tinker.recipes.rl.types",
    "EnvGroupBuilder": "prefect_tinker.recipes.rl.types",
    "RLDataset": "prefect_tinker.recipes.rl.types",
    "StepResult": "prefect_tinker.recipes.rl.types",
    "RolloutContext": "prefect_tinker.recipes.rl.types",
    "Trajectory": "prefect_tinker.recipes.rl.types",
    "Transition": "prefect_tinker.recipes.rl.types",
    "Problem": "prefect_tinker.recipes.rl.problem_env",
    "ProblemEnv": "prefect_tinker.recipes.rl.problem_env",
    "ProblemGroupBuilder": "prefect_tinker.recipes.rl.problem_env",
    "MessageEnv": "prefect_tinker.recipes.rl.message_env",
    "problem_builder": "prefect_tinker.recipes.rl.envs.problems",
    # services by key
    "ServiceKey": "prefect_tinker.recipes.rl.services",
    "ServiceResources": "prefect_tinker.recipes.rl.services",
    "Services": "prefect_tinker.recipes.rl.services",
    "SERVICES": "prefect_tinker.recipes.rl.services",
    "register_service": "prefect_tinker.recipes.rl.services",
    "MissingServiceError": "prefect_tinker.recipes.rl.services",
    "JUDGE": "prefect_tinker.recipes.rl.services",
    "PAIR_PREFERENCES": "prefect_tinker.recipes.rl.services",
    "SAMPLER": "prefect_tinker.recipes.rl.services",
    "SANDBOX": "prefect_tinker.recipes.rl.services",
    "RETRIEVAL": "prefect_tinker.recipes.rl.services",
    "WIN_RATE_EVALUATOR": "prefect_tinker.recipes.rl.services",
    # RL objectives
    "RLLoss": "prefect_tinker.recipes.rl.losses",
    "register_loss": "prefect_tinker.recipes.rl.losses",
    "LOSSES": "prefect_tinker.recipes.rl.losses",
    "OBJECTIVE_INPUTS": "prefect_tinker.recipes.rl.losses",
    "AdvantageEstimator": "prefect_tinker.recipes.rl.advantages",
    "register_advantage_estimator": "prefect_tinker.recipes.rl.advantages",
    "ADVANTAGE_ESTIMATORS": "prefect_tinker.recipes.rl.advantages",
    # RL schedules
    "Schedule": "prefect_tinker.flows.rl_schedules",
    "RLLoopParts": "prefect_tinker.flows.rl_schedules",
    "register_schedule": "prefect_tinker.flows.rl_schedules",
    "SCHEDULES": "prefect_tinker.flows.rl_config",
    # renderers, graders, data formats
    "Renderer": "prefect_tinker.recipes.renderers",
    "register_renderer": "prefect_tinker.recipes.renderers",
    "RENDERERS": "prefect_tinker.recipes.renderers",
    "GRADERS": "prefect_tinker.recipes.evals.graders",
    "register_grader": "prefect_tinker.recipes.evals.graders",
    "CODE_RUNNERS": "prefect_tinker.recipes.evals.graders",
    "register_code_runner": "prefect_tinker.recipes.evals.graders",
    "DataFormat": "prefect_tinker.recipes.format_options",
    "FormatOptions": "prefect_tinker.recipes.format_options",
    "CONVERTERS": "prefect_tinker.recipes.data_sources",
    "register_converter": "prefect_tinker.recipes.data_sources",
    # data files
    "FileType": "prefect_tinker.recipes.data_reading",
    "register_file_type": "prefect_tinker.recipes.data_reading",
    "FILE_TYPES": "prefect_tinker.recipes.data_reading",
    "RawRecord": "prefect_tinker.recipes.data_reading",
    "SourceSpec": "prefect_tinker.recipes.data_reading",
    "register_builtin_dataset": "prefect_tinker.recipes.builtin_datasets",
    "BUILTIN_DATASETS": "prefect_tinker.recipes.builtin_datasets",
    # DPO variants
    "DPOVariant": "prefect_tinker.recipes.preference",
    "register_dpo_loss": "prefect_tinker.recipes.preference",
    "DPO_LOSSES": "prefect_tinker.recipes.preference",
    # benchmarks
    "BENCHMARKS": "prefect_tinker.recipes.evals.benchmarks",
    "BenchmarkSpec": "prefect_tinker.recipes.evals.benchmarks",
    # the registry class
    "Registry": "prefect_tinker.recipes.registry",
    "UnknownComponentError": "prefect_tinker.recipes.registry",
    # blocks and stores
    "TinkerCredentials": "tinker_blocks.credentials",
    "S3Credentials": "tinker_blocks.s3_credentials",
    "TrainingStore": "tinker_blocks.stores",
    "EvalStore": "tinker_blocks.stores",
    "CaptureStore": "tinker_blocks.stores",
    "connect_stores": "tinker_blocks.store_sql",
}

__all__ = sorted(_MODULES)

if TYPE_CHECKING:
    from prefect_tinker.flows.config import RecipeConfig
    from prefect_tinker.flows.interrupts import recipe_flow
    from prefect_tinker.flows.loop import StepLoop
    from prefect_tinker.flows.registry import RECIPES, Recipe
    from prefect_tinker.flows.rl_config import SCHEDULES
    from prefect_tinker.flows.rl_schedules import RLLoopParts, Schedule, register_schedule
    from prefect_tinker.flows.session import RunSession
    from prefect_tinker.recipes.builtin_datasets import BUILTIN_DATASETS, register_builtin_dataset
    from prefect_tinker.recipes.data_reading import FILE_TYPES, FileType, RawRecord, SourceSpec, register_file_type
    from prefect_tinker.recipes.data_sources import CONVERTERS, register_converter
    from prefect_tinker.recipes.evals.benchmarks import BENCHMARKS, BenchmarkSpec
    from prefect_tinker.recipes.evals.graders import CODE_RUNNERS, GRADERS, register_code_runner, register_grader
    from prefect_tinker.recipes.format_options import DataFormat, FormatOptions
    from prefect_tinker.recipes.preference import DPO_LOSSES, DPOVariant, register_dpo_loss
    from prefect_tinker.recipes.registry import Registry, UnknownComponentError
    from prefect_tinker.recipes.renderers import RENDERERS, Renderer, register_renderer
    from prefect_tinker.recipes.resume_marker import RESUME
    from prefect_tinker.recipes.rl.advantages import (
        ADVANTAGE_ESTIMATORS,
        AdvantageEstimator,
        register_advantage_estimator,
    )
    from prefect_tinker.recipes.rl.envs import ENVS, EnvContext, Environment, register_env
    from prefect_tinker.recipes.rl.envs.problems import problem_builder
    from prefect_tinker.recipes.rl.losses import LOSSES, OBJECTIVE_INPUTS, RLLoss, register_loss
    from prefect_tinker.recipes.rl.message_env import MessageEnv
    from prefect_tinker.recipes.rl.problem_env import Problem, ProblemEnv, ProblemGroupBuilder
    from prefect_tinker.recipes.rl.services import (
        JUDGE,
        PAIR_PREFERENCES,
        RETRIEVAL,
        SAMPLER,
        SANDBOX,
        SERVICES,
        WIN_RATE_EVALUATOR,
        MissingServiceError,
        ServiceKey,
        ServiceResources,
        Services,
        register_service,
    )
    from prefect_tinker.recipes.rl.types import (
        Env,
        EnvGroupBuilder,
        RLDataset,
        RolloutContext,
        StepResult,
        Trajectory,
        Transition,
    )
    from prefect_tinker.tasks.clients import tokenizer
    from prefect_tinker.tasks.run_context import RunContext
    from prefect_tinker.tasks.training import train_step
    from tinker_blocks.credentials import TinkerCredentials
    from tinker_blocks.s3_credentials import S3Credentials
    from tinker_blocks.store_sql import connect_stores
    from tinker_blocks.stores import CaptureStore, EvalStore, TrainingStore


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use.

    Raises:
        AttributeError: ``name`` is not part of the public API.
    """
    module = _MODULES.get(name)
    if module is None:
        names = ", ".join(__all__)
        raise AttributeError(f"prefect_tinker.plugin has no public name {name!r}; the public names: {names}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
