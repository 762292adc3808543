"""A live ``tinker_local`` server inside the test process (uvicorn on a thread, a real TCP port),
for tests that need to reach the service object: move its clock, switch a client-config flag.

``start(root, models)`` returns a ``LiveServer`` only after ``/api/v1/healthz`` answered (the SDK
retries a dead port for minutes); ``stop()`` shuts it down.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.local_server import free_port
from tinker_local.launcher import healthy


@dataclass
class LiveServer:
    base_url: str
    root: Path
    app: Any
    uvicorn: Any
    thread: threading.Thread

    @property
    def service(self):
        """The ``tinker_local.service.LocalService`` behind the app."""
        return self.app.state.service

    def shift_clock(self, seconds: float) -> None:
        """Move the server's clock (expiry, signed URLs) ``seconds`` into the future."""
        base = self.service.clock
        self.service.clock = lambda: base() + seconds

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


def start(root: Path, models: list[str], *, engine_cls: type | None = None, **app_kw: Any) -> LiveServer:
    """``engine_cls``: the engine class (default ``tinker_local.engine.Engine``; a subclass such as
    ``tests.scripted_judge.ScriptedJudgeEngine``), made with ``(root, dtype="fp32", num_threads=1)``."""
    import uvicorn

    from tinker_local.engine import Engine
    from tinker_local.server import create_app

    root = Path(root)
    engine = (engine_cls or Engine)(root, dtype="fp32", num_threads=1)
    for m in models:
        engine.load_base_model(m)
    app = create_app(engine, root, models=models, **app_kw)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, name=f"tinker-local-{port}", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if healthy(base_url, timeout=2):  # urllib: no TLS context built for each poll, as httpx does
            break
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"in-process tinker_local on port {port} did not come up")
        time.sleep(0.05)
    return LiveServer(base_url, root, app, server, thread)
