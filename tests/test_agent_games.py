"""Multi-agent and game environments driven by scripted policies: tic-tac-toe self-play (two envs
of one group sharing a game, stepped by the builder's group-level rollout), illegal moves, the
scripted random and minimax players, guess-the-number, and twenty questions against a scripted
answerer client; rewards, turn counts and datum layouts against independent expectations."""

from __future__ import annotations

import re

import numpy as np
import pytest

from prefect_tinker.recipes.rl.advantages import groups_to_datums, rollout_metrics
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec
from prefect_tinker.recipes.rl.envs.guess_number import GuessNumberBuilder
from prefect_tinker.recipes.rl.envs.tictactoe import TicTacToe, TicTacToeSelfPlayBuilder
from prefect_tinker.recipes.rl.envs.twenty_questions import TwentyQuestionsBuilder, names_word
from prefect_tinker.recipes.rl.message_env import EpisodeLimits
from prefect_tinker.recipes.rl.services import SAMPLER, Services
from prefect_tinker.recipes.rl.problem_env import load_renderer
from prefect_tinker.recipes.rl.tictactoe_game import EMPTY, minimax_move, minimax_value, play, random_move, winner
from prefect_tinker.tasks.rollouts import RolloutError, RolloutPolicy, run_group_rollout
from tests.scripted_policy import ScriptedSampler, tokenizer_dirs  # noqa: F401

END = "<|im_end|>"
LIMITS = EpisodeLimits(max_turns=5, failed_parse_reward=-1.0)


def _tok(dirs):
    return load_renderer("chatml", dirs["tiny"]).tokenizer


def _selfplay(dirs):
    return TicTacToeSelfPlayBuilder(group_size=2, renderer_name="chatml", tokenizer_id=dirs["tiny"], limits=LIMITS)


def _check_player_datums(group):
    """Each player's transitions merge into one datum whose trained tokens are exactly its moves."""
    datums, advs = groups_to_datums([group])
    by_member = {d.member: d for d in datums}
    for i, traj in enumerate(group.trajectories_G):
        if not any(t.action_tokens for t in traj.transitions):
            assert i not in by_member
            continue
        d = by_member[i]
        for a, b in zip(traj.transitions, traj.transitions[1:], strict=False):
            assert b.observation[: len(a.observation) + len(a.action_tokens)] == a.observation + a.action_tokens
        trained = [tok for tok, m in zip(d.tokens[1:], d.mask, strict=False) if m]
        assert trained == [tok for t in traj.transitions for tok in t.action_tokens]
        assert set(np.unique(d.advantages[d.mask > 0])) == {np.float32(advs[0][i])}
    assert datums
    return advs[0]


def test_selfplay_game_alternates_players_and_is_zero_sum(tokenizer_dirs):
    tok = _tok(tokenizer_dirs)
    moves = ["1", "4", "2", "5", "3"]  # X: 1 2 3 (top row), O: 4 5
    sampler = ScriptedSampler(tok, [f"I take {m}.{END}" for m in moves])
    group = run_group_rollout(sampler, _selfplay(tokenizer_dirs), seed=11, max_tokens=16)
    x, o = group.trajectories_G
    assert [len(x.transitions), len(o.transitions)] == [3, 2] and group.errors == 0
    assert group.total_rewards() == [1.0, -1.0]
    assert x.transitions[-1].metrics["win"] == 1.0 and o.transitions[-1].metrics["loss"] == 1.0
    assert o.transitions[-1].logs["board"] == "XXXOO...." and o.transitions[-1].episode_done
    # O's second observation shows X's move 2 and the board; X's last shows O's 5
    assert "Your opponent played 2." in tok.decode(o.transitions[1].observation)
    assert " X | X | 3\n---+---+---\n O | O | 6" in tok.decode(x.transitions[2].observation)
    # the prompts alternate X, O, X, O, X in sampling order, each seeded differently
    assert [c[0] for c in sampler.calls] == [
        t.observation
        for pair in zip(x.transitions, o.transitions + [None], strict=False)
        for t in pair
        if t is not None
    ]
    assert len({c[2] for c in sampler.calls}) == 5
    adv = _check_player_datums(group)
    assert adv.tolist() == [1.0, -1.0] and adv.sum() == 0.0


