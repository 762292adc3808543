"""Images and audio in model inputs: decoding media chunks and feeding them to the model.

A model input may hold, besides token runs, ``image`` chunks (PNG/JPEG bytes),
``image_asset_pointer`` chunks (a local PNG/JPEG file; sampling and direct engine calls: the
SDK's ``forward_backward`` cannot send them) and ``dmel`` chunks (a uint8 DMel tensor (frames,
mel bins) in the SDK's TensorContainer encoding).  :func:`media_support` tells what a base
model takes:

- vision-language models of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: a config with
  ``vision_config`` and ``image_token_id``, and an image processor in the model directory): an
  image becomes ``grid_t * grid_h * grid_w / merge_size**2`` positions holding the model's image
  token (the processor's own resize decides the grid; ``expected_tokens``, when the client sent
  it, must equal that count, else the request fails as a user error);
- ``tiny-audio`` style models (``DmelQwen3ForCausalLM``): a DMel chunk becomes one position per
  frame holding the audio token; its bins must match the model's and values stay below its
  levels.

Text chunks may not contain the image/video/audio placeholder ids themselves (they would
desynchronise features and positions).  Chunks are resolved into ``(token ids, payloads)``;
:func:`media_kwargs` batches payloads of a right-padded batch for a forward pass and
:func:`media_logits` runs it with the output head in fp32.  Source of the layout: the Qwen2-VL /
Qwen3-VL processors and models in ``transformers`` (image pad tokens replaced by vision
features, M-RoPE positions from ``get_rope_index``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
import torch

from .datatypes import MediaChunk
from .errors import EngineUserError

_CONSTANT = 254  # TensorContainer marker of a constant tensor
_UINT8 = 4  # TensorContainer dtype byte of uint8 (the DMel tensors of tml-renderers and ours)
MAX_MEDIA_BYTES = 64 << 20


@dataclass
class Support:
    """What a base model takes besides text: ``kind`` "vision" or "audio", the placeholder token
    ids, and the image processor (vision) or DMel shape (audio)."""

    kind: str
    placeholder: int
    reserved: frozenset[int]
    processor: Any = None
    merge: int = 1
    bins: int = 0
    levels: int = 0


def media_support(model, model_dir: str | None) -> Support | None:
    """The media a base model accepts (None: text only).  The image processor is loaded from
    ``model_dir`` (``preprocessor_config.json``) on first use of a vision model."""
    cfg = model.config
    if getattr(cfg, "model_type", None) == "tinker_local_dmel_qwen3":
        return Support(
            "audio",
            int(cfg.audio_token_id),
            frozenset({int(cfg.audio_token_id)}),
            bins=int(cfg.dmel_bins),
            levels=int(cfg.dmel_levels),
        )
    image_id = getattr(cfg, "image_token_id", None)
    if getattr(cfg, "vision_config", None) is None or image_id is None:
        return None
    reserved = {int(image_id)} | {int(v) for v in [getattr(cfg, "video_token_id", None)] if v is not None}
    merge = int(getattr(cfg.vision_config, "spatial_merge_size", 2))
    processor = None
    if model_dir is not None:
        try:
            from transformers import AutoImageProcessor

            processor = AutoImageProcessor.from_pretrained(model_dir)
        except (OSError, ValueError) as e:  # no preprocessor_config.json: images are refused
            processor = e
    return Support("vision", int(image_id), frozenset(reserved), processor=processor, merge=merge)


def _read_location(location: str, what: str) -> bytes:
    parsed = urlparse(location)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "" or (len(parsed.scheme) == 1 and location[1:3] in (":\\", ":/")):
        path = Path(location).expanduser()
    else:
        raise EngineUserError(
            f"{what}: location {location!r} is not a local file (tinker_local reads local "
            "paths and file:// URIs only; send remote images as ImageChunk bytes)"
        )
    try:
        if path.stat().st_size > MAX_MEDIA_BYTES:
            raise EngineUserError(f"{what}: {str(path)!r} is larger than {MAX_MEDIA_BYTES >> 20} MiB")
        return path.read_bytes()
    except OSError as e:
        raise EngineUserError(f"{what}: cannot read {str(path)!r}: {e.strerror or e}") from None


def decode_image(data: bytes, fmt: str | None, what: str):
    """A PIL RGB image from PNG/JPEG ``data`` whose content matches ``fmt``; EngineUserError otherwise."""
    from PIL import Image, UnidentifiedImageError

    if fmt not in ("png", "jpeg"):
        raise EngineUserError(f"{what}: format must be 'png' or 'jpeg', got {fmt!r}")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise EngineUserError(f"{what}: the data is not a readable {fmt} image ({e})") from None
    actual = (img.format or "").lower()
    if actual != fmt:
        raise EngineUserError(f"{what}: declared format {fmt!r} but the data is {actual or 'unknown'!r}")
    return img.convert("RGB")


def decode_tensor_container(data: bytes, what: str) -> np.ndarray:
    """A uint8 array from TensorContainer bytes (dtype byte, varint rank, varint dims, raw
    row-major payload; a leading 254 marks a constant tensor holding one value)."""
    if not data:
        raise EngineUserError(f"{what}: empty DMel data")
    pos, constant = 0, data[0] == _CONSTANT
    pos += constant
    if pos >= len(data) or data[pos] != _UINT8:
        got = data[pos] if pos < len(data) else None
        raise EngineUserError(f"{what}: DMel TensorContainer dtype byte {got!r} is not uint8 ({_UINT8})")
    pos += 1

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise EngineUserError(f"{what}: truncated DMel TensorContainer header")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    rank = varint()
    if rank != 2:
        raise EngineUserError(f"{what}: DMel tensor must be 2-D (frames, mel bins), got rank {rank}")
    shape = (varint(), varint())
    n = int(np.prod(shape))
    payload = np.frombuffer(data, dtype=np.uint8, offset=pos)
    if constant:
        if payload.size < 1:
            raise EngineUserError(f"{what}: constant DMel tensor without a value")
        return np.full(shape, payload[0], dtype=np.uint8)
    if payload.size != n:
        raise EngineUserError(f"{what}: DMel payload has {payload.size} bytes, expected {n} for shape {shape}")
    return payload.reshape(shape).copy()


def resolve_chunks(support: Support | None, chunks: list, what: str, model: str) -> tuple[list[int], list]:
    """Expand ``chunks`` (token lists and ``MediaChunk`` s) into ``(token ids (N,), payloads)``:
    each media chunk becomes its token count of placeholder ids; payloads are ``(pixel_values,
    grid_thw)`` tensors per image or a uint8 (frames, bins) array per DMel chunk, in order.
    Raises EngineUserError naming ``what`` and the chunk for anything the model cannot take."""
    tokens: list[int] = []
    payloads: list = []
    for j, chunk in enumerate(chunks):
        where = f"{what}: chunk {j}"
        if not isinstance(chunk, MediaChunk):
            run = [int(t) for t in chunk]
            if support is not None and support.reserved.intersection(run):
                bad = sorted(support.reserved.intersection(run))[0]
                raise EngineUserError(
                    f"{where}: token id {bad} is the placeholder of a media position of "
                    f"{model!r}; send the media as an image/DMel chunk instead"
                )
            tokens.extend(run)
            continue
        kind = "image" if chunk.kind in ("image", "image_asset_pointer") else chunk.kind
        if support is None or (kind == "image") != (support.kind == "vision") or kind not in ("image", "dmel"):
            took = "text only" if support is None else "images" if support.kind == "vision" else "DMel audio"
            raise EngineUserError(f"{where}: {chunk.kind} chunks are not supported by {model!r} ({took})")
        if kind == "image":
            n, payload = _image_payload(support, chunk, where, model)
        else:
            frames = decode_tensor_container(chunk.data or b"", where)
            if frames.shape[0] < 1 or frames.shape[1] != support.bins:
                raise EngineUserError(
                    f"{where}: DMel tensor has shape {frames.shape}; {model!r} takes "
                    f"(frames >= 1, {support.bins} mel bins)"
                )
            if int(frames.max()) >= support.levels:
                raise EngineUserError(f"{where}: DMel value {int(frames.max())} is outside [0, {support.levels})")
            n, payload = int(frames.shape[0]), frames
        tokens.extend([support.placeholder] * n)
        payloads.append(payload)
    return tokens, payloads


def _image_payload(support: Support, chunk: MediaChunk, where: str, model: str):
    if isinstance(support.processor, Exception) or support.processor is None:
        raise EngineUserError(
            f"{where}: {model!r} has no image processor (preprocessor_config.json) "
            f"in its directory: {support.processor}"
        )
    data = chunk.data if chunk.kind == "image" else _read_location(chunk.location or "", where)
    if data is None or len(data) > MAX_MEDIA_BYTES:
        raise EngineUserError(f"{where}: image data missing or larger than {MAX_MEDIA_BYTES >> 20} MiB")
    img = decode_image(data, chunk.format, where)
    out = support.processor(images=[img], return_tensors="pt")
    grid = out["image_grid_thw"].reshape(1, 3)
    n = int(grid.prod()) // support.merge**2
    if chunk.expected_tokens is not None and int(chunk.expected_tokens) != n:
        raise EngineUserError(
            f"{where}: expected_tokens={chunk.expected_tokens}, but this {img.width}x{img.height} "
            f"image is {n} tokens for {model!r} (grid {grid.tolist()[0]}, merge {support.merge})"
        )
    return n, (out["pixel_values"], grid)


def media_kwargs(model, support: Support, ids: torch.Tensor, payloads: list, device: torch.device) -> dict:
    """Keyword arguments that put ``payloads`` (all media of the batch ``ids`` (B, T), in
    row-major order of their positions) into a forward of ``model``'s decoder: pixel values,
    grids and token types for vision models; input embeddings for DMel models."""
    if support.kind == "vision":
        return {
            "input_ids": ids,
            "pixel_values": torch.cat([p[0] for p in payloads]).to(device),
            "image_grid_thw": torch.cat([p[1] for p in payloads]).to(device),
            "mm_token_type_ids": (ids == support.placeholder).int(),
        }
    frames = torch.from_numpy(np.concatenate(payloads)).to(device)
    return {"dmel_frames": frames}


def media_logits(model, support: Support, ids: torch.Tensor, payloads: list) -> torch.Tensor:
    """Logits (B, T, V) float32 of a right-padded batch with media: the decoder under the
    ambient autocast, the output projection in fp32."""
    kw = media_kwargs(model, support, ids, payloads, ids.device)
    head = model.get_output_embeddings()
    if support.kind == "audio":
        hidden = model.model(inputs_embeds=model.embed_audio(ids, kw["dmel_frames"]), use_cache=False).last_hidden_state
    else:
        reset_media_state(model)
        hidden = model.model(**kw, use_cache=False).last_hidden_state
    with torch.autocast(ids.device.type, enabled=False):
        return head(hidden.float()).float()


def prefill_kwargs(model, support: Support, prompt: list[int], payloads: list, device: torch.device) -> dict:
    """Extra arguments of the sampler's prefill of one media prompt (``sample_batch``)."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    kw = media_kwargs(model, support, ids, payloads, device)
    kw.pop("input_ids", None)
    return kw


def reset_media_state(model) -> None:
    """Forget the M-RoPE offsets a Qwen-VL model keeps from its last prefill (``rope_deltas``),
    so that a new prompt's positions are computed afresh."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None
