"""Fair share on a shared tinker_local server: one user's training step time alone and while another
user floods the server with sampling requests.

Starts ``prefect-tinker local serve --model tiny`` with two keys (``trainer``, ``flooder``) in a
temporary root, then measures the trainer's step (``forward_backward`` + ``optim_step``, waited
for) through the unmodified SDK: ``--steps`` steps alone, then ``--steps`` steps while
``--flood`` threads of the other user each keep one sampling request (``--flood-tokens`` new
tokens, ``--flood-samples`` sequences) in flight, plus one burst of ``--burst`` requests
submitted at once before each step.  Prints the median step times and their ratio (the issue's
target: within 2x of alone).  The compute thread serves the two users round-robin
(``tinker_local.futures``), so a step waits for at most one sampling batch, not the flood.

    python benchmarks/fair_share.py [--steps 8] [--flood 4] [--burst 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np


def _serve(root: Path, port: int, threads: int) -> tuple[subprocess.Popen, dict[str, str]]:
    cli = str(Path(sys.executable).parent / "prefect-tinker")
    keys = {u: subprocess.run([cli, "local", "keys", "--root", str(root), "add", u], capture_output=True,
                              text=True, check=True).stdout.strip() for u in ("trainer", "flooder")}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    proc = subprocess.Popen([cli, "local", "serve", "--model", "tiny", "--port", str(port), "--root", str(root),
                             "--threads", str(threads), "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, keys
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--flood", type=int, default=4, help="flooding threads (one request in flight each)")
    ap.add_argument("--burst", type=int, default=32, help="sampling requests submitted at once before each step")
    ap.add_argument("--flood-tokens", type=int, default=16)
    ap.add_argument("--flood-samples", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="datums per training step")
    ap.add_argument("--threads", type=int, default=2, help="server torch threads")
    ap.add_argument("--port", type=int, default=18977)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import tinker
    from tinker import types

    with tempfile.TemporaryDirectory() as tmp:
        proc, keys = _serve(Path(tmp), args.port, args.threads)
        url = f"http://127.0.0.1:{args.port}"
        try:
            trainer = tinker.ServiceClient(base_url=url, api_key=keys["trainer"])
            flooder = tinker.ServiceClient(base_url=url, api_key=keys["flooder"])
            tc = trainer.create_lora_training_client("tiny", rank=8, seed=0).result(timeout=300)
            tok = tc.get_tokenizer()
            ids = tok.encode("the quick brown fox jumps over the lazy dog " * 6)
            datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                                "weights": np.ones(len(ids) - 1, np.float32)})
            sampler = flooder.create_sampling_client(base_model="tiny")
            prompt = types.ModelInput.from_ints(tok.encode("hello world"))
            params = types.SamplingParams(max_tokens=args.flood_tokens, seed=1, stop=[])

            def step() -> float:
                t0 = time.perf_counter()
                tc.forward_backward([datum] * args.batch, "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=600)
                return time.perf_counter() - t0

            step()  # warm-up
            alone = [step() for _ in range(args.steps)]
            stop = threading.Event()
            done = [0]

            def flood() -> None:
                while not stop.is_set():
                    sampler.sample(prompt, args.flood_samples, params).result(timeout=600)
                    done[0] += 1

            workers = [threading.Thread(target=flood, daemon=True) for _ in range(args.flood)]
            for w in workers:
                w.start()
            time.sleep(1.0)
            flooded = []
            for _ in range(args.steps):
                burst = [sampler.sample(prompt, args.flood_samples, params) for _ in range(args.burst)]
                flooded.append(step())
                for f in burst:
                    f.result(timeout=600)
            stop.set()
            for w in workers:
                w.join(600)
            out = {"alone_median_s": statistics.median(alone), "flooded_median_s": statistics.median(flooded),
                   "alone_s": alone, "flooded_s": flooded, "flood_requests_done": done[0], **vars(args)}
            out["ratio"] = out["flooded_median_s"] / out["alone_median_s"]
            out["json"] = str(args.json) if args.json else None
            print(f"trainer step median: alone {out['alone_median_s']:.3f} s, during the flood "
                  f"{out['flooded_median_s']:.3f} s (x{out['ratio']:.2f}); flood requests served: {done[0]}")
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
