"""A verifiers ToolEnv on local data: one tool (add_one); reward 1 when the completion holds a tool
result (the tool was called and ran)."""

import verifiers as vf
from datasets import Dataset


async def add_one(x: int) -> int:
    """Add 1 to an integer.

    Args:
        x: The integer.

    Returns:
        x + 1.
    """
    return x + 1


def used_tool(completion, **kwargs) -> float:
    return float(any((m.get("role") if isinstance(m, dict) else m.role) == "tool" for m in completion))


def load_environment() -> vf.Environment:
    data = Dataset.from_list([{"question": "Use add_one on 41, then tell me the result.", "answer": "42"}] * 2)
    return vf.ToolEnv(dataset=data, tools=[add_one], rubric=vf.Rubric(funcs=[used_tool]), max_turns=3)
