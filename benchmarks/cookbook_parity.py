"""Same recipe, same numbers: tinker-cookbook 0.6.1's training loops and ours, request by request.

For each recipe this starts one ``prefect-tinker local serve`` (fp32, every request recorded with
its payload: ``--record-requests``; sampling seeded by the request's content: ``--sampling-seed
content``; LoRA adapters created without a seed initialised from seed 0: ``--lora-seed 0``), runs
the cookbook's own training entry point with a config in a child process (its own session), then
``prefect-tinker run RECIPE`` with the equivalent config (another session), and compares what the
two sessions sent:

- the training requests in order (``forward_backward`` / ``forward`` with every datum's model
  input, loss function, loss config and every loss input; ``optim_step`` with its Adam
  parameters), step by step;
- the sampling requests (prompt, sampling parameters other than the seed, the identity of the
  sampled weights, and what came back), one entry per sampled sequence, in a canonical order;
- the loss of every step (``loss:sum`` of each ``forward_backward``), and the final LoRA weights
  (the adapter of each side's last save).

It prints one table per recipe (requests compared, the first difference with its step, request,
datum, field and both values, the largest relative loss difference, the largest final weight
difference) and, last, one summary line per recipe.  Exit status 0 when every recipe is identical
within the tolerances (integers exact; floats within ``--rtol``, default 1e-6 relative).

The cookbook is not a dependency of the project; install it beside the environment (what
``scripts/setup.sh`` does, into ``.cookbook/``)::

    pip install --target .cookbook --no-deps tinker-cookbook==0.6.1 tml-renderers chz blobfile \\
        pyrage termcolor tiktoken lxml pycryptodomex
    python benchmarks/cookbook_parity.py --recipe sft --steps 20
    python benchmarks/cookbook_parity.py --recipe sft,dpo,rl --model smollm2 --json parity.json

``--cookbook DIR`` (default ``.cookbook`` in the checkout, else ``$COOKBOOK_DIR``) is put on the
children's ``PYTHONPATH``.  The config mapping (cookbook field -> ours) of each recipe is in
``RECIPES`` below and in docs/cookbook-parity.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
API_KEY = "tml-cookbook-parity"

# --------------------------------------------------------------------------------------------------
# the cookbook side: one small program per recipe, run in a child with only the server's URL/key

PRELUDE = """
import asyncio, json, logging, sys
a = json.loads(sys.argv[1])
from transformers import AutoTokenizer
from tinker_cookbook import tokenizer_utils
_tok = AutoTokenizer.from_pretrained(a["tokenizer_dir"])
# a local model has no hub id: tell the cookbook where its tokenizer is (its own extension point)
tokenizer_utils.register_tokenizer(a["model"], lambda: _tok)
"""

COOKBOOK_SFT = """
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=a["model"], renderer_name=a["renderer"], max_length=a["max_length"],
    batch_size=a["batch_size"], train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
cfg = train.Config(
    log_path=a["log"], recipe_name="parity_sft", model_name=a["model"], renderer_name=a["renderer"],
    dataset_builder=FromConversationFileBuilder(common_config=common, file_path=a["data"],
                                                test_size=a["test_size"], shuffle_seed=a["seed"]),
    learning_rate=a["lr"], lr_schedule="linear", num_epochs=a["num_epochs"], lora_rank=a["lora_rank"],
    save_every=0, eval_every=0, max_steps=a["steps"])
asyncio.run(train.main(cfg))
"""

COOKBOOK_DPO = """
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=a["model"], renderer_name=a["renderer"], max_length=a["max_length"],
    batch_size=a["batch_size"])
cfg = train_dpo.Config(
    log_path=a["log"], recipe_name="parity_dpo", model_name=a["model"], renderer_name=a["renderer"],
    dataset_builder=DPODatasetBuilderFromComparisons(
        common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=a["data"])),
    learning_rate=a["lr"], lr_schedule="linear", num_epochs=a["num_epochs"], dpo_beta=a["beta"],
    lora_rank=a["lora_rank"], save_every=0, eval_every=0, infrequent_eval_every=0, max_steps=a["steps"])
train_dpo.main(cfg)
"""

COOKBOOK_RL = """
import chz, datasets
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.recipes.math_rl.math_env import Gsm8kDataset, MathEnv
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import RLDatasetBuilder


class FileGsm8kDataset(Gsm8kDataset):
    # the cookbook's GSM8K dataset (shuffled by seed, MathEnv with its few-shot prefix, boxed answers graded
    # with sympy) over a local JSONL of {question, answer} rows instead of the hub's copy (offline here)
    def __init__(self, path, batch_size, group_size, renderer, seed=0):
        self.ds = datasets.load_dataset("json", data_files=path, split="train").shuffle(seed=seed)
        self.batch_size, self.group_size, self.renderer = batch_size, group_size, renderer
        self.convo_prefix = MathEnv.standard_fewshot_prefix()


@chz.chz
class FileGsm8kBuilder(RLDatasetBuilder):
    path: str
    batch_size: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        tok = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tok)
        return FileGsm8kDataset(self.path, self.batch_size, self.group_size, renderer), None


if a["data"]:
    builder = FileGsm8kBuilder(path=a["data"], batch_size=a["groups"], group_size=a["group_size"],
                               model_name_for_tokenizer=a["model"], renderer_name=a["renderer"])
