"""DPO: the cookbook's ``preference.train_dpo`` program, the comparisons in both forms (the same HH-RLHF
pairs in the same order) and the config mapping (``RECIPES["dpo"]``)."""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any

from . import SHARED
from .recipe import Recipe, our_renderer, prompt_logprobs

COOKBOOK_DPO = """
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=a["model"], renderer_name=a["renderer"], max_length=a["max_length"],
    batch_size=a["batch_size"])
cfg = train_dpo.Config(
    log_path=a["log"], recipe_name="parity_dpo", model_name=a["model"], renderer_name=a["renderer"],
    dataset_builder=DPODatasetBuilderFromComparisons(
        common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=a["data"])),
    learning_rate=a["lr"], lr_schedule="linear", num_epochs=a["num_epochs"], dpo_beta=a["beta"],
    lora_rank=a["lora_rank"], save_every=0, eval_every=0, infrequent_eval_every=0, max_steps=a["steps"])
train_dpo.main(cfg)
"""


def _hh_messages(text: str) -> list[dict[str, str]]:
    """An HH-RLHF transcript (``\\n\\nHuman: ...\\n\\nAssistant: ...``) as chat messages."""
    msgs: list[dict[str, str]] = []
    for part in text.split("\n\nHuman: ")[1:]:
        human, *replies = part.split("\n\nAssistant: ")
        msgs.append({"role": "user", "content": human.strip()})
        msgs.extend({"role": "assistant", "content": r.strip()} for r in replies)
    return msgs


# Pairs are kept short enough (2,000 characters a transcript) never to reach it: the cookbook truncates a
# longer pair, ours skips it (a truncated reply's log-ratio is not the reply's), a difference kept on purpose.
DPO_MAX_LENGTH = 2048


def dpo_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path, int]:
    """The comparisons twice: the cookbook's ``{comparison, label}`` rows and our ``{prompt, chosen,
    rejected}`` rows (the same pairs in the same order: HH-RLHF pairs whose transcripts share all
    but the last assistant reply, at most 2,000 characters each, both replies non-empty and
    different)."""
    src = Path(args.dataset) if args.dataset else SHARED / "prefs" / "hh_rlhf_harmless_base_test.jsonl.gz"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    opener = gzip.open if src.suffix == ".gz" else open
    need = args.steps * args.batch_size
    cb, ours = work / "dpo_cookbook.jsonl", work / "dpo_ours.jsonl"
    n = 0
    with opener(src, "rt") as f, cb.open("w") as g, ours.open("w") as h:
        for line in f:
            if not line.strip() or n >= need:
                continue
            rec = json.loads(line)
            if "comparison" in rec:  # already the cookbook's form
                comp = rec["comparison"]
                chosen, rejected = (
                    (comp["completion_A"], comp["completion_B"])
                    if rec["label"] == "A"
                    else (comp["completion_B"], comp["completion_A"])
                )
                prompt = comp["prompt_conversation"]
            elif isinstance(rec.get("prompt"), str) and "\n\nHuman: " not in rec["chosen"]:  # our plain form
                prompt = [{"role": "user", "content": rec["prompt"]}]
                chosen = [{"role": "assistant", "content": rec["chosen"]}]
                rejected = [{"role": "assistant", "content": rec["rejected"]}]
            else:
                c, r = _hh_messages(rec["chosen"]), _hh_messages(rec["rejected"])
                if len(rec["chosen"]) > 2000 or len(rec["rejected"]) > 2000 or not c or not r:
                    continue
                if c[:-1] != r[:-1] or c[-1]["role"] != "assistant" or r[-1]["role"] != "assistant":
                    continue
                prompt, chosen, rejected = c[:-1], c[-1:], r[-1:]
            # both sides train the same pairs: ours skips (counted) a pair with an empty reply or two identical
            # replies, which the cookbook trains (kept on purpose, docs/cookbook-parity.md); leave them out here
            texts = [" ".join(m["content"] for m in side).strip() for side in (chosen, rejected)]
            if not all(texts) or texts[0] == texts[1]:
                continue
            comp = {"prompt_conversation": prompt, "completion_A": chosen, "completion_B": rejected}
            g.write(json.dumps({"comparison": comp, "label": "A"}) + "\n")
            h.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
            n += 1
    return cb, ours, n


def dpo_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cb, _, n = dpo_data(args, work)
    return {
        "data": str(cb), "renderer": args.renderer, "max_length": DPO_MAX_LENGTH, "batch_size": args.batch_size,
        "lr": args.lr, "beta": 0.1, "lora_rank": args.lora_rank, "steps": args.steps,
        "num_epochs": max(1, math.ceil(args.steps / max(n // args.batch_size, 1))),
    }  # fmt: skip


def dpo_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    _, ours, n = dpo_data(args, work)
    return {
        "dataset": str(ours), "format": "preference", "renderer": our_renderer(args.renderer),
        "max_length": DPO_MAX_LENGTH,
        "batch_size": args.batch_size, "test_size": 0, "seed": 0, "learning_rate": args.lr, "lr_schedule": "linear",
        "lora_rank": args.lora_rank, "max_steps": args.steps, "beta": 0.1,
        # what reproduces the cookbook's DPO:
        "reference_via": "sampler", "data_order": "cookbook", "adam.eps": 1e-8,
        "eval_every": 0, "save_every": 0,
    }  # fmt: skip


RECIPES: dict[str, Recipe] = {
    # reference logprobs: sample requests with prompt logprobs; compared on prompt and prompt logprobs
    "dpo": Recipe("dpo", COOKBOOK_DPO, dpo_cookbook, dpo_ours, samples=prompt_logprobs),
}
