"""``differences``: a benchmark of the plugin, as one registration: its questions in a JSONL file
shipped with the package, graded by the reply's last number."""

from __future__ import annotations

from pathlib import Path

DIFFERENCES = {
    "source": {"path": str(Path(__file__).with_name("differences.jsonl")), "split": "train"},
    "fields": {"question": "question", "answer": "answer"},
    "prompt": {"question_template": "{question} Answer with the number only."},
    "grader": {"kind": "number", "answer_style": "last_number"},
    "max_tokens": 8,
}
