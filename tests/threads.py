"""Helper threads whose failure reaches the test at once.

A test that runs work in a thread and waits on an event the work sets must not wait out its timeout
when the work fails first (an exception, or ``pytest.skip`` raised inside it: a ``BaseException``):
:class:`Helper` keeps what the thread raised, and :meth:`Helper.wait_for` and :meth:`Helper.join` raise
it in the test's thread as soon as the thread has ended, a skip as a skip. Waits are bounded (60 s by
default): a helper that hangs fails the test with what it was waiting for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: the longest a test waits on a helper unless it says otherwise
WAIT_S = 60.0


class Helper:
    """``fn(*args)`` running in a daemon thread, started at once; its result or what it raised is kept."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str | None = None):
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name or fn.__name__, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self.result = fn(*args)
        except BaseException as exc:  # handed to the test's thread by wait_for / join
            self.error = exc

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def wait_for(self, event: threading.Event, timeout: float = WAIT_S, what: str = "the event") -> None:
        """Return once ``event`` is set; raise what the thread raised as soon as it has; fail when the
        thread ended without setting it, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not event.wait(0.05):
            if not self._thread.is_alive():
                self._raise_if_failed()
                if event.is_set():
                    return
                raise AssertionError(f"helper thread {self._thread.name!r} ended without {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"helper thread {self._thread.name!r}: no {what} within {timeout:.0f} s")

    def join(self, timeout: float = WAIT_S) -> Any:
        """The thread's result once it has ended (what it raised is raised here); fail after ``timeout``."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"helper thread {self._thread.name!r} still running after {timeout:.0f} s")
        self._raise_if_failed()
        return self.result
