"""Dataset builder: interleaving with weights, streaming, split, epochs with reshuffling, truncation
keeping weights aligned, batching into shifted datums.  Runs on a character-level stand-in tokenizer
(no shared data needed) and the real ``datasets`` code on local files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from prefect_tinker.recipes.data_pipeline import (
    ExampleTooLongError,
    SupervisedDataset,
    batch_datums,
    epoch_permutation,
    interleave,
    render_example,
    shuffle_buffer,
)
from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
from prefect_tinker.recipes.data_sources import Conversation
from prefect_tinker.recipes.datasets import datum_from_example
from prefect_tinker.recipes.renderers import get_renderer


class CharTokenizer:
    """One token per character (id = code point); id 0 is EOS."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i)


RENDERER = get_renderer("role_colon", CharTokenizer())


def _chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _key(datum) -> tuple[int, ...]:
    return tuple(datum.model_input.to_ints())


def _test_datums(ds: SupervisedDataset) -> list:
    """The dataset's held-out datums."""
    return [datum_from_example(t, w) for t, w in ds.test_examples()]


def _epochs(ds: SupervisedDataset, num_epochs: int):
    """``(epoch, batch index within the epoch, batch)`` over ``num_epochs`` epochs."""
    for epoch in range(num_epochs):
        for i, batch in enumerate(ds.batches(epoch)):
            yield epoch, i, batch


def test_interleave_weights_seed_and_stopping():
    a, b = [("a", i) for i in range(3000)], [("b", i) for i in range(1000)]
    out = list(interleave([a, b], [3, 1], seed=0))
    counts = Counter(tag for tag, _ in out)
    assert 2.6 < counts["a"] / counts["b"] < 3.4  # proportions follow the weights
    assert out == list(interleave([a, b], [3, 1], seed=0)) and out != list(interleave([a, b], [3, 1], seed=1))
    assert [i for tag, i in out if tag == "a"] == sorted(
        i for tag, i in out if tag == "a"
    )  # order within a source kept
    # all_exhausted: the short source restarts until every source has been fully seen
    out = list(interleave([list(range(50)), ["x"] * 5], seed=3, stopping="all_exhausted"))
    assert set(range(50)) <= set(out) and out.count("x") >= 5
    # a callable source restarts, a plain iterator does not (it leaves the draw)
    out = list(interleave([lambda: iter([1, 2]), iter(["z"])], [1, 1], stopping="all_exhausted", seed=0))
    assert out.count("z") == 1 and {1, 2} <= set(out)
    out = list(interleave([list(range(50)), ["x"] * 5], seed=3, stopping="each_once"))
    assert sorted(x for x in out if x != "x") == list(range(50)) and out.count("x") == 5
    with pytest.raises(ValueError, match="one positive weight per source"):
        list(interleave([a, b], [1, 0]))


def test_shuffle_buffer_and_epoch_permutation():
    items = list(range(100))
    out = list(shuffle_buffer(items, 10, seed=1))
    assert sorted(out) == items and out != items and out == list(shuffle_buffer(items, 10, seed=1))
    assert list(shuffle_buffer(items, 1)) == items
    p0, p1 = epoch_permutation(20, 0, seed=5), epoch_permutation(20, 1, seed=5)
    assert sorted(p0) == list(range(20)) and not np.array_equal(p0, p1)
    assert np.array_equal(p0, epoch_permutation(20, 0, seed=5))


def test_render_example_truncation_keeps_weights_aligned():
    conv = Conversation(messages=_chat("q" * 10, "a" * 30)["messages"], source="f.jsonl:7")
    tokens, weights = render_example(RENDERER, conv)
    assert len(tokens) == len("User: " + "q" * 10 + "\n\nAssistant: " + "a" * 30 + "\n\nUser:")
    for max_length in (30, 40, len(tokens)):
        t, w = render_example(RENDERER, conv, max_length=max_length)
        assert t == tokens[:max_length] and np.array_equal(w, weights[:max_length])
    assert render_example(RENDERER, conv, max_length=20) is None  # nothing trained within 20 tokens
    assert render_example(RENDERER, conv, max_length=40, on_too_long="skip") is None
    with pytest.raises(
        ExampleTooLongError,
        match=rf"f.jsonl:7: field 'messages': example has {len(tokens)} tokens, more than max_length=40",
    ):
        render_example(RENDERER, conv, max_length=40, on_too_long="error")


def test_batch_datums():
    assert [len(b) for b in batch_datums(list(range(7)), 3)] == [3, 3, 1]
    assert [len(b) for b in batch_datums(list(range(7)), 3, drop_last=True)] == [3, 3]
    with pytest.raises(ValueError, match="batch_size"):
        batch_datums([1], 0)


