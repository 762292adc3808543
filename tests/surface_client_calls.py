"""Calls of the SDK surface walk (tests/test_local_surface.py): the shared clients (:class:`Ctx`)
and one handler per public method of ``ServiceClient``, ``TrainingClient`` and ``SamplingClient``;
each calls its method with valid arguments against the local server and checks the answer."""

from __future__ import annotations

import os
import warnings

from pathlib import Path

import numpy as np
import pytest

import tinker
from tinker import types


KEY = "tml-surface-tests"
TEN_YEARS = 10 * 365 * 86400


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
    for a, b in zip(c.logprobs(tc), c.logprobs(src_tc), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def sc_copy_weights(c: Ctx):
    copy_weights_checks(c, c.sc.copy_weights(c.state).result(timeout=60), "proj-surface")


def sc_create_custom_loss(c: Ctx):
    def surface_loss(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/surface:sum": loss}

    handle = c.sc.create_custom_loss(surface_loss, {"logprobs": 1, "weights": 1}).result(timeout=60)
    assert handle.loss_id and handle.loss_id in c.server.service.losses.compiled
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
    assert c.tc.model_id in [
        r.training_run_id for r in rc.list_training_runs(limit=100).result(timeout=30).training_runs
    ]


def sc_create_sampling_client(c: Ctx):
    _sample_tokens(c.sc.create_sampling_client(base_model=c.model).result(timeout=60), c)


def _from_state(c: Ctx, method: str):
    tc = getattr(c.sc, method)(c.state).result(timeout=60)
    base = c.sc.create_training_client_from_state(c.state).result(timeout=60)
    for a, b in zip(c.logprobs(tc), c.logprobs(base), strict=True):
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
    for a, b in zip(c.logprobs(tc), c.logprobs(ref), strict=True):
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
    try:
        assert _sample_tokens(s, c) == _sample_tokens(c.sampler, c)
    finally:
        s.holder.close()  # the handle's own connection holder heartbeats the session; tinker 0.38 has no s.close()


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


def sc_get_telemetry(c: Ctx):
    get_telemetry(c.sc)


def tc_get_telemetry(c: Ctx):
    get_telemetry(c.tc)


def s_get_telemetry(c: Ctx):
    get_telemetry(c.sampler)
