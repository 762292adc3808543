"""``verifiers``: run an environment written with the ``verifiers`` library as an RL environment.

``env=verifiers env_options.name=<id>`` loads a ``verifiers`` environment (PyPI ``verifiers``, its
classic 0.2 API: ``vf.SingleTurnEnv``, ``vf.MultiTurnEnv``, ``vf.ToolEnv``..., a dataset of
``prompt``/``question``, ``answer``, ``info`` rows, a ``Parser`` and a ``Rubric``) the way
``vf.load_environment`` does (``<id>`` names an installed environment package; ``env_options.env_args``
are its ``load_environment`` arguments), or from a ``.py`` file defining ``load_environment``. Each
group is one dataset row rolled out ``group_size`` times by the environment's own rollout loop
(its ``env_response`` between replies, its stop conditions), with replies sampled from the policy
being trained; rewards are the environment's rubric (weighted reward functions, group reward
functions included), metrics ``env/<reward function>`` and ``env/num_turns`` come from the rubric
too. See :mod:`prefect_tinker.recipes.rl.verifiers_bridge` and ``docs/verifiers.md``.

Needs the optional dependency: ``pip install 'prefect-tinker[verifiers]'``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.message_env import EPISODE_TURNS_LIMIT
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, load_renderer
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, RolloutContext, StopCondition, Trajectory

__all__ = ["VerifiersEnv", "VerifiersGroupBuilder", "VerifiersMember", "VerifiersOptions", "verifiers_rows"]

_INSTALL = "pip install 'prefect-tinker[verifiers]'"


class VerifiersOptions(BaseModel):
    """``env_options`` of ``env=verifiers``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        description="verifiers environment: an installed environment's id (as vf.load_environment takes it, "
        "e.g. vf-gsm8k) or the path of a .py file defining load_environment(**env_args).",
    )
    env_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of its load_environment.")
    split: Literal["train", "eval"] = Field(
        default="train", description="Rows of the environment's dataset (train) or eval_dataset (eval)."
    )
    max_examples: int | None = Field(default=None, ge=1, description="Use at most this many rows.")
    max_turns: int | None = Field(
        default=None,
        ge=1,
        le=EPISODE_TURNS_LIMIT,
        description="Override the environment's max_turns (multi-turn environments); unset: its own.",
    )
    max_trajectory_tokens: int = Field(
        default=4096,
        ge=8,
        description="Longest observation (tokens); a longer one ends the episode as verifiers' prompt_too_long.",
    )
    eval_examples: int = Field(
        default=0, ge=0, description="Rows of the environment's eval_dataset rolled out as the eval set 'verifiers'."
    )


