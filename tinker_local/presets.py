"""The settings of the built-in random-init presets, in one torch-free place.

The tiny text stack is a Qwen3 causal LM (``transformers.Qwen3Config`` fields): 6 layers, hidden
256, MLP 768, 4 query / 2 key-value heads of 64, context 2048, untied output head, RoPE base
10,000, over the tiny byte-level BPE tokenizer (:mod:`tinker_local.tokenizer`, vocabulary at most
``TINY_VOCAB``).  ``tiny`` is that stack alone (:func:`tinker_local.models.tiny_config`);
``tiny-vl`` and ``tiny-audio`` put a vision tower or a DMel projector in front of it
(:mod:`tinker_local.media_models`).

``DMEL_CONFIG`` is what ``tiny-audio`` writes to its ``dmel_config.json``: the DMel feature
settings (Bai et al. 2024, arXiv:2407.15835) a client must compute its audio input with
(``prefect_tinker.recipes.audio_features`` reads them from here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DMEL_CONFIG", "TINY_ROPE_THETA", "TINY_TEXT", "TINY_TOKEN_IDS", "TINY_VOCAB"]

#: Vocabulary bound of the tiny tokenizer, and the tiny model's embedding rows.
TINY_VOCAB = 2048
#: The tiny Qwen3 text stack (``Qwen3Config`` keyword arguments besides the vocabulary, the
#: RoPE base and the special token ids).
TINY_TEXT: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
}
#: RoPE base frequency of the tiny text stack.
TINY_ROPE_THETA = 10000.0
#: The tiny tokenizer's special ids as model config fields: no BOS, ``<|im_end|>`` (2) ends,
#: ``<|endoftext|>`` (0) pads.
TINY_TOKEN_IDS: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}
#: The DMel feature settings of ``tiny-audio``: 16 kHz, a 25 ms Hann window (``n_fft`` points)
#: every 20 ms, 80 HTK-mel bins over 0..8 kHz, 16 levels over [-80, 0] dB below the utterance's peak.
DMEL_CONFIG: dict[str, Any] = {
    "codec": "dmel",
    "sample_rate": 16000,
    "n_fft": 400,
    "win_length": 400,
    "hop_length": 320,
    "n_mels": 80,
    "levels": 16,
    "min_db": -80.0,
    "fmin": 0.0,
    "fmax": 8000.0,
}
