"""RL: the cookbook's ``rl.train`` program (arithmetic, or GSM8K from a local file), the problems and the
config mapping of its variants (``RECIPES``: ``rl``, ``rl_kl``, ``rl_streaming``, ``rl_async``)."""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .recipe import Recipe, any_sample, our_renderer

COOKBOOK_RL = """
import chz, datasets
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.recipes.math_rl.math_env import Gsm8kDataset, MathEnv
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import RLDatasetBuilder


class FileGsm8kDataset(Gsm8kDataset):
    # the cookbook's GSM8K dataset (shuffled by seed, MathEnv with its few-shot prefix, boxed answers graded
    # with sympy) over a local JSONL of {question, answer} rows instead of the hub's copy (offline here)
    def __init__(self, path, batch_size, group_size, renderer, seed=0):
        self.ds = datasets.load_dataset("json", data_files=path, split="train").shuffle(seed=seed)
        self.batch_size, self.group_size, self.renderer = batch_size, group_size, renderer
        self.convo_prefix = MathEnv.standard_fewshot_prefix()


@chz.chz
class FileGsm8kBuilder(RLDatasetBuilder):
    path: str
    batch_size: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        tok = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tok)
        return FileGsm8kDataset(self.path, self.batch_size, self.group_size, renderer), None


if a["data"]:
    builder = FileGsm8kBuilder(path=a["data"], batch_size=a["groups"], group_size=a["group_size"],
                               model_name_for_tokenizer=a["model"], renderer_name=a["renderer"])
else:
    builder = ArithmeticDatasetBuilder(
        batch_size=a["groups"], model_name_for_tokenizer=a["model"], renderer_name=a["renderer"],
        n_batches=a["steps"], group_size=a["group_size"])
stream = train.StreamMinibatchConfig(groups_per_batch=a["groups"], num_minibatches=a["minibatches"]) \
    if a["streaming"] else None
asynchronous = train.AsyncConfig(max_steps_off_policy=0, groups_per_batch=a["groups"], loss_fn=a["async_loss"]) \
    if a["async_loss"] else None
cfg = train.Config(async_config=asynchronous, max_steps=a["steps"],
    learning_rate=a["lr"], dataset_builder=builder, model_name=a["model"], recipe_name="parity_rl",
    renderer_name=a["renderer"], max_tokens=a["max_tokens"], log_path=a["log"], eval_every=0, save_every=0,
    lora_rank=a["lora_rank"], kl_penalty_coef=a["kl"], stream_minibatch_config=stream,
    kl_reference_config=train.KLReferenceConfig(base_model=a["model"]) if a["kl"] else None)
asyncio.run(train.main(cfg))
"""


def _rl_data(args: argparse.Namespace, work: Path) -> Path | None:
    """With ``--dataset``: the problems as ``{question, answer}`` JSON lines (a GSM8K-style JSONL:
    the answer's last line ``#### n``), the first ``4 * steps`` of them (one pass, full batches)."""
    if not args.dataset:
        return None
    src = Path(args.dataset)
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    opener = gzip.open if src.suffix == ".gz" else open
    out, need, n = work / "rl_problems.jsonl", RL_GROUPS * args.steps, 0
    with opener(src, "rt") as f, out.open("w") as g:
        for line in f:
            if line.strip() and n < need:
                rec = json.loads(line)
                g.write(json.dumps({"question": rec["question"], "answer": str(rec["answer"])}) + "\n")
                n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} problems, {need} needed for {args.steps} steps")
    return out


RL_GROUPS = 4  # groups (problems) per step, of RL_GROUP_SIZE rollouts each
RL_GROUP_SIZE = 4


def _rl_args(args: argparse.Namespace, variant: str, work: Path) -> dict[str, Any]:
    data = _rl_data(args, work)
    return {
        "groups": RL_GROUPS, "group_size": RL_GROUP_SIZE, "max_tokens": args.max_tokens, "steps": args.steps,
        "lr": args.lr, "lora_rank": args.lora_rank, "renderer": args.renderer,
        "kl": 0.05 if variant == "kl" else 0.0, "streaming": variant == "streaming", "minibatches": 2,
        "data": str(data) if data else None, "async_loss": "ppo" if variant == "async" else None,
    }  # fmt: skip


def rl_cookbook(variant: str) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    return lambda args, work: _rl_args(args, variant, work)


def rl_ours(variant: str) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    def ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
        a = _rl_args(args, variant, work)
        env: dict[str, Any] = {
            "env": "arithmetic", "env_options": {"max_operand": 100, "problems": "cookbook", "answer": "last_integer"}
        }
        if a["data"]:  # the cookbook's MathEnv prompt, boxed answers
            env = {
                "env": "math", "dataset": a["data"],
                "env_options": {"question_field": "question", "answer_field": "answer", "answer_style": "boxed",
                                "prompt": "cookbook"},
            }  # fmt: skip
        out = {
            **env, "few_shot": True,
            "renderer": our_renderer(args.renderer), "group_size": a["group_size"], "groups_per_batch": a["groups"],
            "max_tokens": a["max_tokens"], "learning_rate": args.lr, "lr_schedule": "constant",
            "lora_rank": args.lora_rank, "max_steps": args.steps, "seed": 0, "loss_fn": "importance_sampling",
            "temperature": 1.0, "save_every": 0, "eval_every": 0, "kl_penalty_coef": a["kl"],
            # what reproduces the cookbook's RL (with env_options above):
            "format_needs_stop": True, "remove_constant_reward_groups": False, "adam.eps": 1e-8,
        }  # fmt: skip
        if a["kl"]:
            out["kl_reference"] = f"base:{args.model}"
        if variant == "async":  # on-policy (no step off policy): each step trains the groups of one batch
            out.update(schedule="async", max_steps_off_policy=0, loss_fn="ppo")
            # the cookbook sends no loss_fn_config (the server's clip thresholds); ours sends 0.8 / 1.2 unless unset
            out.update(clip_low_threshold=None, clip_high_threshold=None)
        if variant == "streaming":
            out.update(schedule="streaming", num_minibatches=a["minibatches"])
        return out

    return ours


RECIPES: dict[str, Recipe] = {
    "rl": Recipe("rl", COOKBOOK_RL, rl_cookbook("sync"), rl_ours("sync"), samples=any_sample),
    "rl_kl": Recipe("rl", COOKBOOK_RL, rl_cookbook("kl"), rl_ours("kl"), samples=any_sample),
    "rl_streaming": Recipe(
        "rl", COOKBOOK_RL, rl_cookbook("streaming"), rl_ours("streaming"), samples=any_sample, by_step=True
    ),
    # the cookbook's async loop with ppo (its default loss, stable_reinforce, is refused by our server: its
    # objective is unpublished); groups finish in no fixed order, so each step's datums are compared as a set
    "rl_async": Recipe("rl", COOKBOOK_RL, rl_cookbook("async"), rl_ours("async"), samples=any_sample, by_step=True),
}
