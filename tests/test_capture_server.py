"""The capture endpoint end to end: the real ``openai`` client against a real ``prefect-tinker
capture serve`` process sampling the ``tiny`` model on the session's embedded local server, and
the ``captures`` rows read back with DuckDB through the store."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

from tests.capture_fixtures import TOKEN, capture_command, capture_rows, start_capture, wait_for_rows  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def local_root(local_credentials) -> str:
    local_credentials.get_client()  # start the embedded server once; capture serve reuses it
    return str(local_credentials.resolved_local_root())


@pytest.fixture(scope="module")
def server(tmp_path_factory, local_root):
    cap = start_capture(tmp_path_factory.mktemp("capture"), local_root, session="capture-test-main",
                        extra=("--flush-seconds", "0.5", "--served-model-name", "tiny-chat"))
    yield cap
    assert cap.stop() == 0, cap.log_text()[-3000:]


@pytest.fixture(scope="module")
def tokenizer(server, local_root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(local_root) / "models" / "tiny"))


def client(server, tag: str | None = None, token: str = TOKEN) -> "openai.OpenAI":
    base = server.base + (f"/r/{tag}" if tag else "") + "/v1"
    return openai.OpenAI(base_url=base, api_key=token, max_retries=0, timeout=120)


def rows_of(server, request_id: str, timeout: float = 20.0) -> list[dict]:
    """The request's rows, waiting for the server's next flush."""
    deadline = time.monotonic() + timeout
    while True:
        rows = capture_rows(server.store, "SELECT * FROM captures WHERE request_id = ? ORDER BY sequence_index",
                            [request_id])
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_chat_stream_n2_and_completion_each_sequence_one_row(server, tokenizer):
    before = len(capture_rows(server.store))
    c = client(server, tag="agent-a")
    plain = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=11,
                                      metadata={"task": "colours"})
    stream = list(client(server).chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_completion_tokens=5, seed=12, stream=True,
        stream_options={"include_usage": True}))
    two = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, n=2, seed=13, logprobs=True,
                                    top_logprobs=2, temperature=0.9, top_p=0.95)
    comp = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, seed=14, logprobs=2)
    rows = wait_for_rows(server.store, before + 5)
    assert len(rows) == before + 5  # exactly one row per returned sequence

    # independent prompt length: the tokenizer's own chat template (tiny's renderer is chat_template)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tokenizer.encode(text, add_special_tokens=False))
    assert plain.usage.prompt_tokens == two.usage.prompt_tokens == n_prompt
    assert comp.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))

    (r,) = rows_of(server, plain.id)
    assert (r["run_id"], r["client"], r["endpoint"], r["model"], r["checkpoint"]) == (
        "capture-test-main", "agent-a", "chat.completions", "tiny", "tiny")
    assert json.loads(r["metadata_json"]) == {"task": "colours"}
    assert json.loads(r["prompt"]) == MESSAGES
    assert r["prompt_tokens"] == plain.usage.prompt_tokens
    assert r["completion_tokens"] == plain.usage.completion_tokens == len(r["completion_token_ids"])
    assert r["completion"] == plain.choices[0].message.content
    assert r["finish_reason"] == plain.choices[0].finish_reason in ("stop", "length")
    assert json.loads(r["sampling_json"])["seed"] == 11 and json.loads(r["sampling_json"])["max_tokens"] == 6

    ids = {ch.id for ch in stream}
    assert len(ids) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in stream if ch.choices and ch.choices[0].finish_reason]
    usage = stream[-1].usage
    assert stream[-1].choices == [] and usage.prompt_tokens == n_prompt
    (r,) = rows_of(server, ids.pop())
    assert r["model"] == "tiny-chat" and r["completion"] == text and [r["finish_reason"]] == finish
    assert r["completion_tokens"] == usage.completion_tokens <= 5 and r["prompt_tokens"] == usage.prompt_tokens

    rs = rows_of(server, two.id)
    assert [x["sequence_index"] for x in rs] == [0, 1] and len(two.choices) == 2
    assert sum(x["completion_tokens"] for x in rs) == two.usage.completion_tokens
    for x, choice in zip(rs, two.choices, strict=True):
        lps = [t.logprob for t in choice.logprobs.content]
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
                   and t.logprob <= t.top_logprobs[0].logprob + 1e-5 for t in choice.logprobs.content)
        if choice.finish_reason == "length":  # no end-of-turn token: the row covers exactly these tokens
            assert len(lps) == x["completion_tokens"] == 7
            assert x["logprob_sum"] == pytest.approx(sum(lps), abs=1e-4)
            assert x["logprob_mean"] == pytest.approx(sum(lps) / 7, abs=1e-5)
            assert x["logprob_min"] == pytest.approx(min(lps), abs=1e-5)
            assert tokenizer.decode(x["completion_token_ids"]) == choice.message.content
        else:
            assert len(lps) == x["completion_tokens"] - 1

    (r,) = rows_of(server, comp.id)
    assert r["endpoint"] == "completions" and r["prompt"] == "Once upon a time"
    assert r["completion"] == comp.choices[0].text and r["completion_tokens"] == comp.usage.completion_tokens
    assert len(comp.choices[0].logprobs.tokens) in (r["completion_tokens"], r["completion_tokens"] - 1)


def test_stop_strings_cut_like_openai_and_echo(server, tokenizer):
    c = client(server)
    full = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(text) > 6 and stop.strip()
    cut = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].message.content == text[: text.find(stop)]  # greedy: the same text, cut before the stop
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 16
    (row,) = rows_of(server, cut.id)
    assert row["completion"] == cut.choices[0].message.content and row["stop_reason"] == "stop"
    assert json.loads(row["sampling_json"])["stop"] == [stop, "@@@"]

    comp = c.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    (ch,) = comp.choices
    n_prompt = len(tokenizer.encode("Once upon a time"))
    assert ch.text.startswith("Once upon a time") and len(ch.logprobs.tokens) == n_prompt + 5
    assert ch.logprobs.token_logprobs[0] is None and all(v is not None for v in ch.logprobs.token_logprobs[1:])
    assert "".join(ch.logprobs.tokens) == ch.text and ch.logprobs.text_offset[n_prompt] == len("Once upon a time")
    (row,) = rows_of(server, comp.id)
    assert "Once upon a time" + row["completion"] == ch.text  # the row keeps prompt and completion apart


def test_sixteen_concurrent_clients_complete_and_are_batched(server, local_credentials):
    from tinker_blocks.credentials import LOCAL_API_KEY, ensure_local_server

    base_url = ensure_local_server(local_credentials)["base_url"]

    def stats() -> dict:
        return httpx.get(f"{base_url}/api/v1/local_stats", headers={"X-API-Key": LOCAL_API_KEY}, timeout=10).json()[
            "compute"
        ]

    before, s0 = len(capture_rows(server.store)), stats()

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=TOKEN, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(
                c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"question {i}"}],
                                          max_tokens=12, seed=i, user=f"agent-{i}")
                for i in range(16)))

    results = asyncio.run(main())
    s1 = stats()
    assert len({r.id for r in results}) == 16 and all(r.choices[0].message.content is not None for r in results)
    rows = wait_for_rows(server.store, before + 16)
    assert len(rows) == before + 16
    got = {r["request_id"]: r for r in rows}
    for i, res in enumerate(results):
        assert got[res.id]["client"] == f"agent-{i}"
        assert got[res.id]["completion_tokens"] == res.usage.completion_tokens
    batches = s1["batches"] - s0["batches"]
    assert (s1["batched_jobs"] - s0["batched_jobs"]) > batches  # some requests shared a decode loop


def test_openai_error_bodies(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, temperature=3.5)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 2100}], max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2040)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=MESSAGES, presence_penalty=0.5)
    assert e.value.param == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[0].role"
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, token="wrong-token-wrong-token").chat.completions.create(model="tiny", messages=MESSAGES)
    assert e.value.code == "invalid_api_key"
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"model": "tiny"}', 400)):
        r = httpx.post(server.base + "/v1/chat/completions", content=body, headers=auth, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(server.base + "/v1/models", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.base + "/v1/nothing", headers=auth, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(server.base + "/r/bad tag!/v1/chat/completions", headers=auth, timeout=30,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
    assert r.status_code in (400, 404) and "error" in r.json()
    assert [m.id for m in c.models.list()] == ["tiny-chat", "tiny"]
    assert TOKEN not in server.log_text() and TOKEN not in json.dumps(capture_rows(server.store), default=str)


def test_non_loopback_bind_without_token_is_refused(tmp_path, monkeypatch, capsys):
    import subprocess

    from prefect_tinker.cli.main import main

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_TINKER_CAPTURE_TOKEN"}
    out = subprocess.run(capture_command("--model", "tiny", "--store", str(tmp_path / "s"), "--host", "0.0.0.0"),
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 2 and "refusing to bind '0.0.0.0' without a bearer token" in out.stderr, out.stderr
    monkeypatch.delenv("PREFECT_TINKER_CAPTURE_TOKEN", raising=False)
    args = ["capture", "serve", "--model", "tiny", "--store", str(tmp_path / "s")]
    for host in ("::", "10.1.2.3"):
        assert main([*args, "--host", host]) == 2 and "refusing to bind" in capsys.readouterr().err
    (tmp_path / "short").write_text("abc\n")
    assert main([*args, "--host", "0.0.0.0", "--token-file", str(tmp_path / "short")]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    monkeypatch.setenv("PREFECT_TINKER_CAPTURE_TOKEN", "  ")  # blank: no token
    assert main([*args, "--host", "0.0.0.0"]) == 2 and "refusing to bind" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing started, nothing written


def test_is_loopback():
    from prefect_tinker.cli.capture import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.5.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "192.168.1.4", "no-such-host.invalid"))


def test_sigkill_loses_at_most_the_last_flush_interval(tmp_path, local_root):
    flush_s = 1.0
    cap = start_capture(tmp_path, local_root, session="capture-test-kill", extra=("--flush-seconds", str(flush_s)))
    c = client(cap)
    warm = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)  # model loaded, parts warm
    answered: list[tuple[str, float]] = [(warm.id, time.monotonic())]
    t_end = time.monotonic() + 6.0
    while time.monotonic() < t_end:
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        answered.append((r.id, time.monotonic()))
    os.kill(cap.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    cap.proc.wait(30)
    parts = sorted(Path(cap.store).rglob("*.parquet"))
    for p in parts:  # every visible part is a whole Parquet file
        assert pq.read_table(p).num_rows > 0
    others = [p for p in Path(cap.store).rglob("*") if p.is_file() and p.suffix not in (".parquet", ".tmp")]
    assert not others
    stored = {r["request_id"] for r in capture_rows(cap.store)}
    ids = {rid for rid, _ in answered}
    assert stored <= ids and len(answered) >= 4
    must_have = {rid for rid, t in answered if t < killed_at - flush_s - 1.5}  # slack for a busy machine
    assert must_have and must_have <= stored, (len(must_have - stored), len(answered))


def test_completion_prompt_forms():
    """``POST /v1/completions`` takes the four prompt forms of the OpenAI API; a mixed list is refused."""
    from prefect_tinker.capture.requests import APIError, CompletionRequest

    def prompts(p):
        return CompletionRequest(model="tiny", prompt=p).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([5, 6, 7]) == [[5, 6, 7]]
    assert prompts([[5, 6], [7]]) == [[5, 6], [7]]
    with pytest.raises(APIError, match="must not be empty"):
        prompts([])
    with pytest.raises(ValueError):
        prompts(["a", 5])
