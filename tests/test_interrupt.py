"""Ctrl-C keeps the work (prefect_tinker/flows/interrupts.py): real SIGINTs, to the running process.

In-process, for every recipe on the shared run session and step loop: a SIGINT after step 1
ends the flow run ``Cancelled`` with the one line, the state checkpoint at step 1 (with its
optimizer state) recorded in the store, the run recorded ``interrupted``; a re-run resumes after
it with one metrics row per (step, name). A second SIGINT stops at once, nothing saved. Then the
command itself, as a user runs it: ``prefect-tinker run sft --example tiny`` in a subprocess,
SIGINT from outside, exit status 130 and one line, and the same command resuming.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from pydantic import BaseModel

from prefect_tinker.flows.interrupts import RunInterrupted
from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from tinker_blocks.stores import TrainingStore


@pytest.fixture(autouse=True)
def _default_sigint():
    """Python's own SIGINT handler, which the run session replaces while it is open (a test runner
    may have installed another one)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the session put it back
    signal.signal(signal.SIGINT, before)


class ProbeConfig(BaseModel):
    run_name: str


class _Sigint(RunCallbacks):
    """``times`` SIGINTs to this process right after step ``at`` of run ``run_id``."""

    def __init__(self, run_id: str, at: int, times: int = 1):
        self.run_id, self.at, self.times, self.sent = run_id, at, times, False

    def after_step(self, run_id, step):
        if run_id == self.run_id and step == self.at and not self.sent:
            self.sent = True
            for _ in range(self.times):
                signal.raise_signal(signal.SIGINT)


class _SigintAsLibraryError(_Sigint):
    """Two SIGINTs right after step ``at``; the second one's KeyboardInterrupt comes out as a
    library's own error, as DuckDB raises ``RuntimeError: Query interrupted`` when it arrives mid-query."""

    def after_step(self, run_id, step):
        if run_id == self.run_id and step == self.at and not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGINT)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                raise RuntimeError("Query interrupted") from None


def _configs(local_credentials, store):
    """A tiny config of every recipe that trains in a run session (3 steps, no periodic save)."""
    from prefect_tinker.flows.decisions import DecisionsConfig, decisions_flow
    from prefect_tinker.flows.distill import DistillConfig, distill_flow
    from prefect_tinker.flows.dpo import DPOConfig, dpo_flow
    from prefect_tinker.flows.reward_model import RewardModelConfig, reward_model_flow
    from prefect_tinker.flows.rl import RLConfig, rl_flow
    from prefect_tinker.flows.sft import SFTConfig, sft_flow

    common = dict(model="tiny", lora_rank=8, max_steps=3, save_every=0, eval_every=0, store=str(store),
                  backend={"local_root": local_credentials.local_root})
    return {
        "sft": (sft_flow, SFTConfig, dict(batch_size=2, max_length=128, num_eval_samples=0, test_size=0)),
        "dpo": (dpo_flow, DPOConfig, dict(dataset="builtin:example_prefs", batch_size=2, test_size=2,
                                          max_length=128)),
        "reward_model": (reward_model_flow, RewardModelConfig, dict(dataset="builtin:example_prefs",
                                                                    format="preference", batch_size=2,
                                                                    test_size=2, max_length=128)),
        "decisions": (decisions_flow, DecisionsConfig, dict(dataset="builtin:sentiment_sentences",
                                                            prompt_field="text", label_field="label",
                                                            choices=["positive", "negative"], batch_size=2,
                                                            test_size=2)),
        "rl": (rl_flow, RLConfig, dict(group_size=2, groups_per_batch=2, max_tokens=4)),
        "distill": (distill_flow, DistillConfig, dict(mode="on_policy", teacher="base:tiny", group_size=2,
                                                      groups_per_batch=2, max_tokens=4)),
    }, common


def _flow_run_state(state):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).state


def _duplicates(store, run_id: str) -> list[dict]:
    return TrainingStore(root=str(store)).query(
        "SELECT step, name, count(*) AS n FROM metrics WHERE run_id = ? GROUP BY step, name HAVING n > 1", [run_id]
    )


