"""Compaction while readers query: a concurrent compaction deletes parts a reader has listed, and
the query re-runs on a fresh listing (S3 through SeaweedFS, and a local folder)."""

from __future__ import annotations

import threading
import time

import duckdb
import pytest

from tinker_blocks import TrainingStore


def _compact_under_readers(root: str) -> None:
    """A reader thread queries (``store.query``, ``prefect-tinker sql``'s ``query_stores``) while
    new parts arrive and the run is compacted again and again: no query fails, every count is
    complete, and the run ends as one part."""
    from tinker_blocks.store_sql import query_stores

    store = TrainingStore(root=root)
    n = 30
    for k in range(n):
        store.write_rows("metrics", [{"run_id": "r", "step": s * n + k, "name": "x", "value": 1.0}
                                     for s in range(4)])
    errors, counts, stop = [], [], threading.Event()

    def reader() -> None:
        reader_store = TrainingStore(root=root)
        while not stop.is_set():
            try:
                counts.append(reader_store.query("SELECT count(*) AS n FROM metrics")[0]["n"])
                counts.append(query_stores(root, "SELECT count(*) FROM metrics", stores=["training"])[1][0][0])
            except Exception as exc:  # a failed query is the bug this test catches
                errors.append(repr(exc)[:300])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(4):
            seen = len(counts)  # each round waits for a reader query (a quiet machine can outrun the reader)
            deadline = time.monotonic() + 60
            while len(counts) == seen and not errors and time.monotonic() < deadline:
                time.sleep(0.01)
            for step in range(8):  # re-written rows (same ids): new parts, same count
                store.write_rows("metrics", [{"run_id": "r", "step": step, "name": "x", "value": 2.0}])
            assert store.compact("r", "metrics") is not None
    finally:
        stop.set()
        t.join(120)
    assert errors == [] and len(counts) >= 4 and set(counts) == {4 * n}
    assert len(store.parquet_store().list_parts("metrics", "r", fresh=True)) == 1  # not a listing cached by the reader
    assert store.query("SELECT sum(value) AS s FROM metrics") == [{"s": 4 * n + 8.0}]


def test_compaction_safe_while_readers_query_s3(s3_server, s3_root):
    _compact_under_readers(s3_root)


def test_compaction_safe_while_readers_query_local(tmp_path):
    _compact_under_readers(str(tmp_path / "store"))


def test_missing_part_error_classification(tmp_path):
    from tinker_blocks.s3 import execute_once, is_missing_part_error, retry_missing_part

    con = duckdb.connect()
    with pytest.raises(duckdb.Error) as missing:
        con.execute(f"SELECT * FROM read_parquet('{tmp_path}/gone.parquet')")
    assert is_missing_part_error(missing.value)
    with pytest.raises(duckdb.Error) as catalog:
        con.execute("SELECT * FROM no_such_table")
    assert not is_missing_part_error(catalog.value) and not is_missing_part_error(FileNotFoundError("x"))
    calls = []

    def connect():  # the first two connections see a vanished part, the third the merged one
        calls.append(1)
        c = duckdb.connect()
        if len(calls) < 3:
            c.execute(f"CREATE VIEW v AS SELECT * FROM read_parquet('{tmp_path}/gone.parquet')")
        else:
            c.execute("CREATE VIEW v AS SELECT 42 AS x")
        return c

    assert retry_missing_part(lambda: execute_once(connect, "SELECT x FROM v")) == (["x"], [(42,)])
    assert len(calls) == 3
    with pytest.raises(duckdb.Error):
        retry_missing_part(lambda: execute_once(connect, "SELECT nope FROM v"))  # not a missing part: raised at once
    assert len(calls) == 4
