"""The HTTP API fuzzed from its own OpenAPI document (schemathesis) and the SDK's request models
(hypothesis): no 500, no hang, no crash of the compute thread; every refusal a 4xx whose detail is
one line.  A live server (uvicorn on a thread, two keys) takes the requests; a bounded number of
examples keeps this part under a minute (``benchmarks/fuzz_server.py`` runs the long version).
"""

from __future__ import annotations

import json
import os

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import inproc_server
from tinker_local.keys import KeyStore
from tinker_local.openapi import BODIES

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "3"))  # per operation / per request model
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    keys = KeyStore(root)
    alice, bob = keys.add("alice", admin=True), keys.add("bob")
    server = inproc_server.start(root, ["tiny"])
    try:
        yield {"server": server, "alice": alice, "bob": bob}
    finally:
        server.stop()


def check_response(r) -> None:
    """No server error; a refusal is a 4xx with a one-line string detail (``r``: an httpx or a
    schemathesis response)."""
    assert r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text[:500])
    ct = r.headers.get("content-type") or ""
    ct = ct[0] if isinstance(ct, list) else ct
    if 400 <= r.status_code < 500 and ct.startswith("application/json"):
        detail = r.json().get("detail")
        assert isinstance(detail, str) and "\n" not in detail, (r.request.url, r.text[:500])


def server_still_trains(live) -> None:
    """The compute thread answers: a model is created and a forward pass gives a finite loss."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=live["server"].base_url, api_key=live["bob"])
    tc = sc.create_lora_training_client("tiny", rank=4, seed=0)
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
                    loss_fn_inputs={"target_tokens": np.array([2, 3, 4, 5], np.int64)})
    loss = tc.forward([d], "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert np.isfinite(loss) and loss > 0
    sc.close("success").result(timeout=60)


def test_every_operation_of_the_openapi_document(live):
    schema = schemathesis.openapi.from_dict(live["server"].app.openapi())
    schema.config.update(base_url=live["server"].base_url)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 40
    for op in operations:

        @FUZZ
        @given(case=op.as_strategy())
        def run(case):
            check_response(case.call(headers={"X-API-Key": live["alice"]}, timeout=60))

        run()


def _model_strategy(name: str):
    """Instances of the SDK request model ``name`` (``tinker.types``), dumped to JSON."""
    import tinker.types as types

    tokens = st.lists(st.integers(-3, 5000), max_size=6)
    chunk = st.builds(types.EncodedTextChunk, tokens=tokens)
    overrides = {
        "SampleRequest": {
            "sampling_params": st.builds(types.SamplingParams, stop=st.none() | st.lists(st.integers(0, 3000),
                                                                                         max_size=3)),
            "prompt": st.builds(types.ModelInput, chunks=st.lists(chunk, max_size=2)),
        },
        "CreateCustomLossRequest": {"graph": st.builds(types.CustomLossGraph, nodes=st.lists(
            st.fixed_dictionaries({"op": st.sampled_from(["placeholder", "call_function", "call_method", "output"]),
                                   "name": st.text(max_size=6), "target": st.text(max_size=12),
                                   "args": st.lists(st.integers() | st.text(max_size=4), max_size=3)}),
            max_size=5))},
        # dict[str, Any] metadata: hypothesis cannot draw an instance of Any, so JSON values stand in
        "CreateSessionRequest": {"user_metadata": st.none() | st.dictionaries(st.text(max_size=8), JSON_VALUES,
                                                                               max_size=3)},
    }
    return st.builds(getattr(types, name), **overrides.get(name, {})).map(lambda m: m.model_dump(mode="json"))


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)


@pytest.mark.parametrize("path", sorted(p for p in BODIES if p != "/telemetry"))
def test_request_models_and_their_mutations(live, path):
    valid = _model_strategy(BODIES[path])
    mutated = valid.flatmap(lambda body: st.dictionaries(st.sampled_from(sorted(body) or ["x"]), JSON_VALUES,
                                                          min_size=1, max_size=3).map(lambda m: {**body, **m}))

    @FUZZ
    @given(body=valid | mutated)
    def run(body):
        r = httpx.post(f"{live['server'].base_url}/api/v1{path}", content=json.dumps(body),
                       headers={"X-API-Key": live["alice"], "Content-Type": "application/json"}, timeout=60)
        check_response(r)

    run()


def test_forward_backward_protobufs_never_fail_as_server_errors(live):
    import tinker
    from tinker.proto import tinker_public_pb2 as pb

    sc = tinker.ServiceClient(base_url=live["server"].base_url, api_key=live["alice"])
    tc = sc.create_lora_training_client("tiny", rank=4, seed=1)
    model_id = tc.model_id
    url, headers = live["server"].base_url, {"X-API-Key": live["alice"]}
    seq = iter(range(10_000, 10**6))

    arrays = st.lists(st.integers(-5, 3000), min_size=0, max_size=12)

    @FUZZ
    @given(tokens=arrays, targets=arrays, loss=st.sampled_from(["cross_entropy", "importance_sampling", "ppo",
                                                                "cispo", "custom", "no_such_loss"]),
           dtype=st.sampled_from([pb.DTYPE_INT64, pb.DTYPE_FLOAT32]), extra=st.booleans())
    def run(tokens, targets, loss, dtype, extra):
        msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=next(seq), loss_fn=loss)
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dtype = dtype
        t.shape.extend([len(targets)])
        t.dense = np.asarray(targets, np.int64 if dtype == pb.DTYPE_INT64 else np.float32).tobytes()
        if extra:
            w = d.loss_fn_inputs["logprobs"]
            w.dtype, w.dense = pb.DTYPE_FLOAT32, np.zeros(3, np.float32).tobytes()
            w.shape.extend([3])
        r = httpx.post(f"{url}/api/v1/forward_backward", content=msg.SerializeToString(),
                       headers={**headers, "Content-Type": "application/x-protobuf"}, timeout=60)
        check_response(r)
        if r.status_code == 200:
            rid = r.json()["request_id"]
            while (f := httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": rid}, headers=headers,
                                   timeout=60)).status_code == 408:
                pass
            out = f.json() if f.headers.get("content-type", "").startswith("application/json") else {}
            assert out.get("category") != "server", out

    run()
    sc.close("success").result(timeout=60)


def test_the_server_still_trains_after_the_fuzzing(live):
    server_still_trains(live)
