"""The SDK's export path against ``tinker_local``: ``TrainingClient.save_weights_external`` then
``RestClient.get_external_weights_urls``, files fetched with plain ``urllib`` (no API key), loaded
with plain ``transformers`` + ``peft`` and compared with the server's ``compute_logprobs``; signed
URLs refused when altered or expired; age-encrypted exports (needs ``pyrage``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import tinker
from tinker import types
from tests import inproc_server
from tests.local_server import make_hf_model_dir

# peft warns that lm_head (a LoRA target here) is tied to the input embedding; loading is exact
pytestmark = pytest.mark.filterwarnings("ignore:Model with `tie_word_embeddings=True`:UserWarning")

KEY = "tml-export-tests"
TEXTS = ["hello world, hello tinker", "the quick brown fox jumps over the lazy dog", "7 * 8 = 56"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("export-model") / "model")
    server = inproc_server.start(tmp_path_factory.mktemp("export-root"), [str(model_dir)])
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    tc = sc.create_lora_training_client(str(model_dir), rank=4, seed=0).result(timeout=120)
    tok = tc.get_tokenizer()
    data = []
    for t in TEXTS:
        ids = tok.encode(t)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)}))
    for _ in range(3):  # B != 0 everywhere, so the export carries a real delta
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=60)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=60)
    yield {"server": server, "sc": sc, "tc": tc, "tok": tok, "sampler": sampler,
           "rc": tinker.RestClient(base_url=server.base_url, api_key=KEY)}
    sc.close("success").result(timeout=30)
    server.stop()


def _download(urls: dict[str, str], out: Path) -> Path:
    for rel, url in urls.items():
        dest = out / rel
        assert dest.resolve().is_relative_to(out.resolve())
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(urllib.request.urlopen(url, timeout=60).read())
    return out


def _peft_logprobs(folder: Path, tok) -> list[np.ndarray]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(folder / "base_model"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    out = []
    with torch.no_grad():
        for t in TEXTS:
            ids = tok.encode(t)
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy())
    return out


def _server_logprobs(sampler, tok) -> list[np.ndarray]:
    return [np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(tok.encode(t))).result(timeout=60)[1:],
                       np.float32) for t in TEXTS]


def test_external_weights_load_with_peft_and_match_the_server(env, tmp_path):
    path = env["tc"].save_weights_external("final").result(timeout=60).path
    assert path == f"tinker://{env['tc'].model_id}/external_weights/final"
    res = env["rc"].get_external_weights_urls(path).result(timeout=30)
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model/config.json",
            "base_model/model.safetensors", "base_model/tokenizer.json"} <= set(res.urls)
    assert "base_model/tinker_local_preset.json" not in res.urls
    folder = _download(res.urls, tmp_path / "export")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 32) and "lm_head" in cfg["target_modules"]
    expected = _server_logprobs(env["sampler"], env["tok"])
    got = _peft_logprobs(folder, env["tok"])
    for g, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, want, atol=1e-4)
    adapted = got[0]  # sanity: the delta is not negligible
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(folder / "base_model"), dtype=torch.float32)
    ids = env["tok"].encode(TEXTS[0])
    with torch.no_grad():
        lp = torch.log_softmax(plain(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
    assert np.abs(lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy() - adapted).max() > 1e-2
    ck = next(c for c in env["rc"].list_checkpoints(env["tc"].model_id).result(timeout=30).checkpoints
              if c.tinker_path == path)
    own = sum((folder / f).stat().st_size for f in ("adapter_model.safetensors", "adapter_config.json"))
    assert ck.checkpoint_type == "external" and ck.size_bytes == own


def _status(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_signed_urls_are_refused_when_altered_or_expired(env):
    path = env["tc"].save_weights_external("signed").result(timeout=60).path
    res = env["rc"].get_external_weights_urls(path).result(timeout=30)
    url = res.urls["adapter_config.json"]
    assert _status(url)[0] == 200
    sig = url.split("sig=")[1]
    flipped = url[: -len(sig)] + ("0" if sig[0] != "0" else "1") + sig[1:]
    assert _status(flipped)[0] == 403
    # another file under the same signature, a later expiry under the same signature
    assert _status(url.replace("adapter_config.json", "adapter_model.safetensors"))[0] == 403
    exp = url.split("expires=")[1].split("&")[0]
    assert _status(url.replace(f"expires={exp}", f"expires={int(exp) + 3600}"))[0] == 403
    assert _status(url.split("?")[0])[0] == 403  # no signature at all
    service, clock = env["server"].service, env["server"].service.clock
    assert abs(res.expires.timestamp() - (clock() + 3600)) < 60
    service.clock = lambda: clock() + 3601
    try:
        code, body = _status(url)
        assert code == 403 and "expired" in body
    finally:
        service.clock = clock
    assert _status(url)[0] == 200


def test_external_urls_need_an_external_checkpoint(env):
    import httpx

    sampler_path = env["tc"].save_weights_for_sampler("not-external").result(timeout=60).path
    with pytest.raises(ValueError, match="external weights"):  # the SDK checks the path itself
        env["rc"].get_external_weights_urls(sampler_path)
    run, seg, name = sampler_path.removeprefix("tinker://").split("/")
    r = httpx.get(f"{env['server'].base_url}/api/v1/training_runs/{run}/checkpoints/{seg}/{name}/external_weights_urls",
                  headers={"X-API-Key": KEY})
    assert r.status_code == 400 and "save_weights_external" in r.json()["detail"]


def test_age_encrypted_export_decrypts_to_the_same_adapter(env, tmp_path):
    pyrage = pytest.importorskip("pyrage", reason="age encryption needs the optional pyrage package")
    identity = pyrage.x25519.Identity.generate()
    plain = env["tc"].save_weights_external("clear").result(timeout=60).path
    enc = (
        env["tc"]
        .save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())])
        .result(timeout=60)
        .path
    )
    urls = env["rc"].get_external_weights_urls(enc).result(timeout=30).urls
    assert {"adapter_model.safetensors.age", "adapter_config.json.age"} <= set(urls)
    assert "adapter_model.safetensors" not in urls
    folder = _download(urls, tmp_path / "sealed")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (folder / name).write_bytes(pyrage.decrypt((folder / f"{name}.age").read_bytes(), [identity]))
    clear = _download(env["rc"].get_external_weights_urls(plain).result(timeout=30).urls, tmp_path / "clear")
    assert (folder / "adapter_model.safetensors").read_bytes() == (clear / "adapter_model.safetensors").read_bytes()
    with pytest.raises(tinker.BadRequestError, match="recipient"):
        env["tc"].save_weights_external("bad", age_encryption_recipients=["not-a-key"]).result(timeout=60)
