"""The unmodified tinker SDK against a real ``python -m tinker_local serve`` (tiny preset, fp32).

One server subprocess per module, on a free 127.0.0.1 port; the SDK is only ever pointed at it
after ``/api/v1/healthz`` answered (the SDK retries a dead port for ~5 minutes).
Unit tests of the seq_id ordering and of the wire conversions need no server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tinker_local import protocol as P  # noqa: E402
from tinker_local.protocol_sampling import sample_response_to_proto  # noqa: E402
from tinker_local.tinker_paths import engine_id, parse_tinker_path  # noqa: E402
from tinker_local.futures import FutureStore  # noqa: E402
from tinker_local.launcher import healthy  # noqa: E402
from tinker_local.outcomes import UserError  # noqa: E402

API_KEY = "tml-local-test"


# ------------------------------------------------------------------------------------------------
# server fixture


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base_url, root): a live server subprocess; its log is printed if startup fails."""
    root = tmp_path_factory.mktemp("tinker_local_root")
    port = _free_port()
    log = open(root / "server.log", "w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tinker_local", "serve", "--model", "tiny", "--dtype", "fp32",
         "--port", str(port), "--host", "127.0.0.1", "--root", str(root), "--threads", "2"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{(root / 'server.log').read_text()}")
            if healthy(base_url, timeout=2):  # urllib: no TLS context built for each poll, as httpx does
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after 120 s:\n{(root / 'server.log').read_text()}")
            time.sleep(0.2)
        yield base_url, root
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def service_client(server):
    sc = tinker.ServiceClient(base_url=server[0], api_key=API_KEY)
    yield sc
    sc.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


@pytest.fixture(scope="module")
def trained(service_client):
    """A LoRA training client trained 5 steps on two sentences; (client, tokenizer, data, losses)."""
    tc = service_client.create_lora_training_client("tiny", rank=8, seed=0).result(timeout=120)
    tok = tc.get_tokenizer()
    data = [_datum(tok.encode("The quick brown fox jumps over the lazy dog. 12 + 34 = 46")),
            _datum(tok.encode("Hello world, hello tinker. 7 * 8 = 56"))]
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")  # submitted back to back, no wait
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result(timeout=60).metrics["loss:sum"])
        opt.result(timeout=60)
    return tc, tok, data, losses


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    """An independent fp32 copy of the tiny preset, built in this process."""
    import torch

    from tinker_local.models import resolve_model

    torch.set_num_threads(1)
    spec = resolve_model("tiny", tmp_path_factory.mktemp("ref_cache"))
    model, tok = spec.load()
    return model.float().eval(), tok


