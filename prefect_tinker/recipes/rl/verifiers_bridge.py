"""Run environments of the ``verifiers`` library (Prime Intellect) on this project's Tinker samplers.

A ``verifiers`` environment (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv`` and their kin: a dataset of
``prompt``/``answer``/``info`` rows, a ``Parser`` and a ``Rubric`` of weighted reward functions) runs
its own rollout loop: ``env.run_group(inputs, client, model, sampling_args)`` asks ``client`` for each
model reply, calls ``env_response`` between replies, stops on the environment's stop conditions and
scores the group with ``env.rubric`` (group reward functions included). This module lends it a
``vf.Client`` whose replies are sampled from the policy being trained (the rollout task's
``RolloutContext.sample``), so an unmodified environment runs; the client records, per reply, the
observation tokens, the sampled tokens and their sampler logprobs as the project's
:class:`~prefect_tinker.recipes.rl.types.Transition` records, and the rubric's reward is the reward
of the episode's last transition.

Token layout (as in :mod:`prefect_tinker.recipes.rl.message_env`): when the environment's next
prompt extends the conversation so far (the usual multi-turn case: the previous prompt, the reply,
the environment's messages), the next observation is the previous observation, the sampled reply
tokens exactly as sampled and the renderer's continuation (end of the reply, new messages, assistant
header), so a whole episode trains as one datum; otherwise (an environment that rewrites its
history) the prompt is rendered anew.

Imports ``verifiers`` at module level: import this module only when the package is installed
(``pip install 'prefect-tinker[verifiers]'``; the classic API of verifiers 0.2.x).

Source: verifiers 0.2 ``verifiers/envs/environment.py`` (``run_group``, ``get_model_response``),
``verifiers/clients/client.py`` (the ``Client`` interface) and ``verifiers/types.py`` (``Response``);
read for the interface, written anew.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import verifiers as vf
import verifiers.envs.environment as vf_environment
from verifiers.clients import Client
from verifiers.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage

from prefect_tinker.recipes.renderers import normalize_messages
from prefect_tinker.recipes.rl.message_env import EPISODE_TURNS_LIMIT, continuation_tokens
from prefect_tinker.recipes.rl.types import SampledAction, StopCondition, Trajectory, Transition

__all__ = [
    "MemberRecord",
    "TinkerSamplerClient",
    "load_verifiers_environment",
    "rollout_verifiers_group",
    "run_coroutine",
    "to_plain_messages",
]

_local = threading.local()
_load_lock = threading.Lock()
_envs: dict[tuple[str, str, int | None], Any] = {}


@contextmanager
def _signal_handlers_skipped() -> Iterator[None]:
    """verifiers' ``Environment.__init__`` installs process-wide SIGINT/SIGTERM handlers (its teardown,
    then ``exit``), which Python allows in the main thread only and which would change how a run
    process reacts to signals (a SIGTERM would leave it waiting on its rollout threads). Building an
    environment under this context skips them; its ``atexit`` teardown stays. Only verifiers' own
    module sees the stand-in (loads hold ``_load_lock``)."""
    real = vf_environment.signal
    vf_environment.signal = types.SimpleNamespace(
        signal=lambda *a, **k: None,
        SIGINT=real.SIGINT,
        SIGTERM=real.SIGTERM,
        default_int_handler=real.default_int_handler,
    )
    try:
        yield
    finally:
        vf_environment.signal = real


def load_verifiers_environment(name: str, env_args: dict[str, Any] | None = None, max_turns: int | None = None) -> Any:
    """A ``verifiers`` environment by name, as ``vf.load_environment`` loads it, or from a file.

    Args:
        name: an environment id (the module of an installed environment package, e.g.
            ``"vf-gsm8k"`` -> ``vf_gsm8k``, imported and its ``load_environment(**env_args)``
            called, as ``vf.load_environment`` does), or the path of a ``.py`` file that defines
            ``load_environment(**env_args)``.
        env_args: keyword arguments of ``load_environment``.
        max_turns: replaces the environment's ``max_turns`` (multi-turn environments) when given.

    Returns:
        The ``vf.Environment``, loaded once per process and (name, env_args, max_turns): the flow
        loads it when it builds the dataset, and the rollout tasks of its thread pool share it (a
        process of a Ray or Dask worker loads its own).

    Raises:
        FileNotFoundError: a ``.py`` path that does not exist.
        ValueError / RuntimeError: the environment cannot be imported or loaded (verifiers' message).
        TypeError: ``load_environment`` returned something other than a ``vf.Environment``.
    """
    key = (name, json.dumps(env_args or {}, sort_keys=True, default=str), max_turns)
    with _load_lock:
        if key not in _envs:
            args = dict(env_args or {})
            with _signal_handlers_skipped():
                env = _load_file(Path(name), args) if name.endswith(".py") else vf.load_environment(name, **args)
            if not isinstance(env, vf.Environment):
                raise TypeError(f"load_environment of {name!r} returned {type(env).__name__}, not a vf.Environment")
            if max_turns is not None and hasattr(env, "max_turns"):
                env.max_turns = max_turns
            _envs[key] = env
        return _envs[key]


def _load_file(path: Path, args: dict[str, Any]) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"verifiers environment file {path} does not exist")
    module_name = f"prefect_tinker_vf_{path.stem}_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{path}: not an importable Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        raise ValueError(f"{path}: defines no load_environment(**env_args) function")
    env = load(**args)
    if isinstance(env, vf.Environment):
        env.env_id = env.env_id or path.stem
    return env


def run_coroutine(coro: Any) -> Any:
    """Run ``coro`` to completion from synchronous code, on this thread's own event loop (one per
    thread, kept open across calls); in a helper thread with a fresh loop when this thread already
    runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = _local.__dict__.get("loop")
        if loop is None or loop.is_closed():
            loop = _local.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def to_plain_messages(messages: Sequence[Any]) -> list[dict]:
    """verifiers messages (pydantic models or dicts) as this project's message dicts: ``role``,
    ``content`` (text; text parts joined), ``reasoning_content``, ``tool_calls`` in the OpenAI form
    ``{"id", "type": "function", "function": {"name", "arguments"}}``, ``tool_call_id``."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        msg: dict[str, Any] = {"role": d["role"], "content": _text(d.get("content"))}
        if isinstance(d.get("reasoning_content"), str):
            msg["reasoning_content"] = d["reasoning_content"]
        if d.get("tool_calls"):
            msg["tool_calls"] = [_openai_call(c) for c in d["tool_calls"]]
        if d.get("tool_call_id"):
            msg["tool_call_id"] = d["tool_call_id"]
        out.append(msg)
    return out


def _openai_call(call: Any) -> dict:
    """A verifiers tool call (``vf.ToolCall``, its dict, or its JSON as rollout outputs keep it) in
    the OpenAI form."""
    c = json.loads(call) if isinstance(call, str) else call
    c = c.model_dump() if hasattr(c, "model_dump") else dict(c)
    if "function" in c:
        return c
    return {
        "id": c.get("id", ""),
        "type": "function",
        "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "{}")},
    }


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _same(a: dict, b: dict) -> bool:
    return a["role"] == b["role"] and a["content"] == b["content"]


class MemberRecord:
    """What one member's episode sampled: its transitions and the conversation they render."""

    def __init__(self, index: int):
        self.index = index
        self.transitions: list[Transition] = []
        self.messages: list[dict] = []  # the conversation up to and including the last reply
        self.sequence: list[int] = []  # the last observation + the last reply's tokens
        self.action: list[int] = []


