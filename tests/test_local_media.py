"""Images and audio through the real tinker SDK against ``prefect-tinker local serve`` (tiny-vl,
tiny-audio): logprobs equal a direct transformers forward on the same pixels / frames, a wrong
``expected_tokens`` is a user error, and a client built only on the SDK samples with an
``ImageChunk`` / ``ImageAssetPointerChunk`` it made by hand."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from tests.local_server import API_KEY, _start, _stop, _wait_healthy, free_port


@pytest.fixture(scope="module")
def media_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tl-media")
    cli = str(Path(sys.executable).parent / "prefect-tinker")
    server = _start([cli, "local", "serve", "--model", "tiny-vl", "--model", "tiny-audio", "--dtype", "fp32",
                     "--threads", "1", "--host", "127.0.0.1"], root, free_port())
    try:
        _wait_healthy(server, time.monotonic() + 240)
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="module")
def client(media_server):
    service = tinker.ServiceClient(base_url=media_server.base_url, api_key=API_KEY)
    yield service
    service.close("success").result(timeout=30)  # its session ends (and its heartbeat) while the server answers


def _png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def _datum(chunks, targets: np.ndarray) -> tinker.Datum:
    return tinker.Datum(model_input=tinker.ModelInput(chunks=chunks), loss_fn_inputs={
        "target_tokens": tinker.TensorData.from_numpy(targets.astype(np.int64)),
        "weights": tinker.TensorData.from_numpy(np.ones(len(targets), dtype=np.float32))})


def _direct_logprobs(logits: torch.Tensor, targets: np.ndarray) -> np.ndarray:
    lp = torch.log_softmax(logits.float(), dim=-1)[0]
    return lp.gather(-1, torch.as_tensor(targets).long().unsqueeze(-1))[:, 0].numpy()


def test_image_logprobs_equal_a_direct_forward(media_server, client):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    d = str(media_server.root / "models" / "tiny-vl")
    model = AutoModelForImageTextToText.from_pretrained(d, dtype="float32").eval()
    proc = AutoImageProcessor.from_pretrained(d)
    cfg = model.config
    tc = client.create_lora_training_client(base_model="tiny-vl", rank=4, seed=3).result()
    datums, direct = [], []
    for k, (w, h) in enumerate([(48, 32), (64, 64)]):
        png = _png(w, h, k)
        img = Image.open(io.BytesIO(png)).convert("RGB")
        out = proc(images=[img], return_tensors="pt")
        n = int(out["image_grid_thw"].prod()) // 4
        pre, post = [1, 40 + k, 41, cfg.vision_start_token_id], [cfg.vision_end_token_id, 50, 51, 52 + k, 2]
        ids = torch.tensor([pre + [cfg.image_token_id] * n + post])
        targets = np.random.default_rng(k).integers(3, 1000, ids.shape[1])
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                           mm_token_type_ids=(ids == cfg.image_token_id).int()).logits
        direct.append(_direct_logprobs(logits, targets))
        datums.append(_datum([tinker.EncodedTextChunk(tokens=pre),
                              tinker.types.ImageChunk(data=png, format="png", expected_tokens=n),
                              tinker.EncodedTextChunk(tokens=post)], targets))
    datums.append(_datum([tinker.EncodedTextChunk(tokens=[1, 5, 6, 7])], np.array([5, 6, 7, 8])))  # text in the batch
    res = tc.forward(datums, "cross_entropy").result()
    for k in range(2):
        got = res.loss_fn_outputs[k]["logprobs"].to_numpy()
        assert got.shape == direct[k].shape
        np.testing.assert_allclose(got, direct[k], atol=1e-4, rtol=0)

    # training moves the image datums' logprobs; a wrong expected_tokens is the caller's error
    before = float(sum(res.loss_fn_outputs[k]["logprobs"].to_numpy().sum() for k in range(2)))
    for _ in range(3):
        tc.forward_backward(datums, "cross_entropy").result()
        tc.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
    after_res = tc.forward(datums, "cross_entropy").result()
    after = float(sum(after_res.loss_fn_outputs[k]["logprobs"].to_numpy().sum() for k in range(2)))
    assert after > before + 1.0
    bad = datums[0].model_input.chunks
    wrong = [
        bad[0],
        tinker.types.ImageChunk(data=bad[1].data, format="png", expected_tokens=bad[1].expected_tokens + 1),
        bad[2],
    ]
    with pytest.raises(tinker.RequestFailedError, match="expected_tokens") as err:
        tc.forward([_datum(wrong, np.zeros(len(datums[0].loss_fn_inputs["target_tokens"].to_numpy()) + 1))],
                   "cross_entropy").result()
    assert err.value.category.name == "User"


def test_dmel_logprobs_equal_a_direct_forward(media_server, client):
    from transformers import AutoModelForCausalLM

    from prefect_tinker.recipes.audio_features import tensor_container
    from tinker_local.media_models import register_media_models

    register_media_models()
    d = str(media_server.root / "models" / "tiny-audio")
    model = AutoModelForCausalLM.from_pretrained(d, dtype="float32").eval()
    frames = np.random.default_rng(1).integers(0, 16, (37, 80)).astype(np.uint8)
    pre, post = [1, 9, 10], [11, 12, 2]
    ids = torch.tensor([pre + [model.config.audio_token_id] * 37 + post])
    targets = np.random.default_rng(2).integers(3, 1000, ids.shape[1])
    with torch.no_grad():
        logits = model(input_ids=ids, dmel_frames=torch.from_numpy(frames)).logits
    tc = client.create_lora_training_client(base_model="tiny-audio", rank=4, seed=0).result()
    chunk = tinker.DmelChunk(dmel=tensor_container(frames))
    assert chunk.length == 37
    res = tc.forward([_datum([tinker.EncodedTextChunk(tokens=pre), chunk, tinker.EncodedTextChunk(tokens=post)],
                             targets)], "cross_entropy").result()
    np.testing.assert_allclose(res.loss_fn_outputs[0]["logprobs"].to_numpy(), _direct_logprobs(logits, targets),
                               atol=1e-4, rtol=0)
    with pytest.raises(tinker.RequestFailedError, match="mel bins") as err:  # 40 bins: not this model's 80
        tc.forward(
            [
                _datum(
                    [tinker.EncodedTextChunk(tokens=pre), tinker.DmelChunk(dmel=tensor_container(frames[:, :40]))],
                    np.zeros(40),
                )
            ],
            "cross_entropy",
        ).result()
    assert err.value.category.name == "User"


HAND_BUILT = textwrap.dedent("""
    # A client of the SDK only (no prefect_tinker): an image prompt built by hand.
    import io, json, sys
    import numpy as np
    import tinker
    from PIL import Image

    base_url, api_key, folder = sys.argv[1:4]
    # closed before exit: no SDK thread (event loop, heartbeat) is left running at interpreter shutdown
    with tinker.ServiceClient(base_url=base_url, api_key=api_key) as svc:
        trainer = svc.create_lora_training_client(base_model="tiny-vl", rank=4).result()
        tok = trainer.get_tokenizer()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        cfg = json.load(open(folder + "/preprocessor_config.json"))
        img = Image.fromarray((np.random.default_rng(0).random((48, 80, 3)) * 255).astype("uint8"))
        buf = io.BytesIO(); img.save(buf, format="PNG"); img.save(folder + "/../hand.png")
        p, m = cfg["patch_size"], cfg["merge_size"]
        n = (round(48 / (p * m)) * p * m // p) * (round(80 / (p * m)) * p * m // p) // m**2
        head = tok.encode("<|im_start|>user\\n<|vision_start|>", add_special_tokens=False)
        tail = tok.encode(
            "<|vision_end|>What is the name of the subject in this photo?<|im_end|>\\n<|im_start|>assistant\\n",
            add_special_tokens=False,
        )
        params = tinker.SamplingParams(max_tokens=6, temperature=0.0)
        out = {"n": n}
        pointer = tinker.types.ImageAssetPointerChunk(location=folder + "/../hand.png", format="png", expected_tokens=n)
        for kind, chunk in [("bytes", tinker.types.ImageChunk(data=buf.getvalue(), format="png", expected_tokens=n)),
                            ("pointer", pointer)]:
            prompt = tinker.ModelInput(
                chunks=[tinker.EncodedTextChunk(tokens=head), chunk, tinker.EncodedTextChunk(tokens=tail)]
            )
            res = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
            out[kind] = [list(s.tokens) for s in res.sequences]
        try:
            bad = tinker.types.ImageChunk(data=buf.getvalue(), format="png", expected_tokens=n + 2)
            sampler.sample(tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=head), bad]), 1, params).result()
            out["wrong"] = "accepted"
        except tinker.RequestFailedError as e:
            out["wrong"] = [e.category.name, str(e)]
    print(json.dumps(out))
""")


def test_hand_built_image_chunk_samples_through_the_sdk(media_server, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(HAND_BUILT)
    folder = media_server.root / "models" / "tiny-vl"
    # -X faulthandler: should the client die of a signal, its stderr names the threads and where they stood
    proc = subprocess.run([sys.executable, "-I", "-X", "faulthandler", str(script), media_server.base_url, API_KEY,
                           str(folder)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, f"rc {proc.returncode}\nstdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["n"] == 15  # 80x48 -> 80x48 at 16 px per token: 5 x 3
    assert len(out["bytes"]) == 2 and all(len(s) == 6 for s in out["bytes"])
    assert out["bytes"][0] == out["bytes"][1] == out["pointer"][0]  # greedy: same image, same reply
    assert out["wrong"][0] == "User" and "expected_tokens=17" in out["wrong"][1]
