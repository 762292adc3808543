"""Where mapped tasks run: the flow's own thread pool, a Ray cluster or a Dask cluster.

A config that inherits :class:`TaskRunnerFields` chooses with ``task_runner=thread|ray|dask``
(``task_runner_address`` optional). The flows route their fan-out tasks -- RL rollouts
(``rollout-group``), eval batches (``eval-batch``) -- through :func:`submit_task` and :func:`map_task`:

- ``thread`` (default): ``task.submit`` / ``task.map`` on the flow's own task runner;
- ``ray``: ``prefect_ray.RayTaskRunner`` connected to ``task_runner_address`` (a running
  cluster: ``127.0.0.1:6379``, ``ray://head:10001``, ``auto``), or a local Ray instance started
  in this process when no address is given;
- ``dask``: ``prefect_dask.DaskTaskRunner`` connected to the scheduler at ``task_runner_address``
  (``tcp://host:8786``), or a ``distributed.LocalCluster`` of ``task_runner_workers`` worker
  processes (one thread each) when none is given.

The ray/dask runner is entered once per process and settings (Ray is process-global: one
``ray.init`` per process) and kept for later flow runs of the process; :func:`shutdown_task_runners`
(also registered with ``atexit``) closes them. Tasks submitted through it are ordinary Prefect task
runs of the calling flow run -- same names, states, retries and cache keys as on threads: the
task engine runs in the worker and reports to the same Prefect API (the settings travel with the
serialized context), and cached results are read from the result storage, which must be shared
by the workers (the default local storage is, on one machine). Tasks receive only picklable
handles (the credentials block, sampler paths, specs) and re-create their clients in the worker
from the per-process registry (:mod:`prefect_tinker.tasks.clients`); an embedded local Tinker
server is found through its ``server.json`` and reused by every worker process.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = [
    "TaskRunnerFields",
    "active_task_runner",
    "make_task_runner",
    "map_task",
    "shutdown_task_runners",
    "submit_task",
]

Kind = Literal["thread", "ray", "dask"]


class TaskRunnerFields(BaseModel):
    """Config fields choosing where the flow's mapped tasks run (see the module docstring)."""

    task_runner: Kind = Field(
        default="thread", description="Where rollout/eval tasks run: thread (the flow's thread pool), ray or dask."
    )
    task_runner_address: str | None = Field(
        default=None,
        description=(
            "ray: cluster address (127.0.0.1:6379, ray://head:10001, auto); dask: scheduler address (tcp://host:8786);"
            " empty: start a local cluster in this process."
        ),
    )
    task_runner_workers: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Local cluster size when no address is given (ray: CPUs, dask: worker processes; default 2); thread: the "
            "flow's pool is used as is."
        ),
    )


def make_task_runner(kind: Kind, address: str | None = None, workers: int | None = None) -> Any:
    """A new (not entered) Prefect task runner of ``kind``.

    Raises:
        ImportError: the extra of ``kind`` is not installed (``pip install 'prefect-tinker[ray]'``
            or ``[dask]``).
        ValueError: unknown ``kind``.
    """
    if kind == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as exc:
            raise ImportError("task_runner=ray needs prefect-ray: pip install 'prefect-tinker[ray]'") from exc
        init = {} if address else {"num_cpus": workers or 2, "include_dashboard": False}
        return RayTaskRunner(address=address, init_kwargs=init)
    if kind == "dask":
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError as exc:
            raise ImportError("task_runner=dask needs prefect-dask: pip install 'prefect-tinker[dask]'") from exc
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": workers or 2,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        )
    raise ValueError(f"task_runner must be thread, ray or dask, got {kind!r}")


_lock = threading.Lock()
_active: dict[tuple, Any] = {}
_atexit_registered = False


def _key(settings: TaskRunnerFields) -> tuple[str, str | None, int | None]:
    return (settings.task_runner, settings.task_runner_address, settings.task_runner_workers)


def active_task_runner(settings: TaskRunnerFields | None) -> Any | None:
    """The entered runner for ``settings`` (a config with the :class:`TaskRunnerFields` fields),
    started on first use and kept for the process; None for ``thread`` or no settings (the
    flow's own runner).

    Raises:
        ImportError: see :func:`make_task_runner`.
        ValueError: a Ray runner with another address is already active in this process (Ray
            connects a process to one cluster).
    """
    global _atexit_registered
    if settings is None or settings.task_runner == "thread":
        return None
    kind = settings.task_runner
    key = _key(settings)
    with _lock:
        if key in _active:
            return _active[key]
        if kind == "ray":
            other = [k for k in _active if k[0] == "ray"]
            if other:
                raise ValueError(
                    f"this process is connected to the Ray cluster {other[0][1] or '(local)'}; "
                    f"task_runner_address={settings.task_runner_address!r} needs another process"
                )
        runner = make_task_runner(kind, settings.task_runner_address, settings.task_runner_workers)
        runner.__enter__()
        _active[key] = runner
        if not _atexit_registered:
            atexit.register(shutdown_task_runners)
            _atexit_registered = True
        return runner


def shutdown_task_runners() -> int:
    """Close every runner :func:`active_task_runner` started (a local cluster stops; a
    connection to a cluster is closed); returns how many were closed."""
    with _lock:
        runners = list(_active.values())
        _active.clear()
    for runner in runners:
        try:
            runner.__exit__(None, None, None)
        except Exception:  # closing at exit: a runner that cannot close must not hide the others
            pass
    return len(runners)


def submit_task(settings: TaskRunnerFields | None, task: Any, *args: Any, **kwargs: Any) -> Any:
    """``task.submit(*args, **kwargs)`` on the runner of ``settings``; returns its future."""
    runner = active_task_runner(settings)
    if runner is None:
        return task.submit(*args, **kwargs)
    from prefect.utilities.callables import get_call_parameters

    return runner.submit(task, get_call_parameters(task.fn, args, kwargs))


def map_task(settings: TaskRunnerFields | None, task: Any, *args: Any, **kwargs: Any) -> Any:
    """``task.map(*args, **kwargs)`` on the runner of ``settings`` (``unmapped``/``quote``
    arguments as for ``Task.map``); returns the futures (a ``PrefectFutureList``)."""
    runner = active_task_runner(settings)
    if runner is None:
        return task.map(*args, **kwargs)
    from prefect.utilities.callables import get_call_parameters

    return runner.map(task, get_call_parameters(task.fn, args, kwargs, apply_defaults=False))
