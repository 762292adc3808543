"""Store faults: the S3 server stopped mid-run (every row exactly once, the outage said once when it
starts and once when it ends), a writer killed mid-flush (locally and on S3: no partial part visible),
an interrupted PUT, which errors count as transient and how long they are retried
(``retry_seconds``)."""

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

from tests.s3_fixtures import SeaweedS3, outage_seen, plain_s3fs, raw_rows
from tests.threads import Helper
from tinker_blocks import StoreAccessError, TrainingStore
from tinker_blocks.store_io import ParquetStore


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
