"""Ctrl-C keeps the work: how an interrupted training run stops.

- The first SIGINT (Ctrl-C) while a run session is open only asks the run to stop
  (:class:`StopRequest`): the step loop finishes the step it is in, saves a state checkpoint (with the
  optimizer state, recorded in the training store like every periodic one, so a re-run of the same
  command resumes after it), records the run ``interrupted`` and raises :class:`RunInterrupted`.
- A second SIGINT is Python's own :class:`KeyboardInterrupt` at once; the session still records the
  run ``interrupted`` (nothing saved since its last checkpoint) and turns it into
  :class:`RunInterrupted`. A library may turn that KeyboardInterrupt into an error of its own (DuckDB,
  in a query of the store: ``RuntimeError: Query interrupted``), so after a second SIGINT any error
  ending the session counts as the interruption (:attr:`StopRequest.forced`).
- :func:`recipe_flow` makes a recipe's Prefect flow end in the ``Cancelled`` state with that message
  (not ``Failed``: nothing failed, the user stopped it; a Failed run would set off failure
  automations and the flow's retries, and ``Crashed`` means the infrastructure died). Calling the flow
  then raises the :class:`RunInterrupted`, which ``prefect-tinker run`` prints as its one line
  before exiting with status 130 (128 + SIGINT, what a shell reports for a process Ctrl-C ended).

The handler is installed only in the main thread (Python delivers signals there) and only over
Python's default SIGINT handler: a program that installed its own (or ignores SIGINT) keeps it.
"""

from __future__ import annotations

import functools
import inspect
import signal
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

__all__ = ["RunInterrupted", "StopRequest", "recipe_flow"]

P = ParamSpec("P")
R = TypeVar("R")


class RunInterrupted(Exception):
    """A run stopped by SIGINT.

    Args:
        run_id: the run's name (None: a flow without one).
        step: optimizer steps the run had taken when it stopped; None: it stopped outside a run
            session (before it opened, or in a flow without one: eval, export).
        saved_step: the step of its last state checkpoint (``step``: saved as it stopped), or None
            when it has none.
    """

    def __init__(self, run_id: str | None, step: int | None, saved_step: int | None = None):
        self.run_id, self.step, self.saved_step = run_id, step, saved_step
        super().__init__(run_id, step, saved_step)

    def __str__(self) -> str:
        if self.step is None:
            run = f" (run {self.run_id!r})" if self.run_id else ""
            return f"interrupted{run}; re-run the same command to continue"
        if self.saved_step == self.step:
            return f"interrupted at step {self.step}; checkpoint saved; re-run the same command to resume"
        if self.saved_step is None:
            return (
                f"interrupted at step {self.step} before the first checkpoint of run {self.run_id!r}; "
                "re-run the same command to start again"
            )
        return (
            f"interrupted at step {self.step} without a checkpoint; re-run the same command to resume after "
            f"step {self.saved_step} (the last checkpoint)"
        )


class StopRequest:
    """SIGINT as a request to stop at the next step boundary (see the module docstring).

    ``with StopRequest() as stop:`` installs the handler (main thread, default handler only);
    ``stop.requested`` turns true at the first SIGINT; the second sets ``stop.forced``, puts
    Python's default handler back and raises :class:`KeyboardInterrupt`; leaving the block
    restores the default handler.
    """

    def __init__(self) -> None:
        self.requested = False
        self.forced = False
        self._installed = False

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._on_sigint)
                self._installed = True
        return self

    def _on_sigint(self, signum: int, frame: object) -> None:
        if not self.requested:
            self.requested = True
            return
        self.forced = True
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._installed and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._installed = False


def recipe_flow(name: str, flow_run_name: str) -> Callable[[Callable[P, R]], Any]:
    """A recipe's Prefect flow (``@recipe_flow("sft", "sft-{config.run_name}")`` over its function):
    :func:`prefect.flow` with ``log_prints``, the version hashed from the recipe's own module, and an
    interruption (:class:`RunInterrupted`, or a :class:`KeyboardInterrupt` reaching the flow) ending
    the flow run ``Cancelled`` with the one-line message; calling the flow raises the
    :class:`RunInterrupted`."""
    from prefect import flow
    from prefect.states import Cancelled
    from prefect.utilities.hashing import file_hash

    def decorate(fn: Callable[P, R]) -> Any:
        @functools.wraps(fn)
        def stops_cancelled(*args: P.args, **kwargs: P.kwargs) -> Any:
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:  # outside a run session (before it opened): nothing saved
                exc = RunInterrupted(_run_name(args, kwargs), None)
            except RunInterrupted as interrupted:
                exc = interrupted
            return Cancelled(message=str(exc), data=exc)

        # Prefect validates parameters against the signature: annotations resolved here, in the recipe's module
        try:
            signature = inspect.signature(fn, eval_str=True)
        except NameError:  # a name defined only inside a function: left as written
            signature = inspect.signature(fn)
        stops_cancelled.__signature__ = signature  # type: ignore[attr-defined]
        source = inspect.getsourcefile(fn)
        return flow(
            name=name, flow_run_name=flow_run_name, log_prints=True, version=file_hash(source) if source else None
        )(stops_cancelled)

    return decorate


@runtime_checkable
class _NamedRun(Protocol):
    """A flow's config that names its run (a recipe config's ``run_name``; export, promote and
    flywheel configs have none)."""

    run_name: Any


def _run_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    config = kwargs.get("config", args[0] if args else None)
    name = config.run_name if isinstance(config, _NamedRun) else None
    return str(name) if name else None
