"""Deployments end to end with real parts: ``prefect server start`` on 127.0.0.1, the work pool and
deployments of ``prefect.yaml`` (``prefect --no-prompt deploy --all``), ``process`` workers, the
zombie-run automation of ``prefect_tinker/cli/automations.py``, a ``TinkerCredentials`` block saved on that server and
the embedded local Tinker server (with ``--fail-every`` fault injection: the SDK retries those 503s).

1. a parameterised SFT deployment run completes; store rows, artifacts (metrics table, curves PNG,
   progress), run/task names and checkpoint asset events are checked;
2. a transient fault (the training server cannot write the final sampler checkpoint: its folder is
   blocked by a file, then freed) fails the first attempt of that task; Prefect retries it and the
   flow completes;
3. the worker (and the flow-run process) is killed mid-run; a new worker runs the deployment again
   with the same run_name, which resumes after the last checkpoint; the automation marks the killed
   run Crashed when its heartbeats stop, and the crashed run, re-scheduled (resume automation or
   ``prefect flow-run retry``), resumes too.

Select with ``pytest -m deployments``.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys

import pytest

from tests.prefect_stack import ROOT, PrefectStack, block_sampler_saves, local_training_runs, wait_until

# Generous: every wait below is a condition with its own deadline, so the time limits only matter
# when something hangs; a loaded 2-core machine can take minutes for a server start or a run.
pytestmark = [pytest.mark.deployments, pytest.mark.timeout(2400)]

BLOCK = "deploy-test"
HEARTBEAT = 30  # seconds between flow-run heartbeats (Prefect's minimum)
WITHIN = 50  # the automation marks a run Crashed after this long without a heartbeat
JOB_VARIABLES = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT)}}


class Ctx:
    """The module's stack plus its store and local-server folders."""

    def __init__(self, stack: PrefectStack, store, local_root):
        self.stack, self.store, self.local_root = stack, store, local_root
        self.worker = None

    def params(self, run_name: str, **kw) -> dict:
        cfg = dict(
            model="tiny", batch_size=4, lora_rank=8, learning_rate=2e-3, max_length=128, max_steps=6,
            save_every=3, eval_every=3, num_eval_samples=1, sample_max_tokens=8, run_name=run_name,
            store=str(self.store), backend={"credentials_block": BLOCK},
        )
        cfg.update(kw)
        return {"config": cfg}

    def run(self, run_name: str, **kw):
        return self.stack.run_deployment("sft/sft-tiny", self.params(run_name, **kw), JOB_VARIABLES)

    def training_store(self):
        from tinker_blocks.stores import TrainingStore

        return TrainingStore(root=str(self.store))

    def completed(self, flow_run_id, timeout: float = 900):
        run = self.stack.wait_final(flow_run_id, timeout)
        assert run.state_name == "Completed", (
            f"{run.name}: {run.state_name} {run.state.message}\n" + "\n".join(self.stack.logs(flow_run_id)[-40:])
        )
        return run

    def local_training_runs(self) -> set[str] | None:
        return local_training_runs(self.local_root)

    def checkpoint_rows_written(self, run_id: str) -> bool:
        """Whether the store holds a checkpoint row of ``run_id`` (a cheap look for its Parquet
        part files, so it can poll every few ms; a part appears whole: written, then renamed)."""
        return any((self.store / "training" / "checkpoints" / f"run_id={run_id}").glob("part-*.parquet"))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from prefect_tinker.cli.automations import install_automations
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from tinker_blocks import TinkerCredentials

    tmp = tmp_path_factory.mktemp("deployments")
    stack = PrefectStack(tmp / "prefect-home")
    c = Ctx(stack, tmp / "store", tmp / "tinker-local")
    try:
        stack.start_server()
        stack.deploy_all()
        with temporary_settings({PREFECT_API_URL: stack.api_url}):
            install_automations(within=WITHIN, tag="prefect-tinker")
            TinkerCredentials(
                local=True, local_root=str(c.local_root), local_models=["tiny"],
                local_extra_args=["--fail-every", "23"],  # every 23rd request answers 503; the SDK retries
            ).save(BLOCK, overwrite=True)
        c.worker = stack.start_worker("worker-1")
        yield c
    finally:
        stack.close()
        from tinker_blocks.credentials import stop_local_server

        stop_local_server(c.local_root)