@pytest.mark.parametrize("recipe", ["sft", "dpo", "reward_model", "decisions", "rl", "distill"])
def test_first_sigint_saves_the_step_and_the_rerun_resumes(recipe, prefect_api, local_credentials, tmp_path):
    store = tmp_path / "store"
    configs, common = _configs(local_credentials, store)
    flow, model, own = configs[recipe]
    run_id = f"intr-{recipe}"
    cfg = model(**common, **own, run_name=run_id)
    with run_callbacks(_Sigint(run_id, at=1)):
        state = flow(config=cfg, return_state=True)
    line = "interrupted at step 1; checkpoint saved; re-run the same command to resume"
    assert state.is_cancelled() and state.message == line
    assert _flow_run_state(state).type.value == "CANCELLED"  # in the Prefect API too, not Failed
    with pytest.raises(RunInterrupted, match=re.escape(line)):
        state.result()
    ts = TrainingStore(root=str(store))
    assert ts.get_run(run_id)["status"] == "interrupted"
    rows = ts.query("SELECT step, kind, path FROM checkpoints WHERE run_id = ? ORDER BY step", [run_id])
    states = [r for r in rows if r["kind"] == "state"]
    assert [r["step"] for r in states] == [1] and "/weights/" in states[0]["path"]  # state + optimizer
    assert ts.query("SELECT max(step) AS s FROM metrics WHERE run_id = ? AND name LIKE 'train/%'",
                    [run_id])[0]["s"] == 0  # step 2 never started

    out = flow(config=cfg.model_copy(update={"max_steps": 2}))  # the same run, resumed; two steps in all
    assert out["steps"] == 2
    assert ts.get_run(run_id)["status"] == "completed"
    assert _duplicates(store, run_id) == []
    train_steps = ts.query("SELECT DISTINCT step FROM metrics WHERE run_id = ? AND name LIKE 'train/%' ORDER BY step",
                           [run_id])
    assert [r["step"] for r in train_steps] == [0, 1]


def test_second_sigint_stops_at_once_and_a_rerun_says_it_starts_over(prefect_api, local_credentials, tmp_path,
                                                                      caplog):
    from prefect_tinker.flows.sft import SFTConfig, sft_flow

    store = tmp_path / "store"
    configs, common = _configs(local_credentials, store)
    cfg = SFTConfig(**{**common, **configs["sft"][2], "save_every": 10}, run_name="intr-twice")
    with run_callbacks(_Sigint("intr-twice", at=1, times=2)):  # the second one: KeyboardInterrupt at once
        state = sft_flow(config=cfg, return_state=True)
    assert state.is_cancelled() and _flow_run_state(state).type.value == "CANCELLED"
    assert state.message == ("interrupted at step 1 before the first checkpoint of run 'intr-twice'; "
                             "re-run the same command to start again")
    ts = TrainingStore(root=str(store))
    assert ts.get_run("intr-twice")["status"] == "interrupted"
    assert ts.query("SELECT * FROM checkpoints WHERE run_id = 'intr-twice'") == []
    assert ts.query("SELECT * FROM metrics WHERE run_id = 'intr-twice'") == []  # buffered rows were not written

    # the second Ctrl-C re-raised by a library as its own error: the same interruption, not a failure
    translated = cfg.model_copy(update={"run_name": "intr-translated"})
    with run_callbacks(_SigintAsLibraryError("intr-translated", at=1)):
        state = sft_flow(config=translated, return_state=True)
    assert state.is_cancelled() and _flow_run_state(state).type.value == "CANCELLED", state.message
    assert state.message.startswith("interrupted at step 1 before the first checkpoint of run 'intr-translated'")
    assert ts.get_run("intr-translated")["status"] == "interrupted"

    with caplog.at_level("INFO"):
        out = sft_flow(config=cfg.model_copy(update={"max_steps": 2}))
    assert "no checkpoint of run 'intr-twice' yet: starting at step 1" in caplog.text
    assert out["steps"] == 2 and _duplicates(store, "intr-twice") == []


class _Command:
    """``prefect-tinker ARGS`` in a subprocess reporting to the session's Prefect API; its stderr
    read line by line as it comes."""

    def __init__(self, args: list[str]):
        from prefect.settings import PREFECT_API_URL

        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect_tinker.cli.main", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert self.proc.poll() is None, "\n".join(self.lines[-30:])
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n" + "\n".join(self.lines[-30:]))

    def steps(self, run: str) -> list[int]:
        """The steps of the progress lines printed so far."""
        return [int(m.group(1)) for ln in list(self.lines) if (m := re.search(rf"SFT {run}\s+step (\d+)/", ln))]

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(10)
        return rc


