"""Benchmark: resident memory of a tinker_local server over a long training run.

Starts ``python -m tinker_local serve --model DIR`` with the ~10M-parameter benchmark model
(``tinker_local_common.build_model_dir``) and drives ``--steps`` steps of ``forward_backward``
+ ``optim_step`` through the unmodified SDK (batch ``--batch`` x ``--seq``); every
``--sample-every`` steps it saves sampler weights and samples from them (a new sampler
checkpoint each time, as an RL loop does), every ``--save-every`` steps it saves a state.
The server's RSS (``VmRSS``) and peak RSS (``VmHWM``) are read from /proc after every step.

Report: peak RSS, RSS after the warm-up (10% of the steps) and at the end, the growth (the
highest RSS of the last 10% of the steps minus the highest of the 10% right after warm-up), and
the slope of a least-squares line through RSS over the steps after warm-up (MiB per 1,000
steps).  Targets: peak < 1.5 GB (1,536 MiB); no growth after warm-up (growth < 20 MiB).  The
slope is informative only: the C allocator keeps or returns a ~48 MiB block of freed memory
from one step to the next, so RSS flips between two levels and a late flip tilts the line.

    python benchmarks/tinker_local_memory.py                      # 1,000 steps, 8 x 256
    python benchmarks/tinker_local_memory.py --steps 200 --json mem.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np  # noqa: E402

from tinker_local_common import API_KEY, ServerProcess, batch_tokens, build_model_dir, load_average, rss_mb  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import tinker
    from tinker import types

    from tinker_local.compute import available_cpus

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tl-mem-"))
    model_dir = build_model_dir(work / "model-10m")
    load_before = load_average()
    server = ServerProcess(model_dir, work / "server-root", threads=args.threads or available_cpus())
    rss: list[float] = []
    t0 = time.monotonic()
    try:
        start_rss = rss_mb(server.pid)[0]
        service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
        tc = service.create_lora_training_client(str(model_dir), rank=32, seed=0).result()
        adam = types.AdamParams(learning_rate=1e-4)
        for step in range(args.steps):
            toks = batch_tokens(args.batch, args.seq, seed=step)
            data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1].tolist()),
                                loss_fn_inputs={"target_tokens": r[1:].astype(np.int64),
                                                "weights": np.ones(args.seq, np.float32)}) for r in toks]
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(adam)
            fb.result()
            opt.result()
            if args.sample_every and (step + 1) % args.sample_every == 0:
                sc = tc.save_weights_and_get_sampling_client().result()
                sc.sample(types.ModelInput.from_ints(toks[0, :32].tolist()), 4,
                          types.SamplingParams(max_tokens=32, seed=step, stop=[])).result()
            if args.save_every and (step + 1) % args.save_every == 0:
                tc.save_state(f"step-{step + 1}").result()
            rss.append(rss_mb(server.pid)[0])
            if (step + 1) % 100 == 0:
                print(f"step {step + 1}: rss {rss[-1]:.0f} MiB, {time.monotonic() - t0:.0f} s", flush=True)
        peak = rss_mb(server.pid)[1]
        service.close("success").result()
    finally:
        server.stop()
    warm = max(1, args.steps // 10)
    xs = np.arange(warm, len(rss))
    slope = float(np.polyfit(xs, np.asarray(rss[warm:]), 1)[0]) * 1000 if len(xs) > 1 else 0.0
    first_max, last_max = max(rss[warm:2 * warm]), max(rss[-warm:])
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "load_before": load_before, "load_after": load_average(),
              "rss_start_mib": start_rss, "rss_after_warmup_mib": rss[warm - 1], "rss_end_mib": rss[-1],
              "peak_rss_mib": peak, "slope_mib_per_1000_steps": slope,
              "max_rss_first_window_mib": first_max, "max_rss_last_window_mib": last_max,
              "growth_mib": last_max - first_max,
              "seconds": time.monotonic() - t0, "rss_mib": rss}
    print(f"load average before {load_before}, after {report['load_after']}")
    print(f"server RSS: start {start_rss:.0f} MiB, after warm-up {rss[warm - 1]:.0f}, end {rss[-1]:.0f}, "
          f"peak {peak:.0f} MiB; growth {last_max - first_max:+.1f} MiB (highest RSS of steps "
          f"{warm + 1}-{2 * warm}: {first_max:.0f}, of the last {warm}: {last_max:.0f}); "
          f"slope after warm-up {slope:+.1f} MiB / 1,000 steps "
          f"({args.steps} steps of {args.batch}x{args.seq} in {report['seconds']:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