def _ref_logprobs(model, tokens: list[int]) -> np.ndarray:
    """logprob of tokens[i] given tokens[:i] for i >= 1 (length len(tokens) - 1), fp32."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp.numpy()


# ------------------------------------------------------------------------------------------------
# HTTP basics


def test_healthz_and_api_key(server):
    base_url, _ = server
    assert httpx.get(f"{base_url}/api/v1/healthz").json() == {"status": "ok"}
    assert httpx.post(f"{base_url}/api/v1/client/config", json={}).status_code == 401
    bad = httpx.post(f"{base_url}/api/v1/client/config", json={}, headers={"X-API-Key": "sk-x"})
    assert bad.status_code == 401 and "tml-" in bad.json()["detail"]
    ok = httpx.post(f"{base_url}/api/v1/client/config", json={}, headers={"X-API-Key": API_KEY})
    assert ok.status_code == 200
    gone = httpx.post(f"{base_url}/api/v1/retrieve_future", json={"request_id": "nope"},
                      headers={"X-API-Key": API_KEY})
    assert gone.status_code == 410


# ------------------------------------------------------------------------------------------------
# training


def test_training_loss_falls(trained):
    tc, tok, data, losses = trained
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_name == "tiny"
    assert info.model_data.model_name == info.model_data.tokenizer_id  # loadable: the preset's dir
    assert ":" not in info.model_data.tokenizer_id and Path(info.model_data.tokenizer_id).is_dir()
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.9 * losses[0], losses
    out = tc.forward(data, "cross_entropy").result(timeout=60)
    assert [o["logprobs"].shape[0] for o in out.loss_fn_outputs] == [d.model_input.length for d in data]
    total = -sum(float(o["logprobs"].to_numpy().sum()) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)


def test_parallel_chunks_of_one_forward_are_merged_in_order(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4).result(timeout=120)
    data = [_datum([1 + i % 7, 2, 3, 4]) for i in range(1030)]  # > 1024 datums: 2 chunks, sent in parallel
    out = tc.forward_backward(data, "cross_entropy").result(timeout=120)
    assert len(out.loss_fn_outputs) == 1030
    lp = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    np.testing.assert_allclose(lp[1027], lp[1027 - 7 * 10], atol=1e-5)  # same datum, other chunk
    total = -sum(float(x.sum()) for x in lp)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)


def test_state_round_trip_with_optimizer(service_client, trained):
    tc, _tok, data, _ = trained
    saved = tc.save_state("round-trip").result(timeout=60)
    assert saved.path == f"tinker://{tc.model_id}/weights/round-trip"
    tc2 = service_client.create_training_client_from_state_with_optimizer(saved.path).result(timeout=120)
    assert tc2.model_id != tc.model_id and tc2.get_info().lora_rank == 8
    # the same step on both clients must give the same weights (Adam moments restored)
    for client in (tc, tc2):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    a = tc.forward(data, "cross_entropy").result(timeout=60)
    b = tc2.forward(data, "cross_entropy").result(timeout=60)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-5)
    # without the optimizer the Adam moments restart, so the same step lands elsewhere
    tc3 = service_client.create_training_client_from_state(saved.path).result(timeout=120)
    tc3.forward_backward(data, "cross_entropy")
    tc3.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    c = tc3.forward(data, "cross_entropy").result(timeout=60)
    diff = np.abs(a.loss_fn_outputs[0]["logprobs"].to_numpy() - c.loss_fn_outputs[0]["logprobs"].to_numpy())
    assert diff.max() > 1e-4


def test_user_errors_fail_with_user_category(service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4).result(timeout=120)
    bad = _datum([1, 2, 10**6])
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.forward_backward([bad], "cross_entropy").result(timeout=60)
    assert e.value.category == types.RequestErrorCategory.User
    assert "vocab" in str(e.value)
    with pytest.raises(tinker.NotFoundError):
        service_client.create_sampling_client(model_path="tinker://nope/sampler_weights/x").result(timeout=60)


# ------------------------------------------------------------------------------------------------
# sampling


@pytest.fixture(scope="module")
def sampler(service_client, trained):
    tc, tok, _, _ = trained
    saved = tc.save_weights_for_sampler("sampler-1").result(timeout=60)
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/sampler-1"
    return service_client.create_sampling_client(model_path=saved.path).result(timeout=60), saved.path


def test_sample_num_samples_seed_and_stop(trained, sampler):
    _tc, tok, _, _ = trained
    sc, _path = sampler
    prompt = types.ModelInput.from_ints(tok.encode("Hello world"))
    params = types.SamplingParams(max_tokens=8, seed=11, stop=[], temperature=1.0)
    r1 = sc.sample(prompt, 3, params).result(timeout=60)
    r2 = sc.sample(prompt, 3, params).result(timeout=60)
    assert len(r1.sequences) == 3
    assert all(len(s.tokens) == 8 and s.stop_reason == "length" for s in r1.sequences)
    assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
    assert len({s.sequence_id for s in r1.sequences}) == 3
    # stop strings: stop at the text of the first three sampled tokens
    ref = sc.sample(prompt, 1, params).result(timeout=60).sequences[0]
    stop = tok.decode(ref.tokens[:3])
    assert stop.strip(), "degenerate stop string"
    stopped = sc.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=11, stop=[stop])).result(timeout=60)
    seq = stopped.sequences[0]
    assert seq.stop_reason == "stop" and stop in tok.decode(seq.tokens)
    assert seq.tokens == ref.tokens[: len(seq.tokens)] and len(seq.tokens) <= 3
    # stop token ids
    by_id = sc.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=11, stop=[ref.tokens[1]])).result(timeout=60)
    assert by_id.sequences[0].stop_reason == "stop" and by_id.sequences[0].tokens[-1] == ref.tokens[1]


def test_base_model_logprobs_equal_independent_torch_forward(service_client, reference_model):
    model, tok = reference_model
    sc = service_client.create_sampling_client(base_model="tiny").result(timeout=60)
    prompt_ids = tok.encode("12 + 34 = ")
    res = sc.sample(types.ModelInput.from_ints(prompt_ids), 2,
                    types.SamplingParams(max_tokens=10, seed=3, stop=[]),
                    include_prompt_logprobs=True).result(timeout=60)
    for seq in res.sequences:
        ref = _ref_logprobs(model, prompt_ids + list(seq.tokens))[len(prompt_ids) - 1:]
        np.testing.assert_allclose(np.array(seq.logprobs), ref, atol=1e-4)
    assert res.prompt_logprobs[0] is None
    np.testing.assert_allclose(np.array(res.prompt_logprobs[1:]), _ref_logprobs(model, prompt_ids), atol=1e-4)


def test_lora_sampler_logprobs_equal_independent_peft_forward(server, trained, sampler, reference_model):
    import copy

    from peft import PeftModel

    _, root = server
    tc, tok, data, _ = trained
    sc, path = sampler
    parsed = parse_tinker_path(path)
    adapter_dir = root / "checkpoints" / engine_id(parsed.model_id) / "sampler_weights" / parsed.name
    peft_model = PeftModel.from_pretrained(copy.deepcopy(reference_model[0]), str(adapter_dir)).eval()
    prompt_ids = tok.encode("Hello world")
    res = sc.sample(types.ModelInput.from_ints(prompt_ids), 1,
                    types.SamplingParams(max_tokens=10, seed=5, stop=[])).result(timeout=60)
    seq = list(res.sequences[0].tokens)
    ref = _ref_logprobs(peft_model, prompt_ids + seq)[len(prompt_ids) - 1:]
    np.testing.assert_allclose(np.array(res.sequences[0].logprobs), ref, atol=1e-4)
    # the adapter actually changed the model
    base = _ref_logprobs(reference_model[0], prompt_ids + seq)[len(prompt_ids) - 1:]
    assert np.abs(base - ref).max() > 1e-3


def test_save_weights_and_get_sampling_client(trained, reference_model):
    """The client samples the trained weights: the logprobs it returns for its tokens equal the
    training client's own forward of the same sequence (fp32 server: to 1e-4), and differ from the
    base model's (an independent fp32 forward) by far more."""
    tc, tok, _, _ = trained
    sc = tc.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = tok.encode("Hello world")
    res = sc.sample(types.ModelInput.from_ints(prompt), 1,
                    types.SamplingParams(max_tokens=6, seed=1, stop=[])).result(timeout=60)
    seq = list(res.sequences[0].tokens)
    sampled = np.array(res.sequences[0].logprobs)
    assert len(seq) == 6 and sampled.shape == (6,)
    full = prompt + seq
    fwd = tc.forward([_datum(full)], "cross_entropy").result(timeout=60)
    trainer = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
    np.testing.assert_allclose(sampled, trainer, atol=1e-4)
    base = _ref_logprobs(reference_model[0], full)[len(prompt) - 1:]
    assert np.abs(sampled - base).max() > 0.05  # five steps at lr 1e-3 moved these logprobs


