"""Store commands of ``prefect-tinker``: ``sql``, ``runs``, ``evals``, ``checkpoints`` and ``store
check|repair`` over the stores (a folder or ``s3://bucket/prefix``), printed as an aligned table or JSON.

Unreadable parts are skipped with a warning naming them (:mod:`tinker_blocks.store_health`).
Exit status: 0 success, 1 a SQL or store error, a local store root that does not exist
(printed as ``error: ...``), or ``store check`` finding damage.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import decimal
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefect_tinker.cli.config import EXIT_FAILED, EXIT_OK, EXIT_USAGE, jsonable

STORE_HELP = "store root: a folder or s3:// URL (default: $PREFECT_TINKER_STORE or ~/.prefect-tinker/store)"


def _cell(v: Any, width: int | None) -> str:
    if v is None:
        s = "NULL"
    elif isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, _dt.datetime):
        s = v.isoformat(sep=" ", timespec="milliseconds")
    else:
        s = str(v)
    s = s.replace("\n", "\\n")
    return s if width is None or len(s) <= width else s[: width - 1] + "…"


def format_table(names: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int | None = 60) -> str:
    """Rows as an aligned text table with a header and a ``(N rows)`` footer; cells longer than
    ``max_width`` characters are cut (ending in ``…``; None: never, for names and paths)."""
    cells = [[_cell(v, max_width) for v in r] for r in rows]
    widths = [len(n) for n in names]
    for r in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=True)]
    numeric = [
        all(isinstance(r[i], (int, float, decimal.Decimal)) or r[i] is None for r in rows) for i in range(len(names))
    ]

    def line(vals: Sequence[str]) -> str:
        return " | ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric, strict=True)
        ).rstrip()

    out = [line(names), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out)


def _missing_local_root(root: str) -> str | None:
    """The absolute path of a local store ``root`` that does not exist, else None (URLs such as
    ``s3://`` are not checked here)."""
    if "://" in root:
        return None
    path = Path(root).expanduser()
    return None if path.exists() else str(path.absolute())


def _run_query(root: str, sql: str, params: list[Any]) -> tuple[list[str], list[tuple]] | int:
    """``(names, rows)`` of ``sql`` over the stores at ``root``, or the exit status after
    printing the error."""
    import duckdb

    missing = _missing_local_root(root)
    if missing is not None:  # a typo in --store would otherwise read as an empty store
        print(
            f"error: store root {missing} does not exist (no run has written there; "
            "give --store ROOT or set $PREFECT_TINKER_STORE)",
            file=sys.stderr,
        )
        return EXIT_FAILED

    from tinker_blocks.store_io import StoreAccessError, StoreError, StoreUnavailableError
    from tinker_blocks.store_sql import query_stores

    try:  # re-run on a fresh listing after a concurrent compaction; damaged parts are skipped
        return query_stores(root, sql, params)
    except (duckdb.Error, StoreError, StoreAccessError, StoreUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _print_rows(names: Sequence[str], rows: Sequence[Sequence[Any]], as_json: bool, max_width: int | None = 60) -> int:
    if as_json:
        print(json.dumps([jsonable(dict(zip(names, r, strict=True))) for r in rows], indent=2, ensure_ascii=False))
    elif names:
        print(format_table(names, rows, max_width))
    return EXIT_OK


def _print_query(root: str, sql: str, params: list[Any], as_json: bool) -> int:
    got = _run_query(root, sql, params)
    return got if isinstance(got, int) else _print_rows(*got, as_json)


def _default_store() -> str:
    from tinker_blocks.store_config import default_store_root

    return default_store_root()


def cmd_sql(args: argparse.Namespace) -> int:
    """``prefect-tinker sql``: the rows of ``args.query`` over every store view."""
    return _print_query(args.store or _default_store(), args.query, [], args.json)


#: optimizer steps a run took: its train metrics are logged at steps 0..n-1 (the loss of the batch
#: at index s, before update s+1) and its checkpoints at the number of updates taken; evaluations
#: after the last update are logged at step n, so max(step) + 1 over all metrics would count n + 1
RUNS_SQL = (
    "SELECT run_id, json_extract_string(meta_json, '$.recipe') AS recipe, status, base_model, backend, lora_rank, "
    "time AS updated, "
    "greatest((SELECT max(step) + 1 FROM metrics m WHERE m.run_id = r.run_id AND m.name LIKE 'train/%'), "
    "(SELECT max(step) FROM checkpoints c WHERE c.run_id = r.run_id)) AS steps_done "
    "FROM runs r ORDER BY time DESC"
)


def stale_statuses(root: str, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of ``runs`` with ``status`` ``"stale"`` instead of ``"running"`` for runs whose
    lease (:mod:`tinker_blocks.lease`) is stale or gone: their process died without recording
    an end (killed, or the final write failed). Leases that cannot be read leave the row as is."""
    from tinker_blocks.lease import lease_status
    from tinker_blocks.store_io import ParquetStore

    io = None
    out = []
    for r in rows:
        if r.get("status") == "running":
            try:
                io = io or ParquetStore(root, "training")
                if lease_status(io, r["run_id"]) != "live":
                    r = {**r, "status": "stale"}
            except Exception as exc:  # an unreadable lease must not hide the listing
                print(f"warning: could not read the lease of run {r['run_id']!r}: {exc}", file=sys.stderr)
        out.append(r)
    return out


def cmd_runs(args: argparse.Namespace) -> int:
    """``prefect-tinker runs``: every run, newest first, with its recipe, its status (``running``,
    ``completed``, ``failed``, ``interrupted`` by Ctrl-C, or ``stale``: marked running but its process
    is gone) and the optimizer steps it took."""
    root = args.store or _default_store()
    got = _run_query(root, RUNS_SQL, [])
    if isinstance(got, int):
        return got
    names, rows = got
    fixed = stale_statuses(root, [dict(zip(names, r, strict=True)) for r in rows])
    return _print_rows(names, [tuple(r[n] for n in names) for r in fixed], args.json)


#: one row per evaluated (run, benchmark, step, checkpoint): accuracy, its 95% interval and the
#: examples (x samples) it aggregates, newest evaluation time; other metrics counted
EVALS_SQL = (
    "SELECT run_id, eval_name, step, checkpoint, "
    "max(CASE WHEN metric = 'accuracy' THEN value END) AS accuracy, "
    "max(CASE WHEN metric = 'accuracy_ci95_low' THEN value END) AS ci95_low, "
    "max(CASE WHEN metric = 'accuracy_ci95_high' THEN value END) AS ci95_high, "
    "max(CASE WHEN metric = 'accuracy' THEN num_samples END) AS samples, "
    "count(*) AS metrics, max(time) AS time "
    "FROM eval_results {where}GROUP BY run_id, eval_name, step, checkpoint "
    "ORDER BY run_id, eval_name, step NULLS FIRST, checkpoint"
)


def cmd_evals(args: argparse.Namespace) -> int:
    """``prefect-tinker evals [--run R]``: evaluation results, one row per run, benchmark and
    evaluated weights (step, checkpoint) with accuracy and its 95% interval."""
    where, params = ("WHERE run_id = ? ", [args.run]) if args.run else ("", [])
    return _print_query(args.store or _default_store(), EVALS_SQL.format(where=where), params, args.json)


def cmd_store(args: argparse.Namespace) -> int:
    """``prefect-tinker store check|repair``: list (check) or move into ``<root>/_quarantine/``
    (repair) the unreadable parts and the temporaries of dead writers. Exit status of check: 0
    when the store is sound, 1 when it found something (or failed)."""
    from tinker_blocks.store_io import StoreAccessError, StoreUnavailableError
    from tinker_blocks.store_repair import check_root, repair_root

    root = args.store or _default_store()
    missing = _missing_local_root(root)
    if missing is not None:
        print(f"error: store root {missing} does not exist", file=sys.stderr)
        return EXIT_FAILED
    try:
        if args.action == "check":
            report, moved_to = check_root(root), None
        else:
            report, moved_to = repair_root(root)
    except (OSError, StoreAccessError, StoreUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    rows = [p.as_row() for p in report.problems]
    if args.json:
        print(
            json.dumps(
                {"root": root, "parts_checked": report.parts_checked, "problems": rows, "quarantine": moved_to},
                indent=2,
            )
        )
    else:
        if rows:
            print(format_table(["kind", "path", "size", "reason"], [tuple(r.values()) for r in rows], max_width=120))
        damaged = sum(r["kind"] == "damaged" for r in rows)
        print(
            f"{report.parts_checked} parts read under {root}: {damaged} unreadable, "
            f"{len(rows) - damaged} temporaries of dead writers"
        )
        if moved_to:
            print(f"moved {len(rows)} file(s) to {moved_to} (see manifest.json there; nothing deleted)")
        elif rows:
            print(f"'prefect-tinker store repair --store {root}' moves them aside")
    return EXIT_OK if (report.ok or args.action == "repair") else EXIT_FAILED


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """``prefect-tinker checkpoints RUN_ID``: the run's checkpoints by step and kind."""
    root = args.store or _default_store()
    sql = "SELECT step, kind, name, path, time FROM checkpoints WHERE run_id = ? ORDER BY step, kind"
    got = _run_query(root, sql, [args.run_id])
    if isinstance(got, int):
        return got
    if not got[1]:  # no checkpoint: a run that saved none yet, or a run id that is not in the store
        known = _run_query(root, "SELECT count(*) FROM runs WHERE run_id = ?", [args.run_id])
        if isinstance(known, int):
            return known
        if not known[1][0][0]:
            print(
                f"error: no run {args.run_id!r} in the store {root} (prefect-tinker runs --store {root} lists them)",
                file=sys.stderr,
            )
            return EXIT_USAGE
    return _print_rows(*got, args.json, max_width=None)  # whole tinker:// paths: they are copied into commands


def add_parsers(sub: Any) -> None:
    """Register ``sql``, ``runs``, ``evals``, ``checkpoints`` and ``store`` on the ``prefect-tinker`` subparsers."""
    s = sub.add_parser(
        "sql", help="run SQL over the stores (tables: runs, metrics, checkpoints, eval_results, eval_samples, captures)"
    )
    s.add_argument("--store", help=STORE_HELP)
    s.add_argument("--json", action="store_true", help="print rows as a JSON array")
    s.add_argument("query", help="SQL, e.g. \"SELECT step, value FROM metrics WHERE name = 'train/loss'\"")
    s.set_defaults(func=cmd_sql)

    rs = sub.add_parser("runs", help="list runs in the training store")
    rs.add_argument("--store", help=STORE_HELP)
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_runs)

    ev = sub.add_parser(
        "evals", help="list evaluation results (accuracy and 95%% interval per run, benchmark and checkpoint)"
    )
    ev.add_argument("--store", help=STORE_HELP)
    ev.add_argument("--run", metavar="RUN_ID", help="only this run's results")
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_evals)

    st = sub.add_parser(
        "store", help="check a store for unreadable parts and leftover temporaries, or move them aside (repair)"
    )
    st.add_argument(
        "action",
        choices=["check", "repair"],
        help="check: list them (exit 1 when any); repair: move them to ROOT/_quarantine/",
    )
    st.add_argument("--store", help=STORE_HELP)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_store)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints")
    ck.add_argument("run_id")
    ck.add_argument("--store", help=STORE_HELP)
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_checkpoints)
