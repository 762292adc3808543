"""Qwen3 and Llama 3 renderers against the formats those families document.

Their tokenizers cannot be loaded offline, so the expected strings below are written by hand from
the documented templates (Qwen3: the chat template in the models' tokenizer_config.json and
https://qwen.readthedocs.io/en/latest/framework/function_call.html; Llama 3:
https://www.llama.com/docs/model-cards-and-prompt-formats/meta-llama-3/), and the renderers run on
the SmolLM2 tokenizer extended with each family's special tokens.  Tokens must equal the joint
encoding of the expected text; the decoded text must equal it exactly.
"""

from __future__ import annotations

import pytest

from prefect_tinker.recipes.renderers import RendererError, Termination, get_renderer, parse_tool_calls
from tests.renderer_tokenizers import (
    decode,
    encode,
    llama3_like,
    needs_smollm2,
    qwen3_like,
    trained_runs,
)

pytestmark = needs_smollm2

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "Again, add."},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    },
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "21°C"},
    {"role": "assistant", "content": "Paris 18°C, Zürich 21°C."},
]
TOOLS_SYSTEM = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _check(tok, model_input, expected: str) -> None:
    assert decode(tok, model_input.to_ints()) == expected
    assert model_input.to_ints() == encode(tok, expected)


def test_qwen3_thinking_multiturn_drops_past_reasoning():
    tok = qwen3_like()
    r = get_renderer("qwen3", tok)
    mi, w = r.build_supervised_example(CONV)
    _check(tok, mi, (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nAgain, add.\n</think>\n\n6<|im_end|>\n"
    ))
    assert trained_runs(tok, mi, w) == ["4<|im_end|>", "<think>\nAgain, add.\n</think>\n\n6<|im_end|>"]
    _check(tok, r.build_generation_prompt(CONV[:4]), (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    ))
    # reasoning given inline as a <think> prefix of content: the same message where content may
    # hold markup (special_tokens_in_content=True, as the template reads it); by default it is text
    inline = CONV[:4] + [{"role": "assistant", "content": "<think>\nAgain, add.\n</think>\n\n6"}]
    assert get_renderer("qwen3", tok, special_tokens_in_content=True).build_supervised_example(inline)[0] == mi
    as_text = r.build_supervised_example(inline)[0].to_ints()
    think = tok.convert_tokens_to_ids("<think>")
    assert as_text.count(think) == 1  # only the (empty) think block the renderer writes
    assert decode(tok, as_text).endswith("<think>\n\n</think>\n\n<think>\nAgain, add.\n</think>\n\n6<|im_end|>\n")
    # keeping history reasoning: every turn rendered as sampled
    keep = get_renderer("qwen3", tok, strip_thinking_from_history=False)
    text = decode(tok, keep.build_supervised_example(CONV)[0].to_ints())
    assert "<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>" in text