@pytest.mark.parametrize("moves, rewards, illegal", [
    (["5", "5"], [0.0, -1.0], 1),  # O takes an occupied cell
    (["5", "no idea"], [0.0, -1.0], 1),  # O names no cell
    (["0"], [-1.0, 0.0], 0),  # X's first move is off the board: O never moves
])
def test_illegal_moves_end_the_game_with_a_penalty(tokenizer_dirs, moves, rewards, illegal):
    sampler = ScriptedSampler(_tok(tokenizer_dirs), [m + END for m in moves])
    group = run_group_rollout(sampler, _selfplay(tokenizer_dirs), seed=0, max_tokens=16)
    assert group.total_rewards() == rewards
    trajs = group.trajectories_G
    assert trajs[illegal].transitions[-1].metrics["illegal"] == 1.0
    assert trajs[1 - illegal].transitions[-1].metrics["opponent_illegal"] == 1.0
    adv = _check_player_datums(group)
    assert adv[0] == -adv[1] and abs(adv[illegal]) == 0.5  # centred within the game: zero-sum
    if moves == ["0"]:
        assert trajs[1].transitions[0].action_tokens == [] and len(groups_to_datums([group])[0]) == 1


def test_shared_episode_failures_follow_the_rollout_policy(tokenizer_dirs):
    def broken(prompt):
        raise RuntimeError("sampler down")

    tok = _tok(tokenizer_dirs)
    g = run_group_rollout(ScriptedSampler(tok, broken), _selfplay(tokenizer_dirs), seed=0, max_tokens=8)
    assert g.trajectories_G == [] and g.errors == 1 and "shared episode" in g.error_messages[0]
    with pytest.raises(RolloutError, match="shared episode"):
        run_group_rollout(ScriptedSampler(tok, broken), _selfplay(tokenizer_dirs), seed=0, max_tokens=8,
                          policy=RolloutPolicy(mode="retry", retries=1))
    calls = iter([RuntimeError("flaky")] + ["1", "4", "2", "5", "3"])

    def flaky(prompt):
        nxt = next(calls)
        if isinstance(nxt, Exception):
            raise nxt
        return nxt + END

    g = run_group_rollout(ScriptedSampler(tok, flaky), _selfplay(tokenizer_dirs), seed=0, max_tokens=8,
                          policy=RolloutPolicy(mode="retry", retries=1))
    assert g.errors == 1 and g.total_rewards() == [1.0, -1.0]  # replayed from a fresh game


def test_minimax_is_optimal_and_never_loses():
    assert minimax_value(EMPTY) == 0  # tic-tac-toe is a draw under perfect play
    assert minimax_move("XX.OO....") == 3  # X completes the top row
    assert minimax_move("XX..O....") == 3  # O blocks it
    rng = np.random.default_rng(0)
    for game in range(200):
        board, minimax_mark = EMPTY, "XO"[game % 2]
        while winner(board) is None:
            mover = "X" if board.count("X") == board.count("O") else "O"
            board = play(board, minimax_move(board, rng) if mover == minimax_mark else random_move(board, rng))
        assert winner(board) in (minimax_mark, "draw")


def _lowest_cell(prompt: str) -> str:
    """A scripted player: the lowest free cell of the last board shown."""
    board = prompt[prompt.rindex("Board:"):]
    free = re.findall(r"(?<![\d])([1-9])(?![\d])", board.split("You play")[0])
    return free[0] + END


