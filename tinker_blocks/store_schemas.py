"""Table schemas of the three stores (training, eval, capture); no I/O here.

Every table has ``row_id`` (string), ``run_id`` (string, also the hive partition) and ``time``
(UTC timestamp, microseconds). Readers keep one row per ``(run_id, row_id)``: the latest ``time``.
Row ids are derived from each table's natural key unless the writer gives one, so writing the
same logical row twice (a retried task, a resumed run) never shows up twice in the views.

Units: times are UTC; ``latency_ms`` is milliseconds; logprobs are natural-log probabilities
(nats); token counts are tokens of the model's tokenizer.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

__all__ = [
    "StoreError",
    "TableSpec",
    "make_row_id",
    "validate_run_id",
    "normalize_row",
    "TIMESTAMP",
    "METRICS_SCHEMA",
    "CHECKPOINTS_SCHEMA",
    "RUNS_SCHEMA",
    "TRAJECTORIES_SCHEMA",
    "MODELS_SCHEMA",
    "EVAL_RESULTS_SCHEMA",
    "EVAL_SAMPLES_SCHEMA",
    "CAPTURES_SCHEMA",
    "RATINGS_SCHEMA",
    "TRAINING_TABLES",
    "EVAL_TABLES",
    "CAPTURE_TABLES",
    "STORES",
]

#: UTC timestamps with microsecond resolution (DuckDB: TIMESTAMPTZ).
TIMESTAMP = pa.timestamp("us", tz="UTC")


def _f(name: str, typ: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


_ROW_ID = _f("row_id", pa.string(), False)
_RUN_ID = _f("run_id", pa.string(), False)
_TIME = _f("time", TIMESTAMP, False)

# ----- training store ---------------------------------------------------------------------------
METRICS_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,
        _f("step", pa.int64(), False),  # optimizer steps taken by the weights that produced the value
        _f("name", pa.string(), False),  # e.g. "train/loss" (nats per trained token), "test/nll"
        _f("value", pa.float64()),  # NaN/inf allowed; the unit depends on the metric
        _TIME,  # when the row was written
    ]
)
CHECKPOINTS_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,
        _f("step", pa.int64(), False),  # optimizer steps done when saved
        _f("name", pa.string(), False),  # checkpoint name, e.g. "step-000100"
        _f("kind", pa.string(), False),  # "state" (weights + optimizer) | "sampler" (weights to sample)
        _f("path", pa.string(), False),  # e.g. "tinker://<model_id>/weights/<name>"
        _TIME,
        _f("renderer", pa.string()),  # renderer the weights were trained with (added in 0.2; null before)
    ]
)
RUNS_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,
        _f("base_model", pa.string()),
        _f("backend", pa.string()),  # "local" | "remote" | "hosted" (free text)
        _f("lora_rank", pa.int64()),
        _f("config_json", pa.string()),  # the flow config as JSON (never secrets)
        _f("status", pa.string()),  # "running" | "completed" | "failed" | "interrupted"
        _TIME,  # time of this status update
        # what the run resolved (added in 0.2; null before): recipe, renderer, tokenizer_id,
        # dataset fingerprint -- compared with a resumed run's own (see prefect_tinker.flows.session)
        _f("meta_json", pa.string()),
    ]
)

TRAJECTORIES_SCHEMA = pa.schema(
    [  # a sample of RL rollouts, for inspection
        _ROW_ID,
        _RUN_ID,
        _f("step", pa.int64(), False),  # optimizer steps of the trainer when the group was trained
        _f("sampler_step", pa.int64()),  # optimizer steps of the weights that sampled it (async: older)
        _f("batch_index", pa.int64(), False),  # dataset batch and group the problem came from
        _f("group_index", pa.int64(), False),
        _f("member", pa.int64(), False),  # index of the trajectory within its group
        _f("prompt", pa.string()),  # the rendered observation text
        _f("response", pa.string()),  # the sampled action text (all turns joined for multi-turn envs)
        _f("reward", pa.float64()),  # total reward (step rewards + group reward)
        _f("advantage", pa.float64()),  # group-centred advantage used in training
        _f("metrics_json", pa.string()),  # env metrics (correct, format, ...) and logs as JSON
        _TIME,
    ]
)

MODELS_SCHEMA = pa.schema(
    [  # the model registry: one row per alias change of a model line (append-only history)
        _ROW_ID,  # random: every change is a row; the latest row of (line, alias) is the alias now
        _RUN_ID,  # the model line (also the partition)
        _f("line", pa.string(), False),  # model line, e.g. "assistant"
        _f("alias", pa.string(), False),  # "champion", "candidate" or any name
        _f("action", pa.string(), False),  # "promote" | "rollback" | "set"
        # what a sampler is made from: tinker:// sampler path or a base model name (as eval_results.checkpoint)
        _f("checkpoint", pa.string(), False),
        _f("state_path", pa.string()),  # tinker://.../weights/... of the same weights (training starts), if any
        _f("base_model", pa.string()),
        _f("source_run", pa.string()),  # the training run the weights come from (null: a base model)
        _f("step", pa.int64()),  # optimizer steps of the weights
        _f("renderer", pa.string()),  # renderer the weights were trained with
        _f("previous", pa.string()),  # checkpoint the alias held before this row (null: new alias)
        _f("decision_json", pa.string()),  # the promotion gate's numbers, or the reason, as JSON
        _f("flow_run_id", pa.string()),  # the Prefect flow run that changed it (null: the command line)
        _TIME,
    ]
)

# ----- eval store -------------------------------------------------------------------------------
EVAL_RESULTS_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,  # the training run whose weights were evaluated (or an eval-only run name)
        _f("step", pa.int64()),  # optimizer steps of the evaluated weights; null for a base model
        _f("checkpoint", pa.string()),  # evaluated weights: tinker:// sampler path or a base model name
        _f("eval_name", pa.string(), False),  # benchmark / task, e.g. "gsm8k", "heldout_nll"
        _f("metric", pa.string(), False),  # e.g. "accuracy" (fraction 0-1), "nll" (nats per token)
        _f("value", pa.float64()),
        _f("num_samples", pa.int64()),  # examples (x samples) the value aggregates
        _f("config_json", pa.string()),  # eval settings (sampling params, renderer, split) as JSON
        _TIME,
    ]
)
EVAL_SAMPLES_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,
        _f("step", pa.int64()),
        _f("checkpoint", pa.string()),
        _f("eval_name", pa.string(), False),
        _f("example_id", pa.string(), False),  # id or index of the dataset example
        _f("sample_index", pa.int64()),  # 0.. when several completions are drawn per example
        _f("prompt", pa.string()),  # the rendered prompt text (or chat messages as JSON)
        _f("completion", pa.string()),  # the sampled completion text
        _f("reference", pa.string()),  # the expected answer, when the eval has one
        _f("score", pa.float64()),  # this sample's score / reward (eval-defined scale)
        _f("correct", pa.bool_()),  # pass/fail, when the eval grades that way
        _f("completion_tokens", pa.int64()),
        _f("extra_json", pa.string()),  # any other per-sample fields as JSON
        _TIME,
    ]
)

# ----- capture store ----------------------------------------------------------------------------
CAPTURES_SCHEMA = pa.schema(
    [
        _ROW_ID,
        _RUN_ID,  # capture session (e.g. the capture server's name or its flow run)
        _f("request_id", pa.string(), False),  # one per HTTP request; n sequences share it
        _f("sequence_index", pa.int64(), False),  # 0..n-1 within the request
        _f("client", pa.string()),  # who called: the /r/<tag>/ path tag, else the request's user, else the User-Agent
        _f("endpoint", pa.string()),  # "chat.completions" | "completions"
        _f("model", pa.string()),  # the model name the client asked for
        _f("checkpoint", pa.string()),  # what was sampled: tinker:// sampler path or base model
        _f("prompt", pa.string()),  # chat messages as JSON, or the completion prompt text
        _f("completion", pa.string()),  # generated text of this sequence
        _f("prompt_tokens", pa.int64()),
        _f("completion_tokens", pa.int64()),
        _f("completion_token_ids", pa.list_(pa.int64())),  # sampled token ids (may be null)
        _f("logprob_sum", pa.float64()),  # sum of sampled-token logprobs, nats
        _f("logprob_mean", pa.float64()),  # logprob_sum / completion_tokens, nats per token
        _f("logprob_min", pa.float64()),  # least likely sampled token, nats
        _f("stop_reason", pa.string()),  # "stop" (stop sequence / EOS) | "length" (max_tokens)
        _f("latency_ms", pa.float64()),  # request received -> response ready, milliseconds
        _f("sampling_json", pa.string()),  # temperature, top_p, max_tokens, seed, stop as JSON
        _f("metadata_json", pa.string()),  # client-supplied metadata / tags as JSON
        _f("finish_reason", pa.string()),  # what the client was told: "stop" | "length" | "tool_calls"
        _f("tools_json", pa.string()),  # chat: the tool (function) schemas of the request as JSON
        _f("response_json", pa.string()),  # chat: {"message": the returned assistant message, ...}
        _TIME,  # when the response was sent
    ]
)


RATINGS_SCHEMA = pa.schema(
    [  # feedback on captured sequences: a client's rating or a judge's score
        _ROW_ID,
        _RUN_ID,  # capture session that received the rating
        _f("request_id", pa.string(), False),  # captures.request_id of the rated sequence
        _f("sequence_index", pa.int64(), False),
        _f("source", pa.string(), False),  # "client" (POST /v1/feedback) | "judge" | any name
        _f("rating", pa.float64(), False),  # client: +1 good, -1 bad (or any number); judge: its score
        _f("label", pa.string()),  # the client's own word for it ("good", "thumbs-up", ...)
        _f("comment", pa.string()),
        _TIME,
    ]
)


@dataclass(frozen=True)
class TableSpec:
    """One table of a store.

    Attributes:
        schema: pyarrow schema; must contain ``row_id`` (string), ``run_id`` (string) and
            ``time`` (timestamp, UTC).
        natural_key: columns whose values identify a row; when a written row has no ``row_id``,
            ``row_id = make_row_id(*values)`` (nulls encoded as JSON null), so a re-write
            deduplicates. Empty -> a random row id.
        required: columns that must be present and non-null in every written row.
        choices: allowed values per column (e.g. ``{"kind": ("state", "sampler")}``).
        evolved: columns were added after parts of this table were first written, so parts of
            older and newer schemas may mix: views read every part's schema (``union_by_name``;
            a missing column reads as null). Only for small tables (one footer read per part).
    """

    schema: pa.Schema
    natural_key: tuple[str, ...] = ()
    required: tuple[str, ...] = ("run_id",)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    evolved: bool = False


TRAINING_TABLES: dict[str, TableSpec] = {
    "metrics": TableSpec(
        METRICS_SCHEMA,
        natural_key=("run_id", "step", "name"),
        required=("run_id", "step", "name"),
    ),
    "checkpoints": TableSpec(
        CHECKPOINTS_SCHEMA,
        natural_key=("run_id", "kind", "name"),
        required=("run_id", "step", "name", "kind", "path"),
        choices={"kind": ("state", "sampler")},
        evolved=True,
    ),
    # one row id per run: each status update replaces the previous one in the view
    "runs": TableSpec(RUNS_SCHEMA, natural_key=("run_id",), required=("run_id",), evolved=True),
    "trajectories": TableSpec(
        TRAJECTORIES_SCHEMA,
        natural_key=("run_id", "step", "batch_index", "group_index", "member"),
        required=("run_id", "step", "batch_index", "group_index", "member"),
    ),
    # append-only history: random row ids, so no change replaces another
    "models": TableSpec(
        MODELS_SCHEMA,
        required=("run_id", "line", "alias", "action", "checkpoint"),
        choices={"action": ("promote", "rollback", "set")},
    ),
}

EVAL_TABLES: dict[str, TableSpec] = {
    "eval_results": TableSpec(
        EVAL_RESULTS_SCHEMA,
        natural_key=("run_id", "eval_name", "checkpoint", "step", "metric"),
        required=("run_id", "eval_name", "metric"),
    ),
    "eval_samples": TableSpec(
        EVAL_SAMPLES_SCHEMA,
        natural_key=("run_id", "eval_name", "checkpoint", "step", "example_id", "sample_index"),
        required=("run_id", "eval_name", "example_id"),
    ),
}

CAPTURE_TABLES: dict[str, TableSpec] = {
    "captures": TableSpec(
        CAPTURES_SCHEMA,
        natural_key=("run_id", "request_id", "sequence_index"),
        required=("run_id", "request_id", "sequence_index"),
    ),
    # the latest rating per (session, sequence, source) wins
    "ratings": TableSpec(
        RATINGS_SCHEMA,
        natural_key=("run_id", "request_id", "sequence_index", "source"),
        required=("run_id", "request_id", "sequence_index", "source", "rating"),
    ),
}

#: store name -> its tables; a root holds each store under ``<root>/<store>/``.
STORES: dict[str, dict[str, TableSpec]] = {
    "training": TRAINING_TABLES,
    "eval": EVAL_TABLES,
    "capture": CAPTURE_TABLES,
}


# ----- row validation ---------------------------------------------------------------------------
class StoreError(ValueError):
    """Bad input to a store: unknown table or column, wrong type, invalid run id."""


_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_id(run_id: Any) -> str:
    """Return ``run_id`` if it is usable as a path segment, else raise :class:`StoreError`.

    Accepted: 1-128 characters from ``A-Z a-z 0-9 . _ -``, starting with a letter or digit.
    """
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise StoreError(
            f"invalid run_id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"
        )
    return run_id


def make_row_id(*parts: Any) -> str:
    """Deterministic row id: hex SHA-1 of the parts' JSON encoding, e.g. ``(run_id, step, name)``."""
    payload = json.dumps(list(parts), default=str, separators=(",", ":"))
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()


