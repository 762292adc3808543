"""Stores on a real S3 server (SeaweedFS on 127.0.0.1, credentials enforced): round trips of the
three stores, credentials from a block and from the AWS environment, wrong credentials, the server
stopped mid-run, a writer killed mid-flush, and ``prefect-tinker sql --store s3://...``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlparse

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs

from prefect_tinker.cli import main as cli
from tests.s3_fixtures import SeaweedS3
from tests.threads import Helper
from tinker_blocks import (
    CaptureStore,
    EvalStore,
    S3Credentials,
    StoreAccessError,
    TrainingStore,
)
from tinker_blocks.store_io import STORES, ParquetStore


def plain_s3fs(server: SeaweedS3) -> s3fs.S3FileSystem:
    """An s3fs client configured by hand (no project code), as an outside reader would."""
    return s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key,
                             endpoint_url=server.endpoint_url)


def raw_rows(server: SeaweedS3, root: str, store: str, table: str) -> list[dict]:
    """Rows of every part, read with a plain DuckDB + s3fs connection (no views, no dedup)."""
    con = duckdb.connect()
    con.register_filesystem(plain_s3fs(server))
    cur = con.execute(
        f"SELECT * FROM read_parquet('{root}/{store}/{table}/run_id=*/*.parquet', hive_partitioning=true)")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


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


def test_credentials_block_without_env(s3_server, s3_root, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)
    creds = S3Credentials(aws_access_key_id=s3_server.access_key,
                          aws_secret_access_key=s3_server.secret_key,
                          endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    store = TrainingStore(root=s3_root, credentials=creds)
    store.check()
    store.record_run("r2", status="running")
    assert store.get_run("r2")["status"] == "running"
    assert s3_server.secret_key not in repr(store) and "**********" in repr(store)


def test_wrong_credentials_fail_fast_and_clearly(s3_server, s3_root, monkeypatch, capsys):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = TrainingStore(root=s3_root)
    t0 = time.monotonic()
    with pytest.raises(StoreAccessError) as err:
        store.check()
    msg = str(err.value)
    assert s3_root in msg and s3_server.endpoint_url in msg and "credentials" in msg
    assert "not-the-secret" not in msg
    with pytest.raises(StoreAccessError):
        store.record_run("r1", status="running")
    with pytest.raises(StoreAccessError):
        store.last_checkpoint("r1")
    assert time.monotonic() - t0 < 10  # no retry loop on a refusal
    assert cli.main(["sql", "--store", s3_root, "SELECT count(*) FROM metrics"]) == 1
    assert "access denied" in capsys.readouterr().err


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


def outage_seen(caplog, timeout: float) -> bool:
    """Wait until a store said it is not answering (its first failed write may take a few seconds:
    a request in flight when the server died); False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("is not answering" in r.getMessage() for r in list(caplog.records)):
            return True
        time.sleep(0.05)
    return False


def test_server_stopped_mid_run_exactly_once(tmp_path, caplog):
    """The S3 server dies mid-run and comes back: writes retry, the run finishes, the raw parts
    hold every row exactly once, and two lines say so: one when the outage starts, one when the
    store answers again."""
    server = SeaweedS3(tmp_path / "sw").start()
    try:
        bucket = server.make_bucket()
        root = f"s3://{bucket}/faults"
        io = ParquetStore(root, "training", storage_options=server.storage_options(), retry_seconds=60,
                          retry_max_wait=0.5)
        n_steps = 400
        progress = threading.Event()

        def run() -> None:
            with io.writer("metrics", flush_rows=20) as w:
                for step in range(n_steps):
                    for name in ("train/loss", "lr"):
                        w.write(run_id="fault", step=step, name=name, value=float(step))
                    if step == 60:
                        progress.set()
                    time.sleep(0.005)

        with caplog.at_level("WARNING"):
            writer = Helper(run, name="writer")  # its failure is raised here at once
            writer.wait_for(progress, timeout=30, what="step 60 written")
            server.kill()
            outage_seen(caplog, 30)  # the writer keeps flushing into a dead port
            time.sleep(1.0)
            server.start()
            writer.join(90)
        said = [r.getMessage() for r in caplog.records]
        where = f"store {root!r} (endpoint {server.endpoint_url})"
        assert len(said) == 2 and said[0].startswith(f"{where} is not answering ("), said
        assert said[1].startswith(f"{where} answers again after ")
        rows = raw_rows(server, root, "training", "metrics")
        keys = [(r["step"], r["name"]) for r in rows]
        assert len(keys) == 2 * n_steps and len(set(keys)) == 2 * n_steps
        con = io.connect()
        assert con.execute("SELECT count(*) FROM metrics").fetchone()[0] == 2 * n_steps
    finally:
        server.stop()


