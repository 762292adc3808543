"""The code sandbox against programs that attack it: each attempt fails, is reported with its
reason, and leaves the host as it was.  Real bubblewrap processes; no mocks."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from prefect_tinker.recipes.sandbox import SandboxConfig, SandboxUnavailable, run_python, sandbox_problem

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _sandbox_works():
    problem = sandbox_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the code sandbox must work in CI (scripts/setup.sh installs bubblewrap): {problem}")
        pytest.skip(f"the code sandbox cannot run here: {problem}")


def _procs_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
            if int(uid_line.split()[1]) == uid:
                pids.append(int(entry.name))
    return pids


def _assert_nothing_left(result) -> None:
    """No process of the sandbox's uid outlives the run (checkable when the host ran it as its own uid)."""
    if result.uid != os.getuid():
        assert _procs_of_uid(result.uid) == [], "sandbox processes outlived the run"


def _report(result) -> dict:
    """The JSON object the attacking program printed as its last stdout line."""
    return json.loads(result.stdout.strip().splitlines()[-1])


def _run(code: str, **limits):
    return run_python(textwrap.dedent(code), config=SandboxConfig(**limits) if limits else None)


def test_normal_program_passes_with_exact_stdout():
    r = run_python("import sys\nfor i in range(3):\n    print(i * i)\nprint(sys.argv[1:], input())\n",
                   args=["a", "b c"], stdin="from stdin\n", files={"data.txt": "x"})
    assert (r.exit_code, r.reason, r.passed, r.timed_out, r.killed) == (0, "ok", True, False, False)
    assert r.stdout == "0\n1\n4\n['a', 'b c'] from stdin\n" and r.stderr == ""
    failing = run_python("raise KeyError('missing')")
    assert (failing.exit_code, failing.reason, failing.passed) == (1, "error", False)
    assert failing.detail == "exit code 1: KeyError: 'missing'" and "Traceback" in failing.stderr


