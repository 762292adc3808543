"""Operating the flows on a Prefect server: automations for stuck and crashed runs.

A self-hosted Prefect server does not notice when the process running a flow dies (machine lost,
OOM kill, ``kill -9`` of a worker): the run stays ``Running`` forever. Flow runs started by a
worker emit a ``prefect.flow-run.heartbeat`` event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
seconds (``prefect.yaml`` sets 60 for our deployments), so one *proactive* automation can mark a
run ``Crashed`` when no heartbeat (and no terminal state) follows its last heartbeat within
``within`` seconds. A crashed deployment run is re-run with ``prefect flow-run retry <id>`` (or
the UI's Retry): same parameters, same run name, so the flow resumes after the run's last
checkpoint. ``--resume-crashed N`` installs a second automation that does this retry by itself,
up to N attempts of a run.

Commands (``prefect-tinker ops ...``; the server is ``PREFECT_API_URL``)::

    install-automations [--within S] [--tag T | --all-runs] [--resume-crashed N] [--dry-run]
    remove-automations
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta
from typing import Any

__all__ = [
    "ZOMBIE_AUTOMATION",
    "RESUME_AUTOMATION",
    "zombie_automation",
    "resume_automation",
    "install_automations",
    "remove_automations",
    "add_parser",
]

#: Name of the automation that marks runs without heartbeats as Crashed.
ZOMBIE_AUTOMATION = "prefect-tinker: crash runs without heartbeats"
#: Name of the automation that re-schedules crashed runs (they resume from their checkpoint).
RESUME_AUTOMATION = "prefect-tinker: resume crashed runs"
#: Tag of every deployment in prefect.yaml; the automations only watch runs carrying it by default.
DEFAULT_TAG = "prefect-tinker"
#: Seconds without a heartbeat before a run counts as crashed: 5 heartbeats at our 60 s, and more
#: than Prefect's default frequency of 180 s, so runs of other flows are never crashed by mistake.
DEFAULT_WITHIN = 300.0
_TERMINAL = ("Completed", "Failed", "Cancelled", "Crashed")


def _scope(tag: str | None) -> dict[str, Any]:
    """``match`` / ``match_related`` restricting a trigger to flow runs (tagged ``tag``)."""
    scope: dict[str, Any] = {"match": {"prefect.resource.id": "prefect.flow-run.*"}}
    if tag:
        scope["match_related"] = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{tag}"}
    return scope


def zombie_automation(within: float = DEFAULT_WITHIN, tag: str | None = DEFAULT_TAG) -> Any:
    """The automation (unsaved ``prefect.automations.Automation``) that changes a flow run to
    ``Crashed`` when, after a heartbeat, neither another heartbeat nor a terminal state event
    (Completed, Failed, Cancelled, Crashed, or a pause) arrives within ``within`` seconds.

    Args:
        within: seconds; must exceed the heartbeat frequency of the watched runs (at least 10).
        tag: watch only flow runs with this tag (None: every flow run that sends heartbeats).

    Raises:
        ValueError: ``within`` below 10 s (the server's minimum for proactive triggers).
    """
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    if within < 10:
        raise ValueError(f"within must be at least 10 seconds, got {within}")
    expect = {"prefect.flow-run.heartbeat", "prefect.flow-run.Paused", "prefect.flow-run.Suspended"}
    expect |= {f"prefect.flow-run.{s}" for s in _TERMINAL}
    return Automation(
        name=ZOMBIE_AUTOMATION,
        description=(
            f"Marks a flow run{f' tagged {tag!r}' if tag else ''} as Crashed when its heartbeats stop for "
            f"{within:g} s (the process running it died). Installed by `prefect-tinker ops install-automations`."
        ),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect=expect,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within),
            **_scope(tag),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {within:g} s: the process running this flow run is gone. "
                "Retry the run to resume it from its last checkpoint.",
            )
        ],
    )


def resume_automation(max_attempts: int = 3, tag: str | None = DEFAULT_TAG) -> Any:
    """The automation that re-schedules a crashed flow run (a deployment's worker runs it again
    with the same parameters, so it resumes after its last checkpoint), while the run has been
    attempted at most ``max_attempts`` times (the event's ``prefect.run-count``).

    Raises:
        ValueError: ``max_attempts`` < 1.
    """
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    if max_attempts < 1:
        raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
    scope = _scope(tag)
    scope["match"]["prefect.run-count"] = [str(i) for i in range(1, max_attempts + 1)]
    return Automation(
        name=RESUME_AUTOMATION,
        description=(
            f"Re-schedules a crashed flow run{f' tagged {tag!r}' if tag else ''} (up to {max_attempts} attempts); "
            "the flow resumes after its last checkpoint. Installed by `prefect-tinker ops install-automations`."
        ),
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(seconds=0),
            **scope,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="AwaitingRetry",
                message="Re-scheduled after a crash by prefect-tinker: resumes from the last checkpoint.",
            )
        ],
    )


def _upsert(automation: Any) -> Any:
    """Create ``automation``, replacing any existing automations with the same name."""
    from prefect.automations import Automation

    _delete_named(automation.name)
    created = automation.create()
    assert isinstance(created, Automation)
    return created


def _delete_named(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(name)
        for a in found:
            client.delete_automation(a.id)
    return len(found)


def install_automations(
    within: float = DEFAULT_WITHIN, tag: str | None = DEFAULT_TAG, resume_crashed: int = 0
) -> list[Any]:
    """Create (or replace, by name) the zombie-run automation and, when ``resume_crashed`` > 0,
    the resume automation, on the server at ``PREFECT_API_URL``. Returns the saved automations."""
    made = [_upsert(zombie_automation(within, tag))]
    if resume_crashed:
        made.append(_upsert(resume_automation(resume_crashed, tag)))
    else:
        _delete_named(RESUME_AUTOMATION)
    return made


def remove_automations() -> int:
    """Delete the automations this module installs; returns how many were deleted."""
    return _delete_named(ZOMBIE_AUTOMATION) + _delete_named(RESUME_AUTOMATION)


# ---------------------------------------------------------------------------------------------- CLI


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
    if args.dry_run:
        print(json.dumps([a.model_dump(mode="json", exclude={"id"}) for a in autos], indent=2))
        return 0
    try:
        made = install_automations(args.within, tag, args.resume_crashed)
    except Exception as exc:  # no server, wrong URL: one clear line, no traceback
        return _server_error(exc)
    for a in made:
        print(f"installed automation {a.name!r} ({a.id})")
    return 0


def _cmd_remove(args: argparse.Namespace) -> int:
    try:
        print(f"removed {remove_automations()} automation(s)")
    except Exception as exc:
        return _server_error(exc)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``ops`` subcommand group to an argparse ``subparsers`` object (sets ``func``)."""
    p = subparsers.add_parser("ops", help="operate on a Prefect server: automations for crashed runs")
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
    i.add_argument("--dry-run", action="store_true", help="print the automations as JSON, do not install")
    i.set_defaults(func=_cmd_install)
    r = sub.add_parser("remove-automations", help="delete the automations installed by install-automations")
    r.set_defaults(func=_cmd_remove)
    return p
