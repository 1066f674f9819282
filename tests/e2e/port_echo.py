"""A tiny upstream for Envoy tests: answers every request with its own port, and counts them.

`python -m tests.e2e.port_echo PORT` serves HTTP/1.1 on port PORT of 127.0.0.1 (and ::1). Any path answers
`{"port": P, "path": ..., "destination": <x-gateway-destination-endpoint or null>}`;
`GET /__count` answers `{"count": N}`, the number of other requests served (so a test can tell
which endpoint Envoy picked without trusting Envoy's own stats).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _DualStack(ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve(port: int) -> None:
    lock = threading.Lock()
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

        def _answer(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            if n:
                self.rfile.read(n)
            if self.path == "/__count":
                body = {"count": count[0]}
            else:
                with lock:
                    count[0] += 1
                body = {"port": port, "path": self.path,
                        "destination": self.headers.get("x-gateway-destination-endpoint")}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    try:  # both 127.0.0.1 and ::1, so a host name resolving to either reaches it
        server: ThreadingHTTPServer = _DualStack(("::", port), Handler)
    except OSError:
        server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
