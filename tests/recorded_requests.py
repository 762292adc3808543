"""Reading a recording server's request log (``tinker_local.request_log``) around one run.

``mark(folder)`` before the run, ``since(folder, marked)`` after it: the entries the run added, in
the order the server wrote them. Shared by the tests that compare two programs' requests
(``test_cookbook_parity.py``, ``test_reference_loops.py``).
"""

from __future__ import annotations

import json
from pathlib import Path


def mark(folder: Path) -> dict[Path, int]:
    """How many entries each session's request log holds now."""
    return {p: len(p.read_text().splitlines()) for p in folder.glob("*.jsonl")} if folder.is_dir() else {}


def since(folder: Path, marked: dict[Path, int]) -> list[dict]:
    """The request-log entries written after ``marked``, session after session (in-process flows reuse the
    process's SDK session, so a run's entries may follow an earlier run's in the same file)."""
    out: list[dict] = []
    for p in sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        out.extend(json.loads(line) for line in p.read_text().splitlines()[marked.get(p, 0) :] if line)
    return out
