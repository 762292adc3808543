"""Eval-gated promotion as one Prefect flow: the candidate replaces the champion only when it is
better on the same items.

``prefect-tinker run promote line=assistant candidate=run:sft-7 benchmarks='[...]'``
(config: :class:`PromoteConfig`).

1. The candidate and the champion are resolved once (:func:`~prefect_tinker.flows.config.weights_ref`:
   a ``tinker://`` path, ``run:RUN``, ``alias:LINE@ALIAS`` or a base model).
2. Both are evaluated on the same suite by the ``eval`` flow (a subflow; evaluations are cached
   tasks, so a re-run, or a champion already evaluated by the last promotion, costs nothing), the
   champion's rows of base models under the fixed eval run ``gate-<line>``; the candidate is then
   recorded as the line's ``candidate`` alias (``set``; with the sampler weights the evaluation
   saved for a state checkpoint).
3. The gate (:mod:`prefect_tinker.recipes.gate`): per-example scores from ``eval_samples``, a paired
   stratified bootstrap interval of the difference, the margins of the listed benchmarks.
4. The decision and its numbers become the artifact ``promote-<line>`` (always).
5. When the gate holds, inside one Prefect transaction: the ``models`` row moving ``alias`` (default
   ``champion``) to the candidate (``set-alias``, undone if a later step fails), the aliases on the
   checkpoints' assets and the alias asset (``tag-aliases``), then the
   ``prefect-tinker.model.promoted`` event.

A line without a champion takes the candidate as its first champion (``first_promotion``), unless
``require_champion`` is set.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.transactions import transaction
from pydantic import BaseModel, Field, field_validator, model_validator

from prefect_tinker.flows.config import BackendConfig, default_store_root, weights_ref
from prefect_tinker.flows.eval import eval_flow
from prefect_tinker.flows.eval_config import EvalConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.recipes.evals.specs import EvalSpec
from prefect_tinker.recipes.gate import GateConfig, GateDecision, decide, item_scores
from prefect_tinker.tasks.models import alias_row, announce, set_alias, tag_aliases
from prefect_tinker.tasks.reporting import artifact_key
from tinker_blocks.model_registry import AliasChangedError, ModelRegistry, Weights, check_name

__all__ = ["PromoteConfig", "promote_flow"]


class PromoteConfig(BaseModel):
    """Parameters of an eval-gated promotion (the flow's single parameter)."""

    recipe: ClassVar[str] = "promote"

    line: str = Field(description="The model line, e.g. assistant.")
    candidate: str = Field(
        description="The weights considered: a tinker:// path, run:RUN (its last checkpoint), alias:LINE@ALIAS or a "
        "base model."
    )
    champion: str | None = Field(
        default=None, description="The weights to beat; default alias:<line>@<alias> (what the alias holds now)."
    )
    alias: str = Field(default="champion", description="The alias the candidate takes when the gate holds.")
    require_champion: bool = Field(
        default=False,
        description="Refuse when the line has no champion yet (default: the first candidate becomes champion).",
    )
    benchmarks: list[EvalSpec] = Field(
        min_length=1,
        description="The suite both are evaluated on: built-in names, {benchmark: NAME, ...} or full specs.",
    )
    limit: int | None = Field(default=None, ge=1, description="Override: first N examples of every benchmark.")
    num_samples: int | None = Field(default=None, ge=1, description="Override: completions per example.")
    gate: GateConfig = Field(default_factory=GateConfig)
    batch_size: int = Field(default=16, ge=1, description="Examples per eval-batch task.")
    store: str = Field(default_factory=default_store_root, description="Training store root (the models table).")
    eval_store: str | None = Field(default=None, description="Eval store root; default: the training store's root.")
    backend: BackendConfig = Field(default_factory=BackendConfig)

    @field_validator("line", "alias")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v, "name")

    @model_validator(mode="after")
    def _check(self) -> PromoteConfig:
        self.eval_config([self.candidate])  # bad benchmark settings fail now, naming the benchmark
        return self

    def champion_ref(self) -> str:
        """``champion``, else ``alias:<line>@<alias>``."""
        return self.champion or f"alias:{self.line}@{self.alias}"

    def eval_config(self, models: list[str]) -> EvalConfig:
        """The ``eval`` flow's config for ``models`` on this suite (base models' rows under the
        fixed run name ``gate-<line>``, so they are cached across promotions)."""
        return EvalConfig(
            model=models,
            benchmarks=self.benchmarks,
            limit=self.limit,
            num_samples=self.num_samples,
            batch_size=self.batch_size,
            run_name=f"gate-{self.line}",
            store=self.store,
            eval_store=self.eval_store,
            backend=self.backend,
            line=self.line,
        )


