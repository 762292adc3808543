"""Media model presets of the local engine, built in code (random init, no download):

- ``"tiny-vl"``: a ``transformers`` Qwen3-VL (``Qwen3VLForConditionalGeneration``): the ``tiny``
  text stack (6 layers, hidden 256, 4/2 heads, M-RoPE) and a 2-block vision tower (hidden 128,
  patch 8, 2x2 merge, one deepstack layer); ~6M parameters.  Its image processor is
  ``Qwen2VLImageProcessor`` (``preprocessor_config.json``: patch 8, merge 2, 32x32 to 128x128
  pixels after resizing to multiples of 16, so an image is 4 to 64 tokens); its tokenizer is the
  ``tiny`` BPE with ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``.
- ``"tiny-audio"``: :class:`DmelQwen3ForCausalLM`, the ``tiny`` Qwen3 plus an audio projector that
  embeds DMel frames (Bai et al. 2024, "dMel: Speech Tokenization made Simple",
  arXiv:2407.15835: log-mel filterbank energies quantised per channel) at the positions of its
  ``<|audio_pad|>`` token: frame ``f`` (80 channels, values 0..15) is one-hot encoded (80 x 16)
  and mapped by ``audio_mlp`` (Linear 1280 -> 256, GELU, Linear 256 -> 256) into the embedding
  space, i.e. a sum of learned per-(channel, level) vectors followed by a nonlinearity.  The
  feature settings the client must use are in ``dmel_config.json`` (``tinker_local.presets.DMEL_CONFIG``:
  16 kHz, 25 ms window, 20 ms hop, 80 mel bins, 16 levels over [-80, 0] dB below the utterance's
  peak); the client renderers compute them (``prefect_tinker.recipes.audio_features``) and send
  them as ``DmelChunk`` s.

Weights come from numpy's PCG64 seeded per parameter name (as ``tiny``): >=2-D parameters
``0.02 * N(0, 1)``, biases 0, other 1-D parameters (norms) 1.  Both presets are random: they
exercise the media paths end to end and learn from a few hundred steps of data, nothing more.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch

from .model_dirs import install_dir
from .presets import DMEL_CONFIG, TINY_ROPE_THETA, TINY_TEXT, TINY_TOKEN_IDS, TINY_VOCAB

TINY_VL_NAME = "tiny-vl"
TINY_AUDIO_NAME = "tiny-audio"
MEDIA_PRESETS = (TINY_VL_NAME, TINY_AUDIO_NAME)
_FORMAT = 1  # bump when a recipe changes; an old cache is rebuilt
_MARKER = "tinker_local_preset.json"

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
AUDIO_TOKENS = ["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
VISION_PROCESSOR: dict[str, Any] = {
    "patch_size": 8,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 32 * 32,
    "max_pixels": 128 * 128,
}
DMEL_MODEL_TYPE = "tinker_local_dmel_qwen3"


# ---------------------------------------------------------------------------------------------
# the audio model: Qwen3 + a DMel projector


def _audio_classes():
    """``(DmelQwen3Config, DmelQwen3ForCausalLM)``, defined and registered with the Auto classes
    on first use (transformers is imported lazily)."""
    global _AUDIO
    if _AUDIO is not None:
        return _AUDIO
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    class DmelQwen3Config(Qwen3Config):
        """Qwen3 config plus ``audio_token_id`` and the DMel shape (``dmel_bins``, ``dmel_levels``)."""

        model_type = DMEL_MODEL_TYPE

        def __init__(self, audio_token_id: int = 0, dmel_bins: int = 80, dmel_levels: int = 16, **kw):
            self.audio_token_id = audio_token_id
            self.dmel_bins = dmel_bins
            self.dmel_levels = dmel_levels
            super().__init__(**kw)

    class DmelQwen3ForCausalLM(Qwen3ForCausalLM):
        """A Qwen3 causal LM whose ``audio_token_id`` positions take embedded DMel frames.

        ``forward(..., dmel_frames=(F, bins) integer tensor)`` replaces the embeddings of the F
        audio positions of ``input_ids`` (row-major order) by ``audio_mlp(one_hot(frames))``.
        """

        config_class = DmelQwen3Config

        def __init__(self, config):
            super().__init__(config)
            width = config.dmel_bins * config.dmel_levels
            self.audio_mlp = torch.nn.Sequential(
                torch.nn.Linear(width, config.hidden_size),
                torch.nn.GELU(),
                torch.nn.Linear(config.hidden_size, config.hidden_size),
            )
            self.post_init()

        def embed_audio(self, input_ids: torch.Tensor, dmel_frames: torch.Tensor) -> torch.Tensor:
            """Input embeddings (B, T, H) with the audio positions filled from ``dmel_frames``.

            Raises ValueError when the number of audio positions differs from the frames."""
            emb = self.get_input_embeddings()(input_ids)
            mask = input_ids == self.config.audio_token_id
            if int(mask.sum()) != dmel_frames.shape[0]:
                raise ValueError(f"{int(mask.sum())} audio positions but {dmel_frames.shape[0]} DMel frames")
            hot = torch.nn.functional.one_hot(dmel_frames.long(), self.config.dmel_levels)
            feats = self.audio_mlp(hot.reshape(hot.shape[0], -1).to(emb.dtype))
            return emb.masked_scatter(mask.unsqueeze(-1), feats.to(emb.dtype))

        def forward(self, input_ids=None, dmel_frames=None, inputs_embeds=None, cache=None, **kw):
            if dmel_frames is not None and input_ids is not None:
                inputs_embeds, input_ids = self.embed_audio(input_ids, dmel_frames), None
            return super().forward(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, **kw)

    AutoConfig.register(DMEL_MODEL_TYPE, DmelQwen3Config, exist_ok=True)
    AutoModelForCausalLM.register(DmelQwen3Config, DmelQwen3ForCausalLM, exist_ok=True)
    _AUDIO = (DmelQwen3Config, DmelQwen3ForCausalLM)
    return _AUDIO


_AUDIO = None


def register_media_models() -> None:
    """Register the ``tiny-audio`` architecture with ``transformers``' Auto classes (idempotent),
    so a saved directory of it loads with ``AutoModelForCausalLM.from_pretrained``."""
    _audio_classes()


# ---------------------------------------------------------------------------------------------
# building the presets


def _tokenizer(extra: list[str]):
    from .tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(vocab_size=TINY_VOCAB, seed=0)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *extra]})
    return tok


def _text_kwargs(vocab: int) -> dict:
    return dict(vocab_size=vocab, **TINY_TEXT)


def _init_weights(model, seed: int) -> None:
    import numpy as np

    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.ndim >= 2:
                rng = np.random.default_rng([seed, zlib.crc32(pname.encode())])
                arr = rng.standard_normal(tuple(param.shape), dtype=np.float32) * np.float32(0.02)
                param.copy_(torch.from_numpy(arr))
            elif pname.endswith(".bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def build_tiny_vl(seed: int = 0):
    """``(model, tokenizer, image processor)`` of the ``tiny-vl`` preset (fp32, eval mode)."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = _tokenizer(VISION_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    vocab = (len(tok) + 63) // 64 * 64
    text = _text_kwargs(vocab)
    text.update(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": TINY_ROPE_THETA,
            "mrope_section": [8, 12, 12],
            "mrope_interleaved": True,
        },
        **TINY_TOKEN_IDS,
    )
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=dict(
            depth=2,
            hidden_size=128,
            intermediate_size=256,
            num_heads=4,
            patch_size=VISION_PROCESSOR["patch_size"],
            spatial_merge_size=VISION_PROCESSOR["merge_size"],
            temporal_patch_size=VISION_PROCESSOR["temporal_patch_size"],
            out_hidden_size=256,
            num_position_embeddings=256,
            deepstack_visual_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(cfg)
    _init_weights(model, seed)
    model.generation_config.eos_token_id = [2, 0]
    model.generation_config.pad_token_id = 0
    proc = Qwen2VLImageProcessorPil(**VISION_PROCESSOR, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return model.eval(), tok, proc


def build_tiny_audio(seed: int = 0):
    """``(model, tokenizer)`` of the ``tiny-audio`` preset (fp32, eval mode)."""
    config_cls, model_cls = _audio_classes()
    tok = _tokenizer(AUDIO_TOKENS)
    vocab = (len(tok) + 63) // 64 * 64
    cfg = config_cls(
        audio_token_id=tok.convert_tokens_to_ids("<|audio_pad|>"),
        dmel_bins=DMEL_CONFIG["n_mels"],
        dmel_levels=DMEL_CONFIG["levels"],
        rope_theta=TINY_ROPE_THETA,
        **TINY_TOKEN_IDS,
        **_text_kwargs(vocab),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    _init_weights(model, seed)
    model.generation_config.eos_token_id = [2, 0]
    model.generation_config.pad_token_id = 0
    return model.eval(), tok


def ensure_media_preset(name: str, target: Path) -> Path:
    """Make sure ``target`` holds preset ``name`` (``tiny-vl`` or ``tiny-audio``) as a complete
    Hugging Face directory (weights, config, tokenizer, ``preprocessor_config.json`` or
    ``dmel_config.json``); built atomically (temp dir + rename) when absent or outdated (~3 s)."""
    target = Path(target)
    marker = {"preset": name, "format": _FORMAT}
    try:
        if json.loads((target / _MARKER).read_text()) == marker and (target / "config.json").is_file():
            return target
    except (OSError, ValueError):
        pass
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        if name == TINY_VL_NAME:
            model, tok, proc = build_tiny_vl()
            proc.save_pretrained(str(tmp))
        elif name == TINY_AUDIO_NAME:
            model, tok = build_tiny_audio()
            (tmp / "dmel_config.json").write_text(json.dumps(DMEL_CONFIG, indent=1))
        else:
            raise ValueError(f"unknown media preset {name!r}; accepted: {', '.join(MEDIA_PRESETS)}")
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(marker))
        install_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
