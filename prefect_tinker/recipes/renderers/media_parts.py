"""Message content parts (text, image, audio) and how our own renderers place media.

A message's ``content`` may be a list of parts::

    [{"type": "image", "image": "cat.png"},            # path, file:// / data: / http(s) URL, bytes, PIL image
     {"type": "text", "text": "What is this?"},
     {"type": "audio", "audio": "clip.wav"}]            # a PCM WAV file (path or bytes)

(``{"type": "image_url", "image_url": {"url": ...}}`` is accepted as an image part.)
:func:`check_content` validates them: a list of text parts only becomes one string (their
concatenation); a list with media becomes :class:`MediaContent`.  Assistant messages take text
only.

:class:`MediaEncoder` turns media parts into token runs for a tokenizer of our local families
(ChatML / Qwen): an image becomes ``<|vision_start|>`` + n image positions + ``<|vision_end|>``
as in Qwen2-VL / Qwen3-VL, with n from the model's ``preprocessor_config.json`` by
:func:`qwen_vl_image_tokens` (the ``smart_resize`` rule of the Qwen2-VL image processor in
``transformers``: sides rounded to multiples of ``patch_size * merge_size``, area kept within
``[min_pixels, max_pixels]``, then ``(h / patch) * (w / patch) / merge**2`` tokens); audio
becomes ``<|audio_start|>`` + one position per DMel frame + ``<|audio_end|>``, with the
features of the model's ``dmel_config.json`` (:mod:`prefect_tinker.recipes.audio_features`).
Both read the files next to the tokenizer (``tokenizer.name_or_path``: the local model
directory of the presets and of local Hugging Face models).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect_tinker.recipes.media import MediaError, MediaRef, media_tokens, store_media

__all__ = [
    "MediaContent",
    "MediaEncoder",
    "MediaRun",
    "PartProblem",
    "check_content",
    "content_text",
    "qwen_vl_image_tokens",
]


class PartProblem(ValueError):
    """A bad content part: ``field`` (relative, e.g. ``"[1].image"``) and ``problem``."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


class MediaContent(list):
    """Validated content parts of one message holding media: dicts ``{"type": "text", "text"}``,
    ``{"type": "image", "image"}``, ``{"type": "audio", "audio"}``."""


