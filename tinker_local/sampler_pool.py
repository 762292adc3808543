"""Sampler worker processes: sampling requests served apart from the trainer.

``serve --sampler-workers N`` starts N worker processes (``python -m tinker_local.sampler_pool``,
talking pickled messages over a socket pair: no ``multiprocessing`` start method, so the
parent's main script is never re-run); each builds its own ``tinker_local.engine.Engine`` over
the same root folder, preloads the server's ``--model`` names and then serves
``Engine.sample_many`` calls sent over a pipe.  The trainer's engine keeps training (forward,
forward_backward, optim_step, saves) on the compute thread, so a sampling batch and a training
step run at the same time on different cores.

Weights: a worker samples the base model itself (its own fp32 copy, loaded from the same files
as the trainer's: presets are cached under ``root/"models"``) or a sampler / state checkpoint
whose folder (``root/"checkpoints"/<model>/sampler_weights/<name>/``, written atomically by the
trainer) the request names; the worker loads that adapter file into its own model and keeps the
last ``MAX_SAMPLER_ADAPTERS`` loaded (cache key: path + file mtime), exactly as the in-process
path does.  Requests run through the same ``Engine.sample_many`` code, so seeds, stop
conditions, logprobs, top-k logprobs, prompt logprobs and batching behave the same; with the
same number of torch threads the results are bit-identical to in-process sampling.

Threads: ``split_threads(total, n)`` gives each worker ``max(1, total // (n + 1))`` torch
threads and the trainer the rest (at least 1), so their sum stays within ``total`` whenever
``total > n``.

Failures: a worker that dies (killed, out of memory, crashed) fails the batch it was serving
with ``SamplerWorkerError`` (a server error on the wire, never a hang: a dead worker's end of
the socket closes, which wakes the waiting pool) and is restarted at once; the next request waits for the new
worker to be ready.  A worker that cannot start (e.g. an unknown ``--model``) fails requests with
the same error naming its exit code.  Memory: each worker holds its own copy of every base
model it has sampled.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

logger = logging.getLogger("tinker_local.sampler_pool")

START_TIMEOUT_S = 600.0  # longest wait for a worker to load its models and answer "ready"


class SamplerWorkerError(RuntimeError):
    """A sampler worker process died or could not start; the request fails as a server error."""


def split_threads(total: int, workers: int) -> tuple[int, int]:
    """``(trainer threads, threads per worker)`` for ``total`` torch threads and ``workers``
    sampler workers (0: everything to the trainer).  Each part is at least 1, so with
    ``total <= workers`` the sum exceeds ``total`` (the caller warns)."""
    total, workers = max(1, int(total)), max(0, int(workers))
    if workers == 0:
        return total, 0
    per = max(1, total // (workers + 1))
    return max(1, total - workers * per), per


@dataclass
class _Slot:
    index: int
    proc: subprocess.Popen | None = None
    conn: Connection | None = None
    ready: bool = False
    busy: bool = False  # a batch is being served
    starts: int = 0
    batches: int = 0
    requests: int = 0


class SamplerPool:
    """N sampler worker processes (see the module docstring).

    Args:
        root: the server's root folder (checkpoints, model cache).
        workers: number of processes (>= 1).
        threads_per_worker: torch threads of each worker.
        device, dtype: as for ``Engine`` (sampling itself always runs in fp32).
        preload: base model names each worker loads before it reports ready.
        start_timeout_s: longest wait for a (re)started worker to be ready.
    Raises:
        ValueError: ``workers`` < 1 or ``threads_per_worker`` < 1.
    """

    def __init__(
        self,
        root: Path | str,
        workers: int,
        *,
        threads_per_worker: int = 1,
        device: str | None = None,
        dtype: str = "auto",
        preload: list[str] | tuple = (),
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        if int(workers) < 1 or int(threads_per_worker) < 1:
            raise ValueError(
                f"SamplerPool needs workers >= 1 and threads_per_worker >= 1, got {workers} and {threads_per_worker}"
            )
        self.root = Path(root)
        self.workers = int(workers)
        self.threads_per_worker = int(threads_per_worker)
        self.device, self.dtype, self.preload = device, dtype, list(preload)
        self.start_timeout_s = float(start_timeout_s)
        self._slots = [_Slot(i) for i in range(self.workers)]
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.deaths = 0
        for s in self._slots:
            self._free.put(s)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, wait_ready: bool = True) -> None:
        """Spawn every worker; with ``wait_ready`` block until all have loaded their models.
        Raises SamplerWorkerError when one exits or times out before it is ready."""
        for s in self._slots:
            if s.proc is None:
                self._spawn(s)
        if wait_ready:
            for s in self._slots:
                self._wait_ready(s)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (a stop message, then SIGTERM / SIGKILL after ``timeout`` s)."""
        self._closed = True
        for s in self._slots:
            proc, conn = s.proc, s.conn
            if proc is None:
                continue
            try:
                if conn is not None:
                    conn.send(("stop", None))
            except (OSError, ValueError):
                pass
            _reap(proc, timeout)
            if conn is not None:
                conn.close()
            s.proc, s.conn, s.ready = None, None, False

    def stats(self) -> dict[str, Any]:
        """``{"workers", "threads_per_worker", "deaths", "pids": [pid | None (not ready)],
        "busy": [bool], "starts": [...], "batches": [...], "requests": [...]}`` (lists: per
        worker; ``requests`` counts sampling requests served, ``deaths`` workers lost)."""
        with self._lock:
            return {
                "workers": self.workers,
                "threads_per_worker": self.threads_per_worker,
                "deaths": self.deaths,
                "pids": [s.proc.pid if s.proc is not None and s.ready else None for s in self._slots],
                "busy": [s.busy for s in self._slots],
                "starts": [s.starts for s in self._slots],
                "batches": [s.batches for s in self._slots],
                "requests": [s.requests for s in self._slots],
            }

    # -- sampling ---------------------------------------------------------------------------------
    def sample_many(self, requests: list[dict]) -> list[Any]:
        """``Engine.sample_many(requests)`` on a free worker (blocks until one is free): per
        request a ``SampleResult`` or the exception that failed it (``EngineUserError`` for bad
        input, as in-process).  Raises SamplerWorkerError when the worker dies meanwhile (it is
        restarted) or cannot start."""
        slot = self._free.get()
        try:
            if self._closed:
                raise SamplerWorkerError("the sampler pool is closed (server shutting down)")
            if slot.proc is None:
                self._spawn(slot)
            self._wait_ready(slot)
            slot.busy = True
            _, conn = _started(slot)
            try:
                conn.send(("sample", requests))
            except (OSError, ValueError) as e:
                self._died(slot, f"could not send to it ({e})")
            reply = self._recv(slot, timeout=None)
            with self._lock:
                slot.batches += 1
                slot.requests += len(requests)
            return [_decode(r) for r in reply]
        finally:
            slot.busy = False
            self._free.put(slot)

    # -- internals --------------------------------------------------------------------------------
    def _spawn(self, slot: _Slot) -> None:
        parent, child = socket.socketpair()
        spec = {
            "root": str(self.root),
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads_per_worker,
            "preload": self.preload,
            "index": slot.index,
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tinker_local.sampler_pool", str(child.fileno()), json.dumps(spec)],
                pass_fds=[child.fileno()],
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()  # the worker's end lives only in the worker: its death closes it
        with self._lock:
            slot.proc, slot.conn, slot.ready = proc, Connection(parent.detach()), False
            slot.starts += 1
        logger.info(
            "sampler worker %d starting (pid %d, %d torch threads)", slot.index, proc.pid, self.threads_per_worker
        )

    def _wait_ready(self, slot: _Slot) -> None:
        if slot.ready:
            return
        t0 = time.monotonic()
        msg = self._recv(slot, timeout=self.start_timeout_s, starting=True)
        if msg != "ready":
            raise SamplerWorkerError(f"sampler worker {slot.index} sent {msg!r} instead of 'ready'")
        with self._lock:
            slot.ready = True
        proc, _ = _started(slot)
        logger.info("sampler worker %d ready (pid %d) after %.1fs", slot.index, proc.pid, time.monotonic() - t0)

    def _recv(self, slot: _Slot, timeout: float | None, starting: bool = False) -> Any:
        """The next message of ``slot``'s worker; SamplerWorkerError when it exits first."""
        _, conn = _started(slot)
        try:
            ready = wait([conn], timeout)
        except (OSError, ValueError):  # closed by close() meanwhile
            ready = [conn]
        if ready:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError, ValueError):
                kind, payload = None, None
            if kind == "ok":
                return payload
            if kind == "fatal":
                self._died(slot, f"failed: {payload}", starting=starting)
        if not ready:
            self._died(slot, f"was not ready within {timeout:g} s", starting=starting)
        self._died(slot, "exited", starting=starting)

    def _died(self, slot: _Slot, what: str, starting: bool = False) -> None:
        proc = slot.proc
        if proc is None:  # close() took it
            raise SamplerWorkerError(f"sampler worker {slot.index} was stopped (server shutting down)")
        code = _reap(proc, 1.0)
        if slot.conn is not None:
            slot.conn.close()
        with self._lock:
            self.deaths += 1
            slot.proc, slot.conn, slot.ready = None, None, False
        msg = (
            f"sampler worker {slot.index} (pid {proc.pid}) {what} with exit code {code}"
            f"{' while starting' if starting else ' while sampling'}"
        )
        logger.error("%s; restarting it", msg)
        if not self._closed and not starting:  # a worker that cannot start is retried on next use
            self._spawn(slot)
        raise SamplerWorkerError(msg)


