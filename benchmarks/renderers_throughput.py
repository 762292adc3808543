"""Renderer throughput: supervised examples per second on the Dolly slice of ../shared/data.

    python benchmarks/renderers_throughput.py [--repeats 5] [--baseline-dir DIR]

For each renderer (tiny's and SmolLM2's tokenizers) it renders the 151 Dolly conversations with
``build_supervised_example`` and reports the median over ``--repeats`` passes, with content encoded
as text (the default) and with ``special_tokens_in_content=True``.  ``--baseline-dir`` names a
folder holding an older copy of the package as ``oldrenderers`` (``git archive <rev>
recipes/renderers`` moved there, imports rewritten) to time side by side.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def _conversations() -> list[list[dict]]:
    path = DATA / "sft" / "dolly_slice_messages.jsonl"
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def _time(renderer, convs, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for conv in convs:
            renderer.build_supervised_example(conv)
        runs.append(time.perf_counter() - start)
    return len(convs) / statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-dir", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from prefect_tinker.recipes.renderers import get_renderer
    from tinker_local.tokenizer import build_tiny_tokenizer

    old = None
    if args.baseline_dir:
        sys.path.insert(0, args.baseline_dir)
        old = importlib.import_module("oldrenderers")
    convs = _conversations()
    toks = {
        "tiny": build_tiny_tokenizer(),
        "smollm2": AutoTokenizer.from_pretrained(str(DATA / "tokenizer" / "smollm2")),
    }
    print(f"{len(convs)} conversations, median of {args.repeats}; conversations/s")
    print(f"{'renderer':15} {'tokenizer':9} {'text':>8} {'markup':>8} {'baseline':>9}")
    for name, tok_id in [("role_colon", "smollm2"), ("chatml", "tiny"), ("smollm2", "smollm2"),
                         ("chat_template", "tiny"), ("chat_template", "smollm2")]:
        tok = toks[tok_id]
        text = _time(get_renderer(name, tok), convs, args.repeats)
        markup = _time(get_renderer(name, tok, special_tokens_in_content=True), convs, args.repeats)
        base = f"{_time(old.get_renderer(name, tok), convs, args.repeats):9.0f}" if old else f"{'-':>9}"
        print(f"{name:15} {tok_id:9} {text:8.0f} {markup:8.0f} {base}")


if __name__ == "__main__":
    main()
