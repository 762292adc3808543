"""Damaged parts never block a store: a part cut short, emptied or overwritten with garbage is
skipped (with a warning naming it) by views, queries, ``sql``/``runs``/``checkpoints``,
compaction and the run-start check; ``store check`` lists it and the temporaries of dead writers;
``store repair`` moves them into ``_quarantine`` (nothing deleted). Local folders and a real S3
server (SeaweedFS)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import s3fs

from prefect_tinker.cli import main as cli
from tinker_blocks import store_health, store_repair
from tinker_blocks.atomic import temp_path
from tinker_blocks.stores import TrainingStore

RUNS = ("a", "b", "c", "d")


def _fill(store: TrainingStore) -> None:
    """Runs a..d: 2 metric parts of 5 steps each (value = 10 * k + step), a runs row, a checkpoint."""
    for run in RUNS:
        for k in range(2):
            with store.writer("metrics", writer_id=f"w{k}") as w:  # part-w0-* sorts first
                for s in range(5):
                    w.write(run_id=run, step=5 * k + s, name="train/loss", value=float(10 * k + s))
        store.record_run(run, status="completed", base_model="tiny", backend="local", lora_rank=4)
        store.record_checkpoint(run, step=10, name="final", kind="state", path=f"tinker://{run}/weights/final")


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts with no part known as damaged or validated in this process."""
    for s in (store_health._damaged, store_health._good, store_health._warned):
        s.clear()
    yield


