"""The model registry: named model lines, their aliases and their history, in the training store's
``models`` table; and the one resolver of weights references.

A *model line* (``assistant``, ``support-bot``) is a sequence of weights that replace one another in
service. An *alias* names one of them: ``champion`` (the weights in service), ``candidate`` (the
weights being considered) or any other name. Each change of an alias is one row of ``models``
(:data:`~tinker_blocks.store_schemas.MODELS_SCHEMA`): the table is append-only history and the
alias now is the latest row of its ``(line, alias)``::

    SELECT line, alias, arg_max(checkpoint, time) AS checkpoint FROM models GROUP BY line, alias

``action`` is ``promote`` (a new value: a gate passed, or set by hand), ``set`` (a new value that is
not a promotion, e.g. the ``candidate`` a gate is about to judge) or ``rollback`` (back to the value
before the last promotion that was not rolled back yet): replaying the rows of an alias as a stack
(promote/set push, rollback pops) gives its value and what a rollback returns to.

Weights references, accepted wherever a model or checkpoint is (:func:`resolve_weights`):

- ``alias:LINE@ALIAS`` (``alias:LINE`` = ``alias:LINE@champion``): what the alias holds now;
- ``run:RUN``: the last checkpoint the training run ``RUN`` recorded;
- a ``tinker://`` path (its run, step and renderer looked up in ``checkpoints``);
- anything else: a base model name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker_blocks.store_schemas import StoreError, validate_run_id

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = [
    "ALIAS_PREFIX",
    "RUN_PREFIX",
    "AliasChangedError",
    "ModelRegistry",
    "Weights",
    "WeightsRefError",
    "is_weights_ref",
    "parse_alias_ref",
    "resolve_weights",
]

ALIAS_PREFIX = "alias:"
RUN_PREFIX = "run:"
DEFAULT_ALIAS = "champion"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class WeightsRefError(ValueError):
    """A weights reference that names nothing: a bad ``alias:`` form, an alias never set, a run
    without checkpoints, a store that does not exist. One line naming the field and the reference."""


class AliasChangedError(WeightsRefError):
    """An alias change computed from a value the alias no longer holds: another writer (a scheduled
    flywheel, a promotion, ``prefect-tinker models``) changed it in between. Nothing was written."""


@dataclass(frozen=True)
class Weights:
    """Weights a reference resolved to.

    Attributes:
        checkpoint: what a sampling client is made from: a ``tinker://.../sampler_weights/...``
            path, a ``tinker://.../weights/...`` state path when the run saved no sampler weights
            at that step, or a base model name.
        state_path: the ``tinker://.../weights/...`` state of the same weights (a training run
            can start from it), None for a base model or when none is recorded.
        base_model: the base model of the weights (None when the store does not know it).
        run_id, step: the training run and its optimizer steps (None for a base model).
        renderer: the renderer the weights were trained with (None: unknown or a base model).
        line, alias: set when the reference was ``alias:LINE@ALIAS``.
    """

    checkpoint: str
    state_path: str | None = None
    base_model: str | None = None
    run_id: str | None = None
    step: int | None = None
    renderer: str | None = None
    line: str | None = None
    alias: str | None = None

    @property
    def is_base(self) -> bool:
        """Whether these are a base model's weights (no ``tinker://`` checkpoint)."""
        return not self.checkpoint.startswith("tinker://")

    @property
    def sampler(self) -> str:
        """The sampling-client form: ``base:<model>`` or the ``tinker://`` path."""
        return f"base:{self.checkpoint}" if self.is_base else self.checkpoint


def is_weights_ref(value: Any) -> bool:
    """Whether ``value`` is a ``run:`` or ``alias:`` reference (resolved through the store)."""
    return isinstance(value, str) and value.startswith((RUN_PREFIX, ALIAS_PREFIX))


