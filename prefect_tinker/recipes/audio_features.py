"""DMel audio features for the local ``tiny-audio`` preset, and the TensorContainer encoding.

DMel (Bai et al. 2024, "dMel: Speech Tokenization made Simple", arXiv:2407.15835) discretises
log mel-filterbank energies per channel into a few levels.  Here: 16 kHz mono, a Hann window of
``win_length`` samples every ``hop_length`` samples (power spectrum of an ``n_fft``-point FFT),
``n_mels`` triangular filters on the HTK mel scale between ``fmin`` and ``fmax``, energies in dB
relative to the utterance's loudest cell, clipped to ``[min_db, 0]`` and quantised uniformly into
``levels`` values (0 = quietest).  The settings come from the model's ``dmel_config.json``
(``tinker_local.presets.DMEL_CONFIG``); the hosted Inkling models use their own DMel codec
inside ``tml-renderers`` (:mod:`prefect_tinker.recipes.renderers.tml`).

:func:`tensor_container` writes the SDK's TensorContainer bytes of a uint8 tensor (dtype byte 4,
varint rank, varint dims, row-major payload), the layout ``tinker.DmelChunk`` carries and whose
header ``DmelChunk.length`` reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tinker_local.presets import DMEL_CONFIG

__all__ = ["dmel_features", "mel_filterbank", "tensor_container", "DEFAULT_DMEL"]

#: The settings of ``tiny-audio`` (its ``dmel_config.json``; defined in ``tinker_local.presets``).
DEFAULT_DMEL: dict[str, Any] = DMEL_CONFIG
_UINT8 = 4


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


def _mel_to_hz(m):
    return 700.0 * (10.0 ** (np.asarray(m, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular HTK-mel filters, float64 (n_mels, n_fft // 2 + 1), peak 1."""
    freqs = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None, :] - lower) / np.maximum(center - lower, 1e-9)
    down = (upper - freqs[None, :]) / np.maximum(upper - center, 1e-9)
    return np.clip(np.minimum(up, down), 0.0, None)


def dmel_features(samples: np.ndarray, cfg: dict[str, Any] | None = None) -> np.ndarray:
    """DMel of ``samples`` (float32 (N,), at ``cfg["sample_rate"]``): uint8 (frames, n_mels) with
    values in ``[0, levels)``; frames = ``1 + (N - 1) // hop_length`` (the signal is zero-padded
    to whole windows), at least 1.

    Raises:
        ValueError: an unknown codec or bad settings.
    """
    c = {**DEFAULT_DMEL, **(cfg or {})}
    if c.get("codec", "dmel") != "dmel":
        raise ValueError(f"unknown audio codec {c.get('codec')!r} (this implementation computes 'dmel')")
    n_fft, win, hop, levels = int(c["n_fft"]), int(c["win_length"]), int(c["hop_length"]), int(c["levels"])
    if not (0 < win <= n_fft and hop > 0 and 1 < levels <= 256):
        raise ValueError(f"bad DMel settings {c}")
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    frames = 1 + max(0, x.size - 1) // hop
    padded = np.zeros((frames - 1) * hop + n_fft)
    padded[: x.size] = x[: padded.size]
    idx = np.arange(n_fft)[None, :] + hop * np.arange(frames)[:, None]
    window = np.zeros(n_fft)
    window[:win] = np.hanning(win + 1)[:-1]
    power = np.abs(np.fft.rfft(padded[idx] * window, n=n_fft, axis=-1)) ** 2
    mel = power @ mel_filterbank(int(c["sample_rate"]), n_fft, int(c["n_mels"]), float(c["fmin"]), float(c["fmax"])).T
    db = 10.0 * np.log10(np.maximum(mel, 1e-10))
    db = np.clip(db - db.max(), float(c["min_db"]), 0.0)
    q = np.floor((db - float(c["min_db"])) / -float(c["min_db"]) * levels)
    return np.clip(q, 0, levels - 1).astype(np.uint8)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tensor_container(array: np.ndarray) -> bytes:
    """TensorContainer bytes of a uint8 ``array`` (any rank)."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    return bytes([_UINT8]) + _varint(a.ndim) + b"".join(_varint(int(d)) for d in a.shape) + a.tobytes()
