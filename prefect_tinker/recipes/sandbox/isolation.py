"""The process isolation of one sandboxed execution: the bubblewrap command line around the program.

Mechanism (bubblewrap, https://github.com/containers/bubblewrap, Debian package ``bubblewrap``):

- ``bwrap`` always runs unprivileged: as a fresh random uid (``UID_BASE`` + random) when this
  process is root, as the calling user otherwise.  It creates new user, PID, network, IPC, UTS and
  (where possible) cgroup namespaces, and forbids further user namespaces (``--disable-userns``).
- The file system is a new empty root: ``/usr`` (and the ``/bin``, ``/lib*`` links of a merged-/usr
  system) and the interpreter's install prefix read-only, a fresh ``/proc`` and a minimal ``/dev``,
  and ``/sandbox``: an empty tmpfs of ``disk_bytes``, the only writable place, holding the program
  and its files (passed in as memory files, :func:`memfd`).  Root and ``/dev`` are remounted
  read-only.  Nothing else of the host (home, ``/etc``, ``/tmp``, the project, other sandboxes)
  exists inside.
- The network namespace has only its own loopback: no route to the host or beyond, including
  servers on the host's 127.0.0.1 and abstract Unix sockets.
- The launcher (:mod:`.launcher`) sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` inside the namespace, then runs the program
  as ``__main__`` with an empty environment (``PATH``, ``HOME=/sandbox``, ``TMPDIR=/sandbox``,
  ``LANG`` only).
- A small host-side parent (:mod:`.reaper`, a child subreaper, dropping to the sandbox's uid when
  started as root) runs ``bwrap`` and reaps every process of the tree, so no zombie is left even
  where the host's PID 1 does not reap.

:func:`prepare_isolation` finds what this host needs (``bwrap``, an interpreter any uid can run)
and raises :class:`~.config.SandboxUnavailable` when something is missing; :meth:`Isolation.command`
is the command line of one execution.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefect_tinker.recipes.sandbox.config import SANDBOX_DIR, SandboxConfig, SandboxUnavailable

__all__ = ["UID_BASE", "UID_SPAN", "Isolation", "memfd", "prepare_isolation"]

UID_BASE = 0x70000000  # per-run uids when started as root: UID_BASE .. UID_BASE + UID_SPAN - 1
UID_SPAN = 1 << 24
_INNER_ID = 1000  # uid/gid the program sees inside
_LAUNCHER = Path(__file__).with_name("launcher.py").read_text()
_REAPER = Path(__file__).with_name("reaper.py").read_text()


@dataclass(frozen=True)
class Isolation:
    """What one execution runs with on this host (see :func:`prepare_isolation`).

    Attributes:
        bwrap: path of the ``bwrap`` executable.
        python: real path of the interpreter run inside.
        ro_trees: host trees (outside ``/usr``) bound read-only for that interpreter.
        uid: host uid the sandbox runs as (a fresh random one when this process is root).
        as_root: this process is root (the reaper then drops to ``uid`` before starting ``bwrap``).
    """

    bwrap: str
    python: str
    ro_trees: tuple[str, ...]
    uid: int
    as_root: bool

    def command(
        self,
        config: SandboxConfig,
        files: Mapping[str, int],
        *,
        status_fd: int,
        report_fd: int,
        lifeline_fd: int,
        main_name: str,
        args: Sequence[str],
    ) -> list[str]:
        """The host command of one execution: the reaper, ``bwrap`` and, inside, the launcher that
        sets the limits and runs ``/sandbox/<main_name> *args``.

        Args:
            config: the limits.
            files: name in ``/sandbox`` -> a readable file descriptor of its content (:func:`memfd`),
                the program included; each must be passed to the child (``pass_fds``).
            status_fd: write end of the pipe for bwrap's ``--json-status-fd`` (``child-pid``, ``exit-code``).
            report_fd: write end of the pipe where the launcher reports a failed launch.
            lifeline_fd: read end of a pipe whose write end only the host holds: the launcher ends
                the sandbox when it reads end-of-file (the host died).
            main_name: the program's file name among ``files``.
            args: its command-line arguments.
        """
        limits = ",".join(f"{name}={soft}:{hard}" for name, soft, hard in _rlimits(config))
        cmd = _bwrap_args(self.bwrap, self.ro_trees, files, status_fd, config) + [
            self.python,
            "-E",
            "-s",
            "-B",
            "-u",
            "-c",
            _LAUNCHER,
            str(report_fd),
            str(lifeline_fd),
            limits,
            main_name,
            *map(str, args),
        ]
        return [
            sys.executable,
            "-I",
            "-S",
            "-c",
            _REAPER,
            str(self.uid) if self.as_root else "-",
            str(os.getpid()),
            *cmd,
        ]


def prepare_isolation(config: SandboxConfig) -> Isolation:
    """Find ``bwrap`` and the interpreter to run inside, and pick the uid of one execution.

    Raises:
        SandboxUnavailable: bubblewrap is not installed, or no interpreter can run inside (none
            executable, or, when this process is root, not readable by an unprivileged uid).
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: apt-get install bubblewrap "
            "(scripts/setup.sh does this on Debian as root)"
        )
    as_root = os.geteuid() == 0
    python, trees = _resolve_python(config, as_root)
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if as_root else os.getuid()
    return Isolation(bwrap=bwrap, python=python, ro_trees=tuple(trees), uid=uid, as_root=as_root)


def memfd(name: str, data: bytes) -> int:
    """A memory file (``memfd_create``) holding ``data``, positioned at its start: how a file
    reaches ``/sandbox`` (``bwrap --file FD PATH``) without touching the host's disk.  The caller
    closes it."""
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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
    cpu = config.cpu_limit_s
    nproc = config.max_processes + 1  # + the launcher's lifeline watcher thread, not the program's
    return [
        ("CPU", cpu, cpu + 1),
        ("AS", config.memory_bytes, config.memory_bytes),
        ("NPROC", nproc, nproc),
        ("FSIZE", config.max_file_bytes, config.max_file_bytes),
        ("NOFILE", config.max_open_files, config.max_open_files),
        ("CORE", 0, 0),
    ]
