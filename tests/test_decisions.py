"""The decisions recipe: calibration metrics against direct computations, record errors, and runs
on the tiny model through the real local server (server-side custom loss): the step-0 held-out
Brier score equals one recomputed from a sampling client's label logprobs (and so do the per-item
``eval_samples`` rows), soft labels train with
cross-entropy = KL + the targets' entropy, and the reliability diagram lands in the store."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.decisions import DecisionsConfig, decisions_flow
from prefect_tinker.recipes.data_pipeline import batch_at
from prefect_tinker.recipes.data_sources import DatasetFormatError
from prefect_tinker.recipes.decisions import (
    DecisionBuilder, choice_loss, choice_probs, decision_metrics, reliability_bins,
)
from prefect_tinker.recipes.data_reading import SourceSpec


def test_metrics_against_hand_computation():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.55, 0.45]])
    targets = np.array([[1, 0], [0, 1], [0, 1], [0.5, 0.5]], dtype=float)
    m = decision_metrics(probs, targets, n_bins=5)
    assert m["accuracy"] == pytest.approx(3 / 4)  # the soft target [.5, .5] has argmax 0
    assert m["brier"] == pytest.approx((0.02 + 0.72 + 0.18 + 0.005) / 4)
    assert m["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.4) + math.log(0.7)
                                       + 0.5 * math.log(0.55) + 0.5 * math.log(0.45)) / 4)
    # confidences .9 (bin 4, right), .6 (bin 3, wrong), .7 (bin 3, right), .55 (bin 2, right)
    assert m["ece"] == pytest.approx(0.25 * 0.1 + 0.5 * abs(0.5 - 0.65) + 0.25 * 0.45)
    bins = reliability_bins(probs, targets, 5)
    assert [b["count"] for b in bins] == [0, 0, 1, 2, 1]
    assert choice_probs([math.log(0.2), math.log(0.6)]) == pytest.approx([0.25, 0.75])


def test_choice_loss_is_cross_entropy_and_kl_of_the_last_row():
    lp = torch.tensor([[-9.0, -9.0, -9.0], [-1.0, -2.0, -3.0]])
    t = torch.tensor([[0.0, 0.0, 0.0], [0.2, 0.8, 0.0]])
    loss, m = choice_loss(lp, t)
    q = np.exp([-1.0, -2.0, -3.0]) / np.exp([-1.0, -2.0, -3.0]).sum()
    ce = -(0.2 * math.log(q[0]) + 0.8 * math.log(q[1]))
    assert float(loss) == pytest.approx(ce)
    assert float(m["custom/kl:sum"]) == pytest.approx(ce + 0.2 * math.log(0.2) + 0.8 * math.log(0.8))
    assert float(m["custom/brier:sum"]) == pytest.approx(((q - [0.2, 0.8, 0.0]) ** 2).sum())
    assert float(m["custom/correct:sum"]) == 0.0  # argmax q = 0, argmax t = 1


def test_bad_records_name_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"

    def check(*records) -> None:
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        DecisionBuilder(sources=[SourceSpec(path=str(data))], renderer="chatml", choices=["yes", "no"],
                        prompt_field="text").check()

    good = {"text": "ok", "label": "yes"}
    check(good, {"text": "fine", "probs": [0.25, 0.75]})
    with pytest.raises(DatasetFormatError, match=r"d\.jsonl:2: field 'label' = 'maybe' is not one of"):
        check(good, {"text": "x", "label": "maybe"})
    with pytest.raises(DatasetFormatError, match=r"d\.jsonl:3: field 'probs' sums to 1\.1"):
        check(good, good, {"text": "y", "probs": {"yes": 0.5, "no": 0.6}})
    with pytest.raises(DatasetFormatError, match=r"d\.jsonl:1: field 'probs': unknown choice"):
        check({"text": "y", "probs": {"yes": 0.5, "maybe": 0.5}})
    with pytest.raises(ValueError, match="distinct"):
        DecisionsConfig(choices=["a", "a"])


def _tiny_tokenizer(local_credentials):
    """The tiny model's tokenizer, as the SDK resolves it for a training client."""
    return local_credentials.get_client().create_lora_training_client(base_model="tiny", rank=1).get_tokenizer()


