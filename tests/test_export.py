"""The export recipe end to end: an SFT run on ``tiny``, its last checkpoint exported as a merged
Hugging Face model and as a PEFT adapter through the SDK's export path, then loaded with plain
``transformers`` / ``peft`` code written here (no project code) and compared with the local
server's ``compute_logprobs`` of the same checkpoint; the same for a Llama with tied embeddings
(``lm_head`` a LoRA target); S3 output against SeaweedFS; caching; a corrupted merge refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch

from prefect_tinker.flows.export import ExportConfig, export_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from tests.data_files import synthetic_file
from tests.local_server import make_hf_model_dir

pytestmark = pytest.mark.filterwarnings("ignore:Model with `tie_word_embeddings=True`:UserWarning")

TEXTS = ["hello world, hello tinker", "the quick brown fox jumps over the lazy dog", "7 * 8 = 56"]


def _sequences(tok) -> list[list[int]]:
    return [tok.encode(t) for t in TEXTS] + [list(range(3, 60, 2))]


def _hf_logprobs(model, seqs) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1)
            out.append(logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy())
    return out


def _server_logprobs(credentials, sampler_path: str, seqs) -> list[np.ndarray]:
    sampler = credentials.get_client().create_sampling_client(model_path=sampler_path).result(timeout=120)
    return [np.asarray(sampler.compute_logprobs(tinker.ModelInput.from_ints(s)).result(timeout=120)[1:], np.float32)
            for s in seqs]


def _load_merged(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(folder)))


def _load_peft(folder: Path, base_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder)).eval()


def _export(local_credentials, **kw) -> dict:
    return export_flow(ExportConfig(backend={"local_root": local_credentials.local_root}, **kw))


@pytest.fixture(scope="module")
def sft_run(prefect_api, local_credentials, tmp_path_factory):
    """A short SFT run on tiny: its summary, its state and sampler paths at the last step."""
    store = tmp_path_factory.mktemp("export-store")
    cfg = SFTConfig(model="tiny", dataset=str(synthetic_file("chats")), batch_size=4,
                    learning_rate=5e-3, lora_rank=8, max_steps=4, eval_every=0, save_every=0, run_name="export-src",
                    store=str(store), max_length=128, num_eval_samples=1, sample_max_tokens=4,
                    backend={"local_root": local_credentials.local_root})
    summary = sft_flow(cfg)
    state = next(p for p in summary["checkpoints"] if "/weights/" in p)
    sampler = next(p for p in summary["checkpoints"] if "/sampler_weights/" in p)
    assert state.rsplit("/", 1)[1] == sampler.rsplit("/", 1)[1]
    return {"state": state, "sampler": sampler, "store": store}


def test_sft_checkpoint_exports_both_ways_and_matches_the_server(sft_run, local_credentials, tmp_path):
    merged = _export(local_credentials, checkpoint=sft_run["state"], format="merged", out=str(tmp_path / "merged"),
                     max_shard_mb=8)
    peft_meta = _export(local_credentials, checkpoint=sft_run["sampler"], format="peft", out=str(tmp_path / "peft"))

    files = sorted(p.name for p in (tmp_path / "merged").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and all(s.startswith("model-") and f"-of-{len(shards):05d}" in s for s in shards)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "export_metadata.json"} <= set(files)
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "export_metadata.json"]

    # plain transformers / peft, compared with the server's compute_logprobs of the same weights
    model, tok = _load_merged(tmp_path / "merged")
    seqs = _sequences(tok)
    want = _server_logprobs(local_credentials, sft_run["sampler"], seqs)
    for got, w in zip(_hf_logprobs(model, seqs), want, strict=True):
        np.testing.assert_allclose(got, w, atol=1e-4)
    base_dir = str(local_credentials.resolved_local_root() / "models" / "tiny")
    for got, w in zip(_hf_logprobs(_load_peft(tmp_path / "peft", base_dir), seqs), want, strict=True):
        np.testing.assert_allclose(got, w, atol=1e-4)
    base = _hf_logprobs(_load_merged(Path(base_dir))[0], seqs)
    assert max(np.abs(b - w).max() for b, w in zip(base, want, strict=True)) > 1e-2  # the adapter matters

    # the metadata: in the folder and the flow's result, with the verification numbers
    on_disk = json.loads((tmp_path / "merged" / "export_metadata.json").read_text())
    assert on_disk == merged
    v = merged["verification"]
    assert v["passed"] and v["max_abs_diff"] <= 1e-4 and v["tolerance"] == 1e-4 and v["discriminative"]
    assert merged["state_path"] == sft_run["state"] and merged["external_weights"].startswith("tinker://")
    assert "/external_weights/" in merged["external_weights"] and merged["embeddings"] == {"tied_in_base": False,
                                                                                          "untied": False}
    import hashlib

    for name, f in merged["files"].items():
        data = (tmp_path / "merged" / name).read_bytes()
        assert len(data) == f["bytes"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    # a sampler path: exported from its state twin, verified against the sampler itself
    assert peft_meta["state_path"] == sft_run["state"] and peft_meta["verification"]["reference"] == sft_run["sampler"]

    # lineage: the export is an asset materialization with the checkpoint as its upstream
    want = {(tmp_path / "merged").resolve().as_uri(): sft_run["state"],
            (tmp_path / "peft").resolve().as_uri(): sft_run["sampler"]}
    events = _wait_for_materializations(set(want))
    for e in events:
        related = {r["prefect.resource.id"]: r.get("prefect.resource.role") for r in e["related"]}
        assert related.get(want[e["resource"]["prefect.resource.id"]]) == "asset", related


def _wait_for_materializations(keys: set[str], timeout: float = 60.0) -> list[dict]:
    import time

    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    while True:  # events reach the API asynchronously
        with get_client(sync_client=True) as c:
            flt = {"event": {"prefix": ["prefect.asset.materialization"]}, "resource": {"id": sorted(keys)}}
            resp = c._client.post("/events/filter", json={"filter": flt, "limit": 50})
        found = [e for e in resp.json()["events"] if e["resource"]["prefect.resource.id"] in keys]
        if {e["resource"]["prefect.resource.id"] for e in found} >= keys or time.monotonic() > deadline:
            assert {e["resource"]["prefect.resource.id"] for e in found} >= keys, found
            return found
        time.sleep(1.0)


def test_cli_runs_an_export_and_refuses_bad_paths(sft_run, local_credentials, tmp_path, capsys):
    from prefect_tinker.cli.main import main as cli_main

    out = tmp_path / "cli-peft"
    rc = cli_main(["run", "export", f"checkpoint={sft_run['sampler']}", "format=peft", f"out={out}",
                   f"backend.local_root={local_credentials.local_root}"])
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0 and printed["verification"]["passed"] and (out / "adapter_model.safetensors").is_file()
    for bad, field in (("checkpoint=tinker://r/external_weights/x", "checkpoint"), ("out=gs://bucket/x", "out"),
                       ("format=gguf", "format")):
        args = {
            "checkpoint": "checkpoint=tinker://r/weights/x",
            "out": f"out={tmp_path / 'o'}",
            "format": "format=peft",
        }
        args[field] = bad
        assert cli_main(["run", "export", *args.values()]) == 2
        assert field in capsys.readouterr().err


def test_export_is_cached_and_redone_when_the_files_are_gone(sft_run, local_credentials, tmp_path):
    rest = local_credentials.get_client().create_rest_client()
    run = sft_run["state"].removeprefix("tinker://").split("/")[0]

    def external_count() -> int:
        return sum(c.checkpoint_type == "external" for c in rest.list_user_checkpoints(limit=1000).result().checkpoints)

    kw = dict(checkpoint=sft_run["state"], format="peft", dtype="bfloat16", out=str(tmp_path / "a"))
    first = _export(local_credentials, **kw)
    n = external_count()
    again = _export(local_credentials, **kw)
    assert again["export_id"] == first["export_id"] and external_count() == n  # no server work
    import shutil

    shutil.rmtree(tmp_path / "a")
    redone = _export(local_credentials, **kw)
    assert redone["export_id"] != first["export_id"] and (tmp_path / "a" / "export_metadata.json").is_file()
    assert external_count() == n + 1 and run
    # an occupied folder is refused before any server work, unless overwrite
    other = dict(kw, format="merged")
    with pytest.raises(FileExistsError, match="already holds"):
        _export(local_credentials, **other)
    assert external_count() == n + 1
    assert _export(local_credentials, overwrite=True, **other)["format"] == "merged"
    assert not (tmp_path / "a" / "adapter_model.safetensors").exists()


def test_a_corrupted_merge_is_refused_and_nothing_is_published(sft_run, local_credentials, tmp_path, monkeypatch):
    from prefect_tinker.export import adapter as adapter_mod
    from prefect_tinker.export.verify import ExportVerificationError

    honest = adapter_mod.LoraDelta.delta
    # the classic bug: the delta transposed where it is square (attention q/o projections)
    monkeypatch.setattr(adapter_mod.LoraDelta, "delta", lambda self, **kw: honest(self, **kw).T.contiguous()
                        if honest(self, **kw).shape[0] == honest(self, **kw).shape[1] else honest(self, **kw))
    with pytest.raises(ExportVerificationError, match="nothing was published"):
        _export(local_credentials, checkpoint=sft_run["state"], format="merged", out=str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.export-*"))


def test_llama_with_tied_embeddings_and_lm_head_target(prefect_api, local_credentials, tmp_path):
    model_dir = make_hf_model_dir(tmp_path / "llama")
    service = local_credentials.get_client()
    tc = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result(timeout=120)
    tok = tc.get_tokenizer()
    data = [tinker.Datum(model_input=tinker.ModelInput.from_ints(tok.encode(t)[:-1]),
                         loss_fn_inputs={"target_tokens": np.asarray(tok.encode(t)[1:], np.int64)}) for t in TEXTS]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(tinker.AdamParams(learning_rate=2e-2)).result(timeout=120)
    state = tc.save_state("tied-final").result(timeout=120).path
    sampler = tc.save_weights_for_sampler("tied-final").result(timeout=120).path

    meta = _export(local_credentials, checkpoint=sampler, format="merged", out=str(tmp_path / "merged"))
    _export(local_credentials, checkpoint=state, format="peft", out=str(tmp_path / "peft"))
    assert meta["embeddings"] == {"tied_in_base": True, "untied": True}
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    seqs = _sequences(tok)
    want = _server_logprobs(local_credentials, sampler, seqs)
    model, _ = _load_merged(tmp_path / "merged")
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr() and not torch.equal(head, embed)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert torch.equal(embed, base.get_input_embeddings().weight)  # the input side is the base's
    for got, w in zip(_hf_logprobs(model, seqs), want, strict=True):
        np.testing.assert_allclose(got, w, atol=1e-4)
    for got, w in zip(_hf_logprobs(_load_peft(tmp_path / "peft", str(model_dir)), seqs), want, strict=True):
        np.testing.assert_allclose(got, w, atol=1e-4)


def test_merged_export_to_s3(sft_run, local_credentials, s3_root, s3_server, tmp_path, monkeypatch):
    import fsspec

    out = f"{s3_root}/models/tiny-sft"
    meta = _export(local_credentials, checkpoint=sft_run["state"], format="merged", dtype="bfloat16", out=out)
    assert meta["out"] == out and meta["verification"]["passed"]
    fs = fsspec.filesystem("s3", **s3_server.storage_options())
    local = tmp_path / "from-s3"
    fs.get(out.removeprefix("s3://") + "/", str(local), recursive=True)
    assert sorted(p.name for p in local.iterdir()) == sorted([*meta["files"], "export_metadata.json"])
    model, tok = _load_merged(local)
    assert model.get_input_embeddings().weight.dtype == torch.float32  # loaded upcast from bfloat16
    from safetensors import safe_open

    shard = next(local.glob("model-*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    seqs = _sequences(tok)
    want = _server_logprobs(local_credentials, sft_run["sampler"], seqs)
    diff = max(np.abs(g - w).max() for g, w in zip(_hf_logprobs(model, seqs), want, strict=True))
    assert diff <= meta["verification"]["tolerance"] and diff == pytest.approx(
        meta["verification"]["max_abs_diff"], abs=0.05
    )
    # wrong S3 credentials fail at the check, before any server work
    from tinker_blocks.s3 import StoreAccessError

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StoreAccessError):
        _export(local_credentials, checkpoint=sft_run["state"], format="peft", out=f"{s3_root}/models/other")


@pytest.mark.parametrize("example", ["merged", "peft"])
def test_example_configs_validate(example, tmp_path, capsys):
    from prefect_tinker.cli.main import main as cli_main

    assert cli_main(["run", "export", "--example", example, "checkpoint=tinker://r/weights/x", "--dry-run"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["format"] == example and cfg["checkpoint"] == "tinker://r/weights/x"
    assert cli_main(["run", "export", "--example", example, "--dry-run"]) == 2  # the checkpoint is required
    assert "checkpoint" in capsys.readouterr().err
