"""Running the two sides of a comparison: one ``prefect-tinker local serve`` per recipe (fp32, every request
recorded, content seeds, LoRA seed 0: :class:`Server`), the cookbook's program in a child process
(:data:`PRELUDE` + the recipe's program: :func:`cookbook_command`, :func:`run_cookbook`) and ``prefect-tinker
run RECIPE`` with our config (:func:`run_ours`), each in a session of its own, in a clean environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

from . import API_KEY, REPO

# the cookbook side: one small program per recipe (in the recipe's module), run in a child with only the
# server's URL/key, after this prelude
PRELUDE = """
import asyncio, json, logging, sys
a = json.loads(sys.argv[1])
from transformers import AutoTokenizer
from tinker_cookbook import tokenizer_utils
_tok = AutoTokenizer.from_pretrained(a["tokenizer_dir"])
# a local model has no hub id: tell the cookbook where its tokenizer is (its own extension point)
tokenizer_utils.register_tokenizer(a["model"], lambda: _tok)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


class Server:
    """One ``prefect-tinker local serve`` for a recipe: fp32, requests recorded, content seeds."""

    def __init__(self, work: Path, model: str, threads: int):
        self.work, self.model = work, model
        self.requests = work / "requests"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            _bin("prefect-tinker"), "local", "serve", "--model", model, "--port", str(self.port),
            "--root", str(work / "server"), "--dtype", "fp32", "--threads", str(threads),
            "--record-requests", str(self.requests), "--sampling-seed", "content", "--lora-seed", "0",
            "--log-level", "warning",
        ]  # fmt: skip
        self.log = work / "server.log"
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=_env(work), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {self.log}") from None
                time.sleep(0.5)
        self.tokenizer_dir = self._tokenizer_dir()

    def _tokenizer_dir(self) -> str:
        import tinker

        os.environ.pop("TINKER_BASE_URL", None)
        with tinker.ServiceClient(base_url=self.url, api_key=API_KEY) as sc:  # its heartbeat ends with the probe
            tc = sc.create_lora_training_client(base_model=self.model, rank=1).result()
            out = tc.get_info().model_data.tokenizer_id
        self.probe_session = self.sessions()  # that client's session: not part of any comparison
        return str(out)

    def teacher(self) -> str:
        """A teacher for distillation that differs from the student: a LoRA adapter (seed 1) trained two steps
        on a few chats at a high learning rate, saved as sampler weights; its ``tinker://`` path. Made once, in
        a session of its own (not part of any comparison)."""
        import numpy as np
        import tinker

        with tinker.ServiceClient(base_url=self.url, api_key=API_KEY) as sc:  # the weights outlive the session
            tc = sc.create_lora_training_client(base_model=self.model, rank=4, seed=1).result()
            tok = tc.get_tokenizer()
            texts = [f"User: What is {i} + {i}?\n\nAssistant: {2 * i}\n\nUser:" for i in range(8)]
            datums = []
            for t in texts:
                ids = tok.encode(t, add_special_tokens=False)
                datums.append(tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                    "weights": np.ones(len(ids) - 1, np.float32)}))
            for _ in range(2):
                tc.forward_backward(datums, "cross_entropy").result()
                tc.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
            return str(tc.save_weights_for_sampler("parity-teacher").result().path)

    def sessions(self) -> set[str]:
        return {p.stem for p in self.requests.glob("*.jsonl")} if self.requests.is_dir() else set()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _env(work: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "TINKER_")) and k not in ("HOME", "PYTHONPATH")
    }
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TINKER_TELEMETRY="0",
        TOKENIZERS_PARALLELISM="false", PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_TINKER_UI="off",
        WANDB_MODE="disabled",
    )  # fmt: skip
    env.update(extra)
    return env


def run_side(server: Server, label: str, cmd: list[str], env: dict[str, str]) -> list[str]:
    """Run ``cmd`` against ``server``; returns the sessions it opened (new request-log files)."""
    before = server.sessions()
    log = server.work / f"{label}.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600).returncode
    if rc:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise SystemExit(f"{label} failed (exit {rc}); the end of {log}:\n{tail}")
    new = sorted(server.sessions() - before, key=lambda s: (server.requests / f"{s}.jsonl").stat().st_mtime)
    print(f"  {label}: {time.monotonic() - t0:.0f} s, session(s) {', '.join(new) or 'none'}", flush=True)
    return new


def cookbook_command(code: str, args: dict[str, Any]) -> list[str]:
    """The command running cookbook program ``code`` (after :data:`PRELUDE`) with ``args`` (JSON;
    ``model``, ``tokenizer_dir`` and ``log`` among them)."""
    return [sys.executable, "-c", textwrap.dedent(PRELUDE) + textwrap.dedent(code), json.dumps(args)]


def run_cookbook(server: Server, code: str, args: dict[str, Any], cookbook: Path) -> list[str]:
    env = _env(server.work, TINKER_BASE_URL=server.url, TINKER_API_KEY=API_KEY, PYTHONPATH=str(cookbook))
    a = {"model": server.model, "tokenizer_dir": server.tokenizer_dir, "log": str(server.work / "cookbook"), **args}
    return run_side(server, "cookbook", cookbook_command(code, a), env)


def run_ours(server: Server, recipe: str, overrides: dict[str, Any]) -> list[str]:
    env = _env(server.work, TINKER_API_KEY=API_KEY)
    kv = {
        "model": server.model, "backend.base_url": server.url, "store": str(server.work / "store"),
        "run_name": f"parity-{recipe}", **overrides,
    }  # fmt: skip
    cmd = [_bin("prefect-tinker"), "run", recipe, *(f"{k}={_cli(v)}" for k, v in kv.items())]
    return run_side(server, "ours", cmd, env)


def _cli(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else str(v)
