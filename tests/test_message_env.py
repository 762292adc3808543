"""Multi-turn message environments driven by scripted policies (fixed replies through a stand-in
for the SDK's sampling client): rewards, turn counts, the endings (parse failure, context overflow,
turns run out), tool errors and timeouts as tool results, and the token layout of the datums the
RL flow builds, each compared with an expectation computed independently (full renderings of the
conversation, positions counted from the sampled tokens)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from prefect_tinker.recipes.renderers import get_renderer
from prefect_tinker.recipes.rl.advantages import groups_to_datums, rollout_metrics
from prefect_tinker.recipes.rl.envs.calculator import CALCULATOR_SYSTEM, CalculatorBuilder
from prefect_tinker.recipes.rl.message_env import (
    EPISODE_TURNS_LIMIT, EpisodeLimits, MessageEnv, MessageGroupBuilder, Reaction, freeze, thaw,
)
from prefect_tinker.recipes.rl.problem_env import Problem, load_renderer
from prefect_tinker.recipes.tools import Toolset, calculator, tool
from prefect_tinker.tasks.rollouts import MAX_TURNS, run_group_rollout
from tests.scripted_policy import ScriptedSampler, completed, tokenizer_dirs  # noqa: F401

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'
END = "<|im_end|>"


def _calc_builder(dirs, renderer="chatml", G=2, limits=EpisodeLimits(), question="What is 12 * 7?", answer="84"):
    return CalculatorBuilder(
        problem=Problem(question, answer, "q1"),
        prefix=freeze([{"role": "system", "content": CALCULATOR_SYSTEM}]),
        group_size=G,
        renderer_name=renderer,
        tokenizer_id=dirs["tiny" if renderer == "chatml" else renderer],
        limits=limits,
    )


def _text(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def test_calculator_episode_token_layout_and_datums(tokenizer_dirs):
    builder = _calc_builder(tokenizer_dirs)
    renderer = load_renderer("chatml", tokenizer_dirs["tiny"])
    tok = renderer.tokenizer
    # call 1 samples both members' first turn; then member 0's and member 1's second turns
    sampler = ScriptedSampler(tok, [CALL.format("12 * 7"), CALL.format("12 * 7"),
                                    "12 * 7 = 84\n#### 84" + END, "I think\n#### 85" + END])
    group = run_group_rollout(sampler, builder, seed=3, max_tokens=64)
    assert group.errors == 0 and [len(t.transitions) for t in group.trajectories_G] == [2, 2]
    assert group.total_rewards() == [1.0, 0.0]  # correct; well-formed but wrong

    conv = [{"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": "What is 12 * 7?"}]
    schemas = Toolset([calculator]).schemas
    prompt = renderer.build_generation_prompt(conv, tools=schemas).to_ints()
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}}
    after = conv + [{"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "84", "name": "calculator"}]
    full = renderer.build_generation_prompt(after, tools=schemas).to_ints()
    for traj, (_, a2, lp2) in zip(group.trajectories_G, sampler.sampled[2:], strict=False):
        t1, t2 = traj.transitions
        assert t1.observation == prompt and t1.reward == 0.0 and not t1.episode_done and t1.metrics == {}
        a1 = t1.action_tokens
        assert t2.observation[: len(prompt) + len(a1)] == prompt + a1  # extends the sequence so far
        assert _text(tok, t2.observation) == _text(tok, full)  # = the whole conversation rendered
        assert "<tool_response>\n84\n</tool_response>" in _text(tok, t2.observation[len(prompt) + len(a1):])
        assert t2.action_tokens == a2 and t2.action_logprobs == lp2 and t2.episode_done
        assert t2.metrics["tool_calls"] == 1.0 and t2.metrics["tool_errors"] == 0.0
    assert [t.transitions[1].metrics["correct"] for t in group.trajectories_G] == [1.0, 0.0]

    # the datums the RL flow trains on: one per episode, sampled tokens only, own logprobs, A = R - mean
    datums, advs = groups_to_datums([group])
    assert len(datums) == 2 and advs[0].tolist() == [0.5, -0.5]
    for d, traj, adv in zip(datums, group.trajectories_G, advs[0], strict=True):
        t1, t2 = traj.transitions
        seq = t2.observation + t2.action_tokens
        assert d.tokens == seq
        mask = np.zeros(len(seq) - 1)
        lps = np.zeros(len(seq) - 1)
        for start, t in ((len(t1.observation), t1), (len(t2.observation), t2)):
            mask[start - 1: start - 1 + len(t.action_tokens)] = 1.0  # position i predicts token i+1
            lps[start - 1: start - 1 + len(t.action_tokens)] = t.action_logprobs
        datum = d.to_datum()
        ins = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
        assert datum.model_input.to_ints() == seq[:-1] and ins["target_tokens"].tolist() == seq[1:]
        assert ins["advantages"] == pytest.approx(adv * mask) and d.mask.tolist() == mask.tolist()
        assert ins["logprobs"] == pytest.approx(lps, abs=1e-7)
        assert mask.sum() == len(t1.action_tokens) + len(t2.action_tokens)
    m = rollout_metrics([group])
    assert m["tool_calls"] == 1.0 and m["correct_rate"] == 0.5 and m["turns_per_episode"] == 2.0


@tool(timeout_s=0.3)
def slow_lookup(key: str) -> str:
    """Look a key up (slowly).

    Args:
        key: what to look up.
    """
    time.sleep(3)
    return key


class _ToolsEnv(MessageEnv):
    def finish(self, reply):
        return Reaction(done=True, reward=float("done" in reply["content"]), metrics={"correct": 1.0})


class _ToolsBuilder(MessageGroupBuilder):
    def make_env(self, renderer):
        return _ToolsEnv(renderer, [{"role": "user", "content": "go"}], toolset=Toolset([calculator, slow_lookup]),
                         limits=self.limits)


def test_tool_errors_and_timeouts_come_back_as_tool_results(tokenizer_dirs):
    from dataclasses import dataclass

    builder = dataclass(frozen=True, kw_only=True)(_ToolsBuilder)(group_size=1, renderer_name="chatml",
                                                                 tokenizer_id=tokenizer_dirs["tiny"])
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    two_calls = (CALL.format("1 / 0").removesuffix(END) + "\n"
                 + '<tool_call>\n{"name": "slow_lookup", "arguments": {"key": "k"}}\n</tool_call>' + END)
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>' + END
    sampler = ScriptedSampler(tok, [two_calls, unknown, "done" + END])
    t0 = time.monotonic()
    group = run_group_rollout(sampler, builder, seed=0, max_tokens=64)
    assert time.monotonic() - t0 < 2.5  # the 3 s tool was cut at its 0.3 s timeout
    (traj,) = group.trajectories_G
    assert group.errors == 0 and len(traj.transitions) == 3 and group.total_rewards() == [1.0]
    ob2 = _text(tok, traj.transitions[1].observation)
    assert "Error: calculator failed: CalculatorError: division by zero" in ob2
    assert "Error: slow_lookup timed out after 0.3 s" in ob2
    assert "Error: unknown tool 'nope'" in _text(tok, traj.transitions[2].observation)
    last = traj.transitions[2].metrics
    assert (last["tool_calls"], last["tool_errors"], last["parse_failed"]) == (3.0, 3.0, 0.0)


@pytest.mark.parametrize("reply, stop_reason", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": 1+}\n</tool_call>' + END, "stop"),
    ("<tool_call>\n{\"name\": \"calculator\"", "length"),  # cut off at max_tokens: no stop token
])
def test_unparsable_reply_ends_the_episode_with_failed_parse_reward(tokenizer_dirs, reply, stop_reason):
    limits = EpisodeLimits(failed_parse_reward=-0.7)
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    sampler = ScriptedSampler(tok, [CALL.format("2 + 2"), reply])
    sampler_turns = iter([("stop"), stop_reason])
    orig = sampler.sample

    def sample(prompt, num_samples, sampling_params):
        out = orig(prompt, num_samples, sampling_params).result()
        for s in out.sequences:
            s.stop_reason = next(sampler_turns)
        return completed(out)

    sampler.sample = sample
    group = run_group_rollout(sampler, _calc_builder(tokenizer_dirs, G=1, limits=limits), seed=0, max_tokens=64)
    (traj,) = group.trajectories_G
    assert len(traj.transitions) == 2 and traj.transitions[1].episode_done
    assert group.total_rewards() == [-0.7]
    m = traj.transitions[1].metrics
    assert m["parse_failed"] == 1.0 and m["tool_calls"] == 1.0 and traj.transitions[1].logs["end"] == "parse_failure"
    (d,) = groups_to_datums([group])[0]  # both replies still trained, in one datum
    assert d.mask.sum() == sum(len(t.action_tokens) for t in traj.transitions)


def test_over_long_trajectory_ends_with_context_overflow_reward(tokenizer_dirs):
    renderer = load_renderer("chatml", tokenizer_dirs["tiny"])
    tok = renderer.tokenizer
    probe = _calc_builder(tokenizer_dirs, G=1).make_envs()[0]
    prompt_len = len(probe.initial_observation()[0])
    call = CALL.format("123456789 * 987654321")
    room = prompt_len + len(tok.encode(call, add_special_tokens=False)) + 5  # the tool result does not fit
    limits = EpisodeLimits(max_trajectory_tokens=room, context_overflow_reward=-0.3)
    group = run_group_rollout(ScriptedSampler(tok, [call]), _calc_builder(tokenizer_dirs, G=1, limits=limits),
                              seed=0, max_tokens=64)
    (traj,) = group.trajectories_G
    assert len(traj.transitions) == 1 and traj.transitions[0].episode_done and group.total_rewards() == [-0.3]
    assert (
        traj.transitions[0].metrics["context_overflow"] == 1.0 and traj.transitions[0].logs["end"] == "context_overflow"
    )


def test_turns_run_out_after_max_turns(tokenizer_dirs):
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    limits = EpisodeLimits(max_turns=3)
    group = run_group_rollout(ScriptedSampler(tok, lambda prompt: CALL.format("1 + 1")),
                              _calc_builder(tokenizer_dirs, G=1, limits=limits), seed=0, max_tokens=64)
    (traj,) = group.trajectories_G
    assert len(traj.transitions) == 3 and group.total_rewards() == [0.0]
    m = traj.transitions[-1].metrics
    assert m["max_turns_reached"] == 1.0 and m["tool_calls"] == 3.0 and m["correct"] == m["format"] == 0.0
    assert EPISODE_TURNS_LIMIT == MAX_TURNS


def _reply_tokens(renderer, conv, reply, tools):
    """What a model following the format samples for ``reply``: the supervised rendering after the
    generation prompt, through the first stop (token or string)."""
    prompt = renderer.build_generation_prompt(conv, tools=tools).to_ints()
    full = renderer.build_supervised_example(conv + [reply], tools=tools)[0].to_ints()
    assert full[: len(prompt)] == prompt
    tail = full[len(prompt):]
    stops = renderer.get_stop_sequences()
    ids = {s for s in stops if isinstance(s, int)}
    cut = next((i + 1 for i, t in enumerate(tail) if t in ids), len(tail))
    return prompt, tail[:cut]


@pytest.mark.parametrize("name", ["chatml", "smollm2", "qwen3", "llama3", "role_colon"])
def test_each_observation_extends_the_last_in_every_renderer_family(tokenizer_dirs, name):
    tid = tokenizer_dirs[{"chatml": "tiny", "role_colon": "tiny"}.get(name, name)]
    renderer = get_renderer(name, load_renderer(name, tid).tokenizer)
    tools = None if name == "role_colon" else Toolset([calculator]).schemas
    conv = [{"role": "user", "content": "What is 6 * 7?"}]
    if tools:
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}
            ],
        }
        new = [{"role": "tool", "content": "42", "name": "calculator"}]
    else:
        reply, new = {"role": "assistant", "content": "Is it 42?"}, [{"role": "user", "content": "Yes."}]
    env = _ToolsEnv(renderer, conv, toolset=Toolset([calculator]) if tools else None)
    prompt, action = _reply_tokens(renderer, conv, reply, tools)
    assert env.initial_observation()[0] == prompt
    res = env.step(action)
    if tools:
        assert not res.episode_done
        nxt = res.next_observation
    else:  # a plain reply ends _ToolsEnv's episode: continue it by hand as a game would
        env.messages, env._observation = conv + [reply], None
        env.add_messages(new)
        nxt = env.observe()
    assert nxt[: len(prompt) + len(action)] == prompt + action
    expected = renderer.build_generation_prompt(conv + [reply] + new, tools=tools).to_ints()
    tok = renderer.tokenizer
    if name.startswith("qwen3"):  # history loses the empty think block of the sampled reply
        assert _text(tok, nxt[len(prompt) + len(action):]) == \
            "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    else:
        assert _text(tok, nxt) == _text(tok, expected)


def test_builders_pickle_with_a_stable_repr(tokenizer_dirs):
    import pickle

    b = _calc_builder(tokenizer_dirs)
    assert pickle.loads(pickle.dumps(b)) == b and repr(pickle.loads(pickle.dumps(b))) == repr(b)
    assert b.cache_key() == _calc_builder(tokenizer_dirs).cache_key()
    assert b.cache_key() != _calc_builder(tokenizer_dirs, answer="85").cache_key()
    msgs = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2]}}}]}
    ]
    assert thaw(freeze(msgs)) == msgs and hash(freeze(msgs))


def test_a_reply_the_renderer_cannot_write_back_ends_as_a_parse_failure(tokenizer_dirs):
    from prefect_tinker.recipes.renderers import ChatMLRenderer, RendererError

    class Strict(ChatMLRenderer):  # a format that refuses tool results (as llama3 refuses text + call)
        def _segments(self, messages, tools):
            if any(m["role"] == "tool" for m in messages):
                raise RendererError("no tool results here")
            return super()._segments(messages, tools)

    renderer = Strict(load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer)
    env = _ToolsEnv(renderer, [{"role": "user", "content": "go"}], toolset=Toolset([calculator]),
                    limits=EpisodeLimits(failed_parse_reward=-0.4))
    env.initial_observation()
    res = env.step(renderer.tokenizer.encode(CALL.format("1 + 1"), add_special_tokens=False))
    assert res.episode_done and res.reward == -0.4 and res.metrics["parse_failed"] == 1.0
    assert res.metrics["tool_calls"] == 1.0 and "no tool results here" in res.logs["detail"]


def test_calculator_solution_transcript_is_an_episode_the_env_rewards(tokenizer_dirs, tmp_path):
    """A GSM8K-annotated solution read as ``format=calculator_solution`` renders to exactly the
    tokens of a calculator-env episode whose replies are its assistant turns (prompt, tool
    results and headers untrained), and that episode gets reward 1; a refused annotation names
    the file, line and field."""
    from prefect_tinker.recipes.data_pipeline import render_example
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_conversations
    from prefect_tinker.recipes.data_sources import DatasetFormatError

    question = "Natalia sold clips to 48 friends in April and half as many in May. How many in all?"
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips in all.\n#### 72"
    path = tmp_path / "gsm.jsonl"
    path.write_text(f'{{"question": "{question}", "answer": {solution!r}}}\n'.replace("'", '"')
                    + '{"question": "q", "answer": "3 apples x 2 = <<3x2=6>>6\\n#### 6"}\n')
    conv = next(iter_conversations(SourceSpec(path=str(path), format="calculator_solution")))
    call = lambda e: [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}]  # noqa: E731
    assert conv.messages == [
        {"role": "system", "content": CALCULATOR_SYSTEM}, {"role": "user", "content": question},
        {"role": "assistant", "content": "Natalia sold 48/2 =", "tool_calls": call("48/2")},
        {"role": "tool", "content": "24", "name": "calculator"},
        {"role": "assistant", "content": "24 clips in May.\nShe sold 48+24 =", "tool_calls": call("48+24")},
        {"role": "tool", "content": "72", "name": "calculator"},
        {"role": "assistant", "content": "72 clips in all.\n#### 72"}]
    assert conv.metadata["tools"] == Toolset([calculator]).schemas
    with pytest.raises(DatasetFormatError, match=r"gsm.jsonl:2: field 'answer' annotation <<3x2=6>>"):
        list(iter_conversations(SourceSpec(path=str(path), format="calculator_solution")))

    renderer = load_renderer("chatml", tokenizer_dirs["tiny"])
    tokens, weights = render_example(renderer, conv, train_on_what="all_assistant_messages")
    tok = renderer.tokenizer
    spans, i = [], 0  # the trained runs: the assistant's replies, each ending on <|im_end|>
    while i < len(weights):
        if weights[i] > 0:
            j = i
            while j < len(weights) and weights[j] > 0:
                j += 1
            spans.append(_text(tok, tokens[i:j]))
            i = j
        i += 1
    assert len(spans) == 3 and all(s.endswith(END) for s in spans)
    builder = _calc_builder(tokenizer_dirs, G=2, question=question, answer="72")
    reply = lambda prompt: spans[prompt.count("<tool_response>")]  # noqa: E731  (turn n follows n results)
    group = run_group_rollout(ScriptedSampler(tok, reply), builder, seed=0, max_tokens=128)
    assert group.total_rewards() == [1.0, 1.0]
    for traj in group.trajectories_G:
        last = traj.transitions[-1]
        assert len(traj.transitions) == 3 and last.metrics["tool_calls"] == 2.0 and last.metrics["tool_errors"] == 0.0
        seq = last.observation + last.action_tokens
        assert list(tokens[: len(seq)]) == seq  # the SFT example is this episode,
        assert _text(tok, tokens[len(seq):]) == "\n" and not weights[len(seq):].any()  # + ChatML's untrained "\n"
