"""``env=verifiers``: environments written with the verifiers library, defined by the tests on local
data (tests/verifiers_envs: a single-turn one with two weighted reward functions, a multi-turn
guessing game with ``env_response`` and its own stop condition), run through the environment's own
rollout loop with replies from a scripted sampler and from the real local server. Rewards are
compared with the rubric recomputed here from the recorded replies (plain regex and arithmetic,
not the environment's code); multi-turn observations hold the environment's messages and extend one
another; the example config runs through ``prefect-tinker run`` on tiny with its metrics in the store."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

pytest.importorskip(
    "verifiers", reason="the verifiers extra is not installed (pip install 'prefect-tinker[verifiers]')"
)

from prefect_tinker.cli.main import main as cli_main  # noqa: E402
from prefect_tinker.recipes.rl.advantages import groups_to_datums  # noqa: E402
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec  # noqa: E402
from prefect_tinker.recipes.rl.envs.verifiers_env import VerifiersEnv, VerifiersOptions, verifiers_rows  # noqa: E402
from prefect_tinker.recipes.rl.problem_env import load_renderer  # noqa: E402
from prefect_tinker.tasks.rollouts import run_group_rollout  # noqa: E402
from tests.scripted_policy import ScriptedSampler, tokenizer_dirs  # noqa: E402,F401

ENVS = Path(__file__).parent / "verifiers_envs"
SINGLE, MULTI = str(ENVS / "capital_single.py"), str(ENVS / "hot_cold.py")
END = "<|im_end|>"


def _builder(dirs, name, row=0, group_size=2, **options):
    """The group builder of dataset row ``row`` of the environment ``name``, built as the RL flow does."""
    ctx = EnvContext(renderer_name="chatml", tokenizer_id=dirs["tiny"], group_size=group_size, groups_per_batch=1)
    dataset = VerifiersEnv.build(EnvSpec(env="verifiers", env_options={"name": name, **options}), ctx)
    return dataset.make_builder(dataset.problems[row])


def _capital_reward(reply: str, answer: str) -> float:
    """The capital env's rubric, independently: 1.0 x (<answer> holds the city) + 0.25 x brevity."""
    m = re.search(r"<answer>\s*(.*?)\s*</answer>", reply, re.DOTALL)
    return float(bool(m) and m.group(1).strip() == answer) + 0.25 * max(0.0, 1.0 - len(reply) / 100.0)


def test_single_turn_rewards_are_the_rubric_of_the_recorded_replies(tokenizer_dirs):
    replies = ["<answer>Paris</answer>", "<answer>\nParis\n</answer> I am sure.", "Paris", "<answer>Lyon</answer>"]
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    sampler = ScriptedSampler(tok, [r + END for r in replies])
    builder = _builder(tokenizer_dirs, SINGLE, row=0, group_size=4)
    assert json.loads(builder.example)["answer"] == "Paris"
    group = run_group_rollout(sampler, builder, seed=0, max_tokens=64)
    assert group.errors == 0 and len(group.trajectories_G) == 4
    for traj, reply in zip(group.trajectories_G, replies, strict=True):
        (t,) = traj.transitions
        text = tok.decode(t.action_tokens, skip_special_tokens=False)
        assert text == reply + END  # member i got the i-th scripted reply, tokens as sampled
        assert t.episode_done and t.reward == pytest.approx(_capital_reward(reply, "Paris"))
        assert t.metrics["exact_answer"] == float(reply.startswith("<answer>") and "Paris" in reply)
        assert json.loads(t.logs["completion"]) == [{"role": "assistant", "content": reply}]
        prompt = tok.decode(t.observation, skip_special_tokens=False)
        assert "Reply as <answer>CITY</answer>." in prompt and "What is the capital of France?" in prompt
    # the datums train every sampled token with the sampler's logprob (one datum per episode)
    datums, _ = groups_to_datums([group])
    assert len(datums) == 4
    for d, (_, _, lps) in zip(datums, sampler.sampled, strict=True):
        got = d.to_datum().loss_fn_inputs["logprobs"].to_numpy()[d.mask.astype(bool)]
        assert got.tolist() == pytest.approx(lps, abs=1e-7)


