"""A small real HTTP server answering like a Tinker server written for an older SDK, for tests.

``OldTinkerServer(upstream, ...)`` listens on 127.0.0.1 and forwards every request to ``upstream``
(a live ``tinker_local``; None: answers 404 to everything it does not answer itself), except what
it is told to answer as an older server would:

- ``no_client_config``: ``POST /api/v1/client/config`` -> 404 ``{"detail": "Not Found"}`` (a server
  that predates the endpoint);
- ``strict_fields``: a JSON request body with one of these fields -> 422 with FastAPI's
  ``extra_forbidden`` errors (a server validating bodies against its older schema);
- ``tokenizer_id``: ``get_info`` answers with this ``model_data.tokenizer_id`` (a hub name, as
  remote servers report) instead of upstream's; upstream's is kept in ``original_tokenizer_id``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


class OldTinkerServer:
    def __init__(self, upstream: str | None, *, no_client_config: bool = False,
                 strict_fields: tuple[str, ...] = (), tokenizer_id: str | None = None):
        self.upstream, self.no_client_config = upstream, no_client_config
        self.strict_fields, self.tokenizer_id = strict_fields, tokenizer_id
        self.original_tokenizer_id: str | None = None
        self.refused: list[str] = []  # paths answered 404 / 422 as an older server
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                outer._handle(self, "GET")

            def do_POST(self) -> None:
                outer._handle(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.client = httpx.Client(timeout=120)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()

    def __enter__(self) -> OldTinkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]) -> None:
        h.send_response(status)
        for k, v in headers.items():
            if k.lower() not in _HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
        self._send(h, status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        path = h.path.split("?", 1)[0]
        if self.no_client_config and path == "/api/v1/client/config":
            self.refused.append(path)
            return self._json(h, 404, {"detail": "Not Found"})
        if self.strict_fields and "json" in (h.headers.get("Content-Type") or ""):
            try:
                sent = json.loads(body or b"{}")
            except ValueError:
                sent = {}
            extra = [f for f in self.strict_fields if isinstance(sent, dict) and f in sent]
            if extra:
                self.refused.append(path)
                return self._json(h, 422, {"detail": [
                    {"type": "extra_forbidden", "loc": ["body", f], "msg": "Extra inputs are not permitted",
                     "input": sent[f]} for f in extra]})
        if self.upstream is None:
            return self._json(h, 404, {"detail": "Not Found"})
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("host", "content-length")}
        resp = self.client.request(method, self.upstream + h.path, content=body, headers=headers)
        content = resp.content  # decoded (httpx undoes a Content-Encoding)
        if (self.tokenizer_id is not None and b'"tokenizer_id"' in content
                and "json" in resp.headers.get("content-type", "")):
            data = resp.json()
            info = data.get("model_data") if isinstance(data, dict) else None
            if isinstance(info, dict) and "tokenizer_id" in info:
                self.original_tokenizer_id = info["tokenizer_id"]
                info["tokenizer_id"] = self.tokenizer_id
                content = json.dumps(data).encode()
        self._send(h, resp.status_code, content, dict(resp.headers))