# ------------------------------------------------------------------------------------------------
# REST


def test_rest_runs_checkpoints_capabilities(server, trained, sampler):
    tc = trained[0]
    rc = tinker.RestClient(base_url=server[0], api_key=API_KEY)
    caps = rc.get_server_capabilities().result(timeout=30)
    assert "tiny" in [m.model_name for m in caps.supported_models]
    cks = rc.list_checkpoints(tc.model_id).result(timeout=30).checkpoints
    paths = {c.tinker_path: c.checkpoint_type for c in cks}
    assert paths[f"tinker://{tc.model_id}/weights/round-trip"] == "training"
    assert paths[sampler[1]] == "sampler"
    run = rc.get_training_run(tc.model_id).result(timeout=30)
    assert run.base_model == "tiny" and run.lora_rank == 8
    runs = rc.list_training_runs().result(timeout=30)
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    info = rc.get_weights_info_by_tinker_path(sampler[1]).result(timeout=30)
    assert info.base_model == "tiny" and info.lora_rank == 8


# ------------------------------------------------------------------------------------------------
# units: ordering and wire conversions (no server)


def test_seq_ids_run_in_order_and_repeats_return_the_original():
    store = FutureStore(gap_timeout_s=0.5)
    ran: list[int] = []
    store.register_model("m", next_seq=1)
    gate = threading.Event()
    ids = {}
    for seq in (3, 2):
        ids[seq] = store.submit("op", lambda s=seq: ran.append(s) or {"seq": s}, model_id="m", seq_id=seq)
    assert store.submit("op", lambda: {}, model_id="m", seq_id=3) == ids[3]
    store.start(None)
    time.sleep(0.1)
    assert ran == []  # 1 has not arrived
    ids[1] = store.submit("op", lambda: (gate.wait(5), ran.append(1))[1] or {"seq": 1}, model_id="m", seq_id=1)
    gate.set()
    for seq in (1, 2, 3):
        assert store.get(ids[seq]).wait_blocking(5)
    assert ran == [1, 2, 3]
    # a missing seq_id is skipped after the gap timeout
    rid = store.submit("op", lambda: ran.append(5) or {}, model_id="m", seq_id=5)
    assert store.get(rid).wait_blocking(5) and ran[-1] == 5
    # errors keep their category
    bad = store.submit("op", lambda: (_ for _ in ()).throw(UserError("nope")))
    boom = store.submit("op", lambda: 1 / 0)
    assert store.get(bad).wait_blocking(5) and store.get(boom).wait_blocking(5)
    assert (store.get(bad).outcome.category, store.get(boom).outcome.category) == ("user", "server")
    store.stop()


