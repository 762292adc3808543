"""Capture endpoint throughput: sequential vs concurrent OpenAI clients, and the endpoint's cost
over calling the SDK sampler directly.

Starts the embedded local server (a temporary root) and ``prefect-tinker capture serve --model
tiny`` on it, then times, ``--repeats`` times each (median reported):

- ``sequential``: ``--requests`` chat completions one after another (the real ``openai`` client);
- ``concurrent``: the same requests issued at once (``AsyncOpenAI`` + ``asyncio.gather``);
- ``sdk direct``: the same prompts sampled concurrently through ``SamplingClient.sample`` (no HTTP
  layer, no rendering, no capture rows): the floor the endpoint adds to.

Every request asks for ``--max-tokens`` tokens with ``stop`` never reached in practice (tiny is
random-init), so each costs the same decode steps.

    python benchmarks/capture_throughput.py --requests 16 --max-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import openai
    import tinker

    from tests.capture_fixtures import TOKEN, capture_rows, start_capture
    from tinker_blocks import TinkerCredentials

    tmp = Path(tempfile.mkdtemp(prefix="capture-bench-"))
    creds = TinkerCredentials(local=True, local_root=str(tmp / "local"))
    creds.get_client()
    cap = start_capture(tmp / "capture", str(tmp / "local"), session="bench", extra=("--flush-seconds", "1"))
    msgs = [[{"role": "user", "content": f"Tell me about item {i}."}] for i in range(args.requests)]
    sync = openai.OpenAI(base_url=cap.base + "/v1", api_key=TOKEN, max_retries=0, timeout=600)
    kw = dict(model="tiny", max_tokens=args.max_tokens)
    sync.chat.completions.create(messages=msgs[0], **kw)  # warm: model loaded, first part written

    def sequential() -> float:
        t = time.perf_counter()
        for i, m in enumerate(msgs):
            sync.chat.completions.create(messages=m, seed=i, **kw)
        return time.perf_counter() - t

    async def concurrent_async() -> float:
        async with openai.AsyncOpenAI(base_url=cap.base + "/v1", api_key=TOKEN, max_retries=0, timeout=600) as c:
            t = time.perf_counter()
            await asyncio.gather(*(c.chat.completions.create(messages=m, seed=i, **kw) for i, m in enumerate(msgs)))
            return time.perf_counter() - t

    from prefect_tinker.recipes.renderers import get_renderer

    sampler = creds.get_client().create_sampling_client(base_model="tiny").result()
    from prefect_tinker.recipes.tokenizers import resolve_tokenizer

    renderer = get_renderer("auto", resolve_tokenizer("tiny", str(tmp / "local")))
    prompts = [renderer.build_generation_prompt(m) for m in msgs]

    async def direct_async() -> float:
        t = time.perf_counter()
        await asyncio.gather(*(sampler.sample(p, 1, tinker.SamplingParams(max_tokens=args.max_tokens, seed=i,
                                                                           stop=renderer.get_stop_sequences()))
                               for i, p in enumerate(prompts)))
        return time.perf_counter() - t

    results = {"sequential": [], "concurrent": [], "sdk direct": []}
    for _ in range(args.repeats):  # interleaved, so that load changes hit all three alike
        results["sequential"].append(sequential())
        results["concurrent"].append(asyncio.run(concurrent_async()))
        results["sdk direct"].append(asyncio.run(direct_async()))
    time.sleep(2)
    rows = len(capture_rows(cap.store))
    cap.stop()
    creds.stop_local_server()
    n = args.requests
    print(f"{n} chat completions x {args.max_tokens} tokens, tiny on the local server, median of {args.repeats}")
    print("| mode | wall s (median) | requests/s | all tries (s) |")
    print("|---|---:|---:|---|")
    for name, vals in results.items():
        med = statistics.median(vals)
        print(f"| {name} | {med:.2f} | {n / med:.1f} | {', '.join(f'{v:.2f}' for v in vals)} |")
    seq, con, sdk = (statistics.median(results[k]) for k in results)
    print(f"concurrent / sequential speed-up: {seq / con:.1f}x; endpoint cost over the SDK: {con / sdk:.2f}x")
    print(f"captures rows: {rows} (expected {1 + 2 * n * args.repeats})")


if __name__ == "__main__":
    main()
