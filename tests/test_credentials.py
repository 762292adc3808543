"""TinkerCredentials: block metadata, secrets, key errors, local server start/wait/reuse.

The start/wait/reuse logic runs against a small stand-in HTTP process (a stdlib server that
answers ``/api/v1/healthz``); the last test gets a real client from the real ``tinker_local``
server when it is present.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import sys
import textwrap
import time
from pathlib import Path

import pytest
import tinker
from prefect.testing.standard_test_suites import BlockStandardTestSuite
from pydantic import ValidationError

import tinker_blocks.credentials as cred
from tinker_local import launcher, procs
from tinker_blocks import LocalServerError, TinkerCredentials

KEY = "tml-very-secret-key-0123456789"

STAND_IN = textwrap.dedent(
    """
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    root = args[args.index("--root") + 1]
    mode = args[args.index("--mode") + 1] if "--mode" in args else "ok"
    with open(os.path.join(root, "starts.txt"), "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    print("stand-in server starting on port", port, flush=True)
    if mode == "crash":
        print("boom: cannot load model 'nope'", flush=True)
        sys.exit(3)
    if mode == "hang":
        print("stuck loading weights", flush=True)
        time.sleep(600)
    time.sleep(0.3)  # not ready at once: the block must wait

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/api/v1/healthz"
            body = json.dumps({"status": "ok"} if ok else {"detail": "not found"}).encode()
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)


class TestTinkerCredentialsStandard(BlockStandardTestSuite):
    @pytest.fixture
    def block(self):
        return TinkerCredentials

    def test_has_a_valid_image(self, block):  # the standard check downloads the logo
        pytest.skip("no logo (and the standard check needs the internet)")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Make the block start the stand-in server; stops whatever it started afterwards."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    root = tmp_path / "local"

    def command(block, port, root_dir):
        return [sys.executable, str(script), "--port", str(port), "--root", str(root_dir), *block.local_extra_args]

    monkeypatch.setattr(cred, "server_command", command)
    cred._clients.clear()
    yield root
    cred.stop_local_server(root, timeout=5)
    cred._clients.clear()


def _starts(root: Path) -> list[int]:
    p = root / "starts.txt"
    return [int(x) for x in p.read_text().split()] if p.exists() else []


def test_local_start_wait_record_and_cached_client(stand_in):
    block = TinkerCredentials(local=True, local_root=str(stand_in))
    assert block.backend_name() == "local"
    t0 = time.monotonic()
    client = block.get_client()
    assert time.monotonic() - t0 < 20
    assert isinstance(client, tinker.ServiceClient)
    record = json.loads((stand_in / "server.json").read_text())
    assert record["base_url"] == f"http://127.0.0.1:{record['port']}"
    assert record["pid"] == _starts(stand_in)[0]
    assert launcher.healthy(record["base_url"])
    # same settings -> same cached client, even from another block instance
    assert block.get_client() is client
    assert TinkerCredentials(local=True, local_root=str(stand_in)).get_client() is client
    assert block.base_url_for_sdk() == record["base_url"]
    assert len(_starts(stand_in)) == 1


def test_local_reuses_recorded_server_and_restarts_dead_one(stand_in):
    block = TinkerCredentials(local=True, local_root=str(stand_in))
    first = cred.ensure_local_server(block)
    cred._clients.clear()  # as in a fresh process: only server.json is left
    assert cred.ensure_local_server(block)["pid"] == first["pid"]
    assert len(_starts(stand_in)) == 1
    # the recorded server dies -> the next call starts a new one (and the client is renewed)
    client = block.get_client()
    procs.terminate(first["pid"], timeout=5)
    assert not launcher.healthy(first["base_url"])
    client2 = block.get_client()
    assert client2 is not client
    assert len(_starts(stand_in)) == 2
    assert json.loads((stand_in / "server.json").read_text())["pid"] == _starts(stand_in)[1]
    assert block.stop_local_server() is True
    assert not (stand_in / "server.json").exists()
    assert block.stop_local_server() is False


def test_local_fixed_port(stand_in):
    port = procs.free_port()
    block = TinkerCredentials(local=True, local_root=str(stand_in), local_port=port)
    assert block.base_url_for_sdk() == f"http://127.0.0.1:{port}"
    # a different block pointed at the same (now busy) port but another root refuses to clash
    other = TinkerCredentials(local=True, local_root=str(stand_in / "other"), local_port=port)
    with pytest.raises(LocalServerError, match=f"port {port} already serves"):
        other.get_client()


def test_local_server_crash_reports_log_tail(stand_in):
    block = TinkerCredentials(local=True, local_root=str(stand_in), local_extra_args=["--mode", "crash"])
    with pytest.raises(LocalServerError, match=r"exited with code 3(.|\n)*boom: cannot load model 'nope'"):
        block.get_client()
    assert not (stand_in / "server.json").exists()


def test_local_server_timeout_stops_it_and_reports_log_tail(stand_in):
    block = TinkerCredentials(
        local=True, local_root=str(stand_in), local_extra_args=["--mode", "hang"], local_startup_timeout=1.5
    )
    with pytest.raises(LocalServerError, match=r"within 1.5 s(.|\n)*stuck loading weights"):
        block.get_client()
    (pid,) = _starts(stand_in)
    assert not procs.pid_alive(pid)


