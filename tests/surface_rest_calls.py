"""Calls of the SDK surface walk (tests/test_local_surface.py): one handler per public method of
``RestClient``; each calls its method against the local server and checks the answer (hosted-account
features: the refusal names the feature)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import warnings

from pathlib import Path

import pytest

import tinker
from tinker import types

from tests.surface_client_calls import KEY, Ctx, _sample_tokens, copy_weights_checks, get_telemetry


def rc_assign_session_project(c: Ctx):
    sc = tinker.ServiceClient(base_url=c.server.base_url, api_key=KEY)
    sc.create_sampling_client(base_model=c.model).result(timeout=60)
    sid = sc.holder.get_session_id()
    c.rc.assign_session_project(sid, "proj-moved").result(timeout=30)
    found = c.rc.search_sessions(types.SessionSearchRequest(project_ids=["proj-moved"])).result(timeout=30)
    assert [s.session_id for s in found.sessions] == [sid]
    sc.close("success").result(timeout=30)


def rc_copy_weights(c: Ctx):
    copy_weights_checks(c, c.rc.copy_weights(c.state, "proj-archive").result(timeout=60), "proj-archive")


def _throwaway_checkpoint(c: Ctx, name: str) -> str:
    return c.tc.save_weights_for_sampler(name).result(timeout=60).path


def rc_delete_checkpoint(c: Ctx):
    path = _throwaway_checkpoint(c, "to-delete")
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    folder = Path(c.server.service.registry.checkpoints[path].path)
    c.rc.delete_checkpoint(parsed.training_run_id, parsed.checkpoint_id).result(timeout=30)
    assert c.checkpoint(path) is None and not folder.exists()


def rc_delete_checkpoint_from_tinker_path(c: Ctx):
    path = _throwaway_checkpoint(c, "to-delete-2")
    c.rc.delete_checkpoint_from_tinker_path(path).result(timeout=30)
    assert c.checkpoint(path) is None
    with pytest.raises(tinker.NotFoundError):
        c.sc.create_sampling_client(model_path=path).result(timeout=60)


def rc_export_session_trace(c: Ctx):
    _sample_tokens(c.sampler, c)
    url = c.rc.export_session_trace(c.session_id).result(timeout=60)
    trace = json.loads(urllib.request.urlopen(url, timeout=30).read())
    reqs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in reqs}
    assert {"create_model", "forward_backward", "optim_step", "save_weights", "sample"} <= names
    assert all(e["dur"] >= 0 and e["ts"] > 1.6e15 and e["args"]["request_id"] for e in reqs)


def _refused(call, words: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(tinker.PermissionDeniedError) as e:
            call().result(timeout=30)
    assert words in str(e.value) and "hosted Tinker accounts" in str(e.value)


def rc_get_audit_log(c: Ctx):
    # a server without keys has one user, "local", who may read the audit log
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        log = c.rc.get_audit_log().result(timeout=30)
    events = {e.event for e in log.entries}
    assert {"session_create", "model_create", "checkpoint_save"} <= events
    assert all(e.event_details["user"] == "local" for e in log.entries)


def rc_get_billing_usage(c: Ctx):
    _refused(lambda: c.rc.get_billing_usage("2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"), "billing")


def rc_get_current_checkpoint_storage_usage(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        usage = c.rc.get_current_checkpoint_storage_usage(project_id="proj-surface").result(timeout=30)
    reg = c.server.service.registry
    mine = [ck for ck in reg.checkpoints.values()
            if c.server.service.project_of(reg.runs[ck.model_id]) == "proj-surface"]
    assert len(usage.data) == 1 and usage.data[0].checkpoint_count == len(mine)
    assert usage.data[0].size_bytes == sum(ck.size_bytes for ck in mine) > 0


def rc_get_external_weights_urls(c: Ctx):
    path = c.tc.save_weights_external("surface-urls").result(timeout=60).path
    urls = c.rc.get_external_weights_urls(path).result(timeout=30)
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model/config.json"} <= set(urls.urls)
    cfg = json.loads(urllib.request.urlopen(urls.urls["adapter_config.json"], timeout=30).read())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"


def rc_get_sampler(c: Ctx):
    s = c.rc.get_sampler(c.sampler._sampling_session_id).result(timeout=30)
    assert s.base_model == c.model and s.model_path == c.sampler_path


def rc_get_server_capabilities(c: Ctx):
    caps = c.rc.get_server_capabilities().result(timeout=30)
    assert {m.model_name: m.max_context_length for m in caps.supported_models}[c.model] == 512


def rc_get_session(c: Ctx):
    s = c.rc.get_session(c.session_id).result(timeout=30)
    assert c.tc.model_id in s.training_run_ids and s.user_metadata == {"suite": "surface"}
    assert s.display_name == "surface walk" and c.sampler._sampling_session_id in s.sampler_ids


def rc_get_training_run(c: Ctx):
    run = c.rc.get_training_run(c.tc.model_id).result(timeout=30)
    assert (run.base_model, run.lora_rank, run.is_lora) == (c.model, 4, True)


def rc_get_training_run_by_tinker_path(c: Ctx):
    assert c.rc.get_training_run_by_tinker_path(c.state).result(timeout=30).training_run_id == c.tc.model_id


def rc_get_weights_info_by_tinker_path(c: Ctx):
    info = c.rc.get_weights_info_by_tinker_path(c.state).result(timeout=30)
    assert (info.base_model, info.lora_rank, info.is_lora) == (c.model, 4, True)


def rc_list_checkpoints(c: Ctx):
    cks = {ck.tinker_path: ck for ck in c.rc.list_checkpoints(c.tc.model_id).result(timeout=30).checkpoints}
    assert cks[c.state].checkpoint_type == "training" and cks[c.sampler_path].checkpoint_type == "sampler"


def rc_list_sessions(c: Ctx):
    assert c.session_id in c.rc.list_sessions(limit=100).result(timeout=30).sessions


def rc_list_training_runs(c: Ctx):
    runs = c.rc.list_training_runs(limit=100, project_id="proj-surface").result(timeout=30).training_runs
    assert c.tc.model_id in [r.training_run_id for r in runs]
    assert c.rc.list_training_runs(project_id="no-such-project").result(timeout=30).training_runs == []


def rc_list_user_checkpoints(c: Ctx):
    page = c.rc.list_user_checkpoints(limit=100).result(timeout=30)
    times = [ck.time for ck in page.checkpoints]
    assert c.state in [ck.tinker_path for ck in page.checkpoints] and times == sorted(times, reverse=True)


def rc_publish_checkpoint_from_tinker_path(c: Ctx):
    c.rc.publish_checkpoint_from_tinker_path(c.sampler_path).result(timeout=30)
    assert c.checkpoint(c.sampler_path).public is True


def rc_unpublish_checkpoint_from_tinker_path(c: Ctx):
    c.rc.publish_checkpoint_from_tinker_path(c.state).result(timeout=30)
    c.rc.unpublish_checkpoint_from_tinker_path(c.state).result(timeout=30)
    assert c.checkpoint(c.state).public is False


def rc_search_sessions(c: Ctx):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        page = c.rc.search_sessions(types.SessionSearchRequest(display_name="SURFACE walk")).result(timeout=30)
        assert [s.session_id for s in page.sessions] == [c.session_id]
        s = page.sessions[0]
        assert s.project_id == "proj-surface" and s.status.type == "active" and s.checkpoints_count >= 2
        by_meta = c.rc.search_sessions(types.SessionSearchRequest(user_metadata={"suite": "nope"})).result(timeout=30)
        assert by_meta.sessions == []
        # paging: one session per page, newest first, until next_cursor is None
        seen, req = [], types.SessionSearchRequest(limit=1, owner=types.AccessibleSearchOwner())
        while True:
            page = c.rc.search_sessions(req).result(timeout=30)
            seen += [x.session_id for x in page.sessions]
            if page.next_cursor is None:
                break
            req = req.model_copy(update={"cursor": page.next_cursor})
    assert seen == c.rc.list_sessions(limit=1000).result(timeout=30).sessions


def rc_set_checkpoint_ttl_from_tinker_path(c: Ctx):
    path = _throwaway_checkpoint(c, "ttl")
    c.rc.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=30)
    assert c.checkpoint(path).expires_at is not None
    c.rc.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=30)
    assert c.checkpoint(path).expires_at is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        c.rc.set_checkpoint_ttl_from_tinker_path(path, 60).result(timeout=30)


def rc_whoami(c: Ctx):
    with pytest.raises(RuntimeError, match="JWT auth"):  # raised by the SDK: no JWT without JWT auth
        c.rc.whoami().result(timeout=30)


def rc_get_telemetry(c: Ctx):
    get_telemetry(c.rc)
