"""Config text for ``prefect-tinker``: the error type and exit codes, YAML values and files,
``key=value`` overrides, and JSON-safe conversion of results.

YAML follows the YAML 1.2 core rules (``1e-4`` is a float, only true/false are booleans,
``no``/``on`` stay strings). Used by :mod:`prefect_tinker.cli.main` and :mod:`prefect_tinker.cli.flows`.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

# Exit codes
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: a run stopped by Ctrl-C (128 + SIGINT, as a shell reports a process that SIGINT ended)
EXIT_INTERRUPTED = 130


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
    ch: [
        (tag, rx)
        for tag, rx in resolvers
        if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
    ]
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
    if v.endswith("inf"):
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
        CLIError: an item without ``=``, an empty key part, a key given twice
            (``lr=1 lr=2``), or a key set both as a value and as a parent of dotted keys
            (``a=1 a.b=2``).
    """
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # dotted key -> the item that set it
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CLIError(f"expected key=value, got {item!r}")
        parts = key.strip().split(".")
        if any(not p for p in parts):
            raise CLIError(f"bad key {key!r} in {item!r}: empty part between dots")
        dotted = ".".join(parts)
        if dotted in seen:
            raise CLIError(f"key {dotted!r} given twice on the command line: {seen[dotted]!r} and {item!r}")
        seen[dotted] = item
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


def jsonable(v: Any) -> Any:
    """``v`` as JSON-safe values: non-finite floats -> None, datetimes -> ISO text, Decimal ->
    float, bytes -> hex, pydantic models -> their JSON dump, anything else unknown -> ``str``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [jsonable(x) for x in v]
    if hasattr(v, "model_dump"):
        return jsonable(v.model_dump(mode="json"))
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)
