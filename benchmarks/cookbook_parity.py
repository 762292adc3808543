"""Same recipe, same numbers: tinker-cookbook 0.6.1's training loops and ours, request by request.

For each recipe this starts one ``prefect-tinker local serve`` (fp32, every request recorded with
its payload: ``--record-requests``; sampling seeded by the request's content: ``--sampling-seed
content``; LoRA adapters created without a seed initialised from seed 0: ``--lora-seed 0``), runs
the cookbook's own training entry point with a config in a child process (its own session), then
``prefect-tinker run RECIPE`` with the equivalent config (another session), and compares what the
two sessions sent:

- the training requests in order (``forward_backward`` / ``forward`` with every datum's model
  input, loss function, loss config and every loss input; ``optim_step`` with its Adam
  parameters), step by step;
- the sampling requests (prompt, sampling parameters other than the seed, the identity of the
  sampled weights, and what came back), one entry per sampled sequence, in a canonical order;
- the loss of every step (``loss:sum`` of each ``forward_backward``), and the final LoRA weights
  (the adapter of each side's last save).

It prints one table per recipe (requests compared, the first difference with its step, request,
datum, field and both values, the largest relative loss difference, the largest final weight
difference) and, last, one summary line per recipe.  Exit status 0 when every recipe is identical
within the tolerances (integers exact; floats within ``--rtol``, default 1e-6 relative).

The cookbook is not a dependency of the project; install it beside the environment (what
``scripts/setup.sh`` does, into ``.cookbook/``)::

    pip install --target .cookbook --no-deps tinker-cookbook==0.6.1 tml-renderers chz blobfile \\
        pyrage termcolor tiktoken lxml pycryptodomex
    python benchmarks/cookbook_parity.py --recipe sft --steps 20
    python benchmarks/cookbook_parity.py --recipe sft,dpo,rl --model smollm2 --json parity.json

``--cookbook DIR`` (default ``.cookbook`` in the checkout, else ``$COOKBOOK_DIR``) is put on the
children's ``PYTHONPATH``.  The config mapping (cookbook field -> ours) of each recipe is in its module of
``benchmarks/parity/`` (``sft.py``, ``dpo.py``, ``rl.py``, ``distill.py``; :data:`RECIPES` below lists them
all) and in docs/cookbook-parity.md.  This file is the command line; the package ``benchmarks/parity/``
holds the server and the sides (``running.py``), the request logs (``requests.py``) and the comparison
(``compare.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported: the package beside it

from parity import REPO, distill, dpo, rl, sft  # noqa: E402
from parity.compare import compare, summary, table  # noqa: E402
from parity.recipe import Recipe  # noqa: E402
from parity.requests import read_sessions  # noqa: E402
from parity.running import Server, run_cookbook, run_ours  # noqa: E402

#: every compared recipe, by the name ``--recipe`` takes
RECIPES: dict[str, Recipe] = {**sft.RECIPES, **dpo.RECIPES, **rl.RECIPES, **distill.RECIPES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="sft", help=f"comma-separated, of: {', '.join(RECIPES)} (or all)")
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF model directory (default tiny)")
    ap.add_argument("--dataset", default=None, help="data file of the recipe (default: the recipe's own)")
    ap.add_argument(
        "--format", default=None, help="SFT: our converter of --dataset's records (default: by the record's shape)"
    )
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--test-size", type=int, default=0)
    ap.add_argument("--renderer", default="role_colon")
    ap.add_argument("--max-tokens", type=int, default=8, help="RL: most sampled tokens per reply (default 8)")
    ap.add_argument("--rtol", type=float, default=1e-6, help="float tolerance, relative (default 1e-6)")
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--cookbook", type=Path, default=Path(os.environ.get("COOKBOOK_DIR", REPO / ".cookbook")))
    ap.add_argument("--json", type=Path, default=None, help="write the comparisons here")
    args = ap.parse_args(argv)
    names = list(RECIPES) if args.recipe == "all" else [r.strip() for r in args.recipe.split(",") if r.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"--recipe: unknown {', '.join(unknown)} (known: {', '.join(RECIPES)})")
    if not (args.cookbook / "tinker_cookbook").is_dir():
        ap.error(f"--cookbook: no tinker_cookbook in {args.cookbook} (install it: see this script's docstring)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cookbook-parity-"))
    results = []
    for name in names:
        r = RECIPES[name]
        rw = work / name
        rw.mkdir(parents=True, exist_ok=True)
        print(f"{name}: serving {args.model} (fp32) in {rw}", flush=True)
        server = Server(rw, args.model, args.threads)
        try:
            extra = (server.teacher(),) if r.teacher else ()
            cb = run_cookbook(server, r.cookbook_code, r.cookbook_args(args, rw, *extra), args.cookbook)
            ours = run_ours(server, r.name, r.ours(args, rw, *extra))
            cmp = compare(
                name,
                args.model,
                read_sessions(server.requests, cb),
                read_sessions(server.requests, ours),
                args.rtol,
                r.samples,
                r.sample_fields,
                r.by_step,
            )
        finally:
            server.close()
        print(table(cmp, args.rtol), flush=True)
        results.append(cmp)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "recipe": c.recipe, "model": c.model, "steps": c.steps, "requests": c.requests,
                        "sequences": c.sequences, "first_difference": None if c.first is None else str(c.first),
                        "max_float_rel": c.max_float_rel, "max_loss_rel": c.max_loss_rel,
                        "max_weight_abs": c.max_weight_abs, "identical": c.identical(args.rtol), "losses": c.losses,
                        "notes": c.notes,
                    }
                    for c in results
                ],
                indent=1,
            )
        )  # fmt: skip
    for c in results:
        print(summary(c, args.rtol))
    return 0 if all(c.identical(args.rtol) for c in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
