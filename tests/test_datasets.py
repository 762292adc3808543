"""Loading, validating and splitting chat datasets; making datums."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker

from prefect_tinker.recipes.datasets import (
    EXAMPLE_CHAT_PATH,
    Conversation,
    DatasetFormatError,
    build_datums,
    datum_from_example,
    load_conversations,
    split_conversations,
)
from tests.data_files import data_file


def _write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def _conv(q="hi", a="hello", **extra):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], **extra}


def test_example_chat_loads_and_is_varied():
    convs = load_conversations(EXAMPLE_CHAT_PATH)
    assert 35 <= len(convs) <= 60
    assert load_conversations("builtin:example_chat") == convs
    assert any(c.messages[0]["role"] == "system" for c in convs)
    assert any(sum(m["role"] == "assistant" for m in c.messages) > 1 for c in convs)
    assert convs[0].source == f"{EXAMPLE_CHAT_PATH}:1"
    assert len({c.messages[-1]["content"] for c in convs}) == len(convs)


def test_load_jsonl_with_other_field_and_metadata(tmp_path):
    records = [{"conv": _conv()["messages"], "id": 7}, "", {"conv": _conv("a", "b")["messages"]}]
    p = _write_jsonl(tmp_path / "d.jsonl", records)
    convs = load_conversations(str(p), messages_field="conv")
    assert [c.messages[1]["content"] for c in convs] == ["hello", "b"]
    assert convs[0].metadata == {"id": 7}
    assert convs[1].source.endswith("d.jsonl:3")  # blank line 2 skipped, line numbers kept


@pytest.mark.parametrize(
    "bad_line, pattern",
    [
        ('{"messages": [', r"d.jsonl:2: malformed JSON"),
        (json.dumps({"text": "x"}), r"d.jsonl:2: field 'messages' is missing \(record has: text\)"),
        (json.dumps({"messages": []}), r"d.jsonl:2: field 'messages' must be a non-empty list"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}),
         r"d.jsonl:2: field 'messages\[1\].role': unknown role 'bot'"),
        (json.dumps({"messages": [{"role": "user"}]}), r"d.jsonl:2: field 'messages\[0\].content' is missing"),
        (json.dumps({"messages": [{"content": "q"}]}), r"d.jsonl:2: field 'messages\[0\].role' is missing"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}), r"messages\[0\].content' must be a string"),
        (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
         r"d.jsonl:2: field 'messages' has no assistant message"),
        (json.dumps([1, 2]), r"d.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, bad_line, pattern):
    p = _write_jsonl(tmp_path / "d.jsonl", [_conv(), bad_line])
    with pytest.raises(DatasetFormatError, match=pattern):
        load_conversations(p)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetFormatError, match="no conversations"):
        load_conversations(tmp_path / "empty.jsonl")


def test_load_through_hf_datasets_local_parquet_dir(tmp_path):
    """The non-JSONL path runs the real ``datasets.load_dataset`` (offline, local files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "ds"
    (d / "data").mkdir(parents=True)
    rows = [_conv(f"q{i}", f"a{i}") for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), d / "data" / "train-00000-of-00001.parquet")
    convs = load_conversations(str(d))
    assert [c.messages[1]["content"] for c in convs] == ["a0", "a1", "a2"]
    assert convs[2].source.endswith("[train]:2")
    # a single .json file goes to the json builder; errors name the row
    j = _write_jsonl(tmp_path / "x.json", [_conv(), {"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(DatasetFormatError, match=r"x.json\[train\]:1: field 'messages' has no assistant"):
        load_conversations(str(j))
    with pytest.raises(DatasetFormatError, match="field 'chat' is missing"):
        load_conversations(str(d), messages_field="chat")


def test_loads_shared_dolly_slice():
    convs = load_conversations(data_file("sft/dolly_slice_messages.jsonl"))
    assert len(convs) == 151 and all(c.messages[-1]["role"] == "assistant" for c in convs)


def test_split_is_seeded_disjoint_and_ordered():
    items = [Conversation(messages=_conv(str(i))["messages"], source=str(i)) for i in range(20)]
    train, test = split_conversations(items, 0.25, seed=1)
    assert len(test) == 5 and len(train) == 15
    assert {c.source for c in train}.isdisjoint({c.source for c in test})
    assert [int(c.source) for c in train] == sorted(int(c.source) for c in train)
    assert split_conversations(items, 0.25, seed=1) == (train, test)
    assert split_conversations(items, 0.25, seed=2)[1] != test
    assert len(split_conversations(items, 3, seed=0)[1]) == 3
    assert split_conversations(items, 0, seed=0) == (items, [])
    with pytest.raises(ValueError, match="leaves no training"):
        split_conversations(items, 20)
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        split_conversations(items, 1.5)


def test_datum_from_example_shifts_inputs_against_targets():
    mi = tinker.ModelInput.from_ints([10, 11, 12, 13, 14])
    w = np.array([0, 0, 1, 1, 1], dtype=np.float32)
    d = datum_from_example(mi, w, max_length=None)
    assert isinstance(d, tinker.Datum)
    assert d.model_input.to_ints() == [10, 11, 12, 13]
    tt, ww = d.loss_fn_inputs["target_tokens"], d.loss_fn_inputs["weights"]
    assert tt.dtype == "int64" and ww.dtype == "float32"
    assert tt.tolist() == [11, 12, 13, 14] and ww.tolist() == [0, 1, 1, 1]
    # truncation keeps alignment: max_length tokens of the example, max_length - 1 inputs
    d = datum_from_example(mi, w, max_length=3)
    assert d.model_input.to_ints() == [10, 11]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [11, 12]
    assert d.loss_fn_inputs["weights"].tolist() == [0, 1]


def test_datum_from_example_errors():
    mi = tinker.ModelInput.from_ints([1, 2, 3, 4])
    with pytest.raises(ValueError, match="no trained token"):
        datum_from_example(mi, np.array([0, 0, 0, 1], np.float32), max_length=3)
    with pytest.raises(ValueError, match=r"expected \(4,\)"):
        datum_from_example(mi, np.ones(3, np.float32), max_length=None)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        datum_from_example([5], np.ones(1, np.float32))


def test_build_datums_with_a_renderer():
    class FakeRenderer:  # tokens = message lengths; trains on the assistant part
        def build_supervised_example(self, conv, train_on_what):
            msgs = conv.messages
            n_prompt, n_reply = len(msgs[0]["content"]), len(msgs[1]["content"])
            tokens = list(range(n_prompt + n_reply))
            return tinker.ModelInput.from_ints(tokens), np.array([0] * n_prompt + [1] * n_reply, np.float32)

    convs = [Conversation(_conv("aaaa", "bb")["messages"], "f:1"), Conversation(_conv("a" * 9, "b")["messages"], "f:2")]
    datums = build_datums(convs, FakeRenderer(), max_length=6)
    assert len(datums) == 1  # the second has its reply cut off by max_length
    with pytest.raises(ValueError, match="f:2: no trained token"):
        build_datums(convs, FakeRenderer(), max_length=6, skip_empty=False)
