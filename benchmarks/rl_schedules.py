"""Steps per minute of the three RL schedules (sync, streaming, async) on the same settings.

Each schedule runs the ``rl`` flow for ``--steps`` steps of the ``arithmetic`` env from the same
base model and seed, through the embedded local server (or ``--base-url``); the rate counts the
flow's training loop only (client start-up and the first sampler save excluded). Prints a
markdown table and writes JSON with ``--json``.

    python benchmarks/rl_schedules.py --model tiny --steps 6 --group-size 4 --groups-per-batch 8

On the local server one engine serves sampling and training one request at a time, so the
overlap that streaming and async buy on the hosted service (sampling while training) shows up
only as the Prefect/HTTP waits they hide; the async schedule also keeps up to two batches of
rollouts in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
             "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--num-minibatches", type=int, default=2)
    p.add_argument("--max-steps-off-policy", type=int, default=1)
    p.add_argument("--schedules", default="sync,streaming,async")
    p.add_argument("--local-root", default=None)
    p.add_argument("--base-url", default=None)
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)

    from prefect_tinker.flows.config import BackendConfig
    from prefect_tinker.flows.rl import RLConfig, rl_flow
    from tinker_blocks.stores import TrainingStore

    store = str(Path(tempfile.mkdtemp(prefix="rl-bench-")) / "store")
    backend = BackendConfig(base_url=args.base_url, local_root=args.local_root)
    results = []
    stamp = time.strftime("%H%M%S")
    for schedule in args.schedules.split(","):
        cfg = RLConfig(
            model=args.model, env="arithmetic", group_size=args.group_size, groups_per_batch=args.groups_per_batch,
            max_tokens=args.max_tokens, max_steps=args.steps, lora_rank=args.lora_rank, learning_rate=1e-3,
            schedule=schedule, num_minibatches=args.num_minibatches, max_steps_off_policy=args.max_steps_off_policy,
            save_every=0, log_trajectories=0, run_name=f"bench-{schedule}-{stamp}", store=store, backend=backend,
        )
        t0 = time.perf_counter()
        summary = rl_flow(cfg)
        wall = time.perf_counter() - t0
        timing = {r["name"]: r["v"] for r in TrainingStore(root=store).query(
            "SELECT name, avg(value) AS v FROM metrics WHERE run_id = ? AND name LIKE 'time/%' GROUP BY name",
            [cfg.run_name])}
        results.append({
            "schedule": schedule, "steps": summary["steps"], "loop_seconds": round(summary["seconds"], 2),
            "steps_per_minute": round(summary["steps_per_minute"], 2), "flow_wall_seconds": round(wall, 2),
            "rollout_wait_s_per_step": round(timing.get("time/rollout_seconds", float("nan")), 3),
            "train_s_per_step": round(timing.get("time/train_seconds", float("nan")), 3),
            "reward_last": summary["last_reward"],
        })
    cols = ["schedule", "steps", "steps_per_minute", "loop_seconds", "rollout_wait_s_per_step", "train_s_per_step",
            "flow_wall_seconds"]
    print(f"\nRL schedules: model={args.model} group_size={args.group_size} groups_per_batch={args.groups_per_batch} "
          f"max_tokens={args.max_tokens} steps={args.steps}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
