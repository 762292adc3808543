"""Converters (messages, sharegpt, instruction/Alpaca/Dolly, prompt/completion, HH dialogues,
self-instruct), field mappings, and the real data in ../shared/data with trained-token counts
computed independently of the renderers."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from prefect_tinker.recipes.data_pipeline import SupervisedDataset
from prefect_tinker.recipes.data_reading import SkipStats, SourceSpec
from prefect_tinker.recipes.data_sources import (
    RecordError,
    convert_record,
    get_field,
    parse_dialogue,
    preference_from_dialogues,
)
from prefect_tinker.recipes.datasets import DatasetFormatError, load_conversations
from prefect_tinker.recipes.renderers import get_renderer
from tests.data_files import data_file
from tests.renderer_tokenizers import needs_smollm2, smollm2


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _msgs(c):
    return [(m["role"], m["content"]) for m in c.messages]


def test_get_field_paths_and_errors():
    rec = {"a": {"b": [{"c": 1}, {"c": 2}]}, "x": "y"}
    assert get_field(rec, "a.b[1].c") == 2 and get_field(rec, "a.b.0.c") == 1
    with pytest.raises(RecordError, match=r"field 'a.q' is missing \('a' has: b\)"):
        get_field(rec, "a.q")
    with pytest.raises(RecordError, match=r"field 'a.b\[5\].c' is missing .* has 2 items"):
        get_field(rec, "a.b[5].c")
    with pytest.raises(RecordError, match=r"field 'z' is missing \(record has: a, x\)"):
        get_field(rec, "z")


def test_converters_each_format():
    one = lambda rec, fmt, **kw: convert_record(rec, fmt, kw.get("fields"), kw.get("options"))
    (c,) = one({"instruction": "Sum", "input": "2 3", "output": "5"}, "alpaca", options={"system_prompt": "Be exact."})
    assert [(m["role"], m["content"]) for m in c.messages] == [
        ("system", "Be exact."),
        ("user", "Sum\n\n2 3"),
        ("assistant", "5"),
    ]
    (c,) = one({"instruction": "Say hi", "context": "", "response": "hi"}, "dolly")
    assert c.messages[0]["content"] == "Say hi" and c.field == "instruction+response"
    (c,) = one({"q": "Q?", "a": {"text": "A."}}, "instruction", fields={"instruction": "q", "output": "a.text"})
    assert c.messages[1]["content"] == "A." and c.used == {"q", "a"}
    (c,) = one(
        {"prompt": "P", "completion": " C END"}, "prompt_completion", options={"strip_completion_suffix": " END"}
    )
    assert c.messages[1]["content"] == " C"
    (c,) = one({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, "sharegpt")
    assert [m["role"] for m in c.messages] == ["user", "assistant"]
    (c,) = one(
        {"chat": [{"speaker": "bot", "text": "x"}]},
        "messages",
        fields={"messages": "chat", "role": "speaker", "content": "text"},
        options={"role_map": {"bot": "assistant"}},
    )
    assert c.messages == [{"role": "assistant", "content": "x"}]
    convs = one({"instruction": "Classify", "instances": [{"input": "a", "output": "x"}, {"input": "", "output": "y"}]},
                "self_instruct")
    assert [c.messages[0]["content"] for c in convs] == ["Classify\n\na", "Classify"]
    assert convs[1].field == "instruction+instances[1]"
    with pytest.raises(RecordError, match=r"field 'output' is missing \(record has: instruction\)"):
        one({"instruction": "x"}, "alpaca")
    with pytest.raises(RecordError, match=r"field 'completion' is empty"):
        one({"prompt": "p", "completion": "  "}, "prompt_completion")
    with pytest.raises(RecordError, match=r"field 'instances\[0\].output' is missing"):
        one({"instruction": "x", "instances": [{"input": "a"}]}, "self_instruct")
    with pytest.raises(ValueError, match="unknown dataset format 'csvv'.*prompt_completion"):
        one({}, "csvv")


def test_parse_dialogue():
    text = "\n\nHuman: Hi there\n\nAssistant:  Hello!\n\nHuman: Say Human: twice\n\nAssistant: Human: Human:"
    assert parse_dialogue(text) == [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Say Human: twice"}, {"role": "assistant", "content": "Human: Human:"},
    ]
    assert parse_dialogue("Human: a\n\nAssistant: b")[1] == {"role": "assistant", "content": "b"}
    with pytest.raises(ValueError, match="text before the first"):
        parse_dialogue("preamble\n\nHuman: a")
    with pytest.raises(ValueError, match="no '"):
        parse_dialogue("  \n")
    pair = preference_from_dialogues(text, text.rsplit("\n\nAssistant:", 1)[0] + "\n\nAssistant: No.")
    assert pair.prompt == parse_dialogue(text)[:3]
    assert pair.chosen == [{"role": "assistant", "content": "Human: Human:"}] and pair.rejected[0]["content"] == "No."


def test_bad_input_errors_name_file_line_and_field(tmp_path, caplog):
    good = {"instruction": "q", "output": "a"}
    p = _jsonl(tmp_path / "d.jsonl", [good, '{"instruction": ', {"instruction": "q"}, {"instruction": "q", "output": 3},
                                      [1], good])
    with pytest.raises(DatasetFormatError, match=r"d.jsonl:2: malformed JSON"):
        load_conversations(p, format="alpaca")
    q = _jsonl(tmp_path / "e.jsonl", [good, {"instruction": "q"}])
    with pytest.raises(DatasetFormatError, match=r"e.jsonl:2: field 'output' is missing \(record has: instruction\)"):
        load_conversations(q, format="alpaca")
    with pytest.raises(
        DatasetFormatError, match=r"e.jsonl:1: field 'answer' is missing \(record has: instruction, output\)"
    ):
        load_conversations(q, format="alpaca", fields={"output": "answer"})
    r = _jsonl(
        tmp_path / "r.jsonl", [{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}]
    )
    with pytest.raises(DatasetFormatError, match=r"r.jsonl:1: field 'messages\[1\].role': unknown role 'robot'"):
        load_conversations(r)
    stats = SkipStats()
    with caplog.at_level(logging.WARNING, logger="prefect_tinker.recipes.data"):
        convs = load_conversations(p, format="alpaca", on_error="skip", stats=stats)
    assert len(convs) == 2 and stats.total == 4
    assert stats.counts == {"bad_record": 3, "malformed_json": 1}
    assert stats.summary() == "4 skipped: 3 bad_record, 1 malformed_json"
    assert "d.jsonl:4: field 'output' must be a string, got 3" in caplog.text
    assert "d.jsonl:5: expected a JSON object" in caplog.text


@needs_smollm2
def test_no_trainable_token_and_too_long_name_file_line_and_field(tmp_path):
    r = get_renderer("smollm2", smollm2())
    p = _jsonl(tmp_path / "t.jsonl", [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 200}]},
        {"messages": [{"role": "user", "content": "no flags"}, {"role": "assistant", "content": "x"}]},
    ])
    with pytest.raises(DatasetFormatError, match=r"t.jsonl:1: field 'messages': .*no message has trainable=true"):
        list(SupervisedDataset([str(p)], r, batch_size=2, train_on_what="customized").batches())
    ds = SupervisedDataset([str(p)], r, batch_size=2, max_length=64, on_too_long="error")
    with pytest.raises(
        DatasetFormatError, match=r"t.jsonl:2: field 'messages': example has \d+ tokens, more than max_length=64"
    ):
        ds.num_batches()
    ds = SupervisedDataset([str(p)], r, batch_size=2, max_length=64, on_too_long="skip")
    assert ds.num_train == 2 and ds.stats.counts == {"too_long": 1}
    ds = SupervisedDataset([str(p)], r, batch_size=2, train_on_what="customized", on_error="skip")
    with pytest.raises(DatasetFormatError, match=r"no training example left \(3 skipped: 3 render_error\)"):
        ds.num_batches()


# ---- the real data in ../shared/data ------------------------------------------------------------

def _expected_chatml_trained(tok, conversations) -> int:
    """Trained tokens under all_assistant_messages for ChatML: each reply's tokens + <|im_end|>."""
    return sum(len(tok.encode(m["content"], add_special_tokens=False)) + 1
               for conv in conversations for m in conv if m["role"] == "assistant")