def _coerce(table: str, col: str, typ: pa.DataType, value: Any) -> Any:
    """Check/convert one value to the Python type pyarrow expects for ``typ``."""
    if value is None:
        return None
    try:
        if pa.types.is_string(typ):
            if isinstance(value, (dict, list)):
                return json.dumps(value, sort_keys=True, default=str)
            if not isinstance(value, str):
                raise TypeError("expected a string")
            return value
        if pa.types.is_boolean(typ):
            if not isinstance(value, bool):
                raise TypeError("expected true or false")
            return value
        if pa.types.is_integer(typ):
            if isinstance(value, (str, bool)) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError("expected an integer")
            return int(value)
        if pa.types.is_floating(typ):
            if isinstance(value, (str, bool)):
                raise TypeError("expected a number")
            return float(value)
        if pa.types.is_timestamp(typ):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return _dt.datetime.fromtimestamp(value, _dt.UTC)
            if not isinstance(value, _dt.datetime):
                raise TypeError("expected a datetime or a Unix time in seconds")
            if value.tzinfo is None:  # naive datetimes are taken as UTC
                value = value.replace(tzinfo=_dt.UTC)
            return value
        if pa.types.is_list(typ):
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise TypeError("expected a list")
            return [_coerce(table, col, typ.value_type, v) for v in value]
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(
            f"table {table!r}, column {col!r}: bad value {value!r} ({type(value).__name__}): {exc}"
        ) from None
    return value


