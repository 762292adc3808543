"""Rollouts and eval batches on real clusters: a local Ray cluster (``ray start --head`` on
127.0.0.1, started here, one per module) through ``prefect_ray.RayTaskRunner``, and a Dask
``LocalCluster`` through ``prefect_dask.DaskTaskRunner``, chosen by ``task_runner=``. Results are
compared with the thread runner for the same seed. Workers are separate processes: each
re-creates its clients from the credentials block and finds the embedded server through its
``server.json``. Marked ``cluster`` (start-up of Ray and Dask workers dominates)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefect_tinker.flows.eval import EvalConfig, eval_flow
from prefect_tinker.flows.rl import RLConfig, rl_flow
from prefect_tinker.tasks.runners import active_task_runner, shutdown_task_runners

pytestmark = pytest.mark.cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """``ray start --head --block`` on 127.0.0.1 in its own session; yields its address; stopped
    by signalling that process group (never ``ray stop``, which stops every Ray on the machine)."""
    pytest.importorskip("prefect_ray", reason="prefect-ray is not installed (extra 'ray')")
    tmp = Path(f"/tmp/pt-ray-{os.getpid()}")  # short: Ray's socket paths must stay under 107 bytes
    tmp.mkdir(exist_ok=True)
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
           f"--temp-dir={tmp}", "--object-store-memory=100000000", f"--ray-client-server-port={_free_port()}"]
    log = open(tmp_path_factory.mktemp("ray") / "ray-start.log", "w")
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"ray start exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}"
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                break
        except OSError:
            assert time.monotonic() < deadline, "ray did not open its port within 120 s"
            time.sleep(0.3)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        shutdown_task_runners()  # the driver's connection
        os.killpg(proc.pid, signal.SIGTERM)  # Ray drains for up to 30 s on SIGTERM: not worth waiting for
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        _reap(str(tmp))


def _reap(marker: str, within: float = 20.0) -> None:
    """Wait for the processes of the cluster (their command lines name its temp dir; Ray workers
    run in sessions of their own) to exit; kill, by pid, any still there after ``within`` s."""
    def ours() -> list[int]:
        out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        return [int(line.split(None, 1)[0]) for line in out.splitlines() if marker in line and "ps -eo" not in line]

    deadline = time.monotonic() + within
    while ours() and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in ours():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rows(store, query) -> list[dict]:
    from tinker_blocks.store_sql import query_stores

    names, rows = query_stores(str(store), query, [])
    return [dict(zip(names, r, strict=True)) for r in rows]


def _rl(local_credentials, store, run_name, **kw) -> dict:
    """An RL run with an evaluator (at its start and end), and its trajectories and eval samples."""
    cfg = RLConfig(model="tiny", group_size=2, groups_per_batch=3, max_tokens=6, max_steps=2, lora_rank=4,
                   learning_rate=5e-3, save_every=2, run_name=run_name, store=str(store), log_trajectories=6,
                   evaluators=[{"benchmark": "arithmetic", "limit": 3, "max_tokens": 4}],
                   backend={"local_root": local_credentials.local_root}, **kw)
    summary = rl_flow(cfg)
    traj = _rows(store, f"SELECT step, batch_index, group_index, member, response, reward FROM trajectories "
                        f"WHERE run_id = '{run_name}' ORDER BY step, batch_index, group_index, member")
    evals = _rows(store, f"SELECT step, example_id, completion FROM eval_samples WHERE run_id = '{run_name}' "
                         "ORDER BY step, example_id, sample_index")
    return {"rewards": summary["rewards"], "trajectories": traj, "eval_samples": evals}


def _eval(local_credentials, root, name, **kw) -> list[dict]:
    store = root / f"eval-{name}"  # own store: a cache key of its own, so every runner samples
    cfg = EvalConfig(
        model="tiny",
        benchmark="arithmetic",
        limit=6,
        num_samples=2,
        temperature=1.0,
        max_tokens=6,
        batch_size=2,
        run_name="scale",
        store=str(store),
        backend={"local_root": local_credentials.local_root},
        **kw,
    )
    assert eval_flow(cfg)["evaluated"] == 1
    return _rows(store, "SELECT example_id, sample_index, completion, correct FROM eval_samples "
                        "ORDER BY example_id, sample_index")


@pytest.fixture(scope="module")
def on_threads(prefect_api, local_credentials, tmp_path_factory):
    """The RL run and the evaluation on the flow's thread pool: what the clusters must reproduce."""
    root = tmp_path_factory.mktemp("threads")
    t0 = time.perf_counter()
    rl = _rl(local_credentials, root / "store", "rl-thread")
    t1 = time.perf_counter()
    ev = _eval(local_credentials, root, "thread")
    print(f"\nthreads: RL 2 steps {t1 - t0:.1f} s, eval {time.perf_counter() - t1:.1f} s")
    assert len(rl["trajectories"]) == 12 and len(rl["eval_samples"]) == 6 and len(ev) == 12
    return rl, ev


def test_rollouts_and_eval_batches_on_ray_match_threads(on_threads, local_credentials, ray_cluster, tmp_path):
    rl, ev = on_threads
    t0 = time.perf_counter()
    on_ray = _rl(local_credentials, tmp_path / "store", "rl-ray", task_runner="ray", task_runner_address=ray_cluster)
    t1 = time.perf_counter()
    assert on_ray == {**rl}  # same rewards, sampled tokens and evaluator samples
    assert _eval(local_credentials, tmp_path, "ray", task_runner="ray", task_runner_address=ray_cluster) == ev
    print(
        f"\nray: RL 2 steps {t1 - t0:.1f} s (incl. connecting, worker start-up), eval {time.perf_counter() - t1:.1f} s"
    )
    import ray

    runner = active_task_runner(RLConfig(task_runner="ray", task_runner_address=ray_cluster))
    assert ray.is_initialized() and type(runner).__name__ == "RayTaskRunner"
    # the cluster this test started: one node of 2 CPUs (Ray replaces a loopback --node-ip-address
    # by this machine's own address, ray._private.services.resolve_ip_for_localhost)
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert node["Resources"]["CPU"] == 2 and ray.get_runtime_context().gcs_address.endswith(ray_cluster.split(":")[1])


def test_rollouts_and_eval_batches_on_dask_match_threads(on_threads, local_credentials, tmp_path):
    pytest.importorskip("prefect_dask", reason="prefect-dask is not installed (extra 'dask')")
    rl, ev = on_threads
    t0 = time.perf_counter()
    try:
        on_dask = _rl(local_credentials, tmp_path / "store", "rl-dask", task_runner="dask", task_runner_workers=2)
        t1 = time.perf_counter()
        assert on_dask == rl
        runner = active_task_runner(RLConfig(task_runner="dask", task_runner_workers=2))
        assert type(runner).__name__ == "DaskTaskRunner"
        pids = set(runner.client.run(os.getpid).values())
        assert len(pids) == 2 and os.getpid() not in pids  # worker processes, not this one
        assert _eval(local_credentials, tmp_path, "dask", task_runner="dask", task_runner_workers=2) == ev
        print(f"\ndask: RL 2 steps {t1 - t0:.1f} s (incl. cluster start-up), eval {time.perf_counter() - t1:.1f} s")
    finally:
        shutdown_task_runners()
