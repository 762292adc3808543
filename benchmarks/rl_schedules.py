"""Steps per minute of the three RL schedules (sync, streaming, async) on the same settings.

Each schedule runs the ``rl`` flow for ``--steps`` steps of the ``arithmetic`` env from the same
base model and seed, through the embedded local server (or ``--base-url``); the rate counts the
flow's training loop only (client start-up and the first sampler save excluded). Prints a
markdown table (medians over ``--repeats``, with each schedule's ratio to sync measured on the
same server setting, and the overlap bound of the same repeat's sync run: its step time over the
longer of its rollout wait and its training time per step, the rate a perfect overlap would
reach; ``of_bound`` = ratio to sync / bound) and writes JSON with ``--json``.  The same figures
again in steady state (``steady_*``): from the end of each run's first step on, since the first step
of an overlapped schedule fills its pipeline (it waits for a whole batch of rollouts with no
training to hide), which caps a whole-run ``of_bound`` over N steps at N max / (N max + min) of
the rollout and training times even for a perfect overlap (``fill_cap``, from the sync runs).

    python benchmarks/rl_schedules.py            # 8 steps, 64-token replies, 1 sampler worker, 3 repeats
    python benchmarks/rl_schedules.py --steps 20 --max-tokens 8 --sampler-workers 0,1 --threads 2 --repeats 2

Defaults: ``tiny``, 8 groups x 4 rollouts of at most 64 tokens, 8 steps, the embedded server with
one sampler worker (the setting whose sampling and training can overlap), 3 repeats.

``--sampler-workers 0,1`` runs every schedule once per setting, interleaved (repeat r: all
schedules on 0 workers, then on 1 worker), each setting on its own embedded server
(``TinkerCredentials.local_sampler_workers``, ``local_threads=--threads`` in all).  With 0
workers one engine serves sampling and training one request at a time, so streaming and async
only hide Prefect/HTTP waits; with workers the sampling runs in its own process, next to the
training, which is what streaming and async overlap.  The sync schedule's rewards per step are
compared across settings (``sync_agreement``): for a fixed seed they must not change.

CPU (with ``psutil``): the CPU seconds each run's flow used, split into this process (the flow:
Prefect tasks, SDK clients), the tinker_local trainer process, its sampler workers and other
children (the ephemeral Prefect server), and ``cores_used`` = all of them / flow wall seconds:
on a machine loaded by other jobs, a schedule can only overlap work up to the cores it gets.
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
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--num-minibatches", type=int, default=None,
                   help="streaming and async (default: each schedule's own, 2 for streaming, 1 for async)")
    p.add_argument("--max-steps-off-policy", type=int, default=1)
    p.add_argument("--schedules", default="sync,streaming,async")
    p.add_argument("--local-root", default=None)
    p.add_argument("--base-url", default=None)
    p.add_argument("--sampler-workers", default=None,
                   help="comma-separated worker counts to compare, e.g. 0,1 (default: 1 on the embedded "
                        "server; with --base-url: that server's own setting)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of each embedded server in all")
    p.add_argument("--repeats", type=int, default=3, help="runs per schedule and setting (medians reported)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.sampler_workers is None and not args.base_url:
        args.sampler_workers = "1"
    if args.sampler_workers is not None and args.base_url:
        p.error("--sampler-workers needs the embedded server (no --base-url)")

    from prefect_tinker.flows.rl import RLConfig, rl_flow
    from tinker_blocks.stores import TrainingStore

    tmp = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    store = str(tmp / "store")
    stamp = time.strftime("%H%M%S")
    settings = _settings(args, tmp, stamp)
    results = []
    try:
        for rep in range(args.repeats):
            for workers, backend in settings:
                for schedule in args.schedules.split(","):
                    r = _run(args, schedule, backend, store, f"bench-{schedule}-w{workers}-r{rep}-{stamp}",
                             TrainingStore, RLConfig, rl_flow)
                    results.append({"sampler_workers": workers, "repeat": rep, **r})
                    print(f"[{time.strftime('%H:%M:%S')}] workers={workers} repeat={rep} {schedule}: "
                          f"{r['steps_per_minute']} steps/min", flush=True)
    finally:
        for _, backend in settings:
            if backend.credentials_block:
                from tinker_blocks import TinkerCredentials

                TinkerCredentials.load(backend.credentials_block).stop_local_server()
    table = _summary(results, args.schedules.split(","))
    print(f"\nRL schedules: model={args.model} group_size={args.group_size} groups_per_batch={args.groups_per_batch} "
          f"max_tokens={args.max_tokens} steps={args.steps} threads={args.threads} repeats={args.repeats}\n")
    cols = ["sampler_workers", "schedule", "steps_per_minute", "ratio_to_sync", "overlap_bound", "of_bound", "fill_cap",
            "steady_steps_per_minute", "steady_overlap_bound", "steady_of_bound",
            "rollout_wait_s_per_step",
            "train_s_per_step", "cores_used", "cpu_s_per_step", "runs"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in table:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    same = _sync_agreement(results, TrainingStore(root=store))
    if same is not None:
        print(f"\nsync runs across sampler_workers settings: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "summary": table,
                                               "sync_agreement": same}, indent=2))
    return results


def _sync_agreement(results: list[dict], store) -> dict | None:
    """Compare the sync runs of repeat 0 across worker settings: rewards per step equal, and the
    largest absolute difference of any other non-timing metric (env/*, train/*, rollout/*) at
    the same step.  None with fewer than two settings."""
    runs = [r for r in results if r["schedule"] == "sync" and r["repeat"] == 0]
    if len(runs) < 2:
        return None
    values = []
    for r in runs:
        rows = store.query("SELECT name, step, value FROM metrics WHERE run_id = ? AND name NOT LIKE 'time/%' "
                           "AND name NOT LIKE '%seconds'", [r["run_name"]])
        values.append({(x["name"], x["step"]): x["value"] for x in rows})
    keys = set(values[0]).intersection(*values[1:])
    diffs = {k: max(abs(v[k] - values[0][k]) for v in values[1:]) for k in keys}
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"rewards_equal": len({tuple(r["rewards"]) for r in runs}) == 1, "metrics_compared": len(keys),
            "metrics_bit_equal": sum(1 for d in diffs.values() if d == 0),
            "max_abs_diff": diffs.get(worst), "max_abs_diff_metric": worst[0] if worst else None}


def _settings(args, tmp: Path, stamp: str) -> list[tuple[int | None, object]]:
    """One (workers, BackendConfig) per server setting: a saved local TinkerCredentials block per
    worker count (own root), or the plain backend when no counts are given."""
    from prefect_tinker.flows.config import BackendConfig

    if args.sampler_workers is None:
        return [(None, BackendConfig(base_url=args.base_url, local_root=args.local_root))]
    from tinker_blocks import TinkerCredentials
    from tinker_blocks.credentials import ensure_local_server

    out = []
    for w in (int(x) for x in args.sampler_workers.split(",")):
        name = f"rl-bench-w{w}-{stamp}"
        root = Path(args.local_root or tmp) / f"server-w{w}"
        block = TinkerCredentials(local=True, local_root=str(root), local_threads=args.threads,
                                  local_sampler_workers=w, local_models=[args.model], local_startup_timeout=900)
        block.save(name, overwrite=True)
        ensure_local_server(block)  # started now, outside the timed runs
        out.append((w, BackendConfig(credentials_block=name)))
    return out


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and its live descendants, by role:
    ``flow`` (this process), ``trainer`` (tinker_local serve), ``sampler_workers``, ``other``
    ({} without psutil).  Processes that exited in between are not counted."""
    try:
        import psutil
    except ImportError:
        return {}
    me = psutil.Process()
    out = {"flow": sum(me.cpu_times()[:2]), "trainer": 0.0, "sampler_workers": 0.0, "other": 0.0}
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            t = sum(child.cpu_times()[:2])
        except psutil.Error:
            continue
        role = ("sampler_workers" if "tinker_local.sampler_pool" in cmd
                else "trainer" if "tinker_local serve" in cmd else "other")
        out[role] += t
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def overlap_bound(sync: dict, steady: bool = False) -> float:
    """The most a schedule overlapping rollouts with training can gain over the sync run ``sync``
    (a ``_run`` result): its step time over the longer of its rollout wait and its training time
    per step, i.e. the rate if the shorter of the two were hidden entirely behind the longer.
    ``steady``: from the run's steady-state figures (every step but the first)."""
    pre = "steady_" if steady else ""
    step_s = 60.0 / sync[pre + "steps_per_minute"]
    longer = max(sync[pre + "rollout_wait_s_per_step"], sync[pre + "train_s_per_step"])
    return step_s / longer if longer > 0 else float("nan")


def fill_cap(sync: dict) -> float:
    """The most of :func:`overlap_bound` a perfect overlap reaches over the whole of a run as long
    as ``sync`` (a ``_run`` result): its first step fills the pipeline (rollouts with no training
    beside them), so N steps take N x max + min of the rollout and training times per step, and
    the whole-run ``of_bound`` is at most N max / (N max + min)."""
    r, t, n = sync["rollout_wait_s_per_step"], sync["train_s_per_step"], sync["steps"]
    return n * max(r, t) / (n * max(r, t) + min(r, t)) if n and max(r, t) > 0 else float("nan")


def _to_sync(run: dict, sync: dict[int, dict], pre: str = "") -> float:
    """``run``'s rate (``pre``: "" whole run, "steady_") over the sync rate of its repeat."""
    return run[pre + "steps_per_minute"] / sync[run["repeat"]][pre + "steps_per_minute"]


def _of_bound(mine: list[dict], sync: dict[int, dict], bound: dict[int, float], pre: str) -> list[float]:
    """Per run of ``mine``: its ratio to sync over the bound of the same repeat's sync run."""
    return [_to_sync(r, sync, pre) / bound[r["repeat"]] for r in mine
            if r["repeat"] in sync and sync[r["repeat"]][pre + "steps_per_minute"] and bound.get(r["repeat"])]


def _summary(results: list[dict], schedules: list[str]) -> list[dict]:
    """Medians per (workers, schedule); ratio_to_sync = median over repeats of the run's rate
    divided by the sync rate of the same repeat and setting (measured side by side);
    overlap_bound = median of the sync runs' :func:`overlap_bound`; of_bound = median over
    repeats of ratio_to_sync / the bound of the same repeat's sync run."""
    table = []
    for w in dict.fromkeys(r["sampler_workers"] for r in results):
        rows = [r for r in results if r["sampler_workers"] == w]
        sync = {r["repeat"]: r for r in rows if r["schedule"] == "sync"}
        bound = {r["repeat"]: overlap_bound(r) for r in sync.values()}
        steady_bound = {r["repeat"]: overlap_bound(r, steady=True) for r in sync.values()}
        for schedule in schedules:
            mine = [r for r in rows if r["schedule"] == schedule]
            ratios = [_to_sync(r, sync) for r in mine if r["repeat"] in sync and sync[r["repeat"]]["steps_per_minute"]]
            of_bound = _of_bound(mine, sync, bound, "")
            steady_of_bound = _of_bound(mine, sync, steady_bound, "steady_")
            table.append({
                "sampler_workers": w, "schedule": schedule, "runs": len(mine),
                "steps_per_minute": round(_median([r["steps_per_minute"] for r in mine]), 2),
                "ratio_to_sync": round(_median(ratios), 2) if ratios else None,
                "overlap_bound": round(_median(list(bound.values())), 2) if bound else None,
                "of_bound": round(_median(of_bound), 3) if of_bound else None,
                "fill_cap": round(_median([fill_cap(r) for r in sync.values()]), 3) if sync else None,
                "steady_steps_per_minute": round(_median([r["steady_steps_per_minute"] for r in mine]), 2),
                "steady_overlap_bound": round(_median(list(steady_bound.values())), 2) if steady_bound else None,
                "steady_of_bound": round(_median(steady_of_bound), 3) if steady_of_bound else None,
                "rollout_wait_s_per_step": round(_median([r["rollout_wait_s_per_step"] for r in mine]), 3),
                "train_s_per_step": round(_median([r["train_s_per_step"] for r in mine]), 3),
                "cores_used": round(_median([r["cores_used"] or float("nan") for r in mine]), 2),
                "cpu_s_per_step": {k: round(_median([r["cpu_s"].get(k, float("nan")) / max(r["steps"], 1)
                                                     for r in mine]), 2) for k in mine[0]["cpu_s"]},
            })
    return table


def _run(args, schedule: str, backend, store: str, run_name: str, TrainingStore, RLConfig, rl_flow) -> dict:
    """One ``rl_flow`` run of ``schedule``: its rate, per-step timings and rewards."""
    cfg = RLConfig(
        model=args.model, env="arithmetic", group_size=args.group_size, groups_per_batch=args.groups_per_batch,
        max_tokens=args.max_tokens, max_steps=args.steps, lora_rank=args.lora_rank, learning_rate=1e-3,
        schedule=schedule, num_minibatches=args.num_minibatches, max_steps_off_policy=args.max_steps_off_policy,
        save_every=0, log_trajectories=0, run_name=run_name, store=store, backend=backend,
    )
    cpu0 = _cpu_by_role()
    t0 = time.perf_counter()
    summary = rl_flow(cfg)
    wall = time.perf_counter() - t0
    cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in _cpu_by_role().items()}
    rows = TrainingStore(root=store).query(
        "SELECT name, step, value FROM metrics WHERE run_id = ? AND name LIKE 'time/%'", [cfg.run_name])
    per_step: dict[str, dict[int, float]] = {}
    for r in rows:
        per_step.setdefault(r["name"], {})[r["step"]] = r["value"]
    timing = {k: sum(v.values()) / len(v) for k, v in per_step.items()}
    # steady state: from the end of the first step on (the first step of an overlapped schedule fills
    # its pipeline: it waits for a whole batch of rollouts with no training to overlap)
    first = min(per_step.get("time/step_seconds", {}) or [0])
    later = {k: [x for st, x in v.items() if st != first] for k, v in per_step.items()}
    steady_s = summary["seconds"] - per_step.get("time/step_seconds", {}).get(first, float("nan"))
    n_later = summary["steps_this_invocation"] - 1
    steady_rate = 60.0 * n_later / steady_s if n_later > 0 and steady_s > 0 else float("nan")
    return {
        "steady_steps_per_minute": round(steady_rate, 2),
        "steady_rollout_wait_s_per_step": round(_mean(later.get("time/rollout_seconds", [])), 3),
        "steady_train_s_per_step": round(_mean(later.get("time/train_seconds", [])), 3),
        "schedule": schedule, "steps": summary["steps"], "loop_seconds": round(summary["seconds"], 2),
        "steps_per_minute": round(summary["steps_per_minute"], 2), "flow_wall_seconds": round(wall, 2),
        "rollout_wait_s_per_step": round(timing.get("time/rollout_seconds", float("nan")), 3),
        "train_s_per_step": round(timing.get("time/train_seconds", float("nan")), 3),
        "reward_last": summary["last_reward"], "rewards": summary["rewards"], "run_name": run_name,
        "cpu_s": cpu, "cores_used": round(sum(cpu.values()) / wall, 2) if cpu else None,
    }


if __name__ == "__main__":
    main()
