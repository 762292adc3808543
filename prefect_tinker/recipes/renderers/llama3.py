"""``llama3``: the Llama 3 instruct format, with Llama 3.1's JSON tool calling.

Source: Meta's prompt-format documentation
(https://www.llama.com/docs/model-cards-and-prompt-formats/meta-llama-3/ and ``.../llama3_1/``) and
the chat templates of Meta-Llama-3-8B-Instruct and Llama-3.1-8B-Instruct::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{user}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{assistant}<|eot_id|>

(one line here; no newlines between the blocks).  Content is trimmed of surrounding whitespace
as the template does (``| trim``); tool results are written as Llama 3.1's template writes them,
through ``tojson`` (a quoted JSON string: ``"18\u00b0C"`` becomes ``"\"18\u00b0C\""``), untrimmed.
The generation prompt ends with
``<|start_header_id|>assistant<|end_header_id|>\\n\\n``; the sampler stops at ``<|eot_id|>`` (and at
``<|eom_id|>`` where the tokenizer has it, Llama 3.1's end of a tool-calling message).  Without
tools this is Llama 3's format (Llama 3.1's template adds a "Cutting Knowledge Date" system block;
give it as a system message to reproduce it).

With ``tools=`` the system block is Llama 3.1's, as its template writes it:
``Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: {date_string}\n\n``
then the system prompt; the schemas (JSON with indent 4, each followed by a blank line) go, with
the template's instruction to answer with a JSON function call, at the start of the first user
message (``tools_in_user_message=True``, the template's default) or in the system block before
the system prompt.  A call is the whole assistant reply, ``{"name": <name>, "parameters":
<arguments>}`` (one call per message, as the template requires); results are ``tool`` messages,
written as ``ipython`` turns.  Rendered text checked against the Llama-3.1-8B-Instruct template.
:meth:`Llama3Renderer.parse_response` also reads several calls separated by ``;``, a
``<|python_tag|>`` before them, and the built-in tool form ``<|python_tag|>name.call(key="value")``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, ParsedResponse, Renderer, RendererError, Segment, Termination
from prefect_tinker.recipes.renderers.encoding import Piece, Tag
from prefect_tinker.recipes.renderers.tools import tojson

__all__ = ["Llama3Renderer", "llama3_tool_call_json", "parse_llama3_tool_calls"]

BOS, EOT, EOM, PYTHON_TAG = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"
START_HEADER, END_HEADER = "<|start_header_id|>", "<|end_header_id|>"

_RESPOND = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)
_TOOLS_IN_USER = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n" + _RESPOND
)
_TOOLS_IN_SYSTEM = (
    "You have access to the following functions. To call a function, please respond with JSON for a function call."
    + _RESPOND
)
_BUILTIN_CALL = re.compile(r"([A-Za-z_]\w*)\.call\((.*)\)", re.S)
_BUILTIN_ARG = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def llama3_tool_call_json(call: Mapping[str, Any]) -> str:
    """``{"name": ..., "parameters": ...}`` for one call (arguments given as a dict or a JSON string).

    Raises:
        RendererError: string arguments that are not a JSON object.
    """
    fn = call.get("function") or call
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise RendererError(
                f"tool call {fn['name']!r}: arguments must be a JSON object, got {fn.get('arguments')!r}"
            )
    return '{"name": ' + tojson(fn["name"]) + ', "parameters": ' + tojson(args) + "}"


def _as_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    return (
        {"type": "function", "function": {"name": obj["name"], "arguments": args}} if isinstance(args, dict) else None
    )


def parse_llama3_tool_calls(text: str, tagged: bool) -> tuple[list[dict[str, Any]] | None, bool]:
    """Tool calls of a Llama 3.1 reply body (``tagged``: it followed ``<|python_tag|>``).

    Returns:
        ``(calls, well_formed)``: calls None for a plain text reply; ``well_formed`` False for a
        reply that is meant as a call (tagged, or starting with ``{"name"``) but does not parse.
    """
    text = text.strip()
    builtin = _BUILTIN_CALL.fullmatch(text) if tagged else None
    if builtin:
        args = {k: v.replace('\\"', '"') for k, v in _BUILTIN_ARG.findall(builtin.group(2))}
        return [{"type": "function", "function": {"name": builtin.group(1), "arguments": args}}], True
    meant = tagged or re.match(r'\{\s*"name"', text) is not None
    calls: list[dict[str, Any]] = []
    decoder, pos = json.JSONDecoder(), 0
    while text.startswith("{"):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None, not meant
        call = _as_call(obj)
        if call is None:
            return None, not meant
        calls.append(call)
        rest = text[pos:].lstrip()
        if not rest:
            return calls, True
        if not rest.startswith(";"):
            return None, not meant
        text, pos = rest[1:].lstrip(), 0
    return None, not meant


class Llama3Renderer(Renderer):
    """Llama 3 instruct format, Llama 3.1 tool calling (see the module docstring).

    Args:
        tokenizer: a Llama 3 tokenizer (``<|begin_of_text|>``, header and ``<|eot_id|>`` tokens).
        date_string: the "Today Date" of the tools system block (the template's default).
        tools_in_user_message: put the tool schemas in the first user message (the template's
            default) rather than in the system block.
        special_tokens_in_content: see :class:`~prefect_tinker.recipes.renderers.Renderer`.

    Raises:
        RendererError: the tokenizer lacks those special tokens.
    """

    name = "llama3"
    supports_tools = True

    def __init__(
        self,
        tokenizer: Any,
        *,
        date_string: str = "26 Jul 2024",
        tools_in_user_message: bool = True,
        special_tokens_in_content: bool = False,
    ):
        super().__init__(tokenizer, special_tokens_in_content=special_tokens_in_content)
        self.bos = self.special_token_id(BOS)
        self.eot = self.special_token_id(EOT)
        self.special_token_id(START_HEADER)
        self.special_token_id(END_HEADER)
        self.date_string, self.tools_in_user_message = date_string, tools_in_user_message
        eom = self.encode(EOM)
        self.eom = eom[0] if len(eom) == 1 else None

    @staticmethod
    def _header_text(role: str) -> str:
        return f"{START_HEADER}{'ipython' if role == 'tool' else role}{END_HEADER}\n\n"

    def _block(self, i: int | None, role: str, body: Sequence[Piece], *, joint: bool) -> list[Segment]:
        head, tokens = self.encode_pair(self._header_text(role), body, joint=joint)
        return [Segment(head, i, "header"), Segment(tokens, i, "body"), Segment([self.eot], i, "end")]

    def _schemas(self, tools: Sequence[Mapping[str, Any]]) -> list[Piece]:
        out: list[Piece] = []
        for tool in tools:
            out += [self.content(json.dumps(tool, indent=4, ensure_ascii=False)), ("\n\n", True)]
        return out

    def _tools_prelude(self, messages: list[Message], tools: Sequence[Mapping[str, Any]]) -> tuple[list[Segment], int]:
        """Segments of the tools system block (and first user message); index of the next message."""
        first_system = messages[0]["role"] == "system"
        body: list[Piece] = [
            (f"Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n", True)
        ]
        if not self.tools_in_user_message:
            body += [(_TOOLS_IN_SYSTEM, True), *self._schemas(tools)]
        if first_system:
            body.append(self.content(messages[0]["content"].strip()))
        segs = self._block(0 if first_system else None, "system", body, joint=True)
        nxt = 1 if first_system else 0
        if self.tools_in_user_message:
            if nxt >= len(messages) or messages[nxt]["role"] != "user":
                raise RendererError(
                    f"llama3 declares tools in the first user message, but messages[{nxt}] is not a "
                    "user message (use tools_in_user_message=False)"
                )
            body = [(_TOOLS_IN_USER, True), *self._schemas(tools), self.content(messages[nxt]["content"].strip())]
            segs += self._block(nxt, "user", body, joint=True)
            nxt += 1
        return segs, nxt

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        segs = [Segment([self.bos], None, "prefix")]
        start = 0
        if tools:
            prelude, start = self._tools_prelude(messages, tools)
            segs += prelude
        for i in range(start, len(messages)):
            msg, role = messages[i], messages[i]["role"]
            calls = msg.get("tool_calls")
            if role == "assistant" and calls:
                if len(calls) != 1 or msg["content"].strip():
                    raise RendererError(
                        f"messages[{i}]: llama3 writes a tool call as the whole assistant reply, one "
                        f"call per message (got {len(calls)} call(s) and content {msg['content'][:40]!r})"
                    )
                text = llama3_tool_call_json(calls[0])
            else:
                text = tojson(msg["content"]) if role == "tool" else msg["content"].strip()
            segs += self._block(i, role, [self.content(text)], joint=role != "assistant")
        return segs

    def _assistant_header(self) -> list[int]:
        return self.encode(self._header_text("assistant"))

    def get_stop_sequences(self) -> list[int]:
        """``[<|eot_id|>]`` plus ``<|eom_id|>`` when the tokenizer has it."""
        return [self.eot] + ([self.eom] if self.eom is not None else [])

    def eos_token_ids(self) -> list[int]:
        ids = super().eos_token_ids()
        end = self.encode("<|end_of_text|>")
        if len(end) == 1 and end[0] not in ids:
            ids.append(end[0])
        return ids

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Decode sampled tokens into an assistant message, with ``tool_calls`` for a call reply.

        Returns:
            ``ParsedResponse``: content (trimmed, as the template trims it; ``""`` for a call);
            termination ``malformed`` (content = raw text) for a reply meant as a call that does
            not parse, ``truncated`` (raw text) when no stop token came.  Never raises.
        """
        content_tokens, term = self.split_at_stop(tokens)
        raw = self.tokenizer.decode(content_tokens, skip_special_tokens=False)
        if term is Termination.TRUNCATED:
            return ParsedResponse({"role": "assistant", "content": raw}, term)
        items = self.tag_items(content_tokens, (PYTHON_TAG,)) if PYTHON_TAG in self.encoder.control_ids else [raw]
        lead = next((k for k, it in enumerate(items) if isinstance(it, Tag) or it.strip()), None)
        tagged = lead is not None and isinstance(items[lead], Tag)
        body = "".join(items[lead + 1 :]) if tagged and lead is not None else "".join(items)
        calls, ok = parse_llama3_tool_calls(body, tagged)
        if not ok:
            return ParsedResponse({"role": "assistant", "content": raw}, Termination.MALFORMED)
        if calls:
            return ParsedResponse({"role": "assistant", "content": "", "tool_calls": calls}, term)
        return ParsedResponse({"role": "assistant", "content": body.strip()}, term)
