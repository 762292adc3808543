"""Facts about processes of this machine (no Prefect import): liveness, start times, and which
processes can see each other's pids.

Used by the server launcher (:mod:`tinker_local.launcher`), the leases (:mod:`tinker_blocks.lease`:
a lease of a dead process of this machine is stale at once), the temporaries
(:mod:`tinker_blocks.atomic`) and the embedded server watch (:mod:`tinker_blocks.server_watch`).
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["host_key", "host_slug", "pid_alive", "pid_start_ticks"]


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