def test_qwen3_last_reply_without_reasoning_gets_an_empty_think_block():
    tok = qwen3_like()
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    think, nothink = get_renderer("qwen3", tok), get_renderer("qwen3_disable_thinking", tok)
    for r in (think, nothink):
        _check(tok, r.build_supervised_example(conv)[0], expected)
    _check(tok, think.build_generation_prompt(conv[:1]), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    _check(tok, nothink.build_generation_prompt(conv[:1]),
           "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # thinking: the (empty) think block is the model's to write; disabled: it belongs to the prompt
    assert trained_runs(tok, *think.build_supervised_example(conv)) == ["<think>\n\n</think>\n\nHello<|im_end|>"]
    assert trained_runs(tok, *nothink.build_supervised_example(conv)) == ["Hello<|im_end|>"]


@pytest.mark.parametrize("with_system", [False, True])
def test_qwen3_tools_calls_and_results(with_system):
    tok = qwen3_like()
    r = get_renderer("qwen3", tok)
    conv = ([{"role": "system", "content": "Use tools."}] if with_system else []) + TOOL_CONV
    system = TOOLS_SYSTEM.replace("system\n# Tools", "system\nUse tools.\n\n# Tools") if with_system else TOOLS_SYSTEM
    calls = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    )
    expected = system + (
        "<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n"
        f"<|im_start|>assistant\n{calls}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\n21°C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nParis 18°C, Zürich 21°C.<|im_end|>\n"
    )
    mi, w = r.build_supervised_example(conv, "last_assistant_turn", tools=[WEATHER])
    _check(tok, mi, expected)
    assert trained_runs(tok, mi, w) == [
        f"{calls}<|im_end|>",
        "<think>\n\n</think>\n\nParis 18°C, Zürich 21°C.<|im_end|>",
    ]
    # the tool-call turn parses back into the same calls
    k = len(conv) - 4
    prompt = r.build_generation_prompt(conv[:k], tools=[WEATHER]).to_ints()
    full = r.build_supervised_example(conv[: k + 1], tools=[WEATHER])[0].to_ints()
    assert full[: len(prompt)] == prompt
    parsed = r.parse_response(full[len(prompt):])
    assert parsed.termination is Termination.STOP_SEQUENCE
    assert parsed.message["tool_calls"] == TOOL_CONV[1]["tool_calls"] and parsed.message["content"] == ""
    # content before the calls is separated from them by one newline
    msg = {"role": "assistant", "content": "Checking.", "tool_calls": TOOL_CONV[1]["tool_calls"][:1]}
    text = decode(tok, r.build_supervised_example([TOOL_CONV[0], msg])[0].to_ints())
    assert text.endswith(
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )


def test_qwen3_parse_reasoning_round_trip_and_malformed():
    tok = qwen3_like()
    r = get_renderer("qwen3", tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = r.build_generation_prompt(CONV[:4]).to_ints()
    full = r.build_supervised_example(CONV)[0].to_ints()
    parsed = r.parse_response(full[len(prompt):])
    assert parsed == ({"role": "assistant", "content": "6", "reasoning_content": "Again, add."}, "stop_sequence")
    # re-rendering the parsed message reproduces the sampled tokens
    assert r.build_supervised_example(CONV[:4] + [parsed.message])[0].to_ints() == full
    bad_json = encode(tok, '<think>\nx\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>') + [
        im_end
    ]
    assert r.parse_response(bad_json).termination is Termination.MALFORMED
    unclosed = encode(tok, "<think>\nstill thinking") + [im_end]
    out = r.parse_response(unclosed)
    assert out.termination is Termination.MALFORMED and out.message["content"] == "<think>\nstill thinking"
    assert r.parse_response(encode(tok, "<think>\nhmm")).termination is Termination.TRUNCATED
    assert parse_tool_calls('a\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>') == (
        "a", [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}], True
    )
    assert parse_tool_calls("<tool_call>\n{}\n</tool_call>")[2] is False


def test_llama3_documented_format():
    tok = llama3_like()
    r = get_renderer("llama3", tok)
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "Ça va ? 🙂"},
        {"role": "assistant", "content": "Oui."},
    ]
    mi, w = r.build_supervised_example(conv)
    _check(tok, mi, (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nÇa va ? 🙂<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nOui.<|eot_id|>"
    ))
    assert trained_runs(tok, mi, w) == ["4.<|eot_id|>", "Oui.<|eot_id|>"]
    _check(tok, r.build_generation_prompt(conv[:2]), (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ))
    eot, eom = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|eom_id|>")
    assert r.get_stop_sequences() == [eot, eom]
    all_msgs = r.build_supervised_example(conv, "all_messages")[1]
    assert all_msgs[0] == 0 and all_msgs[1:].all()  # BOS is not part of any message
    assert r.build_supervised_example(conv, "all_tokens")[1].all()
    tool = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "call"},
            {"role": "tool", "content": "{\"x\": 1}"}, {"role": "assistant", "content": "done"}]
    # tool results as Llama 3.1's template writes them: through tojson, a quoted JSON string
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"x\\": 1}"<|eot_id|>' in decode(
        tok, r.build_supervised_example(tool)[0].to_ints())
    end_of_text = tok.convert_tokens_to_ids("<|end_of_text|>")
    assert r.parse_response(encode(tok, "Oui.") + [end_of_text]).termination is Termination.END_OF_SEQUENCE
    with pytest.raises(RendererError, match="llama3 declares tools in the first user message"):
        r.build_supervised_example([conv[0], conv[2]], tools=[WEATHER])
