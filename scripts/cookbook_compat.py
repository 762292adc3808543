"""Compatibility check: the Tinker cookbook's own training loops, unmodified, against our server.

Programs written for the ``tinker`` SDK should run against ``prefect-tinker local serve`` by
setting ``TINKER_BASE_URL`` and a ``tml-`` API key.  This script checks that with code we did not
write: ``tinker_cookbook.supervised.train.main`` (pipelined forward_backward/optim_step, periodic
state + sampler checkpoints, evaluation NLL) and ``tinker_cookbook.rl.train.main`` (sync GRPO on
the cookbook's arithmetic environment, optionally with its KL penalty against the base model),
both on a Hugging Face model directory built here with plain ``transformers`` (a random 2-layer
Llama with the SmolLM2 tokenizer), served by ``prefect-tinker local serve --model DIR``.

Each loop runs in a child process whose environment holds only ``TINKER_BASE_URL`` /
``TINKER_API_KEY``; this script then checks what the loops wrote (``metrics.jsonl``,
``checkpoints.jsonl``) and that the server lists the checkpoints through the SDK's REST client.
Exit status 0 when every check passes.

The cookbook is not a dependency of the project: tinker-cookbook 0.6.1 asks for
``tml-renderers>=0.4.1``, which the package index here does not have, so install it beside the
environment without resolving its dependencies::

    pip install --target /tmp/cookbook --no-deps tinker-cookbook==0.6.1 tml-renderers chz \
        blobfile pyrage termcolor tiktoken lxml pycryptodomex
    PYTHONPATH=/tmp/cookbook python scripts/cookbook_compat.py [--workdir DIR] [--sl-steps 10]

Known gap: the cookbook's *async* RL mode defaults to ``stable_reinforce``, a loss whose objective
the service has not published; our server answers it with a user error (see
``tinker_local/PROTOCOL.md``), so run async mode with ``loss_fn="ppo"`` or ``"importance_sampling"``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = Path(os.environ.get("SMOLLM2_TOKENIZER", REPO.parent / "shared/data/tokenizer/smollm2"))
DATA = Path(os.environ.get("COMPAT_SFT_DATA", REPO / "prefect_tinker/recipes/data/example_chat.jsonl"))

MAKE_MODEL = """
import sys, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
tok = AutoTokenizer.from_pretrained(sys.argv[2])
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
"""

SL_LOOP = """
import asyncio, sys
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
model, data, log, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon",
                                        max_length=512, batch_size=4,
                                        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
cfg = train.Config(log_path=log, recipe_name="compat_sl", model_name=model, renderer_name="role_colon",
                   dataset_builder=FromConversationFileBuilder(common_config=common, file_path=data, test_size=4),
                   learning_rate=1e-3, lr_schedule="constant", num_epochs=1, lora_rank=16,
                   save_every=4, eval_every=4, max_steps=steps)
asyncio.run(train.main(cfg))
"""

RL_LOOP = """
import asyncio, sys
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train
model, log, kl = sys.argv[1], sys.argv[2], float(sys.argv[3])
builder = ArithmeticDatasetBuilder(batch_size=4, model_name_for_tokenizer=model, renderer_name="role_colon",
                                   n_batches=3, group_size=4)
cfg = train.Config(learning_rate=1e-3, dataset_builder=builder, model_name=model, recipe_name="compat_rl",
                   max_tokens=8, log_path=log, eval_every=0, save_every=2, lora_rank=8, kl_penalty_coef=kl,
                   kl_reference_config=train.KLReferenceConfig(base_model=model) if kl else None)
asyncio.run(train.main(cfg))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, args: list[str], env: dict, log: Path) -> None:
    with log.open("w") as out:
        rc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc:
        raise SystemExit(f"FAILED (exit {rc}); its output: {log}")


def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--sl-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cookbook-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    model = work / "llama-mini"
    if not (model / "config.json").exists():
        _run(MAKE_MODEL, [str(model), str(TOKENIZER)], env, work / "make_model.log")

    port = _free_port()
    server = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("prefect-tinker")),
            "local",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--root",
            str(work / "server"),
            "--threads",
            str(args.threads),
        ],
        cwd=REPO,
        env=env,
        stdout=(work / "server.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start; see {work / 'server.log'}")
                time.sleep(1)
        client_env = {**env, "TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-compat-check"}

        _run(SL_LOOP, [str(model), str(DATA), str(work / "sl"), str(args.sl_steps)], client_env, work / "sl.log")
        sl = _metrics(work / "sl")
        nll = [m["train_mean_nll"] for m in sl if "train_mean_nll" in m]
        test = [m["test/nll"] for m in sl if "test/nll" in m]
        ckpts = [json.loads(x) for x in (work / "sl" / "checkpoints.jsonl").read_text().splitlines() if x]
        print(f"SL loop: {len(nll)} steps, train NLL {nll[0]:.3f} -> {nll[-1]:.3f}, "
              f"test NLL {test[0]:.3f} -> {test[-1]:.3f}, checkpoints {[c['name'] for c in ckpts]}")
        assert len(nll) >= min(args.sl_steps, 5) and nll[-1] < nll[0] and test[-1] < test[0], "SL loss did not fall"

        _run(RL_LOOP, [str(model), str(work / "rl"), "0.05"], client_env, work / "rl.log")
        rl = [m for m in _metrics(work / "rl") if "env/all/reward/total" in m]
        kl = [m["optim/kl_sample_train_v1"] for m in rl if "optim/kl_sample_train_v1" in m]
        print(
            f"RL loop (KL penalty 0.05): {len(rl)} steps, reward {[round(m['env/all/reward/total'], 3) for m in rl]}, "
            f"|KL(sampler, trainer)| <= {max(abs(k) for k in kl):.2e}"
        )
        assert len(rl) == 3 and kl and max(abs(k) for k in kl) < 1e-3, "RL loop incomplete or sampler != trainer"

        import tinker  # the SDK's REST view of what the loops saved

        rest = tinker.RestClient(base_url=url, api_key="tml-compat-check")
        listed = {c.tinker_path for r in rest.list_training_runs().result().training_runs
                  for c in rest.list_checkpoints(r.training_run_id).result().checkpoints}
        missing = {c["state_path"] for c in ckpts} - listed
        assert not missing, f"checkpoints saved by the SL loop but not listed: {missing}"
        print(f"REST: {len(listed)} checkpoints listed, including every one the SL loop saved")
        print(f"OK ({work})")
        return 0
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    raise SystemExit(main())
