"""Compute seconds per user on the local server's compute and side-executor threads.

``tinker_local.futures`` charges each job's wall seconds on its thread (a batch's split evenly over
its jobs) to the user who submitted it: totals since start (``user_totals``) and one entry per
user and second for the last hour (``usage``), which the per-user compute quota of
``tinker_local.tenancy`` and ``GET local_stats`` read.  Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import deque


class ComputeUsage:
    """Per-user compute seconds: ``charge`` after jobs ran, ``user_totals`` / ``usage`` to read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, float]] = {}  # user -> {"jobs", "compute_s"} since start
        self._recent: dict[str, deque[tuple[float, float]]] = {}  # user -> (monotonic second, seconds)

    def charge(self, users: list[str], t0: float) -> None:
        """Charge the seconds since ``t0`` (``time.monotonic``) to the jobs of ``users`` (one entry
        per job, a user may repeat), in equal shares."""
        now = time.monotonic()
        share = (now - t0) / len(users)
        with self._lock:
            for user in users:
                t = self._totals.setdefault(user, {"jobs": 0, "compute_s": 0.0})
                t["jobs"] += 1
                t["compute_s"] += share
                recent = self._recent.setdefault(user, deque())
                second = float(int(now))  # one entry per user and second: an hour holds at most 3600
                if recent and recent[-1][0] == second:
                    recent[-1] = (second, recent[-1][1] + share)
                else:
                    recent.append((second, share))

    def user_totals(self) -> dict[str, dict[str, float]]:
        """user -> ``{"jobs": jobs run, "compute_s": their wall seconds}`` since start."""
        with self._lock:
            return {u: dict(t) for u, t in self._totals.items()}

    def usage(self, user: str, window_s: float, cap: float | None) -> tuple[float, float]:
        """(compute seconds of ``user``'s jobs that ended in the last ``window_s`` seconds, seconds
        until that falls below ``cap`` as the window moves on; 0 when it is below already)."""
        now = time.monotonic()
        with self._lock:
            recent = self._recent.get(user)
            if not recent:
                return 0.0, 0.0
            while recent and recent[0][0] < now - window_s:
                recent.popleft()
            used = sum(s for _, s in recent)
            left, wait = used, 0.0
            if cap is not None:
                for end, s in recent:
                    if left < cap:
                        break
                    left -= s
                    wait = end + window_s - now
            return used, max(0.0, wait)
