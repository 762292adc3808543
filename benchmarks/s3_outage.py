"""An S3 outage in the middle of an SFT run: what the run prints about it and what it leaves in the store.

A SeaweedFS S3 server (the tests' ``SeaweedS3``, on 127.0.0.1) holds the training store; the ``sft``
flow trains ``tiny`` on generated chats through the embedded local server; after step
``--kill-after`` the S3 server is killed (SIGKILL) and started again ``--outage`` seconds later.

- within the window (``--window`` >= the outage, default 300 = the stores' default
  ``retry_seconds``): the run must complete with one ``metrics`` row per (step, name) in the parts
  as written, and print two lines about the store: one when the outage starts, one when it answers
  again;
- past the window (``--window`` < the outage): the run must fail with one line
  (``StoreUnavailableError``, naming the window), and a re-run of the same run name once S3 is back
  must resume after the last checkpoint and end with one row per (step, name) in the views.

    python benchmarks/s3_outage.py                           # a 30 s outage, 300 s window
    python benchmarks/s3_outage.py --outage 30 --window 10   # past the window: fail, then resume

Prints a summary (JSON with ``--json``): steps, the lines that name the store (WARNING and above,
any logger), the rows. The window is set the way a user sets it for flows:
``PREFECT_TINKER_STORE_RETRY_SECONDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
             "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


class _Lines(logging.Handler):
    """Every WARNING+ record of any logger, as (time, logger, message)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.name, record.getMessage()))


def _chats(path: Path, n: int = 96) -> None:
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a + 3}?"},
                          {"role": "assistant", "content": f"{a} plus {a + 3} is {2 * a + 3}."}]} for a in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _raw_metrics(server, root: str, run_id: str) -> list[tuple[int, str]]:
    """(step, name) of every row of every metrics part of the run, read with plain DuckDB + s3fs."""
    import duckdb
    import s3fs

    fs = s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key, endpoint_url=server.endpoint_url,
                           skip_instance_cache=True)
    prefix = f"{root.removeprefix('s3://')}/training/metrics/run_id={run_id}"
    parts = [p for p in fs.find(prefix) if p.endswith(".parquet")]
    con = duckdb.connect()
    con.register_filesystem(fs)
    files = ", ".join(f"'s3://{p}'" for p in parts)
    return [(int(s), str(n)) for s, n in con.execute(f"SELECT step, name FROM read_parquet([{files}])").fetchall()]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-after", type=int, default=5, help="kill S3 after this step")
    p.add_argument("--outage", type=float, default=30.0, help="seconds S3 stays down")
    p.add_argument("--window", type=float, default=300.0, help="PREFECT_TINKER_STORE_RETRY_SECONDS")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="s3-outage-"))
    os.environ["PREFECT_TINKER_HOME"] = str(tmp / "home")
    os.environ["PREFECT_TINKER_STORE_RETRY_SECONDS"] = f"{args.window:g}"
    from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
    from prefect_tinker.flows.sft import SFTConfig, sft_flow
    from tests.s3_fixtures import SeaweedS3
    from tinker_blocks.stores import TrainingStore

    server = SeaweedS3(tmp / "sw").start()
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    out: dict = {"outage_s": args.outage, "window_s": args.window, "steps": args.steps}
    try:
        os.environ.update(server.env())
        root = f"s3://{server.make_bucket()}/outage"
        data = tmp / "chats.jsonl"
        _chats(data)
        down: dict[str, float] = {}
        back = threading.Event()

        class Kill(RunCallbacks):
            def after_step(self, run_id: str, step: int) -> None:
                if step == args.kill_after and "at" not in down:
                    server.kill()
                    down["at"] = time.monotonic()

                    def restart() -> None:
                        time.sleep(args.outage)
                        server.start()
                        down["back"] = time.monotonic()
                        back.set()

                    threading.Thread(target=restart, daemon=True).start()

        config = SFTConfig(model="tiny", dataset=str(data), batch_size=4, learning_rate=2e-3, lora_rank=4,
                           max_steps=args.steps, eval_every=0, save_every=4, run_name="outage", store=root,
                           max_length=64, test_size=0.05, num_eval_samples=0)
        t0 = time.monotonic()
        with run_callbacks(Kill()):
            try:
                summary = sft_flow(config)
                out["first_run"] = {"completed_steps": summary["steps"], "error": None}
            except Exception as exc:
                out["first_run"] = {"completed_steps": None, "error": f"{type(exc).__name__}: {exc}"}
        out["first_run"]["wall_s"] = round(time.monotonic() - t0, 1)
        said = [m for _, _, m in lines.lines if server.endpoint_url in m or root in m]
        out["first_run"]["lines_about_the_store"] = said
        if out["first_run"]["error"] is not None:  # past the window: S3 back, the same run name again
            back.wait(args.outage + 120)
            t1 = time.monotonic()
            summary = sft_flow(config)
            out["rerun"] = {"completed_steps": summary["steps"], "wall_s": round(time.monotonic() - t1, 1)}
        out["outage_measured_s"] = round(down.get("back", float("nan")) - down.get("at", float("nan")), 1)
        raw = _raw_metrics(server, root, "outage")
        out["raw_metric_rows"] = len(raw)
        out["raw_duplicates"] = len(raw) - len(set(raw))
        view = TrainingStore(root=root).query(
            "SELECT step, count(*) AS n FROM metrics WHERE run_id = 'outage' AND name = 'train/loss' GROUP BY step "
            "ORDER BY step")
        out["train_loss_rows_per_step"] = {int(r["step"]): int(r["n"]) for r in view}
    finally:
        logging.getLogger().removeHandler(lines)
        server.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
