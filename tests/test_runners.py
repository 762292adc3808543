"""Task-runner settings and the runner factory (no cluster: tests/test_scaleout.py starts real ones)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from prefect_tinker.flows.eval import EvalConfig
from prefect_tinker.flows.rl import RLConfig
from prefect_tinker.tasks import runners


def test_settings_and_factory():
    from prefect.task_runners import ThreadPoolTaskRunner

    assert RLConfig().task_runner == "thread" and EvalConfig(benchmark="arithmetic").task_runner == "thread"
    assert runners.active_task_runner(RLConfig()) is None  # thread: the flow's own runner
    assert isinstance(runners.make_task_runner("thread", workers=3), ThreadPoolTaskRunner)
    with pytest.raises(ValidationError, match="task_runner"):
        RLConfig(task_runner="spark")
    with pytest.raises(ValueError, match="thread, ray or dask"):
        runners.make_task_runner("spark")
    if pytest.importorskip("prefect_ray", reason="prefect-ray is not installed (extra 'ray')"):
        r = runners.make_task_runner("ray", "127.0.0.1:6379")
        assert r.address == "127.0.0.1:6379" and "num_cpus" not in r.init_kwargs  # a cluster sizes itself
        assert runners.make_task_runner("ray", workers=3).init_kwargs["num_cpus"] == 3  # a local instance
    assert "task_runner" not in RLConfig.resume_fields()  # where rollouts run never changes a result
