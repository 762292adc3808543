"""Run untrusted Python in a sandbox: one bubblewrap process tree per execution.

Mechanism (bubblewrap, https://github.com/containers/bubblewrap, Debian package ``bubblewrap``):

- ``bwrap`` always runs unprivileged: as a fresh random uid (``UID_BASE`` + random) when this
  process is root, as the calling user otherwise.  It creates new user, PID, network, IPC, UTS and
  (where possible) cgroup namespaces, and forbids further user namespaces (``--disable-userns``).
- The file system is a new empty root: ``/usr`` (and the ``/bin``, ``/lib*`` links of a merged-/usr
  system) and the interpreter's install prefix read-only, a fresh ``/proc`` and a minimal ``/dev``,
  and ``/sandbox``: an empty tmpfs of ``disk_bytes``, the only writable place, holding the program.
  Root and ``/dev`` are remounted read-only.  Nothing else of the host (home, ``/etc``, ``/tmp``,
  the project, other sandboxes) exists inside.
- The network namespace has only its own loopback: no route to the host or beyond, including
  servers on the host's 127.0.0.1 and abstract Unix sockets.
- The launcher (:mod:`.launcher`) sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` inside the namespace, then runs the program
  as ``__main__`` with an empty environment (``PATH``, ``HOME=/sandbox``, ``TMPDIR=/sandbox``,
  ``LANG`` only).
- The host enforces the wall time and the output limit (SIGKILL to bwrap: its PID-1 child dies by
  ``--die-with-parent``, and the kernel kills every process of the PID namespace) and captures
  stdout/stderr, keeping the first ``max_output_bytes`` of each.
- Nothing is left behind: the tmpfs and all processes vanish with the namespaces, and a small
  host-side parent (:mod:`.reaper`, a child subreaper) reaps every process of the tree, so no zombie
  is left even where the host's PID 1 does not reap.

When bubblewrap is missing or the kernel refuses the namespaces, :class:`SandboxUnavailable` is
raised; code never runs unsandboxed.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["SANDBOX_DIR", "SandboxConfig", "SandboxResult", "SandboxUnavailable", "run_python", "sandbox_problem"]

MiB = 1 << 20
SANDBOX_DIR = "/sandbox"
UID_BASE = 0x70000000  # per-run uids when started as root: UID_BASE .. UID_BASE + UID_SPAN - 1
UID_SPAN = 1 << 24
_INNER_ID = 1000  # uid/gid the program sees inside
_LAUNCHER = Path(__file__).with_name("launcher.py").read_text()
_REAPER = Path(__file__).with_name("reaper.py").read_text()
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")  # names of files placed in /sandbox


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


class _Capture(threading.Thread):
    """Drains one pipe: keeps the first ``limit`` bytes and the last 4 KiB; calls ``on_overflow`` once."""

    def __init__(self, stream, limit: int, on_overflow) -> None:
        super().__init__(daemon=True)
        self.stream, self.limit, self.on_overflow = stream, limit, on_overflow
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def run(self) -> None:
        fd = self.stream.fileno()
        while chunk := os.read(fd, 65536):
            room = self.limit - len(self.head)
            if room > 0:
                self.head += chunk[:room]
            self.tail = (self.tail + chunk)[-4096:]
            before, self.total = self.total, self.total + len(chunk)
            if self.total > self.limit >= before:
                self.on_overflow()

    @property
    def truncated(self) -> bool:
        return self.total > self.limit


def _others_can_use(path: str) -> bool:
    """Whether any uid may traverse every parent of ``path`` and read it."""
    p = Path(path)
    for parent in p.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(p).st_mode & stat.S_IROTH)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _resolve_python(config: SandboxConfig, as_root: bool) -> tuple[str, list[str]]:
    """The interpreter to run inside and the host trees it needs bound read-only."""
    candidates: list[tuple[str, str | None]]
    if config.python:
        candidates = [(config.python, None)]
    else:
        base = getattr(sys, "_base_executable", None) or sys.executable
        candidates = [(base, sys.base_prefix), ("/usr/bin/python3", None)]
    tried = []
    for exe, prefix in candidates:
        real = os.path.realpath(exe)
        if not (os.path.isfile(real) and os.access(real, os.X_OK)):
            tried.append(f"{exe}: not an executable file")
            continue
        if as_root and not _others_can_use(real):
            tried.append(f"{exe}: not readable by an unprivileged uid (a parent folder lacks o+x)")
            continue
        tree = os.path.realpath(prefix) if prefix else str(Path(real).parent.parent)
        if not _under(real, tree):
            tree = str(Path(real).parent.parent)
        return real, [] if _under(tree, "/usr") else [tree]
    raise SandboxUnavailable(
        "no interpreter usable inside the sandbox: "
        + "; ".join(tried)
        + " (set SandboxConfig.python, or install python3: apt-get install python3)"
    )


def _bwrap_args(
    bwrap: str, ro_trees: Sequence[str], files: Mapping[str, int], status_fd: int, config: SandboxConfig
) -> list[str]:
    args = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(_INNER_ID),
        "--gid",
        str(_INNER_ID),
        "--hostname",
        "sandbox",
        "--json-status-fd",
        str(status_fd),
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        SANDBOX_DIR,
        "--setenv",
        "TMPDIR",
        SANDBOX_DIR,
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/", name)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            args += ["--ro-bind", str(p), str(p)]
    made: set[str] = set()
    for tree in [*ro_trees, *config.extra_ro_paths]:
        tree = os.path.realpath(tree)
        for parent in reversed(Path(tree).parents):
            if str(parent) != "/" and str(parent) not in made and not _under(str(parent), "/usr"):
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", tree, tree]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(config.disk_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        SANDBOX_DIR,
    ]
    for name, fd in files.items():
        args += ["--perms", "0644", "--file", str(fd), f"{SANDBOX_DIR}/{name}"]
    return args + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SANDBOX_DIR]


def _rlimits(config: SandboxConfig) -> list[tuple[str, int, int]]:
    cpu = max(1, math.ceil(config.cpu_s if config.cpu_s is not None else config.timeout_s))
    return [
        ("CPU", cpu, cpu + 1),
        ("AS", config.memory_bytes, config.memory_bytes),
        ("NPROC", config.max_processes, config.max_processes),
        ("FSIZE", config.max_file_bytes, config.max_file_bytes),
        ("NOFILE", config.max_open_files, config.max_open_files),
        ("CORE", 0, 0),
    ]


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _classify(
    exit_code: int,
    sig: int | None,
    *,
    timed_out: bool,
    overflow: bool,
    wall_s: float,
    config: SandboxConfig,
    stderr_tail: str,
) -> tuple[str, str]:
    """(reason, detail) of an execution; see :class:`SandboxResult`."""
    last = _last_line(stderr_tail)
    cpu_limit = max(1, math.ceil(config.cpu_s if config.cpu_s is not None else config.timeout_s))
    if overflow:
        return "output_limit", f"output passed {config.max_output_bytes} bytes on a stream; killed"
    if timed_out:
        return "wall_timeout", f"wall time passed {config.timeout_s:g} s; killed"
    if sig is not None:
        name = signal.Signals(sig).name
        # SIGKILL comes at the hard CPU limit (soft + 1 s) when SIGXCPU is ignored; CPU time can
        # only have reached it if the wall time did (one thread)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and wall_s >= cpu_limit):
            return "cpu_limit", f"CPU time passed {cpu_limit} s ({name})"
        if sig == signal.SIGXFSZ:
            return "file_size_limit", f"a file passed {config.max_file_bytes} bytes ({name})"
        return "signal", f"killed by {name}" + (f": {last}" if last else "")
    if exit_code == 0:
        return "ok", ""
    detail = f"exit code {exit_code}: {last}" if last else f"exit code {exit_code}"
    if last.startswith("MemoryError") or "[Errno 12]" in last:
        return "memory_limit", detail
    if "[Errno 11]" in last or "can't start new thread" in last:
        return "process_limit", detail
    if "[Errno 27]" in last:
        return "file_size_limit", detail
    if "[Errno 28]" in last:
        return "disk_limit", detail
    return "error", detail


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int) -> bytes:
    """What a pipe holds now (non-blocking: a writer that somehow survived cannot stall the host)."""
    os.set_blocking(fd, False)
    out = bytearray()
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except BlockingIOError:
        pass
    return bytes(out)


def _json_docs(raw: bytes) -> dict:
    """Merge the JSON objects bwrap wrote to --json-status-fd (``child-pid``, then ``exit-code``)."""
    text, pos, merged = raw.decode("utf-8", "replace"), 0, {}
    dec = json.JSONDecoder()
    while (pos := len(text) - len(text[pos:].lstrip())) < len(text):
        try:
            doc, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        if isinstance(doc, dict):
            merged.update(doc)
        pos = end
    return merged


def run_python(
    code: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    args: Sequence[str] = (),
    stdin: str | bytes | None = None,
    config: SandboxConfig | None = None,
    main_name: str = "main.py",
) -> SandboxResult:
    """Run ``code`` as ``/sandbox/<main_name>`` (``python -u main_name *args``) in a fresh sandbox.

    Args:
        code: Python source of the program (untrusted).
        files: more files to place in ``/sandbox`` (plain names only, e.g. ``{"data.txt": "..."}``).
        args: command-line arguments of the program.
        stdin: data for its standard input (default: empty).
        config: limits (default :class:`SandboxConfig`).
        main_name: file name of the program inside ``/sandbox``.

    Returns:
        The :class:`SandboxResult`; the program's failures (exceptions, limits, signals) are results.

    Raises:
        SandboxUnavailable: bubblewrap is missing, the namespaces are refused, no interpreter can run
            inside, or the launch failed.  Nothing ran unsandboxed.
        ValueError: a file name is not a plain name.
    """
    config = config or SandboxConfig()
    named = {main_name: code, **(files or {})}
    for name in named:
        if not FILE_NAME_RE.match(name):
            raise ValueError(f"sandbox file name {name!r}: use a plain name of letters, digits, '_', '.', '-'")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: apt-get install bubblewrap "
            "(scripts/setup.sh does this on Debian as root)"
        )
    as_root = os.geteuid() == 0
    python, trees = _resolve_python(config, as_root)
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if as_root else os.getuid()
    fds = {name: _memfd(name, data.encode() if isinstance(data, str) else bytes(data)) for name, data in named.items()}
    status_r, status_w = os.pipe()
    report_r, report_w = os.pipe()
    limits = ",".join(f"{name}={soft}:{hard}" for name, soft, hard in _rlimits(config))
    cmd = _bwrap_args(bwrap, trees, fds, status_w, config) + [
        python,
        "-E",
        "-s",
        "-B",
        "-u",
        "-c",
        _LAUNCHER,
        str(report_w),
        limits,
        main_name,
        *map(str, args),
    ]
    reaper = [sys.executable, "-I", "-S", "-c", _REAPER, str(uid) if as_root else "-", str(os.getpid()), *cmd]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            reaper,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            close_fds=True,
            pass_fds=(*fds.values(), status_w, report_w),
            start_new_session=True,
        )
    except OSError as exc:
        for fd in (*fds.values(), status_r, status_w, report_r, report_w):
            os.close(fd)
        raise SandboxUnavailable(f"cannot start the sandbox: {exc}") from None
    for fd in (*fds.values(), status_w, report_w):
        os.close(fd)
    return _supervise(proc, stdin, config, start, uid, status_r, report_r)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit (a pidfd wakes at once; Popen.wait polls every 50 ms)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if ready:
        proc.wait()
    return bool(ready)


def _supervise(
    proc: subprocess.Popen, stdin, config: SandboxConfig, start: float, uid: int, status_r: int, report_r: int
) -> SandboxResult:
    stdout, stderr, stdin_pipe = proc.stdout, proc.stderr, proc.stdin
    if stdout is None or stderr is None or (stdin is not None and stdin_pipe is None):
        raise TypeError("the sandbox process must be started with pipes for stdout, stderr and the given stdin")
    state = {"overflow": False, "killed_by_host": False}
    lock = threading.Lock()

    def kill(why: str) -> None:
        with lock:
            if not state["killed_by_host"]:
                state["killed_by_host"] = True
                state[why] = True
                try:  # the reaper SIGKILLs bwrap, whose death takes the PID namespace down
                    os.kill(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    out = _Capture(stdout, config.max_output_bytes, lambda: kill("overflow"))
    err = _Capture(stderr, config.max_output_bytes, lambda: kill("overflow"))
    out.start()
    err.start()
    if stdin is not None and stdin_pipe is not None:
        pipe = stdin_pipe
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)

        def feed() -> None:
            try:
                pipe.write(data)
                pipe.close()
            except (BrokenPipeError, OSError):
                pass

        threading.Thread(target=feed, daemon=True).start()
    if not _wait(proc, config.timeout_s + 0.05):  # bwrap's own setup takes a few ms
        timed_out = True
        kill("timeout")
    else:
        timed_out = False
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:  # the reaper did not stop in time: kill its whole process group
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    wall = time.monotonic() - start
    out.join(5)
    err.join(5)
    stdout.close()
    stderr.close()
    status, report = _json_docs(_read_all(status_r)), _read_all(report_r).decode("utf-8", "replace")
    os.close(status_r)
    os.close(report_r)
    stderr_text = bytes(err.head).decode("utf-8", "replace")
    if report:
        raise SandboxUnavailable(f"sandbox launch failed: {report.strip()}")
    if "child-pid" not in status and not state["killed_by_host"]:
        raise SandboxUnavailable(
            f"bubblewrap could not create the sandbox (exit {proc.returncode}): "
            f"{stderr_text.strip()[:500]} -- unprivileged user namespaces must be allowed"
        )
    if "exit-code" in status:
        exit_code = int(status["exit-code"])
    else:  # killed by us before bwrap reported: the tree died by SIGKILL
        exit_code = 128 + signal.SIGKILL if proc.returncode < 0 else proc.returncode
    sig = exit_code - 128 if 128 < exit_code < 128 + signal.NSIG else None
    if sig is not None:
        try:
            signal.Signals(sig)
        except ValueError:
            sig = None
    reason, detail = _classify(
        exit_code,
        sig,
        timed_out=timed_out,
        overflow=state["overflow"],
        wall_s=wall,
        config=config,
        stderr_tail=bytes(err.tail).decode("utf-8", "replace"),
    )
    return SandboxResult(
        exit_code=exit_code,
        signal=signal.Signals(sig).name if sig is not None else None,
        stdout=bytes(out.head).decode("utf-8", "replace"),
        stderr=stderr_text,
        timed_out=timed_out,
        killed=sig is not None or state["killed_by_host"],
        reason=reason,
        detail=detail,
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        wall_s=round(wall, 4),
        uid=uid,
    )


def sandbox_problem(config: SandboxConfig | None = None) -> str | None:
    """None when a trivial program runs in the sandbox here, else why not (for skips and diagnostics)."""
    try:
        result = run_python("print('ok')", config=config or SandboxConfig(timeout_s=30))
    except SandboxUnavailable as exc:
        return str(exc)
    return None if result.passed and result.stdout == "ok\n" else f"trial run failed: {result.detail}"
