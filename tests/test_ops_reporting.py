"""Run reports (metrics table, curves picture) and the operations automations, without a server
(the end-to-end versions run in tests/test_deployments.py)."""

from __future__ import annotations

import json
import os

import pytest

from prefect_tinker.cli.main import main as cli_main
from prefect_tinker.flows.config import default_run_name
from prefect_tinker.cli.automations import RESUME_AUTOMATION, ZOMBIE_AUTOMATION, resume_automation, zombie_automation
from prefect_tinker.tasks.reporting import artifact_key, latest_metrics, metric_series, plot_curves, report_run


@pytest.fixture
def store(tmp_path):
    from tinker_blocks.stores import TrainingStore

    st = TrainingStore(root=str(tmp_path / "store"))
    with st.writer("metrics") as w:
        for step in range(5):
            w.write(run_id="r1", step=step, name="train/loss", value=3.0 - 0.5 * step)
            w.write(run_id="r1", step=step, name="train/learning_rate", value=1e-3)
        w.write(run_id="r1", step=4, name="test/nll", value=float("nan"))
        w.write(run_id="other", step=9, name="train/loss", value=7.0)
    return st


def test_latest_metrics_and_series(store):
    rows = latest_metrics(store, "r1")
    assert rows == [
        {"metric": "test/nll", "step": 4, "value": None},
        {"metric": "train/learning_rate", "step": 4, "value": 0.001},
        {"metric": "train/loss", "step": 4, "value": 1.0},
    ]
    series = metric_series(store.root, "r1", ["train/loss", "absent"])
    assert series == {"train/loss": ([0, 1, 2, 3, 4], [3.0, 2.5, 2.0, 1.5, 1.0])}
    assert metric_series(store, "r1", []) == {}


def test_plot_curves_is_a_png():
    png = plot_curves({"train/loss": ([0, 1, 2], [3.0, 2.0, 1.5]), "test/nll": ([0, 2], [3.1, 2.2])}, "t")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 2_000 < len(png) < 200_000
    with pytest.raises(ValueError, match="no metric series"):
        plot_curves({}, "t")


def test_artifact_keys_are_valid():
    key = artifact_key("sft", "My_Run.v2/with spaces", "curves")
    assert key == "sft-my-run-v2-with-spaces-curves"
    assert all(c.isalnum() and c.islower() or c == "-" or c.isdigit() for c in key)


def test_report_run_posts_table_and_picture(prefect_api, store):
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow
    def reporter():
        return report_run(store.root, "r1", 4)

    out = reporter()
    assert out["metrics"] == 3 and out["png_bytes"] > 2_000
    assert os.path.getsize(out["png"]) == out["png_bytes"]

    with get_client(sync_client=True) as c:
        table = c.read_latest_artifacts()
        by_key = {a.key: a for a in table if a.key}
    assert "train/loss" in str(by_key["sft-r1-metrics"].data)
    assert "data:image/png;base64," in by_key["sft-r1-curves"].data


def test_zombie_automation_shape():
    a = zombie_automation(within=120, tag="prefect-tinker")
    t = a.trigger
    assert a.name == ZOMBIE_AUTOMATION and t.posture.value == "Proactive" and t.within.total_seconds() == 120
    assert t.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Crashed"} <= t.expect
    assert t.for_each == {"prefect.resource.id"}
    assert t.match_related["prefect.resource.id"] == ["prefect.tag.prefect-tinker"]
    assert a.actions[0].type == "change-flow-run-state" and a.actions[0].state.value == "CRASHED"
    assert not zombie_automation(within=60, tag=None).trigger.match_related.root
    with pytest.raises(ValueError, match="at least 10"):
        zombie_automation(within=5)


def test_resume_automation_limits_attempts():
    a = resume_automation(max_attempts=2)
    assert a.name == RESUME_AUTOMATION and a.trigger.posture.value == "Reactive"
    assert a.trigger.expect == {"prefect.flow-run.Crashed"}
    assert a.trigger.match["prefect.run-count"] == ["1", "2"]
    assert a.actions[0].state.value == "SCHEDULED"
    with pytest.raises(ValueError):
        resume_automation(max_attempts=0)