def _final(flow_run) -> bool:
    return flow_run.state is not None and flow_run.state.is_final()


def _names(task_runs, prefix: str) -> list[str]:
    return sorted(t.name for t in task_runs if t.name.startswith(prefix))


def test_deploy_registered_every_flow(ctx):
    with ctx.stack.client() as c:
        names = {f"{c.read_flow(d.flow_id).name}/{d.name}": d for d in c.read_deployments()}
        assert {"sft/sft-tiny", "rl/rl-arithmetic"} <= set(names)
        d = names["sft/sft-tiny"]
        assert d.work_pool_name == "tinker-process" and "prefect-tinker" in d.tags
        assert d.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
        assert d.parameters["config"]["model"] == "tiny"
        assert d.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60"
        autos = c.read_automations_by_name("prefect-tinker: crash runs without heartbeats")
        assert len(autos) == 1 and getattr(autos[0].trigger.posture, "value", None) == "Proactive"
        assert autos[0].actions[0].state.value == "CRASHED"


def test_sft_deployment_run_completes_with_artifacts_and_lineage(ctx):
    fr = ctx.run("deploy-basic")
    run = ctx.completed(fr.id)
    assert run.name == "sft-deploy-basic"

    store = ctx.training_store()
    losses = store.query("SELECT step, count(*) AS n FROM metrics WHERE run_id = 'deploy-basic' "
                         "AND name = 'train/loss' GROUP BY step ORDER BY step")
    assert [(r["step"], r["n"]) for r in losses] == [(s, 1) for s in range(6)]
    ckpts = store.query("SELECT step, kind, path FROM checkpoints WHERE run_id = 'deploy-basic' ORDER BY step, kind")
    assert [(r["step"], r["kind"]) for r in ckpts] == [(3, "state"), (6, "sampler"), (6, "state")]
    assert store.get_run("deploy-basic")["status"] == "completed"

    tasks = ctx.stack.task_runs(fr.id)
    assert all(t.state_name == "Completed" for t in tasks), [(t.name, t.state_name) for t in tasks]
    assert _names(tasks, "step-") == [f"step-{s}" for s in range(6)]
    names = {t.name for t in tasks}
    assert {"open-deploy-basic", "report-deploy-basic-step-3", "report-deploy-basic-step-6",
            "save-state-deploy-basic-step-000003", "save-sampler-deploy-basic-step-000006",
            "record-state-deploy-basic-step-3", "record-sampler-deploy-basic-step-6",
            "sample-deploy-basic-step-000006", "record-run-deploy-basic-completed"} <= names, sorted(names)
    assert {n for n in names if n.startswith("metrics-")} == {"metrics-deploy-basic-steps-0-3",
                                                              "metrics-deploy-basic-steps-3-6"}, sorted(names)

    arts = ctx.stack.artifacts(fr.id)
    by_key = {a.key: a for a in arts if a.key}
    table = by_key["sft-deploy-basic-metrics"]
    assert table.type == "table" and "train/loss" in str(table.data)
    curves = by_key["sft-deploy-basic-curves"]
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", curves.data)
    assert curves.type == "markdown" and png and base64.b64decode(png.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ctx.store / "reports" / "deploy-basic" / "curves.png").stat().st_size > 1000
    assert by_key["sft-deploy-basic"].type == "markdown"  # the run summary
    progress = [a for a in arts if a.type == "progress"]
    assert progress and float(progress[0].data) == pytest.approx(100.0)

    # lineage: each checkpoint is an asset materialization with the dataset as its upstream asset
    want = {"weights/deploy-basic-step-000003", "weights/deploy-basic-step-000006",
            "sampler_weights/deploy-basic-step-000006"}

    def materialized():  # events reach the API asynchronously: the last one may land after Completed
        found = ctx.stack.events("prefect.asset.materialization", related=f"prefect.flow-run.{fr.id}")
        keys = {"/".join(e["resource"]["prefect.resource.id"].split("/")[-2:]) for e in found}
        return found if keys >= want else None

    mats = wait_until(materialized, 120, "the asset materialization events", interval=2.0)
    keys = {"/".join(e["resource"]["prefect.resource.id"].split("/")[-2:]) for e in mats}
    assert keys == want, keys
    for e in mats:
        related = {r["prefect.resource.id"] for r in e["related"]}
        assert f"prefect.flow-run.{fr.id}" in related
        assert any(r.startswith("file://") and r.endswith("example_chat.jsonl") for r in related), related


