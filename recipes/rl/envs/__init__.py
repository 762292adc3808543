"""RL environments: one registered class per environment, and the spec that picks one.

An environment is a subclass of :class:`Environment` decorated with :func:`register_env`, in its
own module: every module of this package is imported when the registry is first read, and
third-party packages add theirs through the ``prefect_tinker.envs`` entry point group (the value
is a module to import), so a new environment touches one file.

Built in: ``arithmetic`` (generated sums), ``gsm8k`` (grade-school word problems), ``math``
(any JSONL or dataset of problems with a reference answer); multi-turn message environments
(:mod:`prefect_tinker.recipes.rl.message_env`): ``calculator`` and ``retrieval`` (tool use),
``humaneval`` (code run in the sandbox), ``guess_number``, ``twenty_questions`` (another model
answers), ``tictactoe`` (two-player self-play sharing one game per group) and ``numerics_check``
(long page-by-page episodes for the sampler-vs-trainer KL, ``docs/numerics.md``).

:class:`EnvSpec` holds the fields an RL config shares for every environment (which ``env``, the
problem source and prompt settings, ``env_options`` validated by the environment's own
``Options`` model); :func:`build_rl_dataset` turns it into an
:class:`~prefect_tinker.recipes.rl.types.RLDataset` through the registered class.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prefect_tinker.recipes.data_reading import check_local_source
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, RLDataset

__all__ = [
    "ENTRY_POINT_GROUP",
    "EnvContext",
    "EnvSpec",
    "Environment",
    "NoOptions",
    "build_rl_dataset",
    "build_rl_evaluators",
    "env_names",
    "get_env",
    "register_env",
]

#: Entry point group of third-party environment modules.
ENTRY_POINT_GROUP = "prefect_tinker.envs"


class NoOptions(BaseModel):
    """``env_options`` of an environment that takes none (any key is an error)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class EnvContext:
    """What the run contributes to an environment's dataset: the resolved renderer, the tokenizer
    (a local directory or hub id), group and batch sizes, the run's seed and (for evaluators) the
    sampler weights of the run's initial policy (its step 0), when known."""

    renderer_name: str
    tokenizer_id: str
    group_size: int
    groups_per_batch: int
    seed: int = 0
    initial_sampler: str | None = None


