"""Bounds on uploaded custom losses (``tinker_local.loss_limits``): adversarial graphs are refused
in one line naming the limit, at upload when their growth does not depend on the data, else before
the node that would go over the bound runs; ordinary losses give the values torch gives."""

from __future__ import annotations

import time

import pytest
import torch

from tests.adversarial_losses import cat_chain, outer, pow_chain
from tinker_local.custom_loss import compile_graph
from tinker_local.loss_limits import CustomLossError, GraphLimits


def _graph(fn, ranks: dict[str, int]):
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, "limits-test")
    return [{"name": x.name, "rank": x.rank} for x in handle.inputs], encode_graph(handle).model_dump(mode="json")


def _compile(fn, limits: GraphLimits | None = None, ranks=None):
    inputs, graph = _graph(fn, ranks or {"logprobs": 1})
    return compile_graph(fn.__name__, inputs, graph, limits)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def diag_offset(logprobs):
    return torch.diag(logprobs, 100_000).sum(), {}


def outer_matmul(logprobs):
    return torch.matmul(logprobs[:, None], logprobs[None, :]).mean(), {}


def cube(logprobs):  # T**3 multiply-adds
    m = torch.matmul(logprobs[:, None], logprobs[None, :])
    return (m @ m).mean(), {}


def masked_mean(logprobs):
    keep = logprobs > -2.0
    return -(logprobs[keep].sum() / keep.sum().clamp(min=1)), {}


def test_chains_whose_growth_does_not_depend_on_the_data_are_refused_at_upload():
    with pytest.raises(CustomLossError) as e:
        _compile(pow_chain)
    assert "limit of 63 bits" in _one_line(e) and "pow_chain" in str(e.value)
    with pytest.raises(CustomLossError) as e:
        _compile(cat_chain)
    assert "elements per intermediate" in _one_line(e) and "torch.cat" in str(e.value)
    with pytest.raises(CustomLossError) as e:
        _compile(diag_offset)
    assert "elements per intermediate" in _one_line(e) and "(100064, 100064)" in str(e.value)


def _raw(nodes: list[dict]) -> dict:
    return {"format": 1, "nodes": [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}, *nodes,
                                   {"op": "call_method", "name": "total", "target": "sum",
                                    "args": [{"ref": "logprobs"}]},
                                   {"op": "output", "name": "output", "target": "output",
                                    "args": [{"tuple": [{"ref": "total"}, {"dict": {}}]}]}]}


def test_list_doubling_string_formatting_and_deep_nesting_are_refused_at_upload():
    inputs = [{"name": "logprobs", "rank": 1}]
    doubling = [{"op": "call_function", "name": "l0", "target": "operator.add",
                 "args": [[{"ref": "logprobs"}], [{"ref": "logprobs"}]]}]
    doubling += [{"op": "call_function", "name": f"l{i}", "target": "operator.add",
                  "args": [{"ref": f"l{i - 1}"}, {"ref": f"l{i - 1}"}]} for i in range(1, 40)]
    with pytest.raises(CustomLossError, match="over the limit of 4096 items"):
        compile_graph("lists", inputs, _raw(doubling))
    fmt = [{"op": "call_function", "name": "f", "target": "operator.mod", "args": ["%0999999999d", 1]}]
    with pytest.raises(CustomLossError, match="string formatting"):
        compile_graph("fmt", inputs, _raw(fmt))
    nested: list = []
    for _ in range(40):
        nested = [nested]
    deep = [{"op": "call_function", "name": "d", "target": "operator.getitem", "args": [nested, 0]}]
    with pytest.raises(CustomLossError, match="nested more than"):
        compile_graph("deep", inputs, _raw(deep))
    big = [{"op": "call_function", "name": "b", "target": "operator.add", "args": [10 ** 30, 1]}]
    with pytest.raises(CustomLossError, match="limit of 63 bits"):
        compile_graph("big", inputs, _raw(big))


