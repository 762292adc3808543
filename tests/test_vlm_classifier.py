"""The VLM classifier recipe: ``prefect-tinker run sft model=tiny-vl`` on a real image set
(scikit-learn's bundled 8x8 handwritten digits, upscaled and written to a class folder here),
with held-out NLL and greedy accuracy; plus the JSONL form of the same data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefect_tinker.cli.main import main as cli_main


def write_digits(root, size: int = 32, per_class: int | None = None):
    """scikit-learn's digits (1,797 8x8 images, 16 grey levels) as ``root/<digit>/<i>.png``,
    upscaled to ``size`` x ``size`` (nearest neighbour). Returns ``root``."""
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn (its bundled digits) is not installed")
    from PIL import Image

    digits = datasets.load_digits()
    counts: dict[int, int] = {}
    for i, (img, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        label = int(label)
        if per_class is not None and counts.get(label, 0) >= per_class:
            continue
        counts[label] = counts.get(label, 0) + 1
        d = root / str(label)
        d.mkdir(parents=True, exist_ok=True)
        pixels = (np.asarray(img) * (255.0 / 16.0)).astype(np.uint8)
        Image.fromarray(pixels, mode="L").resize((size, size), Image.NEAREST).save(d / f"{i:04d}.png")
    return root


def one_thread_server(credentials) -> None:
    """Start the test's local server with one torch thread before the CLI reuses it (from
    ``server.json``): two threads contend on a loaded 2-core machine, ~10x slower per step."""
    from tinker_blocks import TinkerCredentials

    TinkerCredentials(local=True, local_root=credentials.local_root, local_threads=1).get_client()


def _sql(capsys, store, query):
    capsys.readouterr()
    assert cli_main(["sql", "--store", str(store), "--json", query]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_vlm_classifier_on_digits(prefect_api, local_credentials, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_TINKER_MEDIA", str(tmp_path / "media"))
    folder = write_digits(tmp_path / "digits")
    assert sum(1 for _ in folder.rglob("*.png")) == 1797
    store = tmp_path / "store"
    one_thread_server(local_credentials)
    capsys.readouterr()
    rc = cli_main(["run", "sft", "model=tiny-vl", f"dataset={folder}", "format=image_folder", "max_steps=20",
                   "batch_size=8", "learning_rate=3e-3", "lora_rank=16", "test_size=16", "eval_every=0",
                   "save_every=0", "num_eval_samples=2", "sample_max_tokens=12", "sample_temperature=0",
                   f"store={store}", f"backend.local_root={local_credentials.local_root}", "run_name=digits"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 20 and summary["last_loss"] < summary["first_loss"]
    assert summary["last_test_nll"] < summary["first_test_nll"]
    assert all("The subject in this photo is" in s["reference"] for s in summary["samples"])

    acc = _sql(
        capsys,
        store,
        "SELECT step, name, value FROM metrics WHERE run_id='digits' AND name LIKE 'test/accuracy%' "
        "ORDER BY step, name",
    )
    assert [(r["step"], r["name"]) for r in acc] == [
        (s, n) for s in (0, 20) for n in ("test/accuracy", "test/accuracy_n")
    ]
    assert all(r["value"] == 16 for r in acc if r["name"] == "test/accuracy_n")
    assert all(0.0 <= r["value"] <= 1.0 for r in acc if r["name"] == "test/accuracy")
    loss = _sql(
        capsys, store, "SELECT step, value FROM metrics WHERE run_id='digits' AND name='train/loss' ORDER BY step"
    )
    values = [r["value"] for r in loss]
    assert len(values) == 20 and np.mean(values[-3:]) < 0.5 * values[0], values


def test_classification_jsonl_and_prepared_data_by_reference(tmp_path, monkeypatch):
    """JSONL with relative image paths; the prepared data keeps references (path + SHA-256), not pixels."""
    import pickle

    from prefect_tinker.recipes.builders import SupervisedBuilder
    from prefect_tinker.recipes.data_reading import SourceSpec
    from tinker_local.models import resolve_model
    from transformers import AutoTokenizer

    monkeypatch.setenv("PREFECT_TINKER_MEDIA", str(tmp_path / "media"))
    folder = write_digits(tmp_path / "set", per_class=3)
    rows = [
        {"img": str(p.relative_to(tmp_path)), "class": f"digit_{p.parent.name}"} for p in sorted(folder.rglob("*.png"))
    ]
    jsonl = tmp_path / "digits.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-vl", tmp_path / "models").tokenizer_dir)
    builder = SupervisedBuilder(sources=[SourceSpec(path=str(jsonl), format="image_classification",
                                                    fields={"image": "img", "label": "class"})],
                                renderer="chatml", test_size=3, max_length=128)
    data = builder.build(tok)
    assert len(data.train) == 27 and len(data.test) == 3
    ex = data.train[0]
    assert len(ex.media) == 1 and ex.media[0].ref.tokens == 4 and ex.media[0].ref.path.startswith(str(folder))
    text = tok.decode([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0], skip_special_tokens=True)
    assert text.startswith("The subject in this photo is: digit ")
    assert len(pickle.dumps(data)) < 2000 * len(rows)  # references, not pixels
    # the fingerprint follows the JSONL's content
    fp = builder.fingerprint()
    jsonl.write_text(jsonl.read_text().replace("digit_0", "zero"))
    assert builder.fingerprint() != fp


def test_classification_from_a_hugging_face_image_dataset(tmp_path, monkeypatch):
    """A Hugging Face image dataset (``Image`` and ``ClassLabel`` features, here a local parquet
    file): images arrive decoded, go to the media cache as PNG; class ids become class names."""
    datasets = pytest.importorskip("datasets")
    from prefect_tinker.recipes.builders import SupervisedBuilder
    from prefect_tinker.recipes.data_reading import SourceSpec
    from tinker_local.models import resolve_model
    from transformers import AutoTokenizer

    monkeypatch.setenv("PREFECT_TINKER_MEDIA", str(tmp_path / "media"))
    folder = write_digits(tmp_path / "set", per_class=2)
    paths = sorted(folder.rglob("*.png"))
    names = [f"class_{k}" for k in range(10)]
    ds = datasets.Dataset.from_dict({"image": [str(p) for p in paths], "label": [int(p.parent.name) for p in paths]})
    ds = ds.cast_column("image", datasets.Image()).cast_column("label", datasets.ClassLabel(names=names))
    parquet = tmp_path / "digits.parquet"
    ds.to_parquet(str(parquet))
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-vl", tmp_path / "models").tokenizer_dir)
    data = SupervisedBuilder(sources=[SourceSpec(path=str(parquet), format="image_classification")],
                             renderer="chatml", test_size=0, max_length=128).build(tok)
    assert len(data.train) == 20
    for ex in data.train:
        ref = ex.media[0].ref
        assert ref.path.startswith(str(tmp_path / "media")) and ref.format == "png" and ref.tokens == 4
        text = tok.decode([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0], skip_special_tokens=True)
        assert text.startswith("The subject in this photo is: class ")
