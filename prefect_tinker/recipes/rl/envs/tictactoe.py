"""``tictactoe``: two-player self-play, and games against scripted random / optimal players.

Self-play (``opponent="self"``, the default): a group is one game; its two envs are the players X
and O, each with its own conversation (the board and the opponent's last move come as user
messages; each reply is a move: its last number, a cell 1..9), sharing a :class:`Game` that keeps
the turns. The builder is a ``shared_episode`` builder: the rollout task hands it the group and
:meth:`TicTacToeSelfPlayBuilder.run_group` alternates the players, sampling each move from the
policy. Rewards per player: win ``+1``, loss ``-1``, draw ``0``; a move that is not a legal cell
(taken, out of range, no number, a reply that does not parse) ends the game with
``illegal_move_reward`` (default -1) for the player who made it and 0 for the other. With two
members per group the group-centred advantage is ``A_X = (R_X - R_O) / 2 = -A_O``: zero-sum
whatever the rewards, so self-play trains each side against the other.

``opponent="random"`` or ``"minimax"`` (optimal; :mod:`prefect_tinker.recipes.rl.tictactoe_game`):
each env is a game of the policy against that player, the policy playing X in even groups and O in
odd ones. :meth:`TicTacToe.eval_builders` gives such games against both players for evaluation
(win, draw, loss and illegal-move rates).

Metrics per player episode: ``env/win``, ``env/draw``, ``env/loss``, ``env/illegal``,
``env/opponent_illegal``, ``env/moves``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.message_env import (
    EpisodeLimits,
    GeneratedDataset,
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    problem_rng,
)
from prefect_tinker.recipes.rl.tictactoe_game import Game, board_text, minimax_move, parse_move, random_move
from prefect_tinker.recipes.rl.types import RLDataset, RolloutContext, StepResult, Trajectory, Transition

__all__ = ["TicTacToe", "TicTacToeBuilder", "TicTacToeOptions", "TicTacToePlayer", "TicTacToeSelfPlayBuilder"]

RULES = (
    "We are playing tic-tac-toe on a 3x3 board with cells numbered 1 to 9, row by row. Players take turns "
    "marking an empty cell; three marks in a row, column or diagonal win. On your turn, reply with the "
    "number of an empty cell only."
)


class TicTacToeOptions(MessageEnvOptions):
    opponent: Literal["self", "random", "minimax"] = Field(
        default="self", description="self-play, or a scripted random / optimal player."
    )
    illegal_move_reward: float = Field(
        default=-1.0, description="Reward of the player making an illegal move (the game ends)."
    )
    failed_parse_reward: float = Field(default=-1.0, description="A reply that does not parse is an illegal move.")
    max_turns: int = Field(default=5, ge=5, le=32, description="Most moves per player (5 fill the board).")
    eval_games: int = Field(
        default=8, ge=2, description="Evaluation games against each scripted player (half as X, half as O)."
    )


#: Builders' default limits (the options' defaults): 5 moves fill the board; no parse is an illegal move.
GAME_LIMITS = EpisodeLimits(max_turns=5, failed_parse_reward=-1.0)


@dataclass(frozen=True)
class Rewards:
    win: float = 1.0
    draw: float = 0.0
    loss: float = -1.0
    illegal: float = -1.0
    opponent_illegal: float = 0.0

    def of(self, outcome: str) -> float:
        """The reward of ``outcome`` (:meth:`~prefect_tinker.recipes.rl.tictactoe_game.Game.outcome`)."""
        table = {
            "win": self.win,
            "draw": self.draw,
            "loss": self.loss,
            "illegal": self.illegal,
            "opponent_illegal": self.opponent_illegal,
        }
        return table[outcome]


class TicTacToePlayer(MessageEnv):
    """One player's side of a game (see the module docstring).

    Args:
        game: the game, shared with the other player's env in self-play.
        mark: ``"X"`` or ``"O"``.
        opponent: None (self-play: the other env moves) or ``"random"`` / ``"minimax"`` (moves
            inside this env, from ``rng``).
    """

    outcome_metrics = ("win", "draw", "loss", "illegal", "opponent_illegal")

    def __init__(
        self,
        renderer: Any,
        game: Game,
        mark: str,
        *,
        opponent: str | None = None,
        rng: np.random.Generator | None = None,
        rewards: Rewards = Rewards(),
        **kw: Any,
    ):
        super().__init__(renderer, [{"role": "system", "content": RULES}], **kw)
        self.game, self.mark, self.opponent, self.rewards = game, mark, opponent, rewards
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.started = self.overflowed = False

    # ---- the conversation -----------------------------------------------------------------
    def state_message(self) -> dict:
        """The user message at this player's turn: the opponent's last move and the board."""
        last = f"Your opponent played {self.game.moves[-1]}.\n" if self.game.moves else ""
        return {
            "role": "user",
            "content": f"{last}Board:\n{board_text(self.game.board)}\nYou play {self.mark}. Your move?",
        }

    def turn_observation(self) -> list[int] | None:
        """The observation at this player's turn (the first one, or the conversation continued);
        None when it would exceed ``max_trajectory_tokens``: the player forfeits (see :meth:`overflowed`)."""
        if self.opponent is not None and self.game.to_move != self.mark and not self.game.over:
            self._opponent_moves()
        self.add_messages([self.state_message()])
        if not self.started:
            self.started = True
            return MessageEnv.initial_observation(self)[0]
        obs = self.observe()
        if len(obs) > self.limits.max_trajectory_tokens:
            self.overflowed = True
            self.game.move(None)
            return None
        return obs

    def initial_observation(self):
        return self.turn_observation(), self.renderer.get_stop_sequences()

    # ---- moves ------------------------------------------------------------------------------
    def _opponent_moves(self) -> None:
        pick = minimax_move if self.opponent == "minimax" else random_move
        self.game.move(pick(self.game.board, self.rng))

    def step(self, action: list[int]) -> StepResult:
        res = super().step(action)
        if res.episode_done and not self.game.over:  # no parsable move, or no room left: a forfeit
            self.game.move(None)
            outcome = self.result()
            res.metrics.update(outcome.metrics)
            res.logs.update({k: v for k, v in outcome.logs.items() if k != "end"})
        return res

    def react(self, reply: dict) -> Reaction:
        if self.game.to_move != self.mark:
            raise RuntimeError(f"player {self.mark} stepped out of turn")
        self.game.move(parse_move(reply.get("content") or ""))
        if not self.game.over and self.opponent is not None:
            self._opponent_moves()
        if self.game.over:
            return self.result()
        if self.opponent is None:
            return Reaction(wait=True)
        return Reaction([self.state_message()])

    def result(self) -> Reaction:
        """The game's outcome for this player (the game must be over)."""
        outcome = self.game.outcome(self.mark)
        metrics = {k: float(outcome == k) for k in ("win", "draw", "loss", "illegal", "opponent_illegal")}
        metrics.update(moves=float(self.turns), first_player=float(self.mark == "X"))
        return Reaction(
            done=True,
            reward=self.rewards.of(outcome),
            metrics=metrics,
            logs={"end": outcome, "board": self.game.board, "moves": " ".join(map(str, self.game.moves))},
        )


