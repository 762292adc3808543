"""Tools for tool-use environments: the ``@tool`` decorator and its JSON schemas, a safe calculator,
and BM25 retrieval over a JSONL document collection.

Tool errors, bad arguments and timeouts come back as ``Error: ...`` result text (never exceptions),
so a rollout never crashes on what the model wrote.  The retrieval tool needs the ``tools`` extra
(``bm25s``); it is imported lazily.
"""

from prefect_tinker.recipes.tools.calculator import CalculatorError, calculator, evaluate_expression, format_number
from prefect_tinker.recipes.tools.core import Tool, ToolResult, Toolset, tool

__all__ = [
    "BM25Index",
    "CalculatorError",
    "Passage",
    "Tool",
    "ToolResult",
    "Toolset",
    "calculator",
    "evaluate_expression",
    "format_number",
    "load_documents",
    "tool",
]


def __getattr__(name: str):
    if name in ("BM25Index", "Passage", "load_documents"):
        from prefect_tinker.recipes.tools import retrieval

        return getattr(retrieval, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
