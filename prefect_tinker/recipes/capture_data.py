"""Captured chat completions back as training conversations.

:func:`read_captured_conversations` reads the ``captures`` table of a capture store (rows written
by ``prefect-tinker capture serve``), keeps the chat rows an SQL filter selects, and returns one
:class:`~prefect_tinker.recipes.data_sources.Conversation` per row: the request's messages followed
by the assistant message the client was given (content, reasoning, tool calls). A dataset builder
wraps it so that an SFT run can train on what agents produced.

The filter is a DuckDB boolean expression over the columns of ``captures`` (README, "Table
schemas") and two from the capture store's ``ratings``: ``rating`` (the latest rating a client gave
the sequence, ``POST /v1/feedback``: +1 good, -1 bad, or its own number) and ``judge_score`` (the
latest score of source ``judge``), e.g. ``rating > 0``, ``logprob_mean > -1.5``,
``client = 'agent-a'``, ``json_extract_string(metadata_json, '$.task') = 'search'``.
``since`` / ``until`` bound the capture time. It is parsed as one expression
(``duckdb.SQLExpression``: statements, ``;`` and unbalanced parentheses are refused) and applied
with the relational API, on a connection that may read only the store's capture folder
(``enable_external_access`` off, ``allowed_directories`` set, configuration locked), so a filter
cannot read other files, write, or change settings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import duckdb

from prefect_tinker.recipes.data_sources import Conversation

__all__ = [
    "CAPTURE_SOURCE_PREFIX",
    "CaptureFilterError",
    "parse_capture_source",
    "read_captured_conversations",
    "read_captured_preferences",
]

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
    "rating",
    "judge_score",
)
#: the latest client rating and judge score of each captured sequence, beside its columns
_RATED = (
    "SELECT c.*, r.rating, j.judge_score FROM captures c "
    "LEFT JOIN (SELECT request_id, sequence_index, arg_max(rating, time) AS rating FROM ratings "
    "WHERE source = 'client' GROUP BY request_id, sequence_index) r "
    "ON r.request_id = c.request_id AND r.sequence_index = c.sequence_index "
    "LEFT JOIN (SELECT request_id, sequence_index, arg_max(rating, time) AS judge_score FROM ratings "
    "WHERE source = 'judge' GROUP BY request_id, sequence_index) j "
    "ON j.request_id = c.request_id AND j.sequence_index = c.sequence_index"
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
    """Let ``con`` read only the files of the ``captures`` and ``ratings`` tables from now on."""
    con.execute(
        "SET allowed_directories = [?, ?]",
        [io.url(io.table_dir("captures")) + "/", io.url(io.table_dir("ratings")) + "/"],
    )
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _assistant(row: Mapping[str, Any]) -> dict[str, Any]:
    response = json.loads(row["response_json"]) if row.get("response_json") else {}
    msg = dict(response.get("message") or {"role": "assistant", "content": row.get("completion") or ""})
    msg["role"] = "assistant"
    if msg.get("content") is None:
        msg["content"] = ""
    return msg


def _rows(
    store_root: str,
    where_sql: str | None,
    *,
    include_truncated: bool,
    limit: int | None,
    storage_options: Mapping[str, Any] | None,
    since: datetime | None,
    until: datetime | None,
) -> list[dict[str, Any]]:
    """The chat rows of ``captures`` (with ``rating`` and ``judge_score``) that the filter and the
    time window select, oldest first."""
    from tinker_blocks.store_config import resolve_storage_options
    from tinker_blocks.store_io import ParquetStore

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    expr = _expression(where_sql) if where_sql and where_sql.strip() else None
    io = ParquetStore(store_root, "capture", storage_options=resolve_storage_options(store_root, storage_options))
    con = io.connect()
    try:
        _lock_down(con, io)
        rel = con.sql(_RATED).filter("endpoint = 'chat.completions'")
        if not include_truncated:
            rel = rel.filter("coalesce(finish_reason, stop_reason) <> 'length'")
        for op, bound in ((">=", since), ("<", until)):
            if bound is not None:
                when = bound if bound.tzinfo else bound.replace(tzinfo=UTC)
                rel = rel.filter(f"time {op} TIMESTAMPTZ '{when.astimezone(UTC).isoformat()}'")
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
    return [dict(zip(names, values, strict=True)) for values in rows]


def read_captured_conversations(
    store_root: str,
    where_sql: str | None = None,
    *,
    include_truncated: bool = False,
    limit: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[Conversation]:
    """Chat completions captured in the store under ``store_root``, as conversations.

    Args:
        store_root: the root the capture server wrote to (a folder or ``s3://bucket/prefix``).
        where_sql: a DuckDB boolean expression over the ``captures`` columns, ``rating`` and
            ``judge_score`` (see the module docstring); None keeps every chat row.
        include_truncated: keep replies cut by ``max_tokens`` (``finish_reason = 'length'``);
            off by default, since a truncated reply is a poor training target.
        limit: at most this many conversations (oldest first).
        storage_options: fsspec options for S3 roots (default: the AWS_* variables).
        since, until: keep rows captured at or after ``since`` and before ``until`` (naive
            datetimes are UTC).

    Returns:
        One ``Conversation`` per selected row, ordered by capture time, request and sequence:
        ``messages`` = the request's messages (as rendered) + the returned assistant message;
        ``source`` = ``"capture:<run_id>/<request_id>#<sequence_index>"``; ``metadata`` = the
        row's columns (``logprob_mean``, ``client``, ``model``, ``rating``, ...), with ``tools``
        (the request's function schemas, or None) and ``metadata`` (the client's metadata object)
        decoded from JSON. Completion-endpoint rows are never returned.

    Raises:
        CaptureFilterError: ``where_sql`` is not one expression or DuckDB refused it.
        StoreAccessError / StoreUnavailableError: the store cannot be read.
    """
    rows = _rows(
        store_root,
        where_sql,
        include_truncated=include_truncated,
        limit=limit,
        storage_options=storage_options,
        since=since,
        until=until,
    )
    out = []
    for row in rows:
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


def read_captured_preferences(
    store_root: str,
    where_sql: str | None = "rating IS NOT NULL",
    *,
    storage_options: Mapping[str, Any] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    score: str = "rating",
) -> list[dict[str, Any]]:
    """Preference comparisons from rated captures: the rows the filter selects are grouped by
    their conversation (the request's messages and tools); a group whose best and worst
    ``score`` (``rating`` or ``judge_score``) differ gives one comparison, the best reply chosen,
    the worst rejected (ties: the earlier capture).

    Returns:
        ``{"prompt": messages, "chosen": assistant message, "rejected": assistant message,
        "source": [chosen capture, rejected capture]}`` records (the ``preference`` format of
        :mod:`prefect_tinker.recipes.preference`), ordered by each group's first capture.

    Raises:
        CaptureFilterError: a bad filter; ValueError: ``score`` is neither rating nor judge_score.
    """
    if score not in ("rating", "judge_score"):
        raise ValueError(f"score must be rating or judge_score, got {score!r}")
    rows = _rows(
        store_root,
        where_sql,
        include_truncated=False,
        limit=None,
        storage_options=storage_options,
        since=since,
        until=until,
    )
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get(score) is not None:
            groups.setdefault((row["prompt"], row.get("tools_json") or ""), []).append(row)
    out = []
    for (prompt, _), members in groups.items():
        best = max(members, key=lambda r: r[score])  # max/min keep the first of equals: the earlier capture
        worst = min(members, key=lambda r: r[score])
        if best[score] <= worst[score]:
            continue
        out.append(
            {
                "prompt": json.loads(prompt),
                "chosen": _assistant(best),
                "rejected": _assistant(worst),
                "source": [f"capture:{r['run_id']}/{r['request_id']}#{r['sequence_index']}" for r in (best, worst)],
            }
        )
    return out
