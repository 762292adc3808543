"""The ``prefect-tinker ops`` command: operating the flows on a Prefect server (``PREFECT_API_URL``).

Its automations (stuck and crashed runs; checkpoint -> evaluation -> promotion) are built in
:mod:`prefect_tinker.cli.automations`, the backends' concurrency limits in
:mod:`prefect_tinker.cli.concurrency_limits`; a failed API call is one line, no traceback.

Commands (``prefect-tinker ops ...``; the server is ``PREFECT_API_URL``)::

    install-automations [--within S] [--tag T | --all-runs] [--resume-crashed N] [--no-chain]
                        [--eval-deployment D] [--promote-deployment D] [--store ROOT] [--dry-run]
    remove-automations
    install-limits [--backend B] [--train N] [--sample N] [--sample-rate R]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect_tinker.cli.automations import (
    DEFAULT_TAG,
    DEFAULT_WITHIN,
    EVAL_DEPLOYMENT,
    EVALUATE_TAG,
    PROMOTE_DEPLOYMENT,
    PROMOTE_TAG,
    RESUME_AUTOMATION,
    chain_automations,
    delete_automations_named,
    remove_automations,
    resume_automation,
    upsert_automation,
    zombie_automation,
)
from prefect_tinker.cli.concurrency_limits import install_limits

__all__ = ["add_parser"]


def _server_error(exc: Exception) -> int:
    """Report a failed API call (no server, wrong URL) as one line, no traceback; exit status 1."""
    from prefect.settings import PREFECT_API_URL

    print(
        f"error: the Prefect API at {PREFECT_API_URL.value() or '(no PREFECT_API_URL: an ephemeral server)'} "
        f"failed: {type(exc).__name__}: {exc}"
    )
    return 1


def _cmd_install(args: argparse.Namespace) -> int:
    tag = None if args.all_runs else args.tag
    autos = [zombie_automation(args.within, tag)]
    if args.resume_crashed:
        autos.append(resume_automation(args.resume_crashed, tag))
    try:
        from prefect_tinker.cli.prefect_api import api_url_set

        if args.no_chain:
            pass
        elif args.dry_run and not api_url_set():
            print(
                "note: no PREFECT_API_URL: the chaining automations (built from the deployments) are left out",
                file=sys.stderr,
            )
        else:  # the chaining automations need the deployments, read from the server
            chained, missing = chain_automations(args.eval_deployment, args.promote_deployment, args.store)
            autos += chained
            for line in missing:
                print(f"note: {line}", file=sys.stderr)
        if args.dry_run:
            print(json.dumps([a.model_dump(mode="json", exclude={"id"}) for a in autos], indent=2))
            return 0
        made = [upsert_automation(a) for a in autos]
        if not args.resume_crashed:
            delete_automations_named(RESUME_AUTOMATION)
    except Exception as exc:  # no server, wrong URL: one clear line, no traceback
        return _server_error(exc)
    for a in made:
        print(f"installed automation {a.name!r} ({a.id})")
    return 0


def _cmd_limits(args: argparse.Namespace) -> int:
    if args.train is None and args.sample is None and args.sample_rate is None:
        print("error: give --train N, --sample N and/or --sample-rate R")
        return 2
    try:
        lines = install_limits(args.backend, args.train, args.sample, args.sample_rate)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    except Exception as exc:
        return _server_error(exc)
    for line in lines:
        print(line)
    return 0


def _cmd_remove(args: argparse.Namespace) -> int:
    try:
        print(f"removed {remove_automations()} automation(s)")
    except Exception as exc:
        return _server_error(exc)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``ops`` subcommand group to an argparse ``subparsers`` object (sets ``func``)."""
    p = subparsers.add_parser(
        "ops", help="operate on a Prefect server: automations (crashed runs, checkpoint -> eval -> promotion), limits"
    )
    sub = p.add_subparsers(dest="ops_command", metavar="OPS_COMMAND", required=True)
    i = sub.add_parser(
        "install-automations", help="mark runs whose heartbeats stop as Crashed (and optionally resume them)"
    )
    i.add_argument(
        "--within",
        type=float,
        default=DEFAULT_WITHIN,
        help=f"seconds without a heartbeat before a run is marked Crashed (default {DEFAULT_WITHIN:g}; "
        "must exceed PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the runs)",
    )
    i.add_argument("--tag", default=DEFAULT_TAG, help=f"watch only flow runs with this tag (default {DEFAULT_TAG})")
    i.add_argument("--all-runs", action="store_true", help="watch every flow run that sends heartbeats")
    i.add_argument(
        "--resume-crashed",
        type=int,
        default=0,
        metavar="N",
        help="also re-schedule crashed runs (they resume from their checkpoint), up to N attempts",
    )
    i.add_argument(
        "--no-chain",
        action="store_true",
        help=f"skip the automations that evaluate saved checkpoints (runs tagged {EVALUATE_TAG}) and consider "
        f"promotions after evaluations (runs tagged {PROMOTE_TAG})",
    )
    i.add_argument("--eval-deployment", default=EVAL_DEPLOYMENT, help=f"default {EVAL_DEPLOYMENT}")
    i.add_argument("--promote-deployment", default=PROMOTE_DEPLOYMENT, help=f"default {PROMOTE_DEPLOYMENT}")
    i.add_argument("--store", help="training store of the promotions (default: the evaluation's)")
    i.add_argument("--dry-run", action="store_true", help="print the automations as JSON, do not install")
    i.set_defaults(func=_cmd_install)
    r = sub.add_parser("remove-automations", help="delete the automations installed by install-automations")
    r.set_defaults(func=_cmd_remove)
    lim = sub.add_parser(
        "install-limits", help="create or resize the concurrency limits training and sampling take slots of"
    )
    lim.add_argument("--backend", default="local", help="local, remote or hosted (default local)")
    lim.add_argument("--train", type=int, help="training runs at once (tinker-train:<backend>)")
    lim.add_argument("--sample", type=int, help="evaluation batches sampling at once (tinker-sample:<backend>)")
    lim.add_argument(
        "--sample-rate",
        type=float,
        help="sampling requests per second, e.g. what the backend publishes for your account "
        "(tinker-sample-rate:<backend>)",
    )
    lim.set_defaults(func=_cmd_limits)
    return p