def test_games_against_scripted_players_and_their_evaluation_sets(tokenizer_dirs):
    tok = _tok(tokenizer_dirs)
    ctx = EnvContext(renderer_name="chatml", tokenizer_id=tokenizer_dirs["tiny"], group_size=2, groups_per_batch=2)

    sets = TicTacToe.eval_builders(EnvSpec(env="tictactoe", env_options={"eval_games": 6}), ctx)
    assert set(sets) == {"vs_random", "vs_minimax"} and [b.mark for b in sets["vs_minimax"]] == ["X", "O"]
    outcomes = {}
    for name, builders in sets.items():
        groups = [run_group_rollout(ScriptedSampler(tok, _lowest_cell), b, seed=1, max_tokens=8) for b in builders]
        outcomes[name] = rollout_metrics(groups)
        for g, b in zip(groups, builders, strict=True):
            assert len(g.trajectories_G) == 3
            for traj in g.trajectories_G:
                board = traj.transitions[-1].logs["board"]
                w = winner(board)  # replay the final board independently
                expected = {b.mark: 1.0, "draw": 0.0}.get(w, -1.0)
                assert traj.step_reward == expected
                assert len(traj.transitions) == board.count(b.mark)
    assert outcomes["vs_minimax"]["win"] == 0.0 and outcomes["vs_minimax"]["illegal"] == 0.0
    assert outcomes["vs_random"]["illegal"] == 0.0 and outcomes["vs_random"]["trajectories"] == 6


def _binary_search(secret, low, high):
    guesses = []
    while True:
        g = (low + high) // 2
        guesses.append(g)
        if g == secret:
            return guesses
        low, high = (g + 1, high) if secret > g else (low, g - 1)


@pytest.mark.parametrize("secret, max_turns", [(37, 8), (100, 8), (37, 3)])
def test_guess_the_number(tokenizer_dirs, secret, max_turns):
    guesses = _binary_search(secret, 1, 100)
    replies = ["hmm, no idea" + END] + [f"My guess: {g}{END}" for g in guesses]
    builder = GuessNumberBuilder(
        secret=secret,
        group_size=1,
        renderer_name="chatml",
        tokenizer_id=tokenizer_dirs["tiny"],
        limits=EpisodeLimits(max_turns=max_turns),
    )
    tok = _tok(tokenizer_dirs)
    group = run_group_rollout(ScriptedSampler(tok, replies), builder, seed=0, max_tokens=16)
    (traj,) = group.trajectories_G
    turns = len(guesses) + 1
    found = turns <= max_turns
    assert len(traj.transitions) == min(turns, max_turns) and group.total_rewards() == [float(found)]
    m = traj.transitions[-1].metrics
    assert m["correct"] == float(found) and m["invalid_guesses"] == 1.0 and m["max_turns_reached"] == float(not found)
    texts = [tok.decode(t.observation) for t in traj.transitions]
    assert "Please reply with a number between 1 and 100." in texts[1]
    for g, text in zip(guesses, texts[2:], strict=False):
        assert text.rstrip().endswith(("Higher." if secret > g else "Lower.") + END + "\n<|im_start|>assistant")
    _check_player_datums(group)


class _Answerer(ScriptedSampler):
    """An answerer model: 'Yes' when the question mentions a word of its secret's category."""

    def __init__(self, tok):
        super().__init__(tok, self._answer)

    @staticmethod
    def _answer(prompt: str) -> str:
        secret = re.search(r'secret word is "(\w+)"', prompt).group(1)
        question = prompt.rsplit("<|im_start|>user\n", 1)[1]
        if "maybe" in question:
            return "Perhaps." + END
        yes = ("animal" in question and secret in ("dog", "cat")) or ("bark" in question and secret == "dog")
        return ("Yes" if yes else "No") + ", I think." + END


def test_twenty_questions_against_an_answerer_client(tokenizer_dirs):
    tok = _tok(tokenizer_dirs)
    answerer = _Answerer(tok)
    builder = TwentyQuestionsBuilder(word="dog", answerer="base:answer-model", group_size=2, renderer_name="chatml",
                                     tokenizer_id=tokenizer_dirs["tiny"], limits=EpisodeLimits(max_turns=4))
    player = ScriptedSampler(tok, ["Is it an animal?" + END, "Is it an animal?" + END,  # both members' first turns
                                   "Does it bark?" + END, "Is it a dog?" + END,  # member 0 wins on question 3
                                   "maybe a plant?" + END, "Is it a car?" + END, "Is it a cat?" + END])
    clients = {"base:answer-model": answerer}
    services = Services(given={SAMPLER.name: clients.__getitem__})
    group = run_group_rollout(player, builder, seed=5, max_tokens=16, services=services)
    won, lost = group.trajectories_G
    assert group.total_rewards() == [1.0, 0.0] and [len(won.transitions), len(lost.transitions)] == [3, 4]
    assert won.transitions[-1].metrics["questions"] == 3.0 and lost.transitions[-1].metrics["max_turns_reached"] == 1.0
    assert lost.transitions[-1].metrics["answerer_unsure"] == 1.0
    texts = [tok.decode(t.observation) for t in won.transitions]
    assert texts[1].endswith("Yes." + END + "\n<|im_start|>assistant\n") and texts[2].endswith(
        "Yes." + END + "\n<|im_start|>assistant\n"
    )
    assert "I don't know." in tok.decode(lost.transitions[2].observation)
    assert len(answerer.calls) == 2 + 3  # every question but member 0's winning one and member 1's last
    assert all('secret word is "dog"' in tok.decode(c[0]) for c in answerer.calls)
    with pytest.raises(RuntimeError, match="make_envs_in"):
        builder.make_envs()
    assert names_word("Is it a Dog?", "dog") and names_word("dogs!", "dog") and not names_word("hotdog", "dog")