else:
    builder = ArithmeticDatasetBuilder(
        batch_size=a["groups"], model_name_for_tokenizer=a["model"], renderer_name=a["renderer"],
        n_batches=a["steps"], group_size=a["group_size"])
stream = train.StreamMinibatchConfig(groups_per_batch=a["groups"], num_minibatches=a["minibatches"]) \
    if a["streaming"] else None
asynchronous = train.AsyncConfig(max_steps_off_policy=0, groups_per_batch=a["groups"], loss_fn=a["async_loss"]) \
    if a["async_loss"] else None
cfg = train.Config(async_config=asynchronous, max_steps=a["steps"],
    learning_rate=a["lr"], dataset_builder=builder, model_name=a["model"], recipe_name="parity_rl",
    renderer_name=a["renderer"], max_tokens=a["max_tokens"], log_path=a["log"], eval_every=0, save_every=0,
    lora_rank=a["lora_rank"], kl_penalty_coef=a["kl"], stream_minibatch_config=stream,
    kl_reference_config=train.KLReferenceConfig(base_model=a["model"]) if a["kl"] else None)
asyncio.run(train.main(cfg))
"""

COOKBOOK_DISTILL = """
import chz
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder


@chz.chz
class FilePromptsBuilder(RLDatasetBuilder):
    # the cookbook's PromptOnlyDataset over the prompts of a local JSONL ({"prompt": ...} rows, file order)
    path: str
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        tok = tokenizer_utils.get_tokenizer(self.model_name_for_tokenizer)
        prompts = [json.loads(line)["prompt"] for line in open(self.path) if line.strip()]
        return PromptOnlyDataset(prompts, batch_size=self.groups_per_batch, group_size=self.group_size,
                                 renderer=renderers.get_renderer(self.renderer_name, tokenizer=tok),
                                 tokenizer=tok), None


builder = FilePromptsBuilder(path=a["data"], groups_per_batch=a["groups"], group_size=a["group_size"],
                             model_name_for_tokenizer=a["model"], renderer_name=a["renderer"])
cfg = train_on_policy.Config(
    learning_rate=a["lr"], model_name=a["model"], recipe_name="parity_distill", renderer_name=a["renderer"],
    dataset_configs=[DistillationDatasetConfig(
        dataset_builder=builder, groups_per_batch=a["groups"],
        teacher_config=TeacherConfig(base_model=a["model"], load_checkpoint_path=a["teacher"]))],
    max_tokens=a["max_tokens"], lora_rank=a["lora_rank"], kl_penalty_coef=a["kl"], log_path=a["log"],
    eval_every=0, save_every=0, max_steps=a["steps"])
asyncio.run(train_on_policy.main(cfg))
"""

COOKBOOK_SDFT = """
from tinker_cookbook import renderers
from tinker_cookbook.distillation import sdft
from tinker_cookbook.recipes.sdft.datasets import SDFTDataset

rows = [json.loads(line) for line in open(a["data"]) if line.strip()]
tok = tokenizer_utils.get_tokenizer(a["model"])
dataset = SDFTDataset([r["question"] for r in rows], [r["answer"] for r in rows], batch_size=a["groups"],
                      group_size=a["group_size"], renderer=renderers.get_renderer(a["renderer"], tokenizer=tok))
cfg = sdft.Config(model_name=a["model"], recipe_name="parity_sdft", renderer_name=a["renderer"],
                  lora_rank=a["lora_rank"], learning_rate=a["lr"], max_tokens=a["max_tokens"], topk=a["topk"],
                  log_path=a["log"], eval_every=0, save_every=0, max_steps=a["steps"])
asyncio.run(sdft.main(cfg, dataset))
"""


# --------------------------------------------------------------------------------------------------
# running things


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


# --------------------------------------------------------------------------------------------------
# reading the request logs


def read_sessions(folder: Path, sessions: list[str]) -> list[dict[str, Any]]:
    """The request-log entries of ``sessions`` (files ``folder/<session>.jsonl``), session after session."""
    out: list[dict[str, Any]] = []
    for s in sessions:
        out.extend(json.loads(line) for line in (folder / f"{s}.jsonl").read_text().splitlines() if line)
    return out


def training_stream(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``forward_backward`` and ``optim_step`` requests, in the order the server ran them,
    each with its step (optimizer steps before it)."""
    out, step = [], 0
    for e in entries:
        if e["op"] in ("forward_backward", "optim_step"):
            out.append({**e, "step": step})
            if e["op"] == "optim_step":
                step += 1
    return out


def sample_stream(entries: list[dict[str, Any]], include: Callable[[dict], bool]) -> list[dict[str, Any]]:
    """One entry per sampled sequence: (weights, prompt, parameters without the seed, what came
    back), in a canonical order (sorted), for the sample requests ``include`` accepts."""
    out = []
    for e in entries:
        if e["op"] != "sample" or not include(e):
            continue
        params = {k: v for k, v in e["sampling_params"].items() if k != "seed"}
        for s in e["sequences"]:
            out.append(
                {
                    "weights": e["weights"],
                    "prompt": e["prompt"],
                    "sampling_params": params,
                    "prompt_logprobs": e["prompt_logprobs"],
                    "tokens": s["tokens"],
                    "logprobs": s["logprobs"],
                    "prompt_logprobs_out": e.get("prompt_logprobs_out"),
                }
            )
    out.sort(key=lambda r: json.dumps([r["weights"], r["prompt"], r["sampling_params"], r["tokens"]]))
    return out


