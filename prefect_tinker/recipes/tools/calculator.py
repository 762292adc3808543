"""A calculator tool: arithmetic expressions evaluated by walking their Python AST, never ``eval``.

Accepted: int and float literals (``1_000``, ``2.5``, ``1e3``), ``+ - * / // % **``, unary ``+``/``-``
and parentheses.  Everything else (names, calls, attributes, strings, comparisons, ``^``) is refused
with a message.  Results stay small enough to compute instantly: integers are capped at
:data:`MAX_INT_BITS` bits (powers are checked before they are computed) and floats must be finite.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from prefect_tinker.recipes.tools.core import tool

__all__ = ["CalculatorError", "calculator", "evaluate_expression", "format_number"]

MAX_INT_BITS = 4096  # ~1,233 decimal digits
MAX_EXPRESSION_CHARS = 1000

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of range (division by zero, too large)."""


def _check(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"the result has more than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _power(base: int | float, exp: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        if (abs(base).bit_length() - 1) * exp > MAX_INT_BITS:
            raise CalculatorError(f"the result has more than {MAX_INT_BITS} bits")
    try:
        value = base**exp
    except OverflowError:
        raise CalculatorError("the result is too large") from None
    except ZeroDivisionError:
        raise CalculatorError("division by zero (zero to a negative power)") from None
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number (negative base, fractional exponent)")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.Tuple):
        raise CalculatorError("commas are not allowed: write 1000, not 1,000 (and 1.5, not 1,5)")
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power here: write a ** b")
    raise CalculatorError(f"unsupported element {type(node).__name__!r}: use numbers, + - * / // % ** and parentheses")


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression (Python operator precedence; ``/`` is true division).

    Raises:
        CalculatorError: not plain arithmetic, a syntax error, division by zero, or out of range.
    """
    text = expression.strip().replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not text:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"syntax error at column {exc.offset}: {exc.msg}") from None
    return _eval(tree)


def format_number(value: int | float) -> str:
    """A number as a calculator shows it: integers exactly, floats to 12 significant digits
    (``7/2`` -> ``3.5``, ``6/2`` -> ``3``, ``0.1+0.2`` -> ``0.3``, ``1/3`` -> ``0.333333333333``)."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


@tool(timeout_s=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2 / 7".
    """
    return format_number(evaluate_expression(expression))