def test_reading_files_outside_its_directory_fails(tmp_path):
    secret = secrets.token_hex(16)
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    targets = [str(host_file), str(ROOT / "README.md"), "/etc/passwd", "/etc/shadow", "/etc/hostname",
               str(Path.home() / ".bashrc"), "/work", "/tmp", "/var", "/home"]
    r = _run(f"""
        import json, os
        out = {{}}
        for path in {targets!r}:
            try:
                out[path] = os.listdir(path) if os.path.isdir(path) else open(path).read()
            except OSError as exc:
                out[path] = type(exc).__name__
        out["/"] = sorted(os.listdir("/"))
        print(json.dumps(out))
    """)
    assert r.passed, r.stderr
    seen = _report(r)
    for path in targets:
        assert seen[path] in ("FileNotFoundError", "PermissionError"), (path, seen[path])
    assert secret not in r.stdout
    # the root holds only the read-only system, /proc, /dev and the sandbox's own directory
    assert set(seen["/"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "sandbox",
                              "root", "opt", "home"}  # root/opt/home only as parents of a bound interpreter


def test_writing_outside_its_directory_fails(tmp_path):
    host_target = tmp_path / "pwned.txt"
    targets = [str(host_target), "/usr/pwned", "/pwned", "/dev/pwned", "/dev/shm/pwned", "/proc/sys/kernel/hostname",
               "/tmp/pwned"]
    r = _run(f"""
        import json
        out = {{}}
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("x")
                out[path] = "written"
            except OSError as exc:
                out[path] = type(exc).__name__
        with open("/sandbox/mine.txt", "w") as f:
            f.write("ok")
        out["own"] = open("mine.txt").read()
        print(json.dumps(out))
    """)
    assert r.passed, r.stderr
    seen = _report(r)
    assert seen["own"] == "ok"
    for path in targets:
        assert seen[path] != "written", path
    assert not host_target.exists()


class _Server:
    """A TCP server on the host's 127.0.0.1 that counts connections."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def test_network_is_unreachable():
    server = _Server()
    abstract = b"\0prefect-tinker-test-" + secrets.token_hex(4).encode()
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(abstract)
    unix.listen()
    try:
        # the host server answers the host
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
        deadline = time.monotonic() + 5
        while server.accepted < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.accepted == 1
        r = _run(f"""
            import json, socket
            out = {{}}
            for name, address in [("host_loopback", ("127.0.0.1", {server.port})), ("internet", ("1.1.1.1", 80))]:
                try:
                    socket.create_connection(address, timeout=2).close()
                    out[name] = "connected"
                except OSError as exc:
                    out[name] = type(exc).__name__
            try:
                socket.getaddrinfo("pypi.org", 443)
                out["dns"] = "resolved"
            except OSError as exc:
                out["dns"] = type(exc).__name__
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect({abstract!r})
                out["abstract_unix"] = "connected"
            except OSError as exc:
                out["abstract_unix"] = type(exc).__name__
            print(json.dumps(out))
        """)
        assert r.passed, r.stderr
        seen = _report(r)
        assert seen["host_loopback"] == "ConnectionRefusedError"  # its own empty loopback
        assert seen["internet"] == "OSError" and seen["dns"] == "gaierror"  # no route, no resolver
        assert seen["abstract_unix"] == "ConnectionRefusedError"
        time.sleep(0.3)
        assert server.accepted == 1, "the sandbox reached the host's server"
    finally:
        server.close()
        unix.close()


def test_bounded_fork_is_stopped_at_the_process_limit_and_children_die():
    r = _run("""
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                children += 1
        except BlockingIOError:
            print(children, flush=True)
            raise
    """, max_processes=8)
    assert r.reason == "process_limit", r.detail
    assert "BlockingIOError" in r.detail
    # the program and bwrap's PID-1 process count against the limit too
    assert int(r.stdout) in (6, 7)
    assert r.wall_s < 20  # the sleeping children did not keep the run alive
    _assert_nothing_left(r)


def test_fork_bomb_ends_and_leaves_nothing():
    start = time.monotonic()
    r = _run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, timeout_s=3, max_processes=16)
    assert r.reason in ("wall_timeout", "cpu_limit") and r.killed and not r.passed
    assert time.monotonic() - start < 15
    _assert_nothing_left(r)
    # the host still forks
    assert subprocess.run(["true"]).returncode == 0


def test_unbounded_allocation_fails_at_the_memory_limit():
    r = _run("""
        import sys
        blocks = []
        try:
            while True:
                blocks.append(bytearray(16 << 20))
        except MemoryError:
            print(len(blocks) * 16, flush=True)
            raise
    """, memory_bytes=256 * MiB)
    assert r.reason == "memory_limit" and r.detail.endswith("MemoryError"), r.detail
    allocated_mib = int(r.stdout)
    assert 64 <= allocated_mib <= 256  # the interpreter's own mappings count against RLIMIT_AS too


def test_infinite_loop_hits_the_cpu_limit():
    r = _run("while True:\n    pass\n", timeout_s=60, cpu_s=1)  # CPU seconds, not wall: the machine may be busy
    assert (r.reason, r.signal, r.killed, r.timed_out) == ("cpu_limit", "SIGXCPU", True, False)
    assert r.exit_code == 128 + signal.SIGXCPU


def test_loop_ignoring_sigxcpu_is_killed_at_the_hard_cpu_limit():
    r = _run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n",
             timeout_s=60, cpu_s=1)
    assert (r.reason, r.signal, r.killed, r.timed_out) == ("cpu_limit", "SIGKILL", True, False)  # at soft + 1 s


def test_sleeping_forever_hits_the_wall_time_limit():
    start = time.monotonic()
    r = _run("import time\ntime.sleep(3600)\n", timeout_s=1)
    assert (r.reason, r.timed_out, r.killed, r.signal) == ("wall_timeout", True, True, "SIGKILL")
    assert (
        r.wall_s >= 1.0 and time.monotonic() - start >= 1.0
    )  # stopped at the limit, not before (a miss hangs to the pytest timeout)


def test_printing_without_bound_is_cut_and_killed():
    r = _run("while True:\n    print('x' * 999)\n", max_output_bytes=10_000)
    assert (r.reason, r.killed, r.stdout_truncated, r.stderr_truncated) == ("output_limit", True, True, False)
    assert r.stdout == ("x" * 999 + "\n") * 10 and len(r.stdout) == 10_000
    assert r.wall_s < 10


def test_file_size_and_disk_limits():
    big = _run("open('big', 'wb').write(b'x' * (2 << 20))", max_file_bytes=MiB)
    assert big.reason == "file_size_limit" and "[Errno 27]" in big.detail
    many = _run("""
        for i in range(100):
            with open(f"f{i}", "wb") as f:
                f.write(b"x" * (1 << 20))
    """, max_file_bytes=2 * MiB, disk_bytes=4 * MiB)
    assert many.reason == "disk_limit" and "[Errno 28]" in many.detail


def test_parent_environment_is_not_inherited(monkeypatch):
    secret = "tml-" + secrets.token_hex(16)
    monkeypatch.setenv("PREFECT_TINKER_TEST_SECRET", secret)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    r = _run(f"""
        import json, os
        out = {{"env": dict(os.environ), "proc": {{}}}}
        for path in ["/proc/self/environ", "/proc/1/environ", "/proc/{os.getpid()}/environ"]:
            try:
                out["proc"][path] = open(path, "rb").read().decode(errors="replace")
            except OSError as exc:
                out["proc"][path] = type(exc).__name__
        print(json.dumps(out))
    """)
    assert r.passed, r.stderr
    assert secret not in r.stdout + r.stderr
    seen = _report(r)
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "LC_CTYPE"}
    assert seen["env"]["HOME"] == "/sandbox"


def test_cannot_signal_its_parent_or_other_host_processes():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        r = _run(f"""
            import json, os, signal
            out = {{}}
            for name, pid in [("victim", {victim.pid}), ("host_test", {os.getpid()}), ("parent", os.getppid())]:
                try:
                    os.kill(pid, signal.SIGKILL)
                    out[name] = "sent"
                except OSError as exc:
                    out[name] = type(exc).__name__
            try:
                os.kill(-1, signal.SIGKILL)  # everything it may signal, except itself and its PID 1
                out["all"] = "sent"
            except OSError as exc:
                out["all"] = type(exc).__name__
            out["ppid"] = os.getppid()
            print(json.dumps(out))
        """)
        seen = _report(r)
        assert seen["victim"] in ("ProcessLookupError", "PermissionError")
        assert seen["host_test"] in ("ProcessLookupError", "PermissionError")
        assert seen["all"] == "ProcessLookupError"  # nobody else to signal
        assert seen["ppid"] == 1  # its parent is the sandbox's own PID 1, which ignores signals from inside
        time.sleep(0.2)
        assert victim.poll() is None, "a host process died"
    finally:
        victim.kill()
        victim.wait()


def test_no_privileges_inside():
    r = _run("""
        import ctypes, json, os
        out = {}
        try:
            os.setuid(0)
            out["setuid"] = "root"
        except OSError as exc:
            out["setuid"] = type(exc).__name__
        libc = ctypes.CDLL(None, use_errno=True)
        out["new_userns"] = libc.unshare(0x10000000)  # CLONE_NEWUSER: refused (--disable-userns)
        out["uid"] = os.getuid()
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        out["caps"], out["no_new_privs"] = status["CapEff"].strip(), status["NoNewPrivs"].strip()
        print(json.dumps(out))
    """)
    seen = _report(r)
    assert (seen["caps"], seen["no_new_privs"]) == ("0000000000000000", "1")
    assert seen["setuid"] in ("PermissionError", "OSError")  # EPERM, or EINVAL: uid 0 is not mapped
    assert (seen["new_userns"], seen["uid"]) == (-1, 1000)


def test_concurrent_runs_are_independent():
    def one(i: int):
        return run_python(f"import time\ntime.sleep(0.2)\nprint({i} * 7)")

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r.stdout for r in results] == [f"{i * 7}\n" for i in range(4)]
    if os.geteuid() == 0:
        assert len({r.uid for r in results}) == 4


def test_unavailable_mechanism_raises_and_runs_nothing(monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(SandboxUnavailable, match="no interpreter usable"):
        run_python("print(1)", config=SandboxConfig(python=str(tmp_path / "no-python")))
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        run_python(f"open({str(marker)!r}, 'w').write('x')")
    assert not marker.exists()
    with pytest.raises(ValueError, match="plain name"):
        run_python("", files={"../escape.py": ""})


def test_cli_sandbox_run_prints_json(tmp_path, capsys):
    from prefect_tinker.cli.main import main

    ok = tmp_path / "hello.py"
    ok.write_text("print('hello from the sandbox')\n")
    assert main(["sandbox", "run", str(ok), "--timeout", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stdout"] == "hello from the sandbox\n" and out["exit_code"] == 0 and out["reason"] == "ok"
    assert {"exit_code", "stdout", "stderr", "timed_out", "killed", "reason"} <= set(out)
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(60)\n")
    assert main(["sandbox", "run", str(slow), "--timeout", "1"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["timed_out"], out["killed"], out["reason"]) == (True, True, "wall_timeout")
    assert main(["sandbox", "run", str(tmp_path / "absent.py")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_console_script_runs_a_file(tmp_path):
    script = Path(sys.executable).with_name("prefect-tinker")
    if not script.exists():
        pytest.skip("the prefect-tinker console script is not installed in this environment")
    f = tmp_path / "p.py"
    f.write_text("import sys\nprint(sum(range(10)))\nsys.exit(4)\n")
    proc = subprocess.run([str(script), "sandbox", "run", str(f), "--timeout", "5"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["exit_code"], out["stdout"], out["reason"]) == (4, "45\n", "error")


def _with_marker(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_sandbox_dies_with_its_host_process():
    marker = "host-crash-" + secrets.token_hex(6)
    host = subprocess.Popen([sys.executable, "-c",
                             "from prefect_tinker.recipes.sandbox import SandboxConfig, run_python\n"
                             f"run_python('import time\\ntime.sleep(3600)', args=[{marker!r}],"
                             " config=SandboxConfig(timeout_s=600))"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while len(_with_marker(marker)) < 3 and time.monotonic() < deadline:  # reaper, bwrap, program
            time.sleep(0.1)
        assert len(_with_marker(marker)) >= 3, "the sandbox did not start"
    finally:
        host.kill()  # the host crashes: no cleanup code of ours runs
        host.wait()
    deadline = time.monotonic() + 60  # a liveness bound only: they go at once on a quiet machine
    while _with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _with_marker(marker) == [], "sandbox processes outlived their host"
