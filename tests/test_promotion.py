"""Events, the model registry and the eval-gated promotion, in-process on the tiny model: a short
SFT run started from ``alias:LINE@champion`` (its checkpoint events, its run event, what it
recorded), then the ``promote`` flow against the champion on an exact-match benchmark whose
references are one model's own greedy replies (so which model is better is known beforehand), the
gate's numbers recomputed from the stored samples, and an alias change rolled back by its
transaction when a later step fails."""

from __future__ import annotations

import json

import pytest
import tinker

from prefect_tinker.flows.promote import PromoteConfig, promote_flow
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
from prefect_tinker.recipes.gate import decide, item_scores
from prefect_tinker.recipes.renderers import get_renderer, resolve_renderer_name
from prefect_tinker.tasks.models import alias_row
from tinker_blocks.model_registry import ModelRegistry, resolve_weights
from tinker_blocks.stores import EvalStore, TrainingStore

QUESTIONS = [f"Tell me about item number {i}." for i in range(8)]
LINE = "helper"


def _events(prefix: str, related: str | None = None, want: int = 1, resource: str | None = None) -> list[dict]:
    """Events whose name starts with ``prefix`` on the session's test API, once at least ``want``
    arrived (sent ones drained first; the server stores events a moment after receiving them)."""
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    from tests.prefect_stack import wait_until

    EventsWorker.drain_all()
    flt: dict = {"event": {"prefix": [prefix]}, "order": "ASC"}
    if related:
        flt["related"] = {"id": [related]}
    if resource:
        flt["resource"] = {"id": [resource]}

    def found() -> list[dict] | None:
        with get_client(sync_client=True) as c:
            resp = c._client.post("/events/filter", json={"filter": flt, "limit": 50})
            resp.raise_for_status()
            events = resp.json()["events"]
        return events if len(events) >= want else None

    return wait_until(found, 60, f"{want} {prefix} event(s)", interval=1.0)


def _greedy(credentials, sampler: str) -> list[str]:
    """Greedy replies of ``sampler`` (``base:tiny`` or a path) to :data:`QUESTIONS`, as the eval flow renders them."""
    service = credentials.get_client()
    client = (service.create_sampling_client(base_model=sampler[5:]) if sampler.startswith("base:")
              else service.create_sampling_client(model_path=sampler)).result()
    tok = sampler_tokenizer(service, client)
    renderer = get_renderer(resolve_renderer_name("auto", tok), tok)
    out = []
    for q in QUESTIONS:
        prompt = renderer.build_generation_prompt([{"role": "user", "content": q}])
        params = tinker.SamplingParams(max_tokens=6, temperature=0.0, stop=renderer.get_stop_sequences())
        seq = client.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        out.append(renderer.parse_response(list(seq.tokens)).message["content"] or "")
    return out


@pytest.fixture(scope="module")
def trained(prefect_api, local_credentials, tmp_path_factory):
    """A line whose champion is the base model, and a 3-step SFT run started from it (a high
    learning rate, so its greedy replies differ from the base model's)."""
    root = tmp_path_factory.mktemp("promotion")
    store = TrainingStore(root=str(root / "store"))
    ModelRegistry(store).write(alias_row(store, LINE, "champion", "promote", resolve_weights(store, "tiny")))
    cfg = SFTConfig(model=f"alias:{LINE}@champion", run_name="cand", store=store.root, batch_size=4, max_steps=3,
                    learning_rate=0.05, lora_rank=8, max_length=128, save_every=3, eval_every=0, num_eval_samples=1,
                    sample_max_tokens=4, test_size=4,
                    backend={"local_root": local_credentials.local_root})
    summary = sft_flow(cfg)
    return root, store, summary


def test_a_run_from_an_alias_records_its_start_and_sends_linked_events(trained):
    root, store, summary = trained
    run = store.get_run("cand")
    meta, config = json.loads(run["meta_json"]), json.loads(run["config_json"])
    assert (meta["line"], meta["start"], config["model"], run["base_model"]) == (
        LINE, f"alias:{LINE}@champion", f"alias:{LINE}@champion", "tiny")
    state = store.last_checkpoint("cand")["path"]
    sampler = store.last_checkpoint("cand", "sampler")["path"]

    saved = _events("prefect-tinker.checkpoint.saved", related="prefect-tinker.run.cand", want=2)
    by_kind = {e["resource"]["prefect-tinker.kind"]: e for e in saved}
    assert set(by_kind) == {"state", "sampler"}, saved
    st = by_kind["state"]
    assert st["resource"]["prefect.resource.id"] == state
    assert {k: st["resource"][f"prefect-tinker.{k}"] for k in ("run", "step", "recipe", "line")} == {
        "run": "cand", "step": "3", "recipe": "sft", "line": LINE}
    related = {(r["prefect.resource.role"], r["prefect.resource.id"]) for r in st["related"]}
    assert {("run", "prefect-tinker.run.cand"), ("recipe", "prefect-tinker.recipe.sft"),
            ("model-line", f"prefect-tinker.model-line.{LINE}")} <= related
    assert any(role == "flow-run" for role, _ in related)  # Prefect's own link to the flow run
    assert ("state", state) in {(r["prefect.resource.role"], r["prefect.resource.id"])
                                for r in by_kind["sampler"]["related"]}
    (finished,) = _events("prefect-tinker.run.finished", related=f"prefect-tinker.model-line.{LINE}")
    assert finished["resource"]["prefect-tinker.status"] == "completed"
    assert finished["payload"]["steps"] == 3 and set(finished["payload"]["checkpoints"]) == {state, sampler}


