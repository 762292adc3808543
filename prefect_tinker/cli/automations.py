"""The Prefect automations of ``prefect-tinker ops``: one for stuck runs and one for crashed runs, and two
that chain checkpoints to evaluations to promotions; built, installed (replacing by name) and removed here.

A self-hosted Prefect server does not notice when the process running a flow dies (machine lost,
OOM kill, ``kill -9`` of a worker): the run stays ``Running`` forever. Flow runs started by a
worker emit a ``prefect.flow-run.heartbeat`` event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
seconds (``prefect.yaml`` sets 60 for our deployments), so one *proactive* automation can mark a
run ``Crashed`` when no heartbeat (and no terminal state) follows its last heartbeat within
``within`` seconds. A crashed deployment run is re-run with ``prefect flow-run retry <id>`` (or
the UI's Retry): same parameters, same run name, so the flow resumes after the run's last
checkpoint. ``--resume-crashed N`` installs a second automation that does this retry by itself,
up to N attempts of a run.

Two more automations chain the production loop, each opt-in by a tag of the runs it reacts to:

- *evaluate saved checkpoints*: each state checkpoint saved by a run tagged ``evaluate-checkpoints``
  (its ``prefect-tinker.checkpoint.saved`` event) starts the ``eval/eval-checkpoint`` deployment on
  it (``model`` = the checkpoint, ``line`` = its model line, ``store`` = its training store);
- *consider promotion after evaluation*: each evaluation of the gate's first benchmark completed
  by a run tagged ``consider-promotion`` (the ``eval-checkpoint`` deployment carries that tag) for
  weights of a model line starts ``promote/promote-candidate`` on them (``candidate`` = the
  checkpoint, ``line`` = its line).

Their actions are the deployments' own configs with those fields templated from the event, read
when the automations are installed (re-install after changing a deployment's config). The
promotion flow's own evaluations run under other tags, so a promotion never starts another.

The command line: :mod:`prefect_tinker.cli.ops`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = [
    "ZOMBIE_AUTOMATION",
    "RESUME_AUTOMATION",
    "EVALUATE_AUTOMATION",
    "PROMOTE_AUTOMATION",
    "EVALUATE_TAG",
    "PROMOTE_TAG",
    "EVAL_DEPLOYMENT",
    "PROMOTE_DEPLOYMENT",
    "DEFAULT_TAG",
    "DEFAULT_WITHIN",
    "evaluate_automation",
    "promotion_automation",
    "chain_automations",
    "zombie_automation",
    "resume_automation",
    "upsert_automation",
    "delete_automations_named",
    "install_automations",
    "remove_automations",
]

#: Name of the automation that marks runs without heartbeats as Crashed.
ZOMBIE_AUTOMATION = "prefect-tinker: crash runs without heartbeats"
#: Name of the automation that re-schedules crashed runs (they resume from their checkpoint).
RESUME_AUTOMATION = "prefect-tinker: resume crashed runs"
#: Name of the automation that evaluates each state checkpoint saved by a run tagged EVALUATE_TAG.
EVALUATE_AUTOMATION = "prefect-tinker: evaluate saved checkpoints"
#: Name of the automation that runs the promotion gate after an evaluation by a run tagged PROMOTE_TAG.
PROMOTE_AUTOMATION = "prefect-tinker: consider promotion after evaluation"
#: Opt-in tags of the two chaining automations.
EVALUATE_TAG = "evaluate-checkpoints"
PROMOTE_TAG = "consider-promotion"
#: The deployments they run (flow/deployment names, from prefect.yaml).
EVAL_DEPLOYMENT = "eval/eval-checkpoint"
PROMOTE_DEPLOYMENT = "promote/promote-candidate"
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


def upsert_automation(automation: Any) -> Any:
    """Create ``automation``, replacing any existing automations with the same name."""
    from prefect.automations import Automation

    delete_automations_named(automation.name)
    created = automation.create()
    assert isinstance(created, Automation)
    return created


def delete_automations_named(name: str) -> int:
    """Delete every automation named ``name`` on the server; returns how many were deleted."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(name)
        for a in found:
            client.delete_automation(a.id)
    return len(found)


def _jinja(template: str) -> dict[str, str]:
    """A parameter rendered from the triggering event (Prefect's hydration of action parameters)."""
    return {"__prefect_kind": "jinja", "template": template}


def _from_payload(key: str) -> dict[str, Any]:
    """A JSON object from the event's payload (``{}`` when it has none)."""
    return {"__prefect_kind": "json", "value": _jinja(f"{{{{ (event.payload.{key} or {{}}) | tojson }}}}")}