class TinkerSamplerClient(Client):
    """A ``vf.Client`` whose replies come from a Tinker sampler (see the module docstring).

    Args:
        renderer: the run's renderer (prompts in, parsed replies out).
        sample: ``sample(observation, stop, seed) -> (tokens, logprobs, stop_reason)``.
        seed: the group's seed; reply ``t`` of member ``i`` samples with ``seed + 7919 i + 104729 t``.
        max_trajectory_tokens: an observation longer than this raises ``vf.OverlongPromptError``
            (the environment ends the episode as ``prompt_too_long`` and scores it).

    Members are numbered in the order of their first request (deterministic: verifiers starts the
    group's rollouts in order on one event loop, and requests are served one at a time).
    """

    def __init__(
        self,
        renderer: Any,
        sample: Callable[[list[int], StopCondition, int], SampledAction],
        seed: int,
        max_trajectory_tokens: int,
    ):
        super().__init__(sample)
        self.renderer, self.seed, self.max_trajectory_tokens = renderer, seed, max_trajectory_tokens
        self.records: dict[str, MemberRecord] = {}
        self._lock = asyncio.Lock()

    def setup_client(self, config: Any) -> Any:
        raise TypeError("TinkerSamplerClient samples through the sampler it is given, not from a ClientConfig")

    async def to_native_tool(self, tool: Any) -> dict:
        return {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
        }

    async def to_native_prompt(self, messages: Any) -> tuple[list[dict], dict]:
        return to_plain_messages(messages), {}

    async def get_native_response(
        self, prompt: list[dict], model: str, sampling_args: Any, tools: list[dict] | None = None, **kwargs: Any
    ) -> dict:
        state = kwargs.get("state")
        key = str(state["trajectory_id"]) if state is not None else uuid.uuid4().hex
        rec = self.records.setdefault(key, MemberRecord(len(self.records)))
        if len(rec.transitions) >= EPISODE_TURNS_LIMIT:
            raise RuntimeError(f"the episode asked for more than {EPISODE_TURNS_LIMIT} replies")
        conversation, observation = self._observation(rec, prompt, tools)
        if len(observation) > self.max_trajectory_tokens:
            raise vf.OverlongPromptError(
                f"observation of {len(observation)} tokens > max_trajectory_tokens={self.max_trajectory_tokens}"
            )
        seed = self.seed + 7919 * rec.index + 104729 * len(rec.transitions)
        stop = self.renderer.get_stop_sequences()
        async with self._lock:  # one request at a time: the sampler's usage tally is not thread-safe
            tokens, logprobs, reason = await asyncio.to_thread(self.sample, observation, stop, seed)
        tokens = [int(t) for t in tokens]
        parsed = self.renderer.parse_response(tokens).message
        rec.transitions.append(Transition(list(observation), tokens, [float(x) for x in logprobs], 0.0, False, reason))
        rec.messages = [*conversation, dict(parsed)]
        rec.sequence, rec.action = list(observation) + tokens, tokens
        return {"message": parsed, "observation": observation, "tokens": tokens, "logprobs": logprobs, "reason": reason}

    @property
    def sample(self) -> Callable[[list[int], StopCondition, int], SampledAction]:
        return self.client

    def _observation(self, rec: MemberRecord, prompt: list[dict], tools: list[dict] | None) -> tuple[list, list]:
        """(the conversation to render, its observation tokens): the previous sequence continued
        when ``prompt`` extends the recorded conversation, else ``prompt`` rendered anew."""
        k = len(rec.messages)
        if k and len(prompt) > k and all(_same(a, b) for a, b in zip(rec.messages, prompt[:k], strict=False)):
            conversation = [*rec.messages, *prompt[k:]]
            tail = continuation_tokens(self.renderer, conversation, k - 1, rec.action, tools)
            if tail is not None:
                return conversation, rec.sequence + tail
        return prompt, self.renderer.build_generation_prompt(normalize_messages(prompt), tools=tools).to_ints()

    async def raise_from_native_response(self, response: dict) -> None:
        return None

    async def from_native_response(self, response: dict) -> Response:
        msg, tokens, obs = response["message"], response["tokens"], response["observation"]
        calls = [
            ToolCall(
                id=str(c.get("id") or f"call_{i}"),
                name=str(c["function"]["name"]),
                arguments=c["function"]["arguments"]
                if isinstance(c["function"]["arguments"], str)
                else json.dumps(c["function"]["arguments"]),
            )
            for i, c in enumerate(msg.get("tool_calls") or [])
        ]
        truncated = response["reason"] == "length"
        return Response(
            id=uuid.uuid4().hex,
            created=int(time.time()),
            model="policy",
            usage=Usage(
                prompt_tokens=len(obs),
                reasoning_tokens=0,
                completion_tokens=len(tokens),
                total_tokens=len(obs) + len(tokens),
            ),
            message=ResponseMessage(
                content=msg.get("content") or "",
                reasoning_content=msg.get("reasoning_content"),
                tool_calls=calls or None,
                finish_reason="length" if truncated else ("tool_calls" if calls else "stop"),
                is_truncated=truncated,
                tokens=ResponseTokens(
                    prompt_ids=list(obs),
                    prompt_mask=[0] * len(obs),
                    completion_ids=list(tokens),
                    completion_mask=[1] * len(tokens),
                    completion_logprobs=[float(x) for x in response["logprobs"]],
                ),
            ),
        )

    async def close(self) -> None:
        return None


