"""A real local Prefect stack for end-to-end tests, benchmarks and demos: ``prefect server start``
on a free 127.0.0.1 port with its own ``PREFECT_HOME``, the ``tinker-process`` work pool, the
deployments of ``prefect.yaml`` (``prefect --no-prompt deploy --all``) and ``process`` workers.

Every command runs as a subprocess with :meth:`PrefectStack.env` (the stack's API URL and home,
offline settings), so nothing touches the user's Prefect profile. In-process API calls go through
:meth:`PrefectStack.client` (a sync client bound to the stack's URL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
POOL = "tinker-process"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transient(exc: BaseException) -> bool:
    """An API or network hiccup worth polling through (a loaded machine: timeouts, a busy server's
    5xx), as opposed to a bug in the predicate."""
    import httpx

    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
        return True
    response = getattr(exc, "response", None)
    return isinstance(exc, httpx.HTTPStatusError) and response is not None and response.status_code >= 500


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned).

    Transient API errors raised by ``predicate`` (timeouts, refused connections, HTTP 5xx) count as
    "not yet"; any other exception propagates at once. Raises TimeoutError naming ``what`` (and the
    last transient error, if any) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            if not _transient(exc):
                raise
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f" (last error: {type(last_error).__name__}: {last_error})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)


def local_training_runs(local_root: Path) -> set[str] | None:
    """Model ids of the training runs that the local Tinker server under ``local_root`` knows (its
    REST API ``/api/v1/training_runs``), or None while it is not up. Asks up to 5 times: a server
    started with ``--fail-every`` answers some requests with 503."""
    import json

    try:
        base_url = json.loads((Path(local_root) / "server.json").read_text())["base_url"]
    except (OSError, ValueError, KeyError):
        return None
    req = urllib.request.Request(base_url + "/api/v1/training_runs?limit=1000", headers={"X-API-Key": "tml-local"})
    for _ in range(5):
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
                return {r["training_run_id"] for r in json.loads(resp.read())["training_runs"]}
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    return None


def block_sampler_saves(local_root: Path, model_id: str) -> Path:
    """Inject a disk fault: a file where the local server keeps model ``model_id``'s sampler weights
    (``<local_root>/checkpoints/<model_id>/sampler_weights``), so saving sampler weights fails
    until the returned file is removed; state checkpoints still save."""
    model_dir = Path(local_root) / "checkpoints" / model_id.replace(":", ".")
    model_dir.mkdir(parents=True, exist_ok=True)
    blocker = model_dir / "sampler_weights"
    blocker.write_text("a file where the server wants a folder: saving sampler weights fails (disk fault)\n")
    return blocker


class PrefectStack:
    """A Prefect server (and workers) under ``home``; use as a context manager or call :meth:`close`."""

    def __init__(self, home: Path, *, port: int | None = None, extra_env: dict[str, str] | None = None):
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.ui_url = f"http://127.0.0.1:{self.port}"
        self.extra_env = dict(extra_env or {})
        self.server: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []

    # ----- environment and commands ---------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every subprocess: this stack's API and home, offline settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_API_URL=self.api_url, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_UI_ENABLED="true", PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_LOGGING_LEVEL="INFO", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0",
            TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        env.update(extra)
        return env

    def cli(self, *args: str, timeout: float = 400, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        """Run ``prefect <args>`` (``--no-prompt``); AssertionError with its output when it fails."""
        cmd = [sys.executable, "-m", "prefect", "--no-prompt", *args]
        res = subprocess.run(cmd, cwd=cwd, env=self.env(), capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, (
            f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
        return res

    # ----- server ---------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.api_url + "/health", timeout=2) as r:  # noqa: S310
                return r.status == 200
        except OSError:
            return False

    def start_server(self, timeout: float = 300) -> None:
        """``prefect server start --host 127.0.0.1 --port P``; waits for ``/api/health``."""
        log = open(self.home / "server.log", "ab")
        self.server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=self.home, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_default_sigint,
        )
        log.close()

        def up() -> bool:
            if self.server.poll() is not None:
                raise RuntimeError(f"prefect server exited ({self.server.returncode}); see {self.home / 'server.log'}")
            return self.healthy()

        wait_until(up, timeout, f"the Prefect server on port {self.port}")

    def create_pool(self) -> None:
        """Create the ``process`` work pool (what ``prefect work-pool create tinker-process --type
        process`` does, through the API: one CLI start-up less)."""
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.workers.process import ProcessWorker

        with self.client() as c:
            c.create_work_pool(WorkPoolCreate(name=POOL, type="process",
                                              base_job_template=ProcessWorker.get_default_base_job_template()),
                               overwrite=True)

    def deploy_all(self) -> None:
        """Create the ``process`` work pool and register every deployment of ``prefect.yaml``
        (``prefect --no-prompt deploy --all`` in the repository root)."""
        self.create_pool()
        self.cli("deploy", "--all")

    # ----- workers --------------------------------------------------------------------------
    def start_worker(self, name: str = "worker") -> subprocess.Popen:
        """``prefect worker start --pool tinker-process --type process`` (log ``<home>/<name>.log``)."""
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process", "--name", name],
            cwd=self.home, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_default_sigint,
        )
        log.close()
        self.workers.append(proc)
        return proc

    def kill_worker(self, proc: subprocess.Popen) -> list[int]:
        """SIGKILL a worker and the flow-run processes it started (``python -m prefect.engine``):
        what a lost machine looks like to the server. Returns the killed pids."""
        import psutil

        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        engines = [c for c in children if _is_engine(c)]
        killed = []
        for p in [proc, *engines]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
        proc.wait(timeout=30)
        return killed

    def stop_worker(self, proc: subprocess.Popen, timeout: float = 30) -> None:
        """Stop a worker with SIGINT (it ignores SIGTERM for a while), then SIGKILL."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def close(self) -> None:
        for w in self.workers:
            self.stop_worker(w, timeout=15)
        if self.server is not None and self.server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGTERM)  # the server and its uvicorn child
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(timeout=10)

    def __enter__(self) -> "PrefectStack":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- API ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        """A sync Prefect client bound to this stack's API."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            with get_client(sync_client=True) as c:
                yield c

    def run_deployment(self, name: str, parameters: dict, job_variables: dict | None = None) -> Any:
        """Create a flow run of deployment ``flow/deployment`` (not waited for); returns it."""
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.api_url}):
            return run_deployment(name, parameters=parameters, job_variables=job_variables, timeout=0)

    def flow_run(self, flow_run_id: Any) -> Any:
        with self.client() as c:
            return c.read_flow_run(flow_run_id)

    def wait_final(self, flow_run_id: Any, timeout: float) -> Any:
        """Wait until the flow run is in a final state (Completed, Failed, Crashed, Cancelled)."""
        def final():
            run = self.flow_run(flow_run_id)
            return run if run.state is not None and run.state.is_final() else None

        return wait_until(final, timeout, f"flow run {flow_run_id} to finish", interval=1.0)

    def task_runs(self, flow_run_id: Any) -> list[Any]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with self.client() as c:
            return c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))

    def logs(self, flow_run_id: Any) -> list[str]:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        with self.client() as c:
            logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        return [entry.message for entry in logs]

    def artifacts(self, flow_run_id: Any) -> list[Any]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with self.client() as c:
            return c.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )

    def events(self, prefix: str, related: str | None = None, limit: int = 50) -> list[dict]:
        """Events whose name starts with ``prefix`` (oldest first; at most 50, the API's page),
        optionally only those with the resource id ``related`` among their related resources."""
        flt: dict[str, Any] = {"event": {"prefix": [prefix]}, "order": "ASC"}
        if related:
            flt["related"] = {"id": [related]}
        with self.client() as c:
            resp = c._client.post("/events/filter", json={"filter": flt, "limit": limit})
            resp.raise_for_status()
            return resp.json()["events"]


def _default_sigint() -> None:
    """In the child: SIGINT back to its default (a parent started in the background ignores it, and
    the child would inherit that), so that :meth:`PrefectStack.stop_worker` can stop workers."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _is_engine(p: Any) -> bool:
    try:
        return "prefect.engine" in " ".join(p.cmdline())
    except Exception:
        return False
