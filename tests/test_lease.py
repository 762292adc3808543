"""One writer per run name: leases raced by real processes on a local folder and on a real S3
server (SeaweedFS); refusal names the holder; a killed holder's lease is taken over at once, a
suspended one's after the timeout (and the suspended holder then learns it lost it);
``prefect-tinker runs`` shows a dead running run as ``stale``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from prefect_tinker.cli import main as cli
from tinker_blocks.lease import LeaseHeldError, LeaseLostError, acquire_lease, lease_status, read_lease
from tinker_blocks.stores import TrainingStore

# A holder process: takes the leases of the runs given, each at its own start time, prints one
# JSON line per attempt, then keeps what it holds and reports a lost lease.
HOLDER = textwrap.dedent("""
    import json, sys, time
    from tinker_blocks.lease import LeaseHeldError, acquire_lease
    root, timeout, who = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    print(json.dumps({"imported": True}), flush=True)
    start = float(sys.stdin.readline())  # the same start time for every racer
    held = []
    for i, run in enumerate(sys.argv[4:]):
        time.sleep(max(start + i * 0.4 - time.time(), 0))
        try:
            lease = acquire_lease(root, run, who, timeout_s=timeout, heartbeat_s=timeout / 8)
            held.append(lease)
            print(json.dumps({"run": run, "held": True, "token": lease.info.token}), flush=True)
        except LeaseHeldError as exc:
            print(json.dumps({"run": run, "held": False, "error": str(exc), "holder_pid": exc.holder.pid}),
                  flush=True)
    print(json.dumps({"ready": True}), flush=True)
    while True:
        time.sleep(0.05)
        for lease in held:
            if lease.lost:
                print(json.dumps({"lost": lease.run_id}), flush=True)
                held.remove(lease)
""")


def start_holder(root: str, runs: list[str], who: str, *, timeout: float = 60.0, go: bool = True):
    """A holder process; with ``go`` it starts at once, else call :func:`go` with its peers."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root, str(timeout), who, *runs],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    if go:
        start_together(proc)
    return proc


def start_together(*procs: subprocess.Popen) -> None:
    for p in procs:  # wait until each has imported everything
        assert json.loads(p.stdout.readline()) == {"imported": True}, p.stderr.read()
    start = time.time() + 0.3
    for p in procs:
        p.stdin.write(f"{start}\n")
        p.stdin.flush()


def read_until_ready(proc: subprocess.Popen, timeout: float = 120.0) -> list[dict]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"holder exited: {proc.stderr.read()}")
        msg = json.loads(line)
        if msg.get("ready"):
            return lines
        lines.append(msg)
    raise AssertionError("holder not ready in time")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def race(root: str, rounds: int) -> None:
    runs = [f"race-{i}" for i in range(rounds)]
    a, b = start_holder(root, runs, "proc-a", go=False), start_holder(root, runs, "proc-b", go=False)
    try:
        start_together(a, b)
        got_a, got_b = read_until_ready(a), read_until_ready(b)
        for ra, rb in zip(got_a, got_b, strict=True):
            assert ra["run"] == rb["run"]
            assert ra["held"] != rb["held"], (ra, rb)  # exactly one winner per name
            winner, loser, pid = (ra, rb, a.pid) if ra["held"] else (rb, ra, b.pid)
            assert loser["holder_pid"] == pid
            assert f"(pid {pid})" in loser["error"] and "in use by another run" in loser["error"]
            assert read_lease(root, ra["run"]).token == winner["token"]
            assert lease_status(root, ra["run"]) == "live"
    finally:
        stop(a), stop(b)
    for run in runs:  # both holders are gone (same machine): their leases are stale at once
        assert lease_status(root, run) == "stale"


def test_two_processes_race_for_names_local(tmp_path):
    race(str(tmp_path / "store"), rounds=8)