def _bisect(prompt: str) -> str:
    """A guessing policy: bisect [1, 9] from the hints so far in the conversation."""
    lo, hi = 1, 9
    for guess, hint in re.findall(r"assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\n(Higher|Lower)\.", prompt):
        lo, hi = (int(guess) + 1, hi) if hint == "Higher" else (lo, int(guess) - 1)
    return f"{(lo + hi) // 2}{END}"


def test_multi_turn_observations_hold_the_env_messages_and_extend(tokenizer_dirs):
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    builder = _builder(tokenizer_dirs, MULTI, row=0, group_size=2)
    secret = int(json.loads(builder.example)["answer"])
    assert secret == 3
    group = run_group_rollout(ScriptedSampler(tok, _bisect), builder, seed=0, max_tokens=16)
    assert group.errors == 0 and len(group.trajectories_G) == 2
    for traj in group.trajectories_G:
        guesses = [
            int(tok.decode(t.action_tokens, skip_special_tokens=False).removesuffix(END)) for t in traj.transitions
        ]
        assert guesses == [5, 2, 3]  # bisection: 5 (lower), 2 (higher), 3
        texts = [tok.decode(t.observation, skip_special_tokens=False) for t in traj.transitions]
        assert texts[1].endswith(f"5{END}\n<|im_start|>user\nLower.{END}\n<|im_start|>assistant\n")
        assert texts[2].endswith(f"2{END}\n<|im_start|>user\nHigher.{END}\n<|im_start|>assistant\n")
        for prev, nxt in zip(traj.transitions, traj.transitions[1:], strict=False):  # each observation extends the last
            assert nxt.observation[: len(prev.observation) + len(prev.action_tokens)] == (
                prev.observation + prev.action_tokens
            )
        last = traj.transitions[-1]
        expected = 1.0 - 0.25 * (len(guesses) - 1) if guesses[-1] == secret else 0.0
        assert [t.reward for t in traj.transitions] == [0.0, 0.0, pytest.approx(expected)]
        assert last.metrics["found_fast"] == pytest.approx(0.5) and last.metrics["num_turns"] == 3.0
        assert last.logs["end"] in ("found", "has_final_env_response")
        assert json.loads(last.logs["completion"])[-1] == {"role": "user", "content": "Correct!"}
    datums, _ = groups_to_datums([group])  # one datum per episode: the sampled tokens masked in, the rest not
    assert len(datums) == 2
    assert datums[0].mask.sum() == sum(len(t.action_tokens) for t in group.trajectories_G[0].transitions)


def test_tool_env_calls_run_and_results_come_back_in_the_observation(tokenizer_dirs):
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    call = '<tool_call>\n{"name": "add_one", "arguments": {"x": 41}}\n</tool_call>'
    builder = _builder(tokenizer_dirs, str(ENVS / "add_one_tools.py"), row=0, group_size=1)
    group = run_group_rollout(ScriptedSampler(tok, [call + END, "It is 42." + END]), builder, seed=0, max_tokens=64)
    ((first, second),) = [t.transitions for t in group.trajectories_G]
    assert '"name": "add_one"' in tok.decode(first.observation, skip_special_tokens=False)  # the tool's schema
    assert tok.decode(second.observation, skip_special_tokens=False).endswith(
        f"{call}{END}\n<|im_start|>tool\n<tool_response>\n42\n</tool_response>{END}\n<|im_start|>assistant\n"
    )
    assert second.observation[: len(first.observation) + len(first.action_tokens)] == (
        first.observation + first.action_tokens
    )
    assert (first.reward, second.reward) == (0.0, 1.0)
    assert second.metrics["used_tool"] == 1.0 and second.metrics["add_one_calls"] == 1.0


def test_max_turns_option_overrides_the_environment(tokenizer_dirs):
    tok = load_renderer("chatml", tokenizer_dirs["tiny"]).tokenizer
    builder = _builder(tokenizer_dirs, MULTI, row=0, group_size=1, max_turns=2)
    group = run_group_rollout(ScriptedSampler(tok, _bisect), builder, seed=0, max_tokens=16)
    (traj,) = group.trajectories_G
    assert len(traj.transitions) == 2 and traj.transitions[-1].reward == 0.0
    assert traj.transitions[-1].logs["end"] == "max_turns_reached"