def verifiers_rows(opts: VerifiersOptions, split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The rows of the environment's dataset (``split``: ``train`` or ``eval``; default the options'),
    as JSON-able ``RolloutInput`` dicts (``prompt``, ``answer``, ``info``, ``example_id``, ...).

    Raises:
        ValueError: verifiers is not installed, the environment cannot be loaded, or a row has
            no ``prompt`` (naming the row).
    """
    env = _load(opts)
    ds = env.get_eval_dataset() if (split or opts.split) == "eval" else env.get_dataset()
    n = len(ds) if limit is None else min(limit, len(ds))
    rows = []
    for i in range(n):
        row = json.loads(json.dumps(dict(ds[i]), default=str))
        if not isinstance(row.get("prompt"), (list, str)):
            raise ValueError(f"verifiers environment {opts.name!r}: dataset row {i}: field 'prompt' missing or empty")
        rows.append(row)
    return rows


def _bridge() -> Any:
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"env verifiers: the verifiers package is not installed ({_INSTALL})")
    from prefect_tinker.recipes.rl import verifiers_bridge

    return verifiers_bridge


def _load(opts: VerifiersOptions) -> Any:
    bridge = _bridge()
    try:
        return bridge.load_verifiers_environment(opts.name, opts.env_args, opts.max_turns)
    except (ImportError, ValueError, RuntimeError, TypeError, AttributeError, FileNotFoundError) as exc:
        raise ValueError(f"env_options.name: cannot load verifiers environment {opts.name!r}: {exc}") from exc


class VerifiersMember(Env):
    """One member of a verifiers group: its first observation is the row's prompt rendered by the
    run's renderer; its episode is played by the environment's own rollout loop
    (:meth:`VerifiersGroupBuilder.run_group`), never stepped one action at a time."""

    def __init__(self, renderer: Any, prompt: list[dict]):
        self.renderer, self.prompt = renderer, prompt

    def initial_observation(self) -> tuple[list[int], StopCondition]:
        obs = self.renderer.build_generation_prompt(self.prompt).to_ints()
        return list(obs), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> Any:
        raise RuntimeError("a verifiers episode is played by the environment's rollout loop (run_group), not step()")


@dataclass(frozen=True, kw_only=True)
class VerifiersGroupBuilder(EnvGroupBuilder):
    """``group_size`` rollouts of one dataset row (``example``: the row as JSON) of the verifiers
    environment ``name``/``env_args`` (plain values: the repr keys the rollout cache)."""

    shared_episode: ClassVar[bool] = True  # the environment's own rollout loop plays the group (run_group)

    name: str
    env_args: str  # JSON
    example: str  # JSON of the dataset row
    group_size: int
    renderer_name: str
    tokenizer_id: str
    max_turns: int | None = None
    max_trajectory_tokens: int = 4096
    tags: tuple[str, ...] = ("verifiers",)

    def make_envs(self) -> list[VerifiersMember]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        prompt = json.loads(self.example)["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return [VerifiersMember(renderer, prompt) for _ in range(self.group_size)]

    def run_group(self, envs: Any, ctx: RolloutContext) -> list[Trajectory]:
        opts = VerifiersOptions(name=self.name, env_args=json.loads(self.env_args), max_turns=self.max_turns)
        return _bridge().rollout_verifiers_group(
            _load(opts),
            json.loads(self.example),
            len(envs),
            load_renderer(self.renderer_name, self.tokenizer_id),
            ctx.sample,
            ctx.seed,
            self.max_trajectory_tokens,
        )

    def logging_tags(self) -> list[str]:
        return list(self.tags)


def _builder(opts: VerifiersOptions, ctx: EnvContext, row: dict[str, Any], group_size: int) -> VerifiersGroupBuilder:
    return VerifiersGroupBuilder(
        name=opts.name,
        env_args=json.dumps(opts.env_args, sort_keys=True, default=str),
        example=json.dumps(row, sort_keys=True),
        group_size=group_size,
        renderer_name=ctx.renderer_name,
        tokenizer_id=ctx.tokenizer_id,
        max_turns=opts.max_turns,
        max_trajectory_tokens=opts.max_trajectory_tokens,
    )


@register_env
class VerifiersEnv(Environment):
    name = "verifiers"
    description = "An environment of the verifiers library (single- or multi-turn); rewards from its own rubric."
    Options = VerifiersOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        opts = cls.options(spec)
        if opts.name.endswith(".py") and not Path(opts.name).is_file():
            raise ValueError(f"env_options.name: verifiers environment file {opts.name} does not exist")

    @classmethod
    def preflight(cls, spec: Any) -> None:
        if not verifiers_rows(cls.options(spec), limit=1):
            raise ValueError(f"verifiers environment {cls.options(spec).name!r}: its dataset is empty")

    @classmethod
    def build(cls, spec: Any, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        rows = verifiers_rows(opts, limit=opts.max_examples)
        return ProblemDataset(rows, ctx.groups_per_batch, lambda r: _builder(opts, ctx, r, ctx.group_size), ctx.seed)

    @classmethod
    def eval_builders(cls, spec: Any, ctx: EnvContext) -> dict[str, list[EnvGroupBuilder]]:
        opts = cls.options(spec)
        if not opts.eval_examples:
            return {}
        rows = verifiers_rows(opts, split="eval", limit=opts.eval_examples)
        return {"verifiers": [_builder(opts, ctx, r, 1) for r in rows]}
