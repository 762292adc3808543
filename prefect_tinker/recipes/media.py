"""Images and audio in token sequences, stored by reference.

Renderers put a media item into a sequence as a run of :class:`MediaToken` s: ints (the
model's placeholder id: ``<|image_pad|>``, ``<|audio_pad|>``, Inkling's audio token) that also
carry a :class:`MediaRef` (a content-addressed local file: PNG/JPEG bytes for an image, the
SDK's TensorContainer bytes of a DMel tensor for audio) and their index in the run.  A sequence
therefore stays a ``list[int]`` -- slicing, concatenation and prefix tests keep the media with
their positions -- and becomes a ``tinker.ModelInput`` with image / DMel chunks only when it is
sent (:func:`model_input_from_tokens`, which reads each file and checks its SHA-256).

- :func:`safe_cut`: the longest prefix that does not end inside a media run (truncation drops a
  whole media item, never part of one);
- :func:`media_spans` / :func:`restore_media`: ``(start, MediaRef)`` spans of a sequence and
  back (what a prepared dataset stores: small, picklable, no pixels);
- :func:`media_key`: a JSON-able identity of a sequence for cache keys (a plain ``json.dumps``
  of a ``MediaToken`` writes only its int);
- :func:`store_media`: the media cache (``$PREFECT_TINKER_MEDIA``, else
  ``$PREFECT_TINKER_HOME/media``, else ``~/.prefect-tinker/media``), where bytes given inline,
  fetched from a URL or converted (e.g. a GIF to PNG, audio features) are written once under
  their hash.

Sending: ``ImageChunk(data, format, expected_tokens=n)`` for images (the SDK's
``forward_backward`` accepts no asset pointers), ``ImageAssetPointerChunk(location=path)``
when ``pointer=True`` (sampling from a server that reads the same files, e.g. ``tinker_local``),
``DmelChunk(dmel)`` for audio.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import tinker
from pydantic import BaseModel, ConfigDict

__all__ = [
    "MediaError",
    "MediaRef",
    "MediaSpan",
    "MediaToken",
    "cache_file",
    "has_media",
    "media_dir",
    "media_key",
    "media_spans",
    "media_tokens",
    "model_input_from_tokens",
    "restore_media",
    "safe_cut",
    "store_media",
    "tokens_from_model_input",
]


class MediaError(ValueError):
    """A media item cannot be read, decoded or placed (the message names the file or value)."""


class MediaRef(BaseModel):
    """One media item by reference.

    Attributes:
        kind: ``"image"`` or ``"dmel"`` (audio as DMel features).
        path: absolute path of the local file holding the bytes that are sent.
        sha256: hex SHA-256 of that file (checked when the chunk is built).
        format: ``"png"`` / ``"jpeg"`` (images) or ``"dmel"`` (TensorContainer bytes).
        tokens: positions the item occupies in the model input (its ``expected_tokens``).
        width, height: pixel size of an image (None for audio).
        source: where the item came from (a path, URL or ``"<bytes>"``), for messages.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["image", "dmel"]
    path: str
    sha256: str
    format: Literal["png", "jpeg", "dmel"]
    tokens: int
    width: int | None = None
    height: int | None = None
    source: str = ""

    def read(self) -> bytes:
        """The file's bytes; MediaError when it is missing or its content changed."""
        try:
            data = Path(self.path).read_bytes()
        except OSError as exc:
            raise MediaError(
                f"media file {self.path!r} (from {self.source or self.path!r}) cannot be read: {exc.strerror or exc}"
            ) from None
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise MediaError(
                f"media file {self.path!r} changed since it was rendered (sha256 differs); prepare the dataset again"
            )
        return data

    def chunk(self, *, pointer: bool = False) -> Any:
        """The SDK chunk of this item (see the module docstring)."""
        if self.kind == "dmel":
            return tinker.types.DmelChunk(dmel=self.read())
        if pointer:
            return tinker.types.ImageAssetPointerChunk(
                location=self.path, format=self.format, expected_tokens=self.tokens
            )
        return tinker.types.ImageChunk(data=self.read(), format=self.format, expected_tokens=self.tokens)