def _scores(eval_root: str, results: list[dict[str, Any]], score: str) -> dict[str, dict[str, dict[str, float]]]:
    """checkpoint -> benchmark -> {example_id: score} from the ``eval_samples`` of ``results``: only
    the examples and completions of this evaluation (the same weights' rows may hold other ones, e.g.
    a training run's in-loop evaluations of its checkpoint, or an earlier gate with another ``limit``)."""
    from tinker_blocks.stores import EvalStore

    store = EvalStore(root=eval_root)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in results:
        rows = store.query(
            "SELECT example_id, correct, score FROM eval_samples WHERE run_id = ? AND eval_name = ? "
            "AND checkpoint = ? AND step IS NOT DISTINCT FROM ? AND sample_index < ?",
            [r["run_id"], r["eval_name"], r["checkpoint"], r["step"], r["num_samples"]],
        )
        ids = set(r["example_ids"])
        out.setdefault(r["checkpoint"], {})[r["eval_name"]] = item_scores(
            [row for row in rows if str(row["example_id"]) in ids], score
        )
    return out


def _report(config: PromoteConfig, cand: Weights, champ: Weights | None, decision: GateDecision | None, note: str):
    verdict = "promoted" if decision is None or decision.promote else "not promoted"
    lines = [
        f"# Promotion of `{config.line}@{config.alias}`: {verdict}",
        "",
        f"- candidate: `{cand.checkpoint}`" + (f" (run `{cand.run_id}`, step {cand.step})" if cand.run_id else ""),
        f"- champion: `{champ.checkpoint}`" if champ else "- champion: (none yet)",
        f"- {note}",
    ]
    if decision is not None:
        lines += [
            "",
            f"Suite: difference {decision.difference:+.4f}, {decision.confidence:.0%} interval "
            f"[{decision.low:+.4f}, {decision.high:+.4f}] over {decision.items} paired examples "
            f"({decision.resamples} bootstrap resamples).",
            "",
            "| benchmark | examples | candidate | champion | difference | interval | margin | ok |",
            "|---|---|---|---|---|---|---|---|",
            *[
                f"| {n} | {b['items']} | {b['candidate']:.4f} | {b['champion']:.4f} | {b['difference']:+.4f} | "
                f"[{b['low']:+.4f}, {b['high']:+.4f}] | {'-' if b['margin'] is None else b['margin']} | "
                f"{'yes' if b['ok'] else 'no'} |"
                for n, b in decision.benchmarks.items()
            ],
            "",
            *[f"- {r}" for r in decision.reasons],
        ]
    create_markdown_artifact(
        "\n".join(lines), key=artifact_key("promote", config.line), description="promotion decision"
    )


