"""Renderers against the real SmolLM2 tokenizer (read in place from ../shared/data): parity with
``apply_chat_template``, the generation-prompt prefix property, train_on_what modes, parsing."""

from __future__ import annotations

import numpy as np
import pytest
import tinker

from prefect_tinker.recipes.renderers import (
    TRAIN_ON_CHOICES,
    RendererError,
    Termination,
    get_renderer,
    guess_renderer_name,
    renderer_names,
    resolve_renderer_name,
)
from tests.renderer_tokenizers import (
    decode,
    encode,
    llama3_like,
    load_smollm2,
    needs_smollm2,
    qwen3_like,
    smollm2,
    tiny,
    trained_runs,
)

pytestmark = needs_smollm2

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]
CONVERSATIONS = {
    "system_multiturn": CONV,
    "no_system": CONV[1:],
    "empty_messages": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Still there?"},
        {"role": "assistant", "content": "Yes."},
    ],
    "unicode": [
        {"role": "user", "content": "Ça va ? 日本語で答えて 🙂 — naïve façade, עברית, Ελληνικά"},
        {"role": "assistant", "content": "はい、元気です 👍🏽 ñ ü ß ∑ x² ≤ ∞"},
    ],
    "multiline": [
        {"role": "user", "content": "Write a haiku\nabout rain.\n"},
        {"role": "assistant", "content": "Soft rain on the roof\n\nwhispers to the sleeping town\n  night keeps it"},
    ],
    "tool_role": [
        {"role": "user", "content": "Compute 6*7 with the calculator."},
        {"role": "assistant", "content": "calc(6*7)"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "6*7 = 42."},
    ],
}
TEMPLATE_RENDERERS = ["chat_template", "smollm2"]


def _apply(tok, conv, generation: bool) -> list[int]:
    out = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=generation)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _renderer(name: str):
    tok = {"qwen3": qwen3_like, "qwen3_disable_thinking": qwen3_like, "llama3": llama3_like}.get(name, smollm2)()
    return tok, get_renderer(name, tok)


def test_registry_names_unknown_and_guess():
    tok = smollm2()
    assert {"role_colon", "chatml", "smollm2", "qwen3", "qwen3_disable_thinking", "llama3", "chat_template"} <= set(
        renderer_names()
    )
    with pytest.raises(RendererError, match="unknown renderer 'nope'.*chat_template"):
        get_renderer("nope", tok)
    with pytest.raises(RendererError, match="unknown renderer 'nope'; accepted: auto, chat_template"):
        resolve_renderer_name("nope", tok)
    assert resolve_renderer_name("auto", tok) == "smollm2" and resolve_renderer_name("llama3", tok) == "llama3"
    assert resolve_renderer_name("auto", tiny()) == "chatml"  # the tiny preset's template is plain ChatML
    assert guess_renderer_name(tok) == "smollm2" and get_renderer("auto", tok).name == "smollm2"
    fresh = load_smollm2()
    for template, expected in [
        (None, "role_colon"),
        ("<|im_start|>{{ x }}<think>", "qwen3"),
        ("<|start_header_id|>{{ m }}<|eot_id|>", "llama3"),
        ("{{ messages }}", "chat_template"),
        (tiny().chat_template, "chatml"),
        (tiny().chat_template.replace("'\\n' }}{% endfor %}", "'' }}{% endfor %}"), "chat_template"),
    ]:
        fresh.chat_template = template
        assert guess_renderer_name(fresh) == expected


@pytest.mark.parametrize("conv_id", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATE_RENDERERS)
def test_parity_with_apply_chat_template(name, conv_id):
    """Supervised example == apply_chat_template(conv); generation prompt of every prefix ==
    apply_chat_template(prefix, add_generation_prompt=True)."""
    tok = smollm2()
    r = get_renderer(name, tok)
    conv = CONVERSATIONS[conv_id]
    model_input, weights = r.build_supervised_example(conv)
    assert model_input.to_ints() == _apply(tok, conv, False)
    assert weights.dtype == np.float32 and weights.shape == (model_input.length,)
    for k in range(1, len(conv) + 1):
        assert r.build_generation_prompt(conv[:k]).to_ints() == _apply(tok, conv[:k], True), k


