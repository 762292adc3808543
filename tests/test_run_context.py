"""A run resolves its config once: one store object per run, each local data file opened and hashed
once per run (the run session's :class:`~prefect_tinker.tasks.run_context.RunContext`), measured by
counting ``open`` calls of the data file and ``TrainingStore`` constructions during tiny runs."""

from __future__ import annotations

import builtins
import hashlib
import io
import json

import pytest

from prefect_tinker.flows.rl import RLConfig, rl_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from prefect_tinker.recipes.data_reading import iter_records, source_fingerprint
from prefect_tinker.recipes.file_reads import reading_once
from tests.data_files import synthetic_file
from tinker_blocks.stores import TrainingStore


class Spies:
    """Counts ``open`` of one path (builtins.open / io.open: pathlib and gzip open through them)
    and ``TrainingStore`` constructions while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path):
        self.path, self.opens, self.stores = str(path), 0, 0
        real_open, real_init = builtins.open, TrainingStore.__init__

        def spy_open(file, *a, **kw):
            self.opens += str(file) == self.path
            return real_open(file, *a, **kw)

        def spy_init(store, *a, **kw):
            self.stores += 1
            real_init(store, *a, **kw)

        monkeypatch.setattr(builtins, "open", spy_open)
        monkeypatch.setattr(io, "open", spy_open)
        monkeypatch.setattr(TrainingStore, "__init__", spy_init)


def _meta(store, run_id: str) -> dict:
    rows = TrainingStore(root=str(store)).query("SELECT meta_json FROM runs WHERE run_id = ?", [run_id])
    return json.loads(rows[0]["meta_json"])


def test_reading_once_keeps_one_read_per_file(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"a": 1}\n\n{"a": 2}\n')
    spies = Spies(monkeypatch, data)
    with reading_once():
        first = [r.record for r in iter_records(str(data))]
        fp = source_fingerprint(str(data))
        data.write_text('{"a": 3}\n')  # a change on disk during the run: the run keeps what it read
        assert [r.record for r in iter_records(str(data))] == first == [{"a": 1}, {"a": 2}]
        assert source_fingerprint(str(data)) == fp
    assert spies.opens == 2  # the one read inside the block, and the write
    assert fp == "sha256:" + hashlib.sha256(b'{"a": 1}\n\n{"a": 2}\n').hexdigest()
    assert [r.record for r in iter_records(str(data))] == [{"a": 3}]  # outside: read from disk again


def test_sft_run_reads_its_data_file_once_and_builds_one_store(prefect_api, local_credentials, tmp_path, monkeypatch):
    data = tmp_path / "chats.jsonl"
    data.write_bytes(synthetic_file("chats").read_bytes())
    store = tmp_path / "store"
    config = SFTConfig(
        model="tiny",
        dataset=str(data),
        batch_size=4,
        max_steps=2,
        eval_every=0,
        save_every=2,
        run_name="once",
        store=str(store),
        max_length=128,
        num_eval_samples=0,
        backend={"local_root": local_credentials.local_root},
    )
    spies = Spies(monkeypatch, data)
    summary = sft_flow(config)
    opens, stores = spies.opens, spies.stores
    monkeypatch.undo()
    assert summary["steps"] == 2 and len(summary["checkpoints"]) == 1  # the state at step 2
    assert (opens, stores) == (1, 1)
    # the fingerprint recorded from the one read equals the one computed by streaming the file again
    meta = _meta(store, "once")
    assert meta["renderer"] != "auto"
    assert meta["dataset_fingerprint"] == config.dataset_builder(meta["renderer"]).fingerprint()
    # the report written through the run's store object lands under its root
    assert (store / "reports" / "once" / "curves.png").stat().st_size > 0


def test_rl_run_reads_its_problems_once_and_builds_one_store(prefect_api, local_credentials, tmp_path, monkeypatch):
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(3, 4), (10, 5), (7, 7), (2, 9)]]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "store"
    config = RLConfig(
        model="tiny",
        env="math",
        dataset=str(data),
        group_size=2,
        groups_per_batch=2,
        max_tokens=4,
        max_steps=1,
        lora_rank=8,
        save_every=0,
        run_name="rl-once",
        store=str(store),
        backend={"local_root": local_credentials.local_root},
    )
    spies = Spies(monkeypatch, data)
    summary = rl_flow(config)
    opens, stores = spies.opens, spies.stores
    monkeypatch.undo()
    assert summary["steps"] == 1
    assert (opens, stores) == (1, 1)
    assert _meta(store, "rl-once")["dataset_fingerprint"] == config.data_fingerprint(summary["renderer"])