class MediaSpan(BaseModel):
    """``ref`` occupies positions ``[start, start + ref.tokens)`` of a stored sequence."""

    model_config = ConfigDict(frozen=True)

    start: int
    ref: MediaRef


class MediaToken(int):
    """A position of a media run: an int (the placeholder token id) that carries ``ref`` (the
    :class:`MediaRef`) and ``index`` (0 .. ref.tokens - 1).  Equal to another MediaToken of the
    same value, item and index; never equal to a plain int (so a prefix test cannot mistake one
    image for another)."""

    ref: MediaRef
    index: int

    def __new__(cls, value: int, ref: MediaRef, index: int) -> MediaToken:
        obj = super().__new__(cls, value)
        obj.ref, obj.index = ref, int(index)
        return obj

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MediaToken):
            return int(self) == int(other) and self.index == other.index and self.ref == other.ref
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((int(self), self.index, self.ref.sha256))

    def __reduce__(self):
        return (MediaToken, (int(self), self.ref, self.index))

    def __repr__(self) -> str:
        return f"<{self.ref.kind} {self.index + 1}/{self.ref.tokens}:{int(self)}>"


def media_tokens(ref: MediaRef, placeholder: int) -> list[MediaToken]:
    """The run of ``ref.tokens`` MediaTokens of ``ref`` with value ``placeholder``."""
    return [MediaToken(placeholder, ref, k) for k in range(ref.tokens)]


def has_media(tokens: Sequence[int]) -> bool:
    """Whether any position of ``tokens`` is a MediaToken."""
    return any(isinstance(t, MediaToken) for t in tokens)


def _runs(tokens: Sequence[int]) -> Iterator[tuple[int, int, MediaToken, bool]]:
    """``(start, end, first MediaToken, complete)`` of each media run, in order."""
    i, n = 0, len(tokens)
    while i < n:
        t = tokens[i]
        if not isinstance(t, MediaToken):
            i += 1
            continue
        start, ref, k = i, t.ref, t.index
        while i < n:
            u = tokens[i]
            if not (isinstance(u, MediaToken) and u.ref == ref and u.index == k):
                break
            i, k = i + 1, k + 1
            if k == ref.tokens:
                break
        yield start, i, t, (t.index == 0 and k == ref.tokens)


def safe_cut(tokens: Sequence[int], n: int) -> int:
    """The largest ``m <= n`` such that ``tokens[:m]`` ends outside every media run (cutting a
    run drops it whole)."""
    n = max(0, min(n, len(tokens)))
    for start, end, _, _ in _runs(tokens):
        if start < n < end:
            return start
    return n


def media_spans(tokens: Sequence[int]) -> list[MediaSpan]:
    """The media items of ``tokens`` as spans.  MediaError for a partial run."""
    out = []
    for start, _, first, complete in _runs(tokens):
        ref = first.ref
        if not complete:
            raise MediaError(
                f"tokens hold a partial {ref.kind} run at position {start} (from {ref.source!r}); "
                "cut sequences with safe_cut"
            )
        out.append(MediaSpan(start=start, ref=ref))
    return out


def restore_media(tokens: Sequence[int], spans: Sequence[MediaSpan]) -> list[int]:
    """``tokens`` (plain ints, placeholders at media positions) with the positions of ``spans``
    turned back into MediaTokens.  MediaError when a span runs past the end."""
    out = [int(t) for t in tokens]
    for span in spans:
        end = span.start + span.ref.tokens
        if span.start < 0 or end > len(out):
            raise MediaError(f"media span [{span.start}, {end}) lies outside a sequence of {len(out)} tokens")
        for k in range(span.ref.tokens):
            out[span.start + k] = MediaToken(out[span.start + k], span.ref, k)
    return out


