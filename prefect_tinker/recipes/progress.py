"""Live progress in the terminal: one line per training step, and a start, heartbeat and end line
for each long phase (dataset preparation, evaluation, final sampling).

What is printed, on standard error (standard output carries a run's result JSON), follows the
environment variable :data:`PROGRESS_ENV` (set by ``prefect-tinker run --quiet`` /
``--json-progress``):

- ``lines`` (the default): human-readable lines, e.g.
  ``SFT demo  step 3/30  loss 2.4312  tok/s 812  elapsed 0:00:12  ETA 0:01:48``;
- ``json``: one JSON object per line, ``{"event": "step", "recipe", "run", "step", "total",
  "elapsed_s", "eta_s", "tokens_per_s", "metrics": {full metric name: value}}`` and
  ``{"event": "phase_start" | "phase_end", "run", "phase", "elapsed_s"}``;
- ``off``: nothing.

ETA is the mean wall time per step of this invocation (a resumed run counts from where it resumed)
times the steps left. Pure Python: no Prefect import, usable from every layer.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["KEY_METRICS", "PROGRESS_ENV", "PROGRESS_MODES", "StepProgress", "phase", "progress_mode"]

#: ``lines`` | ``json`` | ``off``; unset means ``lines``.
PROGRESS_ENV = "PREFECT_TINKER_PROGRESS"
PROGRESS_MODES = ("lines", "json", "off")

#: (metric name, label) of the metrics a step line shows when the step reports them, in this order:
#: the recipe's loss or reward, accuracy, KL terms.
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("train/loss", "loss"),
    ("train/dpo_loss", "dpo_loss"),
    ("train/soft_ce", "soft_ce"),
    ("env/reward_mean", "reward"),
    ("env/correct_rate", "correct"),
    ("train/accuracy", "acc"),
    ("train/margin", "margin"),
    ("train/teacher_kl", "teacher_kl"),
    ("sdft/kl", "kl"),
    ("train/kl_policy_ref", "kl_ref"),
    ("train/kl_sample_train_v1", "kl_sample_train"),
    ("test/nll", "test_nll"),
    ("test/accuracy", "test_acc"),
)


def progress_mode() -> str:
    """The mode from :data:`PROGRESS_ENV` (``lines`` when unset).

    Raises:
        ValueError: the variable holds something else than one of :data:`PROGRESS_MODES`.
    """
    mode = os.environ.get(PROGRESS_ENV, "").strip().lower() or "lines"
    if mode not in PROGRESS_MODES:
        raise ValueError(f"{PROGRESS_ENV}={mode!r}: expected one of {', '.join(PROGRESS_MODES)}")
    return mode


def _clock(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _emit(line: str, stream: TextIO | None) -> None:
    out = stream or sys.stderr
    try:
        out.write(line + "\n")
        out.flush()
    except (OSError, ValueError):  # a closed or broken stream: progress is never worth a failed run
        pass


class StepProgress:
    """Prints one line per step (see the module docstring).

    Args:
        recipe: the recipe's name (``sft``, ``rl``, ...), shown upper-cased.
        run: the run's name.
        total: optimizer steps the run ends at.
        start: optimizer steps already taken when this invocation starts (a resumed run).
        stream: where to write (default: ``sys.stderr`` at the time of each line).
    """

    def __init__(self, recipe: str, run: str, total: int, start: int = 0, stream: TextIO | None = None):
        self.recipe, self.run, self.total, self.start = recipe, run, int(total), int(start)
        self.stream, self.mode = stream, progress_mode()
        self.t0 = self.last = time.monotonic()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Report that ``step`` optimizer steps are taken; ``metrics`` are the last step's
        (``train/tokens``, when present, gives the tokens per second of that step)."""
        now = time.monotonic()
        took, self.last = now - self.last, now
        elapsed = now - self.t0
        done_here = step - self.start
        eta = elapsed / done_here * (self.total - step) if done_here > 0 else None
        tokens = metrics.get("train/tokens")
        rate = float(tokens) / took if tokens and took > 0 else None
        if self.mode == "json":
            _emit(
                json.dumps(
                    {
                        "event": "step",
                        "recipe": self.recipe,
                        "run": self.run,
                        "step": step,
                        "total": self.total,
                        "elapsed_s": round(elapsed, 3),
                        "eta_s": None if eta is None else round(eta, 3),
                        "tokens_per_s": None if rate is None else round(rate, 1),
                        "metrics": {k: float(v) for k, v in metrics.items() if _is_number(v)},
                    }
                ),
                self.stream,
            )
        elif self.mode == "lines":
            parts = [f"{self.recipe.upper()} {self.run}", f"step {step}/{self.total}"]
            parts += [
                f"{label} {float(metrics[name]):.4f}" for name, label in KEY_METRICS if _is_number(metrics.get(name))
            ]
            if rate is not None:
                parts.append(f"tok/s {rate:.0f}")
            parts.append(f"elapsed {_clock(elapsed)}")
            if eta is not None:
                parts.append(f"ETA {_clock(eta)}")
            _emit("  ".join(parts), self.stream)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@contextmanager
def phase(run: str, name: str, *, heartbeat_s: float = 15.0, stream: TextIO | None = None) -> Iterator[None]:
    """Announce a long phase of run ``run`` (e.g. ``"final sampling (4 prompts)"``): a line when it
    starts, one every ``heartbeat_s`` seconds while it lasts, and one with its duration at the end
    (also when it fails)."""
    mode = progress_mode()
    if mode == "off":
        yield
        return
    t0 = time.monotonic()

    def say(event: str, text: str) -> None:
        if mode == "json":
            _emit(
                json.dumps({"event": event, "run": run, "phase": name, "elapsed_s": round(time.monotonic() - t0, 3)}),
                stream,
            )
        else:
            _emit(f"{run}: {text}", stream)

    say("phase_start", f"{name} ...")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            say("phase_heartbeat", f"{name}: {_clock(time.monotonic() - t0)} elapsed")

    ticker = threading.Thread(target=beat, name=f"progress-{name}", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        say("phase_end", f"{name} done in {_clock(time.monotonic() - t0)}")
