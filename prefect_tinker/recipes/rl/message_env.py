"""Multi-turn message environments: a conversation rendered with the run's renderer, the policy's
replies parsed into text and tool calls, tool results (or the environment's own replies) fed back.

An episode of a :class:`MessageEnv`:

1. the first observation is ``renderer.build_generation_prompt(messages, tools=schemas)``;
2. each sampled reply is parsed (``renderer.parse_response``) and appended to the conversation;
   a reply that does not parse (malformed tool-call JSON, an unclosed think block, or cut off at
   ``max_tokens``, or one the renderer cannot write back into the conversation) ends the episode
   with ``failed_parse_reward``;
3. :meth:`MessageEnv.react` answers it: by default its tool calls are run (:class:`Toolset`:
   unknown tools, bad arguments, exceptions and timeouts come back as ``Error: ...`` tool
   results, never as exceptions) and the episode goes on; a reply without tool calls is the final
   answer, graded by :meth:`MessageEnv.finish`, which ends the episode;
4. the episode also ends after ``max_turns`` replies, and when the next observation would be
   longer than ``max_trajectory_tokens`` (``context_overflow_reward``).

Token layout: the next observation is the previous observation, then the sampled reply tokens
exactly as sampled, then what the renderer writes after a reply (ChatML's ``\\n`` after
``<|im_end|>``; the end-of-turn token too when the reply lacks it), then the new messages and a
new assistant header, each rendered by the renderer's own segments. So every observation extends
the sequence so far, and :func:`~prefect_tinker.recipes.rl.advantages.trajectory_to_datums`
merges a whole episode into one datum: every sampled token trained with its sampler logprob and
the trajectory's advantage, every observation token (prompt, tool results, headers) weight 0.
(``chat_template``, which renders whole conversations only, re-renders the conversation instead:
its observations need not extend and its episodes may give several datums.)

Metrics: the last transition of an episode carries its episode-level numbers, so ``env/<name>``
is a mean per episode: ``tool_calls``, ``tool_errors``, ``parse_failed``, ``context_overflow``,
``max_turns_reached`` and whatever :meth:`MessageEnv.finish` adds (``correct``, ``format``...;
0 in episodes that ended otherwise).

Source: the Tinker cookbook's message environments and tool-use recipes (concepts: a renderer-driven
conversation, ``failed_parse_reward``, ``max_trajectory_tokens``); written anew.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.renderers import RendererError, normalize_messages
from prefect_tinker.recipes.rl.problem_env import load_renderer
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult, StopCondition

__all__ = [
    "EPISODE_TURNS_LIMIT",
    "EpisodeLimits",
    "GeneratedDataset",
    "MessageEnv",
    "MessageEnvOptions",
    "MessageGroupBuilder",
    "Reaction",
    "continuation_tokens",
    "freeze",
    "problem_rng",
    "thaw",
]

#: Most replies per episode (the rollout task's ``MAX_TURNS``: a longer episode fails there).
EPISODE_TURNS_LIMIT = 32


@dataclass(frozen=True)
class EpisodeLimits:
    """How a message episode may end besides its own verdict (plain values: part of builders' repr).

    Attributes:
        max_turns: most replies (>= 1); the episode ends after the last one.
        max_trajectory_tokens: longest observation the policy may continue (tokens).
        failed_parse_reward: reward of a reply that does not parse (ends the episode).
        context_overflow_reward: reward when the next observation would exceed
            ``max_trajectory_tokens`` (ends the episode).
    """

    max_turns: int = 4
    max_trajectory_tokens: int = 2048
    failed_parse_reward: float = -0.1
    context_overflow_reward: float = -0.1


class MessageEnvOptions(BaseModel):
    """``env_options`` every message environment takes (environments subclass it)."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=4, ge=1, le=EPISODE_TURNS_LIMIT, description="Most replies per episode.")
    max_trajectory_tokens: int = Field(
        default=2048, ge=8, description="Longest observation (tokens) the policy may continue; longer ends the episode."
    )
    failed_parse_reward: float = Field(
        default=-0.1, description="Reward of a reply that does not parse (bad tool-call JSON, cut off)."
    )
    context_overflow_reward: float = Field(
        default=-0.1, description="Reward when the conversation outgrows max_trajectory_tokens."
    )

    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(
            self.max_turns, self.max_trajectory_tokens, self.failed_parse_reward, self.context_overflow_reward
        )


@dataclass
class Reaction:
    """What an environment does with one parsed reply (:meth:`MessageEnv.react`).

    Attributes:
        messages: messages appended after the reply (tool results, the environment's answer).
        done: whether the episode ends with this reply.
        reward: the step's reward.
        metrics: episode-level numbers (reported with the episode's last transition).
        logs: short texts kept with the trajectory.
        wait: not done, but the next observation is not known yet (the other player of a shared
            game moves first); the stepper then adds messages with :meth:`MessageEnv.add_messages`
            and asks for :meth:`MessageEnv.observe`.
    """

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    wait: bool = False


def freeze(messages: Sequence[dict]) -> tuple:
    """Messages (nested dicts and lists of plain values) as nested tuples: hashable, stable repr."""

    def f(v: Any) -> Any:
        if isinstance(v, dict):
            return ("__dict__", tuple((str(k), f(x)) for k, x in v.items()))
        if isinstance(v, (list, tuple)):
            return ("__list__", tuple(f(x) for x in v))
        return v

    return tuple(f(m) for m in messages)


def thaw(frozen: tuple) -> list[dict]:
    """Inverse of :func:`freeze`."""

    def t(v: Any) -> Any:
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
            return {k: t(x) for k, x in v[1]}
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "__list__":
            return [t(x) for x in v[1]]
        return v

    return [t(m) for m in frozen]


def continuation_tokens(
    renderer: Any, messages: Sequence[dict], k: int, action: Sequence[int], tools: Sequence[dict] | None = None
) -> list[int] | None:
    """Tokens that follow a sampled reply: the renderer's end of that reply, the messages after it
    and the header of the next assistant message.

    Args:
        messages: the conversation; ``messages[k]`` is the assistant reply whose tokens were
            sampled as ``action``, ``messages[k+1:]`` the new messages (at least one).
        tools: the function schemas the conversation was rendered with.

    Returns:
        The tokens to append to ``observation + action``: ``sep`` of the reply (``end`` + ``sep``
        when the reply did not end with a stop token), then every segment after the reply (a
        role_colon header that the sampled stop string already wrote is skipped), then the
        assistant header. None for renderers that render whole conversations only (no segments).

    Raises:
        RendererError: the conversation cannot be rendered.
    """
    segs = renderer.segments(normalize_messages(messages), tools)
    if segs is None:
        return None
    own = [j for j, s in enumerate(segs) if s.owner == k]
    if not own:
        return None
    end = [t for j in own if segs[j].part == "end" for t in segs[j].tokens]
    sep = [t for j in own if segs[j].part == "sep" for t in segs[j].tokens]
    stops = renderer.get_stop_sequences()
    token_stops = {s for s in stops if isinstance(s, int)}
    out = list(sep) if (not end or (action and int(action[-1]) in token_stops)) else end + sep
    rest = segs[own[-1] + 1 :]
    text_stops = [s for s in stops if isinstance(s, str)]
    if text_stops and rest and rest[0].closes == k:
        text = renderer.tokenizer.decode(list(action), skip_special_tokens=False)
        header = renderer.tokenizer.decode(rest[0].tokens, skip_special_tokens=False)
        if any(text.endswith(s) and s.endswith(header) for s in text_stops):
            rest = rest[1:]  # "\n\nUser:" was sampled: the next header is already there
    for s in rest:
        out += s.tokens
    return out + renderer.assistant_header()


class MessageEnv(Env):
    """A multi-turn conversation episode (see the module docstring).

    Args:
        renderer: the run's renderer.
        messages: the conversation before the first reply (system prompt, few-shot turns, the task).
        toolset: tools declared to the model (None or empty: no tools).
        limits: turn, length and reward limits.

    Subclasses implement :meth:`finish` (grade a final reply) and may override :meth:`react`;
    :attr:`outcome_metrics` are the metrics :meth:`finish` reports, 0 in episodes that end
    otherwise (a parse failure, no turns left), so that their means count every episode.
    """

    outcome_metrics: tuple[str, ...] = ()
    #: True: a reply that does not parse (cut off at ``max_tokens``, malformed) is kept as plain
    #: text and the episode goes on, instead of ending with ``failed_parse_reward`` (episodes whose
    #: length must not depend on the policy's formatting, e.g. ``numerics_check``).
    keep_unparsed_replies: bool = False

    def __init__(
        self, renderer: Any, messages: Sequence[dict], *, toolset: Any = None, limits: EpisodeLimits = EpisodeLimits()
    ):
        self.renderer, self.limits, self.toolset = renderer, limits, toolset
        self.messages: list[dict] = [dict(m) for m in messages]
        self.schemas = toolset.schemas if toolset is not None and toolset.tools else None
        self.turns = self.tool_calls = self.tool_errors = 0
        self._observation: list[int] | None = None
        self._sequence: list[int] = []  # the last observation + the last reply's tokens
        self._action: list[int] = []  # the last reply's tokens
        self._rendered = 0  # messages[:_rendered] are in _sequence

    # ---- to implement -------------------------------------------------------------------
    def finish(self, reply: dict) -> Reaction:
        """Grade a final reply (one without tool calls): a :class:`Reaction` with ``done=True``."""
        raise NotImplementedError

    def react(self, reply: dict) -> Reaction:
        """Answer a parsed reply: run its tool calls (episode goes on), or :meth:`finish` it."""
        calls = reply.get("tool_calls") or []
        if not calls or self.schemas is None:
            return self.finish(reply)
        out = []
        for call in calls:
            result = self.toolset.call(call)
            self.tool_calls += 1
            self.tool_errors += int(not result.ok)
            out.append(self.toolset.tool_message(call, result))
        return Reaction(out)

    # ---- Env ------------------------------------------------------------------------------
    def initial_observation(self) -> tuple[list[int], StopCondition]:
        """The prompt (P,) and the renderer's stop condition.

        Raises:
            ValueError: the prompt alone is longer than ``max_trajectory_tokens``.
        """
        prompt = self.renderer.build_generation_prompt(self.messages, tools=self.schemas).to_ints()
        if len(prompt) > self.limits.max_trajectory_tokens:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, more than max_trajectory_tokens="
                f"{self.limits.max_trajectory_tokens}"
            )
        self._observation, self._rendered = list(prompt), len(self.messages)
        return list(prompt), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        if self._observation is None:
            raise RuntimeError("step() before initial_observation() / observe()")
        self.turns += 1
        self._action = [int(t) for t in action]
        self._sequence, self._observation = self._observation + self._action, None
        parsed = self.renderer.parse_response(action)
        if not parsed.ok and self.keep_unparsed_replies:
            parsed = parsed._replace(message={"role": "assistant", "content": parsed.message.get("content") or ""})
        elif not parsed.ok:
            return self._end(
                Reaction(
                    done=True,
                    reward=self.limits.failed_parse_reward,
                    logs={"response": parsed.message.get("content") or ""},
                ),
                "parse_failure",
                parse_failed=1.0,
            )
        self.messages.append(parsed.message)
        reaction = self.react(parsed.message)
        self.messages.extend(reaction.messages)
        if reaction.done:
            return self._end(reaction, reaction.logs.get("end", "answer"))
        if self.turns >= self.limits.max_turns:
            return self._end(reaction, "max_turns", max_turns_reached=1.0)
        if reaction.wait:
            return StepResult(reaction.reward, False)
        return self._next(reaction.reward)

    # ---- for steppers of shared episodes ---------------------------------------------------
    def add_messages(self, messages: Sequence[dict]) -> None:
        """Append messages (e.g. the other player's move) before the next :meth:`observe`."""
        self.messages.extend(dict(m) for m in messages)

    def observe(self) -> list[int]:
        """The next observation: the sequence so far + the end of the last reply + the messages
        after it + an assistant header (a full re-rendering for renderers without segments)."""
        tail = continuation_tokens(self.renderer, self.messages, self._rendered, self._action, self.schemas)
        if tail is None:
            obs = self.renderer.build_generation_prompt(self.messages, tools=self.schemas).to_ints()
        else:
            obs = self._sequence + tail
        self._observation, self._rendered = list(obs), len(self.messages)
        return list(obs)

    def end_episode(self, reaction: Reaction, end: str, **flags: float) -> StepResult:
        """End the episode from outside a step (a shared game ended on the other player's move):
        the episode-level metrics (``flags`` among them) with ``reaction``'s reward."""
        return self._end(reaction, end, **flags)

    # ---- internals --------------------------------------------------------------------------
    def _next(self, reward: float) -> StepResult:
        try:
            obs = self.observe()
        except RendererError as exc:  # a parsed reply the format cannot write back (llama3: text + call)
            return self._end(
                Reaction(done=True, reward=self.limits.failed_parse_reward, logs={"detail": str(exc)[:200]}),
                "parse_failure",
                parse_failed=1.0,
            )
        if len(obs) > self.limits.max_trajectory_tokens:
            self._observation = None
            return self._end(
                Reaction(done=True, reward=self.limits.context_overflow_reward),
                "context_overflow",
                context_overflow=1.0,
            )
        return StepResult(reward, False, obs, self.renderer.get_stop_sequences())

    def _end(self, reaction: Reaction, end: str, **flags: float) -> StepResult:
        metrics = {
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "parse_failed": 0.0,
            "context_overflow": 0.0,
            "max_turns_reached": 0.0,
            **flags,
            **{k: 0.0 for k in self.outcome_metrics},
            **reaction.metrics,
        }
        return StepResult(float(reaction.reward), True, metrics=metrics, logs={**reaction.logs, "end": end})


