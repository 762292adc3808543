"""A full disk: store parts and report pictures fail with an error naming the path and leave no
temporary and no partial file; what was written before stays readable. On a real tiny file
system (a 256 KiB tmpfs, mounted when the tests run as root) and, everywhere, under a file-size
limit (``RLIMIT_FSIZE`` in a subprocess: ``EFBIG`` instead of ``ENOSPC``, same code path)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinker_blocks.atomic import WriteError, atomic_write_bytes

# Runs with the store root on the small file system: earlier rows and picture, then writes that
# do not fit, then checks. Prints "ok" when every check passed.
SCENARIO = textwrap.dedent("""
    import errno, os, sys
    from pathlib import Path
    from tinker_blocks.atomic import WriteError
    from tinker_blocks.stores import TrainingStore
    from prefect_tinker.tasks.reporting import write_png

    root, big = Path(sys.argv[1]), int(sys.argv[2])
    store = TrainingStore(root=str(root))
    store.record_run("r", status="running")
    first_png = write_png(str(root), "r", b"\\x89PNG small picture")
    codes = {errno.ENOSPC, errno.EFBIG}
    blob = os.urandom(big).hex()  # incompressible: the part cannot fit
    try:
        store.record_run("r", status="failed", config={"blob": blob})
        raise SystemExit("the oversized part was written")
    except WriteError as exc:
        assert exc.errno in codes, exc
        assert "/training/runs/run_id=r/part-run-" in str(exc) and str(root) in str(exc), str(exc)
    try:
        write_png(str(root), "r", os.urandom(big))
        raise SystemExit("the oversized picture was written")
    except WriteError as exc:
        assert exc.errno in codes and exc.filename == str(root / "reports" / "r" / "curves.png"), str(exc)
        assert str(root / "reports" / "r" / "curves.png") in str(exc)
    leftovers = [str(p) for p in root.rglob("*") if p.is_file() and (p.name.endswith(".tmp") or p.stat().st_size == 0)]
    assert leftovers == [], leftovers
    assert Path(first_png).read_bytes() == b"\\x89PNG small picture"
    assert store.get_run("r")["status"] == "running"
    print("ok")
""")


def _run_scenario(root: Path, big: int, preexec=None) -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(root), str(big)], capture_output=True, text=True,
                         timeout=180, preexec_fn=preexec)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs mounted at ``tmp_path/mnt`` (skipped when mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (the RLIMIT_FSIZE test covers the same path)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_tmpfs_leaves_no_temporary_and_names_the_path(tiny_tmpfs):
    _run_scenario(tiny_tmpfs / "store", big=400_000)


def _limit_file_size():
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_file_size_limit_leaves_no_temporary_and_names_the_path(tmp_path):
    _run_scenario(tmp_path / "store", big=400_000, preexec=_limit_file_size)


def test_atomic_write_replaces_whole_and_cleans_up(tmp_path):
    target = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(None, str(target), b"one")
    atomic_write_bytes(None, str(target), b"two")
    assert target.read_bytes() == b"two" and sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]
    blocked = tmp_path / "file-not-folder"
    blocked.write_bytes(b"")
    with pytest.raises(WriteError) as err:
        atomic_write_bytes(None, str(blocked / "x.bin"), b"data")
    assert err.value.errno in (errno.EEXIST, errno.ENOTDIR) and str(blocked / "x.bin") in str(err.value)
