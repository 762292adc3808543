"""Warm up a model by SFT on generated sums, then RL on the ``arithmetic`` env; report rewards.

Runs two Prefect flows through the embedded local server (or ``--base-url``):

1. ``sft`` on ``--sft-examples`` generated ``What is a + b?`` chats (written to a temp dir),
2. ``rl`` on the ``arithmetic`` env starting from the SFT state (``load_checkpoint_path``),

then evaluates greedy accuracy on ``--eval-problems`` fresh sums before RL (the starting weights) and
after, and prints a JSON report: per-step mean reward of the RL run (sampled at temperature 1),
its first/last-5-step averages, greedy accuracies, and timings.

    python scripts/rl_arithmetic_demo.py --model tiny --store /tmp/demo-store
    python scripts/rl_arithmetic_demo.py --model smollm2 --sft-steps 0 --few-shot ...   # a pretrained chat model
    # reuse a warm-up
    python scripts/rl_arithmetic_demo.py --init-checkpoint tinker://.../weights/... --local-root R ...

Not a test: numbers depend on the machine; see benchmarks/README.md for measured ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
             "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


def greedy_accuracy(credentials, sampler_path: str, tokenizer_id: str, n: int, max_operand: int, seed: int,
                    max_tokens: int = 8, few_shot: bool = False, system_prompt: str | None = None) -> float:
    """Fraction of ``n`` fresh sums answered exactly (temperature 0, at most ``max_tokens``
    tokens) by ``sampler_path``, prompted as the RL env prompts (``system_prompt`` if given, then with
    ``few_shot`` one solved sum, then the question)."""
    import numpy as np
    import tinker

    from prefect_tinker.recipes.rl.envs import EnvSpec
    from prefect_tinker.recipes.rl.envs.arithmetic import ARITHMETIC_SHOT, ArithmeticEnv, arithmetic_problem
    from prefect_tinker.recipes.rl.envs.problems import convo_prefix
    from prefect_tinker.recipes.rl.problem_env import load_renderer

    renderer = load_renderer("auto", tokenizer_id)
    client = credentials.get_client().create_sampling_client(model_path=sampler_path).result()
    rng = np.random.default_rng([seed, 999_999])
    prefix = convo_prefix(EnvSpec(few_shot=few_shot, system_prompt=system_prompt), ARITHMETIC_SHOT)
    envs = [ArithmeticEnv(arithmetic_problem(rng, max_operand), renderer, convo_prefix=prefix) for _ in range(n)]
    futures = []
    for env in envs:
        ob, stop = env.initial_observation()
        params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0, stop=stop)
        futures.append(client.sample(tinker.ModelInput.from_ints(ob), 1, params))
    correct = [
        env.step(list(f.result().sequences[0].tokens)).metrics["correct"] for env, f in zip(envs, futures, strict=True)
    ]
    return float(np.mean(correct))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--store", default=None, help="training store (default: a temp dir)")
    p.add_argument(
        "--local-root",
        default=None,
        help="embedded server folder (default: ~/.prefect-tinker); a server started there is stopped at the end",
    )
    p.add_argument("--base-url", default=None, help="a Tinker-compatible server instead of the embedded one")
    p.add_argument("--max-operand", type=int, default=20)
    p.add_argument("--sft-examples", type=int, default=2000)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument(
        "--init-checkpoint",
        default=None,
        help="start RL from these weights (tinker://.../weights/..., e.g. an earlier warm-up) instead of SFT",
    )
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--rl-steps", type=int, default=30)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-batch", type=int, default=16)
    p.add_argument("--rl-lr", type=float, default=5e-4)
    p.add_argument("--rl-lr-schedule", default="constant", choices=["constant", "linear", "cosine"])
    p.add_argument("--max-tokens", type=int, default=8, help="most sampled tokens per reply (RL and eval)")
    p.add_argument("--few-shot", action="store_true", help="prepend one solved sum to every RL prompt")
    p.add_argument(
        "--system-prompt", default=None, help="system message of every RL/eval prompt (default: the chat template's)"
    )
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--loss-fn", default="importance_sampling")
    p.add_argument("--schedule", default="sync")
    p.add_argument("--eval-problems", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="demo")
    args = p.parse_args(argv)
    try:
        return run(args)
    finally:  # the embedded server outlives its client by design; a private one is stopped here
        if args.local_root and not args.base_url:
            from tinker_blocks.credentials import stop_local_server

            stop_local_server(args.local_root)


def run(args: argparse.Namespace) -> dict:
    """SFT warm-up (unless ``args.sft_steps == 0``), RL, greedy evaluation; returns the report."""
    from prefect_tinker.flows.config import BackendConfig, resolve_credentials
    from prefect_tinker.flows.rl import RLConfig, rl_flow
    from prefect_tinker.flows.sft import SFTConfig, sft_flow
    from prefect_tinker.recipes.rl.envs.arithmetic import write_arithmetic_sft_jsonl
    from tinker_blocks.stores import TrainingStore

    tmp = Path(tempfile.mkdtemp(prefix="rl-demo-"))
    store = args.store or str(tmp / "store")
    backend = BackendConfig(base_url=args.base_url, local_root=args.local_root)
    credentials = resolve_credentials(backend)
    report: dict = {"model": args.model, "args": vars(args)}
    stamp = time.strftime("%Y%m%d-%H%M%S")

    init, sampler0 = args.init_checkpoint, None
    if init is None and args.sft_steps > 0:
        data = write_arithmetic_sft_jsonl(
            tmp / "sums.jsonl", args.sft_examples, max_operand=args.max_operand, seed=args.seed
        )
        t0 = time.perf_counter()
        sft = sft_flow(SFTConfig(
            model=args.model, dataset=str(data), batch_size=args.sft_batch, max_steps=args.sft_steps,
            learning_rate=args.sft_lr, lr_schedule="constant", lora_rank=args.lora_rank, eval_every=0,
            save_every=0, test_size=0.05, num_eval_samples=1, sample_max_tokens=8, max_length=64,
            run_name=f"{args.tag}-sft-{stamp}", store=store, seed=args.seed, backend=backend,
        ))
        report["sft"] = {"steps": sft["steps"], "first_loss": sft["first_loss"], "last_loss": sft["last_loss"],
                         "seconds": time.perf_counter() - t0}
        init = sft["checkpoints"][-1]
        sampler0 = TrainingStore(root=store).last_checkpoint(sft["run_name"], kind="sampler")["path"]
    t0 = time.perf_counter()
    config = RLConfig(
        model=args.model, env="arithmetic", env_options={"max_operand": args.max_operand}, group_size=args.group_size,
        groups_per_batch=args.groups_per_batch, learning_rate=args.rl_lr, lr_schedule=args.rl_lr_schedule,
        max_tokens=args.max_tokens, max_steps=args.rl_steps, few_shot=args.few_shot, system_prompt=args.system_prompt,
        lora_rank=args.lora_rank, loss_fn=args.loss_fn, schedule=args.schedule, save_every=args.save_every,
        load_checkpoint_path=init, run_name=f"{args.tag}-rl-{stamp}", store=store, seed=args.seed, backend=backend,
    )
    rl = rl_flow(config)
    rewards = rl["rewards"]
    k = min(5, len(rewards))
    report["rl"] = {
        "run_name": rl["run_name"], "steps": rl["steps"], "seconds": time.perf_counter() - t0,
        "steps_per_minute": rl["steps_per_minute"], "reward_per_step": [round(r, 4) for r in rewards],
        f"reward_mean_first_{k}": sum(rewards[:k]) / k, f"reward_mean_last_{k}": sum(rewards[-k:]) / k,
    }
    rows = TrainingStore(root=store).query(
        "SELECT step, value FROM metrics WHERE run_id = ? AND name = 'env/correct_rate' ORDER BY step", [rl["run_name"]]
    )
    report["rl"]["correct_rate_per_step"] = [round(r["value"], 4) for r in rows]
    tokenizer_id = rl["tokenizer_id"]
    if sampler0 is None:  # no SFT here: the RL run's own step-0 sampler holds the starting weights
        sampler0 = TrainingStore(root=store).query(
            "SELECT path FROM checkpoints WHERE run_id = ? AND kind = 'sampler' AND step = 0", [rl["run_name"]]
        )[0]["path"]
    evaluate = {"n": args.eval_problems, "max_operand": args.max_operand, "seed": args.seed,
                "max_tokens": args.max_tokens, "few_shot": args.few_shot, "system_prompt": args.system_prompt}
    t0 = time.perf_counter()
    report["greedy_accuracy_before_rl"] = greedy_accuracy(credentials, sampler0, tokenizer_id, **evaluate)
    report["greedy_accuracy_after_rl"] = greedy_accuracy(credentials, rl["sampler_path"], tokenizer_id, **evaluate)
    report["eval_seconds"] = time.perf_counter() - t0
    report["store"] = store
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
