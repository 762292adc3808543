"""The whole public SDK surface against ``tinker_local``: every public synchronous method of
``tinker.ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient`` (found by
``inspect.getmembers``, so a method added by a new SDK version fails here until it has a handler)
is called with valid arguments against a live in-process server and its answer checked.  Only
hosted-account features (billing events) may be refused, with a 4xx naming them;
``whoami`` needs the server's JWT auth, which tinker_local does not issue (the SDK says so).

Also here: checkpoint expiry (TTL) enforced on a moved server clock, and the tokenizer of a
sampler over a model directory whose path the SDK's name heuristics used to mangle.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import urllib.error
import urllib.request
import uuid

from pathlib import Path

import pytest

import tinker
from tinker import types
from tests import inproc_server
from tests.local_server import make_hf_model_dir

from tests import surface_client_calls as client_calls
from tests import surface_rest_calls as rest_calls
from tests.surface_client_calls import KEY, Ctx, _sample_tokens

# the walk calls the SDK's deprecated and experimental methods on purpose (both FutureWarnings)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
           "SamplingClient": tinker.SamplingClient, "RestClient": tinker.RestClient}


def public_sync_methods(cls) -> list[str]:
    """Public synchronous methods (the ``_async`` twins and coroutine functions excluded)."""
    return sorted(name for name, member in inspect.getmembers(cls)
                  if not name.startswith("_") and callable(member) and not name.endswith("_async")
                  and not inspect.iscoroutinefunction(member) and not isinstance(member, type))


SURFACE = [(c, m) for c, cls in CLASSES.items() for m in public_sync_methods(cls)]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("surface-model") / "model")
    server = inproc_server.start(tmp_path_factory.mktemp("surface-root"), [str(model_dir)])
    c = Ctx(server, model_dir)
    yield c
    with contextlib.suppress(Exception):
        c.sc.close("success").result(timeout=30)
    server.stop()


# the handler of Class.method is <prefix><method> in the module of its class
HANDLER_MODULES = {"ServiceClient": (client_calls, "sc_"), "TrainingClient": (client_calls, "tc_"),
                   "SamplingClient": (client_calls, "s_"), "RestClient": (rest_calls, "rc_")}


def handler_of(cls_name: str, method: str):
    module, prefix = HANDLER_MODULES[cls_name]
    return getattr(module, prefix + method, None)


def test_the_surface_is_found_by_introspection():
    # the walk below is only as good as its method list: the 0.38 surface has 60 methods
    assert len(SURFACE) >= 60 and ("RestClient", "get_external_weights_urls") in SURFACE


@pytest.mark.parametrize("cls_name,method", SURFACE, ids=[f"{c}.{m}" for c, m in SURFACE])
def test_every_public_method_works_or_names_the_account_feature(ctx, cls_name, method):
    handler = handler_of(cls_name, method)
    assert handler is not None, (f"{cls_name}.{method} (new in this SDK version?) has no handler: make "
                                 "it work against tinker_local and add a check here")
    handler(ctx)


# ------------------------------------------------------------------------------------------------
# expiry, and tokenizers of samplers over awkward model directory paths


def test_an_expired_checkpoint_is_deleted_and_refused(ctx):
    path = ctx.tc.save_weights_for_sampler("expiring", ttl_seconds=3600).result(timeout=60).path
    folder = Path(ctx.server.service.registry.checkpoints[path].path)
    assert ctx.checkpoint(path).expires_at is not None and folder.is_dir()
    _sample_tokens(ctx.sc.create_sampling_client(model_path=path).result(timeout=60), ctx)
    service, clock = ctx.server.service, ctx.server.service.clock
    service.clock = lambda: clock() + 3601
    try:
        assert ctx.checkpoint(path) is None and not folder.exists()
        with pytest.raises(tinker.NotFoundError, match="expired"):
            ctx.sc.create_sampling_client(model_path=path).result(timeout=60)
        assert ctx.checkpoint(ctx.state) is not None  # no TTL: kept
    finally:
        service.clock = clock


def test_sampler_tokenizer_of_a_model_directory_with_two_slashes(ctx, tmp_path):
    from tinker_local.models import loadable_name

    top = Path(f"/tmp/tl-model-{uuid.uuid4().hex[:8]}")  # "/tmp/x": the SDK read it as org/model/variant
    shutil.copytree(ctx.model, top)
    try:
        name = loadable_name(str(top), tmp_path)
        assert name.count("/") != 2 and Path(name).resolve() == top.resolve()
        tc = ctx.sc.create_lora_training_client(str(top), rank=2, seed=4).result(timeout=120)
        s = tc.save_weights_and_get_sampling_client().result(timeout=60)
        assert s.get_tokenizer().encode("hello world") == ctx.tok.encode("hello world")
        again = ctx.sc.create_sampling_client(base_model=s.get_base_model()).result(timeout=60)
        assert again.get_tokenizer().encode("12 + 34") == ctx.tok.encode("12 + 34")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_jwt_auth_mode_serves_whoami_and_refuses_bad_tokens(ctx, tmp_path):
    import httpx

    server = inproc_server.start(tmp_path / "jwt-root", [ctx.model], jwt_auth=True)
    try:
        sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        tc = sc.create_lora_training_client(ctx.model, rank=2, seed=0).result(timeout=120)
        tc.forward_backward(ctx.data, "cross_entropy").result(timeout=60)
        rc = tinker.RestClient(base_url=server.base_url, api_key=KEY)
        me = rc.whoami().result(timeout=30)
        assert (me.user_urn, me.org_urn, me.email) == ("tml:user:local", "tml:organization:local", None)
        token = sc.holder._default_auth._token
        assert token.startswith("eyJ")  # the SDK really sends JWTs to this server
        url = f"{server.base_url}/api/v1/training_runs"
        assert httpx.get(url, headers={"X-API-Key": token}).status_code == 200
        assert httpx.get(url, headers={"X-API-Key": KEY}).status_code == 200  # keys stay valid
        forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
        r = httpx.get(url, headers={"X-API-Key": forged})
        assert r.status_code == 401 and 'error="invalid_token"' in r.headers["www-authenticate"]
        server.shift_clock(2 * 3600)  # the client's JWT has expired on the server's clock
        assert httpx.get(url, headers={"X-API-Key": token}).status_code == 401
        # the SDK answers invalid_token by fetching a fresh JWT and replaying the request
        assert tc.model_id in [r.training_run_id for r in rc.list_training_runs().result(timeout=30).training_runs]
        sc.close("success").result(timeout=30)
    finally:
        server.stop()


def test_session_trace_lists_each_request_in_order_with_its_times(ctx):
    sc = tinker.ServiceClient(base_url=ctx.server.base_url, api_key=KEY)
    tc = sc.create_lora_training_client(ctx.model, rank=2, seed=0).result(timeout=120)
    for _ in range(3):
        tc.forward_backward(ctx.data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    s = tc.save_weights_and_get_sampling_client().result(timeout=60)
    _sample_tokens(s, ctx)
    _sample_tokens(s, ctx, seed=6)
    sid = sc.holder.get_session_id()
    url = ctx.rc.export_session_trace(sid).result(timeout=60)
    with urllib.request.urlopen(url, timeout=30) as r:
        trace = json.loads(r.read())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    done = [e for e in events if e["ph"] == "X"]
    train = [e for e in done if tracks[e["tid"]] == tc.model_id]
    assert [e["name"] for e in train] == ["create_model"] + ["forward_backward", "optim_step"] * 3 \
        + ["save_weights_for_sampler"]
    assert [e["args"].get("seq_id") for e in train[1:]] == list(range(1, 8))
    for a, b in zip(train, train[1:], strict=False):  # one compute thread: each starts after the previous ended
        assert b["ts"] >= a["ts"] + a["dur"]
    assert all(e["args"]["status"] == "ok" and e["args"]["run_ms"] >= 0 and e["args"]["queue_ms"] >= 0
               for e in done)
    assert train[1]["args"]["loss_fn"] == "cross_entropy" and train[1]["args"]["datums"] == 2
    samples = [e for e in done if e["name"] == "sample"]
    assert len(samples) == 2 and all(tracks[e["tid"]] == s._sampling_session_id for e in samples)
    begins = {e["id"] for e in events if e["ph"] == "b"}
    assert begins == {e["id"] for e in events if e["ph"] == "e"} and len(begins) == len(done)
    assert {"create_session"} <= {e["name"] for e in events if e["ph"] == "i"}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url.split("?")[0], timeout=30)
    assert e.value.code == 403
    sc.close("success").result(timeout=30)
