"""Safe downloads of an export listing: hand-crafted listings with unsafe names are refused
before any request, files are written only under a new folder (no link followed), a finished
tree with a symlink or hard link is refused, HTTP errors name the file and never the signed URL;
through the flow, a server answering an unsafe listing leaves nothing at ``out``."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from prefect_tinker.export.download import (
    DownloadError, UnsafeDownloadError, check_listing, check_tree, download_listing,
)

GOOD = "http://127.0.0.1:9/x?sig=abc"


@pytest.mark.parametrize("name", [
    "/etc/passwd", "../adapter_config.json", "base_model/../../x", "a\\b", "C:evil", "a//b", "./a", "a/.",
    "", "a\x00b", "a\nb", "caf\u00e9.json", "a b", "~/x", "a/" * 9 + "b", "x" * 256,
])
def test_unsafe_names_are_refused(name):
    with pytest.raises(UnsafeDownloadError, match="file name"):
        check_listing({"adapter_config.json": GOOD, name: GOOD})


def test_collisions_and_bad_urls_are_refused():
    with pytest.raises(UnsafeDownloadError, match="letter case"):
        check_listing({"Model.safetensors": GOOD, "model.safetensors": GOOD})
    with pytest.raises(UnsafeDownloadError, match="both a file and a folder"):
        check_listing({"base_model": GOOD, "base_model/config.json": GOOD})
    for url in ("file:///etc/passwd", "ftp://host/x", "//host/x", "", None):
        with pytest.raises(UnsafeDownloadError, match="not an http"):
            check_listing({"a.json": url})
    with pytest.raises(UnsafeDownloadError, match="empty"):
        check_listing({})
    ok = {"base_model/tokenizer.json": GOOD, "adapter_model.safetensors": GOOD, ".gitattributes": GOOD,
          "base_model/model-00001-of-00002.safetensors": GOOD, "original/params+v2@1=x.json": GOOD}
    assert list(check_listing(ok)) == sorted(ok)


@pytest.fixture
def http_files(tmp_path):
    """A real HTTP server on 127.0.0.1 serving ``tmp_path/www``; ``/forbidden/...`` answers 403."""
    www = tmp_path / "www"
    (www / "base_model").mkdir(parents=True)
    (www / "adapter_config.json").write_text('{"r": 4}')
    (www / "base_model" / "model.safetensors").write_bytes(os.urandom(3 << 20))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(www), **kw)

        def do_GET(self):
            if self.path.startswith("/forbidden"):
                self.send_error(403, "signature expired")
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_writes_the_listing_under_a_new_folder(http_files, tmp_path):
    www, url = http_files
    listing = {"adapter_config.json": f"{url}/adapter_config.json?sig=s1",
               "base_model/model.safetensors": f"{url}/base_model/model.safetensors?sig=s2"}
    sizes = download_listing(listing, tmp_path / "got")
    assert sizes == {"adapter_config.json": 8, "base_model/model.safetensors": 3 << 20}
    assert (tmp_path / "got" / "base_model" / "model.safetensors").read_bytes() == \
        (www / "base_model" / "model.safetensors").read_bytes()
    assert oct((tmp_path / "got").stat().st_mode & 0o777) == "0o700"
    with pytest.raises(FileExistsError):  # never into an existing folder (it could hold links)
        download_listing(listing, tmp_path / "got")
    with pytest.raises(DownloadError, match=r"'adapter_config.json': HTTP 403") as err:
        download_listing({"adapter_config.json": f"{url}/forbidden/x?expires=1&sig=SECRET"}, tmp_path / "no")
    assert "SECRET" not in str(err.value)
    with pytest.raises(ConnectionError) as err:  # nothing listens on port 9
        download_listing({"a.json": "http://127.0.0.1:9/a.json?sig=SECRET"}, tmp_path / "down")
    assert "SECRET" not in str(err.value)


def test_unsafe_listing_writes_nothing(http_files, tmp_path):
    _, url = http_files
    with pytest.raises(UnsafeDownloadError):
        download_listing({"adapter_config.json": f"{url}/adapter_config.json",
                          "../escaped.json": f"{url}/adapter_config.json"}, tmp_path / "dl")
    assert not (tmp_path / "dl").exists() and not (tmp_path / "escaped.json").exists()


def test_trees_with_links_are_refused(tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.json").write_text("{}")
    assert check_tree(tree) == ["sub/a.json"]
    (tree / "link").symlink_to("/etc/passwd")
    with pytest.raises(UnsafeDownloadError, match="symlink"):
        check_tree(tree)
    (tree / "link").unlink()
    os.link(tree / "sub" / "a.json", tmp_path / "outside.json")
    with pytest.raises(UnsafeDownloadError, match="hard link"):
        check_tree(tree)
    (tmp_path / "outside.json").unlink()
    os.mkfifo(tree / "pipe")
    with pytest.raises(UnsafeDownloadError, match="not a regular file"):
        check_tree(tree)


def test_flow_refuses_a_hand_crafted_listing_from_the_server(prefect_api, tmp_path, monkeypatch):
    from prefect_tinker.flows.export import ExportConfig, export_flow
    from prefect_tinker.export import server

    asked = []

    def fake(credentials, checkpoint, *, wait, ttl_s=None):
        asked.append(checkpoint)
        return server.ServerExport(checkpoint, checkpoint, "tinker://r/sampler_weights/n", "tinker://r/external_weights/n",
                                   "tiny", 4, {"adapter_config.json": GOOD, "/tmp/evil": GOOD}, "2030-01-01T00:00:00")

    monkeypatch.setattr(server, "export_on_server", fake)
    out = tmp_path / "out"
    with pytest.raises(UnsafeDownloadError, match="'/tmp/evil' is absolute"):
        export_flow(ExportConfig(checkpoint="tinker://r/weights/n", format="peft", out=str(out),
                                 backend={"local_root": str(tmp_path / "root")}))
    assert asked and not out.exists() and not list(Path(tmp_path).glob(".out.export-*"))