def test_transient_fault_is_retried_and_the_flow_completes(ctx):
    store = ctx.training_store()
    known = ctx.local_training_runs() or set()  # None: the local server is not started yet
    fr = ctx.run("deploy-fault", max_steps=12, save_every=3, eval_every=0)

    # The fault goes in as soon as the run's model exists on the local server, long before the
    # sampler save at step 12: no race with training (the run opens its model before step 0).
    def new_model() -> str | None:
        if _final(ctx.stack.flow_run(fr.id)):
            raise AssertionError("the run finished before its model showed up on the local server")
        fresh = (ctx.local_training_runs() or set()) - known
        assert len(fresh) <= 1, f"several new training runs on the local server: {fresh}"
        return next(iter(fresh), None)

    model_id = wait_until(new_model, 600, "the run's model on the local server", interval=0.2)
    blocker = block_sampler_saves(ctx.local_root, model_id)

    def failed_once() -> bool:
        """True once a save-sampler attempt failed and awaits its retry (read from the task run's
        state history, so a poll that misses the short AwaitingRetry state still sees it)."""
        saves = [t for t in ctx.stack.task_runs(fr.id) if t.name.startswith("save-sampler")]
        for t in saves:
            if t.state_name == "Completed" and t.run_count <= 1:
                raise AssertionError(f"{t.name} completed without failing: the fault was not in place")
            with ctx.stack.client() as c:
                if any(st.name == "AwaitingRetry" for st in c.read_task_run_states(t.id)):
                    return True
        if _final(ctx.stack.flow_run(fr.id)):
            raise AssertionError(f"the run ended ({ctx.stack.flow_run(fr.id).state_name}) before a save-sampler retry")
        return False

    try:
        wait_until(failed_once, 900, "the sampler save to fail and await its retry")
    finally:
        blocker.unlink()  # the fault passes; the next attempt (2-8 s later) succeeds
    ctx.completed(fr.id)
    assert int(store.last_checkpoint("deploy-fault")["step"]) == 12

    save = [t for t in ctx.stack.task_runs(fr.id) if t.name.startswith("save-sampler")]
    assert len(save) == 1 and save[0].state_name == "Completed" and save[0].run_count >= 2
    with ctx.stack.client() as c:
        states = [s.name for s in c.read_task_run_states(save[0].id)]
    assert "AwaitingRetry" in states and states[-1] == "Completed", states
    assert store.get_run("deploy-fault")["status"] == "completed"
    assert [
        r["kind"]
        for r in store.query("SELECT kind FROM checkpoints WHERE run_id = 'deploy-fault' AND step = 12 ORDER BY kind")
    ] == ["sampler", "state"]

    # the server's fault injection answered some requests with 503; the SDK retried them
    import json
    import urllib.request

    base_url = json.loads((ctx.local_root / "server.json").read_text())["base_url"]
    req = urllib.request.Request(base_url + "/api/v1/local_stats", headers={"X-API-Key": "tml-local"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
        stats = json.loads(resp.read())
    assert stats["fault_config"]["fail_every"] == 23 and sum(stats["faults"].values()) > 0, stats


def test_killed_worker_then_rerun_resumes_after_last_checkpoint(ctx):
    store = ctx.training_store()
    steps = dict(max_steps=20, save_every=4, eval_every=0, num_eval_samples=0)
    fr = ctx.run("deploy-resume", **steps)
    # Kill as soon as the first checkpoint row lands (a file check every 50 ms): 16 steps remain.
    wait_until(lambda: ctx.checkpoint_rows_written("deploy-resume"), 900, "the first checkpoint", interval=0.05)
    ctx.stack.kill_worker(ctx.worker)
    last = store.last_checkpoint("deploy-resume")
    k = int(last["step"])
    state = ctx.stack.flow_run(fr.id).state_name
    assert 4 <= k < 20 and state == "Running", (k, state)  # a zombie now

    ctx.worker = ctx.stack.start_worker("worker-2")
    fr2 = ctx.run("deploy-resume", **steps)
    ctx.completed(fr2.id)

    line = f"resuming run deploy-resume after its checkpoint at step {k}"
    wait_until(lambda: line in "\n".join(ctx.stack.logs(fr2.id)), 120, "the re-run's resume log line", interval=2.0)
    done = sorted(int(n.split("-")[1]) for n in _names(ctx.stack.task_runs(fr2.id), "step-"))
    assert done == list(range(k, 20))
    rows = store.query("SELECT step, count(*) AS n FROM metrics WHERE run_id = 'deploy-resume' "
                       "AND name = 'train/loss' GROUP BY step ORDER BY step")
    assert [(r["step"], r["n"]) for r in rows] == [(s, 1) for s in range(20)]
    assert store.get_run("deploy-resume")["status"] == "completed"

    # No heartbeat from the killed run for WITHIN seconds: the automation marks it Crashed; the resume
    # automation (installed only now, so that the crashed run cannot train alongside the re-run)
    # re-schedules it, or, when the crash came first, `prefect flow-run retry` does. The same flow
    # run runs again, gets the same config and resumes from the run's last checkpoint (step 20).
    resume_installed = ctx.stack.flow_run(fr.id).state_name == "Running"
    if resume_installed:
        from prefect_tinker.cli.automations import resume_automation
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: ctx.stack.api_url}):
            resume_automation(max_attempts=2).create()

    def history() -> list:
        with ctx.stack.client() as c:
            return c.read_flow_run_states(fr.id)

    crashed = wait_until(lambda: next((s for s in history() if s.name == "Crashed"), None), WITHIN + 600,
                         "the automation to mark the killed run Crashed", interval=2.0)
    assert "No heartbeat" in crashed.message

    def rescheduled() -> bool:
        return ctx.stack.flow_run(fr.id).state_name != "Crashed"

    try:
        # the resume automation reacts to the Crashed event within seconds, or minutes under load;
        # it may miss a crash that came while it was being created: then the CLI retry below
        wait_until(rescheduled, 180 if resume_installed else 0, "the resume automation", interval=1.0)
    except TimeoutError:
        cmd = [sys.executable, "-m", "prefect", "--no-prompt", "flow-run", "retry", str(fr.id)]
        res = subprocess.run(cmd, cwd=ROOT, env=ctx.stack.env(), capture_output=True, text=True, timeout=400)
        # a late resume automation may have re-scheduled the run meanwhile: then the retry is refused
        assert res.returncode == 0 or rescheduled(), res.stdout + res.stderr
    ctx.completed(fr.id)
    # flow-run logs are shipped in batches: wait for the re-run's line rather than reading once
    wait_until(lambda: "resuming run deploy-resume after its checkpoint at step 20" in "\n".join(ctx.stack.logs(fr.id)),
               120, "the re-run's resume log line", interval=2.0)
    assert store.get_run("deploy-resume")["status"] == "completed"


