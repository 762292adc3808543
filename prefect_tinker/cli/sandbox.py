"""``prefect-tinker sandbox run FILE.py [--timeout S]``: run one file in the code sandbox, print JSON.

Prints the :class:`~prefect_tinker.recipes.sandbox.SandboxResult` (``exit_code``, ``stdout``,
``stderr``, ``timed_out``, ``killed``, ``reason``, ``detail``, ...) as one JSON object.  Exit status:
0 when the program exited 0 on its own, 1 when it failed or hit a limit or the sandbox is unavailable
(``error: ...`` on stderr), 2 for bad usage.  The parser is registered in ``cli/main.py`` through
:func:`add_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``sandbox`` command (``sandbox run FILE.py``) to an argparse ``subparsers`` object."""
    p = subparsers.add_parser("sandbox", help="run untrusted Python in the code sandbox (sandbox run FILE.py)")
    sub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)
    r = sub.add_parser("run", help="run FILE.py in a fresh sandbox and print the result as JSON")
    r.add_argument("file", help="Python file to run (copied into the sandbox's empty /sandbox)")
    r.add_argument("args", nargs="*", help="arguments of the program")
    r.add_argument("--timeout", type=float, default=10.0, metavar="S", help="wall-time limit, seconds (default 10)")
    r.add_argument("--cpu", type=float, default=None, metavar="S", help="CPU-time limit, seconds (default: timeout)")
    r.add_argument("--memory-mb", type=int, default=512, help="address space per process, MiB (default 512)")
    r.add_argument(
        "--max-processes", type=int, default=8, help="processes and threads, the sandbox's PID 1 included (default 8)"
    )
    r.add_argument("--max-output-kb", type=int, default=64, help="output kept per stream, KiB (default 64)")
    r.add_argument("--stdin", metavar="FILE", default=None, help="file to feed as standard input")
    r.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``sandbox run`` for parsed ``args``; returns the exit status."""
    from pydantic import ValidationError

    from prefect_tinker.recipes.sandbox.core import FILE_NAME_RE, SandboxConfig, SandboxUnavailable, run_python

    out = out or sys.stdout
    path = Path(args.file)
    try:
        code = path.read_text(encoding="utf-8")
        stdin = Path(args.stdin).read_bytes() if args.stdin else None
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {exc.filename if isinstance(exc, OSError) else path}: {exc}", file=sys.stderr)
        return 2
    try:
        config = SandboxConfig(
            timeout_s=args.timeout,
            cpu_s=args.cpu,
            memory_bytes=args.memory_mb << 20,
            max_processes=args.max_processes,
            max_output_bytes=args.max_output_kb << 10,
        )
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"error: bad sandbox limits: {bad}", file=sys.stderr)
        return 2
    name = path.name if path.suffix == ".py" and FILE_NAME_RE.match(path.name) else "main.py"
    try:
        result = run_python(code, args=args.args, stdin=stdin, config=config, main_name=name)
    except SandboxUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.model_dump(), indent=2), file=out)
    return 0 if result.passed else 1
