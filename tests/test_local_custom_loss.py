"""Server-side custom losses: ``ServiceClient.create_custom_loss`` uploads the traced loss when the
server's client config says ``custom_loss_server_side``, and ``forward_backward_custom`` then runs
it on the server in one request.  Gradients must equal those of the SDK's client-side path (the
same loss with the flag off: a forward, then a cross_entropy forward_backward with
weights = -dloss/dlogprobs) and of an independent torch computation; graphs with ops outside
tinker_local's allow-list are refused as user errors naming the op.

Gradients are read back exactly from one AdamW step with beta1 = beta2 = 0 and a large eps: the
update is ``delta = lr * g / (|g| + eps)``, so ``g = delta * eps / (lr - |delta|)``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tinker
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph
from tests import inproc_server
from tests.local_server import ReferenceLoRA, make_hf_model_dir
from tinker_local.custom_loss import compile_graph
from tinker_local.loss_limits import CustomLossError

KEY = "tml-custom-loss-tests"
LR = EPS = 1000.0  # delta = lr g / (|g| + eps) ~ g for |g| << eps, and exactly invertible
SGD_LIKE = types.AdamParams(learning_rate=LR, beta1=0.0, beta2=0.0, eps=EPS, weight_decay=0.0)
PAIRS = [("12 + 34 =", " 46", " 47"), ("hello", " world", " tinker"), ("7 * 8 =", " 56", " 54")]


def dpo_pair(logprobs, chosen_mask, rejected_mask, ref_logprobs, beta):
    """DPO's sigmoid loss for one (chosen, rejected) pair packed in one datum (Rafailov et al.
    2023, arXiv:2305.18290): -log sigmoid(beta * (policy margin - reference margin))."""
    delta = logprobs - ref_logprobs
    margin = (delta * chosen_mask).sum() - (delta * rejected_mask).sum()
    loss = -F.logsigmoid(beta * margin)
    return loss, {"custom/margin:mean": margin, "custom/loss:sum": loss}


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum() / weights.abs().sum().clamp(min=1.0)
    return loss, {"custom/weight:sum": weights.sum()}


DPO_RANKS = {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_logprobs": 1, "beta": 0}
WEIGHTED_RANKS = {"logprobs": 1, "weights": 1}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("closs-model") / "model")
    server = inproc_server.start(tmp_path_factory.mktemp("closs-root"), [str(model_dir)])
    on = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    on.holder  # noqa: B018  (fetches the client config now: custom losses run on the server)
    server.service.custom_loss_server_side = False
    off = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    off.holder  # noqa: B018  (this session's config says: run custom losses client-side)
    server.service.custom_loss_server_side = True
    tc = on.create_lora_training_client(str(model_dir), rank=4, seed=7).result(timeout=120)
    tok = tc.get_tokenizer()
    warm = [_plain_datum(tok, p + c) for p, c, _ in PAIRS]
    for _ in range(2):  # A and B both non-zero before the compared step
        tc.forward_backward(warm, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    state = tc.save_state("init").result(timeout=60).path
    yield {"server": server, "on": on, "off": off, "tc": tc, "tok": tok, "state": state,
           "model_dir": model_dir}
    for sc in (on, off):
        sc.close("success").result(timeout=30)
    server.stop()


def _plain_datum(tok, text: str) -> types.Datum:
    ids = tok.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})


def _dpo_data(env) -> list[types.Datum]:
    """One datum per pair: prompt + chosen + rejected, masks over the two responses' targets,
    reference logprobs of the base model (a fresh LoRA: B = 0), beta as a scalar input."""
    tok = env["tok"]
    ref = env["on"].create_lora_training_client(str(env["model_dir"]), rank=4, seed=1).result(timeout=120)
    data = []
    for prompt, chosen, rejected in PAIRS:
        p, c, r = tok.encode(prompt), tok.encode(chosen), tok.encode(rejected)
        ids = p + c + r
        n = len(ids) - 1
        cm, rm = np.zeros(n, np.float32), np.zeros(n, np.float32)
        cm[len(p) - 1: len(p) - 1 + len(c)] = 1.0
        rm[len(p) - 1 + len(c):] = 1.0
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64),
                                                "chosen_mask": cm, "rejected_mask": rm,
                                                "beta": np.asarray(0.5, np.float32)}))
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    out = ref.forward(plain, "cross_entropy").result(timeout=60)
    for d, o in zip(data, out.loss_fn_outputs, strict=True):
        d.loss_fn_inputs["ref_logprobs"] = types.TensorData.from_numpy(np.asarray(o["logprobs"].data, np.float32))
    return data


def _weighted_data(env) -> list[types.Datum]:
    rng = np.random.default_rng(3)
    data = []
    for text in ("the quick brown fox jumps over the lazy dog", "one two three four", "hello world"):
        d = _plain_datum(env["tok"], text)
        n = len(d.model_input.to_ints())
        d.loss_fn_inputs["weights"] = types.TensorData.from_numpy(rng.uniform(-0.5, 2.0, n).astype(np.float32))
        data.append(d)
    return data


def _adapter(server, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(server.service.registry.checkpoints[path].path) / "adapter_model.safetensors"))


def _step(env, sc, fn, ranks, data, tag: str):
    """One forward_backward_custom + SGD-like step from the initial state; returns (handle,
    forward_backward metrics, optim metrics, gradient per adapter tensor, forward requests)."""
    server = env["server"]
    handle = sc.create_custom_loss(fn, ranks).result(timeout=60)
    tc = sc.create_training_client_from_state(env["state"]).result(timeout=60)
    counts = server.service.request_counts
    before = counts.get("/api/v1/forward", 0) + counts.get("/api/v1/forward_backward", 0)
    fb = tc.forward_backward_custom(data, handle)
    opt = tc.optim_step(SGD_LIKE)
    fb_metrics, opt_metrics = fb.result(timeout=120).metrics, opt.result(timeout=60).metrics
    requests = counts.get("/api/v1/forward", 0) + counts.get("/api/v1/forward_backward", 0) - before
    after = _adapter(server, tc.save_weights_for_sampler(f"after-{tag}").result(timeout=60).path)
    init = _adapter(server, env["state"])
    grads = {}
    for k, w in after.items():
        delta = (init[k].double() - w.double())
        grads[k] = delta * EPS / (LR - delta.abs())
    return handle, fb_metrics, opt_metrics, grads, requests


def _reference_grads(env, fn, data) -> dict[str, torch.Tensor]:
    """The same loss on logprobs of an independent fp32 model + LoRA hooks (tests/local_server.py)."""
    ref = ReferenceLoRA(env["model_dir"], Path(env["server"].service.registry.checkpoints[env["state"]].path))
    names = list(fn.__code__.co_varnames[1: fn.__code__.co_argcount])
    total = 0
    for d in data:
        lp = ref.logprobs(d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].to_numpy())
        loss, _ = fn(lp, *[d.loss_fn_inputs[n].to_torch() for n in names])
        total = total + loss
    total.backward()
    return {k: g.double() for k, g in ref.grads().items()}


@pytest.mark.parametrize("case", ["dpo_pair", "weighted_nll"])
def test_server_side_gradients_equal_the_client_side_path(env, case):
    fn, ranks, data = ((dpo_pair, DPO_RANKS, _dpo_data(env)) if case == "dpo_pair"
                       else (weighted_nll, WEIGHTED_RANKS, _weighted_data(env)))
    h_on, m_on, o_on, g_on, n_on = _step(env, env["on"], fn, ranks, copy.deepcopy(data), f"on-{case}")
    h_off, m_off, o_off, g_off, n_off = _step(env, env["off"], fn, ranks, copy.deepcopy(data), f"off-{case}")
    assert h_on.loss_id is not None and h_off.loss_id is None
    assert (n_on, n_off) == (1, 2)  # one forward_backward on the server; forward + backward client-side
    for key in m_off:
        if key.startswith("custom/") or key == "loss:sum":
            assert m_on[key] == pytest.approx(m_off[key], rel=1e-5, abs=1e-6), key
    assert o_on["grad_norm:mean"] == pytest.approx(o_off["grad_norm:mean"], rel=1e-5)
    assert o_on["grad_norm:mean"] > 1e-3
    if case == "dpo_pair":  # policy (warmed up) and reference (base) differ
        assert abs(m_on["custom/margin:mean"]) > 1e-3
    ref = _reference_grads(env, fn, data)
    scale = max(float(g.abs().max()) for g in ref.values())
    for k in g_on:
        np.testing.assert_allclose(g_on[k].numpy(), g_off[k].numpy(), atol=1e-5, err_msg=k)
        np.testing.assert_allclose(g_on[k].numpy(), ref[k].numpy(), atol=1e-5 + 1e-5 * scale, err_msg=k)


def test_rank2_logprobs_and_a_failing_loss_are_user_errors(env):
    def soft_targets(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {}

    handle = env["on"].create_custom_loss(soft_targets, {"logprobs": 2, "weights": 2}).result(timeout=60)
    tc = env["on"].create_training_client_from_state(env["state"]).result(timeout=60)
    ids = env["tok"].encode("hello world")
    n = len(ids) - 1
    tgt = np.stack([np.asarray(ids[1:]), np.asarray(ids[1:][::-1])], 1).astype(np.int64)
    w = np.full((n, 2), 0.5, np.float32)
    d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": tgt, "weights": w})
    got = tc.forward_backward_custom([d], handle).result(timeout=60)
    ce = tc.forward([d], "cross_entropy").result(timeout=60)
    assert got.metrics["loss:sum"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-5)  # CE uses the same weights
    assert got.loss_fn_outputs[0]["logprobs"].shape == [n, 2]
    tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)

    def mismatched(logprobs, weights):  # (n,) @ (n,) fine; (n,) @ (n, 1) is not a scalar loss
        loss = logprobs * weights
        return loss, {}

    bad = env["on"].create_custom_loss(mismatched, {"logprobs": 1, "weights": 1}).result(timeout=60)
    d1 = _plain_datum(env["tok"], "hello world")
    d1.loss_fn_inputs["weights"] = types.TensorData.from_numpy(np.ones(len(d1.model_input.to_ints()), np.float32))
    with pytest.raises(tinker.RequestFailedError, match="scalar loss"):
        tc.forward_backward_custom([d1], bad).result(timeout=60)


# ------------------------------------------------------------------------------------------------
# the allow-list


def _graph_of(env, fn, ranks):
    from tinker.lib.public_interfaces.custom_loss import trace_loss

    handle = trace_loss(fn, ranks, "local-test")
    return handle, encode_graph(handle).model_dump(mode="json")


def _edit(graph: dict, **changes) -> dict:
    g = copy.deepcopy(graph)
    node = next(n for n in g["nodes"] if n["op"] == "call_function" and n["target"] == "operator.mul")
    node.update(changes)
    return g


def _upload(sc, handle, graph: dict):
    holder = sc.holder
    return holder.run_coroutine_threadsafe(holder._create_custom_loss(
        handle.name, list(handle.inputs), types.CustomLossGraph.model_validate(graph))).result(timeout=60)


@pytest.mark.parametrize("change,named", [
    ({"target": "os.system", "args": ["touch /tmp/tinker-local-pwned"]}, "os.system"),
    ({"target": "torch.load", "args": ["/etc/passwd"]}, "torch.load"),
    ({"target": "torch.save", "args": [{"ref": "logprobs"}, "/tmp/tinker-local-pwned"]}, "torch.save"),
    ({"target": "builtins.eval", "args": ["__import__('os')"]}, "builtins.eval"),
    ({"op": "call_method", "target": "__reduce_ex__", "args": [{"ref": "logprobs"}, 2]}, "__reduce_ex__"),
    ({"op": "call_method", "target": "mul_", "args": [{"ref": "logprobs"}, 2.0]}, "mul_"),
    ({"target": "getattr", "args": [{"ref": "logprobs"}, "__class__"]}, "__class__"),
    ({"op": "get_attr", "target": "weight", "args": []}, "get_attr"),
    ({"op": "call_module", "target": "linear", "args": []}, "call_module"),
    ({"args": [{"ref": "logprobs"}, {"pickle": "gASV"}]}, "pickle"),
])
def test_a_graph_with_a_forbidden_op_is_refused_as_a_user_error(env, change, named):
    handle, graph = _graph_of(env, weighted_nll, WEIGHTED_RANKS)
    with pytest.raises(tinker.BadRequestError) as e:
        _upload(env["on"], handle, _edit(graph, **change))
    assert named in str(e.value) and "custom loss" in str(e.value)
    assert not Path("/tmp/tinker-local-pwned").exists()


def test_the_unmodified_graph_uploads_and_compile_graph_checks_structure(env):
    handle, graph = _graph_of(env, weighted_nll, WEIGHTED_RANKS)
    assert _upload(env["on"], handle, graph)  # the same graph, unedited, is accepted
    inputs = [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}]
    compile_graph("w", inputs, graph)
    with pytest.raises(CustomLossError, match="parameters"):
        compile_graph("w", inputs[:1], graph)
    bad_ref = _edit(graph, args=[{"ref": "nowhere"}, {"ref": "weights"}])
    with pytest.raises(CustomLossError, match="no earlier node"):
        compile_graph("w", inputs, bad_ref)
    no_output = copy.deepcopy(graph)
    no_output["nodes"] = [n for n in no_output["nodes"] if n["op"] != "output"]
    with pytest.raises(CustomLossError, match="output"):
        compile_graph("w", inputs, no_output)
    with pytest.raises(CustomLossError, match="out="):
        compile_graph("w", inputs, _edit(graph, kwargs={"out": {"ref": "logprobs"}}))


def test_python_values_cannot_be_blown_up_by_repetition_or_huge_powers():
    inputs = [{"name": "logprobs", "rank": 1}]
    for args, limit in (([[0], 10 ** 10], "list, tuple or string"), ([10, 10 ** 9], "limit of 63 bits")):
        target = "operator.mul" if isinstance(args[0], list) else "operator.pow"
        graph = {"format": 1, "nodes": [
            {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
            {"op": "call_function", "name": "boom", "target": target, "args": args},
            {"op": "call_method", "name": "total", "target": "sum", "args": [{"ref": "logprobs"}]},
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": "total"}, {"dict": {}}]}]}]}
        with pytest.raises(CustomLossError, match=f"boom.*{limit}"):  # at upload, before anything runs
            compile_graph("boom", inputs, graph)