def test_node_count_and_time_budget_limits_name_themselves():
    with pytest.raises(CustomLossError) as e:
        _compile(cat_chain, GraphLimits(max_nodes=10))
    assert "node limit" in _one_line(e)
    bound = _compile(outer, GraphLimits(time_budget_s=0.0)).bind(1)
    time.sleep(0.01)
    with pytest.raises(CustomLossError) as e:
        bound(torch.zeros(4), {"__index__": 0}, {})
    assert "time budget of 0 s per request" in _one_line(e)


def test_shape_dependent_growth_is_refused_before_the_node_runs_and_small_inputs_compute_exactly():
    with pytest.raises(CustomLossError, match="4096 elements"):  # 64 x 64 at the probe shape
        _compile(outer, GraphLimits(max_elements=1000))
    lp = -torch.rand(30, dtype=torch.float32)
    for fn, ref in ((outer, (lp[:, None] * lp[None, :]).sum()), (outer_matmul, torch.outer(lp, lp).mean())):
        assert torch.equal(_compile(fn).bind(1)(lp, {"__index__": 0}, {}), ref)
    big = -torch.rand(5000)  # 25 M elements: over the default 16.8 M per intermediate
    with pytest.raises(CustomLossError) as e:
        _compile(outer).bind(1)(big, {"__index__": 3}, {})
    msg = _one_line(e)
    assert "datum 3" in msg and "25000000 elements (5000, 5000)" in msg and "per intermediate" in msg
    with pytest.raises(CustomLossError, match="262144 multiply-adds"):  # 64**3 at the probe shape
        _compile(cube, GraphLimits(max_macs=10_000))
    bound = _compile(cube, GraphLimits(max_macs=300_000)).bind(1)
    m = torch.outer(lp, lp)
    assert torch.allclose(bound(lp, {"__index__": 0}, {}), (m @ m).mean())
    with pytest.raises(CustomLossError) as e:
        bound(-torch.rand(70), {"__index__": 0}, {})
    assert "343000 multiply-adds is over the limit of 300000" in _one_line(e)
    with pytest.raises(CustomLossError) as e:  # the request's total over all datums
        bound = _compile(outer, GraphLimits(max_request_elements=5000)).bind(6)
        for i in range(6):  # 961 elements per datum: refused at datum 5, node mul
            bound(lp, {"__index__": i}, {})
    assert "datum 5" in _one_line(e) and "5765 elements in all, over the limit of 5000 per request" in str(e.value)


def test_data_dependent_shapes_are_bounded_and_computed_exactly():
    lp = torch.tensor([-0.5, -3.0, -1.0, -4.0, -0.1])
    got = _compile(masked_mean).bind(1)(lp, {"__index__": 0}, {})
    keep = lp > -2.0
    assert torch.equal(got, -(lp[keep].sum() / keep.sum().clamp(min=1)))


def where_indices(logprobs, table):  # one-argument where: the indices of the non-zero elements, one tensor per dim
    idx = torch.where(table > 0)
    return logprobs.sum() + (idx[0] + idx[1]).sum() * 0.0, {}


def test_one_argument_where_is_counted_as_the_index_tensors_it_returns():
    lp = -torch.rand(5)
    table = torch.rand(6, 7) + 0.5  # every element > 0: the bound of all-non-zero is the real size
    bound = _compile(where_indices, ranks={"logprobs": 1, "table": 2}).bind(1)
    got = bound(lp, {"__index__": 0, "table": table}, {})
    mask = table > 0
    idx = torch.where(mask)
    assert torch.equal(got, lp.sum() + (idx[0] + idx[1]).sum() * 0.0)
    summed = lp.sum()
    both = idx[0] + idx[1]
    real = [mask, *idx, summed, idx[0], idx[1], both, both.sum(), both.sum() * 0.0, got]  # the nodes' outputs
    assert [n.target for n in bound.loss.nodes if n.op != "placeholder"][:2] == ["operator.gt", "torch.where"]
    assert bound.meter.elements == sum(t.numel() for t in real) == 42 * 6 + 4