def test_server_command_names_the_real_cli(tmp_path):
    block = TinkerCredentials(
        local=True, local_models=["tiny", "smollm2"], local_device="cpu", local_threads=1, local_extra_args=["--x", "1"]
    )
    cmd = cred.server_command(block, 8123, tmp_path)
    assert cmd[:4] == [sys.executable, "-m", "tinker_local", "serve"]
    assert cmd[4:] == [
        "--host", "127.0.0.1", "--port", "8123", "--root", str(tmp_path), "--model", "tiny", "--model", "smollm2",
        "--device", "cpu", "--threads", "1", "--x", "1",
    ]
    if importlib.util.find_spec("tinker_local.cli") is not None:  # the real CLI accepts what we pass
        from tinker_local.cli import build_parser

        args = build_parser().parse_args(cred.server_command(TinkerCredentials(local=True, local_models=["tiny"],
                                                             local_device="cpu", local_threads=1), 8123, tmp_path)[3:])
        assert (args.port, args.root, args.model, args.device, args.threads) == (8123, tmp_path, ["tiny"], "cpu", 1)


def test_default_local_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFECT_TINKER_HOME", str(tmp_path / "home"))
    assert TinkerCredentials(local=True).resolved_local_root() == (tmp_path / "home").resolve()
    monkeypatch.delenv("PREFECT_TINKER_HOME")
    assert launcher.default_root() == Path.home() / ".prefect-tinker"


def test_hosted_and_remote_need_a_tml_key(monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    cred._clients.clear()
    with pytest.raises(ValueError, match="api_key is required for the hosted Tinker service"):
        TinkerCredentials().get_client()
    with pytest.raises(ValueError, match="required for the server at http://gpu-box:8000"):
        TinkerCredentials(base_url="http://gpu-box:8000/").get_client()
    with pytest.raises(ValidationError, match="api_key must start with 'tml-'") as info:
        TinkerCredentials(api_key="sk-not-a-tinker-key")
    assert "sk-not-a-tinker-key" not in str(info.value)
    with pytest.raises(ValidationError, match="base_url must start with http"):
        TinkerCredentials(base_url="gpu-box:8000", api_key=KEY)
    monkeypatch.setenv("TINKER_API_KEY", "bad-env-key")
    with pytest.raises(ValueError, match="TINKER_API_KEY must start with 'tml-'") as info:
        TinkerCredentials().get_client()
    assert "bad-env-key" not in str(info.value)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    client = TinkerCredentials().get_client()  # lazy: no request is made
    assert isinstance(client, tinker.ServiceClient)
    assert TinkerCredentials().get_client() is client
    remote = TinkerCredentials(base_url="http://gpu-box:8000/", api_key=KEY)
    assert remote.base_url == "http://gpu-box:8000" and remote.backend_name() == "remote"
    assert remote.get_client() is not client
    assert TinkerCredentials(api_key=KEY).backend_name() == "hosted"
    cred._clients.clear()


def test_secret_is_masked_everywhere(stand_in, caplog):
    block = TinkerCredentials(api_key=KEY, local=True, local_root=str(stand_in))
    for text in (repr(block), str(block), block.model_dump_json(), json.dumps(block.model_dump(mode="json"))):
        assert KEY not in text
    assert block.api_key.get_secret_value() == KEY
    schema = json.dumps(TinkerCredentials.model_json_schema())
    assert '"format": "password"' in schema and '"writeOnly": true' in schema
    with caplog.at_level(logging.DEBUG):
        block.get_client()
    assert "Starting local Tinker server" in caplog.text
    assert KEY not in caplog.text
    assert KEY not in (stand_in / "server.json").read_text()
    assert KEY not in (stand_in / "server.log").read_text()
    # blocks travel to task workers: they pickle, with the secret intact
    again = pickle.loads(pickle.dumps(block))
    assert again.api_key.get_secret_value() == KEY and again == block


def test_real_local_server_answers_the_sdk(tmp_path):
    """The block starts the real embedded server and hands its URL to the SDK: the server lists the
    model the block preloads (``local_models``), the cached client is reused, and a sample through that client
    carries the base model's logprobs of its tokens (an independent fp32 forward of the preset,
    built here: the server samples in fp32)."""
    import numpy as np
    import torch

    from tinker_local.models import resolve_model

    cred._clients.clear()
    block = TinkerCredentials(local=True, local_root=str(tmp_path / "real"), local_startup_timeout=90,
                              local_models=["tiny"])
    try:
        client = block.get_client()
        base_url = block.base_url_for_sdk()
        assert base_url == launcher.read_record(block.resolved_local_root())["base_url"]
        caps = tinker.RestClient(base_url=base_url, api_key=cred.LOCAL_API_KEY).get_server_capabilities().result()
        assert [m.model_name for m in caps.supported_models] == ["tiny"]
        assert block.get_client() is client
        prompt = [5, 17, 42, 7]
        res = client.create_sampling_client(base_model="tiny").result(timeout=60).sample(
            tinker.ModelInput.from_ints(prompt), 1, tinker.SamplingParams(max_tokens=4, seed=2, stop=[])
        ).result(timeout=120)
        tokens, logprobs = list(res.sequences[0].tokens), np.array(res.sequences[0].logprobs)
        spec = resolve_model("tiny", tmp_path / "reference")
        assert caps.supported_models[0].max_context_length == spec.max_context
        model, _ = spec.load()
        with torch.no_grad():
            full = torch.tensor([prompt + tokens])
            lp = torch.log_softmax(model.float().eval()(input_ids=full).logits[0].float(), -1)
        want = lp[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()
        assert len(tokens) == 4
        np.testing.assert_allclose(logprobs, want, atol=1e-4)
    finally:
        block.stop_local_server()
        cred._clients.clear()