def _trained(ds: SupervisedDataset) -> tuple[int, int]:
    datums = [d for batch in ds.batches(0) for d in batch]
    return len(datums), int(sum(d.loss_fn_inputs["weights"].to_numpy().sum() for d in datums))


@needs_smollm2
def test_dolly_slice_raw_and_messages_load_with_the_right_trained_tokens():
    raw_path, msg_path = data_file("sft/dolly_slice_raw.jsonl"), data_file("sft/dolly_slice_messages.jsonl")
    raw = [json.loads(line) for line in raw_path.read_text().splitlines()]
    rows = [json.loads(line) for line in msg_path.read_text().splitlines()]
    assert len(raw) == len(rows) == 151
    tok = smollm2()
    r = get_renderer("smollm2", tok)
    # messages file through the messages converter and through the Dolly converter: same conversations
    by_messages = load_conversations(msg_path)
    by_dolly = load_conversations(msg_path, format="dolly")
    assert [c.messages for c in by_messages] == [c.messages for c in by_dolly] == [row["messages"] for row in rows]
    expected = _expected_chatml_trained(tok, [[{"role": "assistant", "content": row["response"]}] for row in rows])
    for spec in (SourceSpec(path=str(msg_path)), SourceSpec(path=str(msg_path), format="dolly")):
        ds = SupervisedDataset([spec], r, batch_size=16)
        assert _trained(ds) == (151, expected) and ds.stats.total == 0
    # the raw file: prompt/completion with the end marker removed; the replies are the same texts
    spec = SourceSpec(path=str(raw_path), format="prompt_completion", fields={"completion": "answer"},
                      options={"strip_completion_suffix": "###eos_token###"})
    convs = load_conversations(spec)
    assert [c.messages[1]["content"] for c in convs] == [row["response"] for row in rows]
    assert [c.messages[0]["content"] for c in convs] == [x["prompt"] for x in raw]
    assert _trained(SupervisedDataset([spec], r, batch_size=16)) == (151, expected)


