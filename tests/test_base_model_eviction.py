"""Base models unloaded least-recently-used within ``Engine.max_base_bytes``: a training model whose
base was unloaded resumes exactly where it was (adapter, AdamW state and pending gradients parked),
compared step by step with an engine that never unloads anything."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from tests.engine_helpers import make_datums
from tests.local_server import make_hf_model_dir
from tinker_local.engine import Datum, Engine


def _hf_datums(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 300, 12)
    return [Datum(tokens=toks[:-1].tolist(), inputs={"target_tokens": toks[1:].astype(np.int64),
                                                   "weights": np.ones(11, np.float32)})]


def _script(engine: Engine, hf: str) -> list[float]:
    """Tiny trains, then the other model, then tiny again with gradients pending across the switch."""
    losses = []
    engine.create_model("a", "tiny", 4, seed=1)
    for s in range(2):
        losses.append(engine.forward_backward("a", make_datums(s), "cross_entropy", None).metrics["loss:sum"])
        engine.optim_step("a", learning_rate=1e-2)
    losses.append(engine.forward_backward("a", make_datums(7), "cross_entropy", None).metrics["loss:sum"])
    engine.create_model("b", hf, 4, seed=2)  # loading it unloads tiny under a budget of one model
    losses.append(engine.forward_backward("b", _hf_datums(0), "cross_entropy", None).metrics["loss:sum"])
    engine.optim_step("b", learning_rate=1e-2)
    engine.optim_step("a", learning_rate=1e-2)  # the gradients of datums 7, kept while tiny was away
    losses.append(engine.forward("a", make_datums(8), "cross_entropy", None).metrics["loss:sum"])
    losses.append(engine.forward("b", _hf_datums(1), "cross_entropy", None).metrics["loss:sum"])
    return losses


def test_an_unloaded_base_model_comes_back_with_its_adapters_parked_bit_exactly(tmp_path):
    hf = str(make_hf_model_dir(tmp_path / "hf"))
    free = Engine(tmp_path / "free", dtype="fp32", device="cpu", num_threads=1)
    bounded = Engine(tmp_path / "bounded", dtype="fp32", device="cpu", num_threads=1)
    tiny_bytes = bounded.load_base_model("tiny") and bounded.resident_bases()["tiny"]["bytes"]
    bounded.max_base_bytes = tiny_bytes + 1000  # room for tiny or the small Llama, not both
    want, got = _script(free, hf), _script(bounded, hf)
    assert got == want  # bit for bit
    assert set(free.resident_bases()) == {"tiny", hf}
    assert list(bounded.resident_bases()) == [hf]  # tiny went again for the last forward of b
    assert bounded.base_loads == {"tiny": 2, hf: 2}
    assert free.base_loads == {"tiny": 1, hf: 1}


def test_resident_bases_reads_no_model_an_unload_may_clear_meanwhile(tmp_path):
    """``GET local_stats`` reads ``resident_bases`` without the engine lock: a base model unloaded
    between its snapshot and its byte count (``model`` set to None) still reports the bytes of its
    parameters and buffers as loaded."""
    engine = Engine(tmp_path / "e", dtype="fp32", device="cpu", num_threads=1)
    engine.load_base_model("tiny")
    state = engine._bases["tiny"]
    want = sum(t.numel() * t.element_size() for t in [*state.model.parameters(), *state.model.buffers()])
    assert want > 1e6

    class UnloadAfterSnapshot(OrderedDict):
        def items(self):  # the compute thread unloads everything right after the snapshot is taken
            snapshot = list(super().items())
            engine.max_base_bytes = 0
            engine._make_room(1, "other")
            return snapshot

    engine._bases = UnloadAfterSnapshot(engine._bases)
    assert engine.resident_bases() == {"tiny": {"bytes": want, "loads": 1}}
    assert state.model is None and not engine._bases  # the unload did happen in between
