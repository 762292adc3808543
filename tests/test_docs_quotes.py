"""What the documentation quotes is what the code does: every message docs/progress.md shows in its
error and Ctrl-C sections is produced here by the code (the CLI's own lines by running it, on the files
the examples name) and compared character for character; the getting-started recipe table lists every
registered recipe."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from prefect_tinker.cli import main as cli
from tests.conftest import ROOT
from tests.old_tinker_server import OldTinkerServer

DOCS = ROOT / "docs"
GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def _quoted(text: str, start: str, end: str) -> list[str]:
    """The lines of the ```text blocks between headings ``start`` and ``end``."""
    part = text.split(start, 1)[1].split(end, 1)[0]
    return [ln for block in re.findall(r"```text\n(.*?)```", part, flags=re.S) for ln in block.splitlines()]


def _cli_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


def _real_lines(tmp_path, capsys) -> list[str]:
    """Each quoted message, made by the code."""
    lines = []
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(GOOD) + '\n{"messages": [broken\n')
    lines.append(_cli_error(capsys, ["run", "sft", "dataset=chats.jsonl", "model=tiny", "store=./store"]))
    chats.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + '\n{"msgs": []}\n')
    lines.append(_cli_error(capsys, ["run", "sft", "dataset=chats.jsonl", "model=tiny", "store=./store"]))
    lines.append(_cli_error(capsys, ["run", "sft", "dataset=chats.jsonl", "model=tiny", "format=nosuch",
                                     "store=./store"]))
    (tmp_path / "store").mkdir()
    lines.append(_cli_error(capsys, ["run", "distill", "--example", "on_policy", "teacher=run:sft-teacher",
                                     "store=./store"]))

    from prefect_tinker.flows.resume_checks import ResumeConfigError, check_same_recipe
    from tinker_blocks.server_api import OlderServerAPIError, check_server_api, older_api_error

    with pytest.raises(ResumeConfigError) as refused:
        check_same_recipe("intr2", {"recipe": "sft"}, "dpo")
    lines.append(f"error: flow 'dpo' failed: ResumeConfigError: {refused.value}")
    with OldTinkerServer(None, no_client_config=True) as old, pytest.raises(OlderServerAPIError) as older:
        check_server_api(old.url, "tml-x")
    lines.append(f"error: flow 'sft' failed: OlderServerAPIError: {older.value}".replace(old.url, "http://gpu-box:8000"))
    import tinker

    body = {"detail": [{"type": "extra_forbidden", "loc": ["body", "optimizer_config"]}]}
    refused_field = tinker.UnprocessableEntityError(
        "422", body=body,
        response=httpx.Response(422, json=body, request=httpx.Request("POST", "http://gpu-box:8000/api/v1/create_model")))
    lines.append(f"error: flow 'sft' failed: OlderServerAPIError: {older_api_error(refused_field, 'http://gpu-box:8000')}")

    from prefect_tinker.flows.interrupts import RunInterrupted

    lines += [str(RunInterrupted("intr", 8, 8)), str(RunInterrupted("intr", 9, 8))]
    return lines


def test_progress_md_quotes_the_messages_the_code_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quoted lines name chats.jsonl and ./store, relative
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing here may talk to Prefect
    text = (DOCS / "progress.md").read_text()
    quoted = _quoted(text, "## Errors before anything starts", "## The embedded server is never stale")
    real = _real_lines(tmp_path, capsys)
    # logged, not raised: the session's own words, as the interrupt test reads them from the log
    session_source = (ROOT / "prefect_tinker" / "flows" / "session.py").read_text()
    logged = "no checkpoint of run 'intr' yet: starting at step 1"
    assert '"no checkpoint of run %r yet: starting at step 1"' in session_source
    assert sorted(quoted) == sorted([*real, logged]), "\n".join(sorted(set(quoted) ^ {*real, logged}))

    # the stale-server refusals (sessions in use; cannot tell): the launcher's message parts, each
    # {field} filled in any way ("(...)" in the docs stands for the change)
    source = (ROOT / "tinker_local" / "launcher.py").read_text()
    strings = dict(re.findall(r'(where|then) = f?"([^"]*)"', source))
    busy = re.search(r'f"\{where\}( and \{busy\}[^"]*)\{then\}"', source).group(1)
    unknown = "".join(re.findall(r'f"(?:\{where\})?( and it cannot tell[^"]*|when nothing uses it, )', source))

    def pattern(middle: str) -> str:
        p = re.escape(strings["where"] + middle + strings["then"])
        return re.sub(r"\\\{[^}]*\\\}", ".+", p)

    stale = _quoted(text, "## The embedded server is never stale", "## Hermetic tests")
    assert len(stale) == 2, stale
    assert re.fullmatch(pattern(busy), stale[0]), (busy, stale[0])
    assert re.fullmatch(pattern(unknown), stale[1]), (unknown, stale[1])


def test_getting_started_lists_every_recipe():
    from prefect_tinker.flows.registry import recipes

    text = (DOCS / "getting-started.md").read_text().split("## Recipes", 1)[1].split("\n\n", 2)[1]
    listed = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(recipes()), listed
