"""The TRL side of ``vs_trl.py``: the PEFT LoRA model, one ``train()`` of TRL's SFT, DPO or GRPO
trainer with a step timer, and the independent first-step SFT loss both sides are compared with.
Needs the ``bench`` extra (``trl``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vs_trl_data import BETAS, DPO_BETA, LR, reward


class StepTimer:
    """A ``transformers`` ``TrainerCallback`` recording each step's wall and CPU seconds (this
    process, all threads) and logged losses."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.times, self.cpu, self.logs, self._t0, self._c0 = [], [], [], 0.0, 0.0

            def on_step_begin(self, args, state, control, **kw):
                self._t0, self._c0 = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kw):
                self.times.append(time.perf_counter() - self._t0)
                self.cpu.append(time.process_time() - self._c0)

            def on_log(self, args, state, control, logs=None, **kw):
                self.logs.append(dict(logs or {}))

        return _Timer()


def trl_model(model_dir: Path, rank: int):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules="all-linear", task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, cfg)


def _training_args(work: Path, steps: int, batch: int, checkpointing: bool = False) -> dict:
    return dict(
        output_dir=str(work),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
        max_grad_norm=0.0,
        gradient_checkpointing=checkpointing,
    )


def trl_run(
    kind: str,
    model,
    tok,
    data,
    steps: int,
    work: Path,
    group: int = 4,
    reply_tokens: int = 32,
    checkpointing: bool = False,
):
    """One ``train()`` of ``steps`` steps; returns the StepTimer.

    SFT and DPO train on a dataset of exactly the batch's ``len(data)`` rows with batch size
    ``len(data)``: the trainer's random sampler only reorders them, so every step sees the same
    batch as the server (a dataset of ``data * steps`` would let the sampler draw a different mix,
    with repeats, for each step: its first-step loss then is another batch's)."""
    from datasets import Dataset

    timer = StepTimer()
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**_training_args(work, steps, len(data), checkpointing), max_length=None, packing=False)
        trainer = SFTTrainer(
            model=model,
            args=args,
            processing_class=tok,
            callbacks=[timer],
            train_dataset=Dataset.from_list([{"input_ids": s} for s in data]),
        )
    elif kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **_training_args(work, steps, len(data), checkpointing),
            beta=DPO_BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            max_length=None,
        )
        rows = [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in data]
        if "ref" in model.peft_config:  # the reference adapter an earlier round's DPOTrainer added
            model.delete_adapter("ref")
            model.set_adapter("default")
        trainer = DPOTrainer(
            model=model, args=args, processing_class=tok, callbacks=[timer], train_dataset=Dataset.from_list(rows)
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        def reward_fn(completions, **kw):
            return [reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

        n = len(data) * group
        args = GRPOConfig(
            **_training_args(work, steps, n, checkpointing),
            num_generations=group,
            generation_batch_size=n,
            max_completion_length=reply_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            generation_kwargs={"min_new_tokens": reply_tokens},
            num_iterations=1,
            shuffle_dataset=False,
            log_completions=False,
        )
        trainer = GRPOTrainer(
            model=model,
            args=args,
            processing_class=tok,
            callbacks=[timer],
            reward_funcs=reward_fn,
            train_dataset=Dataset.from_list([{"prompt": p} for p in data] * steps),
        )
    trainer.train()
    return timer


@torch.no_grad()
def independent_sft_loss(model, chats: list[list[int]]) -> float:
    """Mean token cross-entropy of ``chats`` under ``model``, each chat alone (no padding, no
    packing), summed in float64 over the ``sum(len - 1)`` target tokens: the reference both sides'
    first-step SFT loss is compared with."""
    total = 0.0
    for c in chats:
        ids = torch.tensor([c])
        logits = model(input_ids=ids).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    return total / sum(len(c) - 1 for c in chats)


def reset_lora(model) -> None:
    """LoRA back to its initial state (B = 0), so that each TRL round starts from the base model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
