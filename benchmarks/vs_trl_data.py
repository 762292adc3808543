"""The data and the reward both sides of ``vs_trl.py`` train on, and the shared hyperparameters.

- SFT: the first Dolly chats (``shared/data/sft/dolly_slice_messages.jsonl``) in the model's chat
  template (:func:`sft_chats`);
- DPO: single-turn HH-RLHF pairs (``shared/data/prefs``) tokenized as TRL does (:func:`dpo_pairs`);
- GRPO: short Dolly instructions (:func:`grpo_prompts`), the reward (:func:`reward`) and TRL's
  group-normalised advantages (:func:`group_advantages`).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
LR, BETAS = 1e-4, (0.9, 0.95)  # AdamW on both sides, no weight decay
DPO_BETA = 0.1


def sft_chats(tok, n: int = 8, max_tokens: int = 256) -> list[list[int]]:
    """Token ids of the first ``n`` Dolly chats of at most ``max_tokens`` tokens."""
    out = []
    with open(DATA / "sft" / "dolly_slice_messages.jsonl") as f:
        for line in f:
            ids = list(tok.apply_chat_template(json.loads(line)["messages"], tokenize=True)["input_ids"])
            if len(ids) <= max_tokens:
                out.append(ids)
            if len(out) == n:
                break
    return out


def _split_hh(text: str) -> tuple[str, str] | None:
    """A single-turn HH-RLHF transcript -> (human text, assistant text); None when multi-turn."""
    parts = text.split("\n\nAssistant:")
    if len(parts) != 2 or text.count("\n\nHuman:") != 1:
        return None
    return parts[0].replace("\n\nHuman:", "", 1).strip(), parts[1].strip()


def dpo_pairs(tok, n: int = 8, max_tokens: int = 256) -> list[dict]:
    """``n`` single-turn HH-RLHF pairs as TRL tokenizes them: ``{"prompt", "chosen", "rejected"}``
    messages and ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (the reply starts where the
    prompt's and the prompt + reply's token ids diverge)."""
    out = []
    with gzip.open(DATA / "prefs" / "hh_rlhf_harmless_base_test.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            c, r = _split_hh(rec["chosen"]), _split_hh(rec["rejected"])
            if c is None or r is None or c[0] != r[0] or not c[1] or not r[1] or c[1] == r[1]:
                continue
            prompt = [{"role": "user", "content": c[0]}]
            ex = {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": c[1]}],
                "rejected": [{"role": "assistant", "content": r[1]}],
            }
            p = list(tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"])
            pc = list(tok.apply_chat_template(prompt + ex["chosen"], tokenize=True)["input_ids"])
            pr = list(tok.apply_chat_template(prompt + ex["rejected"], tokenize=True)["input_ids"])
            k = min(_common(p, pc), _common(p, pr))
            if max(len(pc), len(pr)) > max_tokens:
                continue
            out.append({**ex, "prompt_ids": p[:k], "chosen_ids": pc[k:], "rejected_ids": pr[k:]})
            if len(out) == n:
                break
    return out


def _common(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def grpo_prompts(n: int) -> list[list[dict]]:
    """The first ``n`` short Dolly instructions (no context) as one-message chats."""
    out = []
    with open(DATA / "sft" / "dolly_slice_messages.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if not rec.get("context") and len(rec["instruction"]) <= 200:
                out.append([{"role": "user", "content": rec["instruction"]}])
            if len(out) == n:
                break
    return out


def reward(text: str) -> float:
    """Distinct words / 10: a cheap deterministic reward with spread inside a group."""
    return len(set(text.lower().split())) / 10.0


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """Rewards minus their group's mean, over the group's standard deviation (+1e-4): TRL's
    ``scale_rewards="group"``."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1).tolist()
