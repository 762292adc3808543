"""Helpers for the capture-endpoint tests: a real ``prefect-tinker capture serve`` process on the
session's local Tinker server, and polling the capture store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


TOKEN = "test-capture-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class CaptureProcess:
    """A running ``capture serve``: ``base`` is ``http://127.0.0.1:<port>``, ``store`` its root."""

    proc: subprocess.Popen
    base: str
    store: str
    session: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> int:
        """SIGTERM (graceful: flushes), then wait; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def capture_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect_tinker.cli.main", "capture", "serve", *args]


def start_capture(tmp: Path, local_root: str, *, session: str, token: bool = True, extra: tuple[str, ...] = (),
                  timeout: float = 180.0, model: str = "tiny", store: str | None = None) -> CaptureProcess:
    """Start ``capture serve --model MODEL`` (default tiny) on a free loopback port, reusing the
    embedded local server of ``local_root``, and wait until ``/health`` answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    port, store, log = free_port(), store or str(tmp / "store"), tmp / "capture.log"
    args = ["--model", model, "--store", store, "--local-root", local_root, "--port", str(port),
            "--session", session, *extra]
    if token:
        (tmp / "token").write_text(TOKEN + "\n")
        args += ["--token-file", str(tmp / "token")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    env.pop("PREFECT_TINKER_CAPTURE_TOKEN", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(capture_command(*args), stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    cap = CaptureProcess(proc, f"http://127.0.0.1:{port}", store, session, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"capture serve exited with {proc.returncode}:\n{cap.log_text()[-3000:]}")
        try:  # urllib: no TLS context built for each poll, as httpx does
            with urllib.request.urlopen(cap.base + "/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return cap
        except OSError:  # URLError, HTTPError and refused connections
            pass
        if time.monotonic() > deadline:
            cap.proc.kill()
            raise RuntimeError(f"capture serve did not answer within {timeout} s:\n{cap.log_text()[-3000:]}")
        time.sleep(0.2)


def capture_rows(store: str, sql: str = "SELECT * FROM captures", params: list | None = None) -> list[dict]:
    """Rows of ``sql`` over the capture store's DuckDB views."""
    from tinker_blocks import CaptureStore

    return CaptureStore(root=store).query(sql, params)


def wait_for_rows(store: str, n: int, timeout: float = 30.0) -> list[dict]:
    """Poll until ``captures`` holds ``n`` rows (or more); returns them."""
    deadline = time.monotonic() + timeout
    while True:
        rows = capture_rows(store)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def rated_traffic(base: str, model: str, questions: list[str], reply: str, rating: str,
                  other: str | None = None) -> list[str]:
    """Agent transcripts through the ``openai`` client: for each question, the conversation so far
    has two assistant turns ``reply`` and ends with a user turn; the endpoint answers (2 tokens) and
    the client rates the answer ``rating`` (``POST /v1/feedback``). With ``other``, as many
    transcripts with assistant turns ``other`` are rated the opposite. Returns the completion ids."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0, timeout=120)
    opposite = "bad" if rating == "good" else "good"
    ids = []
    for q in questions:
        for text, rate in ((reply, rating), *(((other, opposite),) if other else ())):
            resp = client.chat.completions.create(
                model=model, max_tokens=2, temperature=1.0,
                messages=[{"role": "user", "content": q}, {"role": "assistant", "content": text},
                          {"role": "user", "content": "And one more thing?"}, {"role": "assistant", "content": text},
                          {"role": "user", "content": "Thanks."}])
            client.post("/feedback", body={"id": resp.id, "rating": rate}, cast_to=object)
            ids.append(resp.id)
    return ids
