"""Orchestration overhead per training step: the SFT flow (Prefect tasks) vs the same loop calling
the tinker SDK directly, side by side on one tinker_local server and one model.

    python benchmarks/orchestration_overhead.py                  # tiny model, 8 x 256 tokens, 24 steps x 3 runs
    python benchmarks/orchestration_overhead.py --steps 40 --repeats 5 --json out.json

What is timed (``time.perf_counter`` between the ends of consecutive steps; the first
``--warmup`` intervals of every run are dropped):

- **direct**: ``forward_backward`` + ``optim_step`` submitted back to back on a
  ``tinker.TrainingClient``, then both awaited; the batch's datums built each step from the same
  rendered examples (what a hand-written training script does);
- **flow**: ``prefect_tinker.flows.sft.sft_flow`` against a real ``prefect server start`` API on 127.0.0.1: per
  step a ``train-step`` task run (state changes, retry policy, result handling), the batch's
  datums, and the progress-artifact update; step ends are marked by the flow's ``_after_step``
  hook. Evaluation, checkpoints and sampling are off (``eval_every=0``, a checkpoint only at the
  end, ``num_eval_samples=0``), so both loops train the same batches with the same optimizer.

Runs alternate (direct, flow, direct, flow, ...) so that load drifts hit both alike. Two numbers:

- the median step time of each loop and their ratio: everything included (also the CPU the flow's
  background threads take from the server on a small machine), but as noisy as the machine;
- the orchestration overhead proper: the median time of a step spent *outside* the SDK calls
  (flow: the step minus the ``train/step_seconds`` its ``train-step`` task measured around
  forward_backward + optim_step; direct: building the datums), flow minus direct, in ms and as a
  share of the direct step. Compute noise cancels out of it.

The machine's load average before and after is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
API_KEY = "tml-bench"
WORDS = ("alpha beta gamma delta epsilon model train token weight loss step batch flow task server "
         "client prefect tinker gradient optimizer adam learning rate schedule sample").split()


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _write_dataset(path: Path, n: int, seed: int = 0) -> None:
    """``n`` chat conversations whose rendering is longer than 256 tokens (truncated to the length)."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            answer = " ".join(rng.choice(WORDS) for _ in range(400))
            msgs = [{"role": "user", "content": f"Question {i}: say some words."},
                    {"role": "assistant", "content": answer}]
            fh.write(json.dumps({"messages": msgs}) + "\n")


def _start_server(root: Path, port: int, model: str, threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tinker_local", "serve", "--model", model, "--port", str(port), "--root", str(root)]
    if threads:
        cmd += ["--threads", str(threads)]
    log = open(root / "server.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1):  # noqa: S310
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"tinker_local exited; see {root / 'server.log'}")
            time.sleep(0.3)
    raise TimeoutError("tinker_local did not start")


def _direct(base_url: str, args, examples: list, lr: float) -> tuple[list[float], list[float]]:
    """Step durations (s) of the hand-written loop, and the time of each step spent outside the
    SDK's forward_backward + optim_step (building the batch's datums)."""
    import tinker

    from prefect_tinker.recipes.data_pipeline import batch_at

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=args.model, rank=args.lora_rank, seed=0).result()
    ends, sdk = [time.perf_counter()], []
    for step in range(args.steps):
        batch = [examples[i] for i in batch_at(len(examples), args.batch, 0, step)]  # the flow's order (seed 0)
        datums = [ex.datum() for ex in batch]
        t0 = time.perf_counter()
        fb = client.forward_backward(datums, "cross_entropy")
        opt = client.optim_step(tinker.AdamParams(learning_rate=lr))
        fb.result()
        opt.result()
        ends.append(time.perf_counter())
        sdk.append(ends[-1] - t0)
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return steps, [st - sd for st, sd in zip(steps, sdk, strict=False)]