def _tagged(tag: str) -> dict[str, str]:
    return {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{tag}"}


def evaluate_automation(deployment: Any, tag: str = EVALUATE_TAG) -> Any:
    """The automation (unsaved) that runs ``deployment`` (an eval deployment, read from the server)
    on each state checkpoint saved by a flow run tagged ``tag``: its config with ``model`` = the
    checkpoint, ``line`` = its model line, ``store`` = its training store, ``backend`` = the run's
    backend and ``run_name`` = ``eval-<run>-step-<step>``, from the ``prefect-tinker.checkpoint.saved``
    event."""
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    config = {
        **dict((deployment.parameters or {}).get("config") or {}),
        "model": _jinja("{{ event.resource.id }}"),
        "line": _jinja("{{ event.resource.get('prefect-tinker.line', '') }}"),
        "store": _jinja("{{ event.payload.store }}"),
        "backend": _from_payload("backend"),
        "run_name": _jinja(
            "eval-{{ event.resource['prefect-tinker.run'] }}-step-{{ event.resource['prefect-tinker.step'] }}"
        ),
    }
    return Automation(
        name=EVALUATE_AUTOMATION,
        description=(
            f"Runs the eval deployment {deployment.name!r} on each state checkpoint saved by a flow run tagged "
            f"{tag!r}. Installed by `prefect-tinker ops install-automations`."
        ),
        trigger=EventTrigger(
            expect={"prefect-tinker.checkpoint.saved"},
            match={"prefect-tinker.kind": "state"},
            match_related=_tagged(tag),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(seconds=0),
        ),
        actions=[RunDeployment(source="selected", deployment_id=deployment.id, parameters={"config": config})],
    )


def promotion_automation(deployment: Any, tag: str = PROMOTE_TAG, store: str | None = None) -> Any:
    """The automation (unsaved) that runs ``deployment`` (a promote deployment, read from the
    server) after each completed evaluation of the gate's first benchmark, by a flow run tagged
    ``tag``, of weights of a model line: its config with ``candidate`` = the evaluated checkpoint,
    ``line`` = its line, ``store`` and ``backend`` = the evaluation's (``store``, when given,
    instead).

    Raises:
        ValueError: the deployment's config is not a valid promotion config.
    """
    from prefect.automations import Automation
    from prefect.events.actions import RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    from prefect_tinker.flows.promote import PromoteConfig

    base = dict((deployment.parameters or {}).get("config") or {})
    gate = PromoteConfig.model_validate(base)
    first = gate.eval_config([gate.candidate]).specs()[0].name
    config = {
        **base,
        "candidate": _jinja("{{ event.resource['prefect-tinker.checkpoint'] }}"),
        "line": _jinja("{{ event.resource['prefect-tinker.line'] }}"),
        "store": store or _jinja("{{ event.payload.store }}"),
        "backend": _from_payload("backend"),
    }
    return Automation(
        name=PROMOTE_AUTOMATION,
        description=(
            f"Runs the promotion gate {deployment.name!r} when an evaluation of {first!r} by a flow run tagged "
            f"{tag!r} completes for weights of a model line. Installed by `prefect-tinker ops install-automations`."
        ),
        trigger=EventTrigger(
            expect={"prefect-tinker.eval.completed"},
            match={"prefect-tinker.benchmark": first, "prefect-tinker.line": "*"},
            match_related=_tagged(tag),
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(seconds=0),
        ),
        actions=[RunDeployment(source="selected", deployment_id=deployment.id, parameters={"config": config})],
    )


def _deployment(name: str) -> Any:
    """The deployment ``flow/deployment`` on the server, or None when it is not registered."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


def chain_automations(
    eval_deployment: str = EVAL_DEPLOYMENT, promote_deployment: str = PROMOTE_DEPLOYMENT, store: str | None = None
) -> tuple[list[Any], list[str]]:
    """The two chaining automations (unsaved) for the registered deployments, and one line per
    deployment that is missing (its automation is left out)."""
    made, missing = [], []
    for name, build in (
        (eval_deployment, evaluate_automation),
        (promote_deployment, lambda d: promotion_automation(d, store=store)),
    ):
        dep = _deployment(name)
        if dep is None:
            missing.append(f"deployment {name!r} is not registered (prefect deploy --all): its automation is skipped")
        else:
            made.append(build(dep))
    return made, missing


def install_automations(
    within: float = DEFAULT_WITHIN,
    tag: str | None = DEFAULT_TAG,
    resume_crashed: int = 0,
    chain: bool = False,
    eval_deployment: str = EVAL_DEPLOYMENT,
    promote_deployment: str = PROMOTE_DEPLOYMENT,
    store: str | None = None,
) -> list[Any]:
    """Create (or replace, by name) the zombie-run automation and, when ``resume_crashed`` > 0,
    the resume automation, on the server at ``PREFECT_API_URL``; with ``chain``, also the
    automations evaluating saved checkpoints and considering promotions (for the deployments
    that are registered). Returns the saved automations."""
    made = [upsert_automation(zombie_automation(within, tag))]
    if resume_crashed:
        made.append(upsert_automation(resume_automation(resume_crashed, tag)))
    else:
        delete_automations_named(RESUME_AUTOMATION)
    if chain:
        autos, _ = chain_automations(eval_deployment, promote_deployment, store)
        made += [upsert_automation(a) for a in autos]
    return made


def remove_automations() -> int:
    """Delete the automations this module installs; returns how many were deleted."""
    names = (ZOMBIE_AUTOMATION, RESUME_AUTOMATION, EVALUATE_AUTOMATION, PROMOTE_AUTOMATION)
    return sum(delete_automations_named(n) for n in names)
