"""Run untrusted Python in a sandbox: one bubblewrap process tree per execution.

:func:`run_python` places the program and its files in a fresh sandbox (the isolation: namespaces,
read-only system, an empty tmpfs, rlimits, empty environment; see :mod:`.isolation`), starts it and
supervises it from the host:

- the host enforces the wall time and the output limit (SIGKILL to bwrap: its PID-1 child dies by
  ``--die-with-parent``, and the kernel kills every process of the PID namespace) and captures
  stdout/stderr, keeping the first ``max_output_bytes`` of each;
- nothing is left behind: the tmpfs and all processes vanish with the namespaces, and the reaper
  (:mod:`.reaper`) reaps every process of the tree;
- the outcome is classified (:class:`~.config.SandboxResult` ``reason``: the limit hit, a signal,
  the program's own error).

When bubblewrap is missing or the kernel refuses the namespaces, :class:`~.config.SandboxUnavailable`
is raised; code never runs unsandboxed.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from prefect_tinker.recipes.sandbox.config import SandboxConfig, SandboxResult, SandboxUnavailable
from prefect_tinker.recipes.sandbox.isolation import memfd, prepare_isolation

__all__ = ["run_python", "sandbox_problem"]

FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")  # names of files placed in /sandbox


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
    cpu_limit = config.cpu_limit_s
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
    iso = prepare_isolation(config)
    fds = {name: memfd(name, data.encode() if isinstance(data, str) else bytes(data)) for name, data in named.items()}
    status_r, status_w = os.pipe()
    report_r, report_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()  # the write end stays here (not inheritable): cut when this process dies
    command = iso.command(
        config, fds, status_fd=status_w, report_fd=report_w, lifeline_fd=lifeline_r, main_name=main_name, args=args
    )
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            close_fds=True,
            pass_fds=(*fds.values(), status_w, report_w, lifeline_r),
            start_new_session=True,
        )
    except OSError as exc:
        for fd in (*fds.values(), status_r, status_w, report_r, report_w, lifeline_r, lifeline_w):
            os.close(fd)
        raise SandboxUnavailable(f"cannot start the sandbox: {exc}") from None
    for fd in (*fds.values(), status_w, report_w, lifeline_r):
        os.close(fd)
    try:
        return _supervise(proc, stdin, config, start, iso.uid, status_r, report_r)
    finally:
        os.close(lifeline_w)


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