def final_adapter(entries: list[dict[str, Any]]) -> Path | None:
    saves = [e for e in entries if e["op"] in ("save_weights", "save_weights_for_sampler")]
    return Path(saves[-1]["path"]) / "adapter_model.safetensors" if saves else None


# --------------------------------------------------------------------------------------------------
# comparing


@dataclass
class Difference:
    where: str
    field: str
    cookbook: Any
    ours: Any

    def __str__(self) -> str:
        return f"{self.where}, {self.field}: cookbook {_short(self.cookbook)} vs ours {_short(self.ours)}"


def _short(v: Any, n: int = 80) -> str:
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


@dataclass
class Comparison:
    recipe: str
    model: str
    requests: int = 0
    sequences: int = 0
    first: Difference | None = None
    max_float_rel: float = 0.0
    max_loss_rel: float = 0.0
    max_weight_abs: float | None = None
    steps: int = 0
    notes: list[str] = field(default_factory=list)
    losses: list[tuple[float, float]] = field(default_factory=list)

    def differ(self, d: Difference) -> None:
        if self.first is None:
            self.first = d

    def identical(self, rtol: float) -> bool:
        return (
            self.first is None
            and self.max_loss_rel <= rtol
            and (self.max_weight_abs is not None and self.max_weight_abs <= rtol)
        )


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_values(cmp: Comparison, where: str, name: str, a: Any, b: Any, rtol: float) -> None:
    """Integers and strings exact, floats within ``rtol`` (relative, with an absolute floor of
    ``rtol`` for values near 0); lists element by element."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                cmp.differ(Difference(where, f"{name}.{k}", a.get(k, "<absent>"), b.get(k, "<absent>")))
                continue
            compare_values(cmp, where, f"{name}.{k}", a[k], b[k], rtol)
        return
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            cmp.differ(Difference(where, f"{name} (length)", len(a), len(b)))
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if isinstance(x, (list, dict)):
                compare_values(cmp, where, f"{name}[{i}]", x, y, rtol)
            elif isinstance(x, float) or isinstance(y, float):
                if x is None or y is None:
                    if x is not y:
                        cmp.differ(Difference(where, f"{name}[{i}]", x, y))
                    continue
                r = _rel(float(x), float(y))
                if abs(float(x) - float(y)) <= rtol * 1e-3:  # both ~0
                    r = 0.0
                cmp.max_float_rel = max(cmp.max_float_rel, r)
                if r > rtol:
                    cmp.differ(Difference(where, f"{name}[{i}]", x, y))
            elif x != y:
                cmp.differ(Difference(where, f"{name}[{i}]", x, y))
        return
    if isinstance(a, float) or isinstance(b, float):
        r = _rel(float(a), float(b)) if a is not None and b is not None else (0.0 if a is b else math.inf)
        cmp.max_float_rel = max(cmp.max_float_rel, r)
        if r > rtol:
            cmp.differ(Difference(where, name, a, b))
    elif a != b:
        cmp.differ(Difference(where, name, a, b))


def from_training_start(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` from the creation of the model that trains (the one the first ``forward_backward``
    names) on: what a side asked before it (our distillation's teacher check: a probe
    ``compute_logprobs`` of the teacher) is a check before the run, not part of the recipe's requests."""
    model = next((e["model"] for e in entries if e["op"] == "forward_backward"), None)
    start = next((i for i, e in enumerate(entries) if e["op"] == "create_model" and e["model"] == model), 0)
    return entries[start:]