def _started(slot: _Slot) -> tuple[subprocess.Popen, Connection]:
    """The process and connection of ``slot``'s worker; SamplerWorkerError when ``close`` took them."""
    proc, conn = slot.proc, slot.conn
    if proc is None or conn is None:
        raise SamplerWorkerError(f"sampler worker {slot.index} was stopped (server shutting down)")
    return proc, conn


def _reap(proc: subprocess.Popen, timeout: float) -> int | None:
    """Wait up to ``timeout`` s for ``proc`` to exit, then SIGTERM, then SIGKILL; its exit code."""
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()


def _encode(result: Any) -> Any:
    if isinstance(result, BaseException):
        user = any(c.__name__ in ("EngineUserError", "UnknownModelError") for c in type(result).__mro__)
        return ("error", user, type(result).__name__, str(result))
    return result


def _decode(item: Any) -> Any:
    if isinstance(item, tuple) and len(item) == 4 and item[0] == "error":
        from .errors import EngineUserError

        _, user, name, text = item
        return EngineUserError(text) if user else RuntimeError(f"{name}: {text}")
    return item


def _worker_main(
    conn: Connection, root: str, device: str | None, dtype: str, threads: int, preload: list[str], index: int
) -> None:
    """A worker process: build an Engine, preload, answer ``("sample", reqs)`` with
    ``("ok", results)`` until ``("stop", _)`` or the parent's end of the socket closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when workers stop
    log = logging.getLogger("tinker_local.sampler_worker")
    try:
        from .compute import keep_freed_memory
        from .engine import Engine

        keep_freed_memory()
        engine = Engine(Path(root), device=device, dtype=dtype, num_threads=threads)
        for name in preload:
            engine.load_base_model(name)
    except BaseException as e:  # reported to the parent, which fails requests with it
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", "ready"))
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if kind != "sample":
            return
        try:
            out = [_encode(r) for r in engine.sample_many(payload)]
        except Exception as e:  # sample_many reports per-request errors; this is a bug
            log.exception("sampler worker %d (pid %d) failed a batch", index, os.getpid())
            out = [_encode(e)] * len(payload)
        conn.send(("ok", out))


if __name__ == "__main__":  # python -m tinker_local.sampler_pool FD SPEC_JSON (started by the pool)
    _spec = json.loads(sys.argv[2])
    _worker_main(
        Connection(int(sys.argv[1])),
        _spec["root"],
        _spec["device"],
        _spec["dtype"],
        int(_spec["threads"]),
        list(_spec["preload"]),
        int(_spec["index"]),
    )