def _rewards(opts: TicTacToeOptions) -> Rewards:
    return Rewards(illegal=opts.illegal_move_reward)


@dataclass(frozen=True, kw_only=True)
class TicTacToeSelfPlayBuilder(MessageGroupBuilder):
    """One self-play game: envs ``[X, O]`` sharing a :class:`Game` (``group_size`` must be 2)."""

    shared_episode = True
    limits: EpisodeLimits = GAME_LIMITS
    rewards: Rewards = Rewards()

    def make_envs(self) -> list[MessageEnv]:
        from prefect_tinker.recipes.rl.problem_env import load_renderer

        if self.group_size != 2:
            raise ValueError(f"tic-tac-toe self-play needs group_size=2 (the two players), got {self.group_size}")
        renderer, game = load_renderer(self.renderer_name, self.tokenizer_id), Game()
        return [TicTacToePlayer(renderer, game, mark, rewards=self.rewards, limits=self.limits) for mark in "XO"]

    def run_group(self, envs, ctx: RolloutContext) -> list[Trajectory]:
        """Alternate the players until the game ends; each player's last transition gets its outcome
        (a player that never moved, its opponent's first move being illegal, gets one transition
        with its observation and no action tokens: no datum, but the group keeps both members)."""
        game = envs[0].game
        steps: list[list[Transition]] = [[], []]
        while not game.over:
            p = 0 if game.to_move == "X" else 1
            env = envs[p]
            ob = env.turn_observation()
            if ob is None:  # no room for another move: a forfeit
                break
            tokens, lps, reason = ctx.sample(ob, env.renderer.get_stop_sequences(), ctx.seed + 31 * len(game.moves) + p)
            res = env.step(tokens)
            steps[p].append(
                Transition(
                    list(ob),
                    list(tokens),
                    list(lps),
                    float(res.reward),
                    bool(res.episode_done),
                    reason,
                    dict(res.metrics),
                    dict(res.logs),
                )
            )
        for p, env in enumerate(envs):
            if not steps[p]:  # its opponent's first move ended the game: a transition without action (no datum)
                end = env.end_episode(env.result(), game.outcome(env.mark))
                steps[p].append(
                    Transition(
                        env.turn_observation() or [],
                        [],
                        [],
                        end.reward,
                        True,
                        "stop",
                        dict(end.metrics),
                        dict(end.logs),
                    )
                )
            elif not steps[p][-1].episode_done:
                if env.overflowed:
                    end = env.end_episode(
                        Reaction(done=True, reward=env.limits.context_overflow_reward, metrics=env.result().metrics),
                        "context_overflow",
                        context_overflow=1.0,
                    )
                else:
                    end = env.end_episode(env.result(), game.outcome(env.mark))
                last = steps[p][-1]
                last.reward, last.episode_done, last.metrics, last.logs = end.reward, True, end.metrics, end.logs
        return [Trajectory(s) for s in steps]


