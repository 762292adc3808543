"""Sampling completions from saved sampler weights, as a cached Prefect task."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import tinker
from prefect import task

from prefect_tinker.recipes.media import media_key, model_input_from_tokens
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.policies import cached_options, run_name_from_parameters

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["completion_tokens", "sample_completions"]


def _sample_run_name(parameters: dict[str, Any]) -> str:
    """``sample-<checkpoint name>``, e.g. ``sample-my-run-step-000006`` for
    ``tinker://<model>/sampler_weights/my-run-step-000006`` (the name carries run and step)."""
    path = str(parameters.get("sampler_path") or "")
    return f"sample-{path.rstrip('/').rsplit('/', 1)[-1] or 'weights'}"


def _sample_cache_key(context: Any, params: dict[str, Any]) -> str:
    keyed = {k: v for k, v in params.items() if k not in ("credentials", "prompts")}
    keyed["prompts"] = [media_key(p) for p in params["prompts"]]  # media by content, not by placeholder
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()


@task(
    name="sample-completions",
    task_run_name=run_name_from_parameters(_sample_run_name),
    # A pure function of (sampler weights path, prompts incl. their media, sampling params incl.
    # seed); the block is excluded from the key (which backend served it does not change the answer).
    **cached_options(_sample_cache_key),
)
def sample_completions(
    credentials: TinkerCredentials,
    sampler_path: str,
    prompts: list[list[int]],
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: list[str] | list[int] | None = None,
    num_samples: int = 1,
) -> list[list[dict[str, Any]]]:
    """Sample ``num_samples`` completions for each prompt (token ids; images / audio as
    :class:`~prefect_tinker.recipes.media.MediaToken` runs) from ``sampler_path`` (a
    ``tinker://.../sampler_weights/...`` path).

    Returns, per prompt, a list of ``{"tokens": [...], "logprobs": [...], "stop_reason": ...}``.
    Prompt ``i`` uses seed ``seed + i``, so results are reproducible and cacheable.
    """
    client = sampling_client(credentials, sampler_path)
    futures = [
        client.sample(
            prompt=model_input_from_tokens(p),
            num_samples=num_samples,
            sampling_params=tinker.SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + i, stop=stop
            ),
        )
        for i, p in enumerate(prompts)
    ]
    out = []
    for fut in futures:
        resp = fut.result()
        out.append(
            [
                {"tokens": list(s.tokens), "logprobs": list(s.logprobs or []), "stop_reason": str(s.stop_reason)}
                for s in resp.sequences
            ]
        )
    return out


def completion_tokens(prompts: list[list[int]], outs: list[list[dict[str, Any]]]) -> dict[str, float]:
    """The evaluation tokens of a :func:`sample_completions` call (``prompts`` and what it
    returned): ``tokens/eval_prefill``, every prompt once (media runs at their model-input length),
    and ``tokens/eval_sampled``, every returned completion's tokens (see
    :mod:`prefect_tinker.recipes.pricing`)."""
    return {
        "tokens/eval_prefill": float(sum(model_input_from_tokens(p).length for p in prompts)),
        "tokens/eval_sampled": float(sum(len(c["tokens"]) for out in outs for c in out)),
    }