def rollout_verifiers_group(
    env: Any,
    example: dict[str, Any],
    group_size: int,
    renderer: Any,
    sample: Callable[[list[int], StopCondition, int], SampledAction],
    seed: int,
    max_trajectory_tokens: int,
) -> list[Trajectory]:
    """``group_size`` rollouts of one dataset row through the environment's own ``run_group``
    (rollout loop, ``env_response``, stop conditions, rubric scoring), replies from ``sample``.

    Returns:
        One trajectory per member, in member order (G,): a transition per reply; the last one
        carries the rubric's reward, ``done``, the rubric's metrics (one per reward function,
        ``num_turns``...) plus ``turns``, ``truncated``, ``prompt_too_long``, and logs ``end``
        (the stop condition), ``reference`` (the row's answer) and ``completion`` (the
        environment's completion messages as JSON).

    Raises:
        RuntimeError: a rollout ended with an error (``state["error"]``: a failing
            ``env_response``, a sampling error) or without any reply.
    """
    client = TinkerSamplerClient(renderer, sample, seed, max_trajectory_tokens)
    inputs = [json.loads(json.dumps(example)) for _ in range(group_size)]
    outputs = run_coroutine(
        env.run_group(inputs, client, "policy", dict(env.sampling_args or {}), state_columns=["trajectory_id"])
    )
    trajectories: list[Trajectory | None] = [None] * group_size
    for out in outputs:
        if out.get("error"):
            raise RuntimeError(f"verifiers rollout failed: {out['error']}")
        rec = client.records.get(str(out.get("trajectory_id")))
        if rec is None or not rec.transitions:
            raise RuntimeError(f"verifiers rollout made no model request (stop condition {out.get('stop_condition')})")
        last = rec.transitions[-1]
        metrics = {str(k): float(v) for k, v in (out.get("metrics") or {}).items()}
        stop = str(out.get("stop_condition") or "")
        metrics.update(
            turns=float(len(rec.transitions)),
            truncated=float(bool(out.get("is_truncated"))),
            prompt_too_long=float(stop == "prompt_too_long"),
        )
        last.reward, last.episode_done, last.metrics = float(out.get("reward") or 0.0), True, metrics
        last.logs = {
            "end": stop,
            "reference": str(example.get("answer", "")),
            "completion": json.dumps(to_plain_messages(out.get("completion") or []))[:4000],
        }
        trajectories[rec.index] = Trajectory(rec.transitions, [])
    if any(t is None for t in trajectories):
        raise RuntimeError(f"verifiers returned {len(outputs)} rollouts for a group of {group_size}")
    return [t for t in trajectories if t is not None]
