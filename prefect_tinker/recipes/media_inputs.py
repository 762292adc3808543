"""Reading the media that message content parts point at: images and WAV audio.

:func:`load_image` takes what a content part may hold -- a local path, a ``file://``, ``data:``
or ``http(s)://`` URL, raw bytes, or a PIL image -- and returns PNG/JPEG bytes with the pixel
size (other formats, and PIL images, are re-encoded as PNG).  Remote URLs are fetched once (at
most :data:`MAX_FETCH_BYTES`, 30 s timeout) into the media cache; pass ``allow_urls=False``
where dataset text must not make the process fetch anything.  :func:`load_wav` reads PCM WAV
files with the standard library and resamples them (band-limited FFT resampling).
"""

from __future__ import annotations

import base64
import hashlib
import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from prefect_tinker.recipes.media import MediaError, media_dir

__all__ = ["ImageData", "MAX_FETCH_BYTES", "load_image", "load_wav", "resample"]

MAX_FETCH_BYTES = 32 << 20


@dataclass(frozen=True)
class ImageData:
    """An image as it is sent: ``data`` (PNG or JPEG bytes), ``format`` (``png``/``jpeg``),
    pixel ``width`` and ``height``, ``path`` (a local file holding exactly ``data``, or None) and
    ``source`` (what the part said, shortened)."""

    data: bytes
    format: str
    width: int
    height: int
    path: str | None
    source: str


def _fetch(url: str) -> bytes:
    """``url``'s body through the media cache (keyed by the URL's hash)."""
    import urllib.request

    cached = media_dir() / f"url-{hashlib.sha256(url.encode()).hexdigest()}"
    if cached.is_file():
        return cached.read_bytes()
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - http(s) only, checked by the caller
            data = resp.read(MAX_FETCH_BYTES + 1)
    except OSError as exc:
        raise MediaError(f"image URL {url!r} cannot be fetched: {exc}") from None
    if len(data) > MAX_FETCH_BYTES:
        raise MediaError(f"image URL {url!r} is larger than {MAX_FETCH_BYTES >> 20} MiB")
    cached.write_bytes(data)
    return data


def _raw(value: Any, allow_urls: bool) -> tuple[bytes, str | None, str]:
    """``(bytes, local path or None, source label)`` of an image value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value), None, "<bytes>"
    if not isinstance(value, str) or not value:
        raise MediaError(f"an image must be a path, URL, bytes or PIL image, got {type(value).__name__}")
    label = value if len(value) <= 80 else value[:77] + "..."
    parsed = urlparse(value)
    if parsed.scheme == "data":
        head, _, payload = value.partition(",")
        if not head.endswith(";base64"):
            raise MediaError(f"image data URL must be base64 (data:<mime>;base64,...), got {label!r}")
        try:
            return base64.b64decode(payload, validate=True), None, "<data URL>"
        except ValueError as exc:
            raise MediaError(f"image data URL is not valid base64: {exc}") from None
    if parsed.scheme in ("http", "https"):
        if not allow_urls:
            raise MediaError(f"image URL {label!r} refused (fetching URLs is off here)")
        return _fetch(value), None, label
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme and len(parsed.scheme) > 1:
        raise MediaError(f"image location {label!r}: unsupported URL scheme {parsed.scheme!r}")
    else:
        path = Path(value).expanduser()
    try:
        return path.read_bytes(), str(path.resolve()), label
    except OSError as exc:
        raise MediaError(f"image file {str(path)!r} cannot be read: {exc.strerror or exc}") from None


def load_image(value: Any, *, allow_urls: bool = True) -> ImageData:
    """The image a content part names (see the module docstring).

    Raises:
        MediaError: unreadable file, bad URL or data URL, data that is not an image.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        img, data, path, source = value, None, None, "<PIL image>"
    else:
        data, path, source = _raw(value, allow_urls)
        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise MediaError(f"image {source!r} cannot be decoded: {exc}") from None
    fmt = (getattr(img, "format", None) or "").lower()
    if data is None or fmt not in ("png", "jpeg"):
        buf = io.BytesIO()
        img.convert("RGBA" if img.mode in ("RGBA", "LA", "P") else "RGB").save(buf, format="PNG")
        data, fmt, path = buf.getvalue(), "png", None
    return ImageData(data=data, format=fmt, width=int(img.width), height=int(img.height), path=path, source=source)


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``x`` (float32 (N,)) from ``rate`` to ``target`` Hz by band-limited FFT resampling
    (truncating or zero-padding the spectrum, as ``scipy.signal.resample``)."""
    if rate == target or x.size == 0:
        return x.astype(np.float32, copy=False)
    n_out = max(1, int(round(x.size * target / rate)))
    spec = np.fft.rfft(x.astype(np.float64))
    keep = min(spec.size, n_out // 2 + 1)
    out = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    out[:keep] = spec[:keep]
    return (np.fft.irfft(out, n=n_out) * (n_out / x.size)).astype(np.float32)


def load_wav(value: Any, target_rate: int | None = None) -> tuple[np.ndarray, int, str]:
    """``(samples float32 (N,) in [-1, 1], sample rate, source label)`` of a PCM WAV file (a
    path, ``file://`` URL or bytes; 8/16/24/32-bit integer samples, channels averaged),
    resampled to ``target_rate`` when given.

    Raises:
        MediaError: missing file, not a PCM WAV, empty.
    """
    if isinstance(value, (bytes, bytearray)):
        raw, label = bytes(value), "<bytes>"
    elif isinstance(value, str) and value:
        parsed = urlparse(value)
        path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(value).expanduser()
        label = value if len(value) <= 80 else value[:77] + "..."
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise MediaError(f"audio file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    else:
        raise MediaError(f"audio must be a WAV path or bytes, got {type(value).__name__}")
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, channels, rate, n = w.getsampwidth(), w.getnchannels(), w.getframerate(), w.getnframes()
            frames = w.readframes(n)
    except (wave.Error, EOFError) as exc:
        raise MediaError(f"audio {label!r} is not a PCM WAV file: {exc}") from None
    if n == 0:
        raise MediaError(f"audio {label!r} is empty")
    if width == 1:
        x = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        x = np.frombuffer(frames, dtype=np.int16 if width == 2 else np.int32).astype(np.float32) / float(
            2 ** (8 * width - 1)
        )
    elif width == 3:
        b = np.frombuffer(frames, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    else:
        raise MediaError(f"audio {label!r}: unsupported sample width {width} bytes")
    x = x.reshape(-1, channels).mean(axis=1)
    if target_rate is not None and target_rate != rate:
        x, rate = resample(x, rate, target_rate), target_rate
    return x, rate, label
