"""Renderers of the hosted model families, through ``tml-renderers`` (PyPI, by the Tinker team).

``tml-renderers`` (optional extra ``multimodal``: ``pip install 'prefect-tinker[multimodal]'``)
carries the exact formats of the hosted models with their tokenizers compiled in, so rendering
needs no Hugging Face download.  Registered names:

=====================  ==============================================================
``qwen3_vl_instruct``  Qwen3-VL instruct models (``renderers.Qwen3.vision_instruct()``)
``qwen3_vl``           Qwen3-VL thinking models (``renderers.Qwen3.vision()``)
``tml_v0``             Inkling / Inkling-Small (TMLv0, ``v0.Renderer``): text, images, audio as DMel
=====================  ==============================================================

Our message dicts (text / image / audio content parts, :mod:`.media_parts`) become
``chat.OpenAIMessage`` s; images become ``chat.ImagePointer`` s of a local PNG/JPEG file (inline
bytes, URLs and other formats are written to the media cache first), audio ``chat.AudioPointer``
s of a 16 kHz PCM WAV (other rates are resampled into the media cache, since ``tml-renderers``
resamples only with ``librosa``).  The rendered spans become our token lists: text as is, an
image span as ``num_tokens`` positions of the family's image placeholder, a DMel span as one
position per DMel frame (its ``target_audio_token``), each media item by reference
(:mod:`prefect_tinker.recipes.media`), so the chunks sent are those of
``tml_renderers.tinker.token_spans_to_tinker_model_input``.

``render_for_sft`` gives one example per assistant message, trained on that message;
``train_on_what="last_assistant_message"`` takes the last, ``"all_assistant_messages"`` the last
with the weights of the earlier ones (which are its token prefixes).  No tool definitions; the
reply is parsed as text up to the family's stop token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tinker

from prefect_tinker.recipes.media import MediaError, MediaRef, cache_file, media_tokens, store_media
from prefect_tinker.recipes.renderers.base import (
    Message,
    ParsedResponse,
    Renderer,
    RendererError,
    TrainOnWhat,
    check_train_on,
    normalize_messages,
)
from prefect_tinker.recipes.renderers.media_parts import MediaContent

__all__ = ["TML_FAMILIES", "TmlRenderer", "tml_available"]

#: Registered names -> (constructor description, image placeholder special token or None).
TML_FAMILIES = {"qwen3_vl_instruct": "image_pad", "qwen3_vl": "image_pad", "tml_v0": "content_image"}
_ROLES = {"user": "User", "assistant": "Model", "system": "System", "tool": "Tool"}


def tml_available() -> bool:
    """Whether ``tml-renderers`` is installed."""
    import importlib.util

    return importlib.util.find_spec("tml_renderers") is not None


def _make(name: str):
    try:
        from tml_renderers import renderers, tokenizers, v0
    except ImportError as exc:
        raise RendererError(
            f"renderer {name!r} needs tml-renderers: pip install 'prefect-tinker[multimodal]' "
            f"(or pip install tml-renderers) ({exc})"
        ) from None
    if name == "qwen3_vl_instruct":
        return renderers.Qwen3.vision_instruct()
    if name == "qwen3_vl":
        return renderers.Qwen3.vision()
    if name == "tml_v0":
        return v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    raise RendererError(f"unknown tml renderer {name!r}; accepted: {', '.join(TML_FAMILIES)}")


class TmlRenderer(Renderer):
    """A hosted family rendered by ``tml-renderers`` (see the module docstring).

    Args:
        tokenizer: ignored (the family's tokenizer is built in); kept for the registry's signature.
        family: one of :data:`TML_FAMILIES`.
        special_tokens_in_content: must stay False: tml-renderers always encodes message
            content as text.

    Raises:
        RendererError: tml-renderers is missing, the family is unknown, or
            ``special_tokens_in_content=True``.
    """

    supports_media = True

    def __init__(self, tokenizer: Any = None, *, family: str, special_tokens_in_content: bool = False):
        self.name, self.family = family, family
        self.hf_tokenizer = tokenizer
        if special_tokens_in_content:
            raise RendererError(
                f"renderer {family!r} encodes message content as text (tml-renderers); "
                "special_tokens_in_content=True is not available for it"
            )
        self.special_tokens_in_content = False
        self.tml = _make(family)
        self.tokenizer = self.tml.tokenizer
        self.placeholder = int(self.tokenizer.encode_special(TML_FAMILIES[family]))
        stop = self.tml.stop()
        self._stop = [int(s) for s in (stop if isinstance(stop, list) else [stop])] if stop is not None else []

    # ---- messages -> tml ----------------------------------------------------------------
    def _image(self, value: Any):
        from tml_renderers import chat

        from prefect_tinker.recipes.media_inputs import load_image

        img = load_image(value)
        path = img.path or str(cache_file(img.data, img.format))
        fmt = chat.ImageFormat.Png if img.format == "png" else chat.ImageFormat.Jpeg
        return chat.ImagePointer(location=path, format=fmt, width=img.width, height=img.height)

    def _audio(self, value: Any):
        import io
        import wave

        from tml_renderers import chat

        from prefect_tinker.recipes.media_inputs import load_wav

        x, rate, label = load_wav(value)
        local = isinstance(value, str) and "://" not in value
        path = str(Path(value).expanduser().resolve()) if local and rate == 16000 else None
        if path is None:  # resample to 16 kHz into the media cache (tml-renderers needs librosa otherwise)
            y, _, _ = load_wav(value, 16000)
            buf = io.BytesIO()
            with wave.open(buf, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(16000)
                w.writeframes((np.clip(y, -1.0, 1.0) * 32767.0).astype("<i2").tobytes())
            path, x = str(cache_file(buf.getvalue(), "wav")), y
        return chat.AudioPointer(
            location=str(path), format=chat.AudioFormat.Wav, num_frames=int(x.size), sample_rate=16000
        )

    def to_tml(self, messages: Sequence[Message]) -> list[Any]:
        """Our validated messages as ``tml_renderers.chat.OpenAIMessage`` s."""
        from tml_renderers import chat

        out = []
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                raise RendererError(f"messages[{i}]: renderer {self.name!r} does not render tool calls here")
            parts: list[Any] = []
            content = m["content"]
            try:
                for p in content if isinstance(content, MediaContent) else [{"type": "text", "text": content}]:
                    if p["type"] == "text":
                        parts.append(chat.Text(p["text"]))
                    elif p["type"] == "image":
                        parts.append(self._image(p["image"]))
                    else:
                        parts.append(self._audio(p["audio"]))
            except MediaError as exc:
                raise RendererError(f"messages[{i}].content: {exc}") from None
            out.append(
                chat.OpenAIMessage(author=chat.Author(getattr(chat.AuthorKind, _ROLES[m["role"]])), content=parts)
            )
        return out

    # ---- tml spans -> our token lists -----------------------------------------------------
    def spans_to_tokens(self, spans: Sequence[Any]) -> list[int]:
        """Token list of rendered ``spans`` (media as MediaToken runs, by reference)."""
        from tml_renderers import chat
        from tml_renderers.tinker import token_span_to_tinker_chunk

        out: list[int] = []
        for wrapped in spans:
            span = wrapped.span
            if isinstance(span, chat.EncodedTextTokenSpan):
                out.extend(int(t) for t in span.tokens)
            elif isinstance(span, chat.ImageAssetPointerTokenSpan):
                data = open(span.location, "rb").read()
                fmt = "png" if span.format == chat.ImageFormat.Png else "jpeg"
                ref = MediaRef(
                    kind="image",
                    path=span.location,
                    sha256=hashlib.sha256(data).hexdigest(),
                    format=fmt,
                    tokens=int(span.num_tokens),
                    width=int(span.width),
                    height=int(span.height),
                    source=span.location,
                )
                out.extend(media_tokens(ref, self.placeholder))
            elif isinstance(span, chat.DmelTokenSpan):
                chunk = token_span_to_tinker_chunk(wrapped)
                if not isinstance(chunk, tinker.DmelChunk):  # tml_renderers maps a dmel span to a DmelChunk
                    raise RendererError(f"renderer {self.name!r}: a dmel span became a {type(chunk).__name__}")
                dmel = chunk.dmel
                ref = store_media(dmel, "dmel", "dmel", tokens=int(span.token_count()), source="<tml dmel>")
                out.extend(media_tokens(ref, int(span.target_audio_token)))
            else:
                raise RendererError(f"renderer {self.name!r}: unexpected span {type(span).__name__}")
        return out

    # ---- Renderer API ---------------------------------------------------------------------
    def build_supervised_sequence(
        self,
        messages: Any,
        train_on_what: str | TrainOnWhat = "last_assistant_message",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], np.ndarray]:
        mode = check_train_on(train_on_what)
        if tools:
            raise RendererError(f"renderer {self.name!r} cannot render tool definitions")
        msgs = normalize_messages(messages)
        if mode not in (TrainOnWhat.LAST_ASSISTANT_MESSAGE, TrainOnWhat.ALL_ASSISTANT_MESSAGES):
            raise RendererError(
                f"renderer {self.name!r} trains assistant messages only: use train_on_what="
                "last_assistant_message or all_assistant_messages"
            )
        try:
            examples = self.tml.render_for_sft(self.to_tml(msgs))
        except ValueError as exc:
            raise RendererError(f"renderer {self.name!r}: {exc}") from None
        if not examples:
            raise RendererError("conversation has no assistant message to train on")
        tokens = self.spans_to_tokens(examples[-1].input_token_spans)
        weights = np.asarray(examples[-1].per_token_loss_weight_unshifted, dtype=np.float32)
        if mode is TrainOnWhat.ALL_ASSISTANT_MESSAGES:
            for ex in examples[:-1]:
                prefix = self.spans_to_tokens(ex.input_token_spans)
                if tokens[: len(prefix)] != prefix:
                    raise RendererError(
                        f"renderer {self.name!r} rewrites earlier turns (e.g. strips thinking): "
                        "use train_on_what=last_assistant_message"
                    )
                weights[: len(prefix)] = np.maximum(weights[: len(prefix)], ex.per_token_loss_weight_unshifted)
        if weights.shape != (len(tokens),):
            raise RendererError(f"renderer {self.name!r}: {len(weights)} weights for {len(tokens)} positions")
        return tokens, weights

    def build_supervised_example(
        self,
        messages: Any,
        train_on_what: str | TrainOnWhat = "last_assistant_message",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ):
        tokens, weights = self.build_supervised_sequence(messages, train_on_what, tools=tools)
        return self._model_input(tokens), weights

    def build_generation_sequence(
        self, messages: Any, prefill: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        if tools:
            raise RendererError(f"renderer {self.name!r} cannot render tool definitions")
        try:
            spans, _ = self.tml.render_for_completion(self.to_tml(normalize_messages(messages)))
        except ValueError as exc:
            raise RendererError(f"renderer {self.name!r}: {exc}") from None
        tokens = self.spans_to_tokens(spans)
        return tokens + (list(self.tokenizer.encode_ordinary(prefill)) if prefill else [])

    def build_generation_prompt(
        self, messages: Any, prefill: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None
    ):
        return self._model_input(self.build_generation_sequence(messages, prefill, tools=tools))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode_ordinary(text))

    def get_stop_sequences(self) -> list[int]:
        """The family's end-of-turn token ids."""
        return list(self._stop)

    def eos_token_ids(self) -> list[int]:
        return []

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        content, term = self.split_at_stop(tokens)
        text = self.tokenizer.decode(content)
        return ParsedResponse({"role": "assistant", "content": text}, term)
