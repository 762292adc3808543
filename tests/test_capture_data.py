"""Tool calls through the capture endpoint, and captured conversations read back as training data.

- A LoRA of ``tiny`` trained (through the SDK on the local server) to answer with a Qwen3 tool
  call is served by the capture app (uvicorn in a thread); the real ``openai`` client gets the
  call back as OpenAI ``tool_calls`` (plain and streamed), and the conversation read back from
  the store renders to exactly the sampled tokens.
- ``read_captured_conversations``: SQL filters over rows written through the store writer, the
  guard against anything but one filter expression, and the same on a real S3 server.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

from prefect_tinker.recipes.capture_data import (  # noqa: E402
    CaptureFilterError,
    parse_capture_source,
    read_captured_conversations,
)
from tests.capture_fixtures import free_port  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def tool_sampler_path(local_credentials):
    """Sampler weights of a rank-16 LoRA on ``tiny`` overfit (50 Adam steps) to one reply: a
    ``get_weather`` tool call in the Qwen3 format."""
    import tinker

    from prefect_tinker.recipes.datasets import datum_from_example
    from prefect_tinker.recipes.renderers import get_renderer

    service = local_credentials.get_client()
    tc = service.create_lora_training_client(base_model="tiny", rank=16)
    tc = tc.result() if hasattr(tc, "result") else tc
    renderer = get_renderer("qwen3", tc.get_tokenizer())
    model_input, weights = renderer.build_supervised_example(
        ASK + [{"role": "assistant", "content": "", "tool_calls": [CALL]}]
    )
    datum = datum_from_example(model_input, weights)
    for _ in range(50):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(tinker.AdamParams(learning_rate=2e-3)).result()
        fb.result()
    return tc.save_weights_for_sampler("capture-tool").result().path


class ThreadServer:
    """The capture app served by uvicorn in a thread (127.0.0.1, no token)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_tool_calls_come_back_as_openai_tool_calls_and_train_back(tmp_path, local_credentials, tool_sampler_path):
    from tinker_blocks import CaptureStore

    from prefect_tinker.recipes.renderers import get_renderer
    from prefect_tinker.capture.app import create_app
    from prefect_tinker.capture.model import open_served_model
    from prefect_tinker.capture.recorder import CaptureRecorder

    root = str(tmp_path / "store")
    served = open_served_model(local_credentials, tool_sampler_path, renderer="qwen3", names=["agent-model"])
    recorder = CaptureRecorder(CaptureStore(root=root), flush_seconds=0.2)
    srv = ThreadServer(create_app(served, recorder, session_id="tools-1"))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/r/weather-bot/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model="agent-model", messages=ASK, temperature=0, max_tokens=100)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}

        chunks = list(c.chat.completions.create(model="agent-model", messages=ASK, temperature=0, max_tokens=100,
                                                stream=True))
        deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the agent's next turn: its tool call (arguments as a JSON string) and the tool's result
        follow = ASK + [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
        nxt = c.chat.completions.create(model="agent-model", messages=follow, tools=TOOLS, max_tokens=4, seed=1)
        assert nxt.usage.prompt_tokens > r.usage.prompt_tokens
        c.close()
    finally:
        srv.stop()  # lifespan shutdown closes (flushes) the recorder
    assert recorder.pending == 0 and recorder.stats["flush_errors"] == 0

    convs = read_captured_conversations(root, "finish_reason = 'tool_calls' AND client = 'weather-bot'")
    assert len(convs) == 2
    conv = convs[0]
    assert conv.source.startswith("capture:tools-1/chatcmpl-") and conv.metadata["checkpoint"] == tool_sampler_path
    assert conv.messages[:-1] == ASK and conv.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    # rendering the captured conversation reproduces the sampled tokens exactly
    renderer = get_renderer("qwen3", served.tokenizer)
    prompt = renderer.build_generation_prompt(ASK).to_ints()
    tokens, weights = renderer.build_supervised_example(conv.messages, "last_assistant_message")
    row = CaptureStore(root=root).query("SELECT completion_token_ids, prompt_tokens FROM captures WHERE request_id = ?",
                                        [conv.source.split("/")[1].split("#")[0]])[0]
    assert row["prompt_tokens"] == len(prompt)
    assert tokens.to_ints()[len(prompt):len(prompt) + len(row["completion_token_ids"])] == row["completion_token_ids"]
    assert np.flatnonzero(weights)[0] == len(prompt)
    later = read_captured_conversations(root, "json_array_length(tools_json) = 1", include_truncated=True)
    assert len(later) == 1 and later[0].metadata["tools"] == TOOLS and later[0].messages[2]["role"] == "tool"


def _rows(n_clients: int = 2) -> list[dict]:
    rows = []
    for i in range(6):
        rows.append(
            {
                "run_id": "sess-a" if i < 4 else "sess-b",
                "request_id": f"req-{i}",
                "sequence_index": 0,
                "client": f"agent-{i % n_clients}",
                "endpoint": "chat.completions" if i != 5 else "completions",
                "model": "m",
                "checkpoint": "tiny",
                "prompt": json.dumps([{"role": "user", "content": f"q{i}"}]),
                "completion": f"a{i}",
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "completion_token_ids": [5, 6],
                "logprob_sum": -1.0 * i,
                "logprob_mean": -0.5 * i,
                "logprob_min": -1.0 * i,
                "stop_reason": "length" if i == 3 else "stop",
                "finish_reason": "length" if i == 3 else "stop",
                "metadata_json": json.dumps({"task": "t" + str(i % 3)}),
                "time": 1_700_000_000 + i,
                "response_json": json.dumps(
                    {"message": {"role": "assistant", "content": f"a{i}"}, "finish_reason": "stop"}
                ),
            }
        )
    return rows


def _write(root: str, rows: list[dict], storage_options=None) -> None:
    from tinker_blocks.store_io import ParquetStore

    with ParquetStore(root, "capture", storage_options=storage_options).writer("captures") as w:
        w.write_many(rows)


def _check_reader(root: str, storage_options=None) -> None:
    read = lambda where=None, **kw: read_captured_conversations(root, where, storage_options=storage_options, **kw)  # noqa: E731
    everything = read()
    assert [c.messages[0]["content"] for c in everything] == [
        "q0",
        "q1",
        "q2",
        "q4",
    ]  # no completions row, no truncated
    assert [c.messages[1] for c in everything][0] == {"role": "assistant", "content": "a0"}
    assert len(read(include_truncated=True)) == 5
    assert [c.metadata["request_id"] for c in read("logprob_mean > -1.2")] == ["req-0", "req-1", "req-2"]
    assert [
        c.metadata["request_id"] for c in read("client = 'agent-1' AND run_id = 'sess-a'", include_truncated=True)
    ] == ["req-1", "req-3"]
    assert [c.metadata["metadata"] for c in read("json_extract_string(metadata_json, '$.task') = 't1'")] == [
        {"task": "t1"},
        {"task": "t1"},
    ]
    assert [
        c.metadata["request_id"]
        for c in read("request_id IN (SELECT request_id FROM captures WHERE logprob_min < -1.5)", limit=1)
    ] == ["req-2"]
    for bad, what in (("1=1; DROP VIEW captures", "not one SQL expression"),
                      ("logprob_mean > 0) OR (1=1", "not one SQL expression"),
                      ("no_such_column > 1", "no_such_column"),
                      ("length((SELECT content FROM read_text('/etc/hostname'))) > 0", "disabled"),
                      ("EXISTS (SELECT 1 FROM read_csv('/etc/passwd'))", "disabled")):
        with pytest.raises(CaptureFilterError, match=what):
            read(bad)


def test_read_captured_conversations_filters_and_guard(tmp_path):
    root = str(tmp_path / "store")
    _write(root, _rows())
    _check_reader(root)
    assert read_captured_conversations(str(tmp_path / "empty")) == []


def test_read_captured_conversations_on_s3(s3_root, s3_server):
    _write(s3_root, _rows())
    _check_reader(s3_root)


def test_parse_capture_source():
    assert parse_capture_source("capture:/data/store") == ("/data/store", None)
    assert parse_capture_source("capture:s3://b/p::logprob_mean > -1.5 AND client = 'x::y'") == (
        "s3://b/p", "logprob_mean > -1.5 AND client = 'x::y'")
    for bad in ("/data/store", "capture:", "capture:::x > 1"):
        with pytest.raises(ValueError):
            parse_capture_source(bad)


def test_sft_trains_on_captured_conversations_through_a_filter(prefect_api, local_credentials, tmp_path):
    """``dataset=capture:<root>::<filter>``: the SFT flow trains on exactly the captured chats the
    filter selects (counted independently in SQL over the capture store)."""
    from prefect_tinker.flows.sft import SFTConfig, sft_flow
    from tinker_blocks.stores import CaptureStore, TrainingStore

    root = str(tmp_path / "captured")
    rows = []
    for i in range(12):
        r = _rows()[i % 3]
        rows.append(dict(r, request_id=f"r{i}", client=f"agent-{i % 2}",
                         prompt=json.dumps([{"role": "user", "content": f"Say the number {i}."}]),
                         response_json=json.dumps({"message": {"role": "assistant", "content": f"The number is {i}."},
                                                   "finish_reason": "stop"})))
    _write(root, rows)
    where = "client = 'agent-1' AND logprob_mean > -0.7"
    expected = CaptureStore(root=root).query(
        f"SELECT count(*) AS n FROM captures WHERE {where} AND endpoint = 'chat.completions'"
    )[0]["n"]
    assert 0 < expected < 12
    store = tmp_path / "store"
    summary = sft_flow(
        SFTConfig(
            model="tiny",
            dataset=f"capture:{root}::{where}",
            batch_size=1,
            max_steps=2,
            test_size=0,
            lora_rank=4,
            num_eval_samples=0,
            run_name="from-captures",
            store=str(store),
            backend={"local_root": local_credentials.local_root},
        )
    )
    assert summary["steps"] == 2
    meta = json.loads(TrainingStore(root=str(store)).get_run("from-captures")["meta_json"])
    assert meta["dataset_fingerprint"].startswith("sha256:")
    from prefect_tinker.recipes.datasets import load_conversations

    convs = load_conversations(f"capture:{root}::{where}")
    assert len(convs) == expected and all(c.messages[-1]["content"].startswith("The number is") for c in convs)


def test_capture_filter_of_the_docs_and_truncated_replies_counted(tmp_path, capsys):
    """`dataset=capture:STORE::client = 'agent-a'` (the documented syntax) selects agent-a's chat
    rows; replies cut at max_tokens are skipped and counted (reason `truncated`), kept with
    `options.include_truncated=true`; a filter selecting only truncated replies fails up front, in
    one line that says so."""
    from prefect_tinker.cli import main as cli
    from prefect_tinker.recipes.data_reading import SkipStats, SourceSpec, iter_conversations

    root = str(tmp_path / "captured")
    base = _rows()[0]
    rows = [dict(base, request_id=f"r{i}", client="agent-a" if i < 3 else "agent-b",
                 finish_reason="length" if i == 2 else "stop", stop_reason="length" if i == 2 else "stop")
            for i in range(5)]
    _write(root, rows)
    source = f"capture:{root}::client = 'agent-a'"
    stats = SkipStats()
    got = list(iter_conversations(source, stats=stats))
    assert [c.metadata["request_id"] for c in got] == ["r0", "r1"] and stats.summary() == "1 skipped: 1 truncated"
    keep = list(iter_conversations(SourceSpec(path=source, options={"include_truncated": True})))
    assert [c.metadata["request_id"] for c in keep] == ["r0", "r1", "r2"]
    assert cli.main(["run", "sft", "model=tiny", f"dataset={source}", "--dry-run"]) == 0
    capsys.readouterr()

    only_cut = f"capture:{root}::client = 'agent-a' AND request_id = 'r2'"
    assert cli.main(["run", "sft", "model=tiny", f"dataset={only_cut}", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: invalid data for flow 'sft': no conversations in {only_cut} (1 skipped: "
                                 "1 truncated; options.include_truncated=true keeps replies cut at max_tokens)\n")
    assert cli.main(["run", "sft", "model=tiny", f"dataset={only_cut}", "options.include_truncated=true",
                     "--dry-run"]) == 0


def test_ratings_time_window_and_comparisons(tmp_path):
    """The clients' ratings and the judge's scores join the rows (the latest of each source wins),
    ``since`` / ``until`` bound the capture time, and two replies to one conversation rated apart
    make one DPO comparison."""
    from datetime import UTC, datetime

    from prefect_tinker.recipes.capture_data import read_captured_preferences
    from tinker_blocks.store_io import ParquetStore

    root = str(tmp_path / "store")
    rows = _rows()
    rows[2]["prompt"] = rows[0]["prompt"]  # req-2 answers the same conversation as req-0
    _write(root, rows)
    ratings = [("req-0", "client", -1.0, 1), ("req-0", "client", 1.0, 2), ("req-2", "client", -1.0, 1),
               ("req-1", "judge", 0.9, 1), ("req-4", "client", 1.0, 1)]
    with ParquetStore(root, "capture").writer("ratings") as w:
        for req, source, rating, t in ratings:  # req-0's second rating replaces its first
            w.write(run_id="sess-a", request_id=req, sequence_index=0, source=source, rating=rating,
                    time=1_700_000_100 + t)
    got = {c.metadata["request_id"]: (c.metadata["rating"], c.metadata["judge_score"])
           for c in read_captured_conversations(root)}
    assert got == {"req-0": (1.0, None), "req-1": (None, 0.9), "req-2": (-1.0, None), "req-4": (1.0, None)}
    assert [c.metadata["request_id"] for c in read_captured_conversations(root, "rating > 0")] == ["req-0", "req-4"]
    assert [c.metadata["request_id"] for c in read_captured_conversations(root, "judge_score >= 0.5")] == ["req-1"]
    window = read_captured_conversations(root, since=datetime.fromtimestamp(1_700_000_001, UTC),
                                         until=datetime.fromtimestamp(1_700_000_004, UTC))
    assert [c.metadata["request_id"] for c in window] == ["req-1", "req-2"]  # req-3 truncated, req-4 at `until`
    (pair,) = read_captured_preferences(root)
    assert pair["prompt"] == [{"role": "user", "content": "q0"}]
    assert (pair["chosen"]["content"], pair["rejected"]["content"]) == ("a0", "a2")
    assert pair["source"] == ["capture:sess-a/req-0#0", "capture:sess-a/req-2#0"]
