"""OpenAI request bodies of the capture endpoint: validation, errors, and chat messages in the
renderer's form.

Accepted fields follow the OpenAI API reference (https://platform.openai.com/docs/api-reference/chat
and .../completions). Fields the Tinker sampler cannot honour are refused when set to anything but
their neutral value (``frequency_penalty``/``presence_penalty`` other than 0, a ``logit_bias``,
``response_format`` other than text, ``tool_choice`` other than ``auto``/``none``); fields that do
not change sampling (``user``, ``store``, ``parallel_tool_calls``, ``service_tier``, ...) and
unknown fields are ignored, as agent clients send many of them. ``top_k`` is accepted as an
extension (as vLLM does).

Every problem raises :class:`APIError`, which the app turns into an OpenAI error body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "FeedbackRequest",
    "MAX_N",
    "parse_body",
    "to_renderer_messages",
]

#: Most sequences one request may ask for (``n``, times the prompts of a completion request).
MAX_N = 128
#: Largest ``metadata`` object accepted, as JSON characters.
MAX_METADATA_CHARS = 8192


class APIError(Exception):
    """An error answered to the client as an OpenAI error body.

    Attributes:
        status: HTTP status (400 bad request, 401 bad token, 404 unknown model, 413 body too
            large, 502 backend failure).
        message: human-readable text; ``type``: ``invalid_request_error`` | ``server_error``;
        param: the offending request field (e.g. ``"messages[1].content"``) or None;
        code: e.g. ``"model_not_found"``, ``"context_length_exceeded"``, ``"invalid_api_key"``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops or None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: Any) -> dict[str, Any] | None:
        if v is not None and len(json.dumps(v, default=str)) > MAX_METADATA_CHARS:
            raise ValueError(f"metadata is larger than {MAX_METADATA_CHARS} characters as JSON")
        return v

    def check_neutral(self) -> None:
        """Refuse parameters the sampler cannot honour (see the module docstring)."""
        for name, value in self.model_dump(include={"frequency_penalty", "presence_penalty"}).items():
            if value not in (None, 0, 0.0):
                raise APIError(
                    400,
                    f"{name} is not supported by this server (Tinker samplers have no "
                    "repetition penalties); leave it unset or 0",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.logit_bias:
            raise APIError(
                400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported_parameter"
            )

    @property
    def include_usage(self) -> bool:
        """Streaming: whether a last chunk carries ``usage`` (``stream_options.include_usage``)."""
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(_Base):
    """Body of ``POST /v1/chat/completions`` (``max_completion_tokens`` is ``max_tokens``' newer name)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.tool_choice not in (None, "auto", "none"):
            raise APIError(
                400,
                "tool_choice must be 'auto' or 'none': this server cannot force a tool call",
                param="tool_choice",
                code="unsupported_parameter",
            )
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(
                400,
                f"response_format type {kind!r} is not supported (no constrained decoding); use 'text'",
                param="response_format",
                code="unsupported_parameter",
            )
        for i, tool in enumerate(self.tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if (
                not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or tool.get("type", "function") != "function"
            ):
                raise APIError(
                    400,
                    "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                    param=f"tools[{i}]",
                )

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: the server's default)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render into the prompt (None when absent or ``tool_choice='none'``)."""
        return None if self.tool_choice == "none" or not self.tools else list(self.tools)


class CompletionRequest(_Base):
    """Body of ``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token
    ids or a list of token-id lists; ``logprobs`` is the number of alternatives per token (0-20)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported", param="suffix", code="unsupported_parameter")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported; use n", param="best_of", code="unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists (at least one)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        ids = [x for x in p if isinstance(x, int)]
        if len(ids) == len(p):  # one prompt as token ids
            return [ids]
        return [x for x in p if not isinstance(x, int)]  # strings or token-id lists (validated: never mixed)


class FeedbackRequest(BaseModel):
    """A rating of a returned sequence (``POST /v1/feedback``, an extension of the OpenAI API):
    ``id`` (the completion's ``id``), ``index`` (its choice), ``rating`` (a number; ``"good"`` is
    +1, ``"bad"`` -1), optional ``label`` and ``comment``. Stored in the capture store's ``ratings``."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^(chatcmpl|cmpl)-[A-Za-z0-9]{1,64}$")
    index: int = Field(default=0, ge=0, lt=MAX_N)
    rating: float | str
    label: str | None = Field(default=None, max_length=64)
    comment: str | None = Field(default=None, max_length=4000)

    @field_validator("rating")
    @classmethod
    def _rating(cls, v: float | str) -> float:
        if isinstance(v, str):
            words = {"good": 1.0, "bad": -1.0}
            if v.strip().lower() not in words:
                raise ValueError(f"rating must be a number, 'good' or 'bad', got {v!r}")
            return words[v.strip().lower()]
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("rating must be a finite number")
        return float(v)

    @model_validator(mode="before")
    @classmethod
    def _word_as_label(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("rating"), str) and not data.get("label"):
            return {**data, "label": data["rating"].strip().lower()}
        return data


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> Any:
    """Parse and validate a JSON request body into ``model_cls``.

    Raises:
        APIError: 400 for invalid JSON, a body that is not an object, or a field that fails
            validation (``param`` names the field, e.g. ``temperature`` or ``messages``).
    """
    try:
        data = json.loads(raw or b"")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _loc(err.get("loc", ()))
        raise APIError(
            400, f"{param or 'body'}: {err.get('msg')} (got {_short(err.get('input'))})", param=param or None
        ) from None
    if isinstance(req, _Base):
        req.check_neutral()
    if isinstance(req, CompletionRequest) and req.n * len(req.prompts()) > MAX_N:
        raise APIError(400, f"n x prompts must be at most {MAX_N}", param="n")
    return req


_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _loc(loc: tuple) -> str:
    """A pydantic error location as ``field[0].sub``, without the labels of union members."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in _TYPE_LABELS or any(c in str(part) for c in "[(,"):
            continue  # e.g. "list[int]", "function-after[...]": which union member failed
        else:
            out += ("." if out else "") + str(part)
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text_content(content: Any, where: str) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400, f"{where}[{j}]: only text content parts are supported, got {kind!r}", param=f"{where}[{j}]"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def to_renderer_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the renderer's message dicts.

    ``developer`` becomes ``system``; content parts are joined into one string; assistant
    ``tool_calls`` keep ``{"id", "type", "function": {"name", "arguments"}}`` (arguments as
    the client sent them, usually a JSON string); tool results keep ``tool_call_id``;
    ``reasoning_content`` (str) is kept. Message content stays plain text: renderers encode it
    as text, so special-token strings in it do not become control tokens.

    Raises:
        APIError: unknown role, non-text content, malformed tool calls (``param`` names the
            message, e.g. ``messages[2].tool_calls[0]``).
    """
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        raw_role = msg.get("role") if isinstance(msg, dict) else None
        role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            got = msg.get("role") if isinstance(msg, dict) else msg
            raise APIError(
                400,
                f"{where}.role: unsupported role {_short(got)} (expected one of {', '.join(_ROLES)})",
                param=f"{where}.role",
            )
        m: dict[str, Any] = {"role": role, "content": _text_content(msg.get("content"), f"{where}.content")}
        if role == "assistant" and msg.get("tool_calls"):
            m["tool_calls"] = _tool_calls(msg["tool_calls"], where)
        if role == "tool":
            if msg.get("tool_call_id") is not None:
                m["tool_call_id"] = str(msg["tool_call_id"])
        for key in ("name", "reasoning_content"):
            if isinstance(msg.get(key), str):
                m[key] = msg[key]
        out.append(m)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"{where}.tool_calls[{j}] needs function.name", param=f"{where}.tool_calls[{j}]")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise APIError(
                400,
                f"{where}.tool_calls[{j}].function.arguments must be a JSON string",
                param=f"{where}.tool_calls[{j}].function.arguments",
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        out.append(entry)
    return out
