"""Load test of a shared ``tinker_local`` server: N keys at once, each a real SDK client in a process
of its own, doing forward_backward + optim_step + sample in a loop for a given time.

What it checks and prints (JSON with ``--out``):
- errors: every exception a client saw (want 0);
- cross-talk: afterwards each user's first ``--replay`` steps are run again alone on the same server
  (a fresh model with the same seed and data); losses and sampled tokens must equal the loaded
  run's exactly;
- fair share: each user's compute seconds (admin ``GET /api/v1/local_stats``) against an equal share
  (want every user within 25 %);
- memory: the server's resident set size every 10 s; growth from the end of the first quarter of
  the run to its end (want flat: under 10 %).

    python benchmarks/load_keys.py --users 8 --minutes 10 --out /tmp/load.json

The server is ``prefect-tinker local serve --model tiny`` (fp32, ``--threads`` as given) on a free
127.0.0.1 port with N user keys and one admin key in a temporary root.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLI = str(Path(sys.executable).parent / "prefect-tinker")


def _datums(user: int, step: int):
    from tinker import types

    rng = np.random.default_rng(1000 * user + step)
    out = []
    for _ in range(4):
        toks = rng.integers(0, 2048, 33)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": toks[1:].astype(np.int64),
                                               "weights": np.ones(32, np.float32)}))
    return out


def _prompt(user: int, step: int):
    from tinker import types

    rng = np.random.default_rng(7 + 1000 * user + step)
    return types.ModelInput.from_ints(rng.integers(0, 2048, 16).tolist())


def run_user(url: str, key: str, user: int, seconds: float, max_steps: int, q) -> None:
    """One user's loop; puts ``{"user", "losses", "samples", "errors"}`` on ``q``."""
    import tinker
    from tinker import types

    losses, samples, errors = [], [], []
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=key)
        tc = sc.create_lora_training_client("tiny", rank=8, seed=100 + user)
        sampler = sc.create_sampling_client(base_model="tiny")
        deadline = time.monotonic() + seconds
        step = 0
        while time.monotonic() < deadline and step < max_steps:
            try:
                fb = tc.forward_backward(_datums(user, step), "cross_entropy")
                opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                smp = sampler.sample(_prompt(user, step), num_samples=2,
                                     sampling_params=types.SamplingParams(max_tokens=16, seed=step, temperature=1.0))
                losses.append(fb.result(timeout=600).metrics["loss:sum"])
                opt.result(timeout=600)
                samples.append([list(s.tokens) for s in smp.result(timeout=600).sequences])
            except Exception as e:  # counted, and the loop goes on
                errors.append(f"step {step}: {type(e).__name__}: {e}"[:300])
            step += 1
        sc.close("success").result(timeout=60)
    except Exception as e:
        errors.append(f"setup: {type(e).__name__}: {e}"[:300])
    q.put({"user": user, "losses": losses, "samples": samples, "errors": errors})


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _stats(url: str, key: str) -> dict:
    import httpx

    return httpx.get(f"{url}/api/v1/local_stats", headers={"X-API-Key": key}, timeout=30).json()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--replay", type=int, default=5, help="steps of each user run again alone")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from tests.local_server import free_port
    from tinker_local.launcher import healthy

    root = Path(tempfile.mkdtemp(prefix="load-keys-"))
    keys = {}
    for name in [f"user{i}" for i in range(args.users)] + ["admin"]:
        extra = ["--admin"] if name == "admin" else []
        keys[name] = subprocess.run([CLI, "local", "keys", "--root", str(root), "add", name, *extra],
                                    capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    log = open(root / "server.log", "w")
    server = subprocess.Popen([CLI, "local", "serve", "--model", "tiny", "--dtype", "fp32", "--threads",
                               str(args.threads), "--port", str(port), "--root", str(root)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while not healthy(url, timeout=2):
            if server.poll() is not None:
                raise SystemExit(f"server exited: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        seconds = args.minutes * 60
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=run_user, args=(url, keys[f"user{i}"], i, seconds, 10**9, q))
                 for i in range(args.users)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        rss = []
        while any(p.is_alive() for p in procs) and len(rss) < 10**6:
            rss.append((round(time.monotonic() - t0, 1), _rss(server.pid)))
            time.sleep(10)
            if q.qsize() >= args.users:
                break
        results = {r["user"]: r for r in (q.get(timeout=600) for _ in procs)}
        for p in procs:
            p.join(60)
        wall = time.monotonic() - t0
        loaded_stats = _stats(url, keys["admin"])
        # cross-talk: each user's first steps again, alone
        mismatches = []
        for i in range(args.users):
            n = min(args.replay, len(results[i]["losses"]))
            solo_q = ctx.Queue()
            run_user(url, keys[f"user{i}"], i, 10**9, n, solo_q)
            solo = solo_q.get()
            if solo["errors"]:
                mismatches.append(f"user{i} solo errors: {solo['errors']}")
            if solo["losses"] != results[i]["losses"][:n] or solo["samples"] != results[i]["samples"][:n]:
                mismatches.append(f"user{i}: losses/samples differ from the solo run over {n} steps")
        compute = {u: loaded_stats["users"][f"user{u}"]["compute_s"] for u in range(args.users)}
        total = sum(compute.values())
        shares = {u: c / total for u, c in compute.items()}
        worst = max(abs(s * args.users - 1.0) for s in shares.values())
        quarter = [r for t, r in rss if t >= wall / 4]
        growth = (rss[-1][1] - quarter[0]) / quarter[0] if quarter else float("nan")
        summary = {
            "users": args.users,
            "wall_s": round(wall, 1),
            "steps_per_user": {u: len(r["losses"]) for u, r in results.items()},
            "errors": sum(len(r["errors"]) for r in results.values()),
            "error_samples": [e for r in results.values() for e in r["errors"]][:5],
            "cross_talk": mismatches,
            "replayed_steps_per_user": min(args.replay, min(len(r["losses"]) for r in results.values())),
            "compute_s": {u: round(c, 1) for u, c in compute.items()},
            "share_of_equal": {u: round(s * args.users, 3) for u, s in shares.items()},
            "worst_share_deviation": round(worst, 3),
            "rss_mb": [(t, round(r / 2**20, 1)) for t, r in rss],
            "rss_growth_after_first_quarter": round(growth, 4),
            "median_step_s": round(statistics.median(wall / max(1, len(r["losses"])) for r in results.values()), 2),
            "verdict": {
                "no_errors": all(not r["errors"] for r in results.values()),
                "no_cross_talk": not mismatches,
                "shares_within_25pct": worst <= 0.25,
                "memory_flat_within_10pct": abs(growth) <= 0.10,
            },
        }
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0 if all(summary["verdict"].values()) else 1
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