@dataclass(frozen=True, kw_only=True)
class MessageGroupBuilder(EnvGroupBuilder):
    """Base of the message environments' group builders: ``group_size`` envs of :meth:`make_env`
    on the renderer ``renderer_name`` for ``tokenizer_id`` (resolved in the worker, cached per
    process). Subclasses add the problem's fields (plain values: the repr keys the rollout cache)."""

    group_size: int
    renderer_name: str
    tokenizer_id: str
    limits: EpisodeLimits = EpisodeLimits()
    tags: tuple[str, ...] = ()

    def make_env(self, renderer: Any) -> MessageEnv:
        """One fresh env of the group."""
        raise NotImplementedError

    def make_envs(self) -> list[MessageEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        return [self.make_env(renderer) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


class GeneratedDataset(RLDataset):
    """An unbounded dataset of generated problems: batch ``i`` is ``[make(i, g) for g in
    range(groups_per_batch)]`` (``make`` a pure function of its arguments)."""

    def __init__(self, groups_per_batch: int, make: Callable[[int, int], EnvGroupBuilder]):
        self.groups_per_batch, self.make = groups_per_batch, make

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        return [self.make(index, g) for g in range(self.groups_per_batch)]


def problem_rng(seed: int, *keys: int) -> np.random.Generator:
    """A generator seeded by ``(seed, *keys)`` (e.g. batch and group): generated problems are a
    pure function of the run's seed and their place in the dataset."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *(int(k) for k in keys)])
