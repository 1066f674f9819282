"""A small REST service for the tool and rest routes' end-to-end tests (not part of the product).

Serves the petstore contract (tests/data/openapi/petstore.yaml, base path /v1) and a legacy order
contract (snake_case, Unix seconds, one-letter status codes) from memory. Run:
`python tests/e2e/petstore_service.py PORT`.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PETS = {"1": {"id": 1, "name": "Rex", "tag": "dog"}, "2": {"id": 2, "name": "Tom", "tag": "cat"}}
ORDERS: dict = {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, status, doc, extra=()):
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        n = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def do_GET(self):  # noqa: N802
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if url.path == "/v1/pets":
            limit = int(parse_qs(url.query).get("limit", ["100"])[0])
            return self._send(200, list(PETS.values())[:limit], [("x-next", "none")])
        if parts[:2] == ["v1", "pets"] and len(parts) == 3:
            pet = PETS.get(parts[2])
            return self._send(200, pet) if pet else self._send(404, {"code": 404, "message": f"no pet {parts[2]}"})
        if parts[:1] == ["orders"] and len(parts) == 2 and parts[1] in ORDERS:
            return self._send(200, ORDERS[parts[1]])
        if url.path == "/":
            return self._send(200, {"ok": True})
        self._send(404, {"code": 404, "message": "not found"})

    def do_POST(self):  # noqa: N802
        doc = self._body()
        if self.path == "/v1/pets":
            PETS[str(doc["id"])] = doc
            return self._send(201, doc, [("location", f"/v1/pets/{doc['id']}")])
        if self.path == "/orders":
            assert set(doc) == {"order_id", "created_ts", "status_cd"}, doc  # the legacy contract only
            ORDERS[doc["order_id"]] = dict(doc, status_cd="C")  # the service closes it
            return self._send(201, ORDERS[doc["order_id"]])
        self._send(404, {"code": 404, "message": "not found"})

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
