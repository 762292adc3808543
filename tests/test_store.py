"""Training store: buffered writer, immutable parts, dedup by row id, empty views, helpers; eval and
capture rows validated; the store record tasks (check, compact)."""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tinker_blocks.store_io import (
    METRICS_SCHEMA,
    TRAINING_TABLES,
    ParquetStore,
    StoreError,
    make_row_id,
)
from tinker_blocks import StoreAccessError
from tinker_blocks.stores import CaptureStore, EvalStore, S3Credentials, TrainingStore


def parts(root: Path, table: str) -> list[Path]:
    return sorted((root / "training" / table).glob("run_id=*/*.parquet"))


def count(store: TrainingStore, sql: str) -> int:
    return store.connect().execute(sql).fetchone()[0]


def test_block_fields_and_positional_root(tmp_path):
    a = TrainingStore(str(tmp_path))
    b = TrainingStore(root=str(tmp_path))
    assert a.root == b.root == str(tmp_path)
    assert "root" in TrainingStore.model_fields
    assert TrainingStore.model_fields["root"].description.endswith(".")


def test_views_exist_and_are_empty_without_files(tmp_path):
    store = TrainingStore(root=str(tmp_path / "nothing-here"))
    con = store.connect()
    for table, spec in TRAINING_TABLES.items():
        cols = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()]
        assert cols == spec.schema.names
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 0
    types = dict((r[0], r[1]) for r in con.execute("DESCRIBE metrics").fetchall())
    assert types["step"] == "BIGINT" and types["value"] == "DOUBLE"
    assert types["time"].startswith("TIMESTAMP")
    assert store.last_checkpoint("r") is None
    assert store.get_run("r") is None
    assert len(store.metrics_frame("r")) == 0


