"""LLM-judge calls as a cached Prefect task.

``judge_reply(credentials, request)`` renders the judge's prompt of a
:class:`~prefect_tinker.recipes.rl.judge.JudgeRequest` with the judge's renderer (the reply
encoded as text: its special-token strings never become control tokens), samples one answer from
the judge's weights (``base:<model>`` or ``tinker://.../sampler_weights/...``, on any backend the
credentials reach) and returns the answer text. The task is cached across flow runs under the
request's content, i.e. (judge weights, judge renderer and tokenizer, rubric, conversation,
reply, scale, sampling settings), the backend serving the judge's weights
(``TinkerCredentials.backend_identity()``: the same ``base:<model>`` on two servers is two
judges), plus the task's source: a repeated group, a replayed rollout or
a resumed step never asks the judge twice. Rollout tasks lend it to environments as
:attr:`RolloutContext.judge <prefect_tinker.recipes.rl.types.RolloutContext>`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import tinker
from prefect import task

from prefect_tinker.recipes.rl.judge import JudgeRequest, judge_messages
from prefect_tinker.recipes.rl.problem_env import load_renderer
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.policies import cached_options

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["judge_prompt_tokens", "judge_reply"]


def _key(context: Any, params: dict[str, Any]) -> str:
    """The request's content and where the judge's weights are served (``base:<model>`` or a
    ``tinker://`` path names different weights on two servers)."""
    where = params["credentials"].backend_identity()
    return hashlib.sha256(repr((where, params["request"])).encode("utf-8")).hexdigest()


def judge_prompt_tokens(request: JudgeRequest) -> list[int]:
    """The judge's prompt (token ids, length P) of ``request``, rendered by the judge's renderer.

    Raises:
        ValueError: an empty rubric. RendererError / OSError: unknown renderer, missing tokenizer.
    """
    renderer = load_renderer(request.renderer_name, request.tokenizer_id)
    return renderer.build_generation_prompt(judge_messages(request)).to_ints()


@task(
    name="judge-reply",
    task_run_name="judge-{request.judge}",
    **cached_options(_key),
)
def judge_reply(credentials: TinkerCredentials, request: JudgeRequest) -> str:
    """The judge's answer (text, stop sequence removed) to ``request`` (module docstring).

    Raises:
        ValueError: an empty rubric. tinker errors: the judge's weights cannot be sampled
            (transient ones retried by ``RETRY_OPTIONS``).
    """
    renderer = load_renderer(request.renderer_name, request.tokenizer_id)
    prompt = judge_prompt_tokens(request)
    params = tinker.SamplingParams(
        max_tokens=request.max_tokens, temperature=request.temperature, seed=0, stop=renderer.get_stop_sequences()
    )
    resp = (
        sampling_client(credentials, request.judge)
        .sample(prompt=tinker.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params)
        .result()
    )
    return renderer.parse_response(list(resp.sequences[0].tokens)).message.get("content") or ""
