"""``prefect-tinker models``: the model registry of a training store (``models`` table,
:mod:`tinker_blocks.model_registry`).

    prefect-tinker models list [--store ROOT] [--json]                 every line's aliases now
    prefect-tinker models show LINE [--alias A] [--store ROOT] [--json]  a line's history, oldest first
    prefect-tinker models promote LINE WEIGHTS [--alias champion] [--reason TEXT] [--store ROOT]
    prefect-tinker models rollback LINE [--alias champion] [--reason TEXT] [--store ROOT]

``WEIGHTS`` is a ``tinker://`` path, ``run:RUN``, ``alias:LINE@ALIAS`` or a base model name.
``promote`` moves the alias by hand (no gate: ``prefect-tinker run promote`` is the eval-gated
flow); ``rollback`` moves it back to the value before its last promotion not rolled back yet.
With a Prefect API configured (``PREFECT_API_URL``) each change also sends its
``prefect-tinker.model.promoted`` / ``.rolled-back`` event. Exit status: 0, 1 (store error), 2
(a bad name, weights that name nothing, nothing to roll back to).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect_tinker.cli.config import EXIT_FAILED, EXIT_OK, EXIT_USAGE, jsonable
from prefect_tinker.cli.store import STORE_HELP, format_table

__all__ = ["add_parser"]


def _store(args: argparse.Namespace) -> Any:
    from tinker_blocks.store_config import default_store_root
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=args.store or default_store_root())


def _print(rows: list[dict[str, Any]], columns: list[str], as_json: bool) -> None:
    if as_json:
        print(json.dumps(jsonable(rows), indent=2))
    else:
        print(format_table(columns, [[r.get(c) for c in columns] for r in rows], max_width=80))


def _cmd_list(args: argparse.Namespace) -> int:
    from tinker_blocks.model_registry import ModelRegistry

    rows = ModelRegistry(_store(args)).lines()
    _print(rows, ["line", "alias", "checkpoint", "action", "time", "changes"], args.json)
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    from tinker_blocks.model_registry import ModelRegistry

    rows = ModelRegistry(_store(args)).history(args.line, args.alias)
    if not rows and not args.json:
        print(f"model line {args.line!r} has no {'alias ' + repr(args.alias) if args.alias else 'history'}")
        return EXIT_OK
    cols = ["time", "alias", "action", "checkpoint", "source_run", "step", "previous", "decision_json"]
    _print(rows, cols, args.json)
    return EXIT_OK


def _announce(row: dict[str, Any]) -> bool:
    """Send the change's event when a Prefect API is configured; True when sent."""
    from prefect_tinker.cli.prefect_api import api_url_set

    if not api_url_set():
        return False
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    from prefect_tinker.tasks.models import announce

    sent = announce(row) is not None
    drained = EventsWorker.drain_all()
    if inspect.isawaitable(drained):
        run_coro_as_sync(drained)
    return sent


def _change(args: argparse.Namespace, action: str) -> int:
    from prefect_tinker.tasks.models import alias_row
    from tinker_blocks.model_registry import ModelRegistry, WeightsRefError, resolve_weights

    store = _store(args)
    try:
        weights = resolve_weights(store, args.weights, "WEIGHTS") if action == "promote" else None
        decision = {"reason": args.reason or f"{action} by hand (prefect-tinker models {action})"}
        row = alias_row(store, args.line, args.alias, action, weights, decision)
    except WeightsRefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ModelRegistry(store).write(row)
    sent = _announce(row)
    print(
        f"{args.line}@{args.alias} -> {row['checkpoint']}"
        + (f" (was {row['previous']})" if row["previous"] else " (new)")
        + ("; event sent" if sent else "")
    )
    return EXIT_OK


def _guarded(cmd: Any, args: argparse.Namespace, *extra: Any) -> int:
    """Run ``cmd``; a store that cannot be read or written is one line, exit status 1."""
    from tinker_blocks.model_registry import WeightsRefError
    from tinker_blocks.stores import StoreAccessError, StoreError, StoreUnavailableError

    try:
        return int(cmd(args, *extra))
    except WeightsRefError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (StoreError, StoreAccessError, StoreUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def add_parser(sub: Any) -> None:
    """Register ``models list|show|promote|rollback`` on the ``prefect-tinker`` subparsers ``sub``."""
    m = sub.add_parser("models", help="model lines, their aliases (champion, candidate, ...) and history")
    msub = m.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    def command(name: str, help: str, cmd: Any, *extra: Any) -> Any:
        p = msub.add_parser(name, help=help)
        p.set_defaults(func=lambda a: _guarded(cmd, a, *extra))
        return p

    ls = command("list", "every line's aliases now", _cmd_list)
    ls.add_argument("--store", help=STORE_HELP)
    ls.add_argument("--json", action="store_true")
    sh = command("show", "a line's history (the models rows), oldest first", _cmd_show)
    sh.add_argument("line")
    sh.add_argument("--alias", help="only this alias")
    sh.add_argument("--store", help=STORE_HELP)
    sh.add_argument("--json", action="store_true")
    for action, help in (
        ("promote", "point an alias at weights, by hand (no gate; see: run promote)"),
        ("rollback", "move an alias back to its value before the last promotion"),
    ):
        p = command(action, help, _change, action)
        p.add_argument("line")
        if action == "promote":
            p.add_argument("weights", help="tinker:// path, run:RUN, alias:LINE@ALIAS or a base model name")
        p.add_argument("--alias", default="champion", help="default champion")
        p.add_argument("--reason", help="why (stored in decision_json)")
        p.add_argument("--store", help=STORE_HELP)