def test_wire_round_trips_through_the_sdk_decoders():
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([5, 6, 7, 8])], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8}),
        model_id="m", seq_id=4)
    msg = P.parse_forward_backward(forward_backward_request_to_proto(req).SerializeToString(), None)
    (d,) = P.datums_from_proto(msg)
    assert d.tokens == [5, 6, 7] and d.inputs["target_tokens"].tolist() == [6, 7, 8]
    assert P.loss_fn_config_from_proto(msg) == {"clip_low_threshold": pytest.approx(0.8)}
    raw = P.forward_backward_output_to_proto(
        [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.zeros((3, 2), np.float32)}],
        {"loss:sum": 3.0})
    out = deserialize_forward_backward_output(raw)
    assert out.metrics == {"loss:sum": 3.0}
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]
    assert out.loss_fn_outputs[1]["logprobs"].shape == [3, 2]
    sr = deserialize_sample_response(sample_response_to_proto(
        [{"tokens": [1, 2], "logprobs": [-0.5, -0.25], "stop_reason": "stop"}],
        [None, -1.5, -2.5], [None, [(3, -0.1)], [(4, -0.2), (5, -0.3)]], prompt_logprobs_last_n=2))
    assert sr.sequences[0].tokens == [1, 2] and sr.sequences[0].stop_reason == "stop"
    assert sr.prompt_logprobs == [None, -1.5, -2.5]
    assert sr.topk_prompt_logprobs[2] == [(4, pytest.approx(-0.2)), (5, pytest.approx(-0.3))]
    with pytest.raises(P.ProtocolError):
        parse_tinker_path("tinker://m/checkpoints/x")


def test_pending_poll_answers_try_again_then_result(tmp_path):
    from fastapi.testclient import TestClient

    from tinker_local.server import create_app

    release = threading.Event()

    class SlowEngine:
        def create_model(self, model_id, *a, **kw):
            release.wait(10)

        def get_info(self, model_id):
            return {"base_model": "tiny", "lora_rank": 4, "tokenizer_id": "/tok"}

    app = create_app(SlowEngine(), tmp_path, poll_wait_s=0.1)
    h = {"X-API-Key": API_KEY}
    with TestClient(app, client=("127.0.0.1", 50000)) as client:
        sid = client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "x"}, headers=h).json()[
            "session_id"
        ]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
        first = client.post("/api/v1/create_model", json=body, headers=h).json()
        assert client.post("/api/v1/create_model", json=body, headers=h).json() == first  # same seq: same future
        poll = client.post("/api/v1/retrieve_future", json={"request_id": first["request_id"]}, headers=h)
        assert poll.status_code == 408 and poll.json()["type"] == "try_again"
        release.set()
        done = client.post("/api/v1/retrieve_future", json={"request_id": first["request_id"]}, headers=h)
        assert done.json() == {"type": "create_model", "model_id": f"{sid}:train:0"}
        info = client.post("/api/v1/get_info", json={"model_id": f"{sid}:train:0"}, headers=h).json()
        assert info["model_data"]["tokenizer_id"] == "/tok" and info["lora_rank"] == 4


def test_registry_survives_a_restart(tmp_path):
    from tinker_local.registry import CheckpointRecord, Registry, RunRecord

    reg = Registry(tmp_path)
    reg.add_run(RunRecord(model_id="s:train:0", base_model="tiny", lora_rank=4))
    uri = "tinker://s:train:0/weights/a"
    reg.add_checkpoint(CheckpointRecord(uri=uri, model_id="s:train:0", kind="state", name="a", path="/x"))
    reg.add_checkpoint(CheckpointRecord(uri=uri + "b", model_id="s:train:0", kind="state", name="ab", path="/y"))
    reg.delete_checkpoint(uri + "b")
    with open(reg.log_path, "a") as f:
        f.write('{"event": "checkpoint", "uri": ')  # torn last line after a crash
    again = Registry(tmp_path)
    assert again.runs["s:train:0"].lora_rank == 4 and list(again.checkpoints) == [uri]
    assert again.run_to_rest(again.runs["s:train:0"])["last_checkpoint"]["tinker_path"] == uri
