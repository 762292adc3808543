"""The argument encoding of an uploaded custom-loss graph (``tinker_local.custom_loss``).

The SDK writes each node's arguments as JSON: plain scalars and lists as they are, everything else
as a one-key object (``{"ref": node}``, ``{"tuple": [...]}``, ``{"dict": {...}}``,
``{"slice": [start, stop, step]}``, ``{"ellipsis": true}``, ``{"float": "inf"|"-inf"|"nan"}``,
``{"dtype": name}``, ``{"device": name}``, ``{"layout": "strided"}``, ``{"memory_format": name}``;
see ``tinker.types.CustomLossGraph``).  ``decode_arg`` turns that into Python values with ``Ref``
placeholders for node values (any other encoding is refused with ``CustomLossError``), ``refs``
lists the nodes an argument names, and ``resolve`` substitutes the values when the graph runs
(an encoded device becomes the device the loss runs on).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .loss_limits import CustomLossError

MAX_ARG_DEPTH = 16  # nesting of one node's arguments (lists, tuples, dicts, slices)
_DTYPES = {
    n: getattr(torch, n)
    for n in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "long",
        "int",
        "float",
        "double",
        "half",
    )
}
_MEMORY_FORMATS = {n: getattr(torch, n) for n in ("contiguous_format", "preserve_format")}


@dataclass(frozen=True)
class Ref:
    """The value of the earlier node ``name`` (an argument encoded as ``{"ref": name}``)."""

    name: str


class DeviceArg:
    """An encoded ``torch.device``: replaced by the device the loss runs on."""


def decode_arg(where: str, v: Any, depth: int = 0) -> Any:
    """One encoded argument ``v`` as a Python value (``Ref`` for a node's value, ``DeviceArg`` for a
    device); ``CustomLossError`` naming ``where`` for an unknown encoding or nesting deeper than
    ``MAX_ARG_DEPTH``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if depth >= MAX_ARG_DEPTH:
        raise CustomLossError(f"{where}: arguments nested more than {MAX_ARG_DEPTH} levels deep")
    depth += 1
    if isinstance(v, list):
        return [decode_arg(where, x, depth) for x in v]
    if not isinstance(v, dict) or len(v) != 1:
        raise CustomLossError(f"{where}: cannot decode argument {str(v)[:80]!r}")
    ((key, x),) = v.items()
    if key == "ref" and isinstance(x, str):
        return Ref(x)
    if key == "tuple" and isinstance(x, list):
        return tuple(decode_arg(where, a, depth) for a in x)
    if key == "dict" and isinstance(x, dict):
        return {str(k): decode_arg(where, a, depth) for k, a in x.items()}
    if key == "slice" and isinstance(x, list) and len(x) == 3:
        return slice(*(decode_arg(where, a, depth) for a in x))
    if key == "ellipsis" and x is True:
        return Ellipsis
    if key == "float" and x in ("inf", "-inf", "nan"):
        return float(x)
    if key == "dtype" and x in _DTYPES:
        return _DTYPES[x]
    if key == "device" and isinstance(x, str):
        return DeviceArg()
    if key == "layout" and x == "strided":
        return torch.strided
    if key == "memory_format" and x in _MEMORY_FORMATS:
        return _MEMORY_FORMATS[x]
    raise CustomLossError(f"{where}: argument encoding {key!r} with value {str(x)[:40]!r} is not allowed")


def refs(v: Any) -> Iterator[str]:
    """The names of the nodes a decoded argument refers to, in order."""
    if isinstance(v, Ref):
        yield v.name
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from refs(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from refs(x)
    elif isinstance(v, slice):
        yield from refs([v.start, v.stop, v.step])


def resolve(v: Any, env: dict[str, Any], device: torch.device) -> Any:
    """A decoded argument with node values from ``env`` (node name -> value) and ``device`` in
    place of an encoded device."""
    if isinstance(v, Ref):
        return env[v.name]
    if isinstance(v, DeviceArg):
        return device
    if isinstance(v, list):
        return [resolve(x, env, device) for x in v]
    if isinstance(v, tuple):
        return tuple(resolve(x, env, device) for x in v)
    if isinstance(v, dict):
        return {k: resolve(x, env, device) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(*(resolve(x, env, device) for x in (v.start, v.stop, v.step)))
    return v