KILLED_WRITER = r"""
import sys, time
from tinker_blocks.store_io import ParquetStore
root, opts = sys.argv[1], __import__("json").loads(sys.argv[2])
io = ParquetStore(root, "training", storage_options=opts or None)
target = io.fs
armed = []  # the first part is written normally; the next write stops half-way
if io.is_local:  # local parts are written with os.write into a temporary (tinker_blocks/atomic.py)
    import os
    import tinker_blocks.atomic as atomic
    real_write = os.write
    class SlowOS:
        def __getattr__(self, name):
            return getattr(os, name)
        def write(self, fd, data):
            if armed:
                real_write(fd, bytes(data[: len(data) // 2]))
                print("MID", flush=True); time.sleep(60)
            return real_write(fd, data)
    atomic.os = SlowOS()
else:
    real_pipe = target.pipe_file
    def pipe(path, data, **kw):
        print("PUT", flush=True)
        return real_pipe(path, data, **kw)
    target.pipe_file = pipe
with io.writer("metrics", flush_rows=30_000) as w:
    w.write(run_id="ok", step=0, name="x", value=1.0)
    w.flush()
    print("FIRST", flush=True)
    armed.append(True)
    for step in range(30_000):
        w.write(run_id="big", step=step, name=f"metric-{step % 7}-" + "x" * 30, value=step * 0.5)
"""