@pytest.mark.parametrize(
    "name", ["role_colon", "chatml", "smollm2", "chat_template", "qwen3", "qwen3_disable_thinking", "llama3"]
)
def test_generation_prompt_is_prefix_and_reply_parses_back(name):
    _, r = _renderer(name)
    for conv_id, conv in CONVERSATIONS.items():
        for i, msg in enumerate(conv):
            if msg["role"] != "assistant":
                continue
            prompt = r.build_generation_prompt(conv[:i]).to_ints()
            full, w = r.build_supervised_example(conv[: i + 1], "last_assistant_message")
            full = full.to_ints()
            assert full[: len(prompt)] == prompt, (conv_id, i)
            assert not w[: len(prompt)].any() and w[len(prompt)] == 1.0, (conv_id, i)
            parsed = r.parse_response(full[len(prompt):])
            expected = msg["content"].strip() if name == "llama3" else msg["content"]
            assert parsed.termination is Termination.STOP_SEQUENCE and parsed.ok, (conv_id, i)
            assert parsed.message["content"] == expected, (conv_id, i)
            if name != "qwen3_disable_thinking":  # its history drops the empty think block
                whole = r.build_supervised_example(conv)[0].to_ints()
                assert whole[: len(prompt)] == prompt, (conv_id, i)


def test_whitespace_led_reply_keeps_the_prefix_property_where_apply_chat_template_does_not():
    """Content starting with 2+ spaces: BPE merges them with the header's newline in the joint
    encoding of apply_chat_template, a token sequence the sampler never produces after the
    generation prompt.  Both renderers cut at the prompt: same text, different tokens there."""
    tok = smollm2()
    conv = [{"role": "user", "content": "Indent it."}, {"role": "assistant", "content": "    x = 1"}]
    expected = _apply(tok, conv, False)
    ct, _ = get_renderer("chat_template", tok).build_supervised_example(conv)
    fam, _ = get_renderer("smollm2", tok).build_supervised_example(conv)
    assert ct == fam and fam.to_ints() != expected and decode(tok, fam.to_ints()) == decode(tok, expected)
    prompt = _apply(tok, conv[:1], True)
    for r in (get_renderer("smollm2", tok), get_renderer("chat_template", tok)):
        assert r.build_generation_prompt(conv[:1]).to_ints() == prompt  # prompts stay template-exact
    reply = encode(tok, "    x = 1") + [tok.convert_tokens_to_ids("<|im_end|>")] + encode(tok, "\n")
    assert fam.to_ints() == prompt + reply


TOOL_CONV = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "Q2", "trainable": True},
    {"role": "assistant", "content": "call", "trainable": True},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "A2"},
]


@pytest.mark.parametrize("name", TEMPLATE_RENDERERS)
def test_train_on_what_modes(name):
    tok = smollm2()
    r = get_renderer(name, tok)
    runs = lambda mode: trained_runs(tok, *r.build_supervised_example(TOOL_CONV, mode))
    assert runs("last_assistant_message") == ["A2<|im_end|>"]
    assert runs("last_assistant_turn") == ["call<|im_end|>", "A2<|im_end|>"]
    assert runs("all_assistant_messages") == ["A1<|im_end|>", "call<|im_end|>", "A2<|im_end|>"]
    assert runs("customized") == ["Q2<|im_end|>", "call<|im_end|>"]
    for mode in ("all_messages", "all_tokens"):
        mi, w = r.build_supervised_example(TOOL_CONV, mode)
        assert w.all() and len(w) == mi.length
    # the default system prompt the template inserts is trained only under all_messages/all_tokens
    mi, w = r.build_supervised_example(CONV[1:], "all_messages")
    assert w.all()
    mi, w = r.build_supervised_example(CONV[1:], "last_assistant_turn")
    assert trained_runs(tok, mi, w) == ["It is 6.<|im_end|>"]


def test_family_and_template_renderers_agree_on_weights_for_every_mode():
    tok = smollm2()
    fam, gen = get_renderer("smollm2", tok), get_renderer("chat_template", tok)
    for conv in [*CONVERSATIONS.values(), TOOL_CONV]:
        for mode in TRAIN_ON_CHOICES:
            if mode == "customized" and not any(m.get("trainable") for m in conv):
                continue
            a, b = fam.build_supervised_example(conv, mode), gen.build_supervised_example(conv, mode)
            assert a[0] == b[0] and np.array_equal(a[1], b[1]), mode


