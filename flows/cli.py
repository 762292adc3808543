"""``prefect-tinker`` command line: thin over the flows and the stores.

Subcommands::

    prefect-tinker sql [--store ROOT] [--json] "SELECT ..."     query the stores (folder or s3://)
    prefect-tinker run FLOW [key=value ...] [--config FILE.yaml]  validate a config, run a flow
    prefect-tinker show-config FLOW [--schema]                  defaults (YAML) or JSON schema
    prefect-tinker runs [--store ROOT] [--json]                 runs and their latest status
    prefect-tinker checkpoints RUN_ID [--store ROOT] [--json]   a run's checkpoints
    prefect-tinker local serve ...                              the local Tinker-compatible server
    prefect-tinker show-example DATA --tokenizer T [...]        a rendered example, trained tokens highlighted
    prefect-tinker ops install-automations [--within S]         crash runs whose heartbeats stop (flows/ops.py)

Exit status: 0 success, 1 runtime failure (SQL error, the flow failed), 2 bad usage or an
invalid config (the message names each bad field and its value; no traceback).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import decimal
import difflib
import importlib
import inspect
import json
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

#: flow name -> "module:attribute" of a Prefect flow (or plain function) taking ``config``.
FLOWS: dict[str, str] = {"sft": "flows.sft:sft_flow", "rl": "flows.rl:rl_flow"}
#: extra registrations, ``name=module:attr`` separated by commas (e.g. for plugins and tests).
FLOWS_ENV = "PREFECT_TINKER_FLOWS"

# Exit codes
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user error reported as ``error: <message>`` with exit status ``code`` (no traceback)."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------------------------
# YAML scalars with YAML 1.2 core rules: `1e-4` is a float, only true/false are booleans,
# `no`/`on`/`1:20` stay strings, `08` is the integer 8.
# ----------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    pass


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in (
        "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    v = loader.construct_scalar(node)
    return int(v, 16) if v.lower().startswith("0x") else int(v, 10)


def _construct_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    v = str(loader.construct_scalar(node)).lower().lstrip("+")
    if v.endswith(("inf")):
        return -math.inf if v.startswith("-") else math.inf
    if v.endswith("nan"):
        return math.nan
    return float(v)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_value(text: str) -> Any:
    """Parse one command-line value as a YAML scalar/flow value.

    ``8`` -> 8, ``1e-4`` -> 0.0001, ``true`` -> True, ``null`` -> None, ``[1, 2]`` -> [1, 2],
    ``no`` -> "no", empty -> "". Text that is not valid YAML is kept as a string.
    """
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Load a YAML mapping from ``path`` (same scalar rules as :func:`parse_value`).

    Raises:
        CLIError: missing file, invalid YAML (with line and column) or a top level that is not
            a mapping.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise CLIError(f"cannot read config file {str(p)!r}: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CLIError(f"invalid YAML in {p}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CLIError(f"config file {p} must hold a mapping of fields, got {type(data).__name__}")
    return data


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into ``{"a": {"b": 1}, "c": "x"}`` (values via :func:`parse_value`).

    Raises:
        CLIError: an item without ``=``, an empty key part, or a key set both as a value and as
            a parent of dotted keys (``a=1 a.b=2``).
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CLIError(f"expected key=value, got {item!r}")
        parts = key.strip().split(".")
        if any(not p for p in parts):
            raise CLIError(f"bad key {key!r} in {item!r}: empty part between dots")
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise CLIError(f"key {'.'.join(parts[: i + 1])!r} is set to a value and used as a group in {item!r}")
            node = nxt
        if isinstance(node.get(parts[-1]), dict):
            raise CLIError(f"key {key!r} is a group of fields already set with dotted keys; got {item!r}")
        node[parts[-1]] = parse_value(raw)
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursive merge: mappings are merged, anything else in ``over`` replaces ``base``."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _dotted_keys(d: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        full = f"{prefix}{k}"
        keys.add(full)
        if isinstance(v, dict):
            keys |= _dotted_keys(v, full + ".")
    return keys


# ----------------------------------------------------------------------------------------------
# Flows and their config models
# ----------------------------------------------------------------------------------------------
def flow_registry() -> dict[str, str]:
    """:data:`FLOWS` plus registrations from ``$PREFECT_TINKER_FLOWS`` (``name=mod:attr,...``)."""
    reg = dict(FLOWS)
    for entry in filter(None, (e.strip() for e in os.environ.get(FLOWS_ENV, "").split(","))):
        name, sep, target = entry.partition("=")
        if not sep or ":" not in target:
            raise CLIError(f"bad entry {entry!r} in ${FLOWS_ENV}: expected name=module:attr")
        reg[name.strip()] = target.strip()
    return reg


def resolve_flow(name: str) -> tuple[Any, type]:
    """Import flow ``name`` (a registry name or ``module:attr``); return ``(flow, ConfigModel)``.

    The config model is the pydantic class annotated on the flow's ``config`` parameter (or its
    only parameter). Raises :class:`CLIError` for an unknown name or a flow without such a parameter.
    """
    reg = flow_registry()
    target = reg.get(name) or (name if ":" in name else None)
    if target is None:
        raise CLIError(f"unknown flow {name!r}; known flows: {', '.join(sorted(reg)) or '(none)'}")
    mod_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and mod_name.startswith(exc.name):
            raise CLIError(f"flow {name!r}: module {mod_name!r} not found") from None
        raise
    try:
        flow = getattr(module, attr)
    except AttributeError:
        raise CLIError(f"flow {name!r}: module {mod_name!r} has no attribute {attr!r}") from None
    return flow, config_model_of(flow, name)


def config_model_of(flow: Any, name: str = "?") -> type:
    """The pydantic model class of ``flow``'s ``config`` parameter (see :func:`resolve_flow`)."""
    from pydantic import BaseModel

    fn = getattr(flow, "fn", flow)  # a Prefect Flow wraps the function in .fn
    params = list(inspect.signature(fn).parameters.values())
    param = next((p for p in params if p.name == "config"), params[0] if len(params) == 1 else None)
    if param is None:
        raise CLIError(f"flow {name!r} has no 'config' parameter")
    try:
        ann = typing.get_type_hints(fn).get(param.name, param.annotation)
    except Exception:
        ann = param.annotation
    if not (inspect.isclass(ann) and issubclass(ann, BaseModel)):
        raise CLIError(f"flow {name!r}: parameter {param.name!r} is not annotated with a pydantic model")
    return ann


