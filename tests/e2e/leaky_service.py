"""A backend that leaks its internals in every error (not part of the product): for the security tests.

`python -m tests.e2e.leaky_service PORT` serves HTTP/1.1 on 127.0.0.1:PORT. `GET /health` and
`GET /__seen` (the requests it was sent: method, path and headers, as JSON) answer 200; every other request answers 500
with a body naming a source file and line, as a llama.cpp server's errors do (LEAK).
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LEAK = "internal error at /srv/engine/src/server.cpp:1234 (token=sk-secret-42)"
SEEN: list[str] = []


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, doc) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _any(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        if self.path in ("/health", "/__seen"):
            return self._send(200, SEEN if self.path == "/__seen" else {"ok": True})
        SEEN.append({"request": self.command + " " + self.path, "headers": {k.lower(): v for k, v in self.headers.items()}})
        self._send(500, {"error": {"message": LEAK, "type": "server_error"}})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any  # noqa: N815

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    print("ready", flush=True)
    server.serve_forever()