def _benchmark(tmp, name: str, refs: list[str]) -> dict:
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answer": r}) + "\n"
                            for i, (q, r) in enumerate(zip(QUESTIONS, refs, strict=True))))
    return {"benchmark": "exact_match", "dataset": str(data), "id_field": "id", "eval_name": name, "max_tokens": 6,
            "temperature": 0.0}


def test_promotion_gate_decides_from_paired_samples_and_moves_the_alias(trained, local_credentials, tmp_path,
                                                                        monkeypatch):
    root, store, summary = trained
    cand = resolve_weights(store, "run:cand")
    mine, base = _greedy(local_credentials, cand.checkpoint), _greedy(local_credentials, "base:tiny")
    differ = [i for i, (m, b) in enumerate(zip(mine, base, strict=True)) if m.strip() and m != b]
    assert len(differ) >= 4, (mine, base)  # the candidate answers differently from the base model
    backend = {"local_root": local_credentials.local_root}
    common = dict(line=LINE, store=store.root, backend=backend, batch_size=8)

    # references = the champion's own replies: the candidate cannot be better -> the alias stays
    keep = promote_flow(PromoteConfig(candidate="run:cand", benchmarks=[_benchmark(tmp_path, "theirs", base)],
                                      **common))
    assert not keep["promoted"] and keep["decision"]["low"] <= 0 and keep["decision"]["difference"] < 0
    assert resolve_weights(store, f"alias:{LINE}").checkpoint == "tiny"
    assert resolve_weights(store, f"alias:{LINE}@candidate").checkpoint == cand.checkpoint

    # references = the candidate's replies: better on every item it answers differently
    bench = _benchmark(tmp_path, "mine", mine)
    cfg = PromoteConfig(candidate="run:cand", benchmarks=[bench], **common)

    def broken(*args, **kwargs):  # a step after the alias change fails: the transaction undoes it
        raise RuntimeError("asset service down")

    monkeypatch.setattr("prefect_tinker.flows.promote.tag_aliases", broken)
    with pytest.raises(RuntimeError, match="asset service down"):
        promote_flow(cfg)
    assert resolve_weights(store, f"alias:{LINE}").checkpoint == "tiny"
    assert store.query("SELECT count(*) AS n FROM models WHERE alias = 'champion'")[0]["n"] == 1
    monkeypatch.undo()

    # other evaluations of the same weights under the same key (a training run's in-loop evaluator with
    # another limit and more completions): the gate reads only this evaluation's examples and completions
    evals = EvalStore(root=store.root)
    (key,) = evals.query("SELECT DISTINCT run_id, step FROM eval_samples WHERE eval_name = 'mine' AND checkpoint = ?",
                         [cand.checkpoint])
    evals.write_rows("eval_samples", [
        {**key, "checkpoint": cand.checkpoint, "eval_name": "mine", "example_id": ex, "sample_index": i,
         "correct": False, "score": 0.0}
        for ex, i in [*((f"q{j}", 1) for j in range(8)), ("extra0", 0), ("extra1", 0)]
    ])

    won = promote_flow(cfg)
    assert won["promoted"] and won["decision"]["low"] > 0
    champ = resolve_weights(store, f"alias:{LINE}")
    assert (champ.checkpoint, champ.state_path, champ.run_id) == (cand.checkpoint, cand.state_path, "cand")
    (row,) = store.query("SELECT * FROM models WHERE alias = 'champion' AND action = 'promote' AND previous = 'tiny'")
    numbers = json.loads(row["decision_json"])
    assert numbers["promote"] and numbers["items"] == len(QUESTIONS)

    # the same numbers from the stored samples, independently of the flow (this evaluation's rows: the
    # 8 questions, one completion each)
    scores = {ck: {"mine": item_scores(evals.query(
        "SELECT example_id, correct FROM eval_samples WHERE eval_name = 'mine' AND checkpoint = ? "
        "AND example_id LIKE 'q%' AND sample_index = 0", [ck]))}
        for ck in (cand.checkpoint, "tiny")}
    assert scores[cand.checkpoint]["mine"] == {f"q{i}": 1.0 if mine[i].strip() else 0.0 for i in range(8)}
    again = decide(scores[cand.checkpoint], scores["tiny"], cfg.gate)
    assert again.difference == pytest.approx(numbers["difference"]) and again.low == pytest.approx(numbers["low"])

    promoted = _events("prefect-tinker.model.promoted", related=cand.checkpoint)
    assert [e["resource"]["prefect-tinker.alias"] for e in promoted] == ["champion"]
    assert promoted[0]["payload"]["previous"] == "tiny" and promoted[0]["payload"]["decision"]["promote"]
    completed = _events("prefect-tinker.eval.completed", related=cand.checkpoint, want=2)
    assert {e["resource"]["prefect-tinker.benchmark"] for e in completed} >= {"mine", "theirs"}
    assert all(e["payload"]["interval"] and e["resource"]["prefect-tinker.line"] == LINE for e in completed)
    tagged = [e for e in _events("prefect.asset.materialization", resource=cand.checkpoint, want=2)
              if (e.get("payload") or {}).get("aliases")]  # the first: the save itself
    assert sorted(tagged[-1]["payload"]["aliases"]) == [f"{LINE}@candidate", f"{LINE}@champion"], tagged
    (pointed,) = _events("prefect.asset.materialization", resource=f"model://{LINE}/champion")
    assert pointed["payload"]["checkpoint"] == cand.checkpoint
    assert cand.checkpoint in {r["prefect.resource.id"] for r in pointed["related"]}  # the checkpoint upstream