def _model_of_annotation(ann: Any) -> type | None:
    """The pydantic model inside ``ann`` (``Model``, ``Model | None``), else None."""
    from pydantic import BaseModel

    if inspect.isclass(ann) and issubclass(ann, BaseModel):
        return ann
    models = [a for a in typing.get_args(ann) if inspect.isclass(a) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def unknown_fields(model: type, data: dict[str, Any], prefix: str = "") -> list[str]:
    """Messages for keys of ``data`` that are not fields of ``model`` (recursively), with a
    did-you-mean suggestion. Models that allow extra fields accept any key."""
    if model.model_config.get("extra") == "allow":
        return []
    names: dict[str, str] = {}
    for fname, finfo in model.model_fields.items():
        names[fname] = fname
        if finfo.alias:
            names[finfo.alias] = fname
    msgs = []
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1) or [
                n for n in names if "".join(w[:1] for w in n.split("_")) == key  # lr -> learning_rate
            ][:1]
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            msgs.append(f"{prefix}{key}: unknown field{hint}")
            continue
        sub = _model_of_annotation(model.model_fields[names[key]].annotation)
        if sub is not None and isinstance(value, dict):
            msgs += unknown_fields(sub, value, f"{prefix}{key}.")
    return msgs


def build_config(
    model: type, overrides: Sequence[str] = (), config_file: str | None = None, flow_name: str = "?"
) -> Any:
    """Validate ``overrides`` (``key=value``) merged over ``config_file`` against ``model``.

    Raises:
        CLIError: bad ``key=value`` syntax, unreadable YAML, unknown fields, or validation
            errors -- one line per field: ``field = value: reason (source)``.
    """
    from pydantic import ValidationError

    base = load_yaml_file(config_file) if config_file else {}
    cli = parse_overrides(overrides)
    data = deep_merge(base, cli)
    cli_keys = _dotted_keys(cli)

    def source(loc: str) -> str:
        if loc in cli_keys:
            return "command line"
        return f"{config_file}" if config_file else "default"

    problems = unknown_fields(model, data)
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"]) or "(config)"
            if err["type"] == "extra_forbidden":
                continue  # already reported by unknown_fields, with a suggestion
            if err["type"] == "missing":
                problems.append(f"{loc}: required field missing")
            else:
                problems.append(f"{loc} = {err.get('input')!r}: {err['msg']} (from {source(loc)})")
    else:
        if not problems:
            return config
    lines = "\n".join(f"  {p}" for p in problems)
    raise CLIError(f"invalid config for flow {flow_name!r} ({model.__name__}):\n{lines}")


