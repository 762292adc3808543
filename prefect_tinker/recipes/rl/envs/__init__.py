"""RL environments: one registered class per environment, and the spec that picks one.

An environment is a subclass of :class:`Environment` decorated with :func:`register_env`, in its
own module: every module of this package is imported when the registry (:data:`ENVS`, a
:class:`~prefect_tinker.recipes.registry.Registry`) is first read, and third-party packages add
theirs through the ``prefect_tinker.envs`` entry point group (``name = "pkg.module:EnvClass"``, or
a module to import whose classes register themselves), so a new environment touches one file.

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

import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    WithJsonSchema,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic.json_schema import DEFAULT_REF_TEMPLATE, models_json_schema

from prefect_tinker.recipes.data_reading import check_local_source
from prefect_tinker.recipes.registry import Registry, TaggedBy, tagged_options, tagged_union_schema
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.recipes.rl.services import ServiceKey, Services
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, RLDataset

T = TypeVar("T")

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVS",
    "MOVED_TO_ENV_OPTIONS",
    "EnvContext",
    "EnvSpec",
    "Environment",
    "NoOptions",
    "RunSettings",
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
    sampler weights of the run's initial policy (its step 0), when known; build-time services by key."""

    renderer_name: str
    tokenizer_id: str
    group_size: int
    groups_per_batch: int
    seed: int = 0
    initial_sampler: str | None = None
    #: sampling of the run's rollouts: new tokens per turn and temperature (the RL config's
    #: ``max_tokens`` and ``temperature``), used by evaluators that sample the policy
    max_tokens: int = 64
    temperature: float = 1.0
    #: what :meth:`service` resolves keys with (build time: no backend credentials)
    services: Services = field(default_factory=Services)

    def service(self, key: ServiceKey[T]) -> T:
        """The build-time service of ``key`` (e.g. :data:`~prefect_tinker.recipes.rl.services.WIN_RATE_EVALUATOR`),
        made by its registered provider once per process.

        Raises:
            MissingServiceError: no provider is registered for ``key`` (names it and the registered ones).
        """
        return self.services.get(key)


@dataclass(frozen=True)
class RunSettings:
    """The run around an :class:`EnvSpec`, as far as an environment's :meth:`Environment.check` may
    need it (:meth:`EnvSpec.run_settings`). A bare spec, outside a run config, has none of them."""

    #: rollouts per group (the RL config's ``group_size``); None: not known here
    group_size: int | None = None
    #: the policy's base model; None: not known here
    model: str | None = None
    #: True where the flow fills ``dataset`` and the environment's inputs in from earlier stages
    #: (RLHF's RL stage): checks leave those to the flow
    filled_by_pipeline: bool = False


class Environment:
    """One registered RL environment.

    Subclasses set ``name`` and ``description``, optionally ``Options`` (a pydantic model of their
    ``env_options``), and implement :meth:`build`; :meth:`check` validates a spec at config time.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        """Raise ValueError when ``spec`` cannot work with this environment (checked when the
        config is validated, before a run starts)."""

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        """Read and validate the environment's data before a run starts (no tokenizer, no
        server): a bad record fails here, naming file, line and field. Default: nothing to read."""

    @classmethod
    def options(cls, spec: EnvSpec) -> Any:
        """``spec.env_options``, an instance of :attr:`Options` (validated when the spec was; the
        options of a spec naming another environment are read again as this one's).

        Raises:
            ValueError: those options are not this environment's (``env_options.<field>: <problem>``).
        """
        return tagged_options("env", cls.name, cls.Options, spec.env_options, field="env_options")

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        """The training dataset (batches of group builders) of ``spec``.

        Raises:
            ValueError / FileNotFoundError: bad problem data, naming file, line and field.
        """
        raise NotImplementedError

    @classmethod
    def eval_builders(cls, spec: EnvSpec, ctx: EnvContext) -> dict[str, list[EnvGroupBuilder]]:
        """Evaluation sets of the environment: ``{name: group builders}`` (e.g. games against
        fixed opponents), rolled out on sampler weights by
        :class:`prefect_tinker.tasks.rollout_eval.RolloutEvaluator`; none by default."""
        return {}

    @classmethod
    def evaluators(cls, spec: EnvSpec, ctx: EnvContext) -> list:
        """Evaluators the RL run on this environment runs at its start, every ``eval_every``
        steps and at its end (:mod:`prefect_tinker.tasks.evaluators` objects; default none)."""
        return []


#: Registered environments by name: the modules of this package, then the entry points.
ENVS: Registry[type[Environment]] = Registry(
    "env",
    ENTRY_POINT_GROUP,
    builtins=[f"{__name__}.{m.name}" for m in pkgutil.iter_modules([str(Path(__file__).parent)])],
)


def register_env(cls: type[Environment]) -> type[Environment]:
    """Class decorator: register ``cls`` under ``cls.name`` in :data:`ENVS` (a later registration
    of the same name replaces the earlier one: tests and plugins may override).

    Raises:
        ValueError: ``cls.name`` is empty.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}: an environment needs a non-empty `name`")
    return ENVS.register(cls.name, cls)


