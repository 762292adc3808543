"""DuckDB SQL of a store table's view: its Parquet parts read with the table's columns and types,
and every row's copies (a part and its compacted copy, a rewritten metric) reduced to the newest.

Pure functions of a :class:`~tinker_blocks.store_schemas.TableSpec` and part URLs; the store
(:class:`~tinker_blocks.store_io.ParquetStore`) decides which parts to read.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from tinker_blocks.store_schemas import TableSpec

__all__ = ["cast_columns", "dedup_window", "deduplicated_select", "duck_type", "empty_select", "sql_str"]


def sql_str(s: str) -> str:
    """``s`` for a single-quoted SQL string literal (quotes doubled)."""
    return s.replace("'", "''")


_SCALARS = (
    (pa.types.is_string, "VARCHAR"),
    (pa.types.is_int64, "BIGINT"),
    (pa.types.is_int32, "INTEGER"),
    (pa.types.is_float64, "DOUBLE"),
    (pa.types.is_float32, "FLOAT"),
    (pa.types.is_boolean, "BOOLEAN"),
)


def duck_type(t: pa.DataType) -> str:
    """The DuckDB type of an Arrow type of the store schemas.  Raises TypeError for others."""
    for test, name in _SCALARS:
        if test(t):
            return name
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ" if t.tz else "TIMESTAMP"
    if pa.types.is_list(t):
        return f"{duck_type(t.value_type)}[]"
    raise TypeError(f"no DuckDB type mapping for {t}")


def cast_columns(spec: TableSpec) -> str:
    """The select list of the table's columns, each cast to its schema type."""
    return ", ".join(f'CAST("{f.name}" AS {duck_type(f.type)}) AS "{f.name}"' for f in spec.schema)


def dedup_window(spec: TableSpec) -> str:
    """The window numbering the copies of a row, newest first. Partitioned by the natural key
    columns as well as the row id (same groups when row ids come from the natural key), so that
    filters on those columns (``name = 'train/loss'``, ``step > 100``) are pushed below the
    window instead of deduplicating the whole table first. Copies with the same ``time`` (a part
    and its compacted copy) hold the same values; which one is kept does not matter."""
    keys = ["run_id", *(k for k in spec.natural_key if k != "run_id"), "row_id"]
    part = ", ".join(f'"{k}"' for k in keys)
    return f"row_number() OVER (PARTITION BY {part} ORDER BY time DESC)"


def deduplicated_select(spec: TableSpec, urls: Sequence[str], *, glob: bool, union_by_name: bool) -> str:
    """SELECT of the table's columns (cast to the schema's types) over ``urls``, one row per row id.

    ``glob``: ``urls`` is one glob pattern (``.../**/*.parquet``); else a list of part files.
    ``union_by_name``: read every part's schema when the view is bound (slow over S3; needed when
    parts of older and newer schemas mix).  ``run_id`` comes from the hive partition folders."""
    where = f"'{sql_str(urls[0])}'" if glob else "[" + ", ".join(f"'{sql_str(u)}'" for u in urls) + "]"
    cols = cast_columns(spec)
    src = (
        f"read_parquet({where}, hive_partitioning=true, "
        f"union_by_name={'true' if union_by_name else 'false'}, hive_types={{'run_id': VARCHAR}})"
    )
    return f"SELECT {cols} FROM {src} QUALIFY {dedup_window(spec)} = 1"


def empty_select(spec: TableSpec) -> str:
    """SELECT with the table's columns and zero rows (a table without parts yet)."""
    cols = ", ".join(f'CAST(NULL AS {duck_type(f.type)}) AS "{f.name}"' for f in spec.schema)
    return f"SELECT {cols} WHERE false"