def test_block_types_registered_and_secret_masked(ctx):
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from tinker_blocks import TinkerCredentials

    res = subprocess.run([sys.executable, "-m", "prefect", "block", "register", "-m", "tinker_blocks"],
                         cwd=ROOT, env=ctx.stack.env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    with ctx.stack.client() as c:
        slugs = {t.slug: t for t in c.read_block_types()}
        for slug in ("tinker-credentials", "tinker-s3-credentials", "tinker-training-store",
                     "tinker-eval-store", "tinker-capture-store"):
            t = slugs[slug]
            assert t.description and "BLOCK_NAME" in (t.code_example or ""), slug
            assert str(t.documentation_url).startswith(
                "https://github.com/prefect-tinker/prefect-tinker/blob/main/docs/"
            ), slug
    with temporary_settings({PREFECT_API_URL: ctx.stack.api_url}):
        TinkerCredentials(api_key="tml-very-secret", base_url="http://gpu-box:8000").save("with-key", overwrite=True)
        with ctx.stack.client() as c:
            doc = c.read_block_document_by_name("with-key", "tinker-credentials", include_secrets=False)
        assert "tml-very-secret" not in str(doc.data) and doc.data["api_key"] == "********"
        assert TinkerCredentials.load("with-key").api_key.get_secret_value() == "tml-very-secret"
