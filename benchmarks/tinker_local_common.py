"""Shared parts of the tinker_local benchmarks: the benchmark model directories, a server
subprocess, the benchmark batch, and system load / RSS / CPU readings.

The models, random-init Qwen3 causal LMs with the tiny preset's byte-level BPE tokenizer, saved
as plain Hugging Face directories, so that the server (``--model DIR``) and the plain torch /
transformers baselines load the same files:

- ``build_model_dir``: 5 layers, hidden 384, 6 query / 2 kv heads of 64, MLP 1152, vocab 2048,
  untied head, context 2048 (10.18M parameters);
- ``build_like_for_like_dir``: the like-for-like model of issue 43: 8 layers, hidden 256, 4 query /
  2 kv heads of 64, MLP 768, vocab 4096, context 2048, tied (7.35M parameters) or untied
  (8.40M) embeddings.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

API_KEY = "tml-benchmark"


def build_model_dir(path: Path) -> Path:
    """Write the benchmark model directory at ``path`` (kept if already there)."""
    return _build_qwen3_dir(path, vocab_size=2048, hidden_size=384, intermediate_size=1152, num_hidden_layers=5,
                            num_attention_heads=6, tie_word_embeddings=False)


def build_like_for_like_dir(path: Path, tied: bool) -> Path:
    """Write the like-for-like model directory (see the module docstring) at ``path`` (kept if
    already there)."""
    return _build_qwen3_dir(path, vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                            num_attention_heads=4, tie_word_embeddings=tied)


def _build_qwen3_dir(path: Path, vocab_size: int, **shape) -> Path:
    """A random-init (seed 0) Qwen3 causal LM with the given ``shape`` (``Qwen3Config`` fields) and the tiny
    byte-level BPE tokenizer of ``vocab_size`` at ``path``: 2 kv heads of 64, context 2048; kept if already
    there."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tinker_local.tokenizer import save_tiny_tokenizer

    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_tiny_tokenizer(path, vocab_size=vocab_size, seed=0)
    cfg = Qwen3Config(vocab_size=vocab_size, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=2, pad_token_id=0, bos_token_id=None, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    return path


def batch_tokens(batch: int, seq: int, seed: int = 0, vocab: int = 2048) -> np.ndarray:
    """(batch, seq + 1) random token ids in [3, vocab): inputs are [:, :-1], targets [:, 1:]."""
    return np.random.default_rng(seed).integers(3, vocab, (batch, seq + 1))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_peak_rss(pid: int) -> bool:
    """Reset the peak RSS (``VmHWM``) of process ``pid`` to its current RSS (Linux
    ``/proc/<pid>/clear_refs``, value 5); False where that is not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m tinker_local serve --model DIR`` on a free port; ``base_url``, ``pid``;
    ``stop()`` terminates it.  Blocks in ``__init__`` until ``/api/v1/healthz`` answers."""

    def __init__(self, model_dir: Path, root: Path, *, threads: int, dtype: str = "auto",
                 extra: list[str] | None = None, log_level: str = "warning"):
        import httpx

        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = Path(root) / "server.log"
        Path(root).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tinker_local", "serve", "--model", str(model_dir), "--port",
                 str(port), "--root", str(root), "--threads", str(threads), "--dtype", dtype,
                 "--log-level", log_level, *(extra or [])], stdout=f, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 900  # a loaded shared machine: model loading can take minutes
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after 900 s:\n{self.log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of process ``pid`` in MiB, from /proc/<pid>/status."""
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, num, _unit = line.split()
            vals[key] = int(num) / 1024
    return vals["VmRSS:"], vals["VmHWM:"]


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def run_seconds(trace: dict) -> dict[str, list[float]]:
    """Compute time (seconds) of each request by name, from a Chrome trace of the session."""
    out: dict[str, list[float]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and "run_ms" in (ev.get("args") or {}):
            out.setdefault(ev["name"], []).append(ev["args"]["run_ms"] / 1000)
    return out


def session_trace(base_url: str, training_client) -> dict:
    """The server's Chrome trace of ``training_client``'s session ({} when it has none)."""
    import httpx
    import tinker

    session_id = training_client.holder.get_session_id()
    if not session_id:
        return {}
    rest = tinker.RestClient(base_url=base_url, api_key=API_KEY)
    return httpx.get(rest.export_session_trace(session_id).result(timeout=60)).json()