@recipe_flow("promote", "promote-{config.line}")
def promote_flow(config: PromoteConfig) -> dict[str, Any]:
    """Evaluate the candidate against the champion and promote it when the gate holds (module
    docstring); returns ``promoted``, ``reason``, the ``decision`` numbers (None without a
    champion), ``candidate`` / ``champion`` checkpoints and the ``models`` row written (or None).

    Raises:
        WeightsRefError: the candidate names nothing; no champion with ``require_champion``.
        AliasChangedError: the alias changed while the gate ran (nothing promoted).
        ValueError: the two were not evaluated on the same items.
    """
    log = get_run_logger()
    eval_root = config.eval_store or config.store
    cand = weights_ref(config.store, config.candidate, "candidate")
    registry_store = _training_store(config.store)
    champ: Weights | None = None
    if config.champion or ModelRegistry(registry_store).current(config.line, config.alias) is not None:
        champ = weights_ref(config.store, config.champion_ref(), "champion")
    elif config.require_champion:
        raise ValueError(f"model line {config.line!r} has no {config.alias!r} yet (require_champion is set)")
    if champ is not None and champ.checkpoint == cand.checkpoint:
        _report(config, cand, champ, None, "the candidate already is the champion: nothing to do")
        return _summary(config, False, "already champion", None, cand, champ, None)
    models = [cand.checkpoint, *([champ.checkpoint] if champ is not None else [])]
    result = cast(dict[str, Any], eval_flow(config.eval_config(models)))
    evaluated = _eval_checkpoints(result["results"], len(models))
    if evaluated[0] != cand.checkpoint:  # a state path: the sampler weights the eval saved for it, not a newer ref
        cand = weights_ref(config.store, evaluated[0], "candidate")
    set_alias(config.store, alias_row(registry_store, config.line, "candidate", "set", cand, {"for": config.alias}))
    decision: GateDecision | None = None
    if champ is None:
        note, promote = "no champion yet: the candidate becomes the first", True
    else:
        by_ckpt = _scores(eval_root, result["results"], config.gate.score)
        decision = decide(by_ckpt[evaluated[0]], by_ckpt[evaluated[1]], config.gate)
        promote = decision.promote
        note = "the gate holds" if promote else "the gate does not hold"
    log.info("%s@%s: %s (%s)", config.line, config.alias, "promote" if promote else "keep the champion", note)
    _report(config, cand, champ, decision, note)
    if not promote:
        return _summary(config, False, note, decision, cand, champ, None)
    numbers = decision.model_dump() if decision else {"first_promotion": True}
    row = alias_row(registry_store, config.line, config.alias, "promote", cand, numbers)
    judged = champ.checkpoint if champ is not None else None
    if not config.champion and row["previous"] != judged:  # the alias moved while the two were evaluated
        raise AliasChangedError(
            f"{config.line}@{config.alias} holds {row['previous'] or '(nothing)'} now, not {judged or '(nothing)'} "
            "that the gate compared with: another change came first; nothing promoted (run the promotion again)"
        )
    with transaction():  # the alias change and its history row, undone if a later step fails
        set_alias(config.store, row)
        tag_aliases(config.store, config.line, config.alias, [row["checkpoint"], row["previous"]])
        announce(row)
    return _summary(config, True, note, decision, cand, champ, row)


def _training_store(root: str) -> Any:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=root)


def _eval_checkpoints(results: list[dict[str, Any]], n: int) -> list[str]:
    """The evaluated checkpoints in the order the eval flow took the models (candidate first: each of
    the two resolved references is one target, and the eval flow keeps the order it is given)."""
    seen: list[str] = []
    for r in results:
        if r["checkpoint"] not in seen:
            seen.append(r["checkpoint"])
    if len(seen) != n:
        raise ValueError(f"expected {n} evaluated weights, got {seen}")
    return seen


def _summary(
    config: PromoteConfig,
    promoted: bool,
    reason: str,
    decision: GateDecision | None,
    cand: Weights,
    champ: Weights | None,
    row: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "line": config.line,
        "alias": config.alias,
        "promoted": promoted,
        "reason": reason,
        "decision": decision.model_dump() if decision else None,
        "candidate": cand.checkpoint,
        "champion": champ.checkpoint if champ else None,
        "row": row,
    }
