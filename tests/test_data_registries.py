"""The data registries a plugin extends: file types (FILE_TYPES: how a local data file is read) and
``builtin:`` datasets (BUILTIN_DATASETS). A component registered the way a plugin's entry point
registers it is used by the real loaders end to end (the same rendered examples as the equivalent
JSONL), and an unknown name fails at config validation with one line listing the registered names."""

from __future__ import annotations

import csv
import json
import re

import pytest
from pydantic import ValidationError

from prefect_tinker.flows.sft import SFTConfig
from prefect_tinker.recipes.builders import SupervisedBuilder
from prefect_tinker.recipes.data_reading import (
    FILE_TYPES,
    FileType,
    RawRecord,
    SourceSpec,
    iter_conversations,
    iter_records,
    looks_local,
)
from prefect_tinker.recipes.builtin_datasets import BUILTIN_DATASETS, EXAMPLE_CHAT_PATH
from prefect_tinker.recipes.datasets import load_conversations
from tests.data_files import smollm2_tokenizer_dir
from tests.renderer_tokenizers import needs_smollm2

ROWS = [{"prompt": f"What is {i} times three?", "completion": f"It is {3 * i}."} for i in range(6)]


def _read_tsv(path, spec):
    """A plugin's reader: tab-separated rows with a header line, each row a record."""
    with open(path, newline="") as fh:
        for lineno, row in enumerate(csv.DictReader(fh, delimiter="\t"), start=2):
            yield RawRecord(f"{path}:{lineno}", dict(row))


def _build(source: SourceSpec):
    builder = SupervisedBuilder(sources=[source], renderer="role_colon", max_length=64, test_size=0, seed=0)
    return builder.build(_tokenizer())


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))


@needs_smollm2
def test_a_registered_file_type_reads_the_same_examples_as_jsonl(tmp_path, monkeypatch):
    monkeypatch.setitem(FILE_TYPES, "tsv", FileType(_read_tsv, (".tsv",)))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tsv = tmp_path / "rows.tsv"
    tsv.write_text("prompt\tcompletion\n" + "".join(f"{r['prompt']}\t{r['completion']}\n" for r in ROWS))
    renamed = tmp_path / "rows.txt"  # another ending: read as tsv because the source names it
    renamed.write_text(tsv.read_text())

    want = _build(SourceSpec(path=str(jsonl), format="prompt_completion")).train
    assert len(want) == len(ROWS)
    by_ending = _build(SourceSpec(path=str(tsv), format="prompt_completion")).train
    by_name = _build(SourceSpec(path=str(renamed), format="prompt_completion", file_type="tsv")).train
    assert [(e.tokens, e.weights) for e in by_ending] == [(e.tokens, e.weights) for e in want]
    assert [(e.tokens, e.weights) for e in by_name] == [(e.tokens, e.weights) for e in want]
    first = next(iter_conversations(SourceSpec(path=str(tsv), format="prompt_completion")))
    assert first.source == f"{tsv}:2"  # the plugin's record locations reach the conversations

    assert looks_local("more/rows.tsv")  # the ending counts as a local file: a missing one fails before a run
    with pytest.raises(ValidationError, match=r"dataset\n.*file not found: .*missing\.tsv"):
        SFTConfig(dataset=str(tmp_path / "missing.tsv"))


def test_an_unset_file_type_leaves_the_source_as_before():
    # configs and data fingerprints of sources read by their ending do not change
    assert "file_type" not in SourceSpec(path="a.jsonl").model_dump()
    assert SourceSpec(path="a.dat", file_type="jsonl").model_dump()["file_type"] == "jsonl"


def test_an_unknown_file_type_is_one_line_listing_the_registered_ones():
    with pytest.raises(ValidationError) as err:
        SourceSpec(path="a.dat", file_type="xlsx")
    assert "file_type\n  Value error, unknown file type 'xlsx'; registered: arrow, csv, json, jsonl, parquet " in str(
        err.value
    )


def test_a_file_no_file_type_reads_is_one_line_naming_the_file_types(tmp_path, monkeypatch):
    """A local file whose ending no registered file type claims (and no file_type=): an error naming
    the path, the registered file types with their endings and how to choose one, at config
    validation and when read (it was read as JSON and failed deep in ``datasets``)."""
    monkeypatch.setitem(FILE_TYPES, "tsv", FileType(_read_tsv, (".tsv",)))  # a plugin's type is listed too
    chats = tmp_path / "chats.txt"
    chats.write_text("prompt\tcompletion\n" + "".join(f"{r['prompt']}\t{r['completion']}\n" for r in ROWS))
    problem = (
        "no file type reads the ending '.txt' (registered: arrow (.arrow), csv (.csv), json (.json), jsonl (.jsonl "
        ".ndjson .jsonl.gz .ndjson.gz), parquet (.parquet), tsv (.tsv)); choose one with "
        f"sources: [{{path: {chats}, file_type: <name>}}]"
    )
    with pytest.raises(ValidationError) as err:
        SFTConfig(dataset=str(chats))
    assert f"dataset\n  Value error, {problem} [" in str(err.value)
    with pytest.raises(ValidationError) as err:
        SFTConfig(sources=[{"path": str(chats), "format": "prompt_completion"}])
    assert f"Value error, sources[0].path: {problem} [" in str(err.value)
    with pytest.raises(ValueError, match="^" + re.escape(f"{chats}: {problem}") + "$"):
        next(iter_records(SourceSpec(path=str(chats))))
    # named by file_type=, it is read; Hugging Face ids and missing paths without a local look pass as before
    config = SFTConfig(sources=[{"path": str(chats), "format": "prompt_completion", "file_type": "tsv"}])
    assert config.dataset is None and len(list(iter_records(config.source_specs()[0]))) == len(ROWS)
    assert SFTConfig(dataset="HuggingFaceH4/no_robots").dataset == "HuggingFaceH4/no_robots"
    assert SFTConfig(dataset="some_org/data.txt").dataset == "some_org/data.txt"


def test_a_registered_builtin_dataset_resolves(tmp_path, monkeypatch):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(open(EXAMPLE_CHAT_PATH).readlines()[:5]))
    monkeypatch.setitem(BUILTIN_DATASETS, "mine", str(path))
    convs = load_conversations("builtin:mine")
    assert [c.messages for c in convs] == [c.messages for c in load_conversations(EXAMPLE_CHAT_PATH)[:5]]
    assert convs[0].source == f"{path}:1"
    assert SFTConfig(dataset="builtin:mine").dataset == "builtin:mine"
    assert not looks_local("builtin:mine")


def test_an_unknown_builtin_dataset_is_one_line_listing_the_registered_ones():
    with pytest.raises(ValidationError) as err:
        SFTConfig(dataset="builtin:example_chats")
    assert (
        "dataset\n  Value error, unknown builtin dataset 'example_chats'; registered: example_chat, example_prefs, "
        "forecasting_questions, sentiment_sentences " in str(err.value)
    )
    with pytest.raises(ValidationError, match=r"path\n  Value error, unknown builtin dataset 'nope'"):
        SourceSpec(path="builtin:nope")
