"""Benchmark: one client-side custom-loss step (what the SDK's ``forward_backward_custom`` sends:
a ``forward``, then a ``forward_backward`` of the same tokens with ``weights = -d(loss)/d(logprobs)``)
on the local engine, with and without the engine keeping the forward's autograd graph for the
``forward_backward`` that follows it (``tinker_local.engine.Engine._run``).

In one process, alternating round by round: **kept** (the engine as it is: the forward_backward
runs backward only) and **fresh** (the kept graph dropped between the two calls, so the
forward_backward runs its own forward, as before the change).  The batch is DPO-shaped: ``--pairs``
pairs of a ``--prompt``-token prompt and two replies of ``--reply`` tokens (random ids), packed with
their shared prompt as the engine does.  Reported: median wall and CPU seconds per step of each
and the ratio fresh / kept (> 1: keeping pays), and the largest gradient difference of the two.

    python benchmarks/custom_loss_step.py                    # like-for-like tied model, 8 pairs, 5 rounds
    python benchmarks/custom_loss_step.py --model tiny --rounds 7 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinker_local_common import build_like_for_like_dir, load_average  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tied", help="tied (the like-for-like model), tiny, or a local HF directory")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--reply", type=int, default=96)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    args = ap.parse_args(argv)
    from tinker_local.engine import Datum, Engine

    work = Path(tempfile.mkdtemp(prefix="tl-custom-step-"))
    model = str(build_like_for_like_dir(work / "model", tied=True)) if args.model == "tied" else args.model
    eng = Engine(work / "root", dtype=args.dtype, num_threads=args.threads)
    rng = np.random.default_rng(0)
    vocab = int(eng.load_base_model(model)["vocab_size"])
    data = []
    for _ in range(args.pairs):
        prompt = rng.integers(3, vocab, args.prompt).tolist()
        for _side in range(2):
            seq = prompt + rng.integers(3, vocab, args.reply + 1).tolist()
            w = np.zeros(len(seq) - 1, np.float32)
            w[args.prompt - 1 :] = rng.uniform(-1, 1, len(seq) - args.prompt).astype(np.float32)
            data.append(Datum(tokens=seq[:-1], inputs={"target_tokens": np.asarray(seq[1:], np.int64), "weights": w}))
    for side in ("kept", "fresh"):
        eng.create_model(side, model, args.rank, seed=0)

    def step(side: str) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        eng.forward(side, data, "cross_entropy", None)
        if side == "fresh":
            eng._kept_forward = None
        eng.forward_backward(side, data, "cross_entropy", None)
        return time.perf_counter() - t0, time.process_time() - c0

    for side in ("kept", "fresh"):  # warm-up
        step(side)
    load_before = load_average()
    times: dict[str, list[tuple[float, float]]] = {"kept": [], "fresh": []}
    for r in range(args.rounds):
        for side in ("kept", "fresh") if r % 2 == 0 else ("fresh", "kept"):
            for p in eng._models[side].params.values():
                p.grad = None
            times[side].append(step(side))
    ga, gb = eng._models["kept"].params, eng._models["fresh"].params
    diff = max(float((ga[k].grad - gb[k].grad).abs().max()) for k in ga)
    med = {s: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for s, v in times.items()}
    print(f"load average before {load_before}, after {load_average()}; model {args.model}, {args.pairs} pairs of "
          f"{args.prompt} + 2 x {args.reply} tokens, rank {args.rank}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    print("| side | wall s/step | CPU s/step |")
    print("|---|---:|---:|")
    for s in ("fresh", "kept"):
        print(f"| {s} | {med[s][0]:.3f} | {med[s][1]:.3f} |")
    wall, cpu = med["fresh"][0] / med["kept"][0], med["fresh"][1] / med["kept"][1]
    print(f"ratio fresh / kept: wall {wall:.3f}, CPU {cpu:.3f}; largest gradient difference {diff:.2e}")
    return {"median": med, "grad_max_diff": diff}


if __name__ == "__main__":
    main()