def _flow(base_url: str, args, dataset: Path, store: Path, run_name: str) -> tuple[list[float], list[float]]:
    """Step durations (s) of ``sft_flow`` (the ends of steps come from its ``after_step`` callback), and
    the time of each step spent outside the SDK calls (the step minus the ``train/step_seconds``
    the train-step task measured around forward_backward + optim_step)."""
    from prefect_tinker.flows.callbacks import RunCallbacks, run_callbacks
    from prefect_tinker.flows.sft import SFTConfig, sft_flow

    ends = []

    class StepEnds(RunCallbacks):
        def after_step(self, run_id: str, step: int) -> None:
            ends.append(time.perf_counter())

    config = SFTConfig(
        model=args.model, dataset=str(dataset), batch_size=args.batch, max_length=args.seq, test_size=0,
        lora_rank=args.lora_rank, learning_rate=1e-3, lr_schedule="constant", max_steps=args.steps,
        eval_every=0, save_every=0, num_eval_samples=0, run_name=run_name, store=str(store),
        backend={"base_url": base_url},
    )
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: os.environ["PREFECT_API_URL"]}), run_callbacks(StepEnds()):
        sft_flow(config)
    from tinker_blocks.stores import TrainingStore

    rows = TrainingStore(root=str(store)).query(
        "SELECT step, value FROM metrics WHERE run_id = ? AND name = 'train/step_seconds' ORDER BY step", [run_name])
    sdk = {int(r["step"]): float(r["value"]) for r in rows}
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]  # steps[i] ends step i + 1
    return steps, [st - sdk[i + 1] for i, st in enumerate(steps)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loop (alternating)")
    p.add_argument("--warmup", type=int, default=2, help="step intervals dropped at the start of each run")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the server (default: all cores)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0",
                      TOKENIZERS_PARALLELISM="false", TINKER_API_KEY=API_KEY, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    from tests.prefect_stack import PrefectStack, free_port

    tmp = Path(tempfile.mkdtemp(prefix="pt-overhead-"))
    load_before = _load()
    stack = PrefectStack(tmp / "prefect-home")
    port = free_port()
    (tmp / "tinker").mkdir()
    server = _start_server(tmp / "tinker", port, args.model, args.threads)
    base_url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {"direct": [], "flow": []}
    outside: dict[str, list[float]] = {"direct": [], "flow": []}
    try:
        stack.start_server()
        os.environ["PREFECT_API_URL"] = stack.api_url  # the flow reports to the real server
        dataset = tmp / "chats.jsonl"
        _write_dataset(dataset, n=max(4 * args.batch, 64))

        import tinker

        from prefect_tinker.flows.sft import SFTConfig
        from prefect_tinker.recipes.renderers import resolve_renderer_name
        from prefect_tinker.tasks.clients import tokenizer

        probe = tinker.ServiceClient(base_url=base_url, api_key=API_KEY).create_lora_training_client(
            base_model=args.model, rank=args.lora_rank, seed=0).result()
        tok = tokenizer(probe.get_info().model_data.tokenizer_id)
        config = SFTConfig(model=args.model, dataset=str(dataset), max_length=args.seq, test_size=0)
        data = config.dataset_builder(resolve_renderer_name("auto", tok)).build(tok)  # the flow's examples
        lengths = sorted(len(ex.tokens) for ex in data.train)
        print(f"{len(data.train)} examples of {lengths[0]}-{lengths[-1]} tokens; batch {args.batch}; "
              f"{args.steps} steps x {args.repeats} runs per loop", flush=True)
        for r in range(args.repeats):
            d, d_out = (x[args.warmup:] for x in _direct(base_url, args, data.train, 1e-3))
            f, f_out = (x[args.warmup:] for x in _flow(base_url, args, dataset, tmp / "store", f"overhead-{r}"))
            results["direct"] += d
            results["flow"] += f
            outside["direct"] += d_out
            outside["flow"] += f_out
            print(f"run {r}: median step: direct {statistics.median(d) * 1e3:.1f} ms, flow "
                  f"{statistics.median(f) * 1e3:.1f} ms; outside the SDK calls: direct "
                  f"{statistics.median(d_out) * 1e3:.1f} ms, flow {statistics.median(f_out) * 1e3:.1f} ms", flush=True)
    finally:
        try:  # send the flow's logs and events before the server goes away
            from prefect.events.worker import EventsWorker
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)
        except Exception:
            pass
        stack.close()
        server.terminate()
        server.wait(timeout=30)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    load_after = _load()
    med = {k: statistics.median(v) for k, v in results.items()}
    med_out = {k: statistics.median(v) for k, v in outside.items()}
    extra = med_out["flow"] - med_out["direct"]
    out = {
        "model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "repeats": args.repeats,
        "median_step_ms": {k: round(v * 1e3, 1) for k, v in med.items()},
        "median_outside_sdk_ms": {k: round(v * 1e3, 1) for k, v in med_out.items()},
        "step_ratio_pct": round(100 * (med["flow"] / med["direct"] - 1.0), 2),
        "overhead_ms": round(extra * 1e3, 1), "overhead_pct": round(100 * extra / med["direct"], 2),
        "load_before": load_before, "load_after": load_after, "cpus": os.cpu_count(),
    }
    print(f"\n| loop | median step (ms) | median time outside the SDK calls (ms) |\n|---|---|---|\n"
          f"| direct SDK loop | {out['median_step_ms']['direct']} | {out['median_outside_sdk_ms']['direct']} |\n"
          f"| SFT flow (tasks) | {out['median_step_ms']['flow']} | {out['median_outside_sdk_ms']['flow']} |\n"
          f"\nmedian step, flow vs direct: {out['step_ratio_pct']:+}%\n"
          f"orchestration overhead: {out['overhead_ms']} ms per step = {out['overhead_pct']}% of the direct step")
    print(f"load before: {load_before}\nload after:  {load_after}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
