"""A shared server that holds against its own users: one real ``prefect-tinker local serve`` with two
keys (alice, admin; bob) and tight limits.  While bob trains through the unmodified SDK, alice
sends adversarial custom losses and oversized or malformed requests: each is refused with a 4xx (or
a failed future) whose message is one line naming the limit, and bob's losses equal those of the
same steps run alone on an engine of its own.  Also: a base model off the allow-list is refused
without the server looking at the path, ``models allow`` lets it in; ``local`` cannot be a key; a
session recorded without owner is nobody's; ``/local_stats`` shows bob his own counters only and
alice everyone's; a finished session's models leave the server's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types

from tests.adversarial_losses import cat_chain, outer, pow_chain
from tests.local_server import free_port, make_hf_model_dir
from tinker_local.launcher import healthy

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
CLI = str(Path(sys.executable).parent / "prefect-tinker")
STEPS = 6
LIMITS = {"--max-datums-per-request": "64", "--max-tokens-per-request": "4096", "--max-num-samples": "8",
          "--max-sample-tokens": "64", "--max-body-bytes": "1000000", "--loss-time-budget": "0.5",
          "--loss-max-elements": "1000000"}


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "local", *args], capture_output=True, text=True, timeout=120, check=check)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    top = tmp_path_factory.mktemp("limits")
    root = top / "root"
    keys = {"alice": _cli("keys", "--root", str(root), "add", "alice", "--admin").stdout.strip(),
            "bob": _cli("keys", "--root", str(root), "add", "bob").stdout.strip()}
    (root / "server").mkdir(parents=True, exist_ok=True)
    with open(root / "server" / "registry.jsonl", "a") as f:  # a session from before owners were recorded
        f.write(json.dumps({"event": "session", "session_id": "local-legacy0000", "tags": []}) + "\n")
    port, log = free_port(), top / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    argv = [CLI, "local", "serve", "--model", "tiny", "--dtype", "fp32", "--threads", "1", "--port", str(port),
            "--root", str(root), *[x for kv in LIMITS.items() for x in kv]]
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not healthy(url, timeout=2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield {"url": url, "root": root, "keys": keys, "log": log, "hf": make_hf_model_dir(top / "hf")}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _http(server, user: str, path: str, body=None, **kw) -> httpx.Response:
    headers = {"X-API-Key": server["keys"][user], **kw.pop("headers", {})}
    if body is None and "content" not in kw:
        return httpx.get(f"{server['url']}/api/v1{path}", headers=headers, timeout=60)
    if body is not None:
        kw["json"] = body
    return httpx.post(f"{server['url']}/api/v1{path}", headers=headers, timeout=60, **kw)


def _one_line_4xx(r: httpx.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    for w in words:
        assert w in detail, (w, detail)
    return detail


def _datums(seed: int, n: int = 4, length: int = 12) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, 2048, length + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": toks[1:].astype(np.int64),
                                               "weights": np.ones(length, np.float32)}))
    return out


def _bob_trains(server, out: dict) -> None:
    try:
        sc = tinker.ServiceClient(base_url=server["url"], api_key=server["keys"]["bob"])
        tc = sc.create_lora_training_client("tiny", rank=4, seed=11)
        losses = []
        for s in range(STEPS):
            fb = tc.forward_backward(_datums(s), "cross_entropy").result(timeout=300)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
            losses.append(fb.metrics["loss:sum"])
        out["losses"] = losses
        out["sc"] = sc
    except Exception as e:  # reported by the test
        out["error"] = e


def _solo_losses(tmp_path) -> list[float]:
    """bob's steps alone, on an engine of its own (same seed, data and hyperparameters)."""
    from tinker_local.engine import Datum, Engine

    eng = Engine(tmp_path / "solo", dtype="fp32", device="cpu", num_threads=1)
    eng.create_model("m", "tiny", 4, seed=11)
    losses = []
    for s in range(STEPS):
        data = [Datum(tokens=d.model_input.to_ints(), inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
                for d in _datums(s)]
        losses.append(eng.forward_backward("m", data, "cross_entropy", None).metrics["loss:sum"])
        eng.optim_step("m", learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12)
    return losses


def slow(logprobs):
    x = logprobs
    for _ in range(500):  # 1000 nodes, each run for each of 64 datums
        x = torch.exp(x * 1e-3)
    return x.sum(), {}


def _alice_attacks(server, sc_alice, tc_alice) -> list[str]:
    """Every adversarial request of alice; returns the one-line refusals."""
    said = []
    for fn in (pow_chain, cat_chain):
        with pytest.raises(tinker.BadRequestError) as e:
            sc_alice.create_custom_loss(fn, {"logprobs": 1}).result(timeout=60)
        assert "limit" in str(e.value)
        said.append(str(e.value))
    for fn, n, length, limit in ((outer, 1, 1100, "1210000 elements (1100, 1100)"), (slow, 64, 60, "time budget")):
        handle = sc_alice.create_custom_loss(fn, {"logprobs": 1}).result(timeout=60)
        with pytest.raises(tinker.RequestFailedError) as e:
            tc_alice.forward_backward_custom(_datums(0, n=n, length=length), handle).result(timeout=300)
        msg = str(e.value)
        assert limit in msg, msg
        said.append(msg)
    with pytest.raises(tinker.APIStatusError) as e:  # 65 datums, over 64
        tc_alice.forward_backward(_datums(1, n=65, length=4), "cross_entropy").result(timeout=60)
    assert e.value.status_code == 413 and "datums per request is 65, over the limit of 64" in str(e.value)
    with pytest.raises(tinker.APIStatusError) as e:  # 8 x 600 tokens, over 4096
        tc_alice.forward_backward(_datums(1, n=8, length=600), "cross_entropy").result(timeout=60)
    assert e.value.status_code == 413 and "tokens per request is 4800" in str(e.value)
    short, long = ([{"type": "encoded_text", "tokens": [1] * k}] for k in (3, 4000))
    for params, n, chunks, words in (
            ({"max_tokens": 8}, 10**6, short, ("num_samples is 1000000", "--max-num-samples")),
            ({"max_tokens": 10**9}, 1, short, ("max_tokens is 1000000000", "--max-sample-tokens")),
            ({"max_tokens": 64}, 8, long, ("prompt + num_samples x max_tokens tokens is 4512",))):
        r = _http(server, "alice", "/asample", {"base_model": "tiny", "prompt": {"chunks": chunks}, "num_samples": n,
                                                "sampling_params": params})
        said.append(_one_line_4xx(r, 413, *words))
    said.append(_one_line_4xx(_http(server, "alice", "/create_session", content=b"x" * 1_500_000),
                              413, "over the limit of 1000000 bytes"))
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 50_000_000)
    r = _http(server, "alice", "/forward_backward", content=bomb, headers={"Content-Encoding": "zstd"})
    said.append(_one_line_4xx(r, 413, "decompresses to more than 1000000 bytes"))
    r = _http(server, "alice", "/create_session", content=b"[" * 100_000 + b"]" * 100_000)
    said.append(_one_line_4xx(r, 422, "create_session"))
    sid = sc_alice.holder.get_session_id()
    for base in ("/etc", "../../../etc/passwd", str(server["hf"]), "tiny-vl"):
        r = _http(server, "alice", "/create_model", {"session_id": sid, "model_seq_id": 99, "base_model": base,
                                                     "lora_config": {"rank": 4}})
        said.append(_one_line_4xx(r, 403, "is not allowed on this server", "models allow"))
    return said


