"""Write generated two-number word problems (``{question, answer: "#### n"}`` JSONL) for the
``calculator`` environment: products and sums of two-digit numbers, which a small model gets wrong
by itself and right with the calculator tool.

    python scripts/arith_word_problems.py --out /tmp/arith_words.jsonl --n 200 --seed 0
    prefect-tinker run rl env=calculator dataset=/tmp/arith_words.jsonl few_shot=true model=smollm2 ...
"""

from __future__ import annotations

import argparse
import json
import random

TEMPLATES = (
    ("A box holds {a} apples. How many apples are in {b} boxes?", lambda a, b: a * b),
    ("A train carries {a} people in each car and has {b} cars. How many people does it carry?", lambda a, b: a * b),
    ("Tom saves {a} dollars every week for {b} weeks. How many dollars does he save?", lambda a, b: a * b),
    ("A farm has {a} cows and buys {b} more. How many cows does it have now?", lambda a, b: a + b),
)


def problems(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` problems, templates in turn, operands uniform in 12..99 from ``random.Random(seed)``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        template, value = TEMPLATES[i % len(TEMPLATES)]
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        out.append({"question": template.format(a=a, b=b), "answer": f"#### {value(a, b)}"})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSONL file to write.")
    p.add_argument("--n", type=int, default=200, help="Number of problems.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in problems(args.n, args.seed))


if __name__ == "__main__":
    main()
