"""No stale embedded servers: ``server.json`` records the interpreter, the package version and a
hash of the server's code; a recorded server with another identity is replaced, or refused with one
line while a live session still uses it; stopping it first finishes this process's sessions on it
(tinker_blocks/credentials.py)."""

from __future__ import annotations

import json

import pytest

from tinker_blocks import LocalServerError, TinkerCredentials
from tinker_blocks.credentials import LOCAL_API_KEY, ensure_local_server
from tinker_local.keys import KeyStore
from tinker_local.launcher import server_identity
from tinker_local.procs import pid_alive as _pid_alive


def _age(root, **changes):
    """Rewrite the record as if an older installation had started the server."""
    path = root / "server.json"
    record = json.loads(path.read_text())
    record["identity"] = {**record["identity"], **changes}
    path.write_text(json.dumps(record))
    return record


def test_stale_server_is_replaced_or_refused_while_in_use(tmp_path):
    import tinker

    block = TinkerCredentials(local=True, local_root=str(tmp_path))
    first = ensure_local_server(block)
    try:
        ident = server_identity()
        assert first["identity"] == ident and ident["code"].startswith("sha256:") and len(ident["code"]) == 71
        assert ensure_local_server(block)["pid"] == first["pid"]  # same identity: reused

        # another code version, no session using it: stopped and replaced
        _age(tmp_path, code="sha256:" + "0" * 64, version="0.1.0")
        second = ensure_local_server(block)
        assert second["pid"] != first["pid"] and not _pid_alive(first["pid"])
        assert second["identity"] == ident

        # a live session (the unmodified SDK's, just created) on a stale server: refused, server kept
        client = tinker.ServiceClient(base_url=second["base_url"], api_key=LOCAL_API_KEY)
        sampler = client.create_sampling_client(base_model="tiny")  # the SDK's session starts here
        _age(tmp_path, python="/elsewhere/bin/python3")
        with pytest.raises(LocalServerError) as info:
            ensure_local_server(block)
        msg = str(info.value)
        assert "\n" not in msg and f"pid {second['pid']}" in msg and "live session(s) still use it" in msg
        assert f"runs other code (python /elsewhere/bin/python3 -> {ident['python']}) and 1 live session(s)" in msg
        assert _pid_alive(second["pid"])
        del sampler
        client.close("success").result(timeout=10)  # its heartbeat stops with the session

        # a stale server that does not say whether sessions use it (a key file now refuses ours:
        # HTTP 401): any doubt means in use, so it is refused with one line saying why, and kept
        KeyStore(tmp_path).add("alice")
        with pytest.raises(LocalServerError) as info:
            ensure_local_server(block)
        msg = str(info.value)
        assert "\n" not in msg and f"pid {second['pid']}" in msg
        assert "cannot tell whether sessions still use it: its session list answered HTTP 401" in msg
        assert _pid_alive(second["pid"])
    finally:
        block.stop_local_server()


def test_stopping_the_server_first_finishes_the_sessions_of_this_process(tmp_path):
    """The cached client of a server that is stopped is closed while the server still answers: its
    session is recorded finished (the SDK's heartbeat then stops; left alone it warns every 10 s
    once two minutes have passed, for the rest of the process), and the next client is a new one."""
    block = TinkerCredentials(local=True, local_root=str(tmp_path))
    client = block.get_client()
    client.create_sampling_client(base_model="tiny")  # the SDK's session starts here
    assert block.stop_local_server() is True
    events = [json.loads(line) for line in (tmp_path / "server" / "registry.jsonl").read_text().splitlines()]
    sessions = [e for e in events if e["event"] == "session"]
    assert len({e["session_id"] for e in sessions}) == 1, sessions
    finished = [e["finished"] for e in sessions if e.get("finished")]
    assert finished == ["interrupted"], sessions
    try:
        assert block.get_client() is not client
    finally:
        block.stop_local_server()