def defaults_yaml(model: type, indent: int = 0) -> str:
    """The model's fields as commented YAML (defaults; required fields shown as ``null``)."""
    from pydantic import BaseModel

    pad = " " * indent
    lines = []
    for name, f in model.model_fields.items():
        desc = f"  # {f.description}" if f.description else ""
        sub = _model_of_annotation(f.annotation)
        if f.is_required():
            if sub is not None:
                lines.append(f"{pad}{name}:  # required{desc[3:] and ': ' + desc[4:]}")
                lines.append(defaults_yaml(sub, indent + 2))
                continue
            lines.append(f"{pad}{name}: null  # required{desc[3:] and ': ' + desc[4:]}")
            continue
        value = f.get_default(call_default_factory=True)
        if isinstance(value, BaseModel) and sub is not None:
            lines.append(f"{pad}{name}:{desc}")
            lines.append(defaults_yaml(sub, indent + 2))
            continue
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        dumped = json.dumps(_jsonable(value), ensure_ascii=False)
        lines.append(f"{pad}{name}: {dumped}{desc}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Output helpers
# ----------------------------------------------------------------------------------------------
def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "model_dump"):
        return _jsonable(v.model_dump(mode="json"))
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


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


def _store_connect(root: str):
    """All stores under ``root`` (a folder or ``s3://bucket/prefix``; S3 credentials and endpoint
    from the AWS environment variables) as views on one DuckDB connection."""
    from tinker_blocks.store_io import connect_stores

    return connect_stores(root)