@needs_smollm2
def test_self_instruct_seed_tasks_load_with_the_right_trained_tokens():
    path = data_file("sft/self_instruct_seed_tasks.jsonl")
    tasks = [json.loads(line) for line in path.read_text().splitlines()]
    tok = smollm2()
    n_instances = sum(len(t["instances"]) for t in tasks)
    spec = SourceSpec(path=str(path), format="self_instruct")
    convs = load_conversations(spec)
    assert len(convs) == n_instances == 175
    first = tasks[0]["instances"][0]
    assert convs[0].messages[0]["content"] == tasks[0]["instruction"] + (
        f"\n\n{first['input']}" if first["input"] else ""
    )
    expected = _expected_chatml_trained(
        tok, [[{"role": "assistant", "content": i["output"]}] for t in tasks for i in t["instances"]]
    )
    ds = SupervisedDataset([spec], get_renderer("smollm2", tok), batch_size=32)
    assert _trained(ds) == (175, expected) and ds.stats.total == 0
    # role_colon: each reply is " {output}\n\n" followed by the trained "User:" stop
    rc = SupervisedDataset([spec], get_renderer("role_colon", tok), batch_size=32)
    colon = sum(
        len(tok.encode(f" {i['output']}\n\n", add_special_tokens=False))
        + len(tok.encode("User:", add_special_tokens=False))
        for t in tasks
        for i in t["instances"]
    )
    assert _trained(rc) == (175, colon)