def by_optimizer_step(stream: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``stream`` (see :func:`training_stream`) with each step's ``forward_backward`` requests merged
    into one: their datums in a canonical order (sorted), their ``loss:sum`` added, their count
    kept as ``requests``; then the step's ``optim_step``."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for e in stream:
        if e["op"] == "forward_backward":
            pending.append(e)
            continue
        if pending:
            datums = sorted((d for p in pending for d in p["datums"]), key=lambda d: json.dumps(d, sort_keys=True))
            loss = sum(p["metrics"].get("loss:sum", math.nan) for p in pending)
            first = pending[0]
            out.append({**first, "datums": datums, "metrics": {"loss:sum": loss}, "requests": len(pending)})
            pending = []
        out.append(e)
    return out


def compare(
    recipe: str,
    model: str,
    cb: list[dict],
    ours: list[dict],
    rtol: float,
    samples: Callable[[dict], bool] | None,
    sample_fields: tuple[str, ...] | None = None,
    by_step: bool = False,
) -> Comparison:
    cmp = Comparison(recipe, model)
    cb, ours = from_training_start(cb), from_training_start(ours)
    ta, tb = training_stream(cb), training_stream(ours)
    if by_step:
        ta, tb = by_optimizer_step(ta), by_optimizer_step(tb)
    cmp.steps = sum(e["op"] == "optim_step" for e in ta)
    if len(ta) != len(tb):
        cmp.differ(Difference("training requests", "count", len(ta), len(tb)))
    for k, (a, b) in enumerate(zip(ta, tb, strict=False)):
        where = f"step {a['step']}, request {k} ({a['op']})"
        cmp.requests += 1
        if a["op"] != b["op"]:
            cmp.differ(Difference(where, "op", a["op"], b["op"]))
            break
        if a["op"] == "optim_step":
            compare_values(cmp, where, "adam_params", a["adam_params"], b["adam_params"], rtol)
            continue
        for f in ("loss_fn", "loss_fn_config", "requests"):
            if f in a or f in b:
                compare_values(cmp, where, f, a.get(f), b.get(f), rtol)
        if len(a["datums"]) != len(b["datums"]):
            cmp.differ(Difference(where, "datums (count)", len(a["datums"]), len(b["datums"])))
        for d, (x, y) in enumerate(zip(a["datums"], b["datums"], strict=False)):
            compare_values(cmp, f"{where}, datum {d}", "model_input", x["model_input"], y["model_input"], rtol)
            compare_values(cmp, f"{where}, datum {d}", "loss_fn_inputs", x["loss_fn_inputs"], y["loss_fn_inputs"], rtol)
        la, lb = a["metrics"].get("loss:sum", math.nan), b["metrics"].get("loss:sum", math.nan)
        cmp.losses.append((la, lb))
        cmp.max_loss_rel = max(cmp.max_loss_rel, _rel(la, lb))
    if samples is not None:
        sa, sb = sample_stream(cb, samples), sample_stream(ours, samples)
        if len(sa) != len(sb):
            cmp.differ(Difference("sampled sequences", "count", len(sa), len(sb)))
        for k, (a, b) in enumerate(zip(sa, sb, strict=False)):
            cmp.sequences += 1
            if sample_fields is not None:
                a, b = ({f: x[f] for f in sample_fields} for x in (a, b))
            compare_values(cmp, f"sampled sequence {k}", "sequence", a, b, rtol)
    fa, fb = final_adapter(cb), final_adapter(ours)
    if fa is None or fb is None:
        cmp.notes.append(f"final weights: a side saved none (cookbook {fa}, ours {fb})")
    else:
        cmp.max_weight_abs = max_weight_difference(fa, fb)
    return cmp


def max_weight_difference(a: Path, b: Path) -> float:
    """Largest |a - b| over the LoRA tensors of two adapter files (inf when their names or shapes
    differ)."""
    from safetensors.numpy import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if set(x) != set(y) or any(x[k].shape != y[k].shape for k in x):
        return math.inf
    return max((float(abs(x[k].astype("float64") - y[k].astype("float64")).max()) for k in x), default=0.0)


# --------------------------------------------------------------------------------------------------
# recipes


@dataclass
class Recipe:
    name: str  # our recipe (prefect-tinker run NAME)
    cookbook_code: str
    cookbook_args: Callable[..., dict[str, Any]]  # (args, work[, teacher]) -> the cookbook program's arguments
    ours: Callable[..., dict[str, Any]]  # (args, work[, teacher]) -> our config's key=value pairs
    samples: Callable[[dict], bool] | None = None  # which sample requests are compared (None: none)
    # the fields of a sampled sequence compared (default all: weights, prompt, parameters, what came back)
    sample_fields: tuple[str, ...] | None = None
    # compare each optimizer step's forward_backward datums as one set (streaming minibatches are filled in the
    # order groups finish sampling, which neither side controls): the step's datums in a canonical order, the
    # step's summed loss
    by_step: bool = False
    # the recipe needs a teacher (a sampler checkpoint on the server, made by Server.teacher)
    teacher: bool = False


def _sft_data(args: argparse.Namespace, work: Path) -> Path:
    """The conversations as ``{"messages": [...]}`` lines, the file both sides read (the cookbook's
    ``FromConversationFileBuilder`` wants exactly that). A record goes through our converter
    ``--format`` (default: by its shape: ``messages``; ``self_instruct`` with ``instances``;
    ``dialogue`` with an HH-style ``chosen`` transcript; ``prompt_completion`` with ``prompt``;
    ``instruction`` otherwise: instruction/input/output or Dolly's instruction/context/response),
    one conversation per converted record."""
    from prefect_tinker.recipes.data_sources import convert_record

    src = Path(args.dataset) if args.dataset else SHARED / "sft" / "dolly_slice_messages.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    out = work / "sft.jsonl"  # only the messages (the cookbook's builder keeps every column)
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt") as f, out.open("w") as g:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            fmt = args.format or _sft_format(rec)
            try:
                fields = {"text": "chosen"} if fmt == "dialogue" and "text" not in rec else None  # HH: the chosen
                convs = [c.messages for c in convert_record(rec, fmt, fields)]
            except ValueError as e:
                raise SystemExit(f"--dataset: {src}:{n}: {e}") from None
            for msgs in convs:
                g.write(json.dumps({"messages": msgs}) + "\n")
    return out


def _sft_format(rec: Any) -> str:
    if not isinstance(rec, dict) or "messages" in rec:
        return "messages"
    if "instances" in rec:
        return "self_instruct"
    if "chosen" in rec:
        return "dialogue"
    return "prompt_completion" if "prompt" in rec else "instruction"


def _sft_shape(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    n = sum(1 for line in data.open() if line.strip()) - args.test_size
    per_epoch = max(n // args.batch_size, 1)
    return {"num_epochs": max(1, math.ceil(args.steps / per_epoch))}


def sft_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = _sft_data(args, work)
    return {
        "data": str(data), "renderer": args.renderer, "max_length": args.max_length, "batch_size": args.batch_size,
        "test_size": args.test_size, "seed": 0, "lr": args.lr, "lora_rank": args.lora_rank, "steps": args.steps,
        **_sft_shape(args, data),
    }  # fmt: skip


def sft_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = _sft_data(args, work)
    return {
        "dataset": str(data), "renderer": our_renderer(args.renderer), "max_length": args.max_length,
        "batch_size": args.batch_size, "test_size": args.test_size, "seed": 0, "learning_rate": args.lr,
        "lr_schedule": "linear", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "num_epochs": _sft_shape(args, data)["num_epochs"],
        # what reproduces the cookbook's SFT:
        "reduction": "mean", "data_order": "cookbook", "on_too_long": "truncate_keep", "adam.eps": 1e-8,
        # no evaluation or sampling at the end (the cookbook's eval_every=0)
        "eval_every": 0, "save_every": 0, "num_eval_samples": 0,
    }  # fmt: skip


def our_renderer(renderer: str) -> str:
    """Our renderer sending the tokens of the cookbook's ``renderer``: ``role_colon_cookbook`` for its
    ``role_colon`` (ours trains the stop after every reply, takes the tokenizer's own leading tokens and
    escapes role markers in content); any other name as is."""
    return "role_colon_cookbook" if renderer == "role_colon" else renderer


def _hh_messages(text: str) -> list[dict[str, str]]:
    """An HH-RLHF transcript (``\\n\\nHuman: ...\\n\\nAssistant: ...``) as chat messages."""
    msgs: list[dict[str, str]] = []
    for part in text.split("\n\nHuman: ")[1:]:
        human, *replies = part.split("\n\nAssistant: ")
        msgs.append({"role": "user", "content": human.strip()})
        msgs.extend({"role": "assistant", "content": r.strip()} for r in replies)
    return msgs


# Pairs are kept short enough (2,000 characters a transcript) never to reach it: the cookbook truncates a
# longer pair, ours skips it (a truncated reply's log-ratio is not the reply's), a difference kept on purpose.
DPO_MAX_LENGTH = 2048


def dpo_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path, int]:
    """The comparisons twice: the cookbook's ``{comparison, label}`` rows and our ``{prompt, chosen,
    rejected}`` rows (the same pairs in the same order: HH-RLHF pairs whose transcripts share all
    but the last assistant reply, at most 2,000 characters each, both replies non-empty and
    different)."""
    src = Path(args.dataset) if args.dataset else SHARED / "prefs" / "hh_rlhf_harmless_base_test.jsonl.gz"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    opener = gzip.open if src.suffix == ".gz" else open
    need = args.steps * args.batch_size
    cb, ours = work / "dpo_cookbook.jsonl", work / "dpo_ours.jsonl"
    n = 0
    with opener(src, "rt") as f, cb.open("w") as g, ours.open("w") as h:
        for line in f:
            if not line.strip() or n >= need:
                continue
            rec = json.loads(line)
            if "comparison" in rec:  # already the cookbook's form
                comp = rec["comparison"]
                chosen, rejected = (
                    (comp["completion_A"], comp["completion_B"])
                    if rec["label"] == "A"
                    else (comp["completion_B"], comp["completion_A"])
                )
                prompt = comp["prompt_conversation"]
            elif isinstance(rec.get("prompt"), str) and "\n\nHuman: " not in rec["chosen"]:  # our plain form
                prompt = [{"role": "user", "content": rec["prompt"]}]
                chosen = [{"role": "assistant", "content": rec["chosen"]}]
                rejected = [{"role": "assistant", "content": rec["rejected"]}]
            else:
                c, r = _hh_messages(rec["chosen"]), _hh_messages(rec["rejected"])
                if len(rec["chosen"]) > 2000 or len(rec["rejected"]) > 2000 or not c or not r:
                    continue
                if c[:-1] != r[:-1] or c[-1]["role"] != "assistant" or r[-1]["role"] != "assistant":
                    continue
                prompt, chosen, rejected = c[:-1], c[-1:], r[-1:]
            # both sides train the same pairs: ours skips (counted) a pair with an empty reply or two identical
            # replies, which the cookbook trains (kept on purpose, docs/cookbook-parity.md); leave them out here
            texts = [" ".join(m["content"] for m in side).strip() for side in (chosen, rejected)]
            if not all(texts) or texts[0] == texts[1]:
                continue
            comp = {"prompt_conversation": prompt, "completion_A": chosen, "completion_B": rejected}
            g.write(json.dumps({"comparison": comp, "label": "A"}) + "\n")
            h.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
            n += 1
    return cb, ours, n


def dpo_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cb, _, n = dpo_data(args, work)
    return {
        "data": str(cb), "renderer": args.renderer, "max_length": DPO_MAX_LENGTH, "batch_size": args.batch_size,
        "lr": args.lr, "beta": 0.1, "lora_rank": args.lora_rank, "steps": args.steps,
        "num_epochs": max(1, math.ceil(args.steps / max(n // args.batch_size, 1))),
    }  # fmt: skip


def dpo_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    _, ours, n = dpo_data(args, work)
    return {
        "dataset": str(ours), "format": "preference", "renderer": our_renderer(args.renderer),
        "max_length": DPO_MAX_LENGTH,
        "batch_size": args.batch_size, "test_size": 0, "seed": 0, "learning_rate": args.lr, "lr_schedule": "linear",
        "lora_rank": args.lora_rank, "max_steps": args.steps, "beta": 0.1,
        # what reproduces the cookbook's DPO:
        "reference_via": "sampler", "data_order": "cookbook", "adam.eps": 1e-8,
        "eval_every": 0, "save_every": 0,
    }  # fmt: skip


def _rl_data(args: argparse.Namespace, work: Path) -> Path | None:
    """With ``--dataset``: the problems as ``{question, answer}`` JSON lines (a GSM8K-style JSONL:
    the answer's last line ``#### n``), the first ``4 * steps`` of them (one pass, full batches)."""
    if not args.dataset:
        return None
    src = Path(args.dataset)
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    opener = gzip.open if src.suffix == ".gz" else open
    out, need, n = work / "rl_problems.jsonl", RL_GROUPS * args.steps, 0
    with opener(src, "rt") as f, out.open("w") as g:
        for line in f:
            if line.strip() and n < need:
                rec = json.loads(line)
                g.write(json.dumps({"question": rec["question"], "answer": str(rec["answer"])}) + "\n")
                n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} problems, {need} needed for {args.steps} steps")
    return out


RL_GROUPS = 4  # groups (problems) per step, of RL_GROUP_SIZE rollouts each
RL_GROUP_SIZE = 4


def _rl_args(args: argparse.Namespace, variant: str, work: Path) -> dict[str, Any]:
    data = _rl_data(args, work)
    return {
        "groups": RL_GROUPS, "group_size": RL_GROUP_SIZE, "max_tokens": args.max_tokens, "steps": args.steps,
        "lr": args.lr, "lora_rank": args.lora_rank, "renderer": args.renderer,
        "kl": 0.05 if variant == "kl" else 0.0, "streaming": variant == "streaming", "minibatches": 2,
        "data": str(data) if data else None, "async_loss": "ppo" if variant == "async" else None,
    }  # fmt: skip


def rl_cookbook(variant: str) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    return lambda args, work: _rl_args(args, variant, work)


def rl_ours(variant: str) -> Callable[[argparse.Namespace, Path], dict[str, Any]]:
    def ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
        a = _rl_args(args, variant, work)
        env: dict[str, Any] = {
            "env": "arithmetic", "env_options": {"max_operand": 100, "problems": "cookbook", "answer": "last_integer"}
        }
        if a["data"]:  # the cookbook's MathEnv prompt, boxed answers
            env = {
                "env": "math", "dataset": a["data"],
                "env_options": {"question_field": "question", "answer_field": "answer", "answer_style": "boxed",
                                "prompt": "cookbook"},
            }  # fmt: skip
        out = {
            **env, "few_shot": True,
            "renderer": our_renderer(args.renderer), "group_size": a["group_size"], "groups_per_batch": a["groups"],
            "max_tokens": a["max_tokens"], "learning_rate": args.lr, "lr_schedule": "constant",
            "lora_rank": args.lora_rank, "max_steps": args.steps, "seed": 0, "loss_fn": "importance_sampling",
            "temperature": 1.0, "save_every": 0, "eval_every": 0, "kl_penalty_coef": a["kl"],
            # what reproduces the cookbook's RL (with env_options above):
            "format_needs_stop": True, "remove_constant_reward_groups": False, "adam.eps": 1e-8,
        }  # fmt: skip
        if a["kl"]:
            out["kl_reference"] = f"base:{args.model}"
        if variant == "async":  # on-policy (no step off policy): each step trains the groups of one batch
            out.update(schedule="async", max_steps_off_policy=0, loss_fn="ppo")
            # the cookbook sends no loss_fn_config (the server's clip thresholds); ours sends 0.8 / 1.2 unless unset
            out.update(clip_low_threshold=None, clip_high_threshold=None)
        if variant == "streaming":
            out.update(schedule="streaming", num_minibatches=a["minibatches"])
        return out

    return ours


def _distill_prompts(args: argparse.Namespace, work: Path) -> Path:
    """The prompts, one ``{"prompt": text}`` line each: the first user message of each conversation of a chat
    JSONL (``--dataset``, default ours ``prefect_tinker/recipes/data/example_chat.jsonl``), or a JSONL's ``prompt`` /
    ``question`` / ``instruction`` field; the first ``DISTILL_GROUPS * steps`` of them."""
    src = Path(args.dataset) if args.dataset else REPO / "prefect_tinker" / "recipes" / "data" / "example_chat.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    out, need, n = work / "distill_prompts.jsonl", DISTILL_GROUPS * args.steps, 0
    with src.open() as f, out.open("w") as g:
        for line in f:
            if not line.strip() or n >= need:
                continue
            rec = json.loads(line)
            if "messages" in rec:
                text = next(m["content"] for m in rec["messages"] if m["role"] == "user")
            else:
                text = next(rec[k] for k in ("prompt", "question", "instruction") if k in rec)
            g.write(json.dumps({"prompt": text.strip()}) + "\n")
            n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} prompts, {need} needed for {args.steps} steps")
    return out


DISTILL_GROUPS = 4


def _distill_args(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    return {
        "data": str(_distill_prompts(args, work)), "groups": DISTILL_GROUPS, "group_size": RL_GROUP_SIZE,
        "max_tokens": args.max_tokens, "steps": args.steps, "lr": args.lr, "lora_rank": args.lora_rank,
        "renderer": args.renderer, "kl": 1.0, "teacher": teacher,
    }  # fmt: skip


def distill_cookbook(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    return _distill_args(args, work, teacher)


def distill_ours(args: argparse.Namespace, work: Path, teacher: str) -> dict[str, Any]:
    a = _distill_args(args, work, teacher)
    return {
        # the cookbook scores the student's own tokens with the teacher: the teacher renders as the student does
        "mode": "on_policy", "teacher": {"weights": teacher, "renderer": our_renderer(args.renderer)},
        "dataset": a["data"], "renderer": our_renderer(args.renderer),
        "group_size": a["group_size"], "groups_per_batch": a["groups"], "max_tokens": a["max_tokens"],
        "learning_rate": args.lr, "lr_schedule": "constant", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "seed": 0, "loss_fn": "importance_sampling", "temperature": 1.0, "kl_penalty_coef": a["kl"],
        "save_every": 0, "eval_every": 0,
        # what reproduces the cookbook's on-policy distillation:
        "env_options": {"format": "prompt", "shuffle": False}, "adam.eps": 1e-8,
    }  # fmt: skip


#: tinker-cookbook 0.6.1's SDFT demonstration (distillation/sdft.py: DEFAULT_DEMO_TEMPLATE) in our teacher's
#: prompt_template slots ({prompt}, {answer})
COOKBOOK_SDFT_TEMPLATE = (
    "{prompt}\n\nThis is an example for a response to the question:\n{answer}\n\n"
    "Now answer with a response of your own, including the thinking process."
)


def _sdft_data(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """Questions and golden answers, twice: ``{question, answer}`` rows for the cookbook's ``SDFTDataset`` and
    ``{messages: [user, assistant]}`` rows for ours: the first user message and the first assistant reply of each
    conversation of a chat JSONL (``--dataset``, default ours ``prefect_tinker/recipes/data/example_chat.jsonl``)."""
    src = Path(args.dataset) if args.dataset else REPO / "prefect_tinker" / "recipes" / "data" / "example_chat.jsonl"
    if not src.is_file():
        raise SystemExit(f"--dataset: no such file {src}")
    cb, ours = work / "sdft_cookbook.jsonl", work / "sdft_ours.jsonl"
    need, n = DISTILL_GROUPS * args.steps, 0
    with src.open() as f, cb.open("w") as g, ours.open("w") as h:
        for line in f:
            if not line.strip() or n >= need:
                continue
            msgs = json.loads(line)["messages"]
            q = next(m["content"] for m in msgs if m["role"] == "user").strip()
            ans = next(m["content"] for m in msgs if m["role"] == "assistant").strip()
            g.write(json.dumps({"question": q, "answer": ans}) + "\n")
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
            h.write(json.dumps({"messages": msgs}) + "\n")
            n += 1
    if n < need:
        raise SystemExit(f"--dataset: {src} has {n} conversations, {need} needed for {args.steps} steps")
    return cb, ours


SDFT_GROUP_SIZE, SDFT_TOPK = 2, 20


def sdft_cookbook(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cb, _ = _sdft_data(args, work)
    return {
        "data": str(cb), "groups": DISTILL_GROUPS, "group_size": SDFT_GROUP_SIZE, "max_tokens": args.max_tokens,
        "steps": args.steps, "lr": args.lr, "lora_rank": args.lora_rank, "renderer": args.renderer, "topk": SDFT_TOPK,
    }  # fmt: skip


def sdft_ours(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    _, ours = _sdft_data(args, work)
    return {
        "mode": "sdft", "dataset": str(ours), "renderer": our_renderer(args.renderer),
        "group_size": SDFT_GROUP_SIZE, "groups_per_batch": DISTILL_GROUPS, "max_tokens": args.max_tokens,
        "learning_rate": args.lr, "lr_schedule": "constant", "lora_rank": args.lora_rank, "max_steps": args.steps,
        "seed": 0, "temperature": 1.0, "topk": SDFT_TOPK, "skip_first_tokens": 3, "save_every": 0, "eval_every": 0,
        # what reproduces the cookbook's SDFT: its teacher (the base model, rendering as the student, shown its
        # demonstration), the prompts in file order, Adam eps 1e-8
        "teacher": {"weights": f"base:{args.model}", "renderer": our_renderer(args.renderer),
                    "prompt_template": COOKBOOK_SDFT_TEMPLATE},
        "env_options": {"format": "messages", "shuffle": False}, "adam.eps": 1e-8,
    }  # fmt: skip


def any_sample(e: dict) -> bool:
    return True


def prompt_logprobs(e: dict) -> bool:
    return bool(e["prompt_logprobs"])


RECIPES: dict[str, Recipe] = {
    "sft": Recipe("sft", COOKBOOK_SFT, sft_cookbook, sft_ours),
    # reference logprobs: sample requests with prompt logprobs; compared on prompt and prompt logprobs
    "dpo": Recipe("dpo", COOKBOOK_DPO, dpo_cookbook, dpo_ours, samples=prompt_logprobs),
    "rl": Recipe("rl", COOKBOOK_RL, rl_cookbook("sync"), rl_ours("sync"), samples=any_sample),
    "rl_kl": Recipe("rl", COOKBOOK_RL, rl_cookbook("kl"), rl_ours("kl"), samples=any_sample),
    "rl_streaming": Recipe(
        "rl", COOKBOOK_RL, rl_cookbook("streaming"), rl_ours("streaming"), samples=any_sample, by_step=True
    ),
    # the cookbook's async loop with ppo (its default loss, stable_reinforce, is refused by our server: its
    # objective is unpublished); groups finish in no fixed order, so each step's datums are compared as a set
    "rl_async": Recipe("rl", COOKBOOK_RL, rl_cookbook("async"), rl_ours("async"), samples=any_sample, by_step=True),
    "distill": Recipe("distill", COOKBOOK_DISTILL, distill_cookbook, distill_ours, samples=any_sample, teacher=True),
    "sdft": Recipe("distill", COOKBOOK_SDFT, sdft_cookbook, sdft_ours, samples=any_sample),
}


# --------------------------------------------------------------------------------------------------
# report


def table(cmp: Comparison, rtol: float) -> str:
    rows = [
        ("recipe", cmp.recipe),
        ("model", cmp.model),
        ("optimizer steps", str(cmp.steps)),
        ("training requests compared", str(cmp.requests)),
        ("sampled sequences compared", str(cmp.sequences)),
        ("first difference", str(cmp.first) if cmp.first else "none (identical)"),
        ("largest float difference (relative)", f"{cmp.max_float_rel:.3g}"),
        ("largest per-step loss difference (relative)", f"{cmp.max_loss_rel:.3g}"),
        ("largest final LoRA weight difference", "n/a" if cmp.max_weight_abs is None else f"{cmp.max_weight_abs:.3g}"),
        ("verdict", "IDENTICAL" if cmp.identical(rtol) else "DIFFERENT"),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(w)}  {v}" for k, v in rows]
    lines += [f"  note: {n}" for n in cmp.notes]
    if cmp.losses:
        pairs = ", ".join(f"{a:.6g}/{b:.6g}" for a, b in cmp.losses[:8])
        lines.append(f"  loss:sum of the first steps (cookbook/ours): {pairs}")
    return "\n".join(lines)


def summary(cmp: Comparison, rtol: float) -> str:
    verdict = "identical" if cmp.identical(rtol) else f"DIFFERENT ({cmp.first or 'tolerance'})"
    w = "n/a" if cmp.max_weight_abs is None else f"{cmp.max_weight_abs:.2g}"
    return (
        f"{cmp.recipe} [{cmp.model}]: {cmp.requests} requests + {cmp.sequences} sequences, {cmp.steps} steps, "
        f"max loss diff {cmp.max_loss_rel:.2g}, max weight diff {w}: {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="sft", help=f"comma-separated, of: {', '.join(RECIPES)} (or all)")
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF model directory (default tiny)")
    ap.add_argument("--dataset", default=None, help="data file of the recipe (default: the recipe's own)")
    ap.add_argument(
        "--format", default=None, help="SFT: our converter of --dataset's records (default: by the record's shape)"
    )
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--test-size", type=int, default=0)
    ap.add_argument("--renderer", default="role_colon")
    ap.add_argument("--max-tokens", type=int, default=8, help="RL: most sampled tokens per reply (default 8)")
    ap.add_argument("--rtol", type=float, default=1e-6, help="float tolerance, relative (default 1e-6)")
    ap.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--cookbook", type=Path, default=Path(os.environ.get("COOKBOOK_DIR", REPO / ".cookbook")))
    ap.add_argument("--json", type=Path, default=None, help="write the comparisons here")
    args = ap.parse_args(argv)
    names = list(RECIPES) if args.recipe == "all" else [r.strip() for r in args.recipe.split(",") if r.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        ap.error(f"--recipe: unknown {', '.join(unknown)} (known: {', '.join(RECIPES)})")
    if not (args.cookbook / "tinker_cookbook").is_dir():
        ap.error(f"--cookbook: no tinker_cookbook in {args.cookbook} (install it: see this script's docstring)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cookbook-parity-"))
    results = []
    for name in names:
        r = RECIPES[name]
        rw = work / name
        rw.mkdir(parents=True, exist_ok=True)
        print(f"{name}: serving {args.model} (fp32) in {rw}", flush=True)
        server = Server(rw, args.model, args.threads)
        try:
            extra = (server.teacher(),) if r.teacher else ()
            cb = run_cookbook(server, r.cookbook_code, r.cookbook_args(args, rw, *extra), args.cookbook)
            ours = run_ours(server, r.name, r.ours(args, rw, *extra))
            cmp = compare(
                name,
                args.model,
                read_sessions(server.requests, cb),
                read_sessions(server.requests, ours),
                args.rtol,
                r.samples,
                r.sample_fields,
                r.by_step,
            )
        finally:
            server.close()
        print(table(cmp, args.rtol), flush=True)
        results.append(cmp)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "recipe": c.recipe, "model": c.model, "steps": c.steps, "requests": c.requests,
                        "sequences": c.sequences, "first_difference": None if c.first is None else str(c.first),
                        "max_float_rel": c.max_float_rel, "max_loss_rel": c.max_loss_rel,
                        "max_weight_abs": c.max_weight_abs, "identical": c.identical(args.rtol), "losses": c.losses,
                        "notes": c.notes,
                    }
                    for c in results
                ],
                indent=1,
            )
        )  # fmt: skip
    for c in results:
        print(summary(c, args.rtol))
    return 0 if all(c.identical(args.rtol) for c in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