def env_names() -> list[str]:
    """Registered environment names, sorted."""
    return ENVS.names()


def get_env(name: str) -> type[Environment]:
    """The environment class registered as ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return ENVS.get_or_raise(name)


#: Fields an RL config once held at the top level, now options of their environment.
MOVED_TO_ENV_OPTIONS = {
    "max_operand": "arithmetic",
    "question_field": "math, calculator",
    "answer_field": "math, calculator",
    "answer_style": "math",
}


class EnvSpec(BaseModel):
    """Which environment and problems an RL run trains on (fields of the RL flow config).

    ``dataset`` .. ``format_coef`` are shared by the problem environments (arithmetic, gsm8k,
    math and their kin); everything specific to one environment is one of its options,
    ``env_options``: a tagged union over the registered environments' ``Options`` models, the tag
    being ``env``. Validation turns the given mapping into an instance of the model of the
    environment ``env`` names, the environments of plugins included (the registry is read when a
    spec is validated, so the union is not fixed when this class is defined); the JSON schema
    (``prefect-tinker show-config RECIPE --schema``) spells the union out, one ``if env ==
    <name> then env_options: <its Options>`` branch per registered environment.

    Every field but where the problems come from (``dataset``, ``dataset_config``, ``split``,
    ``max_problems``: a resumed run may change them as long as the problems' content, the run's
    data fingerprint, stays the same) is marked
    :data:`~prefect_tinker.recipes.resume_marker.RESUME`: ``env_options`` as a whole, so every
    option of the environment.
    """

    env: Annotated[str, RESUME] = Field(
        default="arithmetic",
        description="Registered environment (prefect-tinker ls shows them): arithmetic, gsm8k, math, ...",
    )
    env_options: Annotated[BaseModel, TaggedBy("env"), WithJsonSchema({"type": "object"}), RESUME] = Field(
        default_factory=NoOptions,
        description="Options of the environment `env` names: its own Options model (see its docs).",
    )
    dataset: str | None = Field(
        default=None, description="gsm8k/math: JSONL path or Hugging Face dataset id (gsm8k default: openai/gsm8k)."
    )
    dataset_config: str | None = Field(
        default=None, description="Hugging Face dataset configuration (gsm8k default: main)."
    )
    split: str = Field(default="train", description="Split of a Hugging Face dataset.")
    max_problems: int | None = Field(default=None, ge=1, description="Use at most this many problems.")
    few_shot: Annotated[bool, RESUME] = Field(
        default=False, description="Prepend one solved example as a user/assistant turn."
    )
    system_prompt: Annotated[str | None, RESUME] = Field(default=None, description="Optional system message.")
    format_coef: Annotated[float, RESUME] = Field(
        default=0.1, ge=0, description="Reward penalty for a malformed reply."
    )
    format_needs_stop: Annotated[bool, RESUME] = Field(
        default=False,
        description=(
            "Problem environments: a reply is well-formed only when it ended with the renderer's stop sequence "
            "(true, tinker-cookbook's require_stop_sequence_for_format) or also at the end-of-sequence token "
            "(false)."
        ),
    )

    _dataset_exists = field_validator("dataset")(check_local_source)  # a missing file fails here

    def required_dataset(self) -> str:
        """``dataset``, for an environment that reads its problems from it.

        Raises:
            ValueError: ``dataset`` is unset (the message names the environment).
        """
        if not self.dataset:
            raise ValueError(f"env {self.env!r} needs dataset=<JSONL path or dataset id>")
        return self.dataset

    def run_settings(self) -> RunSettings:
        """What the run config around this spec says that an environment's check may need (a run
        config overrides this; a bare spec knows none of it)."""
        return RunSettings()

    @model_validator(mode="before")
    @classmethod
    def _tagged_options(cls, data: Any) -> Any:
        """Fields moved into ``env_options`` are refused with the spelling to use; ``env_options``
        becomes the ``Options`` instance of the environment ``env`` names (the union's tag)."""
        if not isinstance(data, dict):
            return data
        for key in MOVED_TO_ENV_OPTIONS.keys() & data.keys():
            raise ValueError(
                f"{key} is an option of its environment ({MOVED_TO_ENV_OPTIONS[key]}): "
                f"write env_options.{key}={data[key]!r}"
            )
        env = data.get("env", cls.model_fields["env"].default)
        if not isinstance(env, str):
            return data  # the field's own validation names the problem
        options = tagged_options("env", env, get_env(env).Options, data.get("env_options"), field="env_options")
        return {**data, "env_options": options}

    @field_serializer("env_options")
    def _given_options(self, options: BaseModel, info: SerializationInfo) -> dict[str, Any]:
        """The options as the config gave them (defaults left out): what a stored config and a
        resume check hold, the same before and after the options became typed."""
        return options.model_dump(mode=info.mode, exclude_unset=True)

    @model_validator(mode="after")
    def _check_env(self) -> EnvSpec:
        get_env(self.env).check(self)
        return self

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The JSON schema, with ``env_options`` as the union over the registered environments'
        option models, tagged by ``env`` (JSON Schema's ``if``/``then``, 2020-12 draft)."""
        schema = super().model_json_schema(*args, **kwargs)
        envs = {n: get_env(n).Options for n in env_names()}
        keys, defs = models_json_schema(
            [(m, "validation") for m in {id(m): m for m in envs.values()}.values()],
            ref_template=kwargs.get("ref_template", DEFAULT_REF_TEMPLATE),
        )
        schema.setdefault("$defs", {}).update(defs.get("$defs", {}))
        branches = {name: keys[(model, "validation")] for name, model in envs.items()}
        tagged_union_schema(
            schema, tag="env", field="env_options", branches=branches, default=cls.model_fields["env"].default
        )
        return schema


def build_rl_dataset(
    spec: EnvSpec, *, renderer_name: str, tokenizer_id: str, group_size: int, groups_per_batch: int, seed: int = 0
) -> RLDataset:
    """The training :class:`~prefect_tinker.recipes.rl.types.RLDataset` of ``spec`` (groups of
    ``group_size`` envs, ``groups_per_batch`` groups per batch), built by its registered class.

    Raises:
        ValueError / FileNotFoundError: unknown env, bad problem data.
    """
    ctx = EnvContext(
        renderer_name=renderer_name,
        tokenizer_id=tokenizer_id,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        seed=seed,
    )
    return get_env(spec.env).build(spec, ctx)


def build_rl_evaluators(
    spec: EnvSpec,
    *,
    renderer_name: str,
    tokenizer_id: str,
    group_size: int,
    groups_per_batch: int,
    seed: int = 0,
    initial_sampler: str | None = None,
    max_tokens: int = 64,
    temperature: float = 1.0,
) -> list:
    """The evaluators of ``spec``'s environment (:meth:`Environment.evaluators`) for an RL run;
    ``initial_sampler`` is the sampler weights of the run's step 0 (e.g. the SFT policy it
    started from); ``max_tokens`` and ``temperature`` as in :class:`EnvContext`."""
    ctx = EnvContext(
        renderer_name=renderer_name,
        tokenizer_id=tokenizer_id,
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        seed=seed,
        initial_sampler=initial_sampler,
        max_tokens=max_tokens,
        temperature=temperature,
    )
    return list(get_env(spec.env).evaluators(spec, ctx))
