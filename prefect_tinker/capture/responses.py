"""OpenAI response bodies and server-sent-event streams of a :class:`~.generate.Generation`.

Streaming follows the OpenAI chunk format (``chat.completion.chunk`` / ``text_completion``
objects as ``data: {...}`` events, then ``data: [DONE]``). The Tinker API returns whole sequences,
so a stream starts once sampling is done: per choice a role chunk, one content chunk (with its
token logprobs), one chunk per tool call, then a chunk with the ``finish_reason``; with
``stream_options.include_usage`` a last chunk has empty ``choices`` and the ``usage``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from prefect_tinker.capture.generate import Generation

__all__ = ["response_body", "sse_events"]


def response_body(gen: Generation) -> dict[str, Any]:
    """The non-streaming JSON body (``chat.completion`` or ``text_completion``)."""
    return {
        "id": gen.id,
        "object": gen.object,
        "created": gen.created,
        "model": gen.model,
        "system_fingerprint": None,
        "choices": gen.choices,
        "usage": gen.usage,
    }


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _head(gen: Generation) -> dict[str, Any]:
    kind = "chat.completion.chunk" if gen.object == "chat.completion" else "text_completion"
    return {"id": gen.id, "object": kind, "created": gen.created, "model": gen.model, "system_fingerprint": None}


def _chat_chunks(gen: Generation) -> Iterator[dict[str, Any]]:
    head = _head(gen)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for choice in gen.choices:
        i, msg = choice["index"], choice["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        if msg.get("reasoning_content"):
            yield chunk(i, {"reasoning_content": msg["reasoning_content"]})
        if msg.get("content") or choice.get("logprobs"):
            yield chunk(i, {"content": msg.get("content") or ""}, logprobs=choice.get("logprobs"))
        for j, call in enumerate(msg.get("tool_calls") or []):
            yield chunk(i, {"tool_calls": [{"index": j, **call}]})
        yield chunk(i, {}, choice["finish_reason"])


def _completion_chunks(gen: Generation) -> Iterator[dict[str, Any]]:
    head = _head(gen)
    for choice in gen.choices:
        yield {
            **head,
            "choices": [
                {
                    "index": choice["index"],
                    "text": choice["text"],
                    "logprobs": choice["logprobs"],
                    "finish_reason": None,
                }
            ],
        }
        yield {
            **head,
            "choices": [
                {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
            ],
        }


def sse_events(gen: Generation, include_usage: bool) -> Iterator[bytes]:
    """The ``text/event-stream`` body of a streamed response, as encoded events."""
    chunks = _chat_chunks(gen) if gen.object == "chat.completion" else _completion_chunks(gen)
    for obj in chunks:
        if include_usage:
            obj["usage"] = None
        yield _event(obj)
    if include_usage:
        yield _event({**_head(gen), "choices": [], "usage": gen.usage})
    yield b"data: [DONE]\n\n"
