"""Captured chat completions back as training conversations.

:func:`read_captured_conversations` reads the ``captures`` table of a capture store (rows written
by ``prefect-tinker capture serve``), keeps the chat rows an SQL filter selects, and returns one
:class:`~prefect_tinker.recipes.data_sources.Conversation` per row: the request's messages followed
by the assistant message the client was given (content, reasoning, tool calls). A dataset builder
wraps it so that an SFT run can train on what agents produced.

The filter is a DuckDB boolean expression over the columns of ``captures`` (README, "Table
schemas"), e.g. ``logprob_mean > -1.5``, ``client = 'agent-a'``,
``json_extract_string(metadata_json, '$.task') = 'search'``. It is parsed as one expression
(``duckdb.SQLExpression``: statements, ``;`` and unbalanced parentheses are refused) and applied
with the relational API, on a connection that may read only the store's capture folder
(``enable_external_access`` off, ``allowed_directories`` set, configuration locked), so a filter
cannot read other files, write, or change settings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import duckdb

from prefect_tinker.recipes.data_sources import Conversation

__all__ = ["CAPTURE_SOURCE_PREFIX", "CaptureFilterError", "parse_capture_source", "read_captured_conversations"]

#: ``dataset=`` strings of the form ``capture:<root>[::<filter>]`` (see :func:`parse_capture_source`).
CAPTURE_SOURCE_PREFIX = "capture:"

_COLUMNS = (
    "run_id",
    "request_id",
    "sequence_index",
    "client",
    "model",
    "checkpoint",
    "prompt",
    "completion",
    "prompt_tokens",
    "completion_tokens",
    "logprob_sum",
    "logprob_mean",
    "logprob_min",
    "stop_reason",
    "finish_reason",
    "latency_ms",
    "sampling_json",
    "metadata_json",
    "tools_json",
    "response_json",
    "time",
)


class CaptureFilterError(ValueError):
    """The filter is not one SQL expression, or DuckDB refused it (unknown column, type error,
    a forbidden file access); the message quotes the filter."""


def parse_capture_source(source: str) -> tuple[str, str | None]:
    """Split a ``capture:<root>[::<filter>]`` dataset string into ``(root, filter)``.

    Examples: ``capture:/data/store``; ``capture:s3://bucket/pt::logprob_mean > -1.5 AND
    client = 'agent-a'``. The first ``::`` separates root and filter (roots never contain it).

    Raises:
        ValueError: not a ``capture:`` string, or an empty root.
    """
    if not source.startswith(CAPTURE_SOURCE_PREFIX):
        raise ValueError(f"a capture source starts with {CAPTURE_SOURCE_PREFIX!r}, got {source!r}")
    root, sep, where = source[len(CAPTURE_SOURCE_PREFIX) :].partition("::")
    if not root.strip():
        raise ValueError(f"capture source {source!r} names no store root")
    return root.strip(), (where.strip() or None) if sep else None


def _expression(where_sql: str) -> Any:
    try:
        return duckdb.SQLExpression(where_sql)
    except duckdb.Error as exc:
        raise CaptureFilterError(f"capture filter {where_sql!r} is not one SQL expression: {exc}") from None


def _lock_down(con: duckdb.DuckDBPyConnection, io: Any) -> None:
    """Let ``con`` read only the files of the ``captures`` table from now on."""
    con.execute("SET allowed_directories = [?]", [io._url(io.table_dir("captures")) + "/"])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _assistant(row: Mapping[str, Any]) -> dict[str, Any]:
    response = json.loads(row["response_json"]) if row.get("response_json") else {}
    msg = dict(response.get("message") or {"role": "assistant", "content": row.get("completion") or ""})
    msg["role"] = "assistant"
    if msg.get("content") is None:
        msg["content"] = ""
    return msg


def read_captured_conversations(
    store_root: str,
    where_sql: str | None = None,
    *,
    include_truncated: bool = False,
    limit: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Conversation]:
    """Chat completions captured in the store under ``store_root``, as conversations.

    Args:
        store_root: the root the capture server wrote to (a folder or ``s3://bucket/prefix``).
        where_sql: a DuckDB boolean expression over the ``captures`` columns (see the module
            docstring); None keeps every chat row.
        include_truncated: keep replies cut by ``max_tokens`` (``finish_reason = 'length'``);
            off by default, since a truncated reply is a poor training target.
        limit: at most this many conversations (oldest first).
        storage_options: fsspec options for S3 roots (default: the AWS_* variables).

    Returns:
        One ``Conversation`` per selected row, ordered by capture time, request and sequence:
        ``messages`` = the request's messages (as rendered) + the returned assistant message;
        ``source`` = ``"capture:<run_id>/<request_id>#<sequence_index>"``; ``metadata`` = the
        row's columns (``logprob_mean``, ``client``, ``model``, ...), with ``tools`` (the
        request's function schemas, or None) and ``metadata`` (the client's metadata object)
        decoded from JSON. Completion-endpoint rows are never returned.

    Raises:
        CaptureFilterError: ``where_sql`` is not one expression or DuckDB refused it.
        StoreAccessError / StoreUnavailableError: the store cannot be read.
    """
    from tinker_blocks.store_io import ParquetStore, resolve_storage_options

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    expr = _expression(where_sql) if where_sql and where_sql.strip() else None
    io = ParquetStore(store_root, "capture", storage_options=resolve_storage_options(store_root, storage_options))
    con = io.connect()
    try:
        _lock_down(con, io)
        rel = con.table("captures").filter("endpoint = 'chat.completions'")
        if not include_truncated:
            rel = rel.filter("coalesce(finish_reason, stop_reason) <> 'length'")
        try:
            if expr is not None:
                rel = rel.filter(expr)
            rel = rel.select(*_COLUMNS).order("time, run_id, request_id, sequence_index")
            if limit is not None:
                rel = rel.limit(int(limit))
            names, rows = rel.columns, rel.fetchall()
        except duckdb.Error as exc:
            raise CaptureFilterError(f"capture filter {where_sql!r} failed: {exc}") from None
    finally:
        con.close()
    out = []
    for values in rows:
        row = dict(zip(names, values, strict=True))
        messages = json.loads(row["prompt"]) + [_assistant(row)]
        meta = {k: v for k, v in row.items() if k not in ("prompt", "response_json", "tools_json", "metadata_json")}
        meta["tools"] = json.loads(row["tools_json"]) if row.get("tools_json") else None
        meta["metadata"] = json.loads(row["metadata_json"]) if row.get("metadata_json") else None
        out.append(
            Conversation(
                messages=messages,
                source=f"capture:{row['run_id']}/{row['request_id']}#{row['sequence_index']}",
                metadata=meta,
                field="captures",
            )
        )
    return out
