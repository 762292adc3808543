"""An image prompt sampled in a sampler worker process (``serve --sampler-workers``) equals the
same request sampled in-process: media chunks survive the pickled pipe to the worker."""

from __future__ import annotations

import io

import numpy as np

from tinker_local.datatypes import MediaChunk
from tinker_local.engine import Engine
from tinker_local.sampler_pool import SamplerPool


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((h, w, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def test_image_prompt_in_a_worker_equals_in_process(tmp_path):
    engine = Engine(tmp_path, dtype="fp32", num_threads=1)
    tok = engine.load_base_model("tiny-vl")["tokenizer_id"]
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    start, end = t.convert_tokens_to_ids("<|vision_start|>"), t.convert_tokens_to_ids("<|vision_end|>")
    req = dict(base_model="tiny-vl", weights_path=None, num_samples=2, max_tokens=5, seed=11, stop=[],
               prompt_tokens=[[1, 30, start], MediaChunk("image", data=_png(48, 32), format="png", expected_tokens=6),
                              [end, 31]])
    local = engine.sample_many([req])[0]
    pool = SamplerPool(tmp_path, 1, threads_per_worker=1, dtype="fp32")
    try:
        pool.start()
        remote = pool.sample_many([req])[0]
    finally:
        pool.close()
    assert not isinstance(remote, Exception), remote
    assert [s["tokens"] for s in remote.sequences] == [s["tokens"] for s in local.sequences]
    np.testing.assert_allclose([s["logprobs"] for s in remote.sequences], [s["logprobs"] for s in local.sequences],
                               atol=1e-5, rtol=0)
