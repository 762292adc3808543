"""Token usage and cost metrics, provenance spans of RL datums, and the ``numerics_check``
environment (offline: scripted policies, no server)."""

from __future__ import annotations

import pytest
import tinker

from prefect_tinker.recipes.pricing import TokenPrices, UsageTotals, price_for, step_cost
from prefect_tinker.recipes.rl.advantages import trajectory_to_datums
from prefect_tinker.recipes.rl.envs import EnvSpec, build_rl_dataset
from prefect_tinker.recipes.rl.envs.numerics_check import closeness_reward, count_word, parse_count
from prefect_tinker.recipes.rl.types import Trajectory, Transition
from prefect_tinker.tasks.rollouts import run_group_rollout
from tests.scripted_policy import ScriptedSampler, tokenizer_dirs  # noqa: F401


def test_step_cost_and_totals():
    prices = TokenPrices(prefill=0.2, prefill_cached=0.05, sample=0.6, train=1.8)
    tokens = {"sampled": 1000, "prefill_cached": 4000, "prefill_uncached": 6000, "trained": 11000}
    want = (1000 * 0.6 + 4000 * 0.05 + 6000 * 0.2 + 11000 * 1.8) / 1e6
    assert step_cost(prices, tokens) == pytest.approx(want, rel=1e-12)
    assert step_cost(TokenPrices(prefill=0.2), {"prefill_cached": 1e6}) == pytest.approx(0.2)  # no discount set
    assert price_for({}, "tiny") == TokenPrices() and step_cost(price_for({}, "tiny"), tokens) == 0.0

    totals = UsageTotals(prices, start={"tokens/trained_total": 5.0, "cost/total_usd": 1.0})
    m0 = totals.add(0, {"tokens/trained": 10, "tokens/sampled": 2})
    assert m0["tokens/prefill_cached"] == 0.0 and m0["tokens/trained_total"] == 15.0
    m1 = totals.add(1, {"tokens/trained": 20})
    assert m1["tokens/trained_total"] == 35.0 and m1["tokens/sampled_total"] == 2.0
    assert m1["cost/total_usd"] == pytest.approx(1.0 + (10 * 1.8 + 2 * 0.6 + 20 * 1.8) / 1e6)
    totals.rewind(1)  # step 1 will be redone: its tokens leave the totals
    assert totals.add(1, {"tokens/trained": 1})["tokens/trained_total"] == 16.0


def _check_tiling(spans, values, records):
    """What the server checks, computed independently: the spans tile ``values`` and each run equals
    the recorded prompt / sampled tokens of its sequence."""
    pos = 0
    for span in spans:
        prompt, sampled = records[span.sequence_id]
        source = prompt if isinstance(span, tinker.PromptProvenanceSpan) else sampled
        assert list(values[pos:pos + span.length]) == source[span.offset:span.offset + span.length]
        pos += span.length
    assert pos == len(values)


def test_provenance_spans_tile_a_multi_turn_datum():
    ob1, a1 = [1, 2, 3, 4], [5, 6]
    ob2 = ob1 + a1 + [7, 8, 9]  # extends turn 1: one datum
    a2 = [10, 11, 12]
    records = {"s1": (ob1, a1), "s2": (ob2, a2)}
    traj = Trajectory([Transition(ob1, a1, [-0.5, -0.6], 0.0, False, sequence_id="s1"),
                       Transition(ob2, a2, [-0.1, -0.2, -0.3], 1.0, True, sequence_id="s2")])
    (d,) = trajectory_to_datums(traj, 0.5)
    assert d.spans == [("prompt", "s1", 0, 4), ("sampled", "s1", 0, 2), ("prompt", "s2", 6, 3), ("sampled", "s2", 0, 3)]
    datum = d.to_datum(provenance=True)
    tokens = ob2 + a2
    _check_tiling(datum.model_input_spans, tokens[:-1], records)
    _check_tiling(datum.loss_fn_input_spans, tokens[1:], records)
    assert d.to_datum().model_input_spans is None  # provenance only when asked for

    anonymous = Trajectory([Transition(ob1, a1, [-0.5, -0.6], 1.0, True)])
    (a,) = trajectory_to_datums(anonymous, 1.0)
    with pytest.raises(ValueError, match="sequence_id"):
        a.to_datum(provenance=True)


def test_numerics_check_text_helpers():
    assert count_word("Until then, until-now; UNTIL's untill until", "until") == 4
    assert parse_count("running 3... Answer: 1,204") == 1204 and parse_count("no number") is None
    assert closeness_reward(10, 10, 0.2) == 1.0 and closeness_reward(11, 10, 0.2) == pytest.approx(0.5)
    assert closeness_reward(20, 10, 0.2) == 0.0


def test_numerics_check_episodes_are_long_whatever_the_policy_writes(tokenizer_dirs):  # noqa: F811
    from transformers import AutoTokenizer

    tok_dir = tokenizer_dirs["smollm2"]
    spec = EnvSpec(env="numerics_check", env_options={"num_pages_min": 3, "num_pages_max": 4, "page_words": 30})
    make = lambda: build_rl_dataset(spec, renderer_name="chatml", tokenizer_id=tok_dir, group_size=2,  # noqa: E731
                                    groups_per_batch=2, seed=3)
    builder = make().get_batch(0)[0]
    assert builder == make().get_batch(0)[0]  # a pure function of the seed and the group's place
    n, truth = len(builder.pages), sum(count_word(p, builder.word) for p in builder.pages)
    assert all(len(p.split()) == 30 for p in builder.pages) and 3 <= n <= 4
    answers = [f"Answer: {truth}", "I lost count"]  # member 0 counts right, member 1 never answers

    def reply(prompt: str) -> str:
        last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
        return (answers.pop(0) if "last page" in last_user else "ok") + "<|im_end|>"

    sampler = ScriptedSampler(AutoTokenizer.from_pretrained(tok_dir), reply)
    group = run_group_rollout(sampler, builder, seed=0, max_tokens=8)
    assert [len(t.transitions) for t in group.trajectories_G] == [n + 1, n + 1]
    assert group.total_rewards() == [1.0, 0.0]
    assert group.trajectories_G[0].transitions[-1].metrics["true_count"] == truth
    # one datum per episode: every observation extends the sequence so far
    (d,) = trajectory_to_datums(group.trajectories_G[0], 1.0)
    assert int(d.mask.sum()) == sum(len(t.action_tokens) for t in group.trajectories_G[0].transitions)
    # usage: every request's prompt once (the shared first prompt of the group once), every sampled token
    assert len(sampler.calls) == 1 + 2 * n
    assert group.usage["sampled"] == sum(len(s[1]) for s in sampler.sampled)
    assert group.usage["prefill_uncached"] == sum(len(c[0]) for c in sampler.calls)
    assert group.usage["prefill_cached"] == 0.0


def test_numerics_check_options_are_checked():
    with pytest.raises(ValueError, match="num_pages_min"):
        EnvSpec(env="numerics_check", env_options={"num_pages_min": 9, "num_pages_max": 4})
    with pytest.raises(ValueError, match="max_turns"):
        EnvSpec(env="numerics_check", env_options={"max_turns": 3})
    with pytest.raises(ValueError, match="no such file"):
        EnvSpec(env="numerics_check", env_options={"corpus": "/nonexistent/corpus.txt"})