class Environment:
    """One registered RL environment.

    Subclasses set ``name`` and ``description``, optionally ``Options`` (a pydantic model of their
    ``env_options``), and implement :meth:`build`; :meth:`check` validates a spec at config time.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions

    @classmethod
    def check(cls, spec: "EnvSpec") -> None:
        """Raise ValueError when ``spec`` cannot work with this environment (checked when the
        config is validated, before a run starts)."""

    @classmethod
    def preflight(cls, spec: "EnvSpec") -> None:
        """Read and validate the environment's data before a run starts (no tokenizer, no
        server): a bad record fails here, naming file, line and field. Default: nothing to read."""

    @classmethod
    def options(cls, spec: "EnvSpec") -> BaseModel:
        """``spec.env_options`` validated by :attr:`Options`."""
        return cls.Options.model_validate(spec.env_options)

    @classmethod
    def build(cls, spec: "EnvSpec", ctx: EnvContext) -> RLDataset:
        """The training dataset (batches of group builders) of ``spec``.

        Raises:
            ValueError / FileNotFoundError: bad problem data, naming file, line and field.
        """
        raise NotImplementedError

    @classmethod
    def eval_builders(cls, spec: "EnvSpec", ctx: EnvContext) -> dict[str, list[EnvGroupBuilder]]:
        """Evaluation sets of the environment: ``{name: group builders}`` (e.g. games against
        fixed opponents), rolled out on sampler weights by
        :class:`prefect_tinker.tasks.rollout_eval.RolloutEvaluator`; none by default."""
        return {}

    @classmethod
    def evaluators(cls, spec: "EnvSpec", ctx: EnvContext) -> list:
        """Evaluators the RL run on this environment runs at its start, every ``eval_every``
        steps and at its end (:mod:`prefect_tinker.tasks.evaluators` objects; default none)."""
        return []


_ENVS: dict[str, type[Environment]] = {}
_loaded = False
_load_lock = threading.Lock()


def register_env(cls: type[Environment]) -> type[Environment]:
    """Class decorator: register ``cls`` under ``cls.name`` (a later registration of the same name
    replaces the earlier one: tests and plugins may override).

    Raises:
        ValueError: ``cls.name`` is empty.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}: an environment needs a non-empty `name`")
    _ENVS[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    with _load_lock:
        if _loaded:
            return
        _loaded = True
        for mod in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{mod.name}")
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            importlib.import_module(ep.value.split(":", 1)[0])


def env_names() -> list[str]:
    """Registered environment names, sorted."""
    _load()
    return sorted(_ENVS)


def get_env(name: str) -> type[Environment]:
    """The environment class registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    _load()
    try:
        return _ENVS[name]
    except KeyError:
        raise ValueError(f"unknown env {name!r}; registered: {', '.join(sorted(_ENVS))}") from None


class EnvSpec(BaseModel):
    """Which environment and problems an RL run trains on (fields of the RL flow config).

    ``dataset`` .. ``format_coef`` are shared by the problem environments (arithmetic, gsm8k,
    math and their kin); anything specific to one environment goes in ``env_options``.
    """

    env: str = Field(default="arithmetic", description="Registered environment (prefect-tinker ls shows them): arithmetic, gsm8k, math, ...")
    env_options: dict[str, Any] = Field(default_factory=dict, description="Options of the environment (its own fields; see its docs).")
    dataset: str | None = Field(default=None, description="gsm8k/math: JSONL path or Hugging Face dataset id (gsm8k default: openai/gsm8k).")
    dataset_config: str | None = Field(default=None, description="Hugging Face dataset configuration (gsm8k default: main).")
    split: str = Field(default="train", description="Split of a Hugging Face dataset.")
    question_field: str = Field(default="question", description="math: record field holding the problem text.")
    answer_field: str = Field(default="answer", description="math: record field holding the reference answer.")
    answer_style: Literal["boxed", "hash", "any"] = Field(default="boxed", description="math: where replies state the answer.")
    max_problems: int | None = Field(default=None, ge=1, description="Use at most this many problems.")
    max_operand: int = Field(default=20, ge=1, description="arithmetic: operands are drawn from [0, max_operand].")
    few_shot: bool = Field(default=False, description="Prepend one solved example as a user/assistant turn.")
    system_prompt: str | None = Field(default=None, description="Optional system message.")
    format_coef: float = Field(default=0.1, ge=0, description="Reward penalty for a malformed reply.")

    _dataset_exists = field_validator("dataset")(check_local_source)  # a missing file fails here

    @model_validator(mode="after")
    def _check_env(self) -> "EnvSpec":
        env = get_env(self.env)
        try:
            env.options(self)
        except ValidationError as exc:
            problems = "; ".join(f"env_options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"env {self.env!r}: {problems}") from None
        env.check(self)
        return self


def build_rl_dataset(spec: EnvSpec, *, renderer_name: str, tokenizer_id: str, group_size: int,
                     groups_per_batch: int, seed: int = 0) -> RLDataset:
    """The training :class:`~prefect_tinker.recipes.rl.types.RLDataset` of ``spec`` (groups of
    ``group_size`` envs, ``groups_per_batch`` groups per batch), built by its registered class.

    Raises:
        ValueError / FileNotFoundError: unknown env, bad problem data.
    """
    ctx = EnvContext(renderer_name=renderer_name, tokenizer_id=tokenizer_id, group_size=group_size,
                     groups_per_batch=groups_per_batch, seed=seed)
    return get_env(spec.env).build(spec, ctx)


def build_rl_evaluators(spec: EnvSpec, *, renderer_name: str, tokenizer_id: str, group_size: int,
                        groups_per_batch: int, seed: int = 0, initial_sampler: str | None = None) -> list:
    """The evaluators of ``spec``'s environment (:meth:`Environment.evaluators`) for an RL run;
    ``initial_sampler`` is the sampler weights of the run's step 0 (e.g. the SFT policy it
    started from)."""
    ctx = EnvContext(renderer_name=renderer_name, tokenizer_id=tokenizer_id, group_size=group_size,
                     groups_per_batch=groups_per_batch, seed=seed, initial_sampler=initial_sampler)
    return list(get_env(spec.env).evaluators(spec, ctx))
