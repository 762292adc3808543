"""Base models unloaded least-recently-used within ``Engine.max_base_bytes``: a training model whose
base was unloaded resumes exactly where it was (adapter, AdamW state and pending gradients parked),
compared step by step with an engine that never unloads anything."""

from __future__ import annotations

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
