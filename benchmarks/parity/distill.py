"""Distillation: the cookbook's on-policy distillation and SDFT programs, the prompts / demonstrations both
sides read and the config mappings (``RECIPES``: ``distill``, ``sdft``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import REPO
from .recipe import Recipe, any_sample, our_renderer
from .rl import RL_GROUP_SIZE

COOKBOOK_DISTILL = """
import chz
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder


@chz.chz
class FilePromptsBuilder(RLDatasetBuilder):
    # the cookbook's PromptOnlyDataset over the prompts of a local JSONL ({"prompt": ...} rows, file order)
    path: str
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        tok = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        prompts = [json.loads(line)["prompt"] for line in open(self.path) if line.strip()]
        return PromptOnlyDataset(prompts, batch_size=self.groups_per_batch, group_size=self.group_size,
                                 renderer=renderers.get_renderer(self.renderer_name, tokenizer=tok),
                                 tokenizer=tok), None


builder = FilePromptsBuilder(path=a["data"], groups_per_batch=a["groups"], group_size=a["group_size"],
                             model_name_for_tokenizer=a["model"], renderer_name=a["renderer"])
cfg = train_on_policy.Config(
    learning_rate=a["lr"], model_name=a["model"], recipe_name="parity_distill", renderer_name=a["renderer"],
    dataset_configs=[DistillationDatasetConfig(
        dataset_builder=builder, groups_per_batch=a["groups"],
        teacher_config=TeacherConfig(base_model=a["model"], load_checkpoint_path=a["teacher"]))],
    max_tokens=a["max_tokens"], lora_rank=a["lora_rank"], kl_penalty_coef=a["kl"], log_path=a["log"],
    eval_every=0, save_every=0, max_steps=a["steps"])
asyncio.run(train_on_policy.main(cfg))
"""


COOKBOOK_SDFT = """
from tinker_cookbook import renderers
from tinker_cookbook.distillation import sdft
from tinker_cookbook.recipes.sdft.datasets import SDFTDataset

rows = [json.loads(line) for line in open(a["data"]) if line.strip()]
tok = tokenizer_utils.get_tokenizer(a["model"])
dataset = SDFTDataset([r["question"] for r in rows], [r["answer"] for r in rows], batch_size=a["groups"],
                      group_size=a["group_size"], renderer=renderers.get_renderer(a["renderer"], tokenizer=tok))
cfg = sdft.Config(model_name=a["model"], recipe_name="parity_sdft", renderer_name=a["renderer"],
                  lora_rank=a["lora_rank"], learning_rate=a["lr"], max_tokens=a["max_tokens"], topk=a["topk"],
                  log_path=a["log"], eval_every=0, save_every=0, max_steps=a["steps"])
