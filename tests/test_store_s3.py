"""The three stores on a real S3 server (SeaweedFS on 127.0.0.1, credentials enforced): round trips
read back with a plain DuckDB + s3fs connection, compaction, ``prefect-tinker sql --store s3://...``,
the part cache, a missing bucket, and how DuckDB is attached to the store's filesystem.

Credentials: tests/test_store_s3_credentials.py; outages, killed writers and retries:
tests/test_store_s3_faults.py."""

from __future__ import annotations

import json
import uuid

import duckdb
import pytest
import s3fs

from prefect_tinker.cli import main as cli
from tests.s3_fixtures import raw_rows
from tinker_blocks import CaptureStore, EvalStore, StoreAccessError, TrainingStore
from tinker_blocks.store_io import STORES, ParquetStore


def test_roundtrip_three_stores_from_env(s3_server, s3_root):
    """No block: s3:// honours AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL."""
    train, evals, caps = TrainingStore(root=s3_root), EvalStore(root=s3_root), CaptureStore(root=s3_root)
    train.check()
    assert train.query("SELECT count(*) AS n FROM metrics") == [{"n": 0}]
    with train.writer("metrics", flush_rows=5) as w:
        for step in range(12):
            w.write(run_id="r1", step=step, name="train/loss", value=1.0 / (step + 1))
    train.record_run("r1", status="completed", base_model="tiny", backend="local", lora_rank=4,
                     config={"learning_rate": 1e-3})
    train.record_checkpoint("r1", step=10, name="step-10", kind="state", path="tinker://m/weights/step-10")
    evals.record_result("r1", eval_name="gsm8k", metric="accuracy", value=0.25, step=10,
                        checkpoint="tinker://m/sampler_weights/step-10", num_samples=8)
    evals.write_rows("eval_samples", [
        {"run_id": "r1", "eval_name": "gsm8k", "example_id": str(i), "sample_index": 0, "step": 10,
         "prompt": "1+1=", "completion": "2", "reference": "2", "score": 1.0, "correct": True,
         "completion_tokens": 1} for i in range(3)])
    caps.write_rows("captures", [{
        "run_id": "cap-1", "request_id": "req-1", "sequence_index": 0, "client": "pytest",
        "endpoint": "chat.completions", "model": "tiny", "checkpoint": "tiny",
        "prompt": [{"role": "user", "content": "hi"}], "completion": "hello",
        "prompt_tokens": 3, "completion_tokens": 2, "completion_token_ids": [11, 12],
        "logprob_sum": -1.5, "logprob_mean": -0.75, "logprob_min": -1.0, "stop_reason": "stop",
        "latency_ms": 12.5}])

    # the block API
    assert [p.split("/")[-3:-1] for p in train.parquet_store().list_parts("metrics")] == [["metrics", "run_id=r1"]] * 3
    assert len(train.metrics_frame("r1")) == 12
    assert train.last_checkpoint("r1")["path"] == "tinker://m/weights/step-10"
    assert train.get_run("r1")["status"] == "completed"
    best = evals.query("SELECT value FROM eval_results WHERE eval_name='gsm8k' AND step=10")
    assert best == [{"value": 0.25}]
    cap = caps.query("SELECT completion, completion_token_ids, latency_ms, prompt FROM captures")[0]
    assert cap["completion_token_ids"] == [11, 12] and cap["latency_ms"] == 12.5
    assert json.loads(cap["prompt"]) == [{"content": "hi", "role": "user"}]

    # a plain DuckDB + s3fs connection reads the parts with the documented schemas
    written = {"training": ["metrics", "runs", "checkpoints"], "eval": ["eval_results", "eval_samples"],
               "capture": ["captures"]}
    for store, tables in written.items():
        for table in tables:
            rows = raw_rows(s3_server, s3_root, store, table)
            assert rows and sorted(rows[0]) == sorted(STORES[store][table].schema.names), (store, table)
    metrics = raw_rows(s3_server, s3_root, "training", "metrics")
    assert sorted(r["step"] for r in metrics) == list(range(12))

    # compaction on S3 keeps the view identical and leaves one part
    before = train.query("SELECT step, value FROM metrics ORDER BY step")
    assert train.compact("r1", "metrics") is not None
    assert len(train.parquet_store().list_parts("metrics", "r1")) == 1
    assert train.query("SELECT step, value FROM metrics ORDER BY step") == before


def test_sql_cli_over_s3(s3_server, s3_root, capsys):
    store = TrainingStore(root=s3_root)
    with store.writer("metrics") as w:
        for step in range(4):
            w.write(run_id="a", step=step, name="train/loss", value=float(step))
    EvalStore(root=s3_root).record_result("a", eval_name="heldout", metric="nll", value=1.5, step=3)
    rc = cli.main(["sql", "--store", s3_root, "--json",
                   "SELECT m.step, m.value, e.value AS nll FROM metrics m "
                   "LEFT JOIN eval_results e USING (run_id, step) ORDER BY m.step"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[3]["nll"] == 1.5
    assert cli.main(["sql", "--store", s3_root, "SELECT count(*) AS n FROM captures"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(1 row)"


def test_part_cache_one_get_per_part_and_warm_queries_free(s3_server, s3_root):
    from tinker_blocks.part_cache import PartCacheFS

    io = ParquetStore(s3_root, "training")
    for part in range(4):
        with io.writer("metrics") as w:
            for step in range(part * 10, part * 10 + 10):
                w.write(run_id=f"r{part % 2}", step=step, name="loss", value=float(step))
    con = duckdb.connect()
    assert io.attach(con) in ("fsspec", "httpfs")
    io.create_views(con)
    q = "SELECT run_id, count(*), sum(value) FROM metrics GROUP BY ALL ORDER BY 1"
    assert con.execute(q).fetchall() == [("r0", 20, float(sum(range(0, 10)) + sum(range(20, 30)))),
                                         ("r1", 20, float(sum(range(10, 20)) + sum(range(30, 40))))]
    cache = PartCacheFS(io.fs)
    con2 = duckdb.connect()
    con2.register_filesystem(cache)
    io.create_views(con2)
    con2.execute(q).fetchall()
    assert cache.fetches == 4  # one GET per part, although DuckDB opens each twice
    con2.execute(q).fetchall()
    assert cache.fetches == 4  # the parts are immutable: a repeated query reads no byte again


def test_missing_bucket_created_on_first_write_or_refused(s3_server, s3_root):
    bucket = f"fresh{uuid.uuid4().hex[:10]}"
    with pytest.raises(StoreAccessError, match=f"bucket '{bucket}' does not exist"):
        TrainingStore(root=f"s3://{bucket}/x").parquet_store().check_access(create_bucket=False)
    store = TrainingStore(root=f"s3://{bucket}/x")
    assert store.query("SELECT count(*) AS n FROM runs") == [{"n": 0}]  # no bucket: empty views
    store.record_run("r", status="running")  # NoSuchBucket -> created, then written
    assert store.get_run("r")["status"] == "running"


def test_httpfs_fallback_and_local_check(tmp_path):
    from tinker_blocks.s3 import attach_filesystem

    con = duckdb.connect()
    fs = s3fs.S3FileSystem(key="k", secret="s", endpoint_url="http://127.0.0.1:9")
    opts = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}
    assert attach_filesystem(con, fs, "s3://b/p", opts, mode="off") == "fsspec"
    assert attach_filesystem(duckdb.connect(), fs, "s3://b/p", opts) in ("httpfs", "fsspec")
    TrainingStore(root=str(tmp_path / "ok")).check()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreAccessError, match="not a writable folder"):
        TrainingStore(root=str(tmp_path / "file")).check()
