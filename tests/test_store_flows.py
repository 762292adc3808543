"""The SFT and RL flows against a real S3 store (SeaweedFS, credentials enforced): the parts they
write read back with a plain DuckDB + s3fs connection, one part per table after the run's final
compaction with the rows unchanged, the S3 server stopped in the middle of a run, and wrong
credentials failing before training starts."""

from __future__ import annotations

import threading
import time

import duckdb
import pytest

from prefect_tinker.flows import rl as rl_module
from prefect_tinker.flows import sft as sft_module
from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from tests.s3_fixtures import SeaweedS3, outage_seen, plain_s3fs
from tinker_blocks import StoreAccessError, TrainingStore
from tinker_blocks.store_io import STORES

TABLES = ("runs", "metrics", "checkpoints", "trajectories")


def run_parts(server: SeaweedS3, root: str, table: str, run_id: str) -> list[str]:
    """The run's Parquet objects of a training table, listed with a plain s3fs client."""
    fs = plain_s3fs(server)
    fs.invalidate_cache()
    prefix = f"{root.removeprefix('s3://')}/training/{table}/run_id={run_id}"
    return [p for p in (fs.find(prefix) if fs.exists(prefix) else []) if p.endswith(".parquet")]


def raw_table(server: SeaweedS3, root: str, table: str, run_id: str) -> list[dict]:
    """Every row of every part of the run (no dedup), read with plain DuckDB + s3fs."""
    parts = run_parts(server, root, table, run_id)
    if not parts:
        return []
    con = duckdb.connect()
    con.register_filesystem(plain_s3fs(server))
    files = ", ".join(f"'s3://{p}'" for p in parts)
    cur = con.execute(f"SELECT * FROM read_parquet([{files}])")
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def latest_per_row_id(rows: list[dict]) -> set[tuple]:
    """What a reader must see: per row id, the copy with the latest time (computed here)."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["row_id"] not in best or r["time"] > best[r["row_id"]]["time"]:
            best[r["row_id"]] = r
    return {tuple(sorted(r.items())) for r in best.values()}


def snapshot(server: SeaweedS3, root: str, run_id: str) -> dict[str, list[dict]]:
    return {t: raw_table(server, root, t, run_id) for t in TABLES}


def assert_compacted(server: SeaweedS3, root: str, run_id: str, before: dict[str, list[dict]]) -> None:
    """One part per table the run wrote, holding exactly the rows a reader saw before, with the
    documented columns."""
    for table in TABLES:
        parts = run_parts(server, root, table, run_id)
        if not before[table]:
            assert parts == [], table
            continue
        assert len(parts) == 1, (table, parts)
        after = raw_table(server, root, table, run_id)
        assert {tuple(sorted(r.items())) for r in after} == latest_per_row_id(before[table]), table
        assert len(after) == len(latest_per_row_id(before[table]))
        assert sorted(after[0]) == sorted(STORES["training"][table].schema.names)


def sft_config(local_credentials, store: str, run_name: str, **kw):
    from tests.data_files import synthetic_file

    base = dict(
        model="tiny", dataset=str(synthetic_file("chats")), batch_size=2,
        learning_rate=2e-3, lora_rank=4, max_steps=3, eval_every=0, save_every=1, run_name=run_name,
        store=store, max_length=128, test_size=0.05, num_eval_samples=1, sample_max_tokens=4,
        backend={"local_root": local_credentials.local_root},
    )
    base.update(kw)
    return sft_module.SFTConfig(**base)


@pytest.mark.slow  # a whole Prefect flow run on the local server: 30-60 s on 2 shared cores
class _Hooks(RunCallbacks):
    """``before_compaction`` / ``after_step`` as plain functions of the test."""

    def __init__(self, before_compaction=None, after_step=None):
        self._before, self._after = before_compaction, after_step

    def before_compaction(self, run_id):
        if self._before:
            self._before(run_id)

    def after_step(self, run_id, step):
        if self._after:
            self._after(step)


def test_sft_flow_on_s3_compacts_its_tables(prefect_api, local_credentials, s3_server, s3_root):
    """SFT with ``store=s3://...`` (credentials from the AWS_* environment): each step's parts as
    written hold one row per (step, name); at the end every table is one part per run, holding
    the rows a reader saw before (each row id's latest copy)."""
    before: dict[str, list[dict]] = {}
    with run_callbacks(_Hooks(lambda run_id: before.update(snapshot(s3_server, s3_root, run_id)))):
        summary = sft_module.sft_flow(sft_config(local_credentials, s3_root, "s3-sft"))
    assert summary["steps"] == 3
    assert {t: len(run_parts(s3_server, s3_root, t, "s3-sft")) for t in TABLES} == {
        "runs": 1, "metrics": 1, "checkpoints": 1, "trajectories": 0}
    # as written: one part per checkpoint (3 state + 1 sampler), two run-status rows
    assert len(before["checkpoints"]) == 4 and [
        r["status"] for r in sorted(before["runs"], key=lambda r: r["time"])
    ] == ["running", "completed"]
    keys = [(r["step"], r["name"]) for r in before["metrics"]]
    assert len(keys) == len(set(keys)) and {(s, "train/loss") for s in range(3)} <= set(keys)
    assert_compacted(s3_server, s3_root, "s3-sft", before)
    store = TrainingStore(root=s3_root)
    assert store.get_run("s3-sft")["status"] == "completed"
    assert summary["checkpoints"] == [r["path"] for r in store.query(
        "SELECT path FROM checkpoints WHERE run_id = 's3-sft' ORDER BY step, kind")]


@pytest.mark.slow
def test_rl_flow_on_s3_compacts_its_tables(prefect_api, local_credentials, s3_server, s3_root):
    """RL to the same kind of store: metrics, trajectories, checkpoints and runs are one part each
    at the end, with the rows unchanged."""
    before: dict[str, list[dict]] = {}
    config = rl_module.RLConfig(
        model="tiny", group_size=2, groups_per_batch=2, max_tokens=6, max_steps=2, lora_rank=8,
        learning_rate=5e-3, save_every=1, run_name="s3-rl", store=s3_root, log_trajectories=3,
        backend={"local_root": local_credentials.local_root},
    )
    with run_callbacks(_Hooks(lambda run_id: before.update(snapshot(s3_server, s3_root, run_id)))):
        summary = rl_module.rl_flow(config)
    assert summary["steps"] == 2
    assert all(before[t] for t in TABLES)
    assert len(run_parts(s3_server, s3_root, "metrics", "s3-rl")) == 1
    assert_compacted(s3_server, s3_root, "s3-rl", before)
    traj = TrainingStore(root=s3_root).query("SELECT step, count(*) AS n FROM trajectories GROUP BY step ORDER BY step")
    assert [r["step"] for r in traj] == [0, 1]


@pytest.mark.slow
def test_sft_flow_survives_s3_outage_exactly_once(prefect_api, local_credentials, tmp_path, monkeypatch, caplog):
    """The S3 server is killed after step 2 of 3, just before the checkpoint's store writes, and
    comes back 2 s after the first write found it gone: the writes (and any lease renewal) retry
    with backoff, the run finishes, the parts as written hold every (step, metric) exactly once,
    and two lines in all speak of the store: one when the outage starts, one when it answers again."""
    server = SeaweedS3(tmp_path / "sw").start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        root = f"s3://{server.make_bucket()}/outage"
        restarted = threading.Event()

        def outage(done: int) -> None:
            if done == 2 and server.proc is not None:
                server.kill()

                def back() -> None:
                    outage_seen(caplog, 60)
                    time.sleep(2.0)
                    server.start()
                    restarted.set()

                threading.Thread(target=back, daemon=True).start()

        before: dict[str, list[dict]] = {}
        hooks = _Hooks(lambda run_id: before.update(snapshot(server, root, run_id)), outage)
        with run_callbacks(hooks), caplog.at_level("WARNING"):
            summary = sft_module.sft_flow(sft_config(local_credentials, root, "outage", save_every=2,
                                                     num_eval_samples=0))
        assert restarted.is_set() and summary["steps"] == 3
        where = f"store {root!r} (endpoint {server.endpoint_url})"
        said = [r.getMessage() for r in caplog.records
                if server.endpoint_url in r.getMessage() or root in r.getMessage()]
        assert len(said) == 2, said
        assert said[0].startswith(f"{where} is not answering (") and "retry for up to 300 s" in said[0]
        assert said[1].startswith(f"{where} answers again after ")
        keys = [(r["step"], r["name"]) for r in before["metrics"]]
        assert len(keys) == len(set(keys))  # no row written twice by a retried PUT
        # every step's rows: train/*, and the token counts and cost (tokens/*, cost/*)
        evaluation = ("test/nll", "test/tokens", "tokens/eval_prefill", "tokens/eval_sampled", "cost/eval_usd")
        train_names = {n for s, n in keys if s == 0 and n.split("/")[0] in ("train", "tokens", "cost")}
        train_names -= set(evaluation)
        assert "train/loss" in train_names
        assert set(keys) == {(s, n) for s in range(3) for n in train_names} | {
            (s, n) for s in (0, 3) for n in evaluation}  # no row lost
        assert sorted(r["step"] for r in before["checkpoints"]) == [2, 3]
        assert_compacted(server, root, "outage", before)
    finally:
        server.stop()


def test_wrong_credentials_fail_flows_before_training(prefect_api, local_credentials, s3_server, s3_root,
                                                      monkeypatch):
    """A wrong secret in the AWS environment: both flows stop at ``check-store`` with a message
    naming the store and endpoint (never the secret), before any training step, writing nothing."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    steps: list[int] = []
    sft = sft_config(local_credentials, s3_root, "bad-creds-sft")
    rl = rl_module.RLConfig(model="tiny", max_steps=1, run_name="bad-creds-rl", store=s3_root,
                            backend={"local_root": local_credentials.local_root})
    for flow, config in ((sft_module.sft_flow, sft), (rl_module.rl_flow, rl)):
        t0 = time.monotonic()
        with run_callbacks(_Hooks(after_step=steps.append)), pytest.raises(StoreAccessError) as err:
            flow(config)
        msg = str(err.value)
        assert s3_root in msg and s3_server.endpoint_url in msg and "not-the-secret" not in msg
        assert time.monotonic() - t0 < 60
    assert steps == []
    fs = plain_s3fs(s3_server)
    prefix = s3_root.removeprefix("s3://")
    assert not fs.exists(prefix) or [p for p in fs.find(prefix) if p.endswith(".parquet")] == []
