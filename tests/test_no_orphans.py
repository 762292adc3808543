"""``prefect-tinker run`` with ``PREFECT_TINKER_UI=off`` killed with SIGKILL mid-run leaves no process
behind but the embedded tinker server (which stays up by design): the temporary Prefect API it started
dies with it and nobody holds the killed command's stdout. (The persistent Prefect server of the default
mode stays up by design too; tests/test_prefect_ui.py stops it and checks that nothing is left.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and PR_SET_PDEATHSIG")


def marked(marker: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds ``marker``."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def test_kill_9_of_run_leaves_only_the_tinker_server(tmp_path):
    marker = f"PT_ORPHAN_TEST={uuid.uuid4().hex}"
    store, local_root = tmp_path / "store", tmp_path / "local"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_TINKER_HOME=str(local_root), PREFECT_TINKER_UI="off",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PT_ORPHAN_TEST=marker.split("=", 1)[1])
    cli = str(Path(sys.executable).parent / "prefect-tinker")
    proc = subprocess.Popen(
        [cli, "run", "sft", "model=tiny", "max_steps=500", "batch_size=2", "lora_rank=4", "eval_every=0",
         "save_every=0", "num_eval_samples=0", "run_name=orphan-probe", f"store={store}",
         f"backend.local_root={local_root}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    server_pid = None
    try:
        deadline = time.monotonic() + 400
        runs = store / "training" / "runs" / "run_id=orphan-probe"
        while not (runs.exists() and any(runs.glob("*.parquet"))):  # the run is recorded: training
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run did not start in time"
            time.sleep(0.5)
        time.sleep(2.0)  # inside the training steps
        server_pid = json.loads((local_root / "server.json").read_text())["pid"]
        before = marked(marker)
        assert proc.pid in before
        assert any("uvicorn" in cmd and "prefect.server" in cmd for cmd in before.values()), before
        assert server_pid not in before  # the tinker server's environment is scrubbed

        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)  # EOF: no survivor holds the command's stdout
        t0 = time.monotonic()
        while marked(marker) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        assert marked(marker) == {}, marked(marker)
        assert os.path.exists(f"/proc/{server_pid}")  # the embedded server stays up by design
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)
        if server_pid is not None:
            from tinker_blocks.credentials import stop_local_server

            stop_local_server(local_root, timeout=5)
