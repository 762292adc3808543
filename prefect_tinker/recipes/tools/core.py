"""Tools a policy can call: the ``@tool`` decorator, validated calls, results as text.

``@tool`` turns a typed Python function into a :class:`Tool` with the JSON function schema that
chat templates and OpenAI-style APIs take (``{"type": "function", "function": {"name",
"description", "parameters"}}``; https://platform.openai.com/docs/guides/function-calling): the
description is the docstring's text, each parameter's description its Google-style ``Args:`` entry
(parsed by griffe), the parameter types (int, float, str, bool, list[...], dict[...], Literal[...],
Optional[...], pydantic models) become JSON Schema through pydantic, and parameters without a
default are ``required``.

:meth:`Tool.call` takes the model's arguments (a JSON string or a dict), validates them against
that schema (pydantic, extra keys refused), runs the function with a timeout and returns a
:class:`ToolResult` whose ``text`` is what goes back to the model.  Nothing the model sends and
nothing the tool raises escapes as an exception: unknown tools, malformed JSON, invalid arguments,
exceptions and timeouts all come back as ``Error: ...`` text with ``ok=False``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

__all__ = ["Tool", "ToolResult", "Toolset", "tool"]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_RESULT_CHARS = 4000


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call.

    Attributes:
        name: the tool's name (as the model called it).
        text: the result text for the model (the tool's return value, or ``Error: ...``).
        ok: False when the call failed.
        error: None, or ``unknown_tool``, ``bad_arguments``, ``tool_error`` or ``timeout``.
        elapsed_s: wall time of the call, seconds.
    """

    name: str
    text: str
    ok: bool = True
    error: str | None = None
    elapsed_s: float = 0.0


def _docstring_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn)
    if not doc:
        return "", {}
    from griffe import Docstring

    sections = Docstring(doc).parse("google", warnings=False)
    text, params = [], {}
    for section in sections:
        kind = getattr(section.kind, "value", section.kind)
        if kind == "text":
            text.append(section.value.strip())
        elif kind == "parameters":
            params.update({p.name: " ".join(p.description.split()) for p in section.value})
    return "\n\n".join(t for t in text if t), params


def _strip_titles(schema: Any, in_properties: bool = False) -> Any:
    """Drop pydantic's generated ``title`` keys (never a property that is named ``title``)."""
    if isinstance(schema, dict):
        return {
            k: _strip_titles(v, in_properties=(k == "properties" and not in_properties))
            for k, v in schema.items()
            if in_properties or k != "title"
        }
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


