"""Queries of the task runs recorded by the Prefect API the test runs against (the ``prefect_api``
fixture's, or whatever ``PREFECT_API_URL`` names)."""

from __future__ import annotations


def cached_task_runs(name: str, *, like: bool = False) -> int:
    """How many task runs named ``name`` (with ``like``: whose name contains ``name``, Prefect's ``like_``
    filter) ended in the state ``Cached``."""
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
