"""Data errors up front: `prefect-tinker run` reads and validates the run's data before anything
starts (no flow run, no server, no store row) and reports the first bad record in one line naming
file, line and field, exit status 2; the traceback only with --debug."""

from __future__ import annotations

import json
import re

import pytest

from prefect_tinker.cli import main as cli

GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def files(tmp_path):
    good = json.dumps(GOOD)
    (tmp_path / "broken.jsonl").write_text(f'{good}\n{{"messages": [broken\n')
    # a record cut short at the end of its line: the column where it ends, not column 1 of the next line (CRLF too)
    (tmp_path / "unfinished.jsonl").write_bytes(f'{good}\r\n{{"messages": []\r\n{good}\r\n'.encode())
    (tmp_path / "missing.jsonl").write_text(f'{good}\n{good}\n{{"msgs": []}}\n')
    (tmp_path / "problems.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    return tmp_path


@pytest.mark.parametrize("argv,expected", [
    (["sft", "dataset={d}/broken.jsonl"], "{d}/broken.jsonl:2: malformed JSON (Expecting value at column 15)"),
    (["sft", "dataset={d}/unfinished.jsonl"],
     "{d}/unfinished.jsonl:2: malformed JSON (Expecting ',' delimiter at column 16)"),
    (["sft", "dataset={d}/missing.jsonl"], "{d}/missing.jsonl:3: field 'messages' is missing (record has: msgs)"),
    (["dpo", "dataset={d}/missing.jsonl"], "{d}/missing.jsonl:1: field 'chosen'"),
    (["rl", "env=math", "dataset={d}/problems.jsonl"], "{d}/problems.jsonl:2"),
    # a stage of RLHF: its section named before the file (PreflightChecks.checked_sections)
    (["rlhf", "sft.dataset={d}/missing.jsonl", "rm.dataset={d}/missing.jsonl"],
     "sft: {d}/missing.jsonl:3: field 'messages' is missing"),
])
def test_bad_data_is_one_line_before_anything_starts(files, argv, expected, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may talk to Prefect
    store = files / "store"
    argv = [a.format(d=files) for a in argv]
    for extra in ([], ["--dry-run"]):
        assert cli.main(["run", *argv, "model=tiny", f"store={store}", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"error: invalid data for flow {argv[0]!r}: {expected.format(d=files)}"), err
        assert "Traceback" not in err
    assert not store.exists()  # nothing recorded, no server started


def test_unknown_format_or_option_is_a_config_error_before_anything_starts(files, capsys, monkeypatch):
    """A format's name and its options are part of the config (a union tagged by ``format``):
    one line naming the field and value, before any data is read."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may talk to Prefect
    store = files / "store"
    for argv, expected in (
        (["format=nosuch"], "format = 'nosuch': unknown dataset format 'nosuch'; registered: alpaca,"),
        (["options.role_mapp={}"], "format 'messages': options.role_mapp: Extra inputs are not permitted"),
        (["format=instruction", "options.role_map={}"], "format 'instruction': options.role_map: Extra inputs"),
    ):
        assert cli.main(["run", "sft", f"dataset={files}/missing.jsonl", *argv, "model=tiny", f"store={store}"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"error: invalid config for flow 'sft' (SFTConfig): {expected}"), err
    assert not store.exists()


def test_debug_shows_the_traceback(files, capsys):
    argv = ["run", "sft", f"dataset={files}/broken.jsonl", "model=tiny", f"store={files}/store", "--debug"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "DatasetFormatError" in err
    assert err.splitlines()[-1] == f"error: invalid data for flow 'sft': {files}/broken.jsonl:2: malformed JSON " \
                                   "(Expecting value at column 15)"


@pytest.mark.parametrize("flow,config", [("sft", "SFTConfig"), ("dpo", "DPOConfig")])
def test_a_file_no_file_type_reads_is_one_line_before_anything_starts(files, flow, config, capsys, monkeypatch):
    """``dataset=`` an existing file whose ending no registered file type claims: one line naming
    the path, the registered file types with their endings and how to choose one (exit 2), not a
    ``DatasetGenerationError`` traceback from reading it as JSON inside the run."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may talk to Prefect
    store = files / "store"
    chats = files / "chats.txt"
    chats.write_text(json.dumps(GOOD) + "\n")
    for extra in ([], ["--dry-run"]):
        assert cli.main(["run", flow, "model=tiny", f"dataset={chats}", f"store={store}", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (
            f"error: invalid config for flow {flow!r} ({config}): dataset = '{chats}': no file type reads the ending "
            "'.txt' (registered: arrow (.arrow), csv (.csv), json (.json), jsonl (.jsonl .ndjson .jsonl.gz "
            f".ndjson.gz), parquet (.parquet)); choose one with sources: [{{path: {chats}, file_type: <name>}}] "
            "(from command line)\n"
        )
    assert not store.exists()  # nothing recorded, no server started


@pytest.mark.parametrize("flow", ["sft", "dpo", "reward_model", "decisions"])
def test_sources_alone_leave_the_default_dataset_unset(files, flow):
    """A recipe config given ``sources`` only: its default ``dataset`` is not "given" (dropped, so
    the config round-trips); both given explicitly is still the one-line error."""
    model = cli.resolve_flow(flow)[1]
    chats = files / "chats.txt"
    chats.write_text(json.dumps(GOOD) + "\n")
    sources = [{"path": str(chats), "file_type": "jsonl"}]
    config = model(sources=sources)
    assert config.dataset is None and [s.path for s in config.source_specs()] == [str(chats)]
    assert model.model_validate(config.model_dump(mode="json")) == config
    assert model(sources=sources, dataset=None).dataset is None
    with pytest.raises(ValueError, match=re.escape("give either dataset=... or sources=[...], not both")):
        model(sources=sources, dataset=str(files / "problems.jsonl"))


def test_sources_alone_in_a_yaml_config(files, capsys, monkeypatch):
    """``run sft --config x.yaml`` whose YAML holds only ``sources`` runs its checks (exit 0 with
    --dry-run); a YAML giving ``dataset`` too is refused in one line."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing may talk to Prefect
    store = files / "store"
    chats = files / "chats.txt"
    chats.write_text(f"{json.dumps(GOOD)}\n{json.dumps(GOOD)}\n")
    yaml = files / "x.yaml"
    yaml.write_text(f"sources: [{{path: {chats}, file_type: jsonl}}]\n")
    assert cli.main(["run", "sft", "--config", str(yaml), "model=tiny", f"store={store}", "--dry-run"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["dataset"] is None and shown["sources"][0]["path"] == str(chats)
    yaml.write_text(f"dataset: builtin:example_chat\nsources: [{{path: {chats}, file_type: jsonl}}]\n")
    assert cli.main(["run", "sft", "--config", str(yaml), "model=tiny", f"store={store}", "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "error: invalid config for flow 'sft' (SFTConfig): give either dataset=... or sources=[...], not both\n")
    assert not store.exists()
