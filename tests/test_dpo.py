"""DPO: preference data (formats, field mapping, bad records), the losses' gradients through the
SDK and the local server against an independent torch computation, and the flow end to end
(ln 2 at step 0, one row per (step, name), resume with cached reference logprobs, a refused
config change on resume)."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tinker
from prefect_tinker.flows.dpo import DPOConfig, dpo_flow
from prefect_tinker.flows.resume_checks import ResumeConfigError
from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.data_sources import DatasetFormatError
from prefect_tinker.recipes.preference import DPOLoss, PreferenceBuilder, pair_datums
from tests.data_files import synthetic_file
from tests.local_server import API_KEY
from tests.task_runs import cached_task_runs
from tests.test_local_losses import _adam_image, _assert_updates_match, _reference, _update


def _tiny_tokenizer(clean):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(clean.root / "models" / "tiny"))


def _write(path, rows, gz=False) -> str:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return str(path)


# ----- data ---------------------------------------------------------------------------------------
def test_preference_formats_and_field_mapping(clean, tmp_path):
    tok = _tiny_tokenizer(clean)
    # our own layout, nothing like shared/: a question, and the two answers nested under other names
    own = _write(tmp_path / "own.jsonl", [
        {"id": i, "question": f"What is {i} plus one?", "answers": {"good": f"It is {i + 1}.", "bad": "No idea."}}
        for i in range(6)])
    b = PreferenceBuilder(sources=[SourceSpec(path=own, format="preference",
                                              fields={"prompt": "question", "chosen": "answers.good",
                                                      "rejected": "answers.bad"})],
                          renderer="role_colon", test_size=0)
    data = b.build(tok)
    assert len(data.train) == 6 and data.skipped == 0
    pair = data.train[2]
    for ex, reply in ((pair.chosen, "It is 3."), (pair.rejected, "No idea.")):
        trained = tok.decode([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0])
        assert reply in trained and "plus one" not in trained  # only the reply (and its end marker) is trained
    n_prompt = next(i for i, w in enumerate(pair.chosen.weights) if w > 0)
    assert pair.chosen.tokens[:n_prompt] == pair.rejected.tokens[:n_prompt]  # the shared prompt

    # messages sharing a prefix (no prompt field), and HH dialogue transcripts
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "joke?"},
    ]
    msgs = _write(tmp_path / "msgs.jsonl", [{"chosen": conv + [{"role": "assistant", "content": "A pun."}],
                                              "rejected": conv + [{"role": "assistant", "content": "No."}]}])
    hh = _write(
        tmp_path / "hh.jsonl.gz",
        [
            {
                "chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: A pun.",
                "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: No.",
            }
        ],
        gz=True,
    )
    a = PreferenceBuilder(sources=[SourceSpec(path=msgs)], renderer="role_colon", test_size=0).build(tok)
    d = PreferenceBuilder(sources=[SourceSpec(path=hh, format="dialogue")], renderer="role_colon", test_size=0).build(
        tok
    )
    assert a.train[0].chosen == d.train[0].chosen and a.train[0].rejected == d.train[0].rejected


def test_bad_preference_data_is_named_or_counted(clean, tmp_path):
    tok = _tiny_tokenizer(clean)
    good = {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "Go away."}
    path = _write(tmp_path / "bad.jsonl", [good, good, {"prompt": "Say hi.", "chosen": "Hi!"}, good])
    with pytest.raises(DatasetFormatError, match=r"bad\.jsonl:3: field 'rejected' is missing"):
        PreferenceBuilder(sources=[SourceSpec(path=path)], renderer="role_colon", test_size=0).build(tok)
    skipped = PreferenceBuilder(sources=[SourceSpec(path=path)], renderer="role_colon", test_size=0,
                                on_error="skip").build(tok)
    assert len(skipped.train) == 3 and skipped.skipped == 1 and "bad_record" in skipped.skip_summary

    rows = [good,
            {"prompt": "Say hi.", "chosen": "Same.", "rejected": "Same."},  # identical
            {"prompt": "Say hi.", "chosen": "  ", "rejected": "Go away."},  # empty reply
            {"prompt": "Say hi.", "chosen": "word " * 400, "rejected": "Go away."}]  # longer than max_length
    dialogue = {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
                "rejected": "\n\nHuman: a\n\nAssistant: X\n\nHuman: c\n\nAssistant: d2"}  # differs before the last turn
    p2, p3 = _write(tmp_path / "content.jsonl", rows), _write(tmp_path / "hh.jsonl", [dialogue, {
        "chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}])
    data = PreferenceBuilder(sources=[SourceSpec(path=p2)], renderer="role_colon", test_size=0, max_length=128).build(
        tok
    )
    assert len(data.train) == 1 and data.skipped == 3
    for reason in ("identical", "empty_reply", "too_long"):
        assert f"1 {reason}" in data.skip_summary
    hh = PreferenceBuilder(sources=[SourceSpec(path=p3, format="dialogue")], renderer="role_colon", test_size=0).build(
        tok
    )
    assert len(hh.train) == 1 and "1 differs_before_last_turn" in hh.skip_summary


# ----- the losses through the SDK -----------------------------------------------------------------
def _torch_loss(kind: str, h: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    """The three losses written out independently (float64, mean over pairs)."""
    if kind == "dpo":
        return (-(1 - eps) * torch.log(torch.sigmoid(beta * h)) - eps * torch.log(torch.sigmoid(-beta * h))).mean()
    if kind == "ipo":
        return ((h - 1 / (2 * beta)) ** 2).mean()
    return torch.clamp(1 - beta * h, min=0).mean()


@pytest.mark.parametrize(
    "kind, beta, eps", [("dpo", 0.5, 0.0), ("dpo", 0.5, 0.2), ("ipo", 0.5, 0.0), ("hinge", 0.02, 0.0)]
)
def test_dpo_gradients_match_independent_torch(clean, service, tmp_path, kind, beta, eps):
    """Policy = a LoRA state trained a little; reference = the base weights: the log-ratios are
    non-zero, so every loss has a real gradient. The server's update after one Adam step with a
    large eps is a faithful image of the gradient; the expected one comes from a plain
    transformers model with the LoRA deltas added by hand, the DPO formula written out here."""
    tok = _tiny_tokenizer(clean)
    rows = [
        {"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"maybe {i}"}
        for i in range(3)
    ]
    data = PreferenceBuilder(sources=[SourceSpec(path=_write(tmp_path / "p.jsonl", rows))], renderer="role_colon",
                             test_size=0).build(tok)
    datums = pair_datums(data.train)
    seqs = [d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"].to_numpy()[-1])] for d in datums]
    masks = [torch.as_tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in datums]

    tc = service.create_lora_training_client("tiny", rank=4, seed=3).result(timeout=120)
    base = service.create_lora_training_client("tiny", rank=4, seed=3).result(timeout=120)  # frozen: B = 0
    base_path = base.save_state("ref-base").result(timeout=60).path
    for _ in range(2):  # move the policy away from the reference
        tc.forward_backward(datums, "cross_entropy")
        tc.optim_step(tinker.types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    start = tc.save_state(f"dpo-start-{kind}-{eps}").result(timeout=60).path
    start_dir = clean.checkpoint_dir(start)
    ref_model = _reference(clean, clean.checkpoint_dir(base_path))
    with torch.no_grad():
        reference = [
            float((ref_model.logprobs(s[:-1], s[1:]).double() * m).sum()) for s, m in zip(seqs, masks, strict=True)
        ]

    policy = service.create_training_client_from_state(start).result(timeout=120)  # fresh Adam state
    loss = DPOLoss(reference, beta, kind, eps)
    fb = policy.forward_backward_custom(datums, loss)
    policy.optim_step(tinker.types.AdamParams(learning_rate=1.0, eps=1.0)).result(timeout=60)
    res = fb.result(timeout=120)
    after = policy.save_weights_for_sampler(f"after-{kind}-{eps}").result(timeout=60).path

    ref = _reference(clean, start_dir)
    seq_lp = torch.stack([(ref.logprobs(s[:-1], s[1:]).double() * m).sum() for s, m in zip(seqs, masks, strict=True)])
    ratio = seq_lp - torch.tensor(reference, dtype=torch.float64)
    h = ratio[0::2] - ratio[1::2]
    assert float(h.detach().abs().min()) > 1e-3  # non-trivial log-ratios
    if kind == "hinge":
        assert bool((1 - beta * h.detach() > 0).any())  # some pair inside the hinge: a real gradient
    direct = _torch_loss(kind, h, beta, eps)
    direct.backward()
    assert res.metrics["dpo_loss:mean"] == pytest.approx(float(direct), rel=1e-4, abs=1e-5)
    assert res.metrics["accuracy:mean"] == pytest.approx(float((h > 0).double().mean()))
    _assert_updates_match(_update(clean, start_dir, after), _adam_image(ref.grads()))


# ----- the flow -----------------------------------------------------------------------------------
def _config(local_credentials, store, run_name, **kw) -> DPOConfig:
    base = dict(
        model="tiny", dataset=str(synthetic_file("dialogues")), format="dialogue",
        batch_size=4, max_steps=6, eval_every=3, save_every=3, learning_rate=1e-4, lora_rank=8, max_length=256,
        test_size=16, run_name=run_name, store=str(store), backend={"local_root": local_credentials.local_root},
    )
    base.update(kw)
    return DPOConfig(**base)


def _sql(store, query: str) -> list[dict]:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=str(store)).query(query)


class _CrashAfter(RunCallbacks):
    def after_step(self, run_id, step):
        if step == 4:
            raise RuntimeError("simulated crash after step 4")


def test_dpo_flow_trains_resumes_and_refuses_config_changes(prefect_api, local_credentials, tmp_path):
    store = tmp_path / "store"
    summary = dpo_flow(_config(local_credentials, store, "dpo-e2e"))
    assert summary["steps"] == 6 and summary["pairs"] == 24
    rows = _sql(store, "SELECT step, name, count(*) AS n FROM metrics WHERE run_id = 'dpo-e2e' GROUP BY ALL")
    assert rows and all(r["n"] == 1 for r in rows)
    names = {r["name"] for r in rows}
    assert {"train/dpo_loss", "train/accuracy", "train/margin", "train/chosen_reward", "train/rejected_reward",
            "train/pairs", "train/tokens", "test/dpo_loss", "test/accuracy"} <= names
    loss = {r["step"]: r["value"] for r in _sql(store, "SELECT step, value FROM metrics WHERE run_id = 'dpo-e2e' "
                                                     "AND name = 'train/dpo_loss'")}
    assert sorted(loss) == list(range(6))
    assert loss[0] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference: every pair ln 2
    test = {r["step"]: r["value"] for r in _sql(store, "SELECT step, value FROM metrics WHERE run_id = 'dpo-e2e' "
                                                     "AND name = 'test/dpo_loss'")}
    assert sorted(test) == [0, 3, 6] and test[0] == pytest.approx(math.log(2), abs=1e-6)
    acc0 = _sql(store, "SELECT value FROM metrics WHERE run_id = 'dpo-e2e' AND name = 'test/accuracy' AND step = 0")
    assert acc0[0]["value"] == 0.5  # ties count one half
    ck = _sql(store, "SELECT step, kind, renderer FROM checkpoints WHERE run_id = 'dpo-e2e' ORDER BY step")
    assert [(r["step"], r["kind"]) for r in ck] == [(3, "state"), (6, "state")] and {r["renderer"] for r in ck} == {
        "chatml"
    }

    # crash after step 4, resume: steps 3.. again, the same losses, the reference from the cache
    with run_callbacks(_CrashAfter()), pytest.raises(RuntimeError, match="simulated crash"):
        dpo_flow(_config(local_credentials, store, "dpo-resume"))
    with pytest.raises(ResumeConfigError, match=r"batch_size=4.*batch_size=8.*allow_config_change=\[batch_size\]"):
        dpo_flow(_config(local_credentials, store, "dpo-resume", batch_size=8))
    resumed = dpo_flow(_config(local_credentials, store, "dpo-resume"))
    assert resumed["steps"] == 6
    dup = _sql(store, "SELECT run_id, step, name, count(*) n FROM metrics GROUP BY ALL HAVING n > 1")
    assert dup == []
    got = _sql(store, "SELECT run_id, step, value FROM metrics WHERE name = 'train/dpo_loss' ORDER BY run_id, step")
    by = {(r["run_id"], r["step"]): r["value"] for r in got}
    assert [by[("dpo-resume", s)] for s in range(6)] == pytest.approx([by[("dpo-e2e", s)] for s in range(6)], abs=1e-5)
    # the reference was asked once
    assert cached_task_runs("reference-step-3") >= 1 and cached_task_runs("reference-test", at_least=2) >= 2
    # tokens: a forward and a training pass over every sequence; the run's totals continue across the resume
    got = _sql(store, "SELECT run_id, step, name, value FROM metrics WHERE name LIKE 'tokens/%' OR name LIKE 'cost/%'")
    use = {(r["run_id"], r["step"], r["name"]): r["value"] for r in got}
    for run in ("dpo-e2e", "dpo-resume"):
        trained = [use[(run, s, "tokens/trained")] for s in range(6)]
        assert all(t > 0 for t in trained) and trained == [use[(run, s, "tokens/prefill_uncached")] for s in range(6)]
        assert use[(run, 5, "tokens/trained_total")] == sum(trained) and use[(run, 5, "cost/total_usd")] == 0.0
    assert [use[("dpo-resume", s, "tokens/trained")] for s in range(6)] == [use[("dpo-e2e", s, "tokens/trained")]
                                                                           for s in range(6)]
