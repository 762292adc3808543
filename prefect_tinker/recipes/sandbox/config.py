"""What one sandboxed execution may use and what it did: the limits (:class:`SandboxConfig`), the
result (:class:`SandboxResult`) and the error of a sandbox that cannot run (:class:`SandboxUnavailable`).

Shared by the process isolation (:mod:`.isolation`) and the execution (:mod:`.core`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SANDBOX_DIR", "SandboxConfig", "SandboxResult", "SandboxUnavailable"]

MiB = 1 << 20
SANDBOX_DIR = "/sandbox"  # the program's folder inside: the only writable place


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no ``bwrap``, namespaces refused, no usable interpreter, or a
    failed launch).  The message says what failed and how to fix it; nothing was run."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed execution (all per execution; memory and file sizes in bytes).

    ``memory_bytes`` bounds each process's address space (``RLIMIT_AS``), so the sandbox's total is
    at most ``max_processes * memory_bytes``; ``max_processes`` counts threads too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(10.0, gt=0, le=3600, description="wall-clock limit, seconds")
    cpu_s: float | None = Field(None, gt=0, le=3600, description="CPU-time limit, seconds (default: timeout_s)")
    memory_bytes: int = Field(512 * MiB, ge=32 * MiB, description="address space per process (RLIMIT_AS)")
    max_processes: int = Field(
        8, ge=2, le=4096, description="processes and threads, the sandbox's PID 1 included (RLIMIT_NPROC)"
    )
    max_file_bytes: int = Field(16 * MiB, ge=0, description="largest file it may write (RLIMIT_FSIZE)")
    disk_bytes: int = Field(64 * MiB, ge=MiB, description="size of the writable /sandbox tmpfs")
    max_open_files: int = Field(64, ge=8, le=65536, description="RLIMIT_NOFILE")
    max_output_bytes: int = Field(64 * 1024, ge=0, description="kept per stream; more output kills the run")
    python: str | None = Field(
        None, description="interpreter path (default: this Python's base interpreter, else /usr/bin/python3)"
    )
    extra_ro_paths: tuple[str, ...] = Field((), description="more host paths to bind read-only at the same place")

    @property
    def cpu_limit_s(self) -> int:
        """The CPU-time limit in whole seconds (``cpu_s``, else ``timeout_s``, rounded up, at least 1):
        the soft ``RLIMIT_CPU`` (the hard one is a second more)."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))


class SandboxResult(BaseModel):
    """What one execution did.

    Attributes:
        exit_code: the program's exit status; ``128 + N`` when signal N ended it (shell convention).
        signal: name of that signal (``"SIGKILL"``, ``"SIGXCPU"``, ...) or None.
        stdout, stderr: the first ``max_output_bytes`` of each stream, UTF-8 (invalid bytes replaced).
        timed_out: the wall-time limit was reached (the tree was killed).
        killed: the run was ended by a signal: by the host (timeout, output limit) or the kernel.
        reason: ``ok``, ``error`` (non-zero exit), ``wall_timeout``, ``cpu_limit``, ``memory_limit``,
            ``process_limit``, ``file_size_limit``, ``disk_limit``, ``output_limit`` or ``signal``.
            The ``*_limit`` reasons of a program that exited by itself are read from its last stderr
            line (``MemoryError``, errno 11/27/28), so they describe, they do not prove.
        detail: one human-readable line (the limit hit, or the program's last stderr line).
        stdout_truncated, stderr_truncated: output beyond ``max_output_bytes`` was dropped.
        wall_s: wall time of the whole execution, seconds.
        uid: host uid the sandbox ran as.
    """

    exit_code: int
    signal: str | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    killed: bool = False
    reason: str = "ok"
    detail: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    uid: int = -1

    @property
    def passed(self) -> bool:
        """True when the program exited with status 0 on its own."""
        return self.exit_code == 0 and not self.killed and not self.timed_out
