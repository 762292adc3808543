"""Run callbacks: hooks every run of this process calls, for tests and plugins to observe runs.

:class:`RunCallbacks` (``after_step``, ``after_checkpoint``, ``before_compaction``) is installed with
:func:`run_callbacks`; the run session and the step loop call :func:`emit` at those points.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec

__all__ = ["RunCallbacks", "emit", "run_callbacks"]

P = ParamSpec("P")


class RunCallbacks:
    """Hooks called for every run of this process (subclass and override what you need)."""

    def after_step(self, run_id: str, step: int) -> None:
        """After optimizer step ``step`` was taken (before its evaluation and checkpoint)."""

    def after_checkpoint(self, run_id: str, step: int, path: str) -> None:
        """After the state checkpoint at ``step`` and its store rows were written."""

    def before_compaction(self, run_id: str) -> None:
        """When every row of the finished run is written, before its tables are compacted."""


_callbacks: list[RunCallbacks] = []
_callbacks_lock = threading.Lock()


@contextmanager
def run_callbacks(*callbacks: RunCallbacks) -> Iterator[None]:
    """Install ``callbacks`` for the runs started inside the ``with`` block."""
    with _callbacks_lock:
        _callbacks.extend(callbacks)
    try:
        yield
    finally:
        with _callbacks_lock:
            for cb in callbacks:
                _callbacks.remove(cb)


def emit(hook: Callable[[RunCallbacks], Callable[P, None]], *args: P.args, **kwargs: P.kwargs) -> None:
    """Call the method ``hook`` picks (e.g. ``lambda cb: cb.after_step``) with ``args`` on every
    installed callback."""
    with _callbacks_lock:
        cbs = list(_callbacks)
    for cb in cbs:
        hook(cb)(*args, **kwargs)
