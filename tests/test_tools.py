"""Tools: schemas built from type hints and docstrings, validated calls, errors as result text,
and the calculator against Python's own arithmetic."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal, Optional

import pytest
from pydantic import BaseModel

from prefect_tinker.recipes.tools import (
    CalculatorError,
    Tool,
    Toolset,
    calculator,
    evaluate_expression,
    format_number,
    tool,
)


class Point(BaseModel):
    x: float
    y: float


@tool
def book_table(restaurant: str, guests: int, time_slot: Literal["lunch", "dinner"] = "dinner",
               budget: Optional[float] = None, outdoor: bool = False, allergies: list[str] | None = None,
               title: str = "") -> dict:
    """Book a table at a restaurant.

    The booking is confirmed at once.

    Args:
        restaurant: name of the restaurant.
        guests: number of people,
            including the caller.
        time_slot: lunch or dinner.
        budget: most to spend per person, in euros.
    """
    if guests > 12:
        raise ValueError("groups of more than 12 must call the restaurant")
    return {"restaurant": restaurant, "guests": guests, "slot": time_slot, "budget": budget}


def test_schema_from_type_hints_and_docstring():
    assert isinstance(book_table, Tool)
    assert book_table.schema == {
        "type": "function",
        "function": {
            "name": "book_table",
            "description": "Book a table at a restaurant.\n\nThe booking is confirmed at once.",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "restaurant": {"type": "string", "description": "name of the restaurant."},
                    "guests": {"type": "integer", "description": "number of people, including the caller."},
                    "time_slot": {"type": "string", "enum": ["lunch", "dinner"], "default": "dinner",
                                  "description": "lunch or dinner."},
                    "budget": {"anyOf": [{"type": "number"}, {"type": "null"}], "default": None,
                               "description": "most to spend per person, in euros."},
                    "outdoor": {"type": "boolean", "default": False},
                    "allergies": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                                  "default": None},
                    "title": {"type": "string", "default": ""},  # a parameter named like a schema keyword
                },
                "required": ["restaurant", "guests"],
            },
        },
    }
    json.dumps(book_table.schema)  # plain JSON


def test_decorator_options_and_bad_declarations():
    @tool(name="lookup", description="Look a word up.", timeout_s=1.0, max_result_chars=10)
    def f(word: str) -> str:
        return word * 10

    assert f.schema["function"]["name"] == "lookup" and f.schema["function"]["description"] == "Look a word up."
    assert f("ab") == "ab" * 10  # calling the tool calls the function
    r = f.call({"word": "abc"})
    assert r.ok and r.text.startswith("abcabcabca\n[... 20 more characters cut]")

    with pytest.raises(TypeError, match="needs a type hint"):
        tool(lambda x: x)
    with pytest.raises(TypeError, match="plain or keyword"):
        @tool
        def g(*values: int) -> int:
            return sum(values)

    class Local(BaseModel):
        x: float

    with pytest.raises(TypeError, match="cannot resolve its type hints"):
        @tool
        def uses_local(p: Local) -> float:
            return p.x

    @tool
    def norm(p: Point) -> float:
        """Length of a vector."""
        return (p.x ** 2 + p.y ** 2) ** 0.5

    assert norm.call('{"p": {"x": 3, "y": 4}}').text == "5.0"
    assert "$defs" in norm.schema["function"]["parameters"]


def test_calls_validate_arguments_and_return_errors_as_text():
    ok = book_table.call('{"restaurant": "Chez Nous", "guests": "4"}')  # lax: "4" is the integer 4
    assert (ok.ok, ok.error) == (True, None)
    assert json.loads(ok.text) == {"restaurant": "Chez Nous", "guests": 4, "slot": "dinner", "budget": None}
    assert json.loads(book_table.call({"restaurant": "A", "guests": 2, "time_slot": "lunch"}).text)["slot"] == "lunch"
    cases = {
        '{"restaurant": "A"': ("bad_arguments", "not valid JSON"),
        '["A", 2]': ("bad_arguments", "must be a JSON object"),
        '{"guests": 2}': ("bad_arguments", "restaurant: Field required"),
        '{"restaurant": "A", "guests": "two"}': ("bad_arguments", "guests: Input should be a valid integer"),
        '{"restaurant": "A", "guests": 2, "time_slot": "breakfast"}': ("bad_arguments", "time_slot: Input should be"),
        '{"restaurant": "A", "guests": 2, "wine": true}': ("bad_arguments", "wine: Extra inputs are not permitted"),
        '{"restaurant": "A", "guests": 20}': ("tool_error", "ValueError: groups of more than 12"),
    }
    for arguments, (error, text) in cases.items():
        r = book_table.call(arguments)
        assert (r.ok, r.error) == (False, error), arguments
        assert r.text.startswith("Error: ") and text in r.text, (arguments, r.text)


def test_timeouts_and_async_tools():
    @tool(timeout_s=0.2)
    def slow(seconds: float) -> str:
        """Sleep."""
        time.sleep(seconds)
        return "done"

    start = time.monotonic()
    r = slow.call({"seconds": 5})
    assert (r.ok, r.error) == (False, "timeout") and "timed out after 0.2 s" in r.text
    assert time.monotonic() - start < 2
    assert slow.call({"seconds": 0}).text == "done"

    @tool
    async def shout(text: str) -> str:
        """Upper-case a text."""
        await asyncio.sleep(0)
        return text.upper()

    assert shout.call({"text": "hi"}).text == "HI"
    assert asyncio.run(asyncio.to_thread(shout.call, {"text": "ho"})).text == "HO"  # from a running loop's worker

    @tool
    def exits(code: int) -> str:
        """Exit."""
        raise SystemExit(code)

    r = exits.call({"code": 3})  # even SystemExit comes back as text
    assert (r.ok, r.error) == (False, "tool_error") and "SystemExit" in r.text


def test_toolset_dispatches_tool_calls():
    tools = Toolset([book_table, calculator])
    assert [s["function"]["name"] for s in tools.schemas] == ["book_table", "calculator"]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
    }
    assert tools.call(call).text == "42"
    assert tools.tool_message(call) == {"role": "tool", "content": "42", "name": "calculator", "tool_call_id": "call_1"}
    assert tools.call({"name": "calculator", "arguments": {"expression": "1+1"}}).text == "2"
    unknown = tools.call({"name": "weather", "arguments": "{}"})
    assert (unknown.ok, unknown.error) == (False, "unknown_tool") and "book_table, calculator" in unknown.text
    assert tools.call("not a call").error == "unknown_tool"
    with pytest.raises(ValueError, match="two tools are named"):
        Toolset([calculator, calculator])
    with pytest.raises(TypeError, match="not a Tool"):
        Toolset([len])


def test_calculator_matches_python_arithmetic():
    # the oracle is Python's own evaluation of the same expressions (trusted strings, written here)
    for expr in ["1 + 2 * 3", "(1 + 2) * 3", "2 ** 10", "2 ** -2", "-3 ** 2", "(-3) ** 2", "7 / 2", "7 // 2",
                 "-7 // 2", "7 % 3", "-7 % 3", "1.5e3 + 0.25", "1_000 * 3", "2 ** 3 ** 2", "10 - 4 - 3",
                 "((48 / 2) + 8) * 3 - 1", "+5 - -5", "2 ** 0.5", "123456789 * 987654321"]:
        assert evaluate_expression(expr) == eval(expr), expr  # noqa: S307
    assert evaluate_expression("3 × 4 ÷ 2 − 1") == 5.0


def test_calculator_refuses_anything_but_arithmetic():
    refused = {
        "__import__('os').system('true')": "Call", "x + 1": "Name", "'a' * 3": "Constant",
        "(1).real": "Attribute", "1 < 2": "Compare", "[1, 2]": "List", "1, 000": "commas", "2 ^ 3": "write a ** b",
        "1 / 0": "division by zero", "5 % 0": "division by zero", "0 ** -1": "division by zero",
        "9 ** 9 ** 9": "more than 4096 bits", "2 ** 5000": "more than 4096 bits", "10.0 ** 400": "too large",
        "(-8) ** 0.5": "not a real number", "1e308 * 10": "not a finite number", "": "empty", "1 +": "syntax error",
        "True + 1": "Constant",
    }
    for expr, message in refused.items():
        start = time.monotonic()
        with pytest.raises(CalculatorError, match=message.replace("*", r"\*")):
            evaluate_expression(expr)
        assert time.monotonic() - start < 1, expr
    r = calculator.call({"expression": "9 ** 9 ** 9"})
    assert (r.ok, r.error) == (False, "tool_error") and "4096 bits" in r.text


def test_format_number():
    assert [format_number(v) for v in (3, 3.0, 3.5, 0.1 + 0.2, 1 / 3, -2.0, 1e20, 2 ** 70)] == [
        "3", "3", "3.5", "0.3", "0.333333333333", "-2", "1e+20", "1180591620717411303424"]
    assert calculator.call({"expression": "(12 + 30) * 2 / 7"}).text == "12"