def test_example_on_tiny_matches_sampler_logprobs_and_writes_reliability_png(prefect_api, local_credentials,
                                                                             tmp_path, capsys):
    store = tmp_path / "store"
    rc = cli_main(
        [
            "run",
            "decisions",
            "--example",
            "tiny",
            "max_steps=2",
            "eval_every=2",
            "save_every=0",
            "run_name=dec",
            f"store={store}",
            "lora_rank=8",
            f"backend.local_root={local_credentials.local_root}",
        ]
    )
    assert rc in (0, None)
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json",
                     "SELECT step, name, value FROM metrics WHERE run_id='dec' ORDER BY step"]) in (0, None)
    by = {(r["step"], r["name"]): r["value"] for r in json.loads(capsys.readouterr().out)}
    for step in (0, 2):
        assert {f"test/{k}" for k in ("accuracy", "brier", "ece", "nll")} <= {n for s, n in by if s == step}
    assert (0, "train/ce") in by and (1, "train/accuracy") in by
    png = store / "reports" / "dec" / "reliability-step-2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # step 0 is the base model: recompute the held-out Brier score from a sampling client's logprobs
    sc = local_credentials.get_client().create_sampling_client(base_model="tiny")
    tok = _tiny_tokenizer(local_credentials)
    data = DecisionBuilder(sources=[SourceSpec(path="builtin:sentiment_sentences")], renderer="chatml",
                           choices=["positive", "negative"], prompt_field="text", test_size=16).build(tok)
    import tinker

    probs = []
    for ex in data.test:
        lps = [sc.compute_logprobs(tinker.ModelInput.from_ints(ex.prompt + [lab])).result()[-1]
               for lab in data.label_tokens]
        probs.append(choice_probs(lps))
    direct = decision_metrics(np.array(probs), np.array([ex.target for ex in data.test]))
    assert by[(0, "test/brier")] == pytest.approx(direct["brier"], abs=0.02)
    assert by[(0, "test/accuracy")] == pytest.approx(direct["accuracy"], abs=1 / 16 + 1e-9)

    # one eval_samples row per held-out item and evaluation: its probabilities are the sampling
    # client's, its Brier score and correctness recompute from them, and they average to the metrics
    assert cli_main(["sql", "--store", str(store), "--json",
                     "SELECT step, example_id, score, correct, extra_json FROM eval_samples "
                     "WHERE run_id='dec' AND eval_name='decisions/test' ORDER BY step, example_id::INT"]) in (0, None)
    samples = json.loads(capsys.readouterr().out)
    assert [(r["step"], int(r["example_id"])) for r in samples] == [(s, i) for s in (0, 2) for i in range(16)]
    for r in samples:
        extra = json.loads(r["extra_json"])
        p, t = np.array(extra["probs"]), np.array(extra["target"])
        assert r["score"] == pytest.approx(((p - t) ** 2).sum(), abs=1e-9)
        assert r["correct"] == bool(p.argmax() == t.argmax())
        if r["step"] == 0:
            assert p == pytest.approx(probs[int(r["example_id"])], abs=0.02)
            assert t.tolist() == list(data.test[int(r["example_id"])].target)
    for step in (0, 2):
        rows = [r for r in samples if r["step"] == step]
        assert np.mean([r["score"] for r in rows]) == pytest.approx(by[(step, "test/brier")], abs=1e-9)
        assert np.mean([r["correct"] for r in rows]) == pytest.approx(by[(step, "test/accuracy")], abs=1e-9)


def test_soft_labels_train_with_ce_equal_kl_plus_entropy(prefect_api, local_credentials, tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        p = rng.dirichlet([1.0, 1.0, 1.0])
        rows.append({"prompt": f"Case {i}: which colour?",
                     "probs": {"red": float(p[0]), "green": float(p[1]), "blue": float(1 - p[0] - p[1])}})
    data = tmp_path / "soft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "s"
    cfg = DecisionsConfig(dataset=str(data), prompt_field="prompt", choices=["red", "green", "blue"], batch_size=3,
                          test_size=2, max_steps=1, eval_every=0, save_every=0, run_name="soft", store=str(store),
                          lora_rank=4, backend={"local_root": local_credentials.local_root})
    decisions_flow(cfg)
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json",
                     "SELECT name, value FROM metrics WHERE run_id='soft' AND step=0"]) in (0, None)
    m = {r["name"]: r["value"] for r in json.loads(capsys.readouterr().out)}
    built = cfg.dataset_builder("chatml").build(_tiny_tokenizer(local_credentials))
    batch = [built.train[i] for i in batch_at(len(built.train), 3, cfg.seed, 0)]
    entropy = np.mean([-sum(t * math.log(t) for t in ex.target if t > 0) for ex in batch])
    assert m["train/ce"] - m["train/kl"] == pytest.approx(entropy, abs=1e-4)
    assert m["train/kl"] >= 0.0 and {"test/brier", "test/ece"} <= set(m)
