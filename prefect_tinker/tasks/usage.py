"""Calling a task when the caller counts the tokens its requests cost.

A cached task (Prefect's task cache) that answers from the cache sends no request, so its tokens
must not be counted again; :func:`run_task` says whether the call was such a cache hit. Token kinds
and prices: :mod:`prefect_tinker.recipes.pricing`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_task"]


def run_task(task: Any, *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """Call the Prefect task ``task`` (a task object, or one made by ``task.with_options``) with
    ``args`` / ``kwargs`` in the current flow; returns ``(result, cached)``, ``cached`` True when
    Prefect answered from its task cache (a ``Cached`` state) instead of running it.

    Raises:
        whatever the task raised (the failed state's exception).
    """
    state = task(*args, return_state=True, **kwargs)
    return state.result(), state.name == "Cached"