def normalize_row(table: str, spec: TableSpec, row: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one row of ``table`` and fill ``time`` (now, UTC) and ``row_id`` (from the
    natural key, else random); return a dict with every column of the schema.

    Raises:
        StoreError: unknown column, missing required column, wrong value type, invalid run id,
            a value outside a column's choices.
    """
    schema = spec.schema
    unknown = [k for k in row if schema.get_field_index(k) < 0]
    if unknown:
        raise StoreError(f"table {table!r}: unknown column(s) {unknown}; columns: {schema.names}")
    rec = {f.name: _coerce(table, f.name, f.type, row.get(f.name)) for f in schema}
    for col in spec.required:
        if rec[col] is None:
            raise StoreError(f"table {table!r}: column {col!r} is required (row {dict(row)!r})")
    validate_run_id(rec["run_id"])
    for col, allowed in spec.choices.items():
        if rec[col] is not None and rec[col] not in allowed:
            raise StoreError(f"table {table!r}, column {col!r}: {rec[col]!r} not one of {list(allowed)}")
    if rec["time"] is None:
        rec["time"] = _dt.datetime.now(_dt.UTC)
    if rec["row_id"] is None:
        key = spec.natural_key
        rec["row_id"] = make_row_id(*(rec[k] for k in key)) if key else uuid.uuid4().hex
    return rec