class Tool:
    """A function the model may call, with its JSON schema (build with :func:`tool`).

    Attributes:
        name, description: as declared to the model.
        fn: the wrapped function (calling the Tool itself calls it directly, unvalidated).
        arguments_model: the pydantic model that validates the arguments.
        timeout_s: per-call wall-time limit, seconds (None: no limit).
        max_result_chars: longer results are cut to this many characters, with a note.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
    ):
        self.fn, self.name = fn, name or fn.__name__
        self.timeout_s, self.max_result_chars = timeout_s, max_result_chars
        doc_text, param_docs = _docstring_parts(fn)
        self.description = description if description is not None else doc_text
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except NameError as exc:
            raise TypeError(
                f"tool {self.name!r}: cannot resolve its type hints ({exc}); define the types they name at module level"
            ) from None
        fields: dict[str, Any] = {}
        self._params: dict[str, str] = {}  # model field name -> parameter name
        for i, (pname, param) in enumerate(inspect.signature(fn).parameters.items()):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise TypeError(f"tool {self.name!r}: parameter {pname!r} must be a plain or keyword parameter")
            if pname not in hints:
                raise TypeError(f"tool {self.name!r}: parameter {pname!r} needs a type hint")
            default = ... if param.default is param.empty else param.default
            fields[f"p{i}"] = (hints[pname], Field(default, alias=pname, description=param_docs.get(pname)))
            self._params[f"p{i}"] = pname
        self.arguments_model: type[BaseModel] = create_model(
            f"{self.name}_arguments", __config__=ConfigDict(extra="forbid", populate_by_name=False), **fields
        )
        self.parameters = _strip_titles(self.arguments_model.model_json_schema(by_alias=True))
        self.parameters.setdefault("properties", {})

    @property
    def schema(self) -> dict:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def validate(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        """Parse and validate the model's arguments into keyword arguments of :attr:`fn`.

        Raises:
            ValueError: not JSON, not an object, or invalid (the message names each bad field).
        """
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, (str, bytes)):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"the arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            model = self.arguments_model.model_validate(dict(arguments))
        except ValidationError as exc:
            problems = []
            for e in exc.errors():
                loc = ".".join(str(x) for x in e["loc"]) or "(arguments)"
                problems.append(f"{loc}: {e['msg']}")
            raise ValueError("invalid arguments: " + "; ".join(problems)) from None
        return {self._params[f]: getattr(model, f) for f in self._params}

    def _format(self, value: Any) -> str:
        if isinstance(value, str):
            text = value
        elif isinstance(value, BaseModel):
            text = value.model_dump_json()
        else:
            text = json.dumps(value, ensure_ascii=False, default=str)
        if len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = text[: self.max_result_chars] + f"\n[... {cut} more characters cut]"
        return text

    def call(self, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        """Validate ``arguments``, run the tool (in a worker thread, with :attr:`timeout_s`), return its text.

        Never raises for anything the model sent or the tool did.  A tool that times out keeps running
        in its (daemon) thread until it returns; tools must not hold resources forever.
        """
        start = time.monotonic()
        try:
            kwargs = self.validate(arguments)
        except ValueError as exc:
            return ToolResult(self.name, f"Error: {self.name}: {exc}", False, "bad_arguments", time.monotonic() - start)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                value = self.fn(**kwargs)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                box["text"] = self._format(value)
            except BaseException as exc:  # noqa: BLE001 -- any failure is a result for the model
                box["error"] = f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=work, name=f"tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        elapsed = time.monotonic() - start
        if worker.is_alive():
            return ToolResult(
                self.name, f"Error: {self.name} timed out after {self.timeout_s:g} s", False, "timeout", elapsed
            )
        if "error" in box:
            return ToolResult(self.name, f"Error: {self.name} failed: {box['error']}", False, "tool_error", elapsed)
        return ToolResult(self.name, box["text"], True, None, elapsed)


async def _awaited(value: Any) -> Any:
    return await value


def tool(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
):
    """Decorator: make a :class:`Tool` of a typed function (``@tool`` or ``@tool(timeout_s=2)``).

    Raises:
        TypeError: a parameter lacks a type hint, or is ``*args``/``**kwargs``/positional-only, or a
            hint names a type that cannot be resolved (string annotations of a function-local class).
    """

    def wrap(f: Callable) -> Tool:
        return Tool(f, name=name, description=description, timeout_s=timeout_s, max_result_chars=max_result_chars)

    return wrap(fn) if fn is not None else wrap


class Toolset:
    """The tools of an environment, by name: their schemas for the renderer, and dispatch of tool calls."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"not a Tool: {t!r} (decorate it with @tool)")
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t

    @property
    def schemas(self) -> list[dict]:
        """The tools' JSON function schemas, in order."""
        return [t.schema for t in self.tools.values()]

    def call(self, tool_call: Mapping[str, Any]) -> ToolResult:
        """Run one parsed tool call: ``{"type": "function", "function": {"name", "arguments"}}`` or
        ``{"name", "arguments"}`` (arguments a JSON string or an object).  Never raises."""
        fn = tool_call.get("function", tool_call) if isinstance(tool_call, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or name not in self.tools:
            known = ", ".join(self.tools) or "(none)"
            return ToolResult(
                str(name), f"Error: unknown tool {name!r}; available tools: {known}", False, "unknown_tool"
            )
        return self.tools[name].call(fn.get("arguments"))

    def tool_message(self, tool_call: Mapping[str, Any], result: ToolResult | None = None) -> dict[str, str]:
        """The ``{"role": "tool", "content", "name"[, "tool_call_id"]}`` message answering ``tool_call``
        (runs it unless ``result`` is given)."""
        result = result or self.call(tool_call)
        msg = {"role": "tool", "content": result.text, "name": result.name}
        if isinstance(tool_call, Mapping) and isinstance(tool_call.get("id"), str):
            msg["tool_call_id"] = tool_call["id"]
        return msg
