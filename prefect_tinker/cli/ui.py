"""``prefect-tinker ui``: the local Prefect server with its UI, which ``prefect-tinker run`` reports to.

    prefect-tinker ui [--no-browser] [--port P] [--root DIR]   start it if needed, print its URL, open a browser
    prefect-tinker ui status [--json] [--root DIR]             the recorded server (exit 1: none runs)
    prefect-tinker ui stop [--root DIR]                        stop it (its database stays)

The server and its files: :mod:`prefect_tinker.cli.prefect_server`. With ``PREFECT_API_URL`` set,
runs report to that server instead: ``ui`` then prints (and opens) that server's UI and starts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from prefect_tinker.cli.config import EXIT_FAILED, EXIT_OK, CLIError

__all__ = ["add_parser", "cmd_ui"]


def _open(url: str, no_browser: bool) -> None:
    print(url)
    if no_browser:
        return
    import webbrowser

    try:
        opened = webbrowser.open(url)
    except webbrowser.Error:
        opened = False
    if not opened:
        print("(no browser found here: open the URL above yourself)", file=sys.stderr)


def _own_server_url() -> str | None:
    """The UI of the user's own Prefect server when ``PREFECT_API_URL`` is set, else None."""
    from prefect.settings import Settings, get_current_settings

    # the environment as it is now (Settings() reads it afresh), else the loaded settings (a profile)
    settings = Settings() if os.environ.get("PREFECT_API_URL") else get_current_settings()
    if not settings.api.url:
        return None
    return str(settings.ui_url or settings.api.url)


def _describe(status: dict[str, Any]) -> str:
    if not status["running"]:
        return f"not running: recorded pid {status['pid']} ({status['ui_url']}) is gone; database in {status['home']}"
    health = "healthy" if status["healthy"] else "NOT answering /api/health"
    up = time.time() - float(status.get("started_at") or time.time())
    return (
        f"running: {status['ui_url']} ({health}), pid {status['pid']}, up {up / 60:.0f} min, "
        f"Prefect {status.get('identity', {}).get('prefect', '?')}, database in {status['home']}, log {status['log']}"
    )


def cmd_ui(args: argparse.Namespace) -> int:
    """``prefect-tinker ui [open|status|stop]`` (see the module docstring)."""
    from prefect_tinker.cli.prefect_server import (
        PrefectServerError,
        ensure_prefect_server,
        prefect_server_folder,
        prefect_server_status,
        stop_prefect_server,
    )

    folder = prefect_server_folder(args.root)
    if args.action == "status":
        status = prefect_server_status(args.root)
        if args.json:
            print(json.dumps(status, indent=2))
        elif status is None:
            print(f"no local Prefect server recorded in {folder / 'server.json'}")
        else:
            print(_describe(status))
        own = _own_server_url()
        if own and not args.json:
            print(f"note: PREFECT_API_URL is set: runs report to that server ({own}), not to this one")
        return EXIT_OK if status and status["running"] else EXIT_FAILED
    if args.action == "stop":
        stopped = stop_prefect_server(args.root)
        if stopped is None:
            print(f"no local Prefect server recorded in {folder / 'server.json'}")
        elif stopped["stopped"]:
            print(f"stopped the local Prefect server pid {stopped['pid']} ({stopped['ui_url']}); database kept")
        else:
            print(f"the local Prefect server pid {stopped['pid']} was not running; removed its stale record")
        return EXIT_OK
    own = _own_server_url()
    if own:
        print("PREFECT_API_URL is set: runs report to that server; its UI:", file=sys.stderr)
        _open(own, args.no_browser)
        return EXIT_OK
    timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 180)
    try:
        record = ensure_prefect_server(args.root, port=args.port, startup_timeout=timeout)
    except PrefectServerError as exc:
        raise CLIError(str(exc), EXIT_FAILED) from None
    if record["started"]:
        print(
            f"started the local Prefect server (pid {record['pid']}, ready in {record['startup_s']:.0f} s"
            + (f"; replaced one of {record['replaced']})" if record["replaced"] else ")"),
            file=sys.stderr,
        )
    _open(record["ui_url"], args.no_browser)
    return EXIT_OK


def add_parser(sub: Any) -> None:
    """Add ``ui`` to the ``prefect-tinker`` subcommands ``sub``."""
    u = sub.add_parser(
        "ui",
        help="the local Prefect server with its UI that runs report to: open (default), status, stop",
        description="The persistent local Prefect server (API and UI) of prefect-tinker run. 'ui' starts it "
        "when needed, prints its URL and opens a browser; 'ui status' shows it; 'ui stop' stops it (its "
        "database stays). PREFECT_TINKER_UI=off makes runs use a temporary API that dies with the command.",
    )
    u.add_argument("action", nargs="?", default="open", choices=("open", "status", "stop"))
    u.add_argument("--no-browser", action="store_true", help="print the URL only")
    u.add_argument("--port", type=int, help="port of a new server (default: the last one, or a free one)")
    u.add_argument("--json", action="store_true", help="status as JSON")
    u.add_argument(
        "--root",
        metavar="DIR",
        help="the prefect-tinker state folder (default $PREFECT_TINKER_HOME or ~/.prefect-tinker)",
    )
    u.set_defaults(func=cmd_ui)
