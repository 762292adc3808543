"""Fixtures for the tinker_local protocol tests: live servers and an independent reference model.

- ``local_servers`` (session): two server subprocesses on free 127.0.0.1 ports, started together
  and used only after ``/api/v1/healthz`` answered (the SDK retries a dead port for minutes):
  ``clean`` = ``prefect-tinker local serve --model <hf dir> --model tiny`` (the console script,
  fp32, one thread) and ``faulty`` = ``python -m tinker_local serve --model tiny`` with
  ``--fail-every 4 --drop-every 7``; ``clean`` (module) is the first of them and ``service`` (module) an SDK
  ``ServiceClient`` on it.  The HF directory is a small Llama (tied embeddings, its
  own byte-level BPE tokenizer) built here with ``transformers`` / ``tokenizers`` only.
- ``ReferenceLoRA``: the base model loaded by ``transformers`` in fp32 plus LoRA deltas
  ``(alpha / r) * B @ A`` added by forward hooks, read from a checkpoint's safetensors; no peft,
  no tinker_local code.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tinker_local.launcher import healthy

API_KEY = "tml-protocol-tests"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tinker",
          "one two three four five six seven eight nine ten", "12 + 34 = 46", "7 * 8 = 56"]


@dataclass
class Server:
    """A live server: ``base_url``, its ``root`` folder and log file."""

    base_url: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def stats(self) -> dict:
        """``GET /api/v1/local_stats``: compute-thread, request and fault counters."""
        return httpx.get(f"{self.base_url}/api/v1/local_stats", headers={"X-API-Key": API_KEY},
                         timeout=10).json()

    def checkpoint_dir(self, tinker_path: str) -> Path:
        """Folder of a ``tinker://<model_id>/<kind>/<name>`` checkpoint under the root."""
        model_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
        return self.root / "checkpoints" / model_id.replace(":", ".") / kind / name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_hf_model_dir(path: Path) -> Path:
    """A random-init Llama causal LM (2 layers, hidden 64, tied embeddings, context 512) and a
    byte-level BPE tokenizer trained on ``CORPUS``, saved as a plain HF model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.save_pretrained(str(path))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


def _start(argv: list[str], root: Path, port: int) -> Server:
    log = root / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    env.pop("TINKER_LOCAL_FAIL_EVERY", None)
    env.pop("TINKER_LOCAL_DROP_EVERY", None)
    with open(log, "w") as f:
        proc = subprocess.Popen(argv + ["--port", str(port), "--root", str(root)], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    return Server(f"http://127.0.0.1:{port}", root, proc, log)


def _wait_healthy(server: Server, deadline: float) -> None:
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log.read_text()}")
        if healthy(server.base_url, timeout=2):  # urllib: no TLS context built for each poll, as httpx does
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy in time:\n{server.log.read_text()}")
        time.sleep(0.2)


def _stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory) -> Path:
    return make_hf_model_dir(tmp_path_factory.mktemp("hf-llama") / "model")


@pytest.fixture(scope="session")
def local_servers(tmp_path_factory, hf_model_dir):
    """``{"clean": Server, "faulty": Server}``; see the module docstring."""
    cli = str(Path(sys.executable).parent / "prefect-tinker")
    common = ["--dtype", "fp32", "--threads", "1", "--host", "127.0.0.1"]
    servers = {
        "clean": _start([cli, "local", "serve", "--model", str(hf_model_dir), "--model", "tiny", *common],
                        tmp_path_factory.mktemp("tl-clean"), free_port()),
        "faulty": _start([sys.executable, "-m", "tinker_local", "serve", "--model", "tiny", *common,
                          "--fail-every", "4", "--drop-every", "7"],
                         tmp_path_factory.mktemp("tl-faulty"), free_port()),
    }
    try:
        deadline = time.monotonic() + 180
        for s in servers.values():
            _wait_healthy(s, deadline)
        yield servers
    finally:
        for s in servers.values():
            _stop(s)



@pytest.fixture(scope="module")
def clean(local_servers):
    """The ``clean`` server of :func:`local_servers`."""
    return local_servers["clean"]


@pytest.fixture(scope="module")
def service(clean):
    """An SDK ``ServiceClient`` on the ``clean`` server (key ``API_KEY``), one per test module, closed
    after it."""
    import tinker

    sc = tinker.ServiceClient(base_url=clean.base_url, api_key=API_KEY)
    yield sc
    sc.close("success").result(timeout=30)

class ReferenceLoRA:
    """fp32 base model from ``base_dir`` + LoRA deltas of checkpoint dir ``adapter_dir``.

    ``logprobs(tokens, targets)``: (N,) or (N, K) float32 tensor with grad towards ``self.params``
    (the adapter tensors by their safetensors key: ``base_model.model.<module>.lora_{A,B}.weight``).
    """

    def __init__(self, base_dir: Path, adapter_dir: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        scale = cfg["lora_alpha"] / cfg["r"]
        self.params = {k: v.float().clone().requires_grad_(True)
                       for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
        modules = dict(self.model.named_modules())
        for key in self.params:
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            a, b = self.params[key], self.params[key.replace(".lora_A.", ".lora_B.")]
            modules[name].register_forward_hook(
                lambda _m, args, out, a=a, b=b: out + scale * ((args[0] @ a.T) @ b.T))

    def logprobs(self, tokens: list[int], targets) -> torch.Tensor:
        logits = self.model(input_ids=torch.tensor([tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        tgt = torch.as_tensor(targets, dtype=torch.long)
        return logp.gather(-1, tgt.reshape(len(tokens), -1)).reshape(tgt.shape)

    def grads(self) -> dict[str, torch.Tensor]:
        return {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in self.params.items()}
