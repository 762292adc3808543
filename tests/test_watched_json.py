"""The server's watched JSON files (API keys, model allow-list): an edit by another process is seen
on the next read, a removed file reads as ``{}``, a write is whole and keeps the file's mode."""

import json
import os
import stat

from tinker_local.keys import KeyStore, keys_file
from tinker_local.watched_json import WatchedJson


def test_edits_removal_and_writes_are_seen(tmp_path):
    path = tmp_path / "server" / "doc.json"
    doc = WatchedJson(path, mode=0o600)
    assert doc.load_if_changed() == (True, {})  # missing: the empty document, read once
    assert doc.load_if_changed() == (False, None)
    doc.write({"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and os.listdir(path.parent) == ["doc.json"]
    assert doc.load_if_changed() == (True, {"a": 1}) and doc.load_if_changed() == (False, None)
    path.write_text(json.dumps({"a": 1, "b": 22}))  # another process edits it (the size changes)
    assert doc.load_if_changed() == (True, {"a": 1, "b": 22})
    path.unlink()
    assert doc.load_if_changed() == (True, {})


def test_a_key_added_by_another_process_is_known_at_once(tmp_path):
    server, admin = KeyStore(tmp_path), KeyStore(tmp_path)  # the running server and the admin's command
    assert server.entries() == []
    key = admin.add("alice")
    assert [e.name for e in server.entries()] == ["alice"] and server.lookup(key).name == "alice"
    assert stat.S_IMODE(keys_file(tmp_path).stat().st_mode) == 0o600
    admin.revoke("alice")
    assert server.entries() == [] and server.lookup(key) is None
