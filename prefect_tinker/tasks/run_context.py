"""The typed run context: what a run resolved once, handed to its tasks, evaluators and environments.

:class:`~prefect_tinker.flows.session.RunSession` builds one :class:`RunContext` when it opens
(after the training client exists and ``renderer="auto"`` is resolved) and hands it on; nothing
below the flow resolves credentials, opens a store or hashes data again::

    ctx = session.context
    evaluators = [*benchmark_evaluators(ctx), *session_env_evaluators(config, ctx.env)]

It lives in the task layer (tasks do not import flows) and holds no flow config: what a task or
an environment needs from the config is copied into typed fields here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
    from prefect_tinker.recipes.evals.specs import InspectSpec
    from prefect_tinker.recipes.rl.envs import EnvContext
    from prefect_tinker.tasks.runners import TaskRunnerFields
    from tinker_blocks.credentials import TinkerCredentials
    from tinker_blocks.stores import TrainingStore

__all__ = ["RunContext"]


@dataclass(frozen=True)
class RunContext:
    """What one training run resolved when it opened (built once by the run session).

    Attributes:
        run_id: the run's name (``runs.run_id``).
        recipe: the recipe (``sft``, ``dpo``, ``rl``, ...).
        model: the base model name as handed to the backend (checked by the run's preflight).
        credentials: the backend's ``TinkerCredentials`` block, resolved once.
        store: the run's one :class:`~tinker_blocks.stores.TrainingStore` (every store row of the
            session goes through it).
        store_root: the store's root (folder or ``s3://`` URL): the eval store of benchmark evaluators.
        renderer: the resolved renderer name (never ``auto``).
        tokenizer_id: the training model's tokenizer (a local directory or hub id).
        dataset_fingerprint: ``sha256:<hex>`` content identity of the run's data (its dataset
            builder's or its environment's), or None when the recipe has no data.
        evaluators: the benchmarks / inspect tasks run during training (the config's ``evaluators``).
        inspect_backend: provider args of the inspect ``tinker`` model for this backend (no secrets).
        task_runner: where the run's mapped tasks run, or None for the flow's own thread pool.
        env: the RL environment context (renderer, tokenizer, group sizes, seed, sampling), or
            None for recipes without an environment.
    """

    run_id: str
    recipe: str
    model: str
    credentials: TinkerCredentials
    store: TrainingStore
    store_root: str
    renderer: str
    tokenizer_id: str
    dataset_fingerprint: str | None
    evaluators: tuple[BenchmarkSpec | InspectSpec, ...]
    inspect_backend: dict[str, Any]
    task_runner: TaskRunnerFields | None
    env: EnvContext | None = None
