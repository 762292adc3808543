"""Store commands of ``prefect-tinker``: ``sql``, ``runs`` and ``checkpoints`` over the stores
(a folder or ``s3://bucket/prefix``), printed as an aligned table or JSON.

Exit status: 0 success, 1 a SQL or store error or a local store root that does not exist
(printed as ``error: ...``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import decimal
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from prefect_tinker.flows.cli_config import EXIT_FAILED, EXIT_OK, jsonable

STORE_HELP = "store root: a folder or s3:// URL (default: $PREFECT_TINKER_STORE or ~/.prefect-tinker/store)"


def _cell(v: Any, width: int) -> str:
    if v is None:
        s = "NULL"
    elif isinstance(v, float):
        s = f"{v:.6g}"
    elif isinstance(v, _dt.datetime):
        s = v.isoformat(sep=" ", timespec="milliseconds")
    else:
        s = str(v)
    s = s.replace("\n", "\\n")
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(names: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60) -> str:
    """Rows as an aligned text table with a header and a ``(N rows)`` footer."""
    cells = [[_cell(v, max_width) for v in r] for r in rows]
    widths = [len(n) for n in names]
    for r in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    numeric = [
        all(isinstance(r[i], (int, float, decimal.Decimal)) or r[i] is None for r in rows)
        for i in range(len(names))
    ]

    def line(vals: Sequence[str]) -> str:
        return " | ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)
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


def _print_query(root: str, sql: str, params: list[Any], as_json: bool) -> int:
    import duckdb

    missing = _missing_local_root(root)
    if missing is not None:  # a typo in --store would otherwise read as an empty store
        print(f"error: store root {missing} does not exist (no run has written there; "
              "give --store ROOT or set $PREFECT_TINKER_STORE)", file=sys.stderr)
        return EXIT_FAILED

    from tinker_blocks.store_io import StoreAccessError, StoreError, StoreUnavailableError
    from tinker_blocks.store_sql import query_stores

    try:  # re-run on a fresh listing when a concurrent compaction deleted a listed part
        names, rows = query_stores(root, sql, params)
    except (duckdb.Error, StoreError, StoreAccessError, StoreUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        print(json.dumps([jsonable(dict(zip(names, r))) for r in rows], indent=2, ensure_ascii=False))
    elif names:
        print(format_table(names, rows))
    return EXIT_OK


def _default_store() -> str:
    from tinker_blocks.store_io import default_store_root

    return default_store_root()


def cmd_sql(args: argparse.Namespace) -> int:
    """``prefect-tinker sql``: the rows of ``args.query`` over every store view."""
    return _print_query(args.store or _default_store(), args.query, [], args.json)


def cmd_runs(args: argparse.Namespace) -> int:
    """``prefect-tinker runs``: every run, newest first, with its status and steps done (metrics are logged at steps 0..n-1)."""
    sql = (
        "SELECT run_id, status, base_model, backend, lora_rank, time AS updated, "
        "(SELECT max(step) + 1 FROM metrics m WHERE m.run_id = r.run_id) AS steps_done "
        "FROM runs r ORDER BY time DESC"
    )
    return _print_query(args.store or _default_store(), sql, [], args.json)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    """``prefect-tinker checkpoints RUN_ID``: the run's checkpoints by step and kind."""
    sql = "SELECT step, kind, name, path, time FROM checkpoints WHERE run_id = ? ORDER BY step, kind"
    return _print_query(args.store or _default_store(), sql, [args.run_id], args.json)


def add_parsers(sub: Any) -> None:
    """Register ``sql``, ``runs`` and ``checkpoints`` on the ``prefect-tinker`` subparsers."""
    s = sub.add_parser("sql", help="run SQL over the stores (tables: runs, metrics, checkpoints, "
                       "eval_results, eval_samples, captures)")
    s.add_argument("--store", help=STORE_HELP)
    s.add_argument("--json", action="store_true", help="print rows as a JSON array")
    s.add_argument("query", help='SQL, e.g. "SELECT step, value FROM metrics WHERE name = \'loss\'"')
    s.set_defaults(func=cmd_sql)

    rs = sub.add_parser("runs", help="list runs in the training store")
    rs.add_argument("--store", help=STORE_HELP)
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_runs)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints")
    ck.add_argument("run_id")
    ck.add_argument("--store", help=STORE_HELP)
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_checkpoints)