@pytest.mark.slow  # three runs, two of them new processes (~1.5 min on 2 busy cores): scheduled first
@pytest.mark.timeout(900)
def test_the_command_interrupted_twice_resumes_after_the_saved_step(prefect_api, local_credentials, tmp_path):
    """The issue's check: SIGINT into `prefect-tinker run sft --example tiny max_steps=200 run_name=intr`; one line,
    status 130; the same command resumes after the saved step (and a double Ctrl-C there stops it at once); the
    finished run has one metrics row per (step, name)."""
    store = tmp_path / "store"
    # the command, on the session's server and store; no held-out split (no evaluations, no final sampling)
    command = ["run", "sft", "--example", "tiny", "max_steps=200", "run_name=intr", f"store={store}",
               f"backend.local_root={local_credentials.local_root}", "test_size=0", "num_eval_samples=0"]
    first = _Command(command)
    first.wait_for(r"SFT intr\s+step (\d+)/200")
    seen = max(first.steps("intr"))  # steps are quick: several may be done already
    first.proc.send_signal(signal.SIGINT)
    assert first.finish() == 130, "\n".join(first.lines[-40:])
    assert not [ln for ln in first.lines if "Traceback" in ln or "KeyboardInterrupt" in ln]
    saved = int(re.fullmatch(r"interrupted at step (\d+); checkpoint saved; re-run the same command to resume",
                             first.lines[-1]).group(1))
    assert saved >= seen and max(first.steps("intr")) == saved  # the step under way was finished and saved, no more
    ts = TrainingStore(root=str(store))
    assert ts.get_run("intr")["status"] == "interrupted"
    assert ts.query("SELECT max(step) AS s FROM checkpoints WHERE run_id = 'intr' AND kind = 'state'")[0]["s"] == saved

    again = _Command(command)  # the same command: resumes, and this time Ctrl-C twice
    again.wait_for(rf"resuming run intr after its checkpoint at step {saved}")
    again.wait_for(r"SFT intr\s+step (\d+)/200")
    at = max(again.steps("intr"))
    again.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    again.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert again.finish() == 130, "\n".join(again.lines[-40:])
    assert time.monotonic() - t0 < 60  # at once, not after the step's checkpoint and the rest of the run
    # the second SIGINT stops the step or its checkpoint where it is; when the first one's checkpoint was written
    # before the second arrived, that is what the line says
    last = ts.query("SELECT max(step) AS s FROM checkpoints WHERE run_id = 'intr' AND kind = 'state'")[0]["s"]
    stopped = re.fullmatch(
        rf"interrupted at step (\d+) without a checkpoint; re-run the same command to resume after step {saved} "
        r"\(the last checkpoint\)",
        again.lines[-1],
    )
    assert (stopped and int(stopped.group(1)) >= at) or again.lines[-1] == (
        f"interrupted at step {last}; checkpoint saved; re-run the same command to resume"
    ), again.lines[-5:]
    assert not [ln for ln in again.lines if "Traceback" in ln]
    assert at > saved and ts.get_run("intr")["status"] == "interrupted"

    from prefect_tinker.cli.main import main as cli_main

    # resumed again, to the end: past every step with rows (a second Ctrl-C between a checkpoint's metrics rows and
    # its own row leaves the rows of steps after the last checkpoint, which the resumed run writes again)
    top = max(last, *(r["s"] for r in ts.query("SELECT max(step) AS s FROM metrics WHERE run_id = 'intr'")))
    assert cli_main([*command[:4], f"max_steps={top + 1}", *command[5:]]) == 0
    assert ts.get_run("intr")["status"] == "completed"
    assert _duplicates(store, "intr") == []
    losses = ts.query("SELECT step FROM metrics WHERE run_id = 'intr' AND name = 'train/loss' ORDER BY step")
    assert [r["step"] for r in losses] == list(range(top + 1))


def test_rlhf_interrupted_in_a_stage_is_cancelled_with_that_stage_saved(prefect_api, local_credentials, tmp_path):
    from prefect_tinker.flows.rlhf import RLHFConfig, rlhf_flow

    store = tmp_path / "store"
    cfg = RLHFConfig(model="tiny", lora_rank=8, run_name="intr-rlhf", store=str(store),
                     backend={"local_root": local_credentials.local_root},
                     sft={"max_steps": 3, "batch_size": 2, "save_every": 0, "eval_every": 0, "num_eval_samples": 0,
                          "test_size": 0, "max_length": 128},
                     rm={"dataset": "builtin:example_prefs", "format": "preference", "max_steps": 1})
    with run_callbacks(_Sigint("intr-rlhf-sft", at=1)):
        state = rlhf_flow(config=cfg, return_state=True)
    line = "interrupted at step 1; checkpoint saved; re-run the same command to resume"
    assert state.is_cancelled() and state.message == line and _flow_run_state(state).type.value == "CANCELLED"
    ts = TrainingStore(root=str(store))
    assert ts.get_run("intr-rlhf-sft")["status"] == "interrupted" and ts.get_run("intr-rlhf-rm") is None
    assert ts.last_checkpoint("intr-rlhf-sft", "state")["step"] == 1


def test_a_flow_stopped_outside_a_run_session_is_cancelled_too(prefect_api):
    """eval and export have no run session: Ctrl-C there is Python's KeyboardInterrupt, which the recipe
    flow turns into the same Cancelled state and one line (nothing to save)."""
    from prefect.utilities.hashing import file_hash

    from prefect_tinker.flows.interrupts import recipe_flow

    @recipe_flow("probe", "probe-{config.run_name}")
    def probe(config: ProbeConfig) -> dict:
        signal.raise_signal(signal.SIGINT)  # no session: Python's own handler raises KeyboardInterrupt here
        return {}

    assert probe.version == file_hash(__file__)  # the flow's version is its own module's, not the decorator's
    state = probe(config=ProbeConfig(run_name="p"), return_state=True)
    assert state.is_cancelled() and _flow_run_state(state).type.value == "CANCELLED"
    assert state.message == "interrupted (run 'p'); re-run the same command to continue"
