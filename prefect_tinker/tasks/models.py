"""Changing an alias of a model line: the ``models`` row, the assets' aliases and the event.

- :func:`alias_row`: the row a change writes (what the alias held before, the weights it holds
  now; for a rollback, the value before the last promotion not rolled back yet). No I/O but reads.
- ``set-alias`` (:func:`set_alias`): writes the row; inside a Prefect transaction its rollback
  hook deletes what it wrote, so an alias change whose later steps fail leaves no trace.
- ``tag-aliases`` (:func:`tag_aliases`): the aliases each touched checkpoint holds now, as the
  metadata and description of its Prefect asset (the ``tinker://`` URI), and the alias itself as
  an asset ``model://<line>/<alias>`` materialized with the checkpoint upstream -- the last link of
  the lineage dataset -> checkpoint -> promotion.
- :func:`announce`: the ``prefect-tinker.model.promoted`` / ``.rolled-back`` event.

Used by the promotion flow (:mod:`prefect_tinker.flows.promote`) inside one transaction, and by
``prefect-tinker models promote|rollback`` (the row and the event, no flow).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE
from prefect.transactions import Transaction, get_transaction

from prefect_tinker.tasks.events import emit_model_changed
from prefect_tinker.tasks.policies import RETRY_OPTIONS
from tinker_blocks.model_registry import ModelRegistry, Weights, WeightsRefError, check_name
from tinker_blocks.store_schemas import make_row_id

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = ["alias_asset_key", "alias_row", "announce", "set_alias", "tag_aliases"]


def alias_asset_key(line: str, alias: str) -> str:
    """The asset key of an alias: ``model://<line>/<alias>``."""
    return f"model://{line}/{alias}"


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


def alias_row(
    store: TrainingStore,
    line: str,
    alias: str,
    action: str,
    weights: Weights | None = None,
    decision: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``models`` row of a change of ``(line, alias)``.

    Args:
        action: ``promote`` or ``set`` (to ``weights``) or ``rollback`` (to the value before the
            last promotion not rolled back yet; ``weights`` unused).
        decision: the gate's numbers or a reason (``decision_json``).

    The row's ``row_id`` is derived from the change and the flow run making it, so a retried
    ``set-alias`` of one flow run writes it once; ``previous`` is what the alias holds now, which
    :meth:`~tinker_blocks.model_registry.ModelRegistry.write` checks again before writing.

    Raises:
        WeightsRefError: a bad name; a rollback with nothing to go back to; promote/set without
            weights.
    """
    check_name(line, "model line")
    check_name(alias, "alias")
    registry = ModelRegistry(store)
    stack = registry.stack(line, alias)
    previous = stack[-1]["checkpoint"] if stack else None
    if action == "rollback":
        if len(stack) < 2:
            raise WeightsRefError(
                f"{line}@{alias}: nothing to roll back to ({'one value so far' if stack else 'never set'})"
            )
        back = stack[-2]
        row = {k: back[k] for k in ("checkpoint", "state_path", "base_model", "source_run", "step", "renderer")}
    elif weights is None:
        raise WeightsRefError(f"{line}@{alias}: {action} needs the weights to point at")
    else:
        row = {
            "checkpoint": weights.checkpoint,
            "state_path": weights.state_path,
            "base_model": weights.base_model,
            "source_run": weights.run_id,
            "step": weights.step,
            "renderer": weights.renderer,
        }
    flow_run_id = _flow_run_id()
    # the same change in the same flow run has the same id (a retried write lands once); outside a flow run,
    # each call is a change of its own
    nonce = flow_run_id or uuid.uuid4().hex
    return {
        **row,
        "row_id": make_row_id("models", line, alias, action, row["checkpoint"], previous, nonce),
        "line": line,
        "alias": alias,
        "action": action,
        "previous": previous,
        "decision_json": decision,
        "flow_run_id": flow_run_id,
    }


def _registry(root: str) -> ModelRegistry:
    from tinker_blocks.stores import TrainingStore

    return ModelRegistry(TrainingStore(root=root))


@task(name="set-alias", task_run_name="{row[action]}-{row[line]}-{row[alias]}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def set_alias(store_root: str, row: dict[str, Any]) -> dict[str, Any]:
    """Append ``row`` (from :func:`alias_row`) to ``models``; returns it. Inside a transaction the
    written part is remembered and deleted if the transaction rolls back.

    Raises:
        AliasChangedError: the alias changed since ``row`` was computed (not retried: nothing written).
    """
    parts = _registry(store_root).write(row)
    txn = get_transaction()
    if txn is not None:
        txn.set("models_parts", parts)
        txn.set("store_root", store_root)
    return row


@set_alias.on_rollback
def _undo_alias(txn: Transaction) -> None:
    parts = txn.get("models_parts", None)
    if parts:
        _registry(txn.get("store_root")).undo(parts)


def _held(registry: ModelRegistry, checkpoint: str) -> list[str]:
    """``line@alias`` of every alias that holds ``checkpoint`` now."""
    return [f"{r['line']}@{r['alias']}" for r in registry.lines() if r["checkpoint"] == checkpoint]


def tag_aliases(store_root: str, line: str, alias: str, checkpoints: list[str]) -> None:
    """Materialize each ``tinker://`` checkpoint of ``checkpoints`` with the aliases it holds now
    (asset metadata ``aliases`` and its description), then the alias asset ``model://<line>/<alias>``
    with the first checkpoint upstream. Base models (no ``tinker://`` URI) have no asset."""
    registry = _registry(store_root)
    for ckpt in dict.fromkeys(c for c in checkpoints if c and c.startswith("tinker://")):
        held = _held(registry, ckpt)
        asset = Asset(
            key=ckpt,
            properties=AssetProperties(description=f"aliases: {', '.join(held) or '(none)'}"),
        )

        def tag(key: str = ckpt, aliases: list[str] = held) -> None:
            add_asset_metadata(key, {"aliases": aliases})

        materialize(
            asset, name="tag-aliases", task_run_name=f"aliases-{ckpt.rsplit('/', 1)[-1]}", cache_policy=NO_CACHE
        )(tag)()
    now = checkpoints[0] if checkpoints else None
    key = alias_asset_key(line, alias)

    def point() -> None:
        add_asset_metadata(key, {"checkpoint": now, "line": line, "alias": alias})

    materialize(
        Asset(key=key, properties=AssetProperties(name=f"{line}@{alias}", description=f"holds {now}")),
        asset_deps=[now] if now and now.startswith("tinker://") else [],
        name="point-alias",
        task_run_name=f"alias-{line}-{alias}",
        cache_policy=NO_CACHE,
    )(point)()


def announce(row: dict[str, Any]) -> Any:
    """The ``prefect-tinker.model.promoted`` / ``.rolled-back`` event of a written row."""
    decision = row.get("decision_json")
    return emit_model_changed(
        row["action"],
        line=row["line"],
        alias=row["alias"],
        checkpoint=row["checkpoint"],
        previous=row.get("previous"),
        run_id=row.get("source_run"),
        decision=decision if isinstance(decision, dict) else None,
    )
