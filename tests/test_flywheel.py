"""The production loop end to end on real parts: ``prefect server start`` with its triggers service,
the deployments of ``prefect.yaml``, a ``process`` worker, the embedded local Tinker server, a
``capture serve`` process following ``alias:assistant@champion`` and the real ``openai`` client.

1. Traffic of one period (agent transcripts whose assistant turns are polite, rated good through
   ``POST /v1/feedback``; others rated bad) -> the ``flywheel`` deployment: a candidate is trained from
   the champion (the base model), evaluated against it, and promoted (the gate holds); the capture
   endpoint then answers from the promoted weights -- requests sent all along, none dropped -- as a
   sampling client of those weights does. Traffic of the next period rated good teaches a worse
   reply: the second turn's candidate is not promoted. The ``models`` table and the events show each
   step. The gate's benchmark scores replies by token F1 against the polite reply, sampled at
   temperature 1: what a dozen steps teach the random-init tiny model is its words, not their order
   (measured: greedy decoding still repeats one word).
2. ``prefect-tinker run sft --tag evaluate-checkpoints`` (an ordinary run): its checkpoint starts the
   ``eval-checkpoint`` deployment through the installed automation, whose evaluation starts the
   ``promote-candidate`` deployment through the second one.
3. Three training runs started at once under ``tinker-train:local`` of size 1 run one after another
   (one of them says it waits) and all complete.

Select with ``pytest -m deployments``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import pytest

from tests.capture_fixtures import TOKEN, rated_traffic, start_capture
from tests.prefect_stack import ROOT, PrefectStack, wait_until

pytestmark = [pytest.mark.deployments, pytest.mark.timeout(2400)]

BLOCK = "flywheel-test"
LINE = "assistant"
POLITE, RUDE = "Sure, I can help with that.", "No."
QUESTIONS = ["What color is the sky?", "Where is my order?", "How do I reset my password?", "What time do you open?",
             "Can you book a table?", "Which planet do we live on?", "What do cows drink?", "Is it going to rain?"]
EVAL = ["Could you help me?", "I need a hand with my order.", "Please check my account.",
        "Can you answer a question?", "Help me plan a trip.", "Is the shop open today?"]


class Ctx:
    def __init__(self, stack: PrefectStack, tmp, local_root):
        self.stack, self.tmp, self.local_root = stack, tmp, local_root
        self.store = str(tmp / "store")
        self.capture = None

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.capture.base + "/v1", api_key=TOKEN, max_retries=0, timeout=120)

    def completed(self, flow_run_id, timeout: float = 1200):
        run = self.stack.wait_final(flow_run_id, timeout)
        assert run.state_name == "Completed", (
            f"{run.name}: {run.state_name} {run.state.message}\n" + "\n".join(self.stack.logs(flow_run_id)[-40:])
        )
        return run

    def training(self):
        from tinker_blocks.stores import TrainingStore

        return TrainingStore(root=self.store)

    def backend(self) -> dict:
        return {"credentials_block": BLOCK}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from prefect_tinker.cli import main as cli
    from prefect_tinker.cli.automations import install_automations
    from prefect_tinker.cli.concurrency_limits import install_limits
    from tinker_blocks import TinkerCredentials

    tmp = tmp_path_factory.mktemp("flywheel")
    stack = PrefectStack(tmp / "prefect-home")
    c = Ctx(stack, tmp, tmp / "tinker-local")
    try:
        stack.start_server()
        stack.deploy_all()
        with temporary_settings({PREFECT_API_URL: stack.api_url}):
            TinkerCredentials(local=True, local_root=str(c.local_root), local_models=["tiny"]).save(BLOCK,
                                                                                                     overwrite=True)
            install_automations(tag="prefect-tinker", chain=True, store=c.store)
            install_limits("local", train=1)
            assert cli.main(["models", "promote", LINE, "tiny", "--store", c.store]) == 0  # the line starts
        c.worker = stack.start_worker("fw-worker")
        c.capture = start_capture(tmp / "capture", str(c.local_root), session="traffic", store=c.store,
                                  model=f"alias:{LINE}@champion",
                                  extra=("--follow-seconds", "1", "--flush-seconds", "0.3"))
        yield c
    finally:
        if c.capture is not None:
            c.capture.stop()
        stack.close()
        from tinker_blocks.credentials import stop_local_server

        stop_local_server(c.local_root)


def _traffic(ctx: Ctx, reply: str, rating: str, other: str | None = None) -> datetime:
    """Rated transcripts (:func:`~tests.capture_fixtures.rated_traffic`); returns the time after
    their captures and ratings are in the store."""
    from tinker_blocks import CaptureStore

    ids = rated_traffic(ctx.capture.base, f"alias:{LINE}@champion", QUESTIONS, reply, rating, other)

    def stored() -> bool:
        store = CaptureStore(root=ctx.store)
        got = store.query("SELECT count(DISTINCT request_id) AS n FROM ratings WHERE list_contains(?, request_id)",
                          [ids])[0]["n"]
        return got == len(ids) and store.query(
            "SELECT count(*) AS n FROM captures WHERE list_contains(?, request_id)", [ids])[0]["n"] == len(ids)

    wait_until(stored, 60, "the captures and ratings in the store")
    time.sleep(0.01)
    return datetime.now(UTC)


def _flywheel(ctx: Ctx, qa_path: str, since: datetime, until: datetime):
    params = {"config": dict(
        line=LINE, captures=ctx.store, store=ctx.store, since=since.isoformat(), until=until.isoformat(),
        period_hours=None, where="rating > 0", method="sft", min_examples=4, include_truncated=True,
        training=dict(max_steps=12, batch_size=4, learning_rate=0.02, lora_rank=16, max_length=128, save_every=12,
                      eval_every=0, num_eval_samples=0, test_size=0),
        benchmarks=[{"benchmark": "exact_match", "dataset": qa_path, "eval_name": "polite", "max_tokens": 12,
                     "temperature": 1.0, "num_samples": 4}],
        gate={"score": "score", "resamples": 1000}, backend=ctx.backend())}
    fr = ctx.stack.run_deployment("flywheel/flywheel-tiny", params)
    ctx.completed(fr.id)
    return fr


def _sampled(ctx: Ctx, checkpoint: str, messages: list[dict]) -> list[int]:
    """The tokens a sampling client of ``checkpoint`` samples for ``messages`` (seed 5, temperature
    1, 12 tokens), rendered with the renderer and stops the capture server uses for it."""
    import tinker

    from prefect_tinker.capture.model import open_served_model
    from tinker_blocks import TinkerCredentials

    credentials = TinkerCredentials(local=True, local_root=str(ctx.local_root))
    served = open_served_model(credentials, checkpoint)
    client = credentials.get_client().create_sampling_client(model_path=checkpoint).result()  # its own client
    prompt = served.renderer.build_generation_prompt(messages)
    params = tinker.SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=served.chat_stops(None))
    return list(client.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0].tokens)


def test_flywheel_promotes_only_when_the_gate_holds_and_the_endpoint_follows(ctx):
    from prefect_tinker.tasks.events import line_resource_id
    from tinker_blocks.model_registry import ModelRegistry

    qa = ctx.tmp / "polite_eval.jsonl"
    qa.write_text("".join(json.dumps({"id": f"p{i}", "question": q, "answer": POLITE}) + "\n"
                          for i, q in enumerate(EVAL)))
    t0 = datetime.now(UTC)
    t1 = _traffic(ctx, POLITE, "good", other="Go away.")

    # a client keeps asking through the promotion: every request must be answered
    answers, failures, stop = [], [], threading.Event()

    def ask():
        client = ctx.client()
        while not stop.is_set():
            try:
                r = client.chat.completions.create(model=f"alias:{LINE}@champion", max_tokens=4,
                                                   messages=[{"role": "user", "content": "Hello?"}])
                answers.append(r.id)
            except Exception as exc:  # noqa: BLE001 -- any failure is the finding
                failures.append(repr(exc))
            time.sleep(0.5)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    first = _flywheel(ctx, str(qa), t0, t1)
    reg = ModelRegistry(ctx.training())
    champ = reg.current(LINE)
    assert champ["action"] == "promote" and champ["previous"] == "tiny" and champ["checkpoint"].startswith("tinker://")
    decision = json.loads(champ["decision_json"])
    assert decision["promote"] and decision["low"] > 0, decision
    run_id = champ["source_run"]
    assert run_id.startswith(f"{LINE}-sft-")
    meta = json.loads(ctx.training().get_run(run_id)["meta_json"])
    assert meta["line"] == LINE and meta["start"] == f"alias:{LINE}@champion"

    # the endpoint answers from the promoted weights, as a sampling client of them does
    import urllib.request

    def serving() -> bool:
        with urllib.request.urlopen(ctx.capture.base + "/health", timeout=5) as r:  # noqa: S310
            return json.loads(r.read())["checkpoint"] == champ["checkpoint"]

    wait_until(serving, 60, "the capture endpoint to follow the promotion", interval=0.5)
    stop.set()
    asker.join(30)
    assert not failures and len(answers) >= 3, failures
    messages = [{"role": "user", "content": "Could you help me?"}]
    reply = ctx.client().chat.completions.create(model=f"alias:{LINE}@champion", max_tokens=12, temperature=1.0,
                                                 seed=5, messages=messages)
    from tinker_blocks import CaptureStore

    def row():
        rows = CaptureStore(root=ctx.store).query(
            "SELECT checkpoint, completion_token_ids FROM captures WHERE request_id = ?", [reply.id])
        return rows[0] if rows else None

    served = wait_until(row, 30, "the reply's capture row")
    assert served["checkpoint"] == champ["checkpoint"]
    assert list(served["completion_token_ids"]) == _sampled(ctx, champ["checkpoint"], messages)

    # the next period's good ratings teach a worse reply: not promoted
    t2 = _traffic(ctx, RUDE, "good")
    second = _flywheel(ctx, str(qa), t1, t2)
    assert reg.current(LINE)["checkpoint"] == champ["checkpoint"]
    cand = reg.current(LINE, "candidate")  # its sampler weights, saved for the evaluation
    assert cand["checkpoint"] != champ["checkpoint"] and cand["source_run"] != run_id
    assert "/sampler_weights/" in cand["checkpoint"]
    arts = {a.key: a for a in ctx.stack.artifacts(second.id) if a.key}
    assert "| promoted | False (the gate does not hold) |" in arts[f"flywheel-{LINE}"].data
    history = ctx.training().query("SELECT alias, action FROM models WHERE line = ? ORDER BY time", [LINE])
    assert [(h["alias"], h["action"]) for h in history] == [
        ("champion", "promote"), ("candidate", "set"), ("champion", "promote"), ("candidate", "set")]

    # the events tell the same story, linked by their resources
    promoted = wait_until(lambda: [e for e in ctx.stack.events("prefect-tinker.model.promoted",
                                                               related=champ["checkpoint"])], 60, "the event")
    assert [e["resource"]["prefect.resource.id"] for e in promoted] == [line_resource_id(LINE)]
    evals = ctx.stack.events("prefect-tinker.eval.completed", related=cand["checkpoint"])
    assert [e["resource"]["prefect-tinker.benchmark"] for e in evals] == ["polite"]
    saved = ctx.stack.events("prefect-tinker.checkpoint.saved", related=f"prefect-tinker.run.{run_id}")
    assert saved and all(e["resource"]["prefect-tinker.line"] == LINE for e in saved)
    snapshots = [e for e in ctx.stack.events("prefect.asset.materialization", related=f"prefect.flow-run.{first.id}")
                 if "/datasets/" in e["resource"]["prefect.resource.id"]]
    assert snapshots and any(r["prefect.resource.id"].endswith("/capture/captures") for r in snapshots[0]["related"])


def test_ordinary_run_checkpoint_is_evaluated_then_considered_for_promotion(ctx):
    env = ctx.stack.env()
    cmd = [sys.executable, "-m", "prefect_tinker.cli.main", "run", "sft", "--quiet", "--tag", "evaluate-checkpoints",
           f"model=alias:{LINE}@champion", "run_name=ordinary", f"store={ctx.store}", "max_steps=2", "batch_size=2",
           "lora_rank=8", "max_length=128", "save_every=2", "eval_every=0", "num_eval_samples=0", "test_size=0",
           f"backend.credentials_block={BLOCK}"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    state = ctx.training().last_checkpoint("ordinary")["path"]

    def runs_of(deployment: str) -> list:
        with ctx.stack.client() as c:
            dep = c.read_deployment_by_name(deployment)
            from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

            return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))

    ev = wait_until(lambda: [r for r in runs_of("eval/eval-checkpoint") if r.parameters["config"]["model"] == state],
                    300, "the automation to start the checkpoint's evaluation", interval=2.0)
    given = ev[0].parameters["config"]  # templated from the checkpoint's event: where it lives
    assert (given["line"], given["store"], given["backend"]["credentials_block"]) == (LINE, ctx.store, BLOCK)
    ctx.completed(ev[0].id)
    from tinker_blocks.stores import EvalStore

    rows = EvalStore(root=ctx.store).query("SELECT checkpoint, value FROM eval_results WHERE run_id = 'ordinary' "
                                           "AND metric = 'accuracy'")
    assert rows and rows[0]["checkpoint"].startswith("tinker://")
    pr = wait_until(lambda: [r for r in runs_of("promote/promote-candidate")
                             if r.parameters["config"]["candidate"] == rows[0]["checkpoint"]],
                    300, "the automation to start the promotion gate", interval=2.0)
    assert pr[0].parameters["config"]["line"] == LINE
    ctx.completed(pr[0].id)
    from tinker_blocks.model_registry import ModelRegistry

    assert ModelRegistry(ctx.training()).current(LINE, "candidate")["checkpoint"] == rows[0]["checkpoint"]


def test_three_training_runs_at_once_take_turns_under_a_limit_of_one(ctx):
    base = dict(model="tiny", batch_size=2, lora_rank=8, max_length=128, max_steps=2, save_every=2, eval_every=0,
                num_eval_samples=0, test_size=0, store=ctx.store, backend=ctx.backend())
    runs = [ctx.stack.run_deployment("sft/sft-tiny", {"config": {**base, "run_name": f"queued-{i}"}})
            for i in range(3)]
    for fr in runs:
        ctx.completed(fr.id)
    spans = []
    for i, fr in enumerate(runs):
        tasks = {t.name: t for t in ctx.stack.task_runs(fr.id)}
        opened, done = tasks[f"open-queued-{i}"], tasks[f"record-run-queued-{i}-completed"]
        spans.append((opened.start_time, done.end_time, fr.id))
    spans.sort()
    for (_, end, _), (start, _, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, spans  # never two training clients at once
    logs = "\n".join(line for fr in runs for line in ctx.stack.logs(fr.id))
    assert "tinker-train:local is full (1 of 1 in use): waiting for a slot" in logs
    with ctx.stack.client() as c:
        assert c.read_global_concurrency_limit_by_name("tinker-train:local").active_slots == 0
