"""Benchmark: an aggregate SQL query over the training store, local folder vs local S3 (SeaweedFS).

Data: RUNS runs x STEPS steps x METRICS metrics in ``metrics`` (default 100 x 1,000 x 10 = 1M rows),
written as the store writes them (one part per ``--steps-per-part`` steps: 100 -> 10 parts per run,
1,000 files) and, as a second layout, compacted (one part per run, 100 files).

Query (mean loss by run and step, 100,000 result rows fetched to Python)::

    SELECT run_id, step, avg(value) AS mean_loss FROM metrics
    WHERE name LIKE '%loss' GROUP BY run_id, step ORDER BY run_id, step

- cold: a new store object, a new S3 client (no listing cache), a new DuckDB connection with
  its views (``connect()``), then the query;
- warm: the same query again on that connection.

Each number is the median of ``--repeats`` tries. Targets: < 1 s local, < 2 s S3.

    python benchmarks/store_query.py                    # local + SeaweedFS started here
    python benchmarks/store_query.py --runs 10 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinker_blocks.store_io import METRICS_SCHEMA, ParquetStore, make_row_id  # noqa: E402

METRIC_NAMES = [
    "train/loss", "train/loss_sum", "train/tokens", "train/learning_rate", "train/step_seconds",
    "train/grad_norm", "test/loss", "test/tokens", "train/reward_mean", "train/kl",
]
QUERY = (
    "SELECT run_id, step, avg(value) AS mean_loss FROM metrics "
    "WHERE name LIKE '%loss' GROUP BY run_id, step ORDER BY run_id, step"
)


def write_dataset(io: ParquetStore, runs: int, steps: int, metrics: int, steps_per_part: int) -> int:
    """Write the metrics parts (vectorised; row ids as the writer derives them); return #parts."""
    names = METRIC_NAMES[:metrics] + [f"extra/m{i}" for i in range(max(0, metrics - len(METRIC_NAMES)))]
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    rng = np.random.default_rng(0)
    n_parts = 0
    for r in range(runs):
        run_id = f"run-{r:03d}"
        for s0 in range(0, steps, steps_per_part):
            step = np.repeat(np.arange(s0, min(s0 + steps_per_part, steps)), len(names))
            name = np.tile(names, len(step) // len(names))
            data = pa.table(
                {
                    "row_id": [make_row_id(run_id, int(s), n) for s, n in zip(step, name, strict=True)],
                    "run_id": [run_id] * len(step),
                    "step": step.astype("int64"),
                    "name": name,
                    "value": rng.random(len(step)) * 3.0,
                    "time": pa.array(
                        [t0 + dt.timedelta(seconds=int(s)) for s in step], type=METRICS_SCHEMA.field("time").type
                    ),
                },
                schema=METRICS_SCHEMA,
            )
            io.write_part("metrics", run_id, data, writer_id="bench", seq=s0 // steps_per_part)
            n_parts += 1
    return n_parts


def measure(make_store, repeats: int) -> dict[str, Any]:
    """Median cold (new store + connection + query) and warm (query again) seconds."""
    cold, warm, rows = [], [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        con = make_store().connect()
        rows = len(con.execute(QUERY).fetchall())
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        con.execute(QUERY).fetchall()
        warm.append(time.perf_counter() - t)
        con.close()
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm), "result_rows": rows,
            "cold_all": [round(x, 3) for x in cold], "warm_all": [round(x, 3) for x in warm]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--metrics", type=int, default=10)
    p.add_argument("--steps-per-part", type=int, default=100, help="steps per part as written (default 100)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--targets", default="local,s3", help="comma list of local, s3")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop SeaweedFS

    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    results: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="pt-bench-"))
    server = None
    try:
        roots: dict[str, tuple[str, dict[str, Any] | None]] = {}
        if "local" in targets:
            roots["local"] = (str(work / "local"), None)
        if "s3" in targets:
            from tests.s3_fixtures import SeaweedS3

            server = SeaweedS3(work / "seaweedfs").start()
            bucket = server.make_bucket("bench")
            roots["s3"] = (f"s3://{bucket}/store", server.storage_options())
        for target, (root, opts) in roots.items():
            for layout, per_part in (("as written", args.steps_per_part), ("compacted", args.steps)):
                lroot = f"{root}/{layout.replace(' ', '-')}"
                io = ParquetStore(lroot, "training", storage_options=opts)
                t = time.perf_counter()
                n_parts = write_dataset(io, args.runs, args.steps, args.metrics, per_part)
                write_s = time.perf_counter() - t

                def make_store(lroot=lroot, opts=opts):
                    fresh = None if opts is None else dict(opts, skip_instance_cache=True)
                    return ParquetStore(lroot, "training", storage_options=fresh)

                m = measure(make_store, args.repeats)
                m.update(target=target, layout=layout, parts=n_parts, write_s=round(write_s, 2),
                         rows=args.runs * args.steps * args.metrics)
                results.append(m)
                print(f"{target:5s} {layout:10s} parts={n_parts:5d} write={write_s:6.2f}s "
                      f"cold={m['cold_s']:.3f}s warm={m['warm_s']:.3f}s rows={m['result_rows']}", flush=True)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
