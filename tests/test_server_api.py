"""Servers speaking an older Tinker API (tinker_blocks/server_api.py), and the ``tokenizer`` field for a
server naming a hub tokenizer: real runs through the unmodified SDK against a small real HTTP server
(tests/old_tinker_server.py) that answers as such servers do, in front of the session's local server."""

from __future__ import annotations

import pytest

from prefect_tinker.cli.main import main as cli_main
from tests.old_tinker_server import OldTinkerServer
from tinker_blocks.server_api import OlderServerAPIError, check_server_api, older_api_error
from tinker_blocks.stores import TrainingStore


@pytest.fixture
def remote_key(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")  # the embedded server takes any tml- key from loopback


def _run(capsys, url: str, store, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main(["run", "sft", "model=tiny", f"backend.base_url={url}", f"store={store}", "max_steps=1",
                   "batch_size=2", "eval_every=0", "save_every=0", "num_eval_samples=0", "test_size=0",
                   "max_length=128", "lora_rank=4", "--quiet", *extra])
    return rc, capsys.readouterr().err


def _close_clients(url: str) -> None:
    """Finish the SDK sessions this process opened on ``url`` (their heartbeats stop with them)."""
    from tinker_blocks import TinkerCredentials

    TinkerCredentials(base_url=url).get_client().close("success").result(timeout=30)


def test_no_client_config_is_named_in_one_line_before_the_run(prefect_api, remote_key, tmp_path, capsys):
    with OldTinkerServer(None, no_client_config=True) as old:
        with pytest.raises(OlderServerAPIError) as info:
            check_server_api(old.url, "tml-local")
        line = (f"server at {old.url} speaks an older Tinker API than the installed SDK 0.38: "
                "/api/v1/client/config not found")
        assert str(info.value) == line
        rc, err = _run(capsys, old.url, tmp_path / "store")
    assert rc == 1 and err.splitlines()[-1] == f"error: flow 'sft' failed: OlderServerAPIError: {line}", err
    assert "NotFoundError" not in err and "Traceback" not in err
    assert old.refused == ["/api/v1/client/config"] * 2  # asked once by hand, once by the run: no SDK retries
    assert not list((tmp_path / "store").glob("training/runs/*/*.parquet"))  # no run recorded


def test_refused_new_request_fields_are_named_in_one_line(prefect_api, local_credentials, remote_key, tmp_path,
                                                          capsys):
    from tinker_blocks.credentials import ensure_local_server

    upstream = ensure_local_server(local_credentials)["base_url"]
    with OldTinkerServer(upstream, strict_fields=("optimizer_config",)) as old:
        check_server_api(old.url, "tml-local")  # it has client/config: nothing to say yet
        try:
            rc, err = _run(capsys, old.url, tmp_path / "store", "run_name=strict")
        finally:
            _close_clients(old.url)
    assert old.refused == ["/api/v1/create_model"]  # refused once: a user error, not retried
    assert rc == 1 and err.splitlines()[-1] == (
        f"error: flow 'sft' failed: OlderServerAPIError: server at {old.url} speaks an older Tinker API than the "
        "installed SDK 0.38: /api/v1/create_model refuses the request field(s) optimizer_config (422 extra_forbidden)"
    ), err
    # the run never started: no step, no checkpoint (the lease is gone, a fixed server can take the name)
    ts = TrainingStore(root=str(tmp_path / "store"))
    assert ts.query("SELECT * FROM metrics WHERE run_id = 'strict'") == []


def test_other_422s_are_not_called_an_older_api():
    import httpx
    import tinker

    req = httpx.Request("POST", "http://h/api/v1/forward_backward")
    missing = tinker.UnprocessableEntityError(
        "bad", response=httpx.Response(422, json={"detail": [{"type": "missing", "loc": ["body", "data"]}]},
                                       request=req), body={"detail": [{"type": "missing", "loc": ["body", "data"]}]})
    assert older_api_error(missing, "http://h") is None
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = tinker.UnprocessableEntityError(
        "bad", response=httpx.Response(422, request=req),
        body={"detail": [{"type": "extra_forbidden", "loc": ["body", "loss_fn_config", "beta"]}]})
    assert str(older_api_error(wrapped, "http://h")) == (
        "server at http://h speaks an older Tinker API than the installed SDK 0.38: /api/v1/forward_backward "
        "refuses the request field(s) loss_fn_config.beta (422 extra_forbidden)")


def test_tokenizer_field_loads_a_local_copy_when_the_server_names_a_hub_tokenizer(
        prefect_api, local_credentials, remote_key, tmp_path, capsys):
    from tinker_blocks.credentials import ensure_local_server

    upstream = ensure_local_server(local_credentials)["base_url"]
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub name: offline (HF_HUB_OFFLINE=1) it does not load
    store = tmp_path / "store"
    with OldTinkerServer(upstream, tokenizer_id=hub) as remote:
        try:
            rc, err = _run(capsys, remote.url, store, "run_name=hubtok")
            assert rc == 1 and err.count("\n") == 1, err
            assert err.startswith(f"error: flow 'sft' failed: ValueError: run 'hubtok': the backend's tokenizer for "
                                  f"this model {hub!r} does not load here ("), err
            assert err.rstrip().endswith("give tokenizer=<a local directory of it>"), err
            local_copy = remote.original_tokenizer_id  # the directory the server really uses
            assert local_copy and local_copy != hub
            rc, err = _run(capsys, remote.url, store, "run_name=hubtok", f"tokenizer={local_copy}")
            assert rc == 0, err
        finally:
            _close_clients(remote.url)
    import json

    meta = json.loads(TrainingStore(root=str(store)).get_run("hubtok")["meta_json"])
    assert meta["tokenizer_id"] == local_copy and meta["renderer"] == "chatml"  # resolved from the local copy