def test_session_env_evaluators_from_the_run_config(tokenizer_dirs):
    """``session_env_evaluators``: the RL config's env sets (tic-tac-toe: vs_random, vs_minimax,
    ``eval_games`` games each, half as X), sampled with the config's max_tokens, temperature and
    seed on the session's renderer and tokenizer; none for an env without evaluation sets."""
    from prefect_tinker.flows.rl_config import RLConfig
    from prefect_tinker.tasks.rollout_eval import session_env_evaluators

    config = RLConfig(model="tiny", env="tictactoe", env_options={"eval_games": 6}, group_size=2, max_tokens=7,
                      temperature=0.5, seed=11)
    evaluators = session_env_evaluators(config, config.env_context("chatml", tokenizer_dirs["tiny"]))
    assert [ev.name for ev in evaluators] == ["vs_random", "vs_minimax"]
    for ev in evaluators:
        assert (ev.max_tokens, ev.temperature, ev.seed) == (7, 0.5, 11)
        assert [(b.mark, b.group_size, b.opponent) for b in ev.builders] == [
            ("X", 3, ev.name[3:]),
            ("O", 3, ev.name[3:]),
        ]
        assert {b.renderer_name for b in ev.builders} == {"chatml"}
    other = RLConfig(model="tiny", env="guess_number")
    assert session_env_evaluators(other, other.env_context("chatml", tokenizer_dirs["tiny"])) == []


def test_env_checks_read_the_run_settings_of_the_config_around_the_spec(tokenizer_dirs):
    """Environment checks that need the run (group size, policy model, fields the RLHF flow fills
    in) read them from ``EnvSpec.run_settings``: a bare spec knows none, an RL config its own."""
    from prefect_tinker.flows.rl_config import RLConfig
    from prefect_tinker.flows.rlhf import RLStageConfig
    from prefect_tinker.recipes.rl.envs import EnvSpec, RunSettings
    from prefect_tinker.recipes.rl.envs.twenty_questions import TwentyQuestions

    assert EnvSpec(env="tictactoe").run_settings() == RunSettings()
    assert RLConfig(model="tiny", env="tictactoe", group_size=2).run_settings() == RunSettings(2, "tiny", False)
    with pytest.raises(ValueError, match="self-play needs group_size=2 .*got 4"):
        RLConfig(model="tiny", env="tictactoe", group_size=4)
    RLConfig(model="tiny", env="tictactoe", group_size=4, env_options={"opponent": "minimax"})  # not self-play

    with pytest.raises(ValueError, match="needs env_options.answerer"):
        EnvSpec(env="twenty_questions")  # no policy model to answer with
    config = RLConfig(model="tiny", env="twenty_questions", group_size=2)
    ctx = config.env_context("chatml", tokenizer_dirs["tiny"])
    builder = TwentyQuestions.build(config, ctx).get_batch(0)[0]
    assert builder.answerer == "base:tiny"  # the policy's base model answers

    with pytest.raises(ValueError, match="needs dataset="):
        RLConfig(model="tiny", env="pairwise_preference")
    stage = RLStageConfig(model="tiny")  # the RLHF flow fills dataset and reward model in later
    assert stage.run_settings().filled_by_pipeline and stage.dataset is None
