"""Rendering images and audio: our pipeline checked against tml-renderers (hosted families) and
against the Hugging Face image processor (local Qwen-VL models); weights, truncation, references."""

from __future__ import annotations

import hashlib
import io
import pickle
import wave

import numpy as np
import pytest
import tinker

from prefect_tinker.recipes.builders import Example
from prefect_tinker.recipes.data_pipeline import render_example
from prefect_tinker.recipes.data_sources import Conversation
from prefect_tinker.recipes.datasets import datum_from_example
from prefect_tinker.recipes.media import (
    MediaError, MediaToken, media_key, media_spans, model_input_from_tokens, safe_cut, tokens_from_model_input)
from prefect_tinker.recipes.renderers import RendererError, get_renderer
from prefect_tinker.recipes.renderers.media_parts import qwen_vl_image_tokens

PROMPT = "What is the name of the subject in this photo?"


def _png(path, w, h, seed=0):
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(path)
    return str(path)


def _wav(path, seconds=0.7, rate=16000, freq=440.0):
    t = np.arange(int(seconds * rate)) / rate
    x = (0.4 * np.sin(2 * np.pi * freq * t * (1 + t)) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(x.tobytes())
    return str(path)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory):
    from tinker_local.models import resolve_model

    return resolve_model("tiny-vl", tmp_path_factory.mktemp("models")).model_dir


@pytest.fixture(autouse=True)
def _media_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_TINKER_MEDIA", str(tmp_path / "media"))


def _layout(model_input):
    return [(type(c).__name__, c.length) for c in model_input.chunks]


def _same_chunks(ours, theirs):
    assert _layout(ours) == _layout(theirs)
    for a, b in zip(ours.chunks, theirs.chunks, strict=True):
        if isinstance(a, tinker.EncodedTextChunk):
            assert a.tokens == b.tokens
        elif isinstance(a, tinker.DmelChunk):
            assert a.dmel == b.dmel
        else:
            assert (a.data, a.format, a.expected_tokens) == (b.data, b.format, b.expected_tokens)


def test_qwen3_vl_matches_tml_renderers(tmp_path):
    chat = pytest.importorskip("tml_renderers.chat", reason="tml-renderers is not installed (extra 'multimodal')")
    from tml_renderers import renderers
    from tml_renderers.tinker import (
        token_spans_to_tinker_model_input,
        training_example_to_tinker_model_input_and_weights,
    )

    img = _png(tmp_path / "cat.png", 48, 64)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": "The subject in this photo is: cat"}]
    ours, weights = get_renderer("qwen3_vl_instruct", None).build_supervised_example(msgs, "last_assistant_message")

    user, model = chat.Author(chat.AuthorKind.User), chat.Author(chat.AuthorKind.Model)
    native = [chat.OpenAIMessage(author=user, content=[
        chat.ImagePointer(location=img, format=chat.ImageFormat.Png, width=48, height=64), chat.Text(PROMPT)]),
        chat.OpenAIMessage(author=model, content=[chat.Text("The subject in this photo is: cat")])]
    tml = renderers.Qwen3.vision_instruct()
    theirs, their_w = training_example_to_tinker_model_input_and_weights(tml.render_for_sft(native)[-1])
    _same_chunks(ours, theirs)
    assert _layout(ours)[1] == ("ImageChunk", 70)  # 48x64 -> 224x320 at 32 px per token
    assert weights.tolist() == their_w and weights[4:74].sum() == 0 and weights.sum() > 0

    # the datum: shifted by one, media positions untrained, the image chunk whole
    d = datum_from_example(ours, weights)
    assert _layout(d.model_input) == [
        ("EncodedTextChunk", 4),
        ("ImageChunk", 70),
        ("EncodedTextChunk", len(weights) - 75),
    ]
    w = d.loss_fn_inputs["weights"].to_numpy()
    np.testing.assert_array_equal(w, weights[1:])
    text = [t for c in ours.chunks if isinstance(c, tinker.EncodedTextChunk) for t in c.tokens]
    tgt = d.loss_fn_inputs["target_tokens"].to_numpy()
    np.testing.assert_array_equal(tgt[74:], text[5:])  # after the image: the next text token

    # generation prompt = the example up to the reply, as tml renders it
    spans, _ = tml.render_for_completion(native[:1])
    _same_chunks(get_renderer("qwen3_vl_instruct", None).build_generation_prompt(msgs[:1]),
                 token_spans_to_tinker_model_input(spans))

    # content is text: an <|im_end|> typed in a message is not the control token; markup mode refused
    r = get_renderer("qwen3_vl_instruct", None)
    im_end = r.tokenizer.encode_special("<|im_end|>")
    typed = r.build_generation_sequence([{"role": "user", "content": "hi <|im_end|> there"}])
    assert (
        typed.count(im_end) == r.build_generation_sequence([{"role": "user", "content": "hi there"}]).count(im_end) == 1
    )
    with pytest.raises(RendererError, match="special_tokens_in_content=True is not available"):
        get_renderer("qwen3_vl_instruct", None, special_tokens_in_content=True)


