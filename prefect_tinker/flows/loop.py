"""The one step loop of every recipe.

``StepLoop(session, total, ...).run(step_fn)`` calls ``step_fn(step)`` while the run has taken
fewer than ``total`` optimizer steps. ``step_fn`` does the recipe's own work for one step (a
batch, rollouts, an update: it advances ``session.run``) and returns its metrics; the loop owns
the rest:

- metrics buffered at the step they belong to (``step`` = optimizer steps taken before it);
- the ``after_step`` callback;
- evaluators at the start of a fresh run, every ``eval_every`` steps and at the end;
- a state checkpoint every ``save_every`` steps and at the end, the buffered rows written first
  (:meth:`~prefect_tinker.flows.session.RunSession.checkpoint`);
- the usage metrics of steps that report ``tokens/<kind>`` counts: every kind, ``cost/step_usd``
  from the config's price table and the run's cumulative ``tokens/<kind>_total`` /
  ``cost/total_usd`` (:mod:`prefect_tinker.recipes.pricing`; totals continue across resumes);
  an evaluation's ``tokens/eval_*`` (summed over its evaluators) and their ``cost/eval_usd``;
- Ctrl-C (:attr:`~prefect_tinker.flows.session.RunSession.stop_requested`, the first SIGINT): the
  step in progress is finished, a state checkpoint saved at it (unless one just was; the
  evaluation due there is skipped) and :class:`~prefect_tinker.flows.interrupts.RunInterrupted`
  raised; asked before the first step of this invocation, nothing is saved;
- lost-client rewinds (:class:`~prefect_tinker.tasks.clients.ClientRewound`): the step is redone
  from the checkpoint the client was recreated at (at most ``max_rewinds`` times);
- the progress artifact, and one line per step in the terminal (:mod:`prefect_tinker.recipes.progress`:
  the step's key metrics, step/total, elapsed time, ETA); evaluations announce themselves as phases.

A *loop step* may take several optimizer steps (``step_size``; RL's ``num_substeps``):
``eval_every`` and ``save_every`` count loop steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefect_tinker.flows.callbacks import emit
from prefect_tinker.flows.session import RunSession
from prefect_tinker.recipes.pricing import EVAL_TOKEN_KINDS, TOKEN_KINDS, UsageTotals, eval_cost, price_for
from prefect_tinker.recipes.progress import StepProgress, phase
from prefect_tinker.tasks.clients import ClientRewound
from prefect_tinker.tasks.evaluators import Evaluator, SamplingClientEvaluator, TrainingClientEvaluator
from prefect_tinker.tasks.reporting import Progress, artifact_key

__all__ = ["StepLoop"]


class StepLoop:
    """See the module docstring.

    Args:
        session: the open run session.
        total: optimizer steps the run ends at (counting earlier invocations).
        evaluators: run at the start (fresh runs), every ``eval_every`` loop steps and at the end.
        step_size: optimizer steps per loop step.
        on_rewind: ``step -> None``, the recipe's own state reset after a rewind to ``step``.
        max_rewinds: rewinds allowed before the error is raised.
    """

    def __init__(
        self,
        session: RunSession,
        total: int,
        *,
        evaluators: Sequence[Evaluator] = (),
        step_size: int = 1,
        on_rewind: Callable[[int], None] | None = None,
        max_rewinds: int = 3,
    ):
        self.session, self.total, self.evaluators = session, int(total), list(evaluators)
        self.step_size, self.on_rewind, self.max_rewinds = int(step_size), on_rewind, max_rewinds
        c = session.config
        self.eval_every, self.save_every = c.eval_every, c.save_every
        start = (
            {
                **{f"tokens/{k}_total": session.metric_sum(f"tokens/{k}") for k in TOKEN_KINDS},
                "cost/total_usd": session.metric_sum("cost/step_usd"),
            }
            if session.resumed_from
            else None
        )
        self.usage = UsageTotals(price_for(c.prices, c.model), start)

    def evaluate(self, step: int) -> dict[str, float]:
        """Run every evaluator on the weights at ``step`` (the current step); buffer and return
        their metrics."""
        s, out = self.session, {}
        tokens: dict[str, float] = {}
        with phase(s.run_id, f"evaluation at step {step} ({len(self.evaluators)} evaluators)"):
            for ev in self.evaluators:
                if isinstance(ev, TrainingClientEvaluator):
                    m = ev.evaluate(s.credentials, s.run)
                elif isinstance(ev, SamplingClientEvaluator):
                    m = ev.evaluate(s.credentials, s.sampler_at(step), step)
                else:
                    raise TypeError(f"{type(ev).__name__} is neither a training- nor a sampling-client evaluator")
                for k in EVAL_TOKEN_KINDS:  # summed over the evaluators, not overwritten
                    if f"tokens/{k}" in m:
                        tokens[k] = tokens.get(k, 0.0) + float(m.pop(f"tokens/{k}"))
                out.update(m)
        if tokens:
            out.update({f"tokens/{k}": tokens.get(k, 0.0) for k in EVAL_TOKEN_KINDS})
            out["cost/eval_usd"] = eval_cost(self.usage.prices, tokens)
        s.record(step, out)
        return out

    def _due(self, every: int, done: int) -> bool:
        return bool(every) and (done // self.step_size) % every == 0

    def run(self, step_fn: Callable[[int], dict[str, Any]]) -> None:
        """Loop until ``total`` optimizer steps are taken (see the module docstring)."""
        s = self.session
        progress = Progress(
            f"{s.recipe.upper()} {s.run_id}: steps done of {self.total}",
            self.total,
            s.step,
            key=artifact_key(s.recipe, s.run_id, "progress"),
        )
        terminal = StepProgress(s.recipe, s.run_id, self.total, s.step)
        if s.step == 0 and self.evaluators:
            self.evaluate(0)
        rewinds, first = 0, s.step
        while s.step < self.total:
            step = s.step
            if s.stop_requested:  # Ctrl-C: the last step taken is saved (usually below), or none was taken
                if step != first and s.saved_step != step:
                    s.checkpoint()
                raise s.interrupted()
            try:
                metrics = step_fn(step)
                if any(k.startswith("tokens/") for k in metrics):
                    metrics = {**metrics, **self.usage.add(step, metrics)}
                s.record(step, metrics)
                done = s.step
                emit(lambda cb: cb.after_step, s.run_id, done)
                last = done >= self.total
                if self.evaluators and not s.stop_requested and (last or (self._due(self.eval_every, done))):
                    metrics = {**metrics, **self.evaluate(done)}
                if last or s.stop_requested or self._due(self.save_every, done):
                    s.checkpoint()
                terminal.update(done, metrics)
            except ClientRewound as rew:
                rewinds += 1
                if rewinds > self.max_rewinds:
                    raise
                s.rewind(rew)
                self.usage.rewind(rew.step)
                if self.on_rewind is not None:
                    self.on_rewind(rew.step)
            progress.update(s.step)