def test_refusal_release_and_reacquire_local(tmp_path):
    root = str(tmp_path / "store")
    assert lease_status(root, "r1") == "none"
    with acquire_lease(root, "r1", "first", timeout_s=5) as lease:
        assert lease_status(root, "r1") == "live" and read_lease(root, "r1").owner == "first"
        with pytest.raises(LeaseHeldError) as err:
            acquire_lease(root, "r1", "second")
        holder = err.value.holder
        assert (holder.owner, holder.pid, holder.token) == ("first", os.getpid(), lease.info.token)
        msg = str(err.value)
        for part in ("owner 'first'", f"host {holder.host}", f"pid {os.getpid()}", "since ", "last heartbeat"):
            assert part in msg
        first_beat = read_lease(root, "r1").heartbeat
        time.sleep(1.5)  # heartbeats every 5/6 s
        assert read_lease(root, "r1").heartbeat > first_beat
        lease.check()
    assert lease_status(root, "r1") == "none"
    again = acquire_lease(root, "r1", "second")
    assert read_lease(root, "r1").owner == "second"
    again.release()
    again.release()  # idempotent


def takeover(root: str) -> None:
    # a killed holder (same machine): stale at once, taken over at once
    killed = start_holder(root, ["crash"], "killed", timeout=60.0)
    assert read_until_ready(killed)[0]["held"]
    killed.kill()
    killed.wait(10)
    assert lease_status(root, "crash") == "stale"
    t0 = time.monotonic()
    acquire_lease(root, "crash", "resumer").release()
    assert time.monotonic() - t0 < 5

    # a suspended holder: live until its heartbeat is timeout_s old, then taken over; when it
    # wakes up its next heartbeat finds the lease gone and reports it lost
    sleeper = start_holder(root, ["hung"], "sleeper", timeout=3.0)
    try:
        assert read_until_ready(sleeper)[0]["held"]
        os.kill(sleeper.pid, signal.SIGSTOP)
        with pytest.raises(LeaseHeldError):
            acquire_lease(root, "hung", "early")
        time.sleep(3.5)
        assert lease_status(root, "hung") == "stale"
        lease = acquire_lease(root, "hung", "taker", timeout_s=3.0)
        os.kill(sleeper.pid, signal.SIGCONT)
        assert json.loads(sleeper.stdout.readline()) == {"lost": "hung"}
        assert read_lease(root, "hung").token == lease.info.token  # the sleeper did not write over it
        lease.check()
        lease.release()
    finally:
        os.kill(sleeper.pid, signal.SIGCONT)
        stop(sleeper)


def test_takeover_of_killed_and_suspended_holders_local(tmp_path):
    takeover(str(tmp_path / "store"))


def test_lost_lease_raises_on_check(tmp_path):
    root = str(tmp_path / "store")
    lease = acquire_lease(root, "r", "me", timeout_s=60)
    path = lease.where
    data = json.loads(open(path).read())
    data["token"] = "someone-else"
    with open(path, "w") as fh:  # another run took it over behind our back
        json.dump(data, fh)
    with pytest.raises(LeaseLostError, match="taken over"):
        lease.renew()
    assert lease.lost
    with pytest.raises(LeaseLostError):
        lease.check()
    lease.release()  # a lost lease is not deleted
    assert read_lease(root, "r").token == "someone-else"


def test_two_processes_race_for_names_s3(s3_root):
    race(s3_root, rounds=4)


def test_takeover_and_release_s3(s3_root):
    takeover(s3_root)
    with acquire_lease(s3_root, "r", "me"):
        assert lease_status(s3_root, "r") == "live"
    assert lease_status(s3_root, "r") == "none"


RUNNER = textwrap.dedent("""
    import sys, time
    from tinker_blocks.lease import acquire_lease
    from tinker_blocks.stores import TrainingStore
    store = TrainingStore(root=sys.argv[1])
    lease = acquire_lease(store, sys.argv[2], "runner")
    store.record_run(sys.argv[2], status="running")
    print("running", flush=True)
    time.sleep(600)
""")


def test_runs_shows_dead_running_runs_as_stale(tmp_path, capsys):
    root = str(tmp_path / "store")
    store = TrainingStore(root=root)
    procs = {run: subprocess.Popen([sys.executable, "-c", RUNNER, root, run], stdout=subprocess.PIPE, text=True)
             for run in ("alive", "killed")}
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "running"
        procs["killed"].kill()
        procs["killed"].wait(10)
        store.record_run("no-lease", status="running")  # e.g. its final status write failed after release
        store.record_run("finished", status="completed")
        assert cli.main(["runs", "--store", root, "--json"]) == 0
        status = {r["run_id"]: r["status"] for r in json.loads(capsys.readouterr().out)}
        assert status == {"alive": "running", "killed": "stale", "no-lease": "stale", "finished": "completed"}
    finally:
        for p in procs.values():
            stop(p)
