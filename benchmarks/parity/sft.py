"""SFT: the cookbook's ``supervised.train`` program, the conversations both sides read (a record converted by
our converters) and the config mapping (``RECIPES["sft"]``)."""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any

from . import SHARED
from .recipe import Recipe, our_renderer

COOKBOOK_SFT = """
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=a["model"], renderer_name=a["renderer"], max_length=a["max_length"],
    batch_size=a["batch_size"], train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
cfg = train.Config(
    log_path=a["log"], recipe_name="parity_sft", model_name=a["model"], renderer_name=a["renderer"],
    dataset_builder=FromConversationFileBuilder(common_config=common, file_path=a["data"],
                                                test_size=a["test_size"], shuffle_seed=a["seed"]),
    learning_rate=a["lr"], lr_schedule="linear", num_epochs=a["num_epochs"], lora_rank=a["lora_rank"],
    save_every=0, eval_every=0, max_steps=a["steps"])
asyncio.run(train.main(cfg))
"""


def _sft_data(args: argparse.Namespace, work: Path) -> Path:
    """The conversations as ``{"messages": [...]}`` lines, the file both sides read (the cookbook's
    ``FromConversationFileBuilder`` wants exactly that). A record goes through our converter
    ``--format`` (default: by its shape: ``messages``; ``self_instruct`` with ``instances``;
    ``dialogue`` with an HH-style ``chosen`` transcript; ``prompt_completion`` with ``prompt``;
    ``instruction`` otherwise: instruction/input/output or Dolly's instruction/context/response),
    one conversation per converted record."""
    from prefect_tinker.recipes.data_sources import convert_record

    src = Path(args.dataset) if args.dataset else SHARED / "sft" / "dolly_slice_messages.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    out = work / "sft.jsonl"  # only the messages (the cookbook's builder keeps every column)
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt") as f, out.open("w") as g:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            fmt = args.format or _sft_format(rec)
            try:
                fields = {"text": "chosen"} if fmt == "dialogue" and "text" not in rec else None  # HH: the chosen
                convs = [c.messages for c in convert_record(rec, fmt, fields)]
            except ValueError as e:
                raise SystemExit(f"--dataset: {src}:{n}: {e}") from None
            for msgs in convs:
                g.write(json.dumps({"messages": msgs}) + "\n")
    return out


def _sft_format(rec: Any) -> str:
    if not isinstance(rec, dict) or "messages" in rec:
        return "messages"
    if "instances" in rec:
        return "self_instruct"
    if "chosen" in rec:
        return "dialogue"
    return "prompt_completion" if "prompt" in rec else "instruction"


def _sft_shape(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    n = sum(1 for line in data.open() if line.strip()) - args.test_size
    per_epoch = max(n // args.batch_size, 1)
    return {"num_epochs": max(1, math.ceil(args.steps / per_epoch))}


def sft_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = _sft_data(args, work)
    return {
        "data": str(data), "renderer": args.renderer, "max_length": args.max_length, "batch_size": args.batch_size,
        "test_size": args.test_size, "seed": 0, "lr": args.lr, "lora_rank": args.lora_rank, "steps": args.steps,
        **_sft_shape(args, data),
    }  # fmt: skip


def sft_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = _sft_data(args, work)
    return {
        "dataset": str(data), "renderer": our_renderer(args.renderer), "max_length": args.max_length,
        "batch_size": args.batch_size, "test_size": args.test_size, "seed": 0, "learning_rate": args.lr,
        "lr_schedule": "linear", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "num_epochs": _sft_shape(args, data)["num_epochs"],
        # what reproduces the cookbook's SFT:
        "reduction": "mean", "data_order": "cookbook", "on_too_long": "truncate_keep", "adam.eps": 1e-8,
        # no evaluation or sampling at the end (the cookbook's eval_every=0)
        "eval_every": 0, "save_every": 0, "num_eval_samples": 0,
    }  # fmt: skip


RECIPES: dict[str, Recipe] = {"sft": Recipe("sft", COOKBOOK_SFT, sft_cookbook, sft_ours)}