def _print_query(root: str, sql: str, params: list[Any], as_json: bool) -> int:
    import duckdb

    from tinker_blocks.store_io import StoreAccessError, StoreError, StoreUnavailableError

    try:
        con = _store_connect(root)
        cur = con.execute(sql, params)
        names = [d[0] for d in cur.description] if cur.description else []
        rows = cur.fetchall() if cur.description else []
    except (duckdb.Error, StoreError, StoreAccessError, StoreUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        print(json.dumps([_jsonable(dict(zip(names, r))) for r in rows], indent=2, ensure_ascii=False))
    elif names:
        print(format_table(names, rows))
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------
def _default_store() -> str:
    from tinker_blocks.store_io import default_store_root

    return default_store_root()


def cmd_sql(args: argparse.Namespace) -> int:
    return _print_query(args.store or _default_store(), args.query, [], args.json)


def cmd_runs(args: argparse.Namespace) -> int:
    sql = (
        "SELECT run_id, status, base_model, backend, lora_rank, time AS updated, "
        "(SELECT max(step) FROM metrics m WHERE m.run_id = r.run_id) AS last_step "
        "FROM runs r ORDER BY time DESC"
    )
    return _print_query(args.store or _default_store(), sql, [], args.json)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    sql = "SELECT step, kind, name, path, time FROM checkpoints WHERE run_id = ? ORDER BY step, kind"
    return _print_query(args.store or _default_store(), sql, [args.run_id], args.json)


def cmd_run(args: argparse.Namespace) -> int:
    # Without PREFECT_API_URL a flow starts a temporary Prefect server; on a busy machine it
    # needs longer than Prefect's 20 s default to answer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    flow, model = resolve_flow(args.flow)
    config = build_config(model, args.overrides, args.config, args.flow)
    if args.dry_run:
        print(config.model_dump_json(indent=2))
        return EXIT_OK
    try:
        result = flow(config=config)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # the flow's own logs carry the traceback
        print(f"error: flow {args.flow!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if result is not None:
        print(json.dumps(_jsonable(result), indent=2, ensure_ascii=False))
    return EXIT_OK


def cmd_show_config(args: argparse.Namespace) -> int:
    _, model = resolve_flow(args.flow)
    if args.schema:
        print(json.dumps(model.model_json_schema(), indent=2))
    else:
        print(f"# {model.__name__} for flow {args.flow!r}; use with: prefect-tinker run "
              f"{args.flow} --config FILE.yaml [key=value ...]")
        print(defaults_yaml(model))
    return EXIT_OK


def cmd_local(argv: list[str]) -> int:
    try:
        from tinker_local.cli import main as local_main
    except ImportError as exc:
        raise CLIError(f"the local server is not available: {exc}", EXIT_FAILED) from None
    rc = local_main(argv)
    return int(rc or 0)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``prefect-tinker`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="prefect-tinker",
        description="LLM post-training flows over the Tinker API: run flows, query stores.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    store_help = "store root: a folder or s3:// URL (default: $PREFECT_TINKER_STORE or ~/.prefect-tinker/store)"

    s = sub.add_parser("sql", help="run SQL over the stores (tables: runs, metrics, checkpoints, "
                       "eval_results, eval_samples, captures)")
    s.add_argument("--store", help=store_help)
    s.add_argument("--json", action="store_true", help="print rows as a JSON array")
    s.add_argument("query", help='SQL, e.g. "SELECT step, value FROM metrics WHERE name = \'loss\'"')
    s.set_defaults(func=cmd_sql)

    r = sub.add_parser("run", help="run a flow with a validated config")
    r.add_argument("flow", help="flow name (e.g. sft) or module:attr")
    r.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config fields; nested with dots (optimizer.lr=1e-4); values are YAML scalars")
    r.add_argument("--config", metavar="FILE.yaml", help="YAML config; key=value pairs override it")
    r.add_argument("--dry-run", action="store_true", help="validate and print the config, do not run")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("show-config", help="print a flow's config defaults (YAML) or JSON schema")
    c.add_argument("flow")
    c.add_argument("--schema", action="store_true", help="print the JSON schema instead")
    c.set_defaults(func=cmd_show_config)

    rs = sub.add_parser("runs", help="list runs in the training store")
    rs.add_argument("--store", help=store_help)
    rs.add_argument("--json", action="store_true")
    rs.set_defaults(func=cmd_runs)

    ck = sub.add_parser("checkpoints", help="list a run's checkpoints")
    ck.add_argument("run_id")
    ck.add_argument("--store", help=store_help)
    ck.add_argument("--json", action="store_true")
    ck.set_defaults(func=cmd_checkpoints)

    sub.add_parser("local", help="local Tinker-compatible server: local serve --model M --port P",
                   add_help=False)

    from recipes.show import add_parser as add_show_example  # logic lives in recipes/show.py

    add_show_example(sub)
    from flows.ops import add_parser as add_ops  # prefect-tinker ops ...: automations for crashed runs

    add_ops(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``prefect-tinker``; returns the exit status (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "local":
            return cmd_local(argv[1:])
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:
                # key=value pairs after --config land here; anything else is a usage error
                if args.command == "run" and all("=" in e and not e.startswith("-") for e in extra):
                    args.overrides = list(args.overrides) + extra
                else:
                    parser.error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return args.func(args)
    except CLIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
