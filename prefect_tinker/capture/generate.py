"""Chat completions and completions: render, sample, parse, and the capture rows of the result.

A request's result is a :class:`Generation`: the OpenAI choices (``message`` or ``text``,
``finish_reason``, ``logprobs``), the usage counts and one ``captures`` row per returned
sequence. JSON bodies and SSE chunks are written from it by :mod:`.responses`.

Counting: ``prompt_tokens`` is the rendered prompt's length (summed over prompts for a multi-prompt
completion request); ``completion_tokens`` counts every sampled token, the end-of-turn / EOS
token that ended a sequence included, which is also what each row's ``completion_token_ids``
holds. Row logprob statistics cover the same tokens (nats; temperature-1 logprobs as the
sampler reports them).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect_tinker.capture.model import ServedModel
from prefect_tinker.capture.requests import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    to_renderer_messages,
)
from prefect_tinker.recipes.renderers import RendererError, Termination

__all__ = ["Generation", "RequestContext", "chat_completion", "completion"]


@dataclass
class RequestContext:
    """Who asked and when: ``run_id`` (capture session), ``client`` (path tag, ``user`` or user
    agent), ``started`` (``time.monotonic()`` when the request arrived)."""

    run_id: str
    client: str | None = None
    started: float = field(default_factory=time.monotonic)


@dataclass
class Generation:
    """One answered request: ``id``, ``object`` (``chat.completion`` | ``text_completion``),
    ``created`` (Unix s), ``model``, ``choices`` (OpenAI choice dicts), ``usage`` and the
    ``rows`` for the ``captures`` table."""

    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, int]
    rows: list[dict[str, Any]]


def _stats(logprobs: Sequence[float] | None) -> dict[str, float | None]:
    vals = [float(v) for v in (logprobs or []) if v is not None and not math.isnan(v)]
    if not vals:
        return {"logprob_sum": None, "logprob_mean": None, "logprob_min": None}
    return {"logprob_sum": sum(vals), "logprob_mean": sum(vals) / len(vals), "logprob_min": min(vals)}


def _cut(text: str, stops: Sequence[str] | None) -> int | None:
    """Index of the earliest client stop string in ``text``, or None."""
    hits = [text.find(s) for s in stops or () if s in text]
    return min(hits) if hits else None


def _sampling(req: Any, model: ServedModel, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "max_tokens": max_tokens,
        "seed": req.seed,
        "stop": req.stop,
        "n": req.n,
        "renderer": model.renderer.name,
        **extra,
    }


def _row(
    ctx: RequestContext,
    model: ServedModel,
    req: Any,
    *,
    request_id: str,
    index: int,
    endpoint: str,
    prompt: str,
    prompt_tokens: int,
    seq: Any,
    completion: str,
    finish_reason: str,
    sampling: dict[str, Any],
    tools: Any = None,
    response: Any = None,
) -> dict[str, Any]:
    tokens = list(seq.tokens)
    return {
        "run_id": ctx.run_id,
        "request_id": request_id,
        "sequence_index": index,
        "client": ctx.client,
        "endpoint": endpoint,
        "model": req.model,
        "checkpoint": model.checkpoint,
        "prompt": prompt,
        "completion": completion,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(tokens),
        "completion_token_ids": tokens,
        **_stats(seq.logprobs),
        "stop_reason": str(seq.stop_reason),
        "sampling_json": json.dumps(sampling, sort_keys=True),
        "finish_reason": finish_reason,
        "metadata_json": json.dumps(req.metadata, sort_keys=True, default=str) if req.metadata is not None else None,
        "tools_json": json.dumps(tools, sort_keys=True) if tools else None,
        "response_json": json.dumps(response, sort_keys=True, ensure_ascii=False) if response is not None else None,
    }


def _finalize(rows: list[dict[str, Any]], ctx: RequestContext) -> None:
    latency = (time.monotonic() - ctx.started) * 1000.0
    for r in rows:
        r["latency_ms"] = latency


# ----- chat -----------------------------------------------------------------------------------
def _token_entry(model: ServedModel, token: int, logprob: float | None, top: Any) -> dict[str, Any]:
    text = model.token_text(int(token))
    entry: dict[str, Any] = {
        "token": text,
        "logprob": float(logprob) if logprob is not None else None,
        "bytes": list(text.encode("utf-8")),
    }
    entry["top_logprobs"] = [
        {
            "token": model.token_text(int(t)),
            "logprob": float(v),
            "bytes": list(model.token_text(int(t)).encode("utf-8")),
        }
        for t, v in (top or [])
    ]
    return entry


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for call in calls:
        fn = call.get("function") or call
        args = fn.get("arguments", {})
        out.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    return out


def _chat_choice(model: ServedModel, req: ChatCompletionRequest, index: int, seq: Any) -> tuple[dict, str, str]:
    """(choice, raw completion text, finish_reason) of one sampled sequence."""
    tokens = [int(t) for t in seq.tokens]
    parsed = model.renderer.parse_response(tokens)
    content_tokens, _ = model.renderer.split_at_stop(tokens)
    message: dict[str, Any]
    raw = model.decode(content_tokens)
    sampler_stopped = str(seq.stop_reason) == "stop"
    cut = _cut(raw, req.stop) if parsed.termination is Termination.TRUNCATED and sampler_stopped else None
    if cut is not None:  # a client stop string ended it: OpenAI leaves the stop string out
        raw = raw[:cut]
        message, finish = {"role": "assistant", "content": raw}, "stop"
    else:
        message = {"role": "assistant", "content": parsed.message.get("content", "")}
        if parsed.message.get("reasoning_content"):
            message["reasoning_content"] = parsed.message["reasoning_content"]
        if parsed.message.get("tool_calls"):
            message["tool_calls"] = _tool_calls(parsed.message["tool_calls"])
        if parsed.termination is Termination.TRUNCATED:
            finish = "length"
        else:
            finish = "tool_calls" if message.get("tool_calls") else "stop"
    if message.get("tool_calls") and not message["content"]:
        message["content"] = None
    logprobs = None
    if req.logprobs:
        lps = list(seq.logprobs or [None] * len(tokens))
        tops = list(seq.topk_logprobs or []) if req.top_logprobs else []
        logprobs = {
            "content": [
                _token_entry(
                    model,
                    t,
                    lps[i] if i < len(lps) else None,
                    tops[i][: req.top_logprobs] if i < len(tops) and tops[i] else None,
                )
                for i, t in enumerate(content_tokens)
            ],
            "refusal": None,
        }
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}, raw, finish


async def chat_completion(model: ServedModel, req: ChatCompletionRequest, ctx: RequestContext) -> Generation:
    """Answer a chat completion request: render ``messages`` (and ``tools``) with the renderer,
    sample ``n`` sequences, parse each into an assistant message (tool calls as OpenAI
    ``tool_calls``), and build one capture row per sequence.

    Raises:
        APIError: unknown model (404), messages the renderer refuses, tools with a renderer that
            cannot render them, a prompt too long for the context (400), backend failures (502).
    """
    model.check_model(req.model)
    messages = to_renderer_messages(req.messages)
    tools = req.active_tools
    try:
        prompt = model.renderer.build_generation_prompt(messages, tools=tools).to_ints()
    except RendererError as exc:
        param = "tools" if tools and "tool" in str(exc) else "messages"
        raise APIError(400, f"cannot render the conversation: {exc}", param=param) from None
    max_tokens = model.max_tokens_for(
        len(prompt), req.max_new_tokens, param="max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    )
    topk = int(req.top_logprobs or 0) if req.logprobs else 0
    resp = await model.sample(
        prompt,
        n=req.n,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=model.chat_stops(req.stop),
        topk=topk,
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    sampling = _sampling(req, model, max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs)
    prompt_json = json.dumps(messages, ensure_ascii=False)
    choices, rows = [], []
    for i, seq in enumerate(resp.sequences):
        choice, raw, finish = _chat_choice(model, req, i, seq)
        choices.append(choice)
        rows.append(
            _row(
                ctx,
                model,
                req,
                request_id=rid,
                index=i,
                endpoint="chat.completions",
                prompt=prompt_json,
                prompt_tokens=len(prompt),
                seq=seq,
                completion=raw,
                finish_reason=finish,
                sampling=sampling,
                tools=tools,
                response={"message": choice["message"], "finish_reason": finish},
            )
        )
    _finalize(rows, ctx)
    used = sum(len(s.tokens) for s in resp.sequences)
    return Generation(
        rid,
        "chat.completion",
        int(time.time()),
        req.model,
        choices,
        {"prompt_tokens": len(prompt), "completion_tokens": used, "total_tokens": len(prompt) + used},
        rows,
    )


# ----- completions ----------------------------------------------------------------------------
def _completion_logprobs(
    model: ServedModel, tokens: list[int], lps: list, tops: list, k: int, offset: int
) -> dict[str, list]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = offset
    for i, t in enumerate(tokens):
        text = model.token_text(int(t))
        out["tokens"].append(text)
        lp = lps[i] if i < len(lps) else None
        out["token_logprobs"].append(None if lp is None or (isinstance(lp, float) and math.isnan(lp)) else float(lp))
        row = tops[i] if i < len(tops) else None
        out["top_logprobs"].append({model.token_text(int(a)): float(v) for a, v in row[:k]} if row and k else None)
        out["text_offset"].append(pos)
        pos += len(text)
    return out


async def completion(model: ServedModel, req: CompletionRequest, ctx: RequestContext) -> Generation:
    """Answer a completion request: each prompt (text encoded by the tokenizer with its special
    tokens, or token ids as given) sampled ``n`` times; choice ``p * n + j`` is sample ``j`` of
    prompt ``p``. ``echo`` prepends the prompt (and, with ``logprobs``, its token logprobs, the
    first one null).

    Raises:
        APIError: as :func:`chat_completion`; token ids outside the vocabulary (400).
    """
    model.check_model(req.model)
    prompts = req.prompts()
    vocab = len(model.tokenizer)
    encoded: list[list[int]] = []
    for p, item in enumerate(prompts):
        if isinstance(item, str):
            encoded.append(list(model.tokenizer.encode(item, add_special_tokens=True)))
        elif isinstance(item, list) and all(isinstance(t, int) and 0 <= t < vocab for t in item) and item:
            encoded.append(list(item))
        else:
            raise APIError(
                400, f"prompt[{p}] must be a string or a non-empty list of token ids in [0, {vocab})", param="prompt"
            )
    if any(not e for e in encoded):
        raise APIError(400, "a prompt encodes to no tokens", param="prompt")
    k = int(req.logprobs or 0)
    stops = model.completion_stops(req.stop)
    eos = model.eos_ids()

    async def one(tokens: list[int]) -> Any:
        max_tokens = model.max_tokens_for(len(tokens), req.max_tokens, prompt_param="prompt")
        resp = await model.sample(
            tokens,
            n=req.n,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop=stops,
            topk=k,
            prompt_logprobs=req.echo and req.logprobs is not None,
            topk_prompt=k if req.echo else 0,
        )
        return resp, max_tokens

    results = await asyncio.gather(*(one(t) for t in encoded))
    rid = f"cmpl-{uuid.uuid4().hex}"
    choices, rows, used = [], [], 0
    for p, ((resp, max_tokens), tokens) in enumerate(zip(results, encoded, strict=True)):
        prompt = prompts[p]
        prompt_text = prompt if isinstance(prompt, str) else model.decode(tokens)
        sampling = _sampling(req, model, max_tokens, logprobs=req.logprobs, echo=req.echo)
        for j, seq in enumerate(resp.sequences):
            toks = [int(t) for t in seq.tokens]
            stopped = str(seq.stop_reason) == "stop"
            shown = toks[:-1] if stopped and toks and toks[-1] in eos else toks
            text = model.decode(shown)
            cut = _cut(text, req.stop) if stopped else None
            finish = "stop" if stopped else "length"
            if cut is not None:
                text = text[:cut]
            index = p * req.n + j
            logprobs = None
            if req.logprobs is not None:
                logprobs = _completion_logprobs(
                    model,
                    shown,
                    list(seq.logprobs or []),
                    list(seq.topk_logprobs or []),
                    k,
                    len(prompt_text) if req.echo else 0,
                )
                if req.echo:
                    head = _completion_logprobs(
                        model,
                        tokens,
                        list(resp.prompt_logprobs or []),
                        list(getattr(resp, "topk_prompt_logprobs", None) or []),
                        k,
                        0,
                    )
                    logprobs = {key: head[key] + logprobs[key] for key in logprobs}
            choices.append(
                {
                    "index": index,
                    "text": (prompt_text + text) if req.echo else text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
            rows.append(
                _row(
                    ctx,
                    model,
                    req,
                    request_id=rid,
                    index=index,
                    endpoint="completions",
                    prompt=prompt_text,
                    prompt_tokens=len(tokens),
                    seq=seq,
                    completion=text,
                    finish_reason=finish,
                    sampling=sampling,
                    response={"text": text, "finish_reason": finish},
                )
            )
            used += len(toks)
    _finalize(rows, ctx)
    prompt_total = sum(len(t) for t in encoded)
    return Generation(
        rid,
        "text_completion",
        int(time.time()),
        req.model,
        choices,
        {"prompt_tokens": prompt_total, "completion_tokens": used, "total_tokens": prompt_total + used},
        rows,
    )