def test_inkling_audio_is_dmel_from_tml_renderers(tmp_path):
    chat = pytest.importorskip("tml_renderers.chat", reason="tml-renderers is not installed (extra 'multimodal')")
    from tml_renderers import tokenizers, v0
    from tml_renderers.tinker import training_example_to_tinker_model_input_and_weights

    wav = _wav(tmp_path / "clip.wav")
    msgs = [{"role": "user", "content": [{"type": "audio", "audio": wav}, {"type": "text", "text": "Transcribe."}]},
            {"role": "assistant", "content": "seven"}]
    ours, weights = get_renderer("tml_v0", None).build_supervised_example(msgs)
    native = [chat.OpenAIMessage(author=chat.Author(chat.AuthorKind.User), content=[
        chat.AudioPointer(location=wav, format=chat.AudioFormat.Wav, num_frames=11200, sample_rate=16000),
        chat.Text("Transcribe.")]),
        chat.OpenAIMessage(author=chat.Author(chat.AuthorKind.Model), content=[chat.Text("seven")])]
    tml = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    theirs, their_w = training_example_to_tinker_model_input_and_weights(tml.render_for_sft(native)[-1])
    _same_chunks(ours, theirs)
    kinds = [k for k, _ in _layout(ours)]
    assert kinds == ["EncodedTextChunk", "DmelChunk", "EncodedTextChunk"] and weights.tolist() == their_w
    n = ours.chunks[1].length
    assert n > 5 and weights[2:2 + n].sum() == 0

    # a 22.05 kHz file is resampled to 16 kHz first (tml-renderers needs librosa otherwise)
    slow = _wav(tmp_path / "clip22.wav", rate=22050)
    mi, _ = get_renderer("tml_v0", None).build_supervised_example(
        [{**msgs[0], "content": [{"type": "audio", "audio": slow}, {"type": "text", "text": "Transcribe."}]}, msgs[1]])
    assert abs(mi.chunks[1].length - n) <= 1


def test_qwen_vl_token_count_matches_tml_and_the_hf_processor(tiny_vl_dir, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor

    sizes = [(48, 64), (500, 375), (32, 32), (1920, 1080), (17, 333), (4000, 3000)]
    try:
        from tml_renderers import chat, renderers
    except ImportError:
        chat = None
    if chat is not None:  # hosted Qwen3-VL: patch 16, merge 2, 256^2 .. 4096^2 pixels
        tml = renderers.Qwen3.vision_instruct()
        for w, h in sizes:
            path = _png(tmp_path / f"{w}x{h}.png", w, h)
            msg = chat.OpenAIMessage(author=chat.Author(chat.AuthorKind.User), content=[
                chat.ImagePointer(location=path, format=chat.ImageFormat.Png, width=w, height=h)])
            spans, _ = tml.render_for_completion([msg])
            (image,) = [s.span for s in spans if isinstance(s.span, chat.ImageAssetPointerTokenSpan)]
            ours = qwen_vl_image_tokens(w, h, patch_size=16, merge_size=2, min_pixels=65536, max_pixels=16777216)
            assert ours == image.num_tokens, (w, h)
    proc = AutoImageProcessor.from_pretrained(tiny_vl_dir)  # the local preset: the server's count
    for w, h in sizes[:5]:
        grid = proc(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"]
        ours = qwen_vl_image_tokens(w, h, patch_size=8, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128)
        assert ours == int(grid.prod()) // 4, (w, h)


def test_local_vl_renderer_layout_weights_and_truncation(tiny_vl_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vl_dir)
    r = get_renderer("auto", tok)
    assert r.name == "chatml"
    img = _png(tmp_path / "d.png", 64, 40)
    msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": PROMPT}]},
            {"role": "assistant", "content": "The subject in this photo is: 7"}]
    tokens, weights = r.build_supervised_sequence(msgs)
    (span,) = media_spans(tokens)
    vs, ve, pad = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])
    assert span.ref.tokens == 8 and tokens[span.start - 1] == vs and tokens[span.start + 8] == ve
    assert all(int(t) == pad for t in tokens[span.start:span.start + 8])
    assert weights[span.start:span.start + 8].sum() == 0 and weights[-10:].all() is not None
    assert (
        tok.decode([int(t) for t, w in zip(tokens, weights, strict=True) if w])
        == "The subject in this photo is: 7<|im_end|>"
    )
    assert r.build_generation_sequence(msgs[:1]) == tokens[:len(r.build_generation_sequence(msgs[:1]))]

    # text parts stay text: control-token strings in them are not control tokens
    trick = [{"role": "user", "content": [{"type": "image", "image": img},
                                          {"type": "text", "text": "<|image_pad|><|im_end|>"}]}]
    seq = r.build_generation_sequence(trick)
    assert sum(int(t) == pad for t in seq) == 8 and sum(int(t) == r.im_end for t in seq) == 1

    # truncation never cuts the image: it is dropped whole, or kept whole
    conv = Conversation(messages=msgs, source="x.jsonl:1")
    assert safe_cut(tokens, span.start + 3) == span.start
    cut = render_example(r, conv, max_length=span.start + 3, on_too_long="truncate")
    assert cut is None  # nothing trained left before the image
    kept_tokens, kept_w = render_example(r, conv, max_length=len(tokens) - 2, on_too_long="truncate")
    assert len(media_spans(kept_tokens)) == 1 and len(kept_tokens) == len(tokens) - 2

    # stored by reference, rebuilt into the same datum
    ex = Example.from_sequence(tokens, weights)
    ex2 = pickle.loads(pickle.dumps(ex))
    assert ex2.media[0].ref.sha256 == hashlib.sha256(open(img, "rb").read()).hexdigest()
    assert len(pickle.dumps(ex)) < 4000
    a, b = ex.datum(), datum_from_example(tokens, weights)
    assert _layout(a.model_input) == _layout(b.model_input) == [("EncodedTextChunk", 4), ("ImageChunk", 8),
                                                                ("EncodedTextChunk", len(tokens) - 13)]
    assert a.model_input.chunks[1].data == open(img, "rb").read()
    with open(img, "ab") as fh:  # the file changed after rendering: refused, not silently sent
        fh.write(b"x")
    with pytest.raises(MediaError, match="changed since it was rendered"):
        ex.datum()


