"""A waiting task notices a dead Tinker server within a bounded time: a real ``tinker_local``
server killed with SIGKILL while an SDK future is pending ends the wait with ``ServerGone``
(naming URL, pid and log), and a restarted server serves a new client that resumes from the
checkpoint; a silent remote server and a stuck request end too. The embedded server starts with
a scrubbed environment (read back from ``/proc/<pid>/environ``)."""

from __future__ import annotations

import concurrent.futures as cf
import http.server
import os
import signal
import threading
import time

import numpy as np
import pytest
import tinker

import tinker_blocks.credentials as cred
from tinker_blocks import TinkerCredentials
from tinker_local.launcher import healthy
from tinker_local.server_env import server_environment
from tinker_blocks.server_watch import ServerDeadline, ServerGone, ServerProbe, wait_result

SECRETS = {
    "TINKER_API_KEY": "tml-secret-tinker-key", "AWS_ACCESS_KEY_ID": "AKIASECRETKEYID",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value", "AWS_SESSION_TOKEN": "aws-session-token-value",
    "HF_TOKEN": "hf_secret_token_value", "OPENAI_API_KEY": "sk-openai-secret", "GITHUB_TOKEN": "ghp_secret",
    "DATABASE_PASSWORD": "db-password-value", "HTTPS_PROXY": "http://user:proxy-pass@proxy:3128",
    "PREFECT_API_KEY": "pnu_secret_prefect",
}


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def test_server_environment_keeps_needs_and_drops_secrets():
    parent = {**SECRETS, "PATH": "/usr/bin", "HOME": "/root", "OMP_NUM_THREADS": "2", "HF_HOME": "/hf",
              "HF_HUB_OFFLINE": "0", "TINKER_LOCAL_FAIL_EVERY": "3", "LC_ALL": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
              "RANDOM_APP_SETTING": "x"}
    env = server_environment(parent)
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "OMP_NUM_THREADS": "2", "HF_HOME": "/hf",
                   "HF_HUB_OFFLINE": "0", "TINKER_LOCAL_FAIL_EVERY": "3", "LC_ALL": "C.UTF-8",
                   "CUDA_VISIBLE_DEVICES": "0", "TINKER_TELEMETRY": "0"}
    assert server_environment({"PATH": "/bin"})["HF_HUB_OFFLINE"] == "1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real embedded server started with secrets in the parent environment."""
    saved = {k: os.environ.get(k) for k in SECRETS}
    os.environ.update(SECRETS)
    cred._clients.clear()
    block = TinkerCredentials(local=True, local_root=str(tmp_path_factory.mktemp("watch")), local_models=["tiny"],
                              local_threads=1, local_startup_timeout=180)
    try:
        record = cred.ensure_local_server(block)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield block, record
    block.stop_local_server()
    cred._clients.clear()


def test_embedded_server_environment_has_no_secret(server):
    _, record = server
    env = _environ(record["pid"])
    for name, value in SECRETS.items():
        assert name not in env and all(value not in v for v in env.values()), name
    assert env["PATH"] == os.environ["PATH"] and env["HF_HUB_OFFLINE"] == os.environ.get("HF_HUB_OFFLINE", "1")


def _datum(tokens: list[int]) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
    )


def test_kill_9_while_a_future_is_pending_then_restart(server):
    block, record = server
    service = block.get_client()
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    batch = [_datum(list(range(1, 40)))]
    client.forward_backward(batch, "cross_entropy").result()
    client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    state = client.save_state("before-kill").result().path
    expected = client.forward(batch, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    os.kill(record["pid"], signal.SIGSTOP)  # the request cannot be answered: it stays pending
    future = client.forward(batch, "cross_entropy")
    threading.Timer(1.0, os.kill, (record["pid"], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(ServerGone) as err:
        wait_result(future, block, deadline_s=60, poll_s=0.5, what="forward of the test")
    waited = time.monotonic() - t0
    assert waited < 10, waited
    assert err.value.url == record["base_url"] and err.value.pid == record["pid"]
    msg = str(err.value)
    assert record["base_url"] in msg and f"process {record['pid']} exited" in msg and record["log"] in msg
    assert "forward of the test" in msg
    assert isinstance(err.value, ConnectionError)  # transient for the task retry policy

    new = block.restart_local_server()
    assert new["pid"] != record["pid"] and healthy(new["base_url"])
    service2 = block.get_client()
    assert service2 is not service
    resumed = service2.create_training_client_from_state_with_optimizer(state).result()
    got = wait_result(resumed.forward(batch, "cross_entropy"), block, deadline_s=120, poll_s=0.5)
    np.testing.assert_allclose(got.loss_fn_outputs[0]["logprobs"].to_numpy(), expected, atol=1e-5)


class _Silent(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # answers (404): a server that is up
        self.send_response(404)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_stuck_request_hits_the_deadline_and_silent_server_is_gone():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    pending: cf.Future = cf.Future()
    t0 = time.monotonic()
    with pytest.raises(ServerDeadline, match="within 1.5 s") as err:
        wait_result(pending, ServerProbe(url), deadline_s=1.5, poll_s=0.2)
    assert time.monotonic() - t0 >= 1.5 and err.value.url == url  # not before the deadline (a hang fails by timeout)
    assert pending.cancelled()
    srv.shutdown()
    srv.server_close()
    pending = cf.Future()
    t0 = time.monotonic()
    with pytest.raises(ServerGone, match="has not answered"):
        wait_result(pending, ServerProbe(url), deadline_s=60, poll_s=0.2, unanswered_s=1.0)
    assert time.monotonic() - t0 < 5
    done: cf.Future = cf.Future()
    done.set_result(7)
    assert wait_result(done, ServerProbe(url), deadline_s=1) == 7  # a result wins over a dead server
