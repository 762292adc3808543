"""Local Hugging Face vision-language directories on the engine (no HTTP): Qwen2-VL and Qwen2.5-VL
built small here (the tiny-vl tokenizer and image processor), logprobs equal a direct forward,
a LoRA step trains, sampling with an image works, and text-only inputs still run."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tinker_local.datatypes import Datum, MediaChunk
from tinker_local.engine import Engine
from tinker_local.errors import EngineUserError


def _png(w, h, seed=0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def _make_dir(arch: str, src, out):
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(src)
    ids = {
        t: tok.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    }
    text = dict(vocab_size=2112, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=False)
    if arch == "qwen2_vl":
        cfg = Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=64, hidden_size=128, mlp_ratio=2,
                                                                 num_heads=4, patch_size=8, spatial_merge_size=2,
                                                                 temporal_patch_size=2), **common)
        cls = Qwen2VLForConditionalGeneration
    else:
        cfg = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                depth=2,
                hidden_size=64,
                intermediate_size=128,
                num_heads=4,
                out_hidden_size=128,
                patch_size=8,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=32,
                fullatt_block_indexes=[1],
            ),
            **common,
        )
        cls = Qwen2_5_VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        cls(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    AutoImageProcessor.from_pretrained(src).save_pretrained(str(out))
    return out, cfg


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine(tmp_path_factory.mktemp("vl-root"), dtype="fp32", num_threads=1)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_local_vl_directory(arch, engine, tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    from PIL import Image

    src = engine.load_base_model("tiny-vl")["tokenizer_id"]
    d, cfg = _make_dir(arch, src, tmp_path / arch)
    engine.create_model(f"m-{arch}", str(d), 4, seed=0)
    model = AutoModelForImageTextToText.from_pretrained(str(d), dtype="float32").eval()
    proc = AutoImageProcessor.from_pretrained(str(d))
    png = _png(48, 32)
    out = proc(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
    n = int(out["image_grid_thw"].prod()) // 4
    pre, post = [1, 30, cfg.vision_start_token_id], [cfg.vision_end_token_id, 31, 32, 2]
    ids = torch.tensor([pre + [cfg.image_token_id] * n + post])
    targets = np.random.default_rng(0).integers(3, 900, ids.shape[1])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                       mm_token_type_ids=(ids == cfg.image_token_id).int()).logits
    direct = torch.log_softmax(logits.float(), -1)[0].gather(-1, torch.as_tensor(targets).unsqueeze(-1))[:, 0].numpy()
    datum = Datum(tokens=[], inputs={"target_tokens": targets, "weights": np.ones(len(targets), np.float32)},
                  chunks=[pre, MediaChunk("image", data=png, format="png", expected_tokens=n), post])
    res = engine.forward(f"m-{arch}", [datum], "cross_entropy", None)
    np.testing.assert_allclose(res.outputs[0]["logprobs"], direct, atol=1e-4, rtol=0)
    before = res.metrics["loss:sum"]
    for _ in range(3):
        engine.forward_backward(f"m-{arch}", [datum], "cross_entropy", None)
        engine.optim_step(f"m-{arch}", learning_rate=1e-2)
    assert engine.forward(f"m-{arch}", [datum], "cross_entropy", None).metrics["loss:sum"] < before - 1.0
    sample = engine.sample(str(d), None, [pre, MediaChunk("image", data=png, format="png"), [cfg.vision_end_token_id]],
                           num_samples=2, max_tokens=4, seed=1, stop=[])
    assert [len(s["tokens"]) for s in sample.sequences] == [4, 4]
    text = engine.forward(f"m-{arch}", [Datum(tokens=[1, 2, 3], inputs={"target_tokens": np.array([2, 3, 4])})],
                          "cross_entropy", None)
    assert np.isfinite(text.outputs[0]["logprobs"]).all()
    with pytest.raises(EngineUserError, match="placeholder of a media position"):
        engine.forward(
            f"m-{arch}",
            [Datum(tokens=[1, cfg.image_token_id, 2], inputs={"target_tokens": np.zeros(3, np.int64)})],
            "cross_entropy",
            None,
        )
    with pytest.raises(EngineUserError, match="placeholder of a media position"):
        engine.sample(str(d), None, [1, cfg.image_token_id], num_samples=1, max_tokens=2)