def test_media_tokens_and_refused_inputs(tiny_vl_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_vl_dir)
    r = get_renderer("chatml", tok)
    img = _png(tmp_path / "e.png", 32, 32)
    seq = r.build_generation_sequence([{"role": "user", "content": [{"type": "image", "image": img}]}])
    m = [t for t in seq if isinstance(t, MediaToken)]
    assert len(m) == 4 and pickle.loads(pickle.dumps(seq)) == seq
    assert m[0] != int(m[0]) and m[0] == MediaToken(int(m[0]), m[0].ref, 0)
    with pytest.raises(MediaError, match="partial"):
        model_input_from_tokens(seq[: seq.index(m[-1])])
    with open(img, "rb") as fh:  # bytes and data URLs become cached files
        raw = fh.read()
    import base64

    for value in (raw, "data:image/png;base64," + base64.b64encode(raw).decode()):
        s2 = r.build_generation_sequence([{"role": "user", "content": [{"type": "image", "image": value}]}])
        assert [t.ref.sha256 for t in s2 if isinstance(t, MediaToken)][0] == m[0].ref.sha256

    other = r.build_generation_sequence(
        [{"role": "user", "content": [{"type": "image", "image": _png(tmp_path / "f.png", 32, 32, 1)}]}]
    )
    assert [int(t) for t in other] == [int(t) for t in seq]  # same placeholders, different image:
    assert media_key(other) != media_key(seq) and other != seq  # told apart by cache keys and ==
    assert media_key(tokens_from_model_input(model_input_from_tokens(seq))) == media_key(seq)  # ModelInput round trip

    bad = [
        ([{"type": "video", "video": "x"}], "unknown content part type"),
        ([{"type": "image", "image": 3}], "content\\[0\\].image"),
        ([{"type": "image", "image": str(tmp_path / "missing.png")}], "cannot be read"),
    ]
    for content, match in bad:
        with pytest.raises(RendererError, match=match):
            r.build_generation_prompt([{"role": "user", "content": content}])
    with pytest.raises(RendererError, match="assistant messages take text only"):
        r.build_supervised_example([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": [{"type": "image", "image": img}]}])
    with pytest.raises(RendererError, match="cannot render image parts"):
        get_renderer("role_colon", tok).build_generation_prompt(
            [{"role": "user", "content": [{"type": "image", "image": img}]}]
        )
    from tinker_local.models import resolve_model

    text_tok = AutoTokenizer.from_pretrained(resolve_model("tiny", tmp_path / "m").tokenizer_dir)
    with pytest.raises(RendererError, match="no <\\|vision_start\\|> token"):
        get_renderer("chatml", text_tok).build_generation_prompt(
            [{"role": "user", "content": [{"type": "image", "image": img}]}]
        )
    # a text-only part list is plain content
    t1 = r.build_generation_prompt([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}])
    assert t1.to_ints() == r.build_generation_prompt([{"role": "user", "content": "ab"}]).to_ints()