def _kill_mid_flush(root: str, opts: dict, marker: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, root, json.dumps(opts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line.strip())
            if seen[-1] == marker and "FIRST" in seen:
                proc.kill()
                break
        proc.wait(30)
        assert "FIRST" in seen and seen[-1] == marker, (seen, proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_killed_writer_leaves_no_partial_file_local(tmp_path):
    root = str(tmp_path / "store")
    _kill_mid_flush(root, {}, "MID")
    io = ParquetStore(root, "training")
    parts = io.list_parts("metrics")
    assert [p.split("/")[-2] for p in parts] == ["run_id=ok"]  # the half-written part is invisible
    (tmp,) = (tmp_path / "store").rglob("*.parquet.*.tmp")
    assert tmp.parent.name == "run_id=big" and tmp.stat().st_size > 0
    assert io.connect().execute("SELECT count(*) FROM metrics").fetchone()[0] == 1
    # the next writer into that folder removes the dead writer's temporary
    io.write_part("metrics", "big", pa.Table.from_pylist([], schema=io.spec("metrics").schema), writer_id="next", seq=0)
    assert not tmp.exists()


def test_killed_writer_leaves_no_partial_file_s3(s3_server, s3_root):
    opts = s3_server.storage_options()
    _kill_mid_flush(s3_root, opts, "PUT")
    io = ParquetStore(s3_root, "training", storage_options=opts)
    fs = plain_s3fs(s3_server)
    for p in io.list_parts("metrics"):  # whatever is visible is a whole Parquet file
        with fs.open(p, "rb") as f:
            assert pq.ParquetFile(f).metadata.num_rows in (1, 30_000)
    n = io.connect().execute("SELECT count(*) FROM metrics").fetchone()[0]
    assert n in (1, 30_001)


def test_interrupted_put_is_never_visible(s3_server, s3_root):
    """What a writer killed mid-PUT leaves behind: a connection closed after half the body.
    The object must not appear (S3 stores a PUT whole or not at all)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    body = b"PAR1" + b"\0" * 200_000
    bucket, _, prefix = s3_root.removeprefix("s3://").partition("/")
    key = f"{prefix}/training/metrics/run_id=x/part-killed-000000-{uuid.uuid4().hex[:12]}.parquet"
    url = f"{s3_server.endpoint_url}/{bucket}/{key}"
    req = AWSRequest(method="PUT", url=url, headers={
        "Content-Length": str(len(body)), "x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    SigV4Auth(Credentials(s3_server.access_key, s3_server.secret_key), "s3", "us-east-1").add_auth(req)
    u = urlparse(url)
    head = f"PUT {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in req.headers.items() if k.lower() != "host") + "\r\n"
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(head.encode() + body[: len(body) // 2])
        time.sleep(0.2)
    time.sleep(0.3)
    fs = plain_s3fs(s3_server)
    assert not fs.exists(f"{bucket}/{key}")
    assert ParquetStore(s3_root, "training").list_parts("metrics") == []


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


# ----- no server needed ---------------------------------------------------------------------------
def test_storage_options_from_environment():
    from tinker_blocks.s3 import s3_storage_options

    env = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK", "AWS_ENDPOINT_URL": "http://h:1",
           "AWS_DEFAULT_REGION": "eu-west-1", "AWS_SESSION_TOKEN": "T"}
    o = s3_storage_options(env=env)
    assert (o["key"], o["secret"], o["token"], o["endpoint_url"]) == ("AK", "SK", "T", "http://h:1")
    assert o["client_kwargs"] == {"region_name": "eu-west-1"}
    assert o["config_kwargs"]["s3"] == {"addressing_style": "path"}
    o = s3_storage_options(key="K2", secret="S2", env=env)  # explicit values win
    assert (o["key"], o["secret"], o["endpoint_url"]) == ("K2", "S2", "http://h:1")
    o = s3_storage_options(env={"AWS_ENDPOINT_URL_S3": "http://s3only:2", "AWS_ENDPOINT_URL": "http://x"})
    assert o["endpoint_url"] == "http://s3only:2" and "key" not in o  # botocore's chain decides


def test_transient_classification_and_retry():
    from botocore.exceptions import ClientError, EndpointConnectionError

    from tinker_blocks.s3 import StoreUnavailableError, is_transient, retry_call

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert is_transient(client_error(503, "SlowDown")) and is_transient(client_error(500, "InternalError"))
    wrapped = OSError("Service Unavailable")
    wrapped.__cause__ = client_error(503, "ServiceUnavailable")
    assert is_transient(wrapped)
    assert not is_transient(client_error(403, "SignatureDoesNotMatch"))
    assert not is_transient(PermissionError("denied")) and not is_transient(FileNotFoundError("nb"))
    assert not is_transient(client_error(400, "InvalidArgument")) and not is_transient(ValueError())

    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionRefusedError("down")
        return "ok"

    assert retry_call(flaky, what="put", deadline_s=60, sleep=sleeps.append) == "ok"
    assert len(calls) == 4 and len(sleeps) == 3 and sleeps[0] < sleeps[2]
    with pytest.raises(StoreAccessError, match="put: access denied"):
        retry_call(lambda: (_ for _ in ()).throw(client_error(403, "AccessDenied")), what="put",
                   deadline_s=60, sleep=sleeps.append)
    with pytest.raises(StoreUnavailableError) as gave_up:
        retry_call(lambda: (_ for _ in ()).throw(ConnectionResetError("reset")), what="put",
                   deadline_s=0.05, first_wait_s=0.01, sleep=time.sleep, where="store 'gave-up'")
    assert "\n" not in str(gave_up.value)
    from prefect_tinker.tasks.policies import is_transient as task_retries

    # the store retried for its whole window: a task retry would stretch retry_seconds several-fold
    assert not task_retries(gave_up.value) and task_retries(ConnectionRefusedError("down"))
    assert str(gave_up.value).startswith("put: no answer for 0.")
    assert str(gave_up.value).endswith("(retry_seconds = 0.05 s): ConnectionResetError: reset")
    # DuckDB quotes the error of a read through fsspec as text, traceback first
    quoted = duckdb.IOException('Traceback (most recent call last):\n  File "x.py", line 1, in send\n'
                                'EndpointConnectionError: Could not connect to the endpoint URL: "http://h:1/b"\n')
    assert is_transient(quoted) and not is_transient(duckdb.IOException("No files found that match the pattern"))


def test_an_outage_is_said_once_when_it_starts_and_once_when_it_ends(caplog):
    """Three threads write to one store while it does not answer (0.4 s): however many retries,
    one warning when the outage starts and one line when the store answers again, both naming
    the store; each retry goes to the debug log."""
    from tinker_blocks.s3 import retry_call

    up = threading.Event()
    where = "store 's3://bucket/said-once' (endpoint http://127.0.0.1:1)"

    def put() -> str:
        if not up.is_set():
            raise ConnectionRefusedError("Connection refused")
        return "ok"

    results: list[str] = []
    with caplog.at_level("DEBUG", logger="tinker_blocks.s3"):
        threads = [threading.Thread(target=lambda k=k: results.append(retry_call(
            put, what=f"writing part {k} ({where})", deadline_s=30, first_wait_s=0.02, max_wait_s=0.05,
            where=where))) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.4)
        up.set()
        for t in threads:
            t.join()
    assert results == ["ok"] * 3
    said = [r for r in caplog.records if r.name == "tinker_blocks.s3" and r.levelname != "DEBUG"]
    retries = [r for r in caplog.records if r.name == "tinker_blocks.s3" and r.levelname == "DEBUG"]
    assert [r.levelname for r in said] == ["WARNING", "WARNING"], [r.getMessage() for r in said]
    assert said[0].getMessage() == (
        f"{where} is not answering (ConnectionRefusedError: Connection refused); its writes, reads and lease "
        "renewals retry for up to 30 s (retry_seconds); one line follows when it answers again")
    assert said[1].getMessage().startswith(f"{where} answers again after 0.")
    assert len(retries) >= 10  # 3 threads x ~8 retries each in 0.4 s, none of them said


def test_the_outage_window_is_one_setting(monkeypatch):
    """``retry_seconds`` of the store blocks (and of ``ParquetStore``) defaults to
    ``$PREFECT_TINKER_STORE_RETRY_SECONDS``, else 300; a bad value is one line naming it."""
    from tinker_blocks.store_io import StoreError

    assert TrainingStore(root="s3://b/p").retry_seconds == 300
    monkeypatch.setenv("PREFECT_TINKER_STORE_RETRY_SECONDS", "45")
    assert TrainingStore(root="s3://b/p").retry_seconds == 45
    assert ParquetStore("s3://b/p", "eval").retry_seconds == 45
    assert TrainingStore(root="s3://b/p", retry_seconds=7).parquet_store().retry_seconds == 7
    monkeypatch.setenv("PREFECT_TINKER_STORE_RETRY_SECONDS", "soon")
    with pytest.raises(StoreError, match="^PREFECT_TINKER_STORE_RETRY_SECONDS='soon': give a positive number"):
        ParquetStore("s3://b/p", "eval")


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


def test_missing_bucket_created_on_first_write_or_refused(s3_server, s3_root):
    bucket = f"fresh{uuid.uuid4().hex[:10]}"
    with pytest.raises(StoreAccessError, match=f"bucket '{bucket}' does not exist"):
        TrainingStore(root=f"s3://{bucket}/x").parquet_store().check_access(create_bucket=False)
    store = TrainingStore(root=f"s3://{bucket}/x")
    assert store.query("SELECT count(*) AS n FROM runs") == [{"n": 0}]  # no bucket: empty views
    store.record_run("r", status="running")  # NoSuchBucket -> created, then written
    assert store.get_run("r")["status"] == "running"


def test_s3_credentials_from_prefect_aws_blocks():
    """prefect-aws blocks convert without prefect-aws installed (duck-typed)."""
    from types import SimpleNamespace

    from pydantic import SecretStr

    params = SimpleNamespace(endpoint_url="http://127.0.0.1:9000")
    minio = SimpleNamespace(minio_root_user="admin", minio_root_password=SecretStr("pw"),
                            region_name="us-east-1", aws_client_parameters=params)
    c = S3Credentials.from_prefect_aws(minio)
    o = c.storage_options()
    assert (o["key"], o["secret"], o["endpoint_url"]) == ("admin", "pw", "http://127.0.0.1:9000")
    aws = SimpleNamespace(aws_access_key_id="AK", aws_secret_access_key=SecretStr("SK"),
                          aws_session_token=None, profile_name=None, assume_role_arn=None,
                          region_name="eu-west-1", aws_client_parameters=SimpleNamespace(endpoint_url=None))
    c = S3Credentials.from_prefect_aws(aws)
    assert c.aws_access_key_id == "AK" and c.aws_secret_access_key.get_secret_value() == "SK"
    assert c.region_name == "eu-west-1" and c.endpoint_url is None
    with pytest.raises(TypeError, match="AwsCredentials or MinIOCredentials"):
        S3Credentials.from_prefect_aws(object())
