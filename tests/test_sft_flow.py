"""The SFT flow end to end: Prefect flow runs -> tinker SDK -> local server -> training store -> SQL."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
from pydantic import ValidationError

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from prefect_tinker.recipes.data_pipeline import batch_at as batch_indices
from tests.data_files import synthetic_file


def _config(local_credentials, store, run_name, **kw) -> SFTConfig:
    base = dict(
        model="tiny", dataset=str(synthetic_file("chats")), batch_size=4,
        learning_rate=2e-3, lora_rank=8, max_steps=8, eval_every=4, save_every=4, run_name=run_name,
        store=str(store), max_length=256, num_eval_samples=2, sample_max_tokens=16,
        backend={"local_root": local_credentials.local_root},
    )
    base.update(kw)
    return SFTConfig(**base)


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_schedule_and_batches_are_functions_of_step():
    cfg = SFTConfig(learning_rate=1.0, lr_schedule="linear", max_steps=10)
    assert [cfg.lr_at(s, 10) for s in (0, 5, 9)] == pytest.approx([1.0, 0.5, 0.1])
    cfg = SFTConfig(learning_rate=1.0, lr_schedule="cosine", warmup_steps=2)
    assert cfg.lr_at(0, 10) == pytest.approx(0.5) and cfg.lr_at(2, 10) == pytest.approx(1.0)
    assert cfg.lr_at(6, 10) == pytest.approx(0.5)
    a = batch_indices(10, 3, seed=1, step=4)  # epoch 1 (3 batches per epoch), second batch
    assert a == batch_indices(10, 3, seed=1, step=4)
    epoch0 = sum((batch_indices(10, 3, 1, s) for s in range(3)), [])
    assert len(set(epoch0)) == 9  # no repeats inside an epoch
    with pytest.raises(ValueError, match="larger than the training set"):
        batch_indices(2, 3, 0, 0)


def test_sft_flow_trains_records_and_samples(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    summary = sft_flow(_config(local_credentials, store, "e2e"))
    assert summary["steps"] == 8 and summary["last_loss"] < summary["first_loss"]
    assert summary["tokens"] > 0 and len(summary["checkpoints"]) == 3

    rows = _sql(capsys, store, "SELECT step, name, count(*) AS n FROM metrics WHERE run_id = 'e2e' GROUP BY ALL")
    assert rows and all(r["n"] == 1 for r in rows)
    names = {r["name"] for r in rows}
    assert {"train/loss", "train/tokens", "train/learning_rate", "test/nll"} <= names
    assert sorted(r["step"] for r in rows if r["name"] == "train/loss") == list(range(8))
    use = {(r["step"], r["name"]): r["value"] for r in _sql(
        capsys, store, "SELECT step, name, value FROM metrics WHERE run_id='e2e' AND name IN "
                       "('tokens/trained', 'tokens/trained_total', 'train/tokens', 'cost/step_usd')")}
    # every input position is trained on, weighted or not: at least the weighted tokens
    assert all(use[(s, "tokens/trained")] >= use[(s, "train/tokens")] > 0 for s in range(8))
    assert use[(7, "tokens/trained_total")] == sum(use[(s, "tokens/trained")] for s in range(8))
    assert use[(7, "cost/step_usd")] == 0.0  # the local model has no price

    loss = _sql(capsys, store, "SELECT step, value FROM metrics WHERE run_id='e2e' AND name='train/loss' ORDER BY step")
    values = [r["value"] for r in loss]
    assert np.mean(values[-2:]) < values[0] - 0.5, values  # random init ~ln(vocab): falls fast
    nll = _sql(capsys, store, "SELECT step, value FROM metrics WHERE run_id='e2e' AND name='test/nll' ORDER BY step")
    assert [r["step"] for r in nll] == [0, 4, 8] and nll[-1]["value"] < nll[0]["value"]

    ckpts = _sql(capsys, store, "SELECT step, kind, path FROM checkpoints WHERE run_id='e2e' ORDER BY step, kind")
    assert [(c["step"], c["kind"]) for c in ckpts] == [(4, "state"), (8, "sampler"), (8, "state")]
    assert all(c["path"].startswith("tinker://") for c in ckpts)
    run = _sql(capsys, store, "SELECT status, base_model, backend FROM runs WHERE run_id='e2e'")
    assert run == [{"status": "completed", "base_model": "tiny", "backend": "local"}]

    # samples came from the final sampler weights, and their logprobs are the model's
    assert len(summary["samples"]) == 2 and all(isinstance(s["completion"], str) for s in summary["samples"])
    sampler = local_credentials.get_client().create_sampling_client(model_path=ckpts[1]["path"]).result()
    prompt = tinker.ModelInput.from_ints([11, 12, 13, 14])
    a = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=5, seed=3, temperature=1.0)).result()
    b = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=5, seed=3, temperature=1.0)).result()
    assert a.sequences[0].tokens == b.sequences[0].tokens


class _Interrupt(RuntimeError):
    pass


class _CrashAfter(RunCallbacks):
    def after_step(self, run_id, step):
        if step == 3:
            raise _Interrupt("simulated crash after step 3")


def test_interrupted_run_resumes_to_same_weights(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    kw = dict(max_steps=6, save_every=2, eval_every=0, num_eval_samples=1)
    sft_flow(_config(local_credentials, store, "straight", **kw))

    with run_callbacks(_CrashAfter()), pytest.raises(_Interrupt):
        sft_flow(_config(local_credentials, store, "resumed", **kw))
    summary = sft_flow(_config(local_credentials, store, "resumed", **kw))
    assert summary["steps"] == 6

    dup = _sql(capsys, store, "SELECT run_id, step, name, count(*) n FROM metrics GROUP BY ALL HAVING n > 1")
    assert dup == []
    losses = _sql(
        capsys, store,
        "SELECT run_id, step, value FROM metrics WHERE name='train/loss' ORDER BY run_id, step",
    )
    by_run = {r: [x["value"] for x in losses if x["run_id"] == r] for r in ("straight", "resumed")}
    assert len(by_run["resumed"]) == 6 and by_run["resumed"] == pytest.approx(by_run["straight"], abs=1e-6)

    paths = {
        r: _sql(capsys, store, f"SELECT path FROM checkpoints WHERE run_id='{r}' AND kind='sampler'")[0]["path"]
        for r in ("straight", "resumed")
    }
    service = local_credentials.get_client()
    seq = tinker.ModelInput.from_ints(list(range(5, 40)))
    lp = {
        r: service.create_sampling_client(model_path=p).result().compute_logprobs(seq).result()
        for r, p in paths.items()
    }
    assert lp["resumed"][1:] == pytest.approx(lp["straight"][1:], abs=1e-6)


def test_bad_dataset_line_is_named(prefect_api, local_credentials, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    bad.write_text("\n".join([good] * 5 + ['{"messages": [ oops'] + [good] * 5) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:6"):
        sft_flow(_config(local_credentials, tmp_path / "s", "bad-line", dataset=str(bad)))

    no_assistant = tmp_path / "noasst.jsonl"
    no_assistant.write_text("\n".join([good] * 3 + ['{"messages": [{"role": "user", "content": "hi"}]}']) + "\n")
    with pytest.raises(ValueError, match=r"noasst\.jsonl:4.*assistant"):
        sft_flow(_config(local_credentials, tmp_path / "s", "no-asst", dataset=str(no_assistant)))

    # a missing file is a config error, before the flow (or a server, or a store row) starts
    with pytest.raises(ValidationError, match=r"dataset\n.*file not found: .*missing\.jsonl"):
        _config(local_credentials, tmp_path / "s", "missing", dataset=str(tmp_path / "missing.jsonl"))


def test_unknown_model_is_a_clear_user_error(prefect_api, local_credentials, tmp_path):
    with pytest.raises(Exception, match="no-such-model"):
        sft_flow(_config(local_credentials, tmp_path / "s", "unknown-model", model="no-such-model"))


def test_starting_from_a_checkpoint_of_another_renderer_is_refused(prefect_api, local_credentials, tmp_path):
    """The resolved renderer is recorded with the run and its checkpoints; a run that starts from
    a checkpoint trained with another renderer fails naming both, unless explicitly allowed."""
    from prefect_tinker.flows.resume_checks import ResumeConfigError
    from tinker_blocks.stores import TrainingStore

    store = tmp_path / "store"
    kw = dict(max_steps=1, save_every=1, eval_every=0, num_eval_samples=0, dataset="builtin:example_chat")
    sft_flow(_config(local_credentials, store, "rc-base", renderer="role_colon", **kw))
    ck = TrainingStore(root=str(store)).last_checkpoint("rc-base")
    assert ck["renderer"] == "role_colon"
    assert json.loads(TrainingStore(root=str(store)).get_run("rc-base")["meta_json"])["renderer"] == "role_colon"
    with pytest.raises(ResumeConfigError, match=r"trained with renderer 'role_colon'.*renders with 'chatml'"):
        sft_flow(_config(local_credentials, store, "rc-next", load_checkpoint_path=ck["path"], **kw))
    ok = sft_flow(_config(local_credentials, store, "rc-next", load_checkpoint_path=ck["path"],
                          allow_config_change=["renderer"], **kw))
    assert ok["renderer"] == "chatml" and ok["steps"] == 1
    same = sft_flow(
        _config(local_credentials, store, "rc-same", load_checkpoint_path=ck["path"], renderer="role_colon", **kw)
    )
    assert same["steps"] == 1
