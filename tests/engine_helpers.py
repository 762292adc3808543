"""What the engine tests share (tests/test_engine.py, tests/test_engine_sampling.py): a module-scoped
``Engine`` on the ``tiny`` preset in fp32 on CPU with a temporary root, random datums, a few steps of training."""

from __future__ import annotations

import numpy as np
import pytest

from tinker_local.engine import Datum, Engine

VOCAB = 2048


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("engine_root"), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def base_dir(engine):
    return engine.load_base_model("tiny")["tokenizer_id"]


def make_datums(seed: int, lengths=(17, 9, 30), soft_k: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        toks = rng.integers(0, VOCAB, n + 1)
        shape = (n, soft_k) if soft_k else (n,)
        tgt = rng.integers(0, VOCAB, shape) if soft_k else toks[1:]
        w = rng.uniform(-1.0, 2.0, shape).astype(np.float32)  # arbitrary real weights
        out.append(Datum(tokens=toks[:-1].tolist(),
                         inputs={"target_tokens": np.asarray(tgt, np.int64), "weights": w}))
    return out


def train_a_bit(engine, model_id, steps=2, lr=5e-3):
    for s in range(steps):
        engine.forward_backward(model_id, make_datums(100 + s), "cross_entropy", None)
        engine.optim_step(model_id, learning_rate=lr)
