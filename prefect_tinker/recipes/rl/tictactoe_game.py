"""Tic-tac-toe: the board, its rules, and two scripted players (uniform random, optimal minimax).

Cells are numbered 1..9 row by row; ``board`` is a string of 9 characters ``"X"``, ``"O"`` or
``"."``. X moves first. :func:`minimax_move` plays perfectly (negamax over the full game tree,
memoised: 5,478 reachable positions), preferring quicker wins and slower losses, ties broken by
the lowest cell number, or at random with an ``rng``.
"""

from __future__ import annotations

import functools
import re

import numpy as np

__all__ = [
    "EMPTY",
    "LINES",
    "Game",
    "board_text",
    "legal_moves",
    "minimax_move",
    "minimax_value",
    "parse_move",
    "play",
    "random_move",
    "to_move",
    "winner",
]

EMPTY = "." * 9
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def winner(board: str) -> str | None:
    """``"X"`` or ``"O"`` when that mark holds a line, ``"draw"`` on a full board, else None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return "draw" if "." not in board else None


def legal_moves(board: str) -> list[int]:
    """Empty cells, 1-based."""
    return [i + 1 for i, c in enumerate(board) if c == "."]


def to_move(board: str) -> str:
    """The mark whose turn it is (X when the counts are equal)."""
    return "X" if board.count("X") == board.count("O") else "O"


def play(board: str, cell: int) -> str:
    """``board`` after the player to move takes ``cell`` (1-based).

    Raises:
        ValueError: the game is over, or ``cell`` is not an empty cell.
    """
    if winner(board) is not None:
        raise ValueError("the game is over")
    if not (isinstance(cell, int) and 1 <= cell <= 9) or board[cell - 1] != ".":
        raise ValueError(f"cell {cell!r} is not an empty cell (empty: {legal_moves(board)})")
    return board[: cell - 1] + to_move(board) + board[cell:]


@functools.cache
def minimax_value(board: str) -> int:
    """Value of ``board`` for the player to move under perfect play: ``+(10 - plies)`` win,
    0 draw, ``-(10 - plies)`` loss (plies = marks on the final board)."""
    w = winner(board)
    if w == "draw":
        return 0
    if w is not None:  # the previous mover won
        return -(10 - (9 - board.count(".")))
    return max(-minimax_value(play(board, m)) for m in legal_moves(board))


def minimax_move(board: str, rng: np.random.Generator | None = None) -> int:
    """An optimal move (1-based): among the best, the lowest cell, or a random one with ``rng``."""
    moves = legal_moves(board)
    if not moves or winner(board) is not None:
        raise ValueError("no move: the game is over")
    values = [-minimax_value(play(board, m)) for m in moves]
    best = [m for m, v in zip(moves, values, strict=True) if v == max(values)]
    return int(rng.choice(best)) if rng is not None else best[0]


def random_move(board: str, rng: np.random.Generator) -> int:
    """A uniformly random legal move (1-based)."""
    return int(rng.choice(legal_moves(board)))


def board_text(board: str) -> str:
    """The board as three rows, empty cells shown by their number: ``" X | 2 | O"``."""
    cells = [c if c != "." else str(i + 1) for i, c in enumerate(board)]
    rows = [" " + " | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
    return "\n---+---+---\n".join(rows)


def parse_move(text: str) -> int | None:
    """The move a reply states: its last standalone number (None if there is none)."""
    found = re.findall(r"(?<!\d)\d+(?!\d)", text or "")
    return int(found[-1]) if found else None


class Game:
    """A game in progress, shared by the two players' environments (the coordinator of turns).

    Attributes:
        board: the current board; moves: the cells played, in order.
        illegal_by: the mark that made an illegal move (which ends the game), or None.
    """

    def __init__(self, board: str = EMPTY):
        self.board = board
        self.moves: list[int] = []
        self.illegal_by: str | None = None

    @property
    def to_move(self) -> str:
        return to_move(self.board)

    @property
    def over(self) -> bool:
        return self.illegal_by is not None or winner(self.board) is not None

    def move(self, cell: int | None) -> bool:
        """Play ``cell`` for the mark to move; an illegal one (None, taken, out of range) ends the
        game with ``illegal_by`` set. Returns whether the move was legal."""
        mark = self.to_move
        if cell is None:
            self.illegal_by = mark
            return False
        try:
            self.board = play(self.board, cell)
        except ValueError:
            self.illegal_by = mark
            return False
        self.moves.append(cell)
        return True

    def outcome(self, mark: str) -> str:
        """``"win"``, ``"loss"``, ``"draw"``, ``"illegal"`` (this mark moved illegally) or
        ``"opponent_illegal"`` for ``mark`` in a finished game."""
        if self.illegal_by is not None:
            return "illegal" if self.illegal_by == mark else "opponent_illegal"
        w = winner(self.board)
        if w is None:
            raise ValueError("the game is not over")
        return "draw" if w == "draw" else ("win" if w == mark else "loss")
