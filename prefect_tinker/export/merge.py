"""Merging a LoRA adapter into its base model's weights: a Hugging Face model folder.

``W' = W + delta`` per target (:meth:`~prefect_tinker.export.adapter.LoraDelta.delta`),
in float32, then cast to the export dtype, streamed shard by shard (one base shard and one output
shard in memory at a time) into ``model-XXXXX-of-YYYYY.safetensors`` files with a
``model.safetensors.index.json``, next to ``config.json``, ``generation_config.json`` and the
base folder's other files (tokenizer, chat template, licence).

Tied embeddings: when the model ties its output projection to the input embedding (found by
building the architecture on the ``meta`` device and comparing the two weights, exactly as
``transformers`` will load it) and the adapter changes either of them, the two are untied:
``lm_head = E + delta_head`` and ``embed = E + delta_embed`` are both written and
``tie_word_embeddings`` is set to false. Merging into a tied weight instead would add the
output-side delta to the input embedding too -- the silent corruption of tinker-cookbook #457.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prefect_tinker.export.adapter import AdapterError, LoraAdapter, LoraDelta

__all__ = ["DTYPES", "MergeReport", "base_weight_files", "cast_weights", "merge_into_folder", "model_layout"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX = "model.safetensors.index.json"
#: files of a base folder never copied into a merged folder (weights, its own config, markers)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_NOT_COPIED = {
    "config.json",
    "generation_config.json",
    INDEX,
    "pytorch_model.bin.index.json",
    "tinker_local_preset.json",
    "adapter_config.json",
    "export_metadata.json",
}
#: adapter module names of the output projection used by other exporters
_HEAD_ALIASES = ("model.unembed_tokens", "unembed_tokens")


@dataclass
class ModelLayout:
    """What the architecture says about its weights (from a ``meta``-device instance).

    Attributes:
        head: the output projection's weight key (``lm_head.weight``), or None.
        embed: the input embedding's weight key (``model.embed_tokens.weight``), or None.
        tied: whether ``transformers`` ties the two when it loads this config.
        shapes: every parameter's key -> shape (tied ones under both keys).
        conv1d: weight keys of GPT-2 style ``Conv1D`` modules (stored (in, out)).
        renamings / converters: ``transformers`` >= 5's checkpoint-key transforms of this
            architecture (a checkpoint may name ``embed_out.weight`` what the model calls
            ``lm_head.weight``); empty with older versions.
        prefix / meta_keys: the base-model prefix and the model's own keys, for the same lookup.
    """

    head: str | None
    embed: str | None
    tied: bool
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    conv1d: set[str] = field(default_factory=set)
    renamings: list[Any] = field(default_factory=list)
    converters: list[Any] = field(default_factory=list)
    prefix: str | None = None

    def model_key(self, file_key: str) -> tuple[str, bool]:
        """``(model key, converted)`` of a checkpoint key, renamed as ``transformers`` does on
        load; ``converted`` when a non-renaming transform (fusing, splitting) applies to it."""
        if not self.renamings and not self.converters:
            return file_key, False
        from transformers.core_model_loading import rename_source_key

        key, pattern = rename_source_key(file_key, self.renamings, self.converters, self.prefix, self.shapes)
        return key, pattern is not None


@dataclass
class MergeReport:
    """What the merge did: ``targets`` (weight keys changed), ``untied`` (the tied embeddings
    were written separately), ``tied_in_base``, ``shards`` (file names), ``total_bytes``."""

    targets: list[str]
    untied: bool
    tied_in_base: bool
    shards: list[str]
    total_bytes: int


def model_layout(config: Any) -> ModelLayout:
    """Build ``config``'s causal LM on the ``meta`` device (no memory, no weights) and read its
    head / embedding keys, whether they are tied, its Conv1D weights and key transforms.

    Raises:
        ValueError: ``transformers`` has no causal LM for this config.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    modules = {id(m): n for n, m in model.named_modules()}
    head_mod, embed_mod = model.get_output_embeddings(), model.get_input_embeddings()
    head_w, embed_w = getattr(head_mod, "weight", None), getattr(embed_mod, "weight", None)
    head = f"{modules[id(head_mod)]}.weight" if head_w is not None else None
    embed = f"{modules[id(embed_mod)]}.weight" if embed_w is not None else None
    conv1d = {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    renamings: list[Any] = []  # transformers' WeightRenaming objects
    converters: list[Any] = []  # transformers' WeightConverter objects
    try:  # transformers >= 5: checkpoint keys may differ from the model's (renamed / fused on load)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        for t in get_model_conversion_mapping(model):
            (
                converters if isinstance(t, WeightConverter) else renamings if isinstance(t, WeightRenaming) else []
            ).append(t)
    except ImportError:
        pass
    return ModelLayout(
        head,
        embed,
        head_w is not None and head_w is embed_w,
        shapes,
        conv1d,
        renamings,
        converters,
        getattr(model, "base_model_prefix", None) or None,
    )


def base_weight_files(base_dir: Path) -> dict[str, str]:
    """``{tensor key: safetensors file name}`` of a Hugging Face folder (sharded or not).

    Raises:
        FileNotFoundError: the folder has no safetensors weights (the message says what it has).
    """
    index = base_dir / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = base_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {k: single.name for k in f.keys()}
    have = sorted(p.name for p in base_dir.iterdir())[:20] if base_dir.is_dir() else []
    raise FileNotFoundError(
        f"base model folder {base_dir} has no model.safetensors or {INDEX} (it has {have}); "
        "only safetensors weights can be merged"
    )


def _targets(adapter: LoraAdapter, layout: ModelLayout, model_keys: set[str]) -> dict[str, LoraDelta]:
    """``{model weight key: delta}``: each adapter module mapped to its weight, shapes checked."""
    known = model_keys | set(layout.shapes)
    out: dict[str, LoraDelta] = {}
    for module, d in adapter.deltas.items():
        key = f"{module}.weight"
        if key not in known and module in _HEAD_ALIASES and layout.head:
            key = layout.head
        if key not in known:
            raise AdapterError(f"adapter module {module!r} has no weight {key!r} in the base model")
        want = layout.shapes.get(key)
        rows, cols = d.b.shape[0], d.a.shape[1]
        flip = d.embedding or d.fan_in_fan_out or key in layout.conv1d
        shape = (cols, rows) if flip else (rows, cols)
        if want is not None and tuple(want) != shape:
            raise AdapterError(
                f"adapter module {module!r}: delta of shape {shape} for weight {key!r} of shape {tuple(want)}"
            )
        out[key] = d
    return out


class _ShardWriter:
    """Greedy shards of at most ``max_bytes`` (a bigger single tensor gets a shard of its own)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.buf and self.size + n > self.max_bytes:
            self.flush()
        self.buf[key] = t.contiguous()
        self.size += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        name = f"part-{len(self.files):05d}.tmp"
        save_file(self.buf, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(self.buf)))
        self.buf, self.size = {}, 0

    def finish(self) -> list[str]:
        self.flush()
        n = len(self.files)
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / tmp).rename(self.folder / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


def _tensors(base_dir: Path, files: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    for fname in sorted(by_file):
        with safe_open(str(base_dir / fname), "pt") as fh:
            for k in sorted(by_file[fname]):
                yield k, fh.get_tensor(k)


def _untie_config(config: Any) -> None:
    config.tie_word_embeddings = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        text.tie_word_embeddings = False


def merge_into_folder(
    base_dir: str | Path,
    adapter: LoraAdapter,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = 5_000_000_000,
) -> MergeReport:
    """Write the merged model of ``base_dir`` (a Hugging Face causal-LM folder with safetensors
    weights) and ``adapter`` into ``out_dir`` (created; must not hold files).

    Args:
        dtype: ``float32`` | ``bfloat16`` | ``float16``: floating-point tensors are saved in it
            (the merge itself is float32); integer tensors are kept as they are.
        max_shard_bytes: the largest shard (bytes; one bigger tensor gets a shard of its own).

    Raises:
        AdapterError: an adapter module with no matching weight, or a delta of the wrong shape.
        FileNotFoundError: no safetensors weights in ``base_dir``.
        ValueError: an unknown ``dtype``.
    """
    from transformers import AutoConfig, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    config = AutoConfig.from_pretrained(str(base_dir))
    layout = model_layout(config)
    files = base_weight_files(base_dir)
    model_keys = {fk: layout.model_key(fk) for fk in files}  # file key -> (model key, converted)
    targets = _targets(adapter, layout, {mk for mk, _ in model_keys.values()})
    for fk, (mk, converted) in model_keys.items():
        if converted and mk in targets:
            raise AdapterError(
                f"adapter target {mk!r} is stored as {fk!r} and converted on load (fused or split "
                "weights): not supported by the exact merge"
            )
    # tied implies both keys exist (model_layout): the pair holds two strings or nothing
    tied_pair = {k for k in (layout.head, layout.embed) if k is not None} if layout.tied else set()
    untie = layout.tied and bool(tied_pair & set(targets))
    present = {mk: fk for fk, (mk, _) in model_keys.items()}
    source = next((present[k] for k in (layout.embed, layout.head) if k in present), None) if untie else None
    if untie and source is None:
        raise AdapterError(f"{base_dir}: the tied embedding {layout.embed!r} is in no weight file")
    to = DTYPES[dtype]
    writer = _ShardWriter(out_dir, max_shard_bytes)
    done: set[str] = set()

    def emit(file_key: str, model_key: str, t: torch.Tensor) -> None:
        copy = adapter.base_copies.get(model_key)
        if copy is not None and not torch.equal(copy.to(t.dtype), t):
            raise AdapterError(
                f"the adapter carries its own base weight for {model_key!r}, and it differs from the "
                "base model's (a resized or retrained embedding): not supported"
            )
        if model_key in targets:
            t = t.float() + targets[model_key].delta(conv1d=model_key in layout.conv1d)
            done.add(model_key)
        writer.add(file_key, t.to(to) if t.is_floating_point() else t)

    for fk, t in _tensors(base_dir, files):
        mk = model_keys[fk][0]
        if untie and mk in tied_pair and fk != source:
            continue  # written from the tie's source below: the loaded model never used this copy
        if untie and fk == source:
            for k in sorted(tied_pair):  # both halves of the tie, each with its own delta
                emit(fk if k == mk else present.get(k, k), k, t.clone())
            continue
        emit(fk, mk, t)
    missing = set(targets) - done
    if missing:
        raise AdapterError(
            f"adapter targets {sorted(missing)} are tied or computed weights missing from {base_dir}'s files"
        )
    shards = writer.finish()
    if untie:
        _untie_config(config)
    config.dtype = to
    config.save_pretrained(str(out_dir))
    gen = base_dir / "generation_config.json"
    if gen.is_file():
        shutil.copyfile(gen, out_dir / gen.name)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    for p in sorted(base_dir.iterdir()):
        if (
            p.is_file()
            and not p.is_symlink()
            and not p.name.startswith(".")
            and p.name not in _NOT_COPIED
            and not p.name.endswith(_WEIGHT_SUFFIXES)
        ):
            shutil.copyfile(p, out_dir / p.name)
    return MergeReport(sorted(targets), untie, layout.tied, shards, writer.total)


def cast_weights(folder: str | Path, dtype: str) -> None:
    """Rewrite every ``*.safetensors`` file of ``folder`` in place with its floating-point tensors
    in ``dtype`` (each file to a temporary, then renamed over it), and the dtype recorded in its
    ``config.json`` and the index's ``total_size``.

    Raises:
        ValueError: an unknown ``dtype``.
    """
    from safetensors.torch import load_file, save_file

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    folder = Path(folder)
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        tensors = {
            k: (t.to(DTYPES[dtype]) if t.is_floating_point() else t).contiguous()
            for k, t in load_file(str(path)).items()
        }
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(path)
        del tensors
    index = folder / INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data["metadata"]["total_size"] = total
        index.write_text(json.dumps(data, indent=2) + "\n")
    config = folder / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in cfg or key == "dtype":
                cfg[key] = dtype
        config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