asyncio.run(sdft.main(cfg, dataset))
"""


def _distill_prompts(args: argparse.Namespace, work: Path) -> Path:
    """The prompts, one ``{"prompt": text}`` line each: the first user message of each conversation of a chat
    JSONL (``--dataset``, default ours ``prefect_tinker/recipes/data/example_chat.jsonl``), or a JSONL's ``prompt`` /
    ``question`` / ``instruction`` field; the first ``DISTILL_GROUPS * steps`` of them."""
    src = Path(args.dataset) if args.dataset else REPO / "prefect_tinker" / "recipes" / "data" / "example_chat.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    out, need, n = work / "distill_prompts.jsonl", DISTILL_GROUPS * args.steps, 0
    with src.open() as f, out.open("w") as g:
        for line in f:
            if not line.strip() or n >= need:
                continue
            rec = json.loads(line)
            if "messages" in rec:
                text = next(m["content"] for m in rec["messages"] if m["role"] == "user")
            else:
                text = next(rec[k] for k in ("prompt", "question", "instruction") if k in rec)
            g.write(json.dumps({"prompt": text.strip()}) + "\n")
            n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} prompts, {need} needed for {args.steps} steps")
    return out


DISTILL_GROUPS = 4


def _distill_args(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    return {
        "data": str(_distill_prompts(args, work)), "groups": DISTILL_GROUPS, "group_size": RL_GROUP_SIZE,
        "max_tokens": args.max_tokens, "steps": args.steps, "lr": args.lr, "lora_rank": args.lora_rank,
        "renderer": args.renderer, "kl": 1.0, "teacher": teacher,
    }  # fmt: skip


def distill_cookbook(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    return _distill_args(args, work, teacher)


def distill_ours(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    a = _distill_args(args, work, teacher)
    return {
        # the cookbook scores the student's own tokens with the teacher: the teacher renders as the student does
        "mode": "on_policy", "teacher": {"weights": teacher, "renderer": our_renderer(args.renderer)},
        "dataset": a["data"], "renderer": our_renderer(args.renderer),
        "group_size": a["group_size"], "groups_per_batch": a["groups"], "max_tokens": a["max_tokens"],
        "learning_rate": args.lr, "lr_schedule": "constant", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "seed": 0, "loss_fn": "importance_sampling", "temperature": 1.0, "kl_penalty_coef": a["kl"],
        "save_every": 0, "eval_every": 0,
        # what reproduces the cookbook's on-policy distillation:
        "env_options": {"format": "prompt", "shuffle": False}, "adam.eps": 1e-8,
    }  # fmt: skip


#: tinker-cookbook 0.6.1's SDFT demonstration (distillation/sdft.py: DEFAULT_DEMO_TEMPLATE) in our teacher's
#: prompt_template slots ({prompt}, {answer})
COOKBOOK_SDFT_TEMPLATE = (
    "{prompt}\n\nThis is an example for a response to the question:\n{answer}\n\n"
    "Now answer with a response of your own, including the thinking process."
)


def _sdft_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """Questions and golden answers, twice: ``{question, answer}`` rows for the cookbook's ``SDFTDataset`` and
    ``{messages: [user, assistant]}`` rows for ours: the first user message and the first assistant reply of each
    conversation of a chat JSONL (``--dataset``, default ours ``prefect_tinker/recipes/data/example_chat.jsonl``)."""
    src = Path(args.dataset) if args.dataset else REPO / "prefect_tinker" / "recipes" / "data" / "example_chat.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    cb, ours = work / "sdft_cookbook.jsonl", work / "sdft_ours.jsonl"
    need, n = DISTILL_GROUPS * args.steps, 0
    with src.open() as f, cb.open("w") as g, ours.open("w") as h:
        for line in f:
            if not line.strip() or n >= need:
                continue
            msgs = json.loads(line)["messages"]
            q = next(m["content"] for m in msgs if m["role"] == "user").strip()
            ans = next(m["content"] for m in msgs if m["role"] == "assistant").strip()
            g.write(json.dumps({"question": q, "answer": ans}) + "\n")
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
            h.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} conversations, {need} needed for {args.steps} steps")
    return cb, ours


SDFT_GROUP_SIZE, SDFT_TOPK = 2, 20


def sdft_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cb, _ = _sdft_data(args, work)
    return {
        "data": str(cb), "groups": DISTILL_GROUPS, "group_size": SDFT_GROUP_SIZE, "max_tokens": args.max_tokens,
        "steps": args.steps, "lr": args.lr, "lora_rank": args.lora_rank, "renderer": args.renderer, "topk": SDFT_TOPK,
    }  # fmt: skip


def sdft_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    _, ours = _sdft_data(args, work)
    return {
        "mode": "sdft", "dataset": str(ours), "renderer": our_renderer(args.renderer),
        "group_size": SDFT_GROUP_SIZE, "groups_per_batch": DISTILL_GROUPS, "max_tokens": args.max_tokens,
        "learning_rate": args.lr, "lr_schedule": "constant", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "seed": 0, "temperature": 1.0, "topk": SDFT_TOPK, "skip_first_tokens": 3, "save_every": 0, "eval_every": 0,
        # what reproduces the cookbook's SDFT: its teacher (the base model, rendering as the student, shown its
        # demonstration), the prompts in file order, Adam eps 1e-8
        "teacher": {"weights": f"base:{args.model}", "renderer": our_renderer(args.renderer),
                    "prompt_template": COOKBOOK_SDFT_TEMPLATE},
        "env_options": {"format": "messages", "shuffle": False}, "adam.eps": 1e-8,
    }  # fmt: skip


RECIPES: dict[str, Recipe] = {
    "distill": Recipe("distill", COOKBOOK_DISTILL, distill_cookbook, distill_ours, samples=any_sample, teacher=True),
    "sdft": Recipe("distill", COOKBOOK_SDFT, sdft_cookbook, sdft_ours, samples=any_sample),
}
