"""A shared ``tinker_local`` server: API keys, per-user isolation, limits, the audit log, TLS.

One real server (``prefect-tinker local serve`` in a subprocess, HTTPS with a CA and server
certificate made here, JWT auth, per-user model limit) with two users' keys made by
``prefect-tinker local keys add``: alice (admin) and bob.  Every cross-user access through the
unmodified SDK and raw HTTP is refused as not found; a published checkpoint is readable by bob but
not deletable; unknown and revoked keys get 401; no key is written to any file of the server.
Also: the server refuses to bind a non-loopback address without keys, the key store keeps hashes
only, and the compute thread serves users round-robin.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.local_server import free_port

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
CLI = str(Path(sys.executable).parent / "prefect-tinker")


def _make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key) PEMs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, srv_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    srv = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
           .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                          critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
           .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
           .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "server.pem", folder / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(srv_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def _keys(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, "local", "keys", "--root", str(root), *args], capture_output=True, text=True,
                          timeout=60, check=True)


class Shared:
    def __init__(self, base_url: str, root: Path, log: Path, ca: Path, keys: dict[str, str]):
        self.base_url, self.root, self.log, self.ca, self.keys = base_url, root, log, ca, keys
        self.ssl = ssl.create_default_context(cafile=str(ca))

    def http(self, method: str, path: str, user: str | None, key: str | None = None, **kw) -> httpx.Response:
        headers = {"X-API-Key": key if key is not None else self.keys[user]}
        return httpx.request(method, f"{self.base_url}/api/v1{path}", headers=headers, verify=self.ssl,
                             timeout=30, **kw)

    def service(self, user: str) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=self.keys[user])

    def rest(self, user: str) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.base_url, api_key=self.keys[user])


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    top = tmp_path_factory.mktemp("shared")
    root = top / "root"
    ca, cert, key = _make_certs(top)
    keys = {"alice": _keys(root, "add", "alice", "--admin").stdout.strip(),
            "bob": _keys(root, "add", "bob").stdout.strip()}
    assert all(k.startswith("tml-") and len(k) > 40 for k in keys.values())
    port, log = free_port(), top / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    with open(log, "w") as f:
        proc = subprocess.Popen([CLI, "local", "serve", "--model", "tiny", "--dtype", "fp32", "--threads", "1",
                                 "--port", str(port), "--root", str(root), "--jwt-auth",
                                 "--tls-cert", str(cert), "--tls-key", str(key), "--max-models-per-user", "2"],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    old_ca = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = str(ca)  # how the SDK's httpx client trusts the server's CA
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                ctx = ssl.create_default_context(cafile=str(ca))
                if httpx.get(f"{url}/api/v1/healthz", verify=ctx, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        yield Shared(url, root, log, ca, keys)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if old_ca is None:
            os.environ.pop("SSL_CERT_FILE", None)
        else:
            os.environ["SSL_CERT_FILE"] = old_ca


def _datum(tok, text: str) -> types.Datum:
    ids = tok.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


def _sample(client, tok) -> list[int]:
    res = client.sample(types.ModelInput.from_ints(tok.encode("hello")), 1,
                        types.SamplingParams(max_tokens=3, seed=1, stop=[])).result(timeout=60)
    return res.sequences[0].tokens


def test_two_users_see_only_their_own_work(shared):
    alice, bob = shared.service("alice"), shared.service("bob")
    ra, rb = shared.rest("alice"), shared.rest("bob")
    assert ra.whoami().result(timeout=30).user_urn == "tml:user:alice"  # JWT exchange carries the user
    assert rb.whoami().result(timeout=30).user_urn == "tml:user:bob"

    tc = alice.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=120)
    tok = tc.get_tokenizer()
    data = [_datum(tok, "hello world, hello tinker")]
    tc.forward_backward(data, "cross_entropy").result(timeout=60)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    state = tc.save_state("a-state").result(timeout=60).path
    sampler = tc.save_weights_for_sampler("a-sampler").result(timeout=60).path
    external = tc.save_weights_external("a-export").result(timeout=60).path
    alice_sid = alice.holder.get_session_id()
    before = tc.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"]

    # listings: bob sees none of alice's runs, checkpoints or sessions
    own_b = bob.create_lora_training_client("tiny", rank=2, seed=1).result(timeout=120)
    runs_b = [r.training_run_id for r in rb.list_training_runs().result(timeout=30).training_runs]
    assert runs_b == [own_b.model_id]
    assert rb.get_training_run(own_b.model_id).result(timeout=30).model_owner == "bob"
    assert tc.model_id in [r.training_run_id for r in ra.list_training_runs().result(timeout=30).training_runs]
    assert rb.list_user_checkpoints().result(timeout=30).checkpoints == []
    assert alice_sid not in rb.list_sessions().result(timeout=30).sessions
    assert alice_sid in ra.list_sessions().result(timeout=30).sessions
    for call in (lambda: rb.get_training_run(tc.model_id), lambda: rb.list_checkpoints(tc.model_id),
                 lambda: rb.get_session(alice_sid), lambda: rb.get_external_weights_urls(external),
                 lambda: rb.delete_checkpoint_from_tinker_path(sampler),
                 lambda: rb.publish_checkpoint_from_tinker_path(sampler)):
        with pytest.raises(tinker.NotFoundError):
            call().result(timeout=30)
    # load and sample: as if the checkpoints did not exist
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        bob.create_training_client_from_state(state).result(timeout=60)
    with pytest.raises(tinker.NotFoundError, match="unknown checkpoint"):
        bob.create_sampling_client(model_path=sampler).result(timeout=60)
    # train on alice's model with bob's credentials (the SDK's own TrainingClient, bob's connection)
    hijack = tinker.TrainingClient(bob.holder, 7, tc.model_id, info=tc.get_info())
    with pytest.raises(Exception, match="unknown model_id"):
        hijack.forward_backward(data, "cross_entropy").result(timeout=60)
    with pytest.raises(Exception, match="unknown model_id"):
        hijack.optim_step(types.AdamParams(learning_rate=1.0)).result(timeout=60)
    assert tc.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == pytest.approx(before)

    # raw HTTP: futures, samplers, traces, sessions, storage usage
    created = shared.http("POST", "/create_model", "alice", json={
        "session_id": alice_sid, "model_seq_id": 50, "base_model": "tiny", "lora_config": {"rank": 2}}).json()
    assert shared.http("POST", "/retrieve_future", "bob", json={"request_id": created["request_id"]}).status_code == 410
    assert shared.http("POST", "/retrieve_future", "alice",
                       json={"request_id": created["request_id"]}).json()["model_id"] == created["model_id"]
    sampling = shared.http("POST", "/create_sampling_session", "alice", json={
        "session_id": alice_sid, "sampling_session_seq_id": 90, "model_path": sampler}).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tok.encode("hello")}]}
    body = {"sampling_session_id": sampling, "prompt": prompt, "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 3}}
    assert shared.http("POST", "/asample", "bob", json=body).status_code == 404
    assert shared.http("GET", f"/samplers/{sampling}", "bob").status_code == 404
    assert shared.http("GET", f"/sessions/{alice_sid}/trace_export", "bob").status_code == 404
    assert shared.http("POST", "/create_model", "bob", json={
        "session_id": alice_sid, "model_seq_id": 51, "base_model": "tiny"}).status_code == 404
    assert shared.http("POST", "/session_heartbeat", "bob", json={"session_id": alice_sid}).status_code == 404
    search = shared.http("POST", "/sessions/search", "bob", json={"limit": 50}).json()["sessions"]
    assert alice_sid not in {s["session_id"] for s in search}
    usage_b = rb.get_current_checkpoint_storage_usage().result(timeout=30)
    assert sum(d.checkpoint_count for d in usage_b.data) == 0
    usage_a = ra.get_current_checkpoint_storage_usage().result(timeout=30)
    mine = ra.list_user_checkpoints(limit=100).result(timeout=30).checkpoints
    assert sum(d.size_bytes for d in usage_a.data) == sum(c.size_bytes for c in mine) > 0
    assert {d.user_name for d in usage_a.data} == {"alice"}

    # published: bob may sample and load it, never delete or unpublish it
    ra.publish_checkpoint_from_tinker_path(sampler).result(timeout=30)
    ra.publish_checkpoint_from_tinker_path(state).result(timeout=30)
    assert len(_sample(bob.create_sampling_client(model_path=sampler).result(timeout=60), tok)) == 3
    loaded = bob.create_training_client_from_state(state).result(timeout=120)
    assert loaded.forward(data, "cross_entropy").result(timeout=60).metrics["loss:sum"] == pytest.approx(before)
    for call in (lambda: rb.delete_checkpoint_from_tinker_path(sampler),
                 lambda: rb.unpublish_checkpoint_from_tinker_path(sampler)):
        with pytest.raises(tinker.PermissionDeniedError, match="only its owner"):
            call().result(timeout=30)
    assert sampler in [c.tinker_path for c in ra.list_user_checkpoints(limit=100).result(timeout=30).checkpoints]

    # the per-user model limit (serve --max-models-per-user 2): bob holds two now
    with pytest.raises(tinker.PermissionDeniedError, match="max-models-per-user 2"):
        bob.create_lora_training_client("tiny", rank=2, seed=2).result(timeout=120)

    # the audit log: alice (admin) reads who did what; bob may not
    log = ra.get_audit_log().result(timeout=30).entries
    seen = {(e.event, e.event_details["user"]) for e in log}
    assert {("session_create", "alice"), ("model_create", "alice"), ("checkpoint_save", "alice"),
            ("checkpoint_publish", "alice"), ("checkpoint_load", "bob"), ("model_create", "bob")} <= seen
    with pytest.raises(tinker.PermissionDeniedError, match="admin key"):
        rb.get_audit_log().result(timeout=30)
    urls = ra.get_external_weights_urls(external).result(timeout=30).urls  # signed URLs: no key needed
    cfg = httpx.get(urls["adapter_config.json"], verify=shared.ssl, timeout=30).json()
    assert cfg["r"] == 2 and cfg["peft_type"] == "LORA"
    ra.delete_checkpoint_from_tinker_path(external).result(timeout=30)
    later = {(e.event, e.event_details["user"]) for e in ra.get_audit_log().result(timeout=30).entries}
    assert {("checkpoint_delete", "alice"), ("checkpoint_download", "alice")} <= later
    for c in (alice, bob):
        c.close("success").result(timeout=30)


def test_credentials_block_trusts_its_ca_bundle(shared, monkeypatch):
    from tinker_blocks.credentials import TinkerCredentials

    monkeypatch.delenv("SSL_CERT_FILE")  # only the block's ca_bundle makes the server's CA trusted
    creds = TinkerCredentials(base_url=shared.base_url, api_key=shared.keys["bob"], ca_bundle=str(shared.ca))
    assert "tml-" not in repr(creds) and "tml-" not in creds.model_dump_json()  # the key stays a secret
    caps = creds.get_client().get_server_capabilities()
    assert "tiny" in [m.model_name for m in caps.supported_models]
    bundle = Path(os.environ["SSL_CERT_FILE"])
    assert shared.ca.read_text() in bundle.read_text()
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        TinkerCredentials(base_url=shared.base_url, api_key=shared.keys["bob"], ca_bundle=str(shared.log)).get_client()


def test_unknown_and_revoked_keys_get_401_and_no_key_is_written(shared):
    assert shared.http("GET", "/training_runs", None, key="tml-not-a-key-of-this-server").status_code == 401
    assert shared.http("GET", "/training_runs", None, key="").status_code == 401
    carol = _keys(shared.root, "add", "carol").stdout.strip()
    assert shared.http("GET", "/training_runs", None, key=carol).status_code == 200
    jwt = shared.http("POST", "/auth/token", None, key=carol).json()["jwt"]
    assert shared.http("GET", "/training_runs", None, key=jwt).status_code == 200
    _keys(shared.root, "revoke", "carol")
    assert shared.http("GET", "/training_runs", None, key=carol).status_code == 401  # no restart needed
    assert shared.http("GET", "/training_runs", None, key=jwt).status_code == 401  # nor its JWT
    listed = _keys(shared.root, "list").stdout
    assert "alice" in listed and "bob" in listed and "carol" not in listed
    # no key in any file of the server: registry, audit log, key store, traces, checkpoints, its log
    secrets = [shared.keys["alice"], shared.keys["bob"], carol]
    files = [p for p in shared.root.rglob("*") if p.is_file()] + [shared.log]
    assert len(files) > 5
    for p in files:
        data = p.read_bytes()
        assert not any(k.encode() in data for k in secrets), p


def test_no_keys_no_public_bind(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tinker_local", "serve", "--host", "0.0.0.0", "--model", "tiny",
                          "--root", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no API keys" in lines[0] and "prefect-tinker local keys add NAME" in lines[0]


def test_cli_refuses_bad_keys_and_tls_options_in_one_line(tmp_path):
    for argv in (["keys", "--root", str(tmp_path), "revoke", "nobody"],
                 ["serve", "--root", str(tmp_path), "--tls-cert", str(tmp_path / "c.pem")],
                 ["serve", "--root", str(tmp_path), "--max-models-per-user", "0"]):
        out = subprocess.run([sys.executable, "-m", "tinker_local", *argv], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, (argv, out.stderr)
        assert out.stderr.startswith("error: ")


def test_key_store_keeps_hashes_only(tmp_path):
    from tinker_local.keys import KeyStore, KeyStoreError

    store = KeyStore(tmp_path)
    key = store.add("dana", admin=True)
    assert key.startswith("tml-") and store.lookup(key).name == "dana" and store.lookup(key).admin
    assert key not in store.path.read_text() and oct(store.path.stat().st_mode & 0o777) == "0o600"
    assert store.lookup(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    with pytest.raises(KeyStoreError, match="exists already"):
        store.add("dana")
    with pytest.raises(KeyStoreError, match="1-64 letters"):
        store.add("no spaces")
    other = KeyStore(tmp_path)  # another process's view picks up the change
    store.revoke("dana")
    assert other.lookup(key) is None and not other.any()


def test_compute_thread_serves_users_round_robin():
    """A flood of one user's requests queued ahead of another's: the other's run at every other
    turn, not after the flood (the order a trainer sees while someone floods the sampler)."""
    from tinker_local.futures import FutureStore
    from tinker_local.tenancy import CURRENT, Limits, Principal, Tenancy

    store = FutureStore()
    store.start(None)
    order: list[str] = []
    gate = threading.Event()

    def as_user(name: str, fn) -> str:
        token = CURRENT.set(Principal(name))
        try:
            return store.submit("job", fn)
        finally:
            CURRENT.reset(token)

    try:
        as_user("flood", gate.wait)  # holds the compute thread while the queue fills
        time.sleep(0.05)
        for i in range(6):
            as_user("flood", lambda i=i: order.append(f"flood{i}"))
        for i in range(3):
            as_user("trainer", lambda i=i: order.append(f"trainer{i}"))
        assert store.queued_by("flood") == 7 and store.queued_by("trainer") == 3
        token = CURRENT.set(Principal("flood"))
        try:
            with pytest.raises(Exception, match="max-queued-per-user 5"):
                Tenancy(None, store, Path("."), Limits(queued=5)).check_queue()
        finally:
            CURRENT.reset(token)
        gate.set()
        deadline = time.monotonic() + 10
        while len(order) < 9 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        store.stop()
    assert order == ["trainer0", "flood0", "trainer1", "flood1", "trainer2", "flood2", "flood3", "flood4", "flood5"]


def test_side_executor_serves_users_round_robin():
    """The sampler workers' queue (a side executor) also lets users take turns."""
    from tinker_local.futures import FutureStore
    from tinker_local.tenancy import CURRENT, Principal

    store = FutureStore()
    store.add_executor("sampler", 1)
    store.start(None)
    order: list[str] = []
    gate = threading.Event()

    def as_user(name: str, fn) -> str:
        token = CURRENT.set(Principal(name))
        try:
            return store.submit("job", fn, executor="sampler")
        finally:
            CURRENT.reset(token)

    try:
        as_user("a-flood", gate.wait)
        time.sleep(0.05)
        for i in range(3):
            as_user("a-flood", lambda i=i: order.append(f"a{i}"))
        for i in range(2):
            as_user("b", lambda i=i: order.append(f"b{i}"))
        gate.set()
        deadline = time.monotonic() + 10
        while len(order) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        store.stop()
    assert order == ["b0", "a0", "b1", "a1", "a2"]


def test_storage_limit_names_its_option_and_usage_is_per_user(tmp_path):
    from tests import inproc_server
    from tinker_local.tenancy import Limits

    server = inproc_server.start(tmp_path / "root", ["tiny"], limits=Limits(checkpoint_bytes=1))
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-loopback")
        tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=120)
        first = tc.save_weights_for_sampler("first").result(timeout=60).path  # 0 bytes stored so far
        with pytest.raises(tinker.PermissionDeniedError, match="max-checkpoint-bytes-per-user 1"):
            tc.save_weights_for_sampler("second").result(timeout=60)
        usage = tinker.RestClient(base_url=server.base_url, api_key="tml-loopback") \
            .get_current_checkpoint_storage_usage().result(timeout=30)
        size = server.app.state.service.registry.checkpoints[first].size_bytes
        assert [(d.user_name, d.checkpoint_count, d.size_bytes) for d in usage.data] == [("local", 1, size)]
        # the refused save consumed its seq_id: the model's next request is not held up
        tc.forward([_datum(tc.get_tokenizer(), "hello world")], "cross_entropy").result(timeout=30)
        sc.close("success").result(timeout=30)
    finally:
        server.stop()
