"""One writer per run name: a lease on a run id in the training store (no Prefect import).

A run takes the lease of its run id before it records anything and keeps it alive with a
heartbeat thread; a second run with the same name, while the lease is live, fails at once with
:class:`LeaseHeldError` naming the holder. A lease whose heartbeat stopped (a crashed or killed
run) is *stale* and the next run takes it over, so crash-and-resume needs nobody's help:

- at once when the holder was a process of this machine (same host, kernel boot and pid
  namespace: :func:`tinker_local.procs.host_key`) that no longer exists (pid gone, or reused by
  a process with another start time);
- otherwise ``timeout_s`` seconds after its last heartbeat (default 60 s; heartbeats every
  ``timeout_s / 6``).

The lease object is ``<root>/training/_leases/<run_id>.json``: ``run_id``, ``token`` (unique per
acquisition), ``owner``, ``host``, ``host_key``, ``pid``, ``pid_start``, ``since``, ``heartbeat``
(epoch seconds, the holder's clock), ``timeout_s``. It holds no secret.

Every change (create, heartbeat, takeover, release) is conditional, so two racers never both win
(:mod:`tinker_blocks.lease_storage`: an exclusive hard link and ``flock`` in local folders,
``If-None-Match`` / ``If-Match`` on S3). The holder also reads its lease back after creating it
and refuses a lease whose token is not its own, which catches an S3 server that ignores the
conditions when the racers start more than a request apart (a documented limit there).

Clocks: a lease is judged stale from the holder's heartbeat time against the reader's clock, so
machines sharing a store must agree on the time to well within ``timeout_s``.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tinker_blocks.lease_storage import LeaseConflict, lease_object
from tinker_blocks.s3 import StoreUnavailableError
from tinker_local.procs import host_key, pid_alive, pid_start_ticks

__all__ = [
    "DEFAULT_LEASE_TIMEOUT_S",
    "Lease",
    "LeaseError",
    "LeaseHeldError",
    "LeaseInfo",
    "LeaseLostError",
    "LeaseState",
    "acquire_lease",
    "lease_status",
    "read_lease",
]

log = logging.getLogger(__name__)

#: seconds without a heartbeat after which a lease of another machine is stale
DEFAULT_LEASE_TIMEOUT_S = 60.0
LeaseState = Literal["live", "stale", "none"]


class LeaseError(RuntimeError):
    """Base class of the lease errors."""


class LeaseHeldError(LeaseError):
    """A live lease of another run holds the run id; ``holder`` is its :class:`LeaseInfo`."""

    def __init__(self, message: str, holder: LeaseInfo):
        super().__init__(message)
        self.holder = holder


class LeaseLostError(LeaseError):
    """This run's lease was taken over (its heartbeats had stopped for longer than the timeout,
    e.g. the process was suspended): another run now writes under the run id."""


@dataclass
class LeaseInfo:
    """The content of a lease object (see the module docstring)."""

    run_id: str
    token: str
    owner: str
    host: str
    host_key: str
    pid: int
    pid_start: int | None
    since: float
    heartbeat: float
    timeout_s: float

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseInfo:
        """Parse a lease object; ValueError when it is not one (e.g. a field is missing)."""
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a lease object must be a JSON object")
        values: dict[str, Any] = {k: raw.get(k) for k in cls.__dataclass_fields__}  # checked below
        info = cls(**values)
        try:
            info.pid, info.heartbeat, info.timeout_s = int(info.pid), float(info.heartbeat), float(info.timeout_s)
            info.since = float(info.since if info.since is not None else info.heartbeat)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a lease object: {exc}") from None
        return info

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    def state(self, now: float | None = None) -> LeaseState:
        """``"stale"`` when the holder is a gone process of this machine or its last heartbeat is
        older than ``timeout_s``, else ``"live"``."""
        if self.host_key == host_key():
            if not pid_alive(int(self.pid)):
                return "stale"
            start = pid_start_ticks(int(self.pid))
            if self.pid_start is not None and start is not None and start != self.pid_start:
                return "stale"  # the pid now belongs to another process
        now = time.time() if now is None else now
        return "stale" if now - float(self.heartbeat) > float(self.timeout_s) else "live"

    def describe(self, now: float | None = None) -> str:
        """``owner 'u' on host h (pid 12), since 2026-01-02 10:11:12 UTC, last heartbeat 3 s ago``."""
        now = time.time() if now is None else now
        since = _dt.datetime.fromtimestamp(float(self.since), _dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (
            f"owner {self.owner!r} on host {self.host} (pid {self.pid}), since {since}, "
            f"last heartbeat {max(now - float(self.heartbeat), 0):.0f} s ago"
        )


class Lease:
    """A held lease (returned by :func:`acquire_lease`). Its heartbeat thread renews it every
    ``heartbeat_s`` seconds; when a renewal finds the lease taken over, :attr:`lost` turns True
    and :meth:`check` raises. Use as a context manager or call :meth:`release`."""

    def __init__(self, backend: Any, info: LeaseInfo, version: str, heartbeat_s: float):
        self._backend, self.info, self._version = backend, info, version
        self.heartbeat_s = float(heartbeat_s)
        self.lost = False
        self.released = False
        self.last_renewed = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{info.run_id}", daemon=True)
        self._thread.start()

    @property
    def run_id(self) -> str:
        return self.info.run_id

    @property
    def where(self) -> str:
        """Path or URL of the lease object."""
        return self._backend.where

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.renew()
                failing = False
            except LeaseLostError as exc:
                log.error("%s", exc)
                return
            except Exception as exc:  # keep trying until the lease times out
                # a store outage past its window was said by tinker_blocks.s3 (once): not again here
                quiet = failing or isinstance(exc, StoreUnavailableError)
                (log.debug if quiet else log.warning)(
                    "renewing the lease of run %r at %s failed (%s); trying again every %.0f s",
                    self.run_id,
                    self.where,
                    exc,
                    self.heartbeat_s,
                )
                failing = True

    def renew(self) -> None:
        """Write a new heartbeat now. Raises :class:`LeaseLostError` when the lease was taken over."""
        with self._lock:
            if self.released or self.lost:
                self.check()
                return
            info = LeaseInfo(**{**asdict(self.info), "heartbeat": time.time()})
            try:
                self._version = self._backend.replace(info.to_bytes(), self._version)
            except LeaseConflict:
                self.lost = True
                self.check()
            self.info = info
            self.last_renewed = time.monotonic()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` when another run took the lease over (call it before
        writing a checkpoint)."""
        if self.lost:
            now = _backend_read_info(self._backend)
            who = f"; it is now held by {now.describe()}" if now is not None else ""
            raise LeaseLostError(
                f"the lease of run {self.run_id!r} at {self.where} was taken over "
                f"after its heartbeats stopped for over {self.info.timeout_s:g} s{who}"
            )

    def release(self) -> None:
        """Stop the heartbeats and delete the lease (if still ours). Idempotent; never raises for
        a lease already lost or deleted; store errors are logged."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.heartbeat_s, 5.0))
        with self._lock:
            if self.released:
                return
            self.released = True
            if self.lost:
                return
            try:
                self._backend.delete(self._version)
            except LeaseConflict:
                log.warning("the lease of run %r at %s was no longer ours at release", self.run_id, self.where)
            except Exception as exc:
                log.warning("releasing the lease of run %r at %s failed: %s", self.run_id, self.where, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _backend_read_info(backend: Any) -> LeaseInfo | None:
    got = backend.read()
    if got is None:
        return None
    try:
        return LeaseInfo.from_bytes(got[0])
    except (ValueError, TypeError):
        return None


def _held_error(run_id: str, holder: LeaseInfo, where: str) -> LeaseHeldError:
    return LeaseHeldError(
        f"run name {run_id!r} is in use by another run: its lease {where} is held by {holder.describe()}. "
        f"Wait for that run to end, choose another run_name, or, if it is gone, start again: its lease is "
        f"taken over {holder.timeout_s:g} s after the last heartbeat (at once for a dead process on this machine).",
        holder,
    )


def acquire_lease(
    store: Any,
    run_id: str,
    owner: str | None = None,
    *,
    timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
    heartbeat_s: float | None = None,
    wait_s: float = 0.0,
) -> Lease:
    """Take the lease of ``run_id`` in the training store ``store`` (a store block, a
    :class:`~tinker_blocks.store_io.ParquetStore`, or a root path / ``s3://`` URL).

    Args:
        owner: who holds it, shown to a refused run (default: the user name); no secrets.
        timeout_s: seconds without a heartbeat after which others may take the lease over.
        heartbeat_s: seconds between heartbeats (default ``timeout_s / 6``).
        wait_s: how long to wait for a live lease to be released or go stale before refusing.

    Returns:
        The held :class:`Lease` (its heartbeat thread running).

    Raises:
        LeaseHeldError: a live lease of another run holds the id (the message names owner, host,
            pid, since when and the last heartbeat).
        StoreError: an invalid run id. StoreAccessError / StoreUnavailableError: S3 refused or
            kept failing. OSError: a local folder that cannot be written.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    heartbeat_s = float(heartbeat_s) if heartbeat_s else timeout_s / 6.0
    if not 0 < heartbeat_s < timeout_s:
        raise ValueError(f"heartbeat_s must be in (0, timeout_s={timeout_s:g}), got {heartbeat_s}")
    backend = lease_object(store, run_id)
    deadline = time.monotonic() + max(wait_s, 0.0)
    races = 0
    while races < 100:  # each pass returns, raises, waits for a live lease, or lost a race
        now = time.time()
        info = LeaseInfo(
            run_id=run_id,
            token=uuid.uuid4().hex,
            owner=owner or _user(),
            host=socket.gethostname(),
            host_key=host_key(),
            pid=os.getpid(),
            pid_start=pid_start_ticks(os.getpid()),
            since=now,
            heartbeat=now,
            timeout_s=float(timeout_s),
        )
        current = backend.read()
        try:
            if current is None:
                backend.create(info.to_bytes())
            else:
                try:
                    holder = LeaseInfo.from_bytes(current[0])
                except (ValueError, TypeError):
                    holder = None  # unreadable lease object: take it over
                if holder is not None and holder.state(now) == "live":
                    if time.monotonic() < deadline:
                        time.sleep(min(1.0, heartbeat_s, max(deadline - time.monotonic(), 0.01)))
                        continue
                    raise _held_error(run_id, holder, backend.where)
                backend.replace(info.to_bytes(), current[1])
                if holder is not None:
                    log.warning("took over the stale lease of run %r (%s)", run_id, holder.describe(now))
        except LeaseConflict:
            races += 1
            continue  # changed since it was read: judge it again
        mine = backend.read()  # verify: a server that ignored a condition lets the last writer win
        if mine is None or LeaseInfo.from_bytes(mine[0]).token != info.token:
            holder = _backend_read_info(backend)
            if holder is None:
                races += 1
                continue
            raise _held_error(run_id, holder, backend.where)
        return Lease(backend, info, mine[1], heartbeat_s)
    raise LeaseError(f"could not take the lease {backend.where} of run {run_id!r}: it kept changing under us")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return f"uid {os.getuid()}"


def read_lease(store: Any, run_id: str) -> LeaseInfo | None:
    """The lease object of ``run_id`` (None when there is none or it cannot be parsed)."""
    return _backend_read_info(lease_object(store, run_id))


def lease_status(store: Any, run_id: str) -> LeaseState:
    """``"live"`` (a run holds the id and its heartbeat is recent), ``"stale"`` (its holder is
    gone: see :meth:`LeaseInfo.state`) or ``"none"`` (no lease: never taken, or released)."""
    info = read_lease(store, run_id)
    return "none" if info is None else info.state()