def model_input_from_tokens(tokens: Sequence[int], *, pointer: bool = False) -> tinker.ModelInput:
    """A ``tinker.ModelInput`` of ``tokens``: text runs as ``EncodedTextChunk`` s, each media run
    as its chunk (``pointer``: images as ``ImageAssetPointerChunk`` s).  MediaError for a
    partial media run or a missing / changed media file."""
    chunks: list[Any] = []
    text: list[int] = []
    pos = 0
    for start, end, first, complete in _runs(tokens):
        ref = first.ref
        if not complete:
            raise MediaError(f"tokens hold a partial {ref.kind} run at position {start} (from {ref.source!r})")
        text.extend(int(t) for t in tokens[pos:start])
        if text:
            chunks.append(tinker.types.EncodedTextChunk(tokens=text))
            text = []
        chunks.append(ref.chunk(pointer=pointer))
        pos = end
    text.extend(int(t) for t in tokens[pos:])
    if text:
        chunks.append(tinker.types.EncodedTextChunk(tokens=text))
    return tinker.ModelInput(chunks=chunks)


def tokens_from_model_input(model_input: tinker.ModelInput, placeholder: int = 0) -> list[int]:
    """The positions of ``model_input`` as a token list: text tokens as they are, image and DMel
    chunks as MediaToken runs of ``placeholder`` whose refs point at files in the media cache
    (:func:`store_media`).  MediaError for an image chunk without ``expected_tokens``."""
    out: list[int] = []
    for chunk in model_input.chunks:
        if isinstance(chunk, tinker.types.EncodedTextChunk):
            out.extend(int(t) for t in chunk.tokens)
            continue
        if isinstance(chunk, tinker.types.DmelChunk):
            ref = store_media(chunk.dmel, "dmel", "dmel", tokens=chunk.length, source="<dmel chunk>")
        elif isinstance(chunk, (tinker.types.ImageChunk, tinker.types.ImageAssetPointerChunk)):
            if chunk.expected_tokens is None:
                raise MediaError("an image chunk without expected_tokens has no known length")
            data = chunk.data if isinstance(chunk, tinker.types.ImageChunk) else Path(chunk.location).read_bytes()
            ref = store_media(data, "image", chunk.format, tokens=chunk.expected_tokens, source="<image chunk>")
        else:
            raise MediaError(f"unsupported model input chunk {type(chunk).__name__}")
        out.extend(media_tokens(ref, placeholder))
    return out


def media_key(tokens: Sequence[int]) -> list:
    """A JSON-able identity of ``tokens`` that tells media apart (each media run becomes
    ``["media", sha256, tokens]``), for cache keys."""
    out: list = []
    pos = 0
    for start, end, first, _ in _runs(tokens):
        out.extend(int(t) for t in tokens[pos:start])
        out.append(["media", first.ref.sha256, end - start, first.index])
        pos = end
    out.extend(int(t) for t in tokens[pos:])
    return out


def media_dir() -> Path:
    """The media cache folder (see the module docstring); created."""
    env = os.environ.get("PREFECT_TINKER_MEDIA")
    if env:
        d = Path(env)
    else:
        home = os.environ.get("PREFECT_TINKER_HOME") or os.path.join(os.path.expanduser("~"), ".prefect-tinker")
        d = Path(home) / "media"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_file(data: bytes, suffix: str) -> Path:
    """``data`` written once into the media cache as ``<sha256>.<suffix>`` (atomic rename); its path."""
    path = media_dir() / f"{hashlib.sha256(data).hexdigest()}.{suffix}"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def store_media(
    data: bytes,
    kind: str,
    fmt: str,
    *,
    tokens: int,
    source: str = "",
    width: int | None = None,
    height: int | None = None,
) -> MediaRef:
    """Write ``data`` into the media cache under its SHA-256 (:func:`cache_file`) and return its
    :class:`MediaRef`."""
    digest = hashlib.sha256(data).hexdigest()
    path = cache_file(data, fmt)
    return MediaRef(
        kind=kind,
        path=str(path),
        sha256=digest,
        format=fmt,
        tokens=int(tokens),
        width=width,
        height=height,
        source=source or "<bytes>",
    )