def check_name(value: str, what: str) -> str:
    """``value`` if usable as a line or alias name (1-64 of ``A-Z a-z 0-9 . _ -``, starting with a
    letter or digit), else :class:`WeightsRefError` naming ``what``."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise WeightsRefError(
            f"{what} {value!r}: use 1-64 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
    return value


def parse_alias_ref(ref: str) -> tuple[str, str]:
    """``(line, alias)`` of ``alias:LINE@ALIAS`` (``alias:LINE``: the ``champion``).

    Raises:
        WeightsRefError: not an ``alias:`` reference, or a bad line or alias name.
    """
    if not ref.startswith(ALIAS_PREFIX):
        raise WeightsRefError(f"{ref!r} is not an alias reference (alias:LINE@ALIAS)")
    line, _, alias = ref[len(ALIAS_PREFIX) :].partition("@")
    return check_name(line, "model line"), check_name(alias or DEFAULT_ALIAS, "alias")


class ModelRegistry:
    """The model lines of one training store (see the module docstring).

    Args:
        store: the training store holding the ``models`` table.
    """

    def __init__(self, store: TrainingStore):
        self.store = store

    # ----- reading ---------------------------------------------------------------------------
    def lines(self) -> list[dict[str, Any]]:
        """Every alias of every line as it is now: ``line, alias, checkpoint, action, time,
        changes`` (rows of that alias so far), sorted by line and alias."""
        return self.store.query(
            "SELECT line, alias, arg_max(checkpoint, time) AS checkpoint, arg_max(action, time) AS action, "
            "max(time) AS time, count(*) AS changes FROM models GROUP BY line, alias ORDER BY line, alias"
        )

    def history(self, line: str, alias: str | None = None) -> list[dict[str, Any]]:
        """The rows of ``line`` (of one ``alias``), oldest first."""
        check_name(line, "model line")
        sql, params = "SELECT * FROM models WHERE line = ?", [line]
        if alias is not None:
            sql, params = sql + " AND alias = ?", [line, check_name(alias, "alias")]
        return self.store.query(sql + " ORDER BY time, row_id", params)

    def current(self, line: str, alias: str = DEFAULT_ALIAS) -> dict[str, Any] | None:
        """The latest row of ``(line, alias)`` (the alias's value now), or None when never set."""
        rows = self.history(line, alias)
        return rows[-1] if rows else None

    def stack(self, line: str, alias: str = DEFAULT_ALIAS) -> list[dict[str, Any]]:
        """The alias's values as a stack (promote/set push, rollback pops), bottom first: the
        last entry is its value now, the one before it what a rollback returns to."""
        stack: list[dict[str, Any]] = []
        for row in self.history(line, alias):
            if row["action"] == "rollback":
                if stack:
                    stack.pop()
                if not stack or stack[-1]["checkpoint"] != row["checkpoint"]:  # never seen: keep it
                    stack.append(row)
            else:
                stack.append(row)
        return stack

    # ----- writing ---------------------------------------------------------------------------
    def write(self, row: dict[str, Any]) -> list[str]:
        """Append one ``models`` row (``run_id`` = its ``line``) if the alias still holds the row's
        ``previous`` value (compare and set); returns the written part paths (what :meth:`undo`
        deletes), ``[]`` when the alias's latest row already is this ``row_id`` (a retried write that
        had landed).

        The check reads the alias then writes: two writers that both pass it within the same instant
        are not told apart (the store has no conditional write); the later row wins.

        Raises:
            AliasChangedError: the alias holds another value than ``row["previous"]`` now.
            StoreError: bad values (an unknown ``action``, a missing column).
        """
        row = {**row, "run_id": check_name(row["line"], "model line")}
        check_name(row["alias"], "alias")
        now = self.current(row["line"], row["alias"])
        if now is not None and row.get("row_id") is not None and now["row_id"] == row["row_id"]:
            return []
        held, expected = (now["checkpoint"] if now is not None else None), row.get("previous")
        if held != expected:
            raise AliasChangedError(
                f"{row['line']}@{row['alias']} holds {held or '(nothing)'} now, not {expected or '(nothing)'} as when "
                f"this {row['action']} was computed: another change came first; nothing written"
            )
        if isinstance(row.get("decision_json"), dict):
            row["decision_json"] = json.dumps(row["decision_json"], sort_keys=True, default=str)
        with self.store.writer("models", writer_id="models", flush_rows=1) as w:
            w.write(row)
        return list(w.parts_written)

    def undo(self, parts: list[str]) -> None:
        """Delete the parts :meth:`write` returned (a change rolled back before it counted)."""
        self.store.parquet_store().delete_parts("models", parts)


# ----- the resolver -------------------------------------------------------------------------------
def _missing_store(store: TrainingStore) -> bool:
    return "://" not in store.root and not Path(store.root).expanduser().is_dir()


def _run_weights(store: TrainingStore, run_id: str, field: str) -> Weights:
    make = f"train it first, e.g. prefect-tinker run sft --example tiny run_name={run_id} store={store.root}"
    if _missing_store(store):
        raise WeightsRefError(f"{field}=run:{run_id}: the training store {store.root} does not exist ({make})")
    try:
        validate_run_id(run_id)
    except StoreError as exc:
        raise WeightsRefError(f"{field}=run:{run_id}: {exc}") from None
    rows = store.query(
        "SELECT step, kind, path, renderer FROM checkpoints WHERE run_id = ? ORDER BY step DESC, time DESC", [run_id]
    )
    if not rows:
        raise WeightsRefError(
            f"{field}=run:{run_id}: the training store {store.root} has no checkpoint of run {run_id!r} ({make})"
        )
    step = int(rows[0]["step"])
    at = [r for r in rows if int(r["step"]) == step]
    sampler = next((r for r in at if r["kind"] == "sampler"), None)
    state = next((r for r in rows if r["kind"] == "state"), None)  # the newest state (resumable)
    run = store.get_run(run_id)
    return Weights(
        checkpoint=(sampler or at[0])["path"],
        state_path=state["path"] if state is not None and int(state["step"]) == step else None,
        base_model=run.get("base_model") if run else None,
        run_id=run_id,
        step=step,
        renderer=next((r["renderer"] for r in at if r["renderer"]), None),
    )


def _path_weights(store: TrainingStore, path: str) -> Weights:
    """A ``tinker://`` path, with what ``checkpoints`` knows of it (its run's other kind at the
    same step: the state of a sampler path and the reverse)."""
    if _missing_store(store):
        return Weights(checkpoint=path, state_path=path if "/weights/" in path else None)
    rows = store.query(
        "SELECT run_id, step, renderer FROM checkpoints WHERE path = ? ORDER BY time DESC LIMIT 1", [path]
    )
    if not rows:
        return Weights(checkpoint=path, state_path=path if "/weights/" in path else None)
    known = rows[0]
    twins = store.query(
        "SELECT kind, path FROM checkpoints WHERE run_id = ? AND step = ? ORDER BY time DESC",
        [known["run_id"], known["step"]],
    )
    sampler = next((r["path"] for r in twins if r["kind"] == "sampler"), None)
    state = next((r["path"] for r in twins if r["kind"] == "state"), None)
    run = store.get_run(known["run_id"])
    return Weights(
        checkpoint=sampler or path,
        state_path=state,
        base_model=run.get("base_model") if run else None,
        run_id=known["run_id"],
        step=int(known["step"]),
        renderer=known["renderer"],
    )


def _alias_weights(store: TrainingStore, ref: str, field: str) -> Weights:
    line, alias = parse_alias_ref(ref)
    row = None if _missing_store(store) else ModelRegistry(store).current(line, alias)
    if row is None:
        raise WeightsRefError(
            f"{field}={ref}: model line {line!r} has no alias {alias!r} in the training store {store.root} "
            f"(set one: prefect-tinker models promote {line} WEIGHTS --alias {alias} --store {store.root})"
        )
    return Weights(
        checkpoint=row["checkpoint"],
        state_path=row["state_path"],
        base_model=row["base_model"],
        run_id=row["source_run"],
        step=None if row["step"] is None else int(row["step"]),
        renderer=row["renderer"],
        line=line,
        alias=alias,
    )


def resolve_weights(store: TrainingStore, ref: str, field: str = "model") -> Weights:
    """What ``ref`` names now (see the module docstring): an ``alias:`` reference, ``run:RUN``, a
    ``tinker://`` path or a base model name, resolved through the training store ``store``.

    Args:
        field: the config field or option being resolved, for the error message.

    Raises:
        WeightsRefError: one line naming ``field`` and ``ref``: an alias never set, a run with no
            checkpoint, a store that does not exist, a bad name.
    """
    ref = ref.strip()
    if ref.startswith(ALIAS_PREFIX):
        return _alias_weights(store, ref, field)
    if ref.startswith(RUN_PREFIX):
        if not ref[len(RUN_PREFIX) :]:
            raise WeightsRefError(f"{field}={ref}: name a run (run:<run_id>)")
        return _run_weights(store, ref[len(RUN_PREFIX) :], field)
    if ref.startswith("tinker://"):
        return _path_weights(store, ref)
    base = ref.removeprefix("base:")
    if not base:
        raise WeightsRefError(f"{field}: empty weights reference")
    return Weights(checkpoint=base, base_model=base)