@dataclass(frozen=True, kw_only=True)
class TicTacToeBuilder(MessageGroupBuilder):
    """Games of the policy (playing ``mark``) against a scripted ``opponent``, one per env, each
    opponent seeded by ``(game_seed, member)``."""

    opponent: str = "random"
    mark: str = "X"
    game_seed: int = 0
    limits: EpisodeLimits = GAME_LIMITS
    rewards: Rewards = Rewards()

    def make_envs(self) -> list[MessageEnv]:
        from prefect_tinker.recipes.rl.problem_env import load_renderer

        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        return [
            TicTacToePlayer(
                renderer,
                Game(),
                self.mark,
                opponent=self.opponent,
                rewards=self.rewards,
                rng=problem_rng(self.game_seed, i),
                limits=self.limits,
            )
            for i in range(self.group_size)
        ]


@register_env
class TicTacToe(Environment):
    name = "tictactoe"
    description = (
        "Two-player self-play tic-tac-toe (zero-sum group advantages), or games against random/minimax players."
    )
    Options = TicTacToeOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        group_size = spec.run_settings().group_size
        if cls.options(spec).opponent == "self" and group_size not in (None, 2):
            raise ValueError(
                f"env 'tictactoe' self-play needs group_size=2 (one game, its two players per group), got {group_size}"
            )

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        common = dict(
            renderer_name=ctx.renderer_name,
            tokenizer_id=ctx.tokenizer_id,
            limits=opts.limits(),
            rewards=_rewards(opts),
            tags=(cls.name,),
        )
        if opts.opponent == "self":
            return GeneratedDataset(ctx.groups_per_batch, lambda b, g: TicTacToeSelfPlayBuilder(group_size=2, **common))
        return GeneratedDataset(
            ctx.groups_per_batch,
            lambda b, g: TicTacToeBuilder(
                opponent=opts.opponent,
                mark="XO"[g % 2],
                game_seed=int(problem_rng(ctx.seed, b, g).integers(2**31)),
                group_size=ctx.group_size,
                **common,
            ),
        )

    @classmethod
    def eval_builders(cls, spec: EnvSpec, ctx: EnvContext) -> dict[str, list]:
        """``{"vs_random": [...], "vs_minimax": [...]}``: ``eval_games`` games against each player,
        half with the policy as X, half as O."""
        opts = cls.options(spec)
        half = opts.eval_games // 2
        common = dict(
            renderer_name=ctx.renderer_name,
            tokenizer_id=ctx.tokenizer_id,
            limits=opts.limits(),
            rewards=_rewards(opts),
            tags=(cls.name,),
            group_size=half,
        )
        return {
            f"vs_{o}": [
                TicTacToeBuilder(opponent=o, mark=m, game_seed=ctx.seed + 7 * k, **common) for k, m in enumerate("XO")
            ]
            for o in ("random", "minimax")
        }