def test_role_colon_format_weights_and_stop():
    tok = smollm2()
    r = get_renderer("role_colon", tok)
    assert r.get_stop_sequences() == ["\n\nUser:"]
    mi, w = r.build_supervised_example(CONV)
    assert decode(tok, mi.to_ints()) == (
        "System: Be brief.\n\nUser: What is 2+2?\n\nAssistant: 4.\n\nUser: And 3+3?\n\nAssistant: It is 6.\n\nUser:"
    )
    # each trained assistant turn ends with the stop sequence, so the model learns to stop
    assert trained_runs(tok, mi, w) == [" 4.\n\nUser:", " It is 6.\n\nUser:"]
    assert trained_runs(tok, *r.build_supervised_example(CONV, "last_assistant_message")) == [" It is 6.\n\nUser:"]
    assert r.build_supervised_example(CONV, "all_messages")[1].all()
    assert r.build_generation_prompt(CONV[:2], prefill="The answer").to_ints()[-2:] == encode(tok, "The answer")


def test_parse_response_terminations():
    tok = smollm2()
    r = get_renderer("smollm2", tok)
    reply = encode(tok, "It is 6.")
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert r.parse_response(reply + [im_end, 5, 6]) == ({"role": "assistant", "content": "It is 6."}, "stop_sequence")
    assert r.parse_response(reply + [eot]).termination is Termination.END_OF_SEQUENCE
    cut = r.parse_response(reply[:2])
    assert cut.termination is Termination.TRUNCATED and not cut.ok and cut.message["content"] == decode(tok, reply[:2])
    rc = get_renderer("role_colon", tok)
    assert rc.parse_response(encode(tok, " It is 6.\n\nUser:")) == (
        {"role": "assistant", "content": "It is 6."},
        "stop_sequence",
    )
    assert rc.parse_response(encode(tok, " It is")).termination is Termination.TRUNCATED
    assert rc.parse_response(encode(tok, " Done.") + [im_end]).termination is Termination.END_OF_SEQUENCE


@pytest.mark.parametrize("name", ["role_colon", "smollm2", "chat_template"])
def test_bad_messages_raise_clear_errors(name):
    r = get_renderer(name, smollm2())
    user = {"role": "user", "content": "hi"}
    with pytest.raises(RendererError, match="no assistant message"):
        r.build_supervised_example([user])
    with pytest.raises(RendererError, match=r"messages\[1\].role: unknown role 'bot'"):
        r.build_supervised_example([user, {"role": "bot", "content": "x"}])
    with pytest.raises(RendererError, match=r"messages\[0\].content: must be a string"):
        r.build_generation_prompt([{"role": "user", "content": None}])
    with pytest.raises(RendererError, match=r"messages\[1\].trainable: must be true or false"):
        r.build_supervised_example([user, {"role": "assistant", "content": "x", "trainable": "yes"}], "customized")
    with pytest.raises(RendererError, match="train_on_what='everything'"):
        r.build_supervised_example(CONV, "everything")
    with pytest.raises(RendererError, match="no message has trainable=true"):
        r.build_supervised_example(CONV, "customized")
    with pytest.raises(RendererError, match="no assistant message follows the last user message"):
        r.build_supervised_example(CONV + [user], "last_assistant_turn")
    with pytest.raises(RendererError, match="empty"):
        r.build_generation_prompt([])


def test_missing_special_tokens_and_tools_support():
    tok = smollm2()
    with pytest.raises(RendererError, match=r"'llama3' needs the special token '<\|begin_of_text\|>'"):
        get_renderer("llama3", tok)
    with pytest.raises(RendererError, match="'role_colon' cannot render tool definitions"):
        get_renderer("role_colon", tok).build_generation_prompt(CONV[:2], tools=[{"name": "f"}])


def test_chat_template_detects_templates_that_rewrite_history():
    t2 = load_smollm2()
    # a template that renders earlier assistant turns differently from the last one
    t2.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}[old]{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = get_renderer("chat_template", t2)
    with pytest.raises(RendererError, match="prefix property"):
        r.build_supervised_example(CONV[1:])
    mi, w = r.build_supervised_example(CONV[1:], "last_assistant_message")  # only the last turn: fine
    assert trained_runs(t2, mi, w) == ["It is 6.<|im_end|>"]


def test_chat_template_requires_a_template():
    t2 = load_smollm2()
    t2.chat_template = None
    with pytest.raises(RendererError, match="no chat template.*role_colon"):
        get_renderer("chat_template", t2)


def test_accepts_conversation_objects():
    from prefect_tinker.recipes.datasets import Conversation

    r = get_renderer("smollm2", smollm2())
    a = r.build_supervised_example(Conversation(messages=CONV, source="x:1"))
    b = r.build_supervised_example(CONV)
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    assert isinstance(r.build_generation_prompt(CONV[:2]), tinker.ModelInput)