def test_supervised_dataset_sources_split_epochs_and_shift(tmp_path):
    chats = _jsonl(tmp_path / "chats.jsonl", [_chat(f"q{i}", f"answer {i}") for i in range(30)])
    alpaca = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"do {i}", "output": f"done {i}"} for i in range(30)])
    sources = [SourceSpec(path=str(chats)), SourceSpec(path=str(alpaca), format="alpaca", weight=1.0)]
    ds = SupervisedDataset(sources, RENDERER, batch_size=8, test_size=0.2, seed=7, stopping="each_once")
    train, test = ds.num_train, _test_datums(ds)
    assert train + len(test) == 60 and len(test) == 12 and ds.num_batches() == 6
    epochs = [[d for b in ds.batches(e) for d in b] for e in range(2)]
    assert [len(b) for b in ds.batches(0)] == [8, 8, 8, 8, 8, 8]
    assert Counter(map(_key, epochs[0])) == Counter(map(_key, epochs[1]))  # same datums ...
    assert [_key(d) for d in epochs[0]] != [_key(d) for d in epochs[1]]  # ... reshuffled
    assert {_key(d) for d in test}.isdisjoint({_key(d) for d in epochs[0]})
    assert [(e, i) for e, i, _ in _epochs(ds, 2)] == [(e, i) for e in range(2) for i in range(6)]
    # inputs shifted against targets: model input t[:-1], targets t[1:], weights w[1:]
    conv = Conversation(messages=_chat("q0", "answer 0")["messages"])
    tokens, weights = render_example(RENDERER, conv)
    d = next(d for d in epochs[0] + test if _key(d) == tuple(tokens[:-1]))
    assert d.loss_fn_inputs["target_tokens"].tolist() == tokens[1:]
    assert d.loss_fn_inputs["weights"].tolist() == weights[1:].tolist()
    # same seed, same everything
    again = SupervisedDataset(sources, RENDERER, batch_size=8, test_size=0.2, seed=7, stopping="each_once")
    assert [_key(d) for b in again.batches(1) for d in b] == [_key(d) for d in epochs[1]]


def test_interleaved_sources_follow_weights(tmp_path):
    big = _jsonl(tmp_path / "big.jsonl", [_chat("b", f"big {i}") for i in range(400)])
    small = _jsonl(tmp_path / "small.jsonl", [_chat("s", f"small {i}") for i in range(100)])
    ds = SupervisedDataset(
        [SourceSpec(path=str(big), weight=4), SourceSpec(path=str(small), weight=1)], RENDERER, batch_size=50, seed=0
    )
    convs = list(ds.conversations())
    share = sum("big" in c.messages[1]["content"] for c in convs) / len(convs)
    assert 0.74 < share < 0.86 and len(convs) < 500  # first_exhausted: stops with the first source


def test_streaming_hf_json_source_epochs_and_holdout(tmp_path):
    rows = [_chat(f"q{i}", f"reply {i}") for i in range(25)]
    path = _jsonl(tmp_path / "rows.json", rows)  # .json goes through datasets' json builder
    spec = SourceSpec(path=str(path), streaming=True)
    assert [r.where for r in iter_records(spec)][:2] == [f"{path}[train]:0", f"{path}[train]:1"]
    ds = SupervisedDataset([spec], RENDERER, batch_size=4, test_size=5, seed=1, shuffle_buffer_size=8)
    assert len(_test_datums(ds)) == 5
    e0 = [_key(d) for b in ds.batches(0) for d in b]
    e1 = [_key(d) for b in ds.batches(1) for d in b]
    assert len(e0) == 20 and Counter(e0) == Counter(e1) and e0 != e1
    assert set(e0).isdisjoint(_key(d) for d in _test_datums(ds))
    with pytest.raises(TypeError, match="streamed"):
        ds.num_batches()
    with pytest.raises(ValueError, match="test_size must be a count"):
        SupervisedDataset([spec], RENDERER, batch_size=4, test_size=0.1)


def test_hf_parquet_dataset_dir_with_field_mapping(tmp_path):
    """A local dataset directory through the real ``datasets.load_dataset``, Dolly-style columns renamed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "ds" / "data"
    d.mkdir(parents=True)
    rows = [
        {"question": f"Q{i}", "ctx": "some context" if i % 2 else "", "meta": {"answer": f"A{i}"}} for i in range(6)
    ]
    pq.write_table(pa.Table.from_pylist(rows), d / "train-00000-of-00001.parquet")
    fields = {"instruction": "question", "input": "ctx", "output": "meta.answer"}
    for streaming in (False, True):
        spec = SourceSpec(
            path=str(tmp_path / "ds"), format="instruction", fields=fields, streaming=streaming, max_records=4
        )
        ds = SupervisedDataset([spec], RENDERER, batch_size=10)
        datums = [d for b in ds.batches(0) for d in b]
        assert len(datums) == 4
        texts = sorted(CharTokenizer().decode(d.model_input.to_ints()) for d in datums)
        assert texts[1].startswith("User: Q1\n\nsome context\n\nAssistant: A1")


def test_max_records_reads_only_the_first_records_of_dataset(tmp_path):
    from prefect_tinker.flows.sft import SFTConfig

    chats = _jsonl(tmp_path / "chats.jsonl", [_chat(f"q{i}", f"answer {i}") for i in range(30)])
    config = SFTConfig(model="tiny", dataset=str(chats), max_records=7)
    (spec,) = config.source_specs()
    assert spec.max_records == 7
    read = [r.record["messages"][0]["content"] for r in iter_records(spec)]
    assert read == [f"q{i}" for i in range(7)]  # the first seven lines, in file order
    with pytest.raises(ValueError, match="max_records applies to dataset="):
        SFTConfig(model="tiny", dataset=None, sources=[{"path": str(chats)}], max_records=7)