def test_adversarial_requests_are_refused_in_one_line_while_another_key_trains_undisturbed(server, tmp_path):
    bob: dict = {}
    trainer = threading.Thread(target=_bob_trains, args=(server, bob))
    trainer.start()
    sc_alice = tinker.ServiceClient(base_url=server["url"], api_key=server["keys"]["alice"])
    tc_alice = sc_alice.create_lora_training_client("tiny", rank=4, seed=3)
    said = _alice_attacks(server, sc_alice, tc_alice)
    trainer.join(600)
    assert "error" not in bob, bob.get("error")
    assert bob["losses"] == _solo_losses(tmp_path)  # bit for bit: nothing of alice's reached bob's model
    assert len(said) == 14 and all("\n" not in s for s in said)
    # the compute thread is alive and alice's own model still trains after all that
    fb = tc_alice.forward_backward(_datums(5), "cross_entropy").result(timeout=120)
    assert fb.metrics["loss:sum"] > 0
    # counters: bob sees his own, alice (admin) everyone's
    mine = _http(server, "bob", "/local_stats").json()
    assert set(mine) == {"user", "counters"} and mine["user"] == "bob"
    assert mine["counters"]["jobs"] >= 2 * STEPS and mine["counters"]["compute_s"] > 0
    assert mine["counters"]["resident_models"] == 1
    everyone = _http(server, "alice", "/local_stats").json()
    assert {"alice", "bob"} <= set(everyone["users"]) and "compute" in everyone
    assert everyone["users"]["bob"]["jobs"] == mine["counters"]["jobs"]
    # a finished session's models leave the server's memory
    bob["sc"].close("success").result(timeout=60)
    sc_alice.close("success").result(timeout=60)
    deadline = time.monotonic() + 60
    while _http(server, "bob", "/local_stats").json()["counters"]["resident_models"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _http(server, "bob", "/local_stats").json()["counters"]["resident_models"] == 0


def test_allow_list_reserved_names_and_ownerless_sessions(server):
    sc = tinker.ServiceClient(base_url=server["url"], api_key=server["keys"]["bob"])
    hf = str(server["hf"])
    with pytest.raises(tinker.PermissionDeniedError, match="is not allowed on this server"):
        sc.create_lora_training_client(hf, rank=4, seed=1).result(timeout=60)
    assert "allowed base model" in _cli("models", "--root", str(server["root"]), "allow", hf).stdout
    assert hf in _cli("models", "--root", str(server["root"]), "list").stdout
    tc = sc.create_lora_training_client(hf, rank=4, seed=1).result(timeout=120)  # picked up without a restart
    assert tc.forward([_hf_datum()], "cross_entropy").result(timeout=120).metrics["loss:sum"] > 0
    assert "denied" in _cli("models", "--root", str(server["root"]), "deny", hf).stdout
    with pytest.raises(tinker.PermissionDeniedError):
        sc.create_lora_training_client(hf, rank=4, seed=2).result(timeout=60)
    bad = _cli("models", "--root", str(server["root"]), "allow", "/no/such/model", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    for name in ("local", "Local"):
        r = _cli("keys", "--root", str(server["root"]), "add", name, check=False)
        assert r.returncode == 2 and "reserved" in r.stderr
    for user in ("alice", "bob"):  # recorded without owner: nobody's
        _one_line_4xx(_http(server, user, "/sessions/local-legacy0000"), 404)
    sc.close("success").result(timeout=60)


def _hf_datum() -> types.Datum:
    toks = list(range(5, 17))
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(toks[1:], np.int64),
                                       "weights": np.ones(11, np.float32)})