def test_ops_cli_dry_run(capsys):
    assert cli_main(["ops", "install-automations", "--within", "90", "--resume-crashed", "3", "--dry-run"]) == 0
    autos = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in autos] == [ZOMBIE_AUTOMATION, RESUME_AUTOMATION]
    assert autos[0]["trigger"]["within"] == 90.0 and autos[0]["trigger"]["posture"] == "Proactive"


def test_default_run_name_is_stable_within_a_deployment_flow_run(monkeypatch):
    from prefect_tinker.flows.sft import SFTConfig

    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    assert SFTConfig().run_name.startswith("sft-tiny-20")
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "4d650914-4267-473e-b8b6-906aa3e1d59c")
    a, b = SFTConfig(), SFTConfig()
    assert a.run_name == b.run_name and a.run_name.startswith("sft-tiny-4d650914-")
    assert SFTConfig(learning_rate=1e-3).run_name != a.run_name  # another config, another run
    assert default_run_name("x", SFTConfig(run_name="given")) != "given"


def test_chaining_automations_template_the_deployments_configs():
    """The two chaining automations as built from the deployments' own configs: opt-in tags,
    matched labels, and action parameters templated from the triggering event (rendered by the
    server's hydration: here the templates themselves are checked)."""
    from types import SimpleNamespace
    from uuid import uuid4

    from prefect_tinker.cli.automations import (EVALUATE_AUTOMATION, PROMOTE_AUTOMATION, evaluate_automation,
                                                 promotion_automation)
    from prefect_tinker.flows.registry import load_example

    ev = SimpleNamespace(id=uuid4(), name="eval-checkpoint", parameters={"config": load_example("eval", "checkpoint")})
    a = evaluate_automation(ev)
    assert a.name == EVALUATE_AUTOMATION and a.trigger.expect == {"prefect-tinker.checkpoint.saved"}
    assert a.trigger.match.root == {"prefect-tinker.kind": "state"}
    assert a.trigger.match_related.root == {"prefect.resource.role": "tag",
                                            "prefect.resource.id": "prefect.tag.evaluate-checkpoints"}
    cfg = a.actions[0].parameters["config"]
    assert a.actions[0].deployment_id == ev.id and cfg["benchmarks"] == ev.parameters["config"]["benchmarks"]
    assert cfg["model"] == {"__prefect_kind": "jinja", "template": "{{ event.resource.id }}"}
    assert cfg["store"]["template"] == "{{ event.payload.store }}" and "prefect-tinker.line" in cfg["line"]["template"]

    pr = SimpleNamespace(id=uuid4(), name="promote-candidate",
                         parameters={"config": load_example("promote", "candidate")})
    b = promotion_automation(pr, store="/data/store")
    assert b.name == PROMOTE_AUTOMATION and b.trigger.expect == {"prefect-tinker.eval.completed"}
    assert b.trigger.match.root == {"prefect-tinker.benchmark": "arithmetic", "prefect-tinker.line": "*"}
    assert b.trigger.match_related.root["prefect.resource.id"] == "prefect.tag.consider-promotion"
    cfg = b.actions[0].parameters["config"]
    assert cfg["store"] == "/data/store" and cfg["gate"] == pr.parameters["config"]["gate"]
    assert cfg["candidate"]["template"] == "{{ event.resource['prefect-tinker.checkpoint'] }}"
    # the eval deployment carries the promotion's opt-in tag; the promote deployment does not (no loops)
    from prefect_tinker.flows.registry import deployments_yaml

    import yaml

    deployments = yaml.safe_load(deployments_yaml().replace("*tinker_process", "x"))["deployments"]
    tags = {d["name"]: d["tags"] for d in deployments}
    assert "consider-promotion" in tags["eval-checkpoint"] and "consider-promotion" not in tags["promote-candidate"]