class Files:
    """Reads and damages the parts of a store through a plain filesystem (os or s3fs)."""

    def __init__(self, fs, base: str):
        self.fs, self.base = fs, base

    def parts(self, table: str, run: str) -> list[str]:
        return sorted(self.fs.glob(f"{self.base}/training/{table}/run_id={run}/*.parquet"))

    def damage(self) -> dict[str, str]:
        """Cut metrics part 0 of a to half, empty metrics part 0 of b, garbage over runs of c."""
        pa_, pb, pc = self.parts("metrics", "a")[0], self.parts("metrics", "b")[0], self.parts("runs", "c")[0]
        data = self.fs.cat_file(pa_)
        self.fs.pipe_file(pa_, data[: len(data) // 2])
        self.fs.pipe_file(pb, b"")
        self.fs.pipe_file(pc, os.urandom(700))
        self.fs.invalidate_cache()
        return {"half": pa_, "empty": pb, "garbage": pc}


def _expect_readable_rest(store: TrainingStore, caplog, damaged: dict[str, str]) -> None:
    with caplog.at_level(logging.WARNING, logger="tinker_blocks.store_health"):
        per_run = store.query("SELECT run_id, count(*) AS n, sum(value) AS s FROM metrics GROUP BY 1 ORDER BY 1")
    # a and b lost their first part (steps 0..4, values 0..4); c and d are whole
    assert per_run == [{"run_id": "a", "n": 5, "s": 60.0}, {"run_id": "b", "n": 5, "s": 60.0},
                       {"run_id": "c", "n": 10, "s": 70.0}, {"run_id": "d", "n": 10, "s": 70.0}]
    assert [r["run_id"] for r in store.query("SELECT run_id FROM runs ORDER BY 1")] == ["a", "b", "d"]
    assert store.last_checkpoint("c")["path"] == "tinker://c/weights/final"
    assert list(store.metrics_frame("a")["step"]) == [5, 6, 7, 8, 9]
    for path in damaged.values():  # each damaged part is named in a warning
        assert any(path in r.getMessage() for r in caplog.records), path


def test_damaged_local_parts_are_skipped_everywhere(tmp_path, caplog, capsys):
    root = str(tmp_path / "store")
    store = TrainingStore(root=root)
    _fill(store)
    files = Files(__import__("fsspec").filesystem("file"), root)
    before = store.query("SELECT count(*) AS n FROM metrics")
    assert before == [{"n": 40}] and store_health._good == set()  # the happy path validates nothing
    damaged = files.damage()
    store.check()  # the check at run start
    _expect_readable_rest(store, caplog, damaged)

    # a raw connection made after the damage is known leaves the parts out of the views
    con = store.connect()
    assert con.execute("SELECT count(*) FROM metrics").fetchone()[0] == 30
    con.close()

    # the CLI: sql, runs, checkpoints
    assert cli.main(["sql", "--store", root, "--json", "SELECT count(*) AS n FROM metrics"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 30}]
    assert cli.main(["runs", "--store", root, "--json"]) == 0
    assert sorted(r["run_id"] for r in json.loads(capsys.readouterr().out)) == ["a", "b", "d"]
    assert cli.main(["checkpoints", "c", "--store", root, "--json"]) == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [10]

    # compaction merges the readable parts only and leaves the damaged one in place
    assert store.compact("a", "metrics") is None  # one readable part: nothing to merge
    assert store.compact("c", "metrics") is not None
    assert len(files.parts("metrics", "c")) == 1
    assert Path(damaged["half"]).exists()
    with store.writer("metrics") as w:
        w.write(run_id="a", step=10, name="train/loss", value=100.0)
    merged = store.compact("a", "metrics")
    assert merged is not None and Path(damaged["half"]).exists()
    assert pq.read_table(merged).num_rows == 6
    assert store.query("SELECT sum(value) AS s FROM metrics WHERE run_id = 'a'") == [{"s": 160.0}]


def test_scan_run_names_a_runs_own_damage(tmp_path):
    root = str(tmp_path / "store")
    store = TrainingStore(root=root)
    _fill(store)
    damaged = Files(__import__("fsspec").filesystem("file"), root).damage()
    assert store_repair.scan_run(store, "d") == []
    (problem,) = store_repair.scan_run(store, "a")
    assert (problem.kind, problem.path) == ("damaged", damaged["half"]) and "magic bytes" in problem.reason
    assert store.last_checkpoint("a")["step"] == 10  # resumes from what it can still read


def test_a_fresh_process_skips_damage_too(tmp_path):
    """The probe of the issue: a finished run's part cut to half, then a new process lists runs
    and a new run with another name starts (check + queries + writes)."""
    root = str(tmp_path / "store")
    store = TrainingStore(root=root)
    _fill(store)
    Files(__import__("fsspec").filesystem("file"), root).damage()
    code = (
        "from tinker_blocks.stores import TrainingStore\n"
        f"s = TrainingStore(root={root!r}); s.check()\n"
        "assert s.last_checkpoint('new') is None\n"
        "s.record_run('new', status='running')\n"
        "print(sorted(r['run_id'] for r in s.query('SELECT run_id FROM runs')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['a', 'b', 'd', 'new']"
    assert "skipping the unreadable part" in out.stderr and "run_id=c" in out.stderr


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temp_of_dead_writer(target: Path) -> str:
    """The temporary name a writer process of this host that has exited would have left."""
    return temp_path(str(target)).replace(f"-{os.getpid()}.tmp", f"-{_dead_pid()}.tmp")


def test_store_check_and_repair_local(tmp_path, capsys):
    root = tmp_path / "store"
    store = TrainingStore(root=str(root))
    _fill(store)
    damaged = Files(__import__("fsspec").filesystem("file"), str(root)).damage()
    part_dir = root / "training" / "metrics" / "run_id=d"
    # leftovers: a temporary of a dead process of this host, an old one of an older writer, and
    # a temporary of this very process (a write in flight: not touched)
    dead = Path(_temp_of_dead_writer(part_dir / "part-x-000001-aaaa.parquet"))
    dead.write_bytes(b"")
    old = part_dir / "part-y-000002-bbbb.parquet.tmp"
    old.write_bytes(b"PAR1")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    mine = Path(temp_path(str(part_dir / "part-z-000003-cccc.parquet")))
    mine.write_bytes(b"x")
    report_png = root / "reports" / "a"
    report_png.mkdir(parents=True)
    (report_png / "curves.png.otherhost-12.tmp").write_bytes(b"")  # another host, fresh: kept

    assert cli.main(["store", "check", "--store", str(root), "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["parts_checked"] == 4 * 2 + 4 + 4
    found = {(p["kind"], p["path"]) for p in got["problems"]}
    assert found == {("damaged", p) for p in damaged.values()} | {("orphan", str(dead)), ("orphan", str(old))}
    assert all(p["reason"] for p in got["problems"])

    assert cli.main(["store", "repair", "--store", str(root)]) == 0
    out = capsys.readouterr().out
    assert "moved 5 file(s) to" in out
    quarantine = next((root / "_quarantine").iterdir())
    manifest = json.loads((quarantine / "manifest.json").read_text())
    assert sorted(m["path"] for m in manifest["moved"]) == sorted([*damaged.values(), str(dead), str(old)])
    for m in manifest["moved"]:  # moved, same bytes, under the relative path; nothing deleted
        assert not Path(m["path"]).exists()
        assert Path(m["moved_to"]) == quarantine / Path(m["path"]).relative_to(root)
        assert Path(m["moved_to"]).exists()
    assert (quarantine / Path(damaged["empty"]).relative_to(root)).stat().st_size == 0
    assert mine.exists() and (report_png / "curves.png.otherhost-12.tmp").exists()

    assert cli.main(["store", "check", "--store", str(root)]) == 0
    assert "0 unreadable, 0 temporaries of dead writers" in capsys.readouterr().out
    assert store.query("SELECT count(*) AS n FROM metrics") == [{"n": 30}]


def test_next_writer_sweeps_its_folder(tmp_path):
    from tinker_blocks import atomic

    store = TrainingStore(root=str(tmp_path))
    store.record_run("r", status="running")
    folder = tmp_path / "training" / "runs" / "run_id=r"
    dead = Path(_temp_of_dead_writer(folder / "part-run-000000-dead.parquet"))
    dead.write_bytes(b"")
    live = Path(temp_path(str(folder / "part-run-000001-live.parquet")))  # this process: in flight
    live.write_bytes(b"")
    atomic._swept.clear()  # as in a new process: this folder was not swept yet
    store.record_run("r", status="completed")
    assert not dead.exists() and live.exists()
    assert store.get_run("r")["status"] == "completed"


@pytest.fixture
def s3_files(s3_server, s3_root):
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    return Files(fs, s3_root.removeprefix("s3://"))


def test_damaged_s3_parts_are_skipped_and_repaired(s3_root, s3_files, caplog, capsys):
    store = TrainingStore(root=s3_root)
    _fill(store)
    damaged = s3_files.damage()
    store.check()
    _expect_readable_rest(store, caplog, damaged)
    assert cli.main(["sql", "--store", s3_root, "--json", "SELECT count(*) AS n FROM metrics"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 30}]
    assert store.compact("c", "metrics") is not None

    assert cli.main(["store", "check", "--store", s3_root, "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert {p["path"] for p in got["problems"]} == set(damaged.values())
    assert cli.main(["store", "repair", "--store", s3_root, "--json"]) == 0
    moved_to = json.loads(capsys.readouterr().out)["quarantine"]
    assert moved_to.startswith(f"{s3_root}/_quarantine/")
    s3_files.fs.invalidate_cache()
    for path in damaged.values():
        assert not s3_files.fs.exists(path)
        rel = path[len(s3_files.base) + 1:]
        assert s3_files.fs.exists(f"{moved_to.removeprefix('s3://')}/{rel}")
    assert cli.main(["store", "check", "--store", s3_root]) == 0
    capsys.readouterr()
