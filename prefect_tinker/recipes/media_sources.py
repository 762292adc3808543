"""Dataset formats with media: image classification and speech transcription.

============================  =============================================  ========================================
format                        records (fields; first present wins)            messages
============================  =============================================  ========================================
``image_folder``              a directory ``root/<label>/*.png|jpg|...``      as ``image_classification``
                              (read by :func:`iter_image_folder`)
``image_classification``      ``image``|``img``|``path`` (path, URL, bytes,   user: [image, ``prompt``];
                              PIL image), ``label``|``class``|``category``    assistant: ``"{answer_prefix} {label}"``
                              (str, or int with a Hugging Face ``ClassLabel``)
``audio_transcript``          ``audio``|``path``|``file`` (WAV path),         user: [audio, ``prompt``];
                              ``text``|``transcript``|``sentence``            assistant: the transcript
============================  =============================================  ========================================

The classification prompt is the Tinker cookbook's VLM classifier shape: ``"What is the name of
the subject in this photo?"`` / ``"The subject in this photo is: <label>"``, labels cleaned as
there (``_``, ``.``, ``-`` become spaces, lower case; option ``clean_labels=false`` keeps them).
Options (:class:`ClassificationOptions`, :class:`TranscriptOptions`): ``prompt``, ``answer_prefix``,
``clean_labels``, ``eval_limit``, ``system_prompt``.  Relative media
paths are resolved against the folder of the dataset file (:func:`absolutize_media`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from prefect_tinker.recipes.format_options import DataFormat, FormatOptions
from prefect_tinker.recipes.record_fields import Converted, RecordError, get_field

__all__ = [
    "CLASSIFICATION_FORMATS",
    "IMAGE_SUFFIXES",
    "MEDIA_FORMATS",
    "ClassificationOptions",
    "TranscriptOptions",
    "absolutize_media",
    "clean_label",
    "iter_image_folder",
    "CLASSIFIER_PROMPT",
    "CLASSIFIER_ANSWER_PREFIX",
    "TRANSCRIBE_PROMPT",
]

CLASSIFIER_PROMPT = "What is the name of the subject in this photo?"
CLASSIFIER_ANSWER_PREFIX = "The subject in this photo is:"
TRANSCRIBE_PROMPT = "Transcribe the audio."
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
#: Formats whose assistant replies are ``"{answer_prefix} {label}"`` (the accuracy evaluator reads them).
CLASSIFICATION_FORMATS = ("image_folder", "image_classification")


def clean_label(label: str) -> str:
    """A class name as the cookbook's classifier writes it: ``_ . -`` -> spaces, lower case, stripped."""
    return label.replace("_", " ").replace(".", " ").replace("-", " ").lower().strip()


def _first(
    record: Mapping[str, Any], fields: Mapping[str, str], name: str, defaults: tuple[str, ...]
) -> tuple[str, Any]:
    path = fields.get(name) or next((d for d in defaults if d in record), None)
    if path is None:
        have = ", ".join(map(str, record)) or "no fields"
        raise RecordError(defaults[0], f"is missing (record has: {have})")
    value = get_field(record, path)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RecordError(path, "is empty")
    return path, value


class ClassificationOptions(FormatOptions):
    """Options of ``image_classification`` and ``image_folder``."""

    prompt: str = Field(default=CLASSIFIER_PROMPT, description="The user's text after the image.")
    answer_prefix: str = Field(
        default=CLASSIFIER_ANSWER_PREFIX, description="The reply is '<answer_prefix> <label>' (and is scored so)."
    )
    clean_labels: bool = Field(default=True, description="Labels with _ . - as spaces, lower case (the cookbook's).")
    eval_limit: int = Field(default=100, ge=1, description="Test examples the classifier accuracy is measured on.")


class TranscriptOptions(FormatOptions):
    """Options of ``audio_transcript``."""

    prompt: str = Field(default=TRANSCRIBE_PROMPT, description="The user's text after the audio.")
    eval_limit: int = Field(default=100, ge=1, description="Test examples the word error rate is measured on.")


def _classification(record: Any, fields: Mapping[str, str], options: ClassificationOptions) -> list[Converted]:
    ipath, image = _first(record, fields, "image", ("image", "img", "path"))
    lpath, label = _first(record, fields, "label", ("label", "class", "category"))
    if isinstance(image, Mapping):  # a Hugging Face Image feature read without decoding
        image = image.get("bytes") or image.get("path")
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise RecordError(lpath, f"must be a string or an integer class id, got {type(label).__name__}")
    label = str(label)
    if options.clean_labels:
        label = clean_label(label)
    messages: list[dict[str, Any]] = []
    if options.system_prompt:
        messages.append({"role": "system", "content": options.system_prompt})
    messages += [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": options.prompt},
            ],
        },
        {"role": "assistant", "content": f"{options.answer_prefix} {label}"},
    ]
    return [Converted(messages, ipath, frozenset({ipath.split(".")[0], lpath.split(".")[0]}))]


def _transcript(record: Any, fields: Mapping[str, str], options: TranscriptOptions) -> list[Converted]:
    apath, audio = _first(record, fields, "audio", ("audio", "path", "file"))
    tpath, text = _first(record, fields, "text", ("text", "transcript", "sentence"))
    if isinstance(audio, Mapping):
        audio = audio.get("bytes") or audio.get("path")
    if not isinstance(text, str):
        raise RecordError(tpath, f"must be a string, got {type(text).__name__}")
    messages: list[dict[str, Any]] = []
    if options.system_prompt:
        messages.append({"role": "system", "content": options.system_prompt})
    messages += [
        {
            "role": "user",
            "content": [
                {"type": "audio", "audio": audio},
                {"type": "text", "text": options.prompt},
            ],
        },
        {"role": "assistant", "content": text.strip()},
    ]
    return [Converted(messages, apath, frozenset({apath.split(".")[0], tpath.split(".")[0]}))]


#: this module's formats (registered by :mod:`prefect_tinker.recipes.data_sources`)
MEDIA_FORMATS = {
    "image_classification": DataFormat(_classification, ClassificationOptions),
    "image_folder": DataFormat(_classification, ClassificationOptions),
    "audio_transcript": DataFormat(_transcript, TranscriptOptions),
}


def iter_image_folder(root: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``(where, {"image": absolute path, "label": class folder name})`` for every image file
    under ``root/<label>/`` (sorted by label, then file name; hidden files skipped).

    Raises:
        FileNotFoundError: ``root`` is not a directory or holds no class folder with images.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root.absolute()}")
    n = 0
    for cls in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for f in sorted(cls.rglob("*")):
            if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith("."):
                n += 1
                yield str(f), {"image": str(f.resolve()), "label": cls.name}
    if n == 0:
        raise FileNotFoundError(
            f"image folder {root.absolute()} has no <label>/<image> files ({', '.join(IMAGE_SUFFIXES)})"
        )


def absolutize_media(messages: list[dict[str, Any]], base: Path | None) -> list[dict[str, Any]]:
    """``messages`` with relative image/audio paths in content parts made absolute against ``base``."""
    if base is None:
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, Mapping) and p.get("type") in ("image", "audio"):
                    key = p["type"]
                    v = p.get(key)
                    if isinstance(v, str) and "://" not in v and not v.startswith(("data:", "/", "~")):
                        p = {**p, key: str((base / v).resolve())}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out
