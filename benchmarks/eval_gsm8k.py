"""GSM8K accuracy and wall time of a model on the local server through the benchmark runner.

    python benchmarks/eval_gsm8k.py --model smollm2 --limit 100 --max-tokens 512 [--json out.json]

Prints accuracy with its 95% Wilson interval, pass@k, truncated/unparsable/errored counts and the
seconds spent sampling and grading (server start and model load excluded).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math" / "gsm8k_test.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", default=str(DATA))
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--num-samples", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per example before it counts as errored")
    ap.add_argument("--renderer", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the local server")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from prefect_tinker.recipes.evals import get_benchmark, metrics_dict, run_benchmark
    from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
    from prefect_tinker.recipes.renderers import get_renderer
    from tinker_blocks import TinkerCredentials

    root = tempfile.mkdtemp(prefix="eval-bench-")
    creds = TinkerCredentials(local=True, local_root=root, local_models=[args.model], local_threads=args.threads)
    try:
        service = creds.get_client()
        client = service.create_sampling_client(base_model=args.model).result()
        renderer = get_renderer(args.renderer, sampler_tokenizer(service, client))
        spec = get_benchmark("gsm8k", dataset=args.dataset, limit=args.limit, num_samples=args.num_samples,
                             max_tokens=args.max_tokens, temperature=args.temperature, concurrency=args.concurrency,
                             timeout_s=args.timeout)
        t0 = time.perf_counter()
        results, samples = run_benchmark(client, renderer, spec, checkpoint=args.model)
        seconds = time.perf_counter() - t0
    finally:
        creds.stop_local_server()
    m = metrics_dict(results)
    out = {"model": args.model, "renderer": renderer.name, "examples": args.limit, "num_samples": args.num_samples,
           "max_tokens": args.max_tokens, "seconds": round(seconds, 1), **{k: round(v, 4) for k, v in m.items()}}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": out, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