def test_loading_leaves_signal_handlers_alone_and_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    from prefect_tinker.recipes.rl.verifiers_bridge import load_verifiers_environment

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    env = load_verifiers_environment(SINGLE, {"n": 2})
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with ThreadPoolExecutor(1) as pool:  # a rollout task's worker thread (Python allows signal() in the main one only)
        other = pool.submit(load_verifiers_environment, SINGLE, {"n": 5}).result()
    assert len(env.get_dataset()) == 2 and len(other.get_dataset()) == 5
    assert load_verifiers_environment(SINGLE, {"n": 2}) is env  # once per process


def test_bad_options_fail_before_the_run(tmp_path):
    with pytest.raises(ValueError, match=r"env_options.name.*does not exist"):
        EnvSpec(env="verifiers", env_options={"name": str(tmp_path / "missing.py")})
    with pytest.raises(ValueError, match=r"env_options.nme"):
        EnvSpec(env="verifiers", env_options={"nme": SINGLE})
    with pytest.raises(ValueError, match=r"cannot load verifiers environment 'no-such-env'"):
        verifiers_rows(VerifiersOptions(name="no-such-env"))
    rows = verifiers_rows(VerifiersOptions(name=SINGLE, env_args={"n": 3}))
    assert [r["answer"] for r in rows] == ["Paris", "Tokyo", "Rome"]


def test_example_config_runs_on_tiny_and_store_rewards_are_the_rubric(prefect_api, local_credentials, tmp_path, capsys):
    store = tmp_path / "store"
    rc = cli_main(
        [
            "run",
            "rl",
            "--example",
            "verifiers_reverse_word",
            "max_steps=2",
            "group_size=2",
            "groups_per_batch=2",
            "max_tokens=16",
            "save_every=0",
            "run_name=vf",
            f"store={store}",
            "lora_rank=8",
            "env_options.eval_examples=2",
            f"backend.local_root={local_credentials.local_root}",
        ]
    )
    assert rc in (0, None)
    capsys.readouterr()
    assert cli_main(
        [
            "sql",
            "--store",
            str(store),
            "--json",
            "SELECT step, name, value FROM metrics WHERE run_id='vf' AND name LIKE 'env/%'",
        ]
    ) in (0, None)
    by = {(r["step"], r["name"]): r["value"] for r in json.loads(capsys.readouterr().out)}
    capsys.readouterr()
    assert cli_main(
        [
            "sql",
            "--store",
            str(store),
            "--json",
            "SELECT step, name, value FROM metrics WHERE run_id='vf' AND name LIKE 'test/verifiers/%'",
        ]
    ) in (0, None)
    evals = {(r["step"], r["name"]): r["value"] for r in json.loads(capsys.readouterr().out)}
    for step in (0, 2):  # the eval set (2 rows of the eval_dataset) at the start and the end
        assert evals[(step, "test/verifiers/trajectories")] == 2.0 and evals[(step, "test/verifiers/errors")] == 0.0
        assert 0.0 <= evals[(step, "test/verifiers/reward_mean")] <= 1.2
    for step in (0, 1):
        assert 0.0 <= by[(step, "env/exact_answer")] <= 1.0 and 0.0 <= by[(step, "env/tagged")] <= 1.0
        assert by[(step, "env/reward_mean")] == pytest.approx(
            by[(step, "env/exact_answer")] + 0.2 * by[(step, "env/tagged")]
        )
    assert cli_main(
        [
            "sql",
            "--store",
            str(store),
            "--json",
            "SELECT response, reward, metrics_json FROM trajectories WHERE run_id='vf'",
        ]
    ) in (0, None)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8
    for t in rows:  # the rubric recomputed from the recorded reply: 1.0 x exact reversed word + 0.2 x tagged
        info = json.loads(t["metrics_json"])
        (reply,) = [m["content"] for m in json.loads(info["completion"]) if m["role"] == "assistant"]
        assert t["response"].startswith(reply)
        m = re.search(r"<answer>\s*(.*?)\s*</answer>", reply, re.DOTALL)
        expected = float(bool(m) and m.group(1).strip().lower() == info["reference"]) + 0.2 * float(bool(m))
        assert t["reward"] == pytest.approx(expected)
