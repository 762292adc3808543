"""Flows known to ``prefect-tinker`` and their configs: the registry, resolving a flow and its
pydantic config model, validating a config from a YAML file plus ``key=value`` overrides (one
line per bad field), and a model's defaults as commented YAML.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefect_tinker.cli.config import CLIError, deep_merge, jsonable, load_yaml_file, parse_overrides

if TYPE_CHECKING:
    from pydantic import BaseModel


def _dotted_keys(d: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        full = f"{prefix}{k}"
        keys.add(full)
        if isinstance(v, dict):
            keys |= _dotted_keys(v, full + ".")
    return keys


def resolve_flow(name: str) -> tuple[Any, type[BaseModel]]:
    """Import flow ``name`` (a registered recipe, see :mod:`prefect_tinker.flows.registry`, or
    ``module:attr``); return ``(flow, ConfigModel)``.

    The config model is the pydantic class annotated on the flow's ``config`` parameter (or its
    only parameter). Raises :class:`CLIError` for an unknown name or a flow without such a parameter.
    """
    from prefect_tinker.flows.registry import RECIPES
    from prefect_tinker.recipes.registry import PluginLoadError

    try:  # a recipe of a working plugin resolves even when another plugin does not import
        target = name if ":" in name else RECIPES[name].flow
    except PluginLoadError as exc:  # a plugin's entry point that does not import
        raise CLIError(str(exc)) from None
    except KeyError:
        raise CLIError(f"unknown flow {name!r}; known flows: {', '.join(RECIPES.names()) or '(none)'}") from None
    if callable(target):  # a built-in recipe: its loader imports the flow
        flow = target()
        return flow, config_model_of(flow, name)
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


def config_model_of(flow: Any, name: str = "?") -> type[BaseModel]:
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


def _model_of_annotation(ann: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``ann`` (``Model``, ``Model | None``), else None."""
    from pydantic import BaseModel

    if inspect.isclass(ann) and issubclass(ann, BaseModel):
        return ann
    models = [a for a in typing.get_args(ann) if inspect.isclass(a) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def unknown_fields(model: type[BaseModel], data: dict[str, Any], prefix: str = "") -> list[str]:
    """Messages for keys of ``data`` that are not fields of ``model`` (recursively), with a
    did-you-mean suggestion. Models that allow extra fields accept any key."""
    from prefect_tinker.recipes.registry import TaggedBy

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
            close = (
                difflib.get_close_matches(key, list(names), n=1)
                or [
                    n
                    for n in names
                    if "".join(w[:1] for w in n.split("_")) == key  # lr -> learning_rate
                ][:1]
            )
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            msgs.append(f"{prefix}{key}: unknown field{hint}")
            continue
        finfo = model.model_fields[names[key]]
        if any(isinstance(m, TaggedBy) for m in finfo.metadata):
            continue  # a union tagged by another field (env_options, options): the config's validator checks it
        sub = _model_of_annotation(finfo.annotation)
        if sub is not None and isinstance(value, dict):
            msgs += unknown_fields(sub, value, f"{prefix}{key}.")
    return msgs


def build_config(
    model: type[BaseModel],
    overrides: Sequence[str] = (),
    config_file: str | None = None,
    flow_name: str = "?",
    example: str | None = None,
) -> Any:
    """Validate ``overrides`` (``key=value``) merged over ``config_file`` against ``model``.
    ``example-data:<path>`` values become the data files the lookup finds
    (:func:`prefect_tinker.cli.examples.resolve_example_data`); ``example`` (``RECIPE/NAME``) names
    the example config in the message of a missing one.

    Raises:
        CLIError: bad ``key=value`` syntax, unreadable YAML, unknown fields, a data file not
            found, or validation errors -- one line per field: ``field = value: reason (source)``
            (a single problem on the heading's line).
    """
    from pydantic import ValidationError

    from prefect_tinker.cli.examples import resolve_example_data

    base = load_yaml_file(config_file) if config_file else {}
    cli = parse_overrides(overrides)
    data = resolve_example_data(deep_merge(base, cli), example)
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
                msg = err["msg"].removeprefix("Value error, ")  # a validator's own message
                if loc == "(config)":  # a check across fields: its message names them
                    problems.append(msg)
                else:
                    problems.append(f"{loc} = {err.get('input')!r}: {msg} (from {source(loc)})")
    else:
        if not problems:
            return config
    head = f"invalid config for flow {flow_name!r} ({model.__name__}):"
    if len(problems) == 1:  # one line: `error: invalid config ...: dataset = '...': file not found: ...`
        raise CLIError(f"{head} {problems[0]}")
    lines = "\n".join(f"  {p}" for p in problems)
    raise CLIError(f"{head}\n{lines}")


def defaults_yaml(model: type[BaseModel], indent: int = 0) -> str:
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
        dumped = json.dumps(jsonable(value), ensure_ascii=False)
        lines.append(f"{pad}{name}: {dumped}{desc}")
    return "\n".join(lines)


def _data_checks(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(section, check)`` for ``config`` and its nested config sections (RLHF's ``sft``, ``rm``,
    ``rl``): reading the local dataset files (``dataset_builder(renderer).check()``) and the other
    inputs (``preflight()``), as :class:`~prefect_tinker.flows.config.PreflightChecks` declares them."""
    from prefect_tinker.flows.config import PreflightChecks, RecipeConfig

    if not isinstance(config, PreflightChecks):
        return []
    checks: list[tuple[str, Any]] = []
    if isinstance(config, RecipeConfig):
        checks.append((prefix, lambda: _check_dataset(config)))
    checks.append((prefix, config.preflight))
    for name, section in config.checked_sections().items():
        checks += _data_checks(section, f"{prefix}{name}.")
    return checks


def _check_dataset(config: Any) -> None:
    builder = config.dataset_builder(config.renderer)
    if builder is not None:
        builder.check()


def check_data(config: Any, flow_name: str = "?") -> None:
    """Read and validate a run's model name and data before anything starts (no Prefect flow run,
    no server, no store row): the base model against what the local server can serve, every record
    of the local dataset files, the RL environment's problems and the record format, as the flow
    itself would.

    Raises:
        CLIError: one line (exit status 2): the unknown model name and what is accepted, or the
            file, line and field of the first bad record
            (``data.jsonl:2: field 'messages' is missing``), or the setting and its value (an
            unknown ``format=``); the original exception is its ``__cause__``.
    """
    from pydantic import ValidationError

    from prefect_tinker.flows.config import RecipeConfig

    if isinstance(config, RecipeConfig):  # a model the local server cannot serve: one line, as a config error
        try:
            config.check_model()
        except ValueError as exc:
            raise CLIError(f"invalid config for flow {flow_name!r} ({type(config).__name__}): {exc}") from exc
    for section, check in _data_checks(config):
        try:
            check()
        except ValidationError as exc:
            problems = [
                f"{section}{'.'.join(str(p) for p in e['loc']) or '(data)'} = {e.get('input')!r}: "
                f"{e['msg'].removeprefix('Value error, ')}"
                for e in exc.errors(include_url=False)
            ]
            raise CLIError(f"invalid data for flow {flow_name!r}: {'; '.join(problems)}") from exc
        except (ValueError, FileNotFoundError, KeyError) as exc:  # DatasetFormatError is a ValueError
            message = " ".join(str(exc).split())  # one line, whatever the message
            where = f"{section.rstrip('.')}: " if section else ""
            raise CLIError(f"invalid data for flow {flow_name!r}: {where}{message}") from exc