def test_writer_buffers_and_flushes_every_n_rows(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    with store.writer("metrics", writer_id="t", flush_rows=4) as w:
        for step in range(3):
            w.write(run_id="r1", step=step, name="loss", value=1.0 / (step + 1))
        assert w.pending == 3 and parts(tmp_path, "metrics") == []
        w.write(run_id="r1", step=3, name="loss", value=0.25)  # 4th row -> flush
        assert w.pending == 0 and len(parts(tmp_path, "metrics")) == 1
        w.write(run_id="r1", step=4, name="loss", value=0.2)
        assert w.pending == 1
    # close flushed the rest
    ps = parts(tmp_path, "metrics")
    assert len(ps) == 2
    assert all(p.name.startswith("part-t-") for p in ps)
    assert pq.read_schema(ps[0]).names == METRICS_SCHEMA.names
    df = store.metrics_frame("r1")
    assert list(df["step"]) == [0, 1, 2, 3, 4]
    assert df["value"].iloc[1] == pytest.approx(0.5)


def test_writer_flushes_after_seconds(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    w = store.writer("metrics", flush_rows=1000, flush_seconds=0.2)
    w.write(run_id="r1", step=0, name="loss", value=1.0)
    assert parts(tmp_path, "metrics") == []
    time.sleep(0.25)
    w.write(run_id="r1", step=1, name="loss", value=1.0)  # arrives after T -> flush
    assert len(parts(tmp_path, "metrics")) == 1 and w.pending == 0
    w.close()
    w.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        w.write(run_id="r1", step=2, name="loss", value=1.0)


def test_close_on_exception_keeps_rows(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    with pytest.raises(RuntimeError):
        with store.writer("metrics") as w:
            w.write(run_id="r1", step=0, name="loss", value=1.0)
            raise RuntimeError("crash")
    assert count(store, "SELECT count(*) FROM metrics") == 1


def test_one_part_per_run_and_layout(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    with store.writer("metrics", writer_id="w1") as w:
        w.write(run_id="a", step=0, name="loss", value=1.0)
        w.write(run_id="b", step=0, name="loss", value=2.0)
    ps = parts(tmp_path, "metrics")
    assert [p.parent.name for p in ps] == ["run_id=a", "run_id=b"]
    assert [p.name.split("-")[:3] for p in ps] == [["part", "w1", "000000"], ["part", "w1", "000001"]]
    rows = store.query("SELECT run_id, value FROM metrics WHERE run_id = 'b'")
    assert rows == [{"run_id": "b", "value": 2.0}]


def test_rewrite_same_metric_dedups_latest_wins(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    with store.writer("metrics") as w:
        for step in range(3):
            w.write(run_id="r1", step=step, name="loss", value=float(step))
    # a re-run (new writer, new parts) rewrites steps 1-2 with new values
    with store.writer("metrics") as w:
        for step in (1, 2):
            w.write(run_id="r1", step=step, name="loss", value=10.0 + step)
    assert len(parts(tmp_path, "metrics")) == 2
    rows = store.query("SELECT step, value FROM metrics ORDER BY step")
    assert rows == [{"step": 0, "value": 0.0}, {"step": 1, "value": 11.0}, {"step": 2, "value": 12.0}]
    assert make_row_id("r1", 1, "loss") == store.query(
        "SELECT row_id FROM metrics WHERE step = 1")[0]["row_id"]
    # same row twice in one buffer: the last write is kept, written once
    with store.writer("metrics") as w:
        w.write(run_id="r1", step=5, name="loss", value=1.0)
        w.write(run_id="r1", step=5, name="loss", value=2.0)
        assert w.pending == 1
    assert store.query("SELECT value FROM metrics WHERE step = 5") == [{"value": 2.0}]


def test_runs_latest_status_and_checkpoints(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    t0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    store.record_run("r1", status="running", base_model="tiny", backend="local", lora_rank=8,
                     config={"lr": 1e-4})
    store.record_run("r1", status="completed", base_model="tiny", backend="local", lora_rank=8)
    run = store.get_run("r1")
    assert run["status"] == "completed" and run["lora_rank"] == 8
    assert count(store, "SELECT count(*) FROM runs") == 1
    with store.writer("checkpoints") as w:
        w.write(run_id="r1", step=10, name="s10", kind="state", path="tinker://m/weights/s10", time=t0)
        w.write(run_id="r1", step=20, name="s20", kind="state", path="tinker://m/weights/s20", time=t0)
        w.write(run_id="r1", step=30, name="s30", kind="sampler", path="tinker://m/sampler_weights/s30")
    last = store.last_checkpoint("r1")
    assert last["step"] == 20 and last["path"] == "tinker://m/weights/s20"
    assert store.last_checkpoint("r1", kind="sampler")["step"] == 30
    assert store.last_checkpoint("other") is None
    with pytest.raises(StoreError, match="kind"):
        store.last_checkpoint("r1", kind="bogus")


def test_bad_rows_raise_clear_errors(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    with store.writer("metrics") as w:
        with pytest.raises(StoreError, match="unknown column.*'lossy'"):
            w.write(run_id="r1", step=0, name="loss", value=1.0, lossy=2)
        with pytest.raises(StoreError, match="'step' is required"):
            w.write(run_id="r1", name="loss", value=1.0)
        with pytest.raises(StoreError, match="column 'step': bad value 'abc'"):
            w.write(run_id="r1", step="abc", name="loss", value=1.0)
        with pytest.raises(StoreError, match="invalid run_id 'a/b'"):
            w.write(run_id="a/b", step=0, name="loss", value=1.0)
    with store.writer("checkpoints") as w:
        with pytest.raises(StoreError, match="'kind': 'weights' not one of"):
            w.write(run_id="r1", step=0, name="x", kind="weights", path="p")
    with pytest.raises(StoreError, match="unknown table 'metric'"):
        store.writer("metric")
    assert parts(tmp_path, "metrics") == [] and parts(tmp_path, "checkpoints") == []


def test_no_partial_file_visible_to_concurrent_reader(tmp_path):
    """Readers polling while a writer flushes many parts only ever see whole Parquet files."""
    io = ParquetStore(str(tmp_path), "training", TRAINING_TABLES)
    stop = threading.Event()
    seen_errors: list[str] = []

    def reader():
        while not stop.is_set():
            for p in io.list_parts("metrics"):
                if not p.endswith(".parquet"):
                    seen_errors.append(f"non-part listed: {p}")
                try:
                    pq.read_metadata(p)
                except FileNotFoundError:
                    pass  # compaction could delete it; not here
                except Exception as exc:  # a truncated file would land here
                    seen_errors.append(repr(exc))

    t = threading.Thread(target=reader)
    t.start()
    try:
        with io.writer("metrics", flush_rows=50) as w:
            for step in range(2000):
                w.write(run_id="r1", step=step, name="loss", value=float(step))
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive() and seen_errors == []
    assert list(tmp_path.rglob("*.tmp")) == []
    con = io.connect()
    assert con.execute("SELECT count(*) FROM metrics").fetchone()[0] == 2000


def test_compact_merges_and_keeps_dedup(tmp_path):
    store = TrainingStore(root=str(tmp_path))
    for rep in range(3):
        with store.writer("metrics") as w:
            for step in range(4):
                w.write(run_id="r1", step=step, name="loss", value=float(rep))
    with store.writer("metrics") as w:
        w.write(run_id="r2", step=0, name="loss", value=5.0)
    assert len(parts(tmp_path, "metrics")) == 4
    before = store.query("SELECT run_id, step, value FROM metrics ORDER BY run_id, step")
    out = store.compact("r1", "metrics")
    assert out is not None and os.path.exists(out)
    assert len(list((tmp_path / "training/metrics/run_id=r1").glob("*.parquet"))) == 1
    assert pq.read_table(out).num_rows == 4
    assert store.query("SELECT run_id, step, value FROM metrics ORDER BY run_id, step") == before
    assert all(r["value"] == 2.0 for r in before if r["run_id"] == "r1")
    assert store.compact("r1", "metrics") is None  # one part: nothing to do


def test_fsspec_remote_root_roundtrip():
    """A non-local fsspec root (memory://, standing in for s3://) goes through single-PUT writes
    and DuckDB's registered filesystem."""
    import uuid

    import fsspec

    root = f"memory://bucket-{uuid.uuid4().hex[:8]}/prefix"
    store = TrainingStore(root=root)
    assert store.connect().execute("SELECT count(*) FROM runs").fetchone()[0] == 0
    for value in (1.0, 2.0):
        with store.writer("metrics") as w:
            w.write(run_id="r1", step=0, name="loss", value=value)
            w.write(run_id="r1", step=1, name="loss", value=value)
    store.record_checkpoint("r1", step=1, name="c1", kind="state", path="tinker://m/weights/c1")
    assert store.query("SELECT step, value FROM metrics ORDER BY step") == [
        {"step": 0, "value": 2.0}, {"step": 1, "value": 2.0}]
    assert store.last_checkpoint("r1")["name"] == "c1"
    assert store.compact("r1", "metrics") is not None
    fs = fsspec.filesystem("memory")
    path = root.removeprefix("memory://")
    assert len(fs.glob(f"/{path}/training/metrics/run_id=r1/*.parquet")) == 1
    assert fs.glob(f"/{path}/**/*.tmp") == []
    assert len(store.metrics_frame("r1")) == 2


def test_block_schema_offline():
    import uuid

    schema = TrainingStore._to_block_schema(block_type_id=uuid.uuid4())
    assert list(schema.fields["properties"]) == ["root", "credentials", "retry_seconds"]
    assert schema.fields["block_schema_references"]["credentials"]["block_type_slug"] == "tinker-s3-credentials"
    assert TrainingStore.get_block_type_slug() == "tinker-training-store"
    assert EvalStore.get_block_type_slug() == "tinker-eval-store"
    assert CaptureStore.get_block_type_slug() == "tinker-capture-store"
    assert "secret" in S3Credentials._to_block_schema(block_type_id=uuid.uuid4()).fields["secret_fields"][0]


def test_eval_and_capture_rows_validated(tmp_path):
    from tinker_blocks import StoreError

    caps = CaptureStore(root=str(tmp_path))
    with pytest.raises(StoreError, match="'completion_token_ids': bad value 'abc'"):
        caps.write_rows("captures", [{"run_id": "c", "request_id": "q", "sequence_index": 0,
                                      "completion_token_ids": "abc"}])
    with pytest.raises(StoreError, match="'request_id' is required"):
        caps.write_rows("captures", [{"run_id": "c", "sequence_index": 0}])
    evals = EvalStore(root=str(tmp_path))
    with pytest.raises(StoreError, match="'correct': bad value 1"):
        evals.write_rows("eval_samples", [{"run_id": "r", "eval_name": "e", "example_id": "1", "correct": 1}])
    # a re-run evaluation replaces its rows (row ids from the natural key, nulls included)
    for value in (0.1, 0.2):
        evals.record_result("r", eval_name="e", metric="acc", value=value)
    assert evals.query("SELECT value, step FROM eval_results") == [{"value": 0.2, "step": None}]
    assert evals.tables == ["eval_results", "eval_samples"] and caps.tables == ["captures", "ratings"]


def test_record_tasks_check_and_compact(tmp_path):
    from prefect_tinker.tasks.records import check_store, compact_run

    root = str(tmp_path / "st")
    check_store.fn(root)
    store = TrainingStore(root=root)
    for step in range(3):
        store.write_rows("metrics", [{"run_id": "r", "step": step, "name": "loss", "value": 1.0}])
    assert compact_run.fn(store, "r") == 1  # a block works as well as a root
    assert len(store.parquet_store().list_parts("metrics", "r")) == 1
    (tmp_path / "f").write_text("")
    with pytest.raises(StoreAccessError):
        check_store.fn(str(tmp_path / "f"))