class MediaRun(list):
    """An encoded media item inside a renderer's pieces: its token run (markers + MediaTokens)."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_content(content: list, role: str) -> str | MediaContent:
    """Validate a list of content parts (see the module docstring).

    Raises:
        PartProblem: e.g. field ``"[1].image"``, problem ``"must be a path, URL, bytes or PIL image"``.
    """
    parts: list[dict] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise PartProblem(f"[{j}]", f"must be an object with a type (text, image, audio), got {_short(part)}")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise PartProblem(f"[{j}].text", f"must be a string, got {_short(part.get('text'))}")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url"):
            value = part.get("image", part.get("image_url"))
            if isinstance(value, Mapping):
                value = value.get("url")
            if not ((isinstance(value, (str, bytes, bytearray)) and value) or hasattr(value, "save")):
                raise PartProblem(f"[{j}].image", f"must be a path, URL, bytes or PIL image, got {_short(value)}")
            parts.append({"type": "image", "image": value})
        elif kind in ("audio", "input_audio"):
            value = part.get("audio")
            if not (isinstance(value, (str, bytes, bytearray)) and value):
                raise PartProblem(f"[{j}].audio", f"must be a WAV file path or bytes, got {_short(value)}")
            parts.append({"type": "audio", "audio": value})
        else:
            raise PartProblem(f"[{j}].type", f"unknown content part type {kind!r} (text, image, audio)")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    if role == "assistant":
        raise PartProblem("", "assistant messages take text only (no image or audio parts)")
    return MediaContent(parts)


def content_text(content: Any) -> str:
    """The text of a message content (the text parts of :class:`MediaContent` joined)."""
    if isinstance(content, MediaContent):
        return "".join(p["text"] for p in content if p["type"] == "text")
    return content if isinstance(content, str) else ""


def qwen_vl_image_tokens(
    width: int, height: int, *, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> int:
    """Tokens of a ``width`` x ``height`` image for a Qwen2-VL-family processor (see the module
    docstring).  Raises MediaError for an aspect ratio above 200 (the processor refuses it)."""
    factor = patch_size * merge_size
    if max(height, width) / max(1, min(height, width)) > 200:
        raise MediaError(f"image {width}x{height}: aspect ratio above 200 is refused by the image processor")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h_bar // patch_size) * (w_bar // patch_size) // merge_size**2


class MediaEncoder:
    """Media parts -> token runs for one tokenizer (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer whose ``name_or_path`` is a local model directory.
        encode_special: ``text -> ids`` of markup (the renderer's :meth:`encode`).
        allow_urls: fetch ``http(s)`` image URLs (off: such parts are an error).
    """

    def __init__(self, tokenizer: Any, encode_special, *, allow_urls: bool = True):
        self.tokenizer, self.encode_special, self.allow_urls = tokenizer, encode_special, allow_urls
        self._dir = Path(str(getattr(tokenizer, "name_or_path", "") or "."))
        self._vision: dict | None = None
        self._audio: dict | None = None

    def _ids(self, names: list[str], what: str) -> list[int]:
        ids = []
        for name in names:
            tok = self.encode_special(name)
            if len(tok) != 1:
                raise MediaError(
                    f"tokenizer {str(self._dir)!r} has no {name} token: it takes no {what} "
                    "(use a vision/audio model, e.g. the tiny-vl / tiny-audio presets)"
                )
            ids.append(tok[0])
        return ids

    def _json(self, name: str, what: str) -> dict:
        try:
            return json.loads((self._dir / name).read_text())
        except (OSError, ValueError) as exc:
            raise MediaError(
                f"{what}: no readable {name} next to the tokenizer in {str(self._dir)!r} ({exc})"
            ) from None

    def vision(self) -> dict:
        """``{"start", "end", "pad"}`` ids and the processor's ``patch_size``, ``merge_size``,
        ``min_pixels``, ``max_pixels``."""
        if self._vision is None:
            start, end, pad = self._ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"], "images")
            cfg = self._json("preprocessor_config.json", "images")
            size = cfg.get("size") or {}
            self._vision = {
                "start": start,
                "end": end,
                "pad": pad,
                "patch_size": int(cfg.get("patch_size", 14)),
                "merge_size": int(cfg.get("merge_size", 2)),
                "min_pixels": int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                "max_pixels": int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            }
        return self._vision

    def audio(self) -> dict:
        """``{"start", "end", "pad"}`` ids and the DMel settings (``dmel_config.json``)."""
        if self._audio is None:
            start, end, pad = self._ids(["<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"], "audio")
            self._audio = {"start": start, "end": end, "pad": pad, "dmel": self._json("dmel_config.json", "audio")}
        return self._audio

    def image_ref(self, value: Any) -> MediaRef:
        """The :class:`MediaRef` of an image part's value for this model."""
        from prefect_tinker.recipes.media_inputs import load_image

        v = self.vision()
        img = load_image(value, allow_urls=self.allow_urls)
        n = qwen_vl_image_tokens(
            img.width,
            img.height,
            patch_size=v["patch_size"],
            merge_size=v["merge_size"],
            min_pixels=v["min_pixels"],
            max_pixels=v["max_pixels"],
        )
        if img.path is not None:  # an existing PNG/JPEG file: referenced in place
            import hashlib

            return MediaRef(
                kind="image",
                path=img.path,
                sha256=hashlib.sha256(img.data).hexdigest(),
                format=img.format,
                tokens=n,
                width=img.width,
                height=img.height,
                source=img.source,
            )
        return store_media(
            img.data, "image", img.format, tokens=n, width=img.width, height=img.height, source=img.source
        )

    def audio_ref(self, value: Any) -> MediaRef:
        """The :class:`MediaRef` of an audio part's DMel features for this model."""
        from prefect_tinker.recipes.audio_features import dmel_features, tensor_container
        from prefect_tinker.recipes.media_inputs import load_wav

        cfg = self.audio()["dmel"]
        samples, _, label = load_wav(value, int(cfg.get("sample_rate", 16000)))
        feats = dmel_features(samples, cfg)
        return store_media(tensor_container(feats), "dmel", "dmel", tokens=feats.shape[0], source=label)

    def run(self, part: Mapping[str, Any]) -> MediaRun:
        """The token run of one image or audio part."""
        if part["type"] == "image":
            v = self.vision()
            return MediaRun([v["start"], *media_tokens(self.image_ref(part["image"]), v["pad"]), v["end"]])
        a = self.audio()
        return MediaRun([a["start"], *media_tokens(self.audio_ref(part["audio"]), a["pad"]), a["end"]])
