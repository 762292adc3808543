"""The whole public SDK surface against ``tinker_local``: every public synchronous method of
``tinker.ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient`` (found by
``inspect.getmembers``, so a method added by a new SDK version fails here until it has a handler)
is called with valid arguments against a live in-process server and its answer checked.  Only
hosted-account features (billing events, audit log) may be refused, with a 4xx naming them;
``whoami`` needs the server's JWT auth, which tinker_local does not issue (the SDK says so).

Also here: checkpoint expiry (TTL) enforced on a moved server clock, and the tokenizer of a
sampler over a model directory whose path the SDK's name heuristics used to mangle.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
import warnings

from pathlib import Path

import numpy as np
import pytest

import tinker
from tinker import types
from tests import inproc_server
from tests.local_server import make_hf_model_dir

# the walk calls the SDK's deprecated and experimental methods on purpose (both FutureWarnings)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

KEY = "tml-surface-tests"
CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
           "SamplingClient": tinker.SamplingClient, "RestClient": tinker.RestClient}
TEN_YEARS = 10 * 365 * 86400


def public_sync_methods(cls) -> list[str]:
    """Public synchronous methods (the ``_async`` twins and coroutine functions excluded)."""
    return sorted(name for name, member in inspect.getmembers(cls)
                  if not name.startswith("_") and callable(member) and not name.endswith("_async")
                  and not inspect.iscoroutinefunction(member) and not isinstance(member, type))


SURFACE = [(c, m) for c, cls in CLASSES.items() for m in public_sync_methods(cls)]


def _datum(tok, text: str) -> types.Datum:
    ids = tok.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                       "weights": np.ones(len(ids) - 1, np.float32)})


class Ctx:
    """Shared clients over one in-process server (a small Llama directory, fp32)."""

    def __init__(self, server, model_dir: Path):
        self.server, self.model = server, str(model_dir)
        self.sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY, project_id="proj-surface",
                                       user_metadata={"suite": "surface"}, display_name="surface walk")
        self.rc = tinker.RestClient(base_url=server.base_url, api_key=KEY)
        self.tc = self.sc.create_lora_training_client(self.model, rank=4, seed=3).result(timeout=120)
        self.tok = self.tc.get_tokenizer()
        self.data = [_datum(self.tok, "hello world, hello tinker"), _datum(self.tok, "12 + 34 = 46")]
        self.tc.forward_backward(self.data, "cross_entropy")
        self.tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        self.state = self.tc.save_state("base").result(timeout=60).path
        self.sampler_path = self.tc.save_weights_for_sampler("base-w").result(timeout=60).path
        self.sampler = self.sc.create_sampling_client(model_path=self.sampler_path).result(timeout=60)
        self.session_id = self.sc.holder.get_session_id()

    def logprobs(self, tc) -> list[np.ndarray]:
        out = tc.forward(self.data, "cross_entropy").result(timeout=60)
        return [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]

    def checkpoint(self, path: str) -> types.Checkpoint | None:
        run = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
        return next((c for c in self.rc.list_checkpoints(run).result(timeout=30).checkpoints
                     if c.tinker_path == path), None)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("surface-model") / "model")
    server = inproc_server.start(tmp_path_factory.mktemp("surface-root"), [str(model_dir)])
    c = Ctx(server, model_dir)
    yield c
    with contextlib.suppress(Exception):
        c.sc.close("success").result(timeout=30)
    server.stop()


# ------------------------------------------------------------------------------------------------
# handlers: one per public method; each calls it with valid arguments and checks the answer


def _sample_tokens(sampling_client, c: Ctx, seed: int = 5) -> list[int]:
    prompt = types.ModelInput.from_ints(c.tok.encode("hello"))
    res = sampling_client.sample(prompt, 1, types.SamplingParams(max_tokens=4, seed=seed, stop=[])).result(timeout=60)
    assert len(res.sequences) == 1 and len(res.sequences[0].tokens) == 4
    return res.sequences[0].tokens


def sc_close(c: Ctx):
    sc = tinker.ServiceClient(base_url=c.server.base_url, api_key=KEY)
    sc.create_sampling_client(base_model=c.model).result(timeout=60)
    sid = sc.holder.get_session_id()
    sc.close("success").result(timeout=30)
    assert c.server.service.registry.sessions[sid]["finished"] == "success"


def copy_weights_checks(c: Ctx, copy: str, project: str):
    assert copy != c.state and copy.endswith("/weights/base")
    run = types.ParsedCheckpointTinkerPath.from_tinker_path(copy).training_run_id
    assert run in [r.training_run_id for r in
                   c.rc.list_training_runs(limit=100, project_id=project).result(timeout=30).training_runs]
    src = c.server.service.registry.checkpoints[c.state].path
    dst = c.server.service.registry.checkpoints[copy].path
    f = "adapter_model.safetensors"
    assert os.stat(Path(src) / f).st_ino == os.stat(Path(dst) / f).st_ino  # shared storage
    # the copy loads like its source
    tc = c.sc.create_training_client_from_state(copy).result(timeout=60)
    src_tc = c.sc.create_training_client_from_state(c.state).result(timeout=60)
    for a, b in zip(c.logprobs(tc), c.logprobs(src_tc)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def sc_copy_weights(c: Ctx):
    copy_weights_checks(c, c.sc.copy_weights(c.state).result(timeout=60), "proj-surface")


def sc_create_custom_loss(c: Ctx):
    def surface_loss(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/surface:sum": loss}

    handle = c.sc.create_custom_loss(surface_loss, {"logprobs": 1, "weights": 1}).result(timeout=60)
    assert handle.loss_id and handle.loss_id in c.server.service._losses
    res = c.tc.forward_backward_custom(c.data, handle).result(timeout=60)
    ce = c.tc.forward(c.data, "cross_entropy").result(timeout=60)
    assert res.metrics["custom/surface:sum"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-5)
    c.tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)  # drop the gradient


def sc_create_lora_training_client(c: Ctx):
    tc = c.sc.create_lora_training_client(c.model, rank=2, seed=1, train_unembed=False).result(timeout=120)
    info = tc.get_info()
    assert info.lora_rank == 2 and info.model_id.startswith(c.session_id)


def sc_create_rest_client(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rc = c.sc.create_rest_client()
    assert c.tc.model_id in [r.training_run_id for r in rc.list_training_runs(limit=100).result(timeout=30).training_runs]


def sc_create_sampling_client(c: Ctx):
    _sample_tokens(c.sc.create_sampling_client(base_model=c.model).result(timeout=60), c)


def _from_state(c: Ctx, method: str):
    tc = getattr(c.sc, method)(c.state).result(timeout=60)
    base = c.sc.create_training_client_from_state(c.state).result(timeout=60)
    for a, b in zip(c.logprobs(tc), c.logprobs(base)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    return tc


def sc_create_training_client_from_state(c: Ctx):
    _from_state(c, "create_training_client_from_state")


def sc_create_training_client_from_state_with_optimizer(c: Ctx):
    tc = _from_state(c, "create_training_client_from_state_with_optimizer")
    step = tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60).metrics["step:max"]
    assert step == 2.0  # one step saved with the state, plus this one


def sc_get_console_url(c: Ctx):
    assert c.session_id in c.sc.get_console_url()


def sc_get_server_capabilities(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        caps = c.sc.get_server_capabilities()
    assert c.model in [m.model_name for m in caps.supported_models]


def get_telemetry(obj):
    tel = obj.get_telemetry()
    assert tel is None or hasattr(tel, "log")  # TINKER_TELEMETRY=0 in the tests: None


def tc_create_sampling_client(c: Ctx):
    assert _sample_tokens(c.tc.create_sampling_client(c.sampler_path).result(timeout=60), c) == \
        _sample_tokens(c.sampler, c)


def tc_forward(c: Ctx):
    out = c.tc.forward(c.data, "cross_entropy").result(timeout=60)
    lps = [np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs]
    assert [len(x) for x in lps] == [len(d.model_input.to_ints()) for d in c.data]
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(x.sum()) for x in lps), rel=1e-5)


def tc_forward_backward(c: Ctx):
    out = c.tc.forward_backward(c.data, "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] > 0
    c.tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)


def tc_forward_backward_custom(c: Ctx):
    import torch

    def loss_fn(data, logprobs_list):
        loss = torch.stack([-lp.sum() for lp in logprobs_list]).sum()
        return loss, {"n:sum": float(len(logprobs_list))}

    out = c.tc.forward_backward_custom(c.data, loss_fn).result(timeout=60)
    assert out.metrics["n:sum"] == 2.0 and out.metrics["loss:sum"] > 0
    c.tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)


def tc_get_console_url(c: Ctx):
    assert isinstance(c.tc.get_console_url(), str)


def tc_get_info(c: Ctx):
    info = c.tc.get_info()
    assert info.model_id == c.tc.model_id and info.lora_rank == 4 and info.model_data.model_name == c.model


def tc_get_tokenizer(c: Ctx):
    tok = c.tc.get_tokenizer()
    assert tok.decode(tok.encode("hello world")) == "hello world"


def _load_state(c: Ctx, method: str):
    tc = c.sc.create_lora_training_client(c.model, rank=4, seed=99).result(timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(tc, method)(c.state).result(timeout=60)
    ref = c.sc.create_training_client_from_state(c.state).result(timeout=60)
    for a, b in zip(c.logprobs(tc), c.logprobs(ref)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def tc_load_state(c: Ctx):
    _load_state(c, "load_state")


def tc_load_state_with_optimizer(c: Ctx):
    _load_state(c, "load_state_with_optimizer")


def tc_optim_step(c: Ctx):
    before = c.logprobs(c.tc)
    c.tc.forward_backward(c.data, "cross_entropy")
    m = c.tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60).metrics
    assert m["grad_norm:mean"] > 0 and m["learning_rate:mean"] == pytest.approx(1e-3)
    after = c.logprobs(c.tc)
    assert sum(float(a.sum()) for a in after) > sum(float(b.sum()) for b in before)  # loss fell


def tc_save_state(c: Ctx):
    path = c.tc.save_state("with-ttl", ttl_seconds=TEN_YEARS, user_metadata={"k": "v"}).result(timeout=60).path
    ck = c.checkpoint(path)
    assert ck.checkpoint_type == "training" and ck.user_metadata == {"k": "v"} and ck.expires_at is not None


def tc_save_weights_and_get_sampling_client(c: Ctx):
    s = c.tc.save_weights_and_get_sampling_client().result(timeout=60)
    assert s.get_tokenizer().encode("hello world") == c.tok.encode("hello world")
    _sample_tokens(s, c)


def tc_save_weights_external(c: Ctx):
    path = c.tc.save_weights_external("surface-ext").result(timeout=60).path
    assert path == f"tinker://{c.tc.model_id}/external_weights/surface-ext"
    assert c.checkpoint(path).checkpoint_type == "external"


def tc_save_weights_for_sampler(c: Ctx):
    path = c.tc.save_weights_for_sampler("surface-w").result(timeout=60).path
    assert c.checkpoint(path).checkpoint_type == "sampler"
    _sample_tokens(c.sc.create_sampling_client(model_path=path).result(timeout=60), c)


def s_compute_logprobs(c: Ctx):
    ids = c.tok.encode("hello world, hello tinker")
    lps = c.sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result(timeout=60)
    ref = c.sc.create_training_client_from_state(c.state).result(timeout=60)
    d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})
    fwd = np.asarray(ref.forward([d], "cross_entropy").result(timeout=60).loss_fn_outputs[0]["logprobs"].data)
    assert lps[0] is None
    np.testing.assert_allclose(np.asarray(lps[1:], np.float32), fwd, atol=1e-4)


def s_create(c: Ctx):
    s = tinker.SamplingClient.create(c.sc.holder, model_path=c.sampler_path).result(timeout=60)
    assert _sample_tokens(s, c) == _sample_tokens(c.sampler, c)


def s_from_sampler_handle(c: Ctx):
    s = tinker.SamplingClient.from_sampler_handle(c.sampler.get_sampler_handle(), api_key=KEY)
    assert _sample_tokens(s, c) == _sample_tokens(c.sampler, c)


def s_get_base_model(c: Ctx):
    assert c.sampler.get_base_model() == c.model


def s_get_sampler_handle(c: Ctx):
    handle = c.sampler.get_sampler_handle()
    assert isinstance(handle, str) and KEY not in handle  # the handle carries no credentials


def s_get_tokenizer(c: Ctx):
    assert c.sampler.get_tokenizer().encode("12 + 34") == c.tok.encode("12 + 34")


def s_on_queue_state_change(c: Ctx):
    from tinker.lib.api_future_impl import QueueState

    c.sampler.on_queue_state_change(QueueState.ACTIVE, None)  # client-side logging only
    c.sampler.on_queue_state_change(QueueState.PAUSED_CAPACITY, "test")


def s_sample(c: Ctx):
    a, b = _sample_tokens(c.sampler, c, seed=11), _sample_tokens(c.sampler, c, seed=11)
    assert a == b


def rc_assign_session_project(c: Ctx):
    sc = tinker.ServiceClient(base_url=c.server.base_url, api_key=KEY)
    sc.create_sampling_client(base_model=c.model).result(timeout=60)
    sid = sc.holder.get_session_id()
    c.rc.assign_session_project(sid, "proj-moved").result(timeout=30)
    found = c.rc.search_sessions(types.SessionSearchRequest(project_ids=["proj-moved"])).result(timeout=30)
    assert [s.session_id for s in found.sessions] == [sid]
    sc.close("success").result(timeout=30)


def rc_copy_weights(c: Ctx):
    copy_weights_checks(c, c.rc.copy_weights(c.state, "proj-archive").result(timeout=60), "proj-archive")


def _throwaway_checkpoint(c: Ctx, name: str) -> str:
    return c.tc.save_weights_for_sampler(name).result(timeout=60).path


def rc_delete_checkpoint(c: Ctx):
    path = _throwaway_checkpoint(c, "to-delete")
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    folder = Path(c.server.service.registry.checkpoints[path].path)
    c.rc.delete_checkpoint(parsed.training_run_id, parsed.checkpoint_id).result(timeout=30)
    assert c.checkpoint(path) is None and not folder.exists()


def rc_delete_checkpoint_from_tinker_path(c: Ctx):
    path = _throwaway_checkpoint(c, "to-delete-2")
    c.rc.delete_checkpoint_from_tinker_path(path).result(timeout=30)
    assert c.checkpoint(path) is None
    with pytest.raises(tinker.NotFoundError):
        c.sc.create_sampling_client(model_path=path).result(timeout=60)


def rc_export_session_trace(c: Ctx):
    _sample_tokens(c.sampler, c)
    url = c.rc.export_session_trace(c.session_id).result(timeout=60)
    trace = json.loads(urllib.request.urlopen(url, timeout=30).read())
    reqs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in reqs}
    assert {"create_model", "forward_backward", "optim_step", "save_weights", "sample"} <= names
    assert all(e["dur"] >= 0 and e["ts"] > 1.6e15 and e["args"]["request_id"] for e in reqs)


def _refused(call, words: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(tinker.PermissionDeniedError) as e:
            call().result(timeout=30)
    assert words in str(e.value) and "hosted Tinker accounts" in str(e.value)


def rc_get_audit_log(c: Ctx):
    _refused(lambda: c.rc.get_audit_log(), "audit log")


def rc_get_billing_usage(c: Ctx):
    _refused(lambda: c.rc.get_billing_usage("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"), "billing")


def rc_get_current_checkpoint_storage_usage(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        usage = c.rc.get_current_checkpoint_storage_usage(project_id="proj-surface").result(timeout=30)
    reg = c.server.service.registry
    mine = [ck for ck in reg.checkpoints.values()
            if c.server.service.project_of(reg.runs[ck.model_id]) == "proj-surface"]
    assert len(usage.data) == 1 and usage.data[0].checkpoint_count == len(mine)
    assert usage.data[0].size_bytes == sum(ck.size_bytes for ck in mine) > 0


def rc_get_external_weights_urls(c: Ctx):
    path = c.tc.save_weights_external("surface-urls").result(timeout=60).path
    urls = c.rc.get_external_weights_urls(path).result(timeout=30)
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model/config.json"} <= set(urls.urls)
    cfg = json.loads(urllib.request.urlopen(urls.urls["adapter_config.json"], timeout=30).read())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"


def rc_get_sampler(c: Ctx):
    s = c.rc.get_sampler(c.sampler._sampling_session_id).result(timeout=30)
    assert s.base_model == c.model and s.model_path == c.sampler_path


def rc_get_server_capabilities(c: Ctx):
    caps = c.rc.get_server_capabilities().result(timeout=30)
    assert {m.model_name: m.max_context_length for m in caps.supported_models}[c.model] == 512


def rc_get_session(c: Ctx):
    s = c.rc.get_session(c.session_id).result(timeout=30)
    assert c.tc.model_id in s.training_run_ids and s.user_metadata == {"suite": "surface"}
    assert s.display_name == "surface walk" and c.sampler._sampling_session_id in s.sampler_ids


def rc_get_training_run(c: Ctx):
    run = c.rc.get_training_run(c.tc.model_id).result(timeout=30)
    assert (run.base_model, run.lora_rank, run.is_lora) == (c.model, 4, True)


def rc_get_training_run_by_tinker_path(c: Ctx):
    assert c.rc.get_training_run_by_tinker_path(c.state).result(timeout=30).training_run_id == c.tc.model_id


def rc_get_weights_info_by_tinker_path(c: Ctx):
    info = c.rc.get_weights_info_by_tinker_path(c.state).result(timeout=30)
    assert (info.base_model, info.lora_rank, info.is_lora) == (c.model, 4, True)


def rc_list_checkpoints(c: Ctx):
    cks = {ck.tinker_path: ck for ck in c.rc.list_checkpoints(c.tc.model_id).result(timeout=30).checkpoints}
    assert cks[c.state].checkpoint_type == "training" and cks[c.sampler_path].checkpoint_type == "sampler"


def rc_list_sessions(c: Ctx):
    assert c.session_id in c.rc.list_sessions(limit=100).result(timeout=30).sessions


def rc_list_training_runs(c: Ctx):
    runs = c.rc.list_training_runs(limit=100, project_id="proj-surface").result(timeout=30).training_runs
    assert c.tc.model_id in [r.training_run_id for r in runs]
    assert c.rc.list_training_runs(project_id="no-such-project").result(timeout=30).training_runs == []


def rc_list_user_checkpoints(c: Ctx):
    page = c.rc.list_user_checkpoints(limit=100).result(timeout=30)
    times = [ck.time for ck in page.checkpoints]
    assert c.state in [ck.tinker_path for ck in page.checkpoints] and times == sorted(times, reverse=True)


def rc_publish_checkpoint_from_tinker_path(c: Ctx):
    c.rc.publish_checkpoint_from_tinker_path(c.sampler_path).result(timeout=30)
    assert c.checkpoint(c.sampler_path).public is True


def rc_unpublish_checkpoint_from_tinker_path(c: Ctx):
    c.rc.publish_checkpoint_from_tinker_path(c.state).result(timeout=30)
    c.rc.unpublish_checkpoint_from_tinker_path(c.state).result(timeout=30)
    assert c.checkpoint(c.state).public is False


def rc_search_sessions(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        page = c.rc.search_sessions(types.SessionSearchRequest(display_name="SURFACE walk")).result(timeout=30)
        assert [s.session_id for s in page.sessions] == [c.session_id]
        s = page.sessions[0]
        assert s.project_id == "proj-surface" and s.status.type == "active" and s.checkpoints_count >= 2
        by_meta = c.rc.search_sessions(types.SessionSearchRequest(user_metadata={"suite": "nope"})).result(timeout=30)
        assert by_meta.sessions == []
        # paging: one session per page, newest first, until next_cursor is None
        seen, req = [], types.SessionSearchRequest(limit=1, owner=types.AccessibleSearchOwner())
        while True:
            page = c.rc.search_sessions(req).result(timeout=30)
            seen += [x.session_id for x in page.sessions]
            if page.next_cursor is None:
                break
            req = req.model_copy(update={"cursor": page.next_cursor})
    assert seen == c.rc.list_sessions(limit=1000).result(timeout=30).sessions


def rc_set_checkpoint_ttl_from_tinker_path(c: Ctx):
    path = _throwaway_checkpoint(c, "ttl")
    c.rc.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=30)
    assert c.checkpoint(path).expires_at is not None
    c.rc.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=30)
    assert c.checkpoint(path).expires_at is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        c.rc.set_checkpoint_ttl_from_tinker_path(path, 60).result(timeout=30)


def rc_whoami(c: Ctx):
    with pytest.raises(RuntimeError, match="JWT auth"):  # raised by the SDK: no JWT without JWT auth
        c.rc.whoami().result(timeout=30)


HANDLERS = {
    "ServiceClient": {
        "close": sc_close, "copy_weights": sc_copy_weights, "create_custom_loss": sc_create_custom_loss,
        "create_lora_training_client": sc_create_lora_training_client,
        "create_rest_client": sc_create_rest_client, "create_sampling_client": sc_create_sampling_client,
        "create_training_client_from_state": sc_create_training_client_from_state,
        "create_training_client_from_state_with_optimizer": sc_create_training_client_from_state_with_optimizer,
        "get_console_url": sc_get_console_url, "get_server_capabilities": sc_get_server_capabilities,
        "get_telemetry": lambda c: get_telemetry(c.sc),
    },
    "TrainingClient": {
        "create_sampling_client": tc_create_sampling_client, "forward": tc_forward,
        "forward_backward": tc_forward_backward, "forward_backward_custom": tc_forward_backward_custom,
        "get_console_url": tc_get_console_url, "get_info": tc_get_info,
        "get_telemetry": lambda c: get_telemetry(c.tc), "get_tokenizer": tc_get_tokenizer,
        "load_state": tc_load_state, "load_state_with_optimizer": tc_load_state_with_optimizer,
        "optim_step": tc_optim_step, "save_state": tc_save_state,
        "save_weights_and_get_sampling_client": tc_save_weights_and_get_sampling_client,
        "save_weights_external": tc_save_weights_external,
        "save_weights_for_sampler": tc_save_weights_for_sampler,
    },
    "SamplingClient": {
        "compute_logprobs": s_compute_logprobs, "create": s_create,
        "from_sampler_handle": s_from_sampler_handle, "get_base_model": s_get_base_model,
        "get_sampler_handle": s_get_sampler_handle, "get_telemetry": lambda c: get_telemetry(c.sampler),
        "get_tokenizer": s_get_tokenizer, "on_queue_state_change": s_on_queue_state_change,
        "sample": s_sample,
    },
    "RestClient": {
        "assign_session_project": rc_assign_session_project, "copy_weights": rc_copy_weights,
        "delete_checkpoint": rc_delete_checkpoint,
        "delete_checkpoint_from_tinker_path": rc_delete_checkpoint_from_tinker_path,
        "export_session_trace": rc_export_session_trace, "get_audit_log": rc_get_audit_log,
        "get_billing_usage": rc_get_billing_usage,
        "get_current_checkpoint_storage_usage": rc_get_current_checkpoint_storage_usage,
        "get_external_weights_urls": rc_get_external_weights_urls, "get_sampler": rc_get_sampler,
        "get_server_capabilities": rc_get_server_capabilities, "get_session": rc_get_session,
        "get_telemetry": lambda c: get_telemetry(c.rc), "get_training_run": rc_get_training_run,
        "get_training_run_by_tinker_path": rc_get_training_run_by_tinker_path,
        "get_weights_info_by_tinker_path": rc_get_weights_info_by_tinker_path,
        "list_checkpoints": rc_list_checkpoints, "list_sessions": rc_list_sessions,
        "list_training_runs": rc_list_training_runs, "list_user_checkpoints": rc_list_user_checkpoints,
        "publish_checkpoint_from_tinker_path": rc_publish_checkpoint_from_tinker_path,
        "search_sessions": rc_search_sessions,
        "set_checkpoint_ttl_from_tinker_path": rc_set_checkpoint_ttl_from_tinker_path,
        "unpublish_checkpoint_from_tinker_path": rc_unpublish_checkpoint_from_tinker_path,
        "whoami": rc_whoami,
    },
}


def test_the_surface_is_found_by_introspection():
    # the walk below is only as good as its method list: the 0.38 surface has 60 methods
    assert len(SURFACE) >= 60 and ("RestClient", "get_external_weights_urls") in SURFACE


@pytest.mark.parametrize("cls_name,method", SURFACE, ids=[f"{c}.{m}" for c, m in SURFACE])
def test_every_public_method_works_or_names_the_account_feature(ctx, cls_name, method):
    handler = HANDLERS[cls_name].get(method)
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
    for a, b in zip(train, train[1:]):  # one compute thread: each starts after the previous ended
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
