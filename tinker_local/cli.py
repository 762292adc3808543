"""Command line of ``tinker_local``.

    python -m tinker_local serve --model tiny [--model M2] --port 8000 --host 127.0.0.1 \
        --root ~/.prefect-tinker [--dtype auto|float32|bfloat16] [--device cpu|cuda] \
        [--fail-every N] [--drop-every M]

``main(argv)`` is also what ``prefect-tinker local serve ...`` calls.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


DTYPES = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}


def default_root() -> Path:
    """``$PREFECT_TINKER_HOME`` or ``~/.prefect-tinker``."""
    return Path(os.environ.get("PREFECT_TINKER_HOME") or Path.home() / ".prefect-tinker")


def build_parser(prog: str = "python -m tinker_local") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Local Tinker-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the Tinker API on host:port")
    s.add_argument("--model", action="append", default=[], metavar="M",
                   help="base model to preload (repeatable): 'tiny', 'smollm2', an HF id or a "
                        "local HF model directory; others load lazily on create_model")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    s.add_argument("--root", type=Path, default=None,
                   help="folder for checkpoints, model cache and registry "
                        "(default $PREFECT_TINKER_HOME or ~/.prefect-tinker)")
    s.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="training/forward compute dtype (default auto: bf16 autocast where the "
                        "CPU/GPU supports it, else fp32); sampling always runs in fp32")
    s.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--fail-every", type=int, default=None, metavar="N",
                   help="fault injection: answer every N-th API request with HTTP 503 "
                        "(default $TINKER_LOCAL_FAIL_EVERY or 0 = off)")
    s.add_argument("--drop-every", type=int, default=None, metavar="M",
                   help="fault injection: run every M-th API request, then drop its connection "
                        "before the response body (default $TINKER_LOCAL_DROP_EVERY or 0 = off)")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m tinker_local") -> int:
    """Parse ``argv`` (without the program name) and run the command; returns an exit code."""
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        if not 0 < args.port < 65536:
            print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
            return 2
        from .faults import FaultConfig
        from .server import serve

        try:
            env = FaultConfig.from_env()
            faults = FaultConfig(env.fail_every if args.fail_every is None else args.fail_every,
                                 env.drop_every if args.drop_every is None else args.drop_every)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        serve(args.model, host=args.host, port=args.port, root=args.root or default_root(),
              dtype=DTYPES[args.dtype], device=args.device, num_threads=args.threads,
              log_level=args.log_level, faults=faults)
    return 0