@needs_smollm2
def test_hh_rlhf_dialogues_load_with_the_right_trained_tokens():
    path = data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        pairs = [json.loads(line) for line in fh]
    tok = smollm2()
    spec = SourceSpec(path=str(path), format="hh", fields={"text": "chosen"})
    convs = load_conversations(spec)
    assert len(convs) == len(pairs) == 2312
    # independent split of each transcript on its turn markers
    replies = []
    for p in pairs:
        chunks = p["chosen"].split("\n\nAssistant:")[1:]
        replies.append([{"role": "assistant", "content": c.split("\n\nHuman:")[0].strip()} for c in chunks])
    assert [sum(m["role"] == "assistant" for m in c.messages) for c in convs] == [len(r) for r in replies]
    ds = SupervisedDataset([spec], get_renderer("smollm2", tok), batch_size=256)
    assert _trained(ds) == (2312, _expected_chatml_trained(tok, replies)) and ds.stats.total == 0
    # last_assistant_message: only the final reply of each dialogue
    last = SupervisedDataset(
        [spec], get_renderer("smollm2", tok), batch_size=256, train_on_what="last_assistant_message"
    )
    assert _trained(last)[1] == _expected_chatml_trained(tok, [r[-1:] for r in replies])
    # every chosen/rejected pair splits into a shared prompt and two different continuations
    for p in pairs[:300]:
        pair = preference_from_dialogues(p["chosen"], p["rejected"])
        assert pair.prompt + pair.chosen == parse_dialogue(p["chosen"]) and pair.chosen != pair.rejected


def test_options_are_the_options_model_of_the_format_named():
    """``options`` is a union tagged by ``format``: validated into the format's model (typed, unknown
    keys refused), dumped as given, and spelled out in the JSON schema, which a JSON Schema
    validator applies to configs (the default format's branch when ``format`` is absent)."""
    import jsonschema

    from prefect_tinker.flows.sft import SFTConfig
    from prefect_tinker.recipes.data_sources import InstructionOptions, MessagesOptions
    from prefect_tinker.recipes.format_options import FormatOptions

    spec = SourceSpec(path="org/set", format="instruction", options={"input_separator": " | "})
    assert type(spec.options) is InstructionOptions and spec.options.input_separator == " | "
    assert spec.model_dump()["options"] == {"input_separator": " | "}  # as given: stored configs unchanged
    assert SourceSpec.model_validate(spec.model_dump()).options == spec.options
    assert type(SourceSpec(path="org/set").options) is MessagesOptions
    assert type(SourceSpec(path="org/set", format="dialogue").options) is FormatOptions
    (conv,) = convert_record({"instruction": "Add", "input": "1 2", "output": "3"}, "instruction", None, spec.options)
    assert conv.messages[0]["content"] == "Add | 1 2"
    with pytest.raises(ValueError, match=r"format 'dialogue': options\.input_separator: Extra inputs"):
        SourceSpec(path="org/set", format="dialogue", options={"input_separator": " "})
    with pytest.raises(ValueError, match=r"format 'instruction': options\.input_separatr: Extra inputs"):
        convert_record({"instruction": "a", "output": "b"}, "instruction", None, {"input_separatr": " "})

    schema = SFTConfig.model_json_schema()
    jsonschema.validate({"model": "tiny", "dataset": "a.jsonl", "options": {"role_map": {"bot": "assistant"}}}, schema)
    jsonschema.validate({"model": "tiny", "format": "instruction", "options": {"input_separator": " "}}, schema)
    for bad in ({"model": "tiny", "options": {"role_mapp": {}}},
                {"model": "tiny", "format": "instruction", "options": {"role_map": {}}},
                {"model": "tiny", "sources": [{"path": "a", "format": "dialogue",
                                               "options": {"input_separator": "x"}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
