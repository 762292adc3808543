"""Bad input found before anything starts, with a clear one-line message: an undecodable byte
in a JSONL dataset names file, line and byte column; an unknown local base model fails at
config time (presets, directories and cached hub ids pass; hosted names pass unchanged)."""

from __future__ import annotations

import gzip
import json

import pytest

from prefect_tinker.recipes.data_reading import SkipStats, iter_conversations
from prefect_tinker.recipes.data_sources import DatasetFormatError
from tinker_blocks.model_names import UnknownModelName, check_model_name

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "héllo"}]}


@pytest.mark.parametrize("gz", [False, True])
def test_undecodable_byte_names_file_line_and_column(tmp_path, gz):
    line = json.dumps(GOOD, ensure_ascii=False).encode()
    bad = line.replace("héllo".encode(), b"h\xe9llo")  # latin-1 byte in a UTF-8 file
    data = b"\n".join([line, line, bad, line]) + b"\n"
    path = tmp_path / ("d.jsonl.gz" if gz else "d.jsonl")
    path.write_bytes(gzip.compress(data) if gz else data)
    col = bad.index(b"\xe9") + 1
    with pytest.raises(DatasetFormatError) as err:
        list(iter_conversations(str(path)))
    assert str(err.value) == (f"{path}:3: not valid UTF-8 (byte 0xe9 at byte column {col}: invalid continuation byte)")
    stats = SkipStats()
    kept = list(iter_conversations(str(path), on_error="skip", stats=stats))
    assert [c.source for c in kept] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    assert kept[0].messages[1]["content"] == "héllo" and stats.total == 1


def test_check_model_name_local_and_hosted(tmp_path, monkeypatch):
    root = tmp_path / "local"
    assert check_model_name("tiny", root) == "tiny"
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert check_model_name("./my-model", root) == str(model_dir.resolve())  # absolute for the server
    with pytest.raises(UnknownModelName, match=r"model directory '.*empty' has no config.json"):
        (tmp_path / "empty").mkdir()
        check_model_name("empty", root)
    with pytest.raises(UnknownModelName, match=r"base model directory '.*/nope' does not exist"):
        check_model_name("./nope", root)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-empty"))
    with pytest.raises(UnknownModelName) as err:
        check_model_name("Qwen/Qwen3-8B", root)
    assert str(err.value).startswith("unknown base model 'Qwen/Qwen3-8B' for the local server; accepted: 'tiny'")
    assert "\n" not in str(err.value)
    with pytest.raises(UnknownModelName, match="unknown base model 'tiyn'"):
        check_model_name("tiyn", root)
    with pytest.raises(UnknownModelName, match="non-empty"):
        check_model_name(" ", None)
    assert check_model_name("Qwen/Qwen3-8B", None) == "Qwen/Qwen3-8B"  # hosted: the service decides
