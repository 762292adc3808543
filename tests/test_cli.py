"""prefect-tinker CLI: sql over the store, key=value parsing, YAML configs, validation, run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from prefect_tinker.cli import main as cli
from tinker_blocks.store_io import TRAINING_TABLES, ParquetStore


@pytest.fixture
def store_root(tmp_path):
    root = tmp_path / "store"
    io = ParquetStore(str(root), "training", TRAINING_TABLES)
    with io.writer("metrics") as w:
        for step in range(3):
            w.write(run_id="r1", step=step, name="train/loss", value=1.0 / (step + 1))
        w.write(run_id="r2", step=0, name="train/loss", value=float("nan"))
    with io.writer("runs") as w:
        w.write(run_id="r1", status="completed", base_model="tiny", lora_rank=4)
    return str(root)


# ----- sql ----------------------------------------------------------------------------------------
def test_sql_table_output(store_root, capsys):
    rc = cli.main(["sql", "--store", store_root,
                   "SELECT step, value FROM metrics WHERE run_id = 'r1' ORDER BY step"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0].split("|")[0].strip() == "step" and lines[0].split("|")[1].strip() == "value"
    assert [ln.split("|")[1].strip() for ln in lines[2:5]] == ["1", "0.5", "0.333333"]
    assert lines[-1] == "(3 rows)"


def test_sql_json_output(store_root, capsys):
    rc = cli.main(["sql", "--store", store_root, "--json",
                   "SELECT run_id, step, value, time FROM metrics ORDER BY run_id, step"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(rows) == 4
    assert rows[0]["run_id"] == "r1" and rows[0]["step"] == 0 and rows[0]["value"] == 1.0
    assert rows[3]["value"] is None  # NaN -> null: the output stays valid JSON
    assert rows[0]["time"].endswith("+00:00")


def test_sql_empty_store_and_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = cli.main(["sql", "--store", str(empty), "--json", "SELECT * FROM checkpoints"])
    assert rc == 0 and json.loads(capsys.readouterr().out) == []
    # a local root that does not exist is a mistake (a typo), not an empty store: one line, rc 1
    for argv in (["sql", "--store", str(tmp_path / "none"), "SELECT * FROM runs"],
                 ["runs", "--store", str(tmp_path / "none")]):
        assert cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err == (f"error: store root {tmp_path / 'none'} does not exist (no run has written "
                       "there; give --store ROOT or set $PREFECT_TINKER_STORE)\n")
    rc = cli.main(["sql", "--store", str(tmp_path), "SELECT * FROM nope"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error:") and "nope" in err


def test_runs_and_checkpoints_helpers(store_root, capsys):
    assert cli.main(["runs", "--store", store_root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["run_id"] == "r1" and rows[0]["steps_done"] == 3  # train metrics at steps 0..2
    assert cli.main(["checkpoints", "r1", "--store", store_root]) == 0
    assert capsys.readouterr().out.strip().endswith("(0 rows)")
    # a run id that is not in the store: one line naming it, exit 2 (not an empty table)
    assert cli.main(["checkpoints", "nosuchrun", "--store", store_root]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: no run 'nosuchrun' in the store {store_root} "
                                 f"(prefect-tinker runs --store {store_root} lists them)\n")


def test_runs_steps_done_counts_optimizer_steps(tmp_path, capsys):
    """A 12-step SFT run logs train/* at steps 0..11 (the batch at index s, before update s + 1),
    test/nll at 0 and 12 (after the last update) and its final checkpoint at 12: 12 steps, not 13.
    A run killed after 5 updates whose last checkpoint was at 4 took 5."""
    io = ParquetStore(str(tmp_path), "training", TRAINING_TABLES)
    with io.writer("metrics") as w:
        for step in range(12):
            w.write(run_id="done12", step=step, name="train/loss", value=1.0)
            w.write(run_id="done12", step=step, name="train/learning_rate", value=1e-3)
        for step in (0, 12):
            w.write(run_id="done12", step=step, name="test/nll", value=2.0)
        for step in range(5):
            w.write(run_id="killed5", step=step, name="train/loss", value=1.0)
        w.write(run_id="killed5", step=4, name="time/save_seconds", value=0.1)
    with io.writer("checkpoints") as w:
        w.write(run_id="done12", step=12, name="final", kind="state", path="tinker://m/weights/final")
        w.write(run_id="killed5", step=4, name="s4", kind="state", path="tinker://m/weights/s4")
        w.write(run_id="ckpt-only", step=7, name="s7", kind="state", path="tinker://m/weights/s7")
    with io.writer("runs") as w:
        for run in ("done12", "killed5", "ckpt-only", "fresh"):
            w.write(run_id=run, status="completed")
    assert cli.main(["runs", "--store", str(tmp_path), "--json"]) == 0
    steps = {r["run_id"]: r["steps_done"] for r in json.loads(capsys.readouterr().out)}
    assert steps == {"done12": 12, "killed5": 5, "ckpt-only": 7, "fresh": None}


def test_console_script_subprocess(store_root):
    proc = subprocess.run(
        [sys.executable, "-m", "prefect_tinker.cli.main", "sql", "--store", store_root, "--json",
         "SELECT count(*) AS n FROM metrics"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"n": 4}]


# ----- key=value and YAML -------------------------------------------------------------------------
def test_parse_value_yaml_scalars():
    assert cli.parse_value("8") == 8 and isinstance(cli.parse_value("8"), int)
    assert cli.parse_value("1e-4") == pytest.approx(1e-4)
    assert cli.parse_value("3.") == 3.0 and cli.parse_value("-2.5E3") == -2500.0
    assert cli.parse_value("true") is True and cli.parse_value("False") is False
    assert cli.parse_value("null") is None
    assert cli.parse_value("no") == "no" and cli.parse_value("on") == "on"  # not YAML 1.1 bools
    assert cli.parse_value("1:20") == "1:20" and cli.parse_value("08") == 8
    assert cli.parse_value("[1, 2]") == [1, 2] and cli.parse_value("{a: 1}") == {"a": 1}
    assert cli.parse_value("") == "" and cli.parse_value("a: b: c") == "a: b: c"
    assert cli.parse_value("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert math.isinf(cli.parse_value(".inf"))


def test_parse_overrides_nested():
    got = cli.parse_overrides(["lora_rank=8", "optim.lr=1e-4", "optim.betas=[0.9, 0.95]",
                               "data.path=/x/y=z.jsonl", "name=run-1"])
    assert got == {"lora_rank": 8, "optim": {"lr": 1e-4, "betas": [0.9, 0.95]},
                   "data": {"path": "/x/y=z.jsonl"}, "name": "run-1"}
    for bad, msg in [("novalue", "expected key=value"), ("a..b=1", "empty part"),
                     (".a=1", "empty part")]:
        with pytest.raises(cli.CLIError, match=msg):
            cli.parse_overrides([bad])
    with pytest.raises(cli.CLIError, match="'a' is set to a value"):
        cli.parse_overrides(["a=1", "a.b=2"])


def test_repeated_key_is_an_error(toy, tmp_path, capsys):
    with pytest.raises(cli.CLIError, match=r"key 'optim.lr' given twice on the command line: "
                                           r"'optim.lr=1e-3' and 'optim.lr=2e-3'"):
        cli.parse_overrides(["optim.lr=1e-3", "x=1", "optim.lr=2e-3"])
    rc = cli.main(["run", "toy", "base_model=m", "lora_rank=4", "lora_rank=8"])
    assert rc == 2 and toy.CALLS == []
    assert capsys.readouterr().err == (
        "error: key 'lora_rank' given twice on the command line: 'lora_rank=4' and 'lora_rank=8'\n")
    # still allowed: sibling keys of a group, and a YAML value overridden once on the command line
    assert cli.parse_overrides(["optim.lr=1", "optim.beta2=0.9"]) == {"optim": {"lr": 1, "beta2": 0.9}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("base_model: m\nlora_rank: 4\n")
    assert cli.main(["run", "toy", "--config", str(cfg), "lora_rank=8"]) == 0
    assert toy.CALLS[-1].lora_rank == 8


def test_deep_merge():
    assert cli.deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4}) == {
        "a": {"x": 1, "y": 3}, "b": 1, "c": 4}


def test_load_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(cli.CLIError, match=r"invalid YAML in .*bad\.yaml:\d+:\d+"):
        cli.load_yaml_file(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(cli.CLIError, match="must hold a mapping"):
        cli.load_yaml_file(lst)
    with pytest.raises(cli.CLIError, match="cannot read config file"):
        cli.load_yaml_file(tmp_path / "missing.yaml")


# ----- run with a throwaway flow module ----------------------------------------------------------
FLOW_MODULE = '''
from pydantic import BaseModel, Field

class Optim(BaseModel):
    learning_rate: float = Field(1e-4, gt=0, description="Adam learning rate.")
    beta2: float = 0.95

class ToyConfig(BaseModel):
    model_config = {"extra": "forbid"}
    base_model: str = Field(description="Model name.")
    lora_rank: int = Field(32, ge=1)
    epochs: int = 1
    use_thing: bool = False
    optim: Optim = Optim()

CALLS = []

def toy_flow(config: ToyConfig) -> dict:
    CALLS.append(config)
    return {"rank": config.lora_rank, "lr": config.optim.learning_rate}

def broken_flow(config: ToyConfig) -> None:
    raise RuntimeError("boom")
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    mod_dir = tmp_path / "mods"
    mod_dir.mkdir()
    (mod_dir / "toy_flows_mod.py").write_text(FLOW_MODULE)
    monkeypatch.syspath_prepend(str(mod_dir))
    from prefect_tinker.flows.registry import RECIPES, Recipe

    monkeypatch.setitem(RECIPES, "toy", Recipe("toy", "toy_flows_mod:toy_flow"))
    import toy_flows_mod

    toy_flows_mod.CALLS.clear()
    yield toy_flows_mod
    sys.modules.pop("toy_flows_mod", None)


def test_run_key_values_and_yaml(toy, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent("""\
        base_model: tiny
        lora_rank: 4
        optim:
          learning_rate: 3e-4
          beta2: 0.99
    """))
    rc = cli.main(["run", "toy", "--config", str(cfg), "lora_rank=8", "optim.learning_rate=1e-3",
                   "use_thing=true"])
    assert rc == 0, capsys.readouterr().err
    (conf,) = toy.CALLS
    assert conf.base_model == "tiny" and conf.lora_rank == 8 and conf.use_thing is True
    assert conf.optim.learning_rate == pytest.approx(1e-3) and conf.optim.beta2 == 0.99
    assert json.loads(capsys.readouterr().out) == {"rank": 8, "lr": 0.001}
    # key=value before and after --config
    assert cli.main(["run", "toy", "epochs=2", "--config", str(cfg), "lora_rank=2"]) == 0
    assert toy.CALLS[-1].epochs == 2 and toy.CALLS[-1].lora_rank == 2
    assert toy.CALLS[-1].optim.learning_rate == pytest.approx(3e-4)


def test_run_validation_errors_exit_2(toy, capsys):
    rc = cli.main(["run", "toy", "lora_rank=abc", "optim.learning_rate=-1"])
    err = capsys.readouterr().err
    assert rc == 2 and toy.CALLS == []
    assert "invalid config for flow 'toy' (ToyConfig)" in err
    assert "base_model: required field missing" in err
    assert "lora_rank = 'abc'" in err and "valid integer" in err and "(from command line)" in err
    assert "optim.learning_rate = -1" in err and "greater than 0" in err
    assert "Traceback" not in err


def test_run_unknown_field_suggests(toy, capsys):
    rc = cli.main(["run", "toy", "base_model=tiny", "lora_rnak=8", "optim.lr=1", "epochs=x"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "lora_rnak: unknown field (did you mean 'lora_rank'?)" in err
    assert "optim.lr: unknown field (did you mean 'optim.learning_rate'?)" in err
    assert "epochs = 'x'" in err  # value errors are reported together with unknown fields
    assert "Extra inputs" not in err  # not reported twice


def test_run_dry_run_unknown_flow_and_failure(toy, capsys):
    assert cli.main(["run", "toy", "base_model=tiny", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["lora_rank"] == 32 and toy.CALLS == []
    assert cli.main(["run", "nosuch"]) == 2
    assert "unknown flow 'nosuch'" in capsys.readouterr().err
    assert cli.main(["run", "toy_flows_mod:broken_flow", "base_model=x"]) == 1
    assert "RuntimeError: boom" in capsys.readouterr().err
    assert cli.main(["run", "toy", "base_model=x", "--bogus"]) == 2


def test_run_registered_recipe(toy, monkeypatch, capsys):
    from prefect_tinker.flows.registry import RECIPES, Recipe

    monkeypatch.setitem(RECIPES, "other", Recipe("other", "toy_flows_mod:toy_flow"))
    assert cli.main(["run", "other", "base_model=m"]) == 0
    assert toy.CALLS[-1].base_model == "m"


def test_run_prefect_flow(toy, tmp_path, monkeypatch, capsys):
    """A real Prefect flow: the config class is found through Flow.fn."""
    from prefect import flow

    monkeypatch.setattr(toy, "pflow", flow(toy.toy_flow), raising=False)
    _, model = cli.resolve_flow("toy_flows_mod:pflow")
    assert model is toy.ToyConfig


def test_show_config(toy, capsys):
    assert cli.main(["show-config", "toy"]) == 0
    out = capsys.readouterr().out
    assert "base_model: null  # required" in out and "lora_rank: 32" in out
    assert "  learning_rate: 0.0001  # Adam learning rate." in out
    assert cli.main(["show-config", "toy", "--schema"]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "ToyConfig"


def test_local_help_names_prefect_tinker(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["local", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: prefect-tinker local ")
    assert "status" in out and "stop" in out and "python -m" not in out


def test_local_status_and_stop_a_real_embedded_server(tmp_path, capsys):
    """The server a flow starts (TinkerCredentials local mode) is shown by `local status` and
    stopped by `local stop`: the process exits, server.json is removed."""
    from tinker_blocks import TinkerCredentials
    from tinker_blocks.credentials import ensure_local_server
    from tinker_local.launcher import healthy
    from tinker_local.procs import pid_alive

    root = tmp_path / "local"
    record = ensure_local_server(TinkerCredentials(local=True, local_root=str(root)))
    try:
        assert cli.main(["local", "status", "--root", str(root)]) == 0
        assert capsys.readouterr().out == (f"running: pid {record['pid']}, {record['base_url']} (healthy), "
                                           f"root {root}, log {root / 'server.log'}\n")
        assert cli.main(["local", "stop", "--root", str(root)]) == 0
        assert capsys.readouterr().out == f"stopped local server pid {record['pid']} ({record['base_url']})\n"
        assert not pid_alive(record["pid"]) and not healthy(record["base_url"])
        assert not (root / "server.json").exists()
        assert cli.main(["local", "status", "--root", str(root)]) == 1
        assert cli.main(["local", "stop", "--root", str(root)]) == 0  # nothing to stop: fine
        assert capsys.readouterr().out == f"no local server recorded in {root / 'server.json'}\n" * 2
    finally:
        if pid_alive(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)


# answers the health check and ignores SIGTERM: `local stop` must SIGKILL it after 5 s
STUBBORN = """
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def test_local_stop_kills_a_server_ignoring_sigterm_and_spares_a_reused_pid(tmp_path, capsys):
    from tinker_local.procs import pid_alive

    root = tmp_path / "local"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["sleep", "60"])
    try:
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        (root / "server.json").write_text(json.dumps({"pid": proc.pid, "base_url": url}))
        t0 = time.monotonic()
        assert cli.main(["local", "stop", "--root", str(root)]) == 0
        assert 4.5 < time.monotonic() - t0 < 15  # SIGTERM ignored for 5 s, then SIGKILL
        assert not pid_alive(proc.pid)  # (already reaped by the stop, as our child)
        assert not (root / "server.json").exists()
        # a live pid that is neither healthy nor tinker_local (a reused pid) is left alone
        (root / "server.json").write_text(json.dumps({"pid": other.pid, "base_url": "http://127.0.0.1:9"}))
        assert cli.main(["local", "stop", "--root", str(root)]) == 1
        assert "does not look like the local server" in capsys.readouterr().err
        assert pid_alive(other.pid) and (root / "server.json").exists()
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()



# ----- defaults and early errors a new user meets ---------------------------------------------------
def test_flows_default_store_is_the_cli_default(tmp_path, monkeypatch, capsys):
    """Without store=..., a run writes where `prefect-tinker runs` / `sql` read: $PREFECT_TINKER_STORE,
    else $PREFECT_TINKER_HOME/store, else ~/.prefect-tinker/store (HOME pointed at tmp_path)."""
    from prefect_tinker.flows.rl_config import RLConfig
    from prefect_tinker.flows.sft import SFTConfig

    env_root = tmp_path / "env-store"
    monkeypatch.setenv("PREFECT_TINKER_STORE", str(env_root))
    assert SFTConfig().store == RLConfig().store == str(env_root)
    assert cli.main(["run", "sft", "max_steps=1", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == str(env_root)
    # a run row written at the flow config's default store is what `runs` lists without --store
    io = ParquetStore(SFTConfig().store, "training", TRAINING_TABLES)
    with io.writer("runs") as w:
        w.write(run_id="default-store-run", status="completed", base_model="tiny", lora_rank=4)
    assert cli.main(["runs", "--json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == ["default-store-run"]

    monkeypatch.delenv("PREFECT_TINKER_STORE")
    monkeypatch.delenv("PREFECT_TINKER_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert SFTConfig().store == RLConfig().store == str(tmp_path / "home" / ".prefect-tinker" / "store")


@pytest.mark.parametrize("flow,extra", [("sft", []), ("rl", ["env=math"])])
def test_missing_dataset_file_fails_at_config_time(flow, extra, tmp_path, monkeypatch, capsys):
    """A path-like dataset that does not exist is a config error (rc 2, one line naming the field
    and the path) before Prefect or a server starts; --dry-run catches it too; HF ids pass."""
    monkeypatch.setenv("PREFECT_TINKER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    model = cli.resolve_flow(flow)[1]
    for value, shown in [("/tmp/nope/chats.jsonl", "/tmp/nope/chats.jsonl"), ("chats.jsonl", tmp_path / "chats.jsonl"),
                         ("./data/p.parquet", tmp_path / "data" / "p.parquet"), ("d.json", tmp_path / "d.json")]:
        for dry in ([], ["--dry-run"]):
            assert cli.main(["run", flow, *extra, f"dataset={value}", *dry]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err == (f"error: invalid config for flow {flow!r} ({model.__name__}): "
                                         f"dataset = {value!r}: file not found: {shown} (from command line)\n")
    assert not (tmp_path / "store").exists()  # nothing recorded
    # a file that exists and holds a valid record (for SFT and for the math env): its data is checked too
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "1+1?"},
                                                                  {"role": "assistant", "content": "2"}],
                                                     "question": "1+1?", "answer": "2"}) + "\n")
    for value in ["chats.jsonl", "HuggingFaceH4/no_robots", "openai/gsm8k"]:  # a file that exists, HF ids
        assert cli.main(["run", flow, *extra, f"dataset={value}", "--dry-run"]) == 0
        assert json.loads(capsys.readouterr().out)["dataset"] == value


def test_local_serve_on_a_busy_port_fails_before_loading_a_model(tmp_path, capsys):
    """`local serve` on a port another process listens on: one line naming host, port and the OS
    error, exit 2, at once (no model is loaded first)."""
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        rc = cli.main(["local", "serve", "--model", "tiny", "--port", str(port), "--root", str(tmp_path)])
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and took < 2.0, (rc, took)
    assert err.count("\n") == 1 and err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert "Address already in use" in err
