"""The run session against real failures: the embedded server killed (kill -9) mid-run, two runs
with one name at once, and bad data (nothing started, nothing written)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from tinker_blocks.credentials import stop_local_server
from tests.data_files import synthetic_file
from tests.threads import Helper
from tinker_blocks.lease import LeaseHeldError
from tinker_blocks.stores import TrainingStore


def _config(root, store, run_name, **kw) -> SFTConfig:
    base = dict(model="tiny", dataset=str(synthetic_file("chats")), batch_size=4,
                learning_rate=2e-3, lora_rank=8, max_steps=6, eval_every=0, save_every=2, run_name=run_name,
                store=str(store), max_length=128, num_eval_samples=0, backend={"local_root": str(root)})
    base.update(kw)
    return SFTConfig(**base)


def _server_pid(root) -> int:
    return int(json.loads((root / "server.json").read_text())["pid"])


class _KillServer(RunCallbacks):
    """kill -9 of the embedded server right after step ``at`` (the next request finds it gone)."""

    def __init__(self, root, at: int):
        self.root, self.at, self.killed = root, at, None

    def after_step(self, run_id, step):
        if step == self.at and self.killed is None:
            self.killed = _server_pid(self.root)
            os.kill(self.killed, signal.SIGKILL)


def test_killed_server_is_restarted_and_the_run_completes(prefect_api, tmp_path):
    root, store = tmp_path / "tl", tmp_path / "store"
    killer = _KillServer(root, at=3)
    t0 = time.monotonic()
    try:
        with run_callbacks(killer):
            summary = sft_flow(_config(root, store, "survivor"))
        took = time.monotonic() - t0
        assert killer.killed is not None and summary["steps"] == 6
        assert _server_pid(root) != killer.killed  # a new server serves the rest of the run
    finally:
        stop_local_server(root, timeout=10.0)  # the restarted embedded server outlives the flow by design
    rows = TrainingStore(root=str(store)).query(
        "SELECT step, count(*) AS n FROM metrics WHERE run_id = 'survivor' AND name = 'train/loss' "
        "GROUP BY step ORDER BY step"
    )
    assert [(r["step"], r["n"]) for r in rows] == [(s, 1) for s in range(6)]  # steps 2-3 redone, one row each
    assert TrainingStore(root=str(store)).get_run("survivor")["status"] == "completed"
    assert took < 600, took  # noticed at once (pid dead), not after the SDK's minutes of retries


class _Hold(RunCallbacks):
    """Hold the first run at step 1 until the second one has been tried."""

    def __init__(self):
        self.at_step, self.release = threading.Event(), threading.Event()

    def after_step(self, run_id, step):
        if run_id == "twin" and step == 1:
            self.at_step.set()
            self.release.wait(120)  # the test sets it in a finally, at most one refused run later


def test_second_run_with_the_same_name_is_refused(prefect_api, local_credentials, tmp_path):
    store = tmp_path / "store"
    hold = _Hold()
    first_config = _config(local_credentials.local_root, store, "twin", learning_rate=2e-3)
    with run_callbacks(hold):
        first = Helper(sft_flow, first_config, name="first-twin")
        try:
            # a failure (or skip) of the first run reaches the test at once; 300 s only bounds a live, slow start
            first.wait_for(hold.at_step, timeout=300, what="step 1 of the first run")
            with pytest.raises(LeaseHeldError, match=r"twin.*(pid|held)"):
                sft_flow(_config(local_credentials.local_root, store, "twin", learning_rate=1e-3))
        finally:
            hold.release.set()
        summary = first.join(300)
    assert summary["steps"] == 6
    cfg = json.loads(TrainingStore(root=str(store)).get_run("twin")["config_json"])
    assert cfg["learning_rate"] == 2e-3  # the refused run wrote nothing over the first one's rows


def test_bad_data_fails_before_a_server_starts_or_a_row_is_written(prefect_api, tmp_path):
    root, store = tmp_path / "tl", tmp_path / "store"
    bad = tmp_path / "chats.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    bad.write_bytes((good + "\n").encode() * 3 + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(ValueError, match=r"chats\.jsonl:4: .*UTF-8"):
        sft_flow(_config(root, store, "bad-data", dataset=str(bad)))
    assert not (root / "server.json").exists()  # no server was started
    assert not list(store.rglob("*.parquet"))  # and no row written
