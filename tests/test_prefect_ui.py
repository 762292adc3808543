"""The persistent local Prefect server with its UI (prefect_tinker/cli/prefect_server.py, ``prefect-tinker ui``).

A real ``prefect-tinker run`` in a throw-away HOME starts the server; the link it prints answers while
the run goes on and, after the command ended, opens the run in headless Chromium (Debian's package), with
the run's progress and curve artifacts on its Artifacts tab and the curves picture on the artifact's page.
What the pages show is checked against the API and the training store. ``ui status`` / ``ui`` / ``ui stop``
then act on that server, and nothing of it is left running afterwards.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from prefect_tinker.cli import main as cli
from prefect_tinker.cli.prefect_server import (
    ensure_prefect_server,
    prefect_server_folder,
    prefect_server_status,
    run_api,
    stop_prefect_server,
)
from tinker_local.procs import pid_alive

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LINK = re.compile(r"View at (http://127\.0\.0\.1:(\d+))/runs/flow-run/([0-9a-f-]{36})")


def _api(method: str, url: str, body: dict | None = None):
    """One call of the Prefect REST API; a 503 (SQLite busy, e.g. just after start-up) is retried
    for up to 30 s, as Prefect's own client does."""
    data = json.dumps(body).encode() if body is not None else None
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def _chromium(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The DOM of ``url`` after its scripts ran (10 s of virtual time) as text, and its screenshot."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,1000", "--hide-scrollbars",
           "--virtual-time-budget=10000", "--dump-dom"]
    if screenshot is not None:
        cmd.append(f"--screenshot={screenshot}")
    # headless Chromium now and then never ends its virtual time on a loaded machine (a page still
    # waiting on the API when the budget runs out): one more try before the run counts as failed
    for attempt in (1, 2):
        try:
            res = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=90, cwd=profile)
            break
        except subprocess.TimeoutExpired:
            if attempt == 2:
                raise
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def _text(dom: str) -> str:
    """The visible text of a DOM dump, whitespace collapsed."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def _not_blank(png: Path) -> int:
    """Distinct colours of a screenshot (a blank or error page has a handful)."""
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (1400, 1000)
        return len(im.convert("RGB").getcolors(maxcolors=1 << 20) or [])


@pytest.fixture
def ui_env(tmp_path):
    """A throw-away HOME (so the default state folder ~/.prefect-tinker is its own) with the
    persistent server on; the Prefect server started there is stopped at the end."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_TINKER_UI")}
    env.update(HOME=str(home), PREFECT_HOME=str(home / ".prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONUNBUFFERED="1")
    root = home / ".prefect-tinker"
    yield env, root
    stop_prefect_server(root, timeout=5.0)  # after a failure; a passing test stopped it with `ui stop`


@pytest.mark.browser
# the run may take up to its 300 s wait on a loaded machine (CI runs three suites at once; a run of ~177 s
# once left Chromium no time under a 180 s limit), then up to two Chromium tries of 90 s each
@pytest.mark.timeout(540)
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (scripts/setup.sh installs Debian's chromium as root)")
def test_printed_link_shows_the_run_and_its_artifacts_in_chromium(ui_env, local_credentials, tmp_path, capsys):
    env, root = ui_env
    store, run_name = tmp_path / "store", "ui-probe"
    # save_every=1: two checkpoints, two reports, which must update one card of each kind, not add a second
    cmd = [str(Path(sys.executable).parent / "prefect-tinker"), "run", "sft", "--example", "tiny", "max_steps=2",
           "eval_every=0", "save_every=1", "num_eval_samples=0", f"run_name={run_name}", f"store={store}",
           f"backend.local_root={local_credentials.resolved_local_root()}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines, link = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if link is None and (m := LINK.search(line)):
                link = m
                # during the run: the link's page is served and the API has the run
                req = urllib.request.Request(m.group(0)[len("View at "):], headers={"Accept": "text/html"})
                with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                    assert resp.status == 200 and b"<html" in resp.read(2000).lower()
                state = _api("GET", f"{m.group(1)}/api/flow_runs/{m.group(3)}")["state_type"]
                assert state in ("PENDING", "RUNNING"), state
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    run_s = time.monotonic() - t0
    out = "".join(lines)
    assert link is not None, out[-3000:]
    ui_url, port, flow_run_id = link.group(1), int(link.group(2)), link.group(3)
    assert "Started the local Prefect server with its UI at " + ui_url in out

    # the server outlives the command: recorded under the HOME's state folder, alive, healthy
    status = prefect_server_status(root)
    assert status and status["running"] and status["healthy"] and status["port"] == port, status
    assert Path(status["home"]) == prefect_server_folder(root) / "home"
    assert (Path(status["home"]) / "prefect.db").exists()

    # what the UI will show, from the API: the finished run, its progress at 100 %, its curves (the PNG the
    # task also wrote to the store), its metrics table (the store's newest values), the checkpoint it printed
    # as a materialized asset and the dataset it read as a referenced one (the run's lineage)
    api = ui_url + "/api"
    assert _api("GET", f"{api}/flow_runs/{flow_run_id}")["state_type"] == "COMPLETED"
    artifacts = _api("POST", f"{api}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    keys = [a["key"] for a in artifacts]
    assert None not in keys and len(set(keys)) == len(keys), keys  # every card labelled, none twice
    by_key = {a["key"]: a for a in artifacts}
    assert set(by_key) == {f"sft-{run_name}{what}" for what in ("", "-progress", "-metrics", "-curves")}
    assert by_key[f"sft-{run_name}-progress"]["data"] == 100.0
    assert by_key[f"sft-{run_name}-progress"]["description"] == f"SFT {run_name}: steps done of 2"
    assert by_key[f"sft-{run_name}-metrics"]["description"] == (
        f"SFT run `{run_name}`: latest value of every metric at step 2")  # the second report, in place
    assert by_key[f"sft-{run_name}-curves"]["description"] == f"SFT run `{run_name}`: curves at step 2"
    curves = by_key[f"sft-{run_name}-curves"]
    png_b64 = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", curves["data"]).group(1)
    assert base64.b64decode(png_b64) == (store / "reports" / run_name / "curves.png").read_bytes()
    from tinker_blocks.stores import TrainingStore

    newest = TrainingStore(root=str(store)).query(
        "SELECT arg_max(value, step) AS v FROM metrics WHERE run_id = ? AND name = 'train/loss'", [run_name])[0]["v"]
    table = json.loads(by_key[f"sft-{run_name}-metrics"]["data"])
    assert next(r["value"] for r in table if r["metric"] == "train/loss") == pytest.approx(newest, rel=1e-5)
    result, _ = json.JSONDecoder().raw_decode(out, out.index("\n{") + 1)  # the JSON the command printed
    events = _api("POST", f"{api}/events/filter", {"filter": {"event": {"prefix": ["prefect.asset."]}, "any_resource": {
        "id": [f"prefect.flow-run.{flow_run_id}"]}}, "limit": 50})["events"]
    assets = {(e["event"], e["resource"]["prefect.resource.id"]) for e in events}
    assert ("prefect.asset.materialization.succeeded", result["checkpoints"][-1]) in assets, assets
    assert any(e == "prefect.asset.referenced" and r.endswith("example_chat.jsonl") for e, r in assets), assets

    # the printed link in Chromium after the command ended: the run's page (Prefect's default UI for a
    # deep link) with its graph and the Artifacts tab
    profile = tmp_path / "chromium"
    profile.mkdir()
    t1 = time.monotonic()
    page = _text(_chromium(f"{ui_url}/runs/flow-run/{flow_run_id}", profile, tmp_path / "flow-run.png"))
    assert f"sft-{run_name}" in page and "Completed" in page and "Artifacts" in page, page[:2000]
    # its Artifacts tab (the V2 UI keeps the tab in the URL): the progress and the curves among the cards
    shot = tmp_path / "flow-run-artifacts.png"
    page = _text(_chromium(f"{ui_url}/v2/runs/flow-run/{flow_run_id}?tab=Artifacts", profile, shot))
    for shown in ("PROGRESS", f"sft-{run_name}-progress", f"SFT {run_name}: steps done of 2",
                  f"sft-{run_name}-curves", f"sft-{run_name}-metrics"):
        assert page.count(shown) == 1, (shown, page[:3000])  # one card each
    assert re.search(rf"SFT run {run_name} ?: curves at step 2", page), page[:3000]
    # the curves artifact's page renders the markdown: the title and the very PNG as an <img>
    dom = _chromium(f"{ui_url}/v2/artifacts/artifact/{curves['id']}", profile, tmp_path / "curves.png")
    assert re.search(rf"SFT run {run_name} ?: curves at step 2", _text(dom)), _text(dom)[:3000]  # `{run}` in <code>
    assert f'src="data:image/png;base64,{png_b64}"' in dom
    browser_s = time.monotonic() - t1
    assert _not_blank(shot) > 100 and _not_blank(tmp_path / "curves.png") > 100

    # ui status / ui (reuses the server: same pid, same URL) / ui stop
    assert cli.main(["ui", "status", "--root", str(root)]) == 0
    assert f"running: {ui_url} (healthy), pid {status['pid']}" in capsys.readouterr().out
    res = subprocess.run([cmd[0], "ui", "--no-browser"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == ui_url + "\n" and "started" not in res.stderr, res
    assert cli.main(["ui", "stop", "--root", str(root)]) == 0
    assert f"stopped the local Prefect server pid {status['pid']} ({ui_url}); database kept" in capsys.readouterr().out
    assert not pid_alive(status["pid"])
    with pytest.raises(ProcessLookupError):  # nothing left in its process group either
        os.killpg(status["pid"], 0)
    assert cli.main(["ui", "status", "--root", str(root)]) == 1
    print(f"\nrun (server start included) {run_s:.1f} s, server ready in {status['startup_s']:.1f} s, "
          f"3 Chromium pages {browser_s:.1f} s; screenshots in {tmp_path}", file=sys.stderr)


def test_a_server_of_another_prefect_is_replaced_unless_runs_use_it(tmp_path):
    """A recorded server of another Prefect version is refused in one line while a flow run on it is
    RUNNING, and replaced (new process, same port) once that run finished."""
    from prefect_tinker.cli.prefect_server import PrefectServerError

    first = ensure_prefect_server(tmp_path)
    try:
        api = first["api_url"]
        flow = _api("POST", f"{api}/flows/", {"name": "probe"})
        run = _api("POST", f"{api}/flow_runs/", {"flow_id": flow["id"], "state": {"type": "PENDING"}})
        running = _api("POST", f"{api}/flow_runs/{run['id']}/set_state", {"state": {"type": "RUNNING"}})
        assert running["status"] == "ACCEPT"
        record_file = prefect_server_folder(tmp_path) / "server.json"
        record = json.loads(record_file.read_text())
        real = record["identity"]["prefect"]
        record["identity"]["prefect"] = "3.0.0"  # as if started before an upgrade
        record_file.write_text(json.dumps(record))
        with pytest.raises(PrefectServerError, match=rf"^the local Prefect server {first['ui_url']} \(pid "
                           rf"{first['pid']}\) runs another Python or Prefect \(prefect 3\.0\.0 -> {re.escape(real)}\) "
                           r"and 1 flow run\(s\) on it are RUNNING"):
            ensure_prefect_server(tmp_path)
        assert pid_alive(first["pid"])
        _api("POST", f"{api}/flow_runs/{run['id']}/set_state", {"state": {"type": "COMPLETED"}})
        second = ensure_prefect_server(tmp_path)
        assert second["started"] and second["replaced"] == f"prefect 3.0.0 -> {real}"
        assert second["pid"] != first["pid"] and not pid_alive(first["pid"]) and second["port"] == first["port"]
        assert _api("GET", f"{api}/flow_runs/{run['id']}")["state_type"] == "COMPLETED"  # the same database
    finally:
        stop_prefect_server(tmp_path)


def test_a_users_prefect_api_url_wins(tmp_path, monkeypatch, capsys):
    """With PREFECT_API_URL set, runs report there and ``ui`` shows that server's UI: nothing starts."""
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.delenv("PREFECT_TINKER_UI", raising=False)
    with run_api(tmp_path) as url:
        assert url is None
    assert cli.main(["ui", "--no-browser", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "http://127.0.0.1:9\n"
    assert not prefect_server_folder(tmp_path).exists()
    assert cli.main(["ui", "status", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "no local Prefect server recorded" in out and "runs report to that server (http://127.0.0.1:9)" in out


def test_stop_never_kills_a_process_that_reused_the_recorded_pid(tmp_path, capsys):
    """A record whose pid now belongs to another process (another start time) is stale: ``ui stop``
    removes it and leaves that process alone; ``ui status`` says it is not running."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        folder = prefect_server_folder(tmp_path)
        folder.mkdir(parents=True)
        record = {"pid": other.pid, "start_ticks": 1, "port": 9, "api_url": "http://127.0.0.1:9/api",
                  "ui_url": "http://127.0.0.1:9", "home": str(folder / "home"), "log": str(folder / "server.log")}
        (folder / "server.json").write_text(json.dumps(record))
        assert cli.main(["ui", "status", "--root", str(tmp_path)]) == 1
        assert capsys.readouterr().out.startswith(f"not running: recorded pid {other.pid} (http://127.0.0.1:9)")
        assert cli.main(["ui", "stop", "--root", str(tmp_path)]) == 0
        assert "was not running; removed its stale record" in capsys.readouterr().out
        assert other.poll() is None and not (folder / "server.json").exists()
    finally:
        other.kill()
        other.wait()


def test_a_port_in_use_is_one_clear_error(tmp_path):
    import socket

    from prefect_tinker.cli.prefect_server import PrefectServerError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PrefectServerError, match=rf"^port {port} of 127\.0\.0\.1 is taken; set "
                                                     r"PREFECT_TINKER_UI_PORT to another port$"):
            ensure_prefect_server(tmp_path, port=port)
    assert not (prefect_server_folder(tmp_path) / "server.json").exists()
