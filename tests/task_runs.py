"""Queries of the task runs recorded by the Prefect API the test runs against (the ``prefect_api``
fixture's, or whatever ``PREFECT_API_URL`` names)."""

from __future__ import annotations


def cached_task_runs(name: str, *, like: bool = False, at_least: int = 1, within: float = 30.0) -> int:
    """How many task runs named ``name`` (with ``like``: whose name contains ``name``, Prefect's ``like_``
    filter) ended in the state ``Cached``: counted again until there are ``at_least`` or ``within``
    seconds have passed (a task run's final state reaches the API a moment after the task returns,
    through the events of the run recorder), then returned."""
    import time

    deadline = time.monotonic() + within
    while True:
        n = _count_cached(name, like)
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


def _count_cached(name: str, like: bool) -> int:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterName,
        TaskRunFilterState,
        TaskRunFilterStateName,
    )

    by_name = TaskRunFilterName(like_=name) if like else TaskRunFilterName(any_=[name])
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(
                name=by_name, state=TaskRunFilterState(name=TaskRunFilterStateName(any_=["Cached"]))
            )
        )
    return len(runs)
