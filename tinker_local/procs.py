"""Processes of this machine (no Prefect import): liveness, start times, which processes can see
each other's pids, and detached servers kept in a record file.

A detached server runs in its own session (it outlives the command that started it), appends its
output to a log file, and is described by a JSON record file (pid, port, URL, command, ...) written
atomically once it answers its health check; an ``flock`` on a lock file next to the record
serialises starts and stops across processes (``file_lock``, ``start_detached``, ``wait_ready``,
``write_record``, ``read_record``, ``terminate``).

Used by the server launcher (:mod:`tinker_local.launcher`), the persistent Prefect server
(:mod:`prefect_tinker.cli.prefect_server`), the leases (:mod:`tinker_blocks.lease`: a lease of a
dead process of this machine is stale at once), the temporaries (:mod:`tinker_blocks.atomic`) and
the embedded server watch (:mod:`tinker_blocks.server_watch`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "file_lock",
    "free_port",
    "host_key",
    "host_slug",
    "log_tail",
    "pid_alive",
    "pid_start_ticks",
    "read_record",
    "start_detached",
    "terminate",
    "wait_ready",
    "write_record",
]


def host_slug() -> str:
    """This machine's host name: ``[A-Za-z0-9_]``, at most 40 characters."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists here (a zombie child of this process is reaped and
    counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def pid_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux ``/proc/<pid>/stat`` field
    22), or None where unknown. With the pid it names one process: a pid reused later by another
    process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ")"
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def host_key() -> str:
    """Who can check this process's pid: ``<host name>/<boot id>/<pid namespace>``. Two processes
    with equal keys run on one kernel boot in one pid namespace, so one can tell whether the
    other is alive; a container with a copied host name has another pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()[:8]
    except OSError:
        boot = "-"
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "-"
    return f"{socket.gethostname()}/{boot}/{ns}"


# -- detached servers ---------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` while the block runs (no-op where fcntl is unavailable)."""
    with open(path, "a+") as fh:  # closing releases the lock
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except ImportError:
            pass
        yield


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object in record file ``path``, or None when there is none or it cannot be read."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write ``record`` as indented JSON to ``path`` atomically (a temporary file renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of log file ``path`` ("(no log)" / "(empty log)" when missing / empty)."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join(tail) or "(empty log)"


def start_detached(cmd: Sequence[str], *, log_path: Path, cwd: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session (it outlives this process and its terminal's signals), in
    folder ``cwd`` with environment ``env`` exactly, stdin closed and stdout and stderr appended to
    ``log_path`` after a line ``=== <local time> starting: <command>``."""
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(cwd),
            env=dict(env),
            start_new_session=True,
        )


def wait_ready(
    proc: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    *,
    what: str,
    url: str,
    log_path: Path,
    timeout: float,
    poll_s: float,
    error: Callable[[str], Exception],
    tail_lines: int,
) -> None:
    """Poll ``ready()`` every ``poll_s`` seconds until it is True.

    Raises:
        ``error(message)``: ``proc`` exited first ("<what> exited with code N before answering
            <url>"), or ``timeout`` seconds passed ("<what> did not answer <url> within T s (stopped
            it)", after :func:`terminate`); the message ends with the last ``tail_lines`` lines of
            ``log_path``.
    """
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise error(
                f"{what} exited with code {proc.returncode} before answering {url}; "
                f"last lines of {log_path}:\n{log_tail(log_path, tail_lines)}"
            )
        if time.monotonic() > deadline:
            terminate(proc.pid, timeout=5.0)
            raise error(
                f"{what} did not answer {url} within {timeout:g} s (stopped it); "
                f"last lines of {log_path}:\n{log_tail(log_path, tail_lines)}"
            )
        time.sleep(poll_s)


def terminate(pid: int, timeout: float) -> None:
    """Stop process ``pid``: SIGTERM, then SIGKILL when it still lives after ``timeout`` seconds;
    returns when it is gone (or 5 s after the SIGKILL)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while pid_alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
