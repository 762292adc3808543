"""Renderers against the real SmolLM2 tokenizer (read in place from shared/data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker

from recipes.renderers import RendererError, get_renderer, renderer_names

TOKENIZER_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizer" / "smollm2"

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR / "tokenizer.json").exists(),
    reason=f"SmolLM2 tokenizer not found at {TOKENIZER_DIR} (shared/data is absent)",
)

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]
NO_SYSTEM = CONV[1:]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def _trained_text(tok, model_input, weights) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    tokens = model_input.to_ints()
    runs, cur = [], []
    for t, w in zip(tokens, weights):
        if w > 0:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_registry_names_and_unknown(tok):
    assert {"role_colon", "chat_template"} <= set(renderer_names())
    with pytest.raises(RendererError, match="unknown renderer 'nope'.*chat_template"):
        get_renderer("nope", tok)


@pytest.mark.parametrize("conv", [CONV, NO_SYSTEM], ids=["system", "no_system"])
def test_chat_template_token_exact_with_apply_chat_template(tok, conv):
    r = get_renderer("chat_template", tok)
    model_input, weights = r.build_supervised_example(conv)
    expected = tok.apply_chat_template(conv, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert model_input.to_ints() == list(expected)
    assert weights.dtype == np.float32 and weights.shape == (model_input.length,)
    prompt = r.build_generation_prompt(conv[:-1])
    gen = tok.apply_chat_template(conv[:-1], tokenize=True, add_generation_prompt=True)
    gen = gen["input_ids"] if hasattr(gen, "keys") else gen
    assert prompt.to_ints() == list(gen)


def test_chat_template_weights_cover_assistant_replies_and_end_of_turn(tok):
    r = get_renderer("chat_template", tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert r.get_stop_sequences() == [im_end]
    mi, w = r.build_supervised_example(CONV)
    assert _trained_text(tok, mi, w) == ["4.<|im_end|>", "It is 6.<|im_end|>"]
    mi, w = r.build_supervised_example(CONV, "last_assistant_message")
    assert _trained_text(tok, mi, w) == ["It is 6.<|im_end|>"]
    mi, w = r.build_supervised_example(CONV, "all_messages")
    assert w.sum() == mi.length  # every token of every message
    # the default system prompt the template injects counts as part of the first message
    mi, w = r.build_supervised_example(NO_SYSTEM, "all_messages")
    assert w.all()


def test_role_colon_format_weights_and_stop(tok):
    r = get_renderer("role_colon", tok)
    assert r.get_stop_sequences() == ["\n\nUser:"]
    mi, w = r.build_supervised_example(CONV)
    text = tok.decode(mi.to_ints())
    assert text == (
        "System: Be brief.\n\nUser: What is 2+2?\n\nAssistant: 4.\n\nUser: And 3+3?\n\nAssistant: It is 6.\n\nUser:"
    )
    # each trained assistant turn ends with the stop sequence, so the model learns to stop
    assert _trained_text(tok, mi, w) == [" 4.\n\nUser:", " It is 6.\n\nUser:"]
    mi, w = r.build_supervised_example(CONV, "last_assistant_message")
    assert _trained_text(tok, mi, w) == [" It is 6.\n\nUser:"]
    mi, w = r.build_supervised_example(CONV, "all_messages")
    assert w.all()


@pytest.mark.parametrize("name", ["role_colon", "chat_template"])
def test_generation_prompt_is_prefix_of_supervised_example(tok, name):
    r = get_renderer(name, tok)
    for cut in (2, 4):  # before each assistant turn of CONV
        prompt = r.build_generation_prompt(CONV[:cut]).to_ints()
        full, weights = r.build_supervised_example(CONV[: cut + 1], "last_assistant_message")
        full = full.to_ints()
        assert full[: len(prompt)] == prompt
        assert not weights[: len(prompt)].any()  # nothing of the prompt is trained
        assert weights[len(prompt)] == 1.0  # the reply starts right after it
        assert isinstance(r.build_generation_prompt(CONV[:cut]), tinker.ModelInput)


@pytest.mark.parametrize("name", ["role_colon", "chat_template"])
def test_parse_response_round_trip(tok, name):
    r = get_renderer(name, tok)
    prompt = r.build_generation_prompt(CONV[:-1]).to_ints()
    full = r.build_supervised_example(CONV)[0].to_ints()
    sampled = full[len(prompt) :]
    msg, ended = r.parse_response(sampled)
    assert ended and msg == {"role": "assistant", "content": "It is 6."}
    msg, ended = r.parse_response(tok.encode(" It is", add_special_tokens=False))
    assert not ended and msg["content"].strip() == "It is"


@pytest.mark.parametrize("name", ["role_colon", "chat_template"])
def test_bad_messages_raise_clear_errors(tok, name):
    r = get_renderer(name, tok)
    with pytest.raises(RendererError, match="no assistant message"):
        r.build_supervised_example([{"role": "user", "content": "hi"}])
    with pytest.raises(RendererError, match=r"messages\[1\].role: unknown role 'bot'"):
        r.build_supervised_example([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}])
    with pytest.raises(RendererError, match=r"messages\[0\].content must be a string"):
        r.build_generation_prompt([{"role": "user", "content": None}])
    with pytest.raises(RendererError, match="train_on_what='everything'"):
        r.build_supervised_example(CONV, "everything")
    with pytest.raises(RendererError, match="empty"):
        r.build_generation_prompt([])


def test_chat_template_detects_broken_prefix_property(tok):
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    # a template that renders earlier assistant turns differently from the last one
    t2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[old]{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = get_renderer("chat_template", t2)
    with pytest.raises(RendererError, match="prefix property"):
        r.build_supervised_example(NO_SYSTEM)


def test_chat_template_requires_a_template(tok):
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    t2.chat_template = None
    with pytest.raises(RendererError, match="no chat template.*role_colon"):
        get_renderer("chat_template", t2)


def test_accepts_conversation_objects(tok):
    from recipes.datasets import Conversation

    r = get_renderer("chat_template", tok)
    a = r.build_supervised_example(Conversation(messages=CONV, source="x:1"))
    b = r.build_supervised_example(CONV)
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
