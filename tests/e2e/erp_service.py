"""A small ERP service for the erp adapter's tests and benchmark (not part of the product).

A real HTTP server (threads, HTTP/1.1 keep-alive) with an in-memory order store, implementing the
REST calls examples/erp-adapter.yaml maps the order-to-cash service tasks to, and the instance
protocol of docs/erp-adapter.md:
- `POST /orders` `{"id"?, "customer", "amount", "sku", "quantity"}` -> 201, a new order whose
  process instance is at the start event (`position: ["StartEvent_OrderReceived"]`, `version: 0`);
- `GET /orders/{id}` -> the order (status, credit, reservation, shipment, invoice);
- `GET /instances/{id}` -> `{"position", "version"}`; `POST /instances/{id}/advance`
  `{"version", "task", "position"}` -> 200 `{"position", "version"}` (version + 1), or 409 when
  `version` is not the current one (someone else moved the instance); a person completing a user task
  uses the same call;
- the actions, each 404 for an unknown order: `POST /orders/{id}/credit-check` (approved when the
  amount is at most the customer's limit, 1000 unless `{"limit"}` was given at creation),
  `POST /orders/{id}/reservations` `{"warehouse", "quantity"}` (409 unless the credit was approved: the
  service's own rule, whatever the process allows), `POST /orders/{id}/rejection` `{"reason"}`,
  `POST /orders/{id}/shipments` `{"carrier"}`, `POST /orders/{id}/invoices` `{"due_days"}`,
  `POST /orders/{id}/close` (500 with a fake stack trace when the order was created with `"fail_close": true`);
- `GET /calls` -> the action calls received (method, path, body), in order; `GET /health`.
Run: `python tests/e2e/erp_service.py PORT`.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ACTION = re.compile(r"^/orders/([^/]+)/(credit-check|reservations|rejection|shipments|invoices|close)$")
START = ["StartEvent_OrderReceived"]


class Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.orders: dict[str, dict] = {}
        self.instances: dict[str, dict] = {}
        self.calls: list[dict] = []
        self.next = 1000


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # one write per response, TCP_NODELAY: headers and body written apart on a keep-alive connection
    # meet Nagle's algorithm and the client's delayed ACK, 40 ms a call (what any production server avoids)
    disable_nagle_algorithm = True
    wbufsize = 1 << 16

    def log_message(self, *args):  # quiet
        pass

    @property
    def store(self) -> Store:
        return self.server.store

    def _send(self, status: int, doc) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self):
        raw = self.rfile.read(int(self.headers.get("content-length", 0) or 0))
        return json.loads(raw) if raw else {}

    def do_GET(self):  # noqa: N802
        s = self.store
        if self.path == "/health":
            return self._send(200, {"ok": True})
        if self.path == "/calls":
            with s.lock:
                return self._send(200, list(s.calls))
        m = re.match(r"^/(orders|instances)/([^/]+)$", self.path)
        if m:
            table = s.orders if m.group(1) == "orders" else s.instances
            with s.lock:
                doc = table.get(m.group(2))
                return self._send(200, doc) if doc is not None else self._send(404, {"error": "no such order"})
        self._send(404, {"error": "not found"})

    def do_POST(self):  # noqa: N802
        s = self.store
        try:
            body = self._body()
        except json.JSONDecodeError:
            return self._send(400, {"error": "body is not JSON"})
        if self.path == "/orders":
            with s.lock:
                s.next += 1
                oid = body.get("id") or f"SO-{s.next}"
                s.orders[oid] = {"id": oid, "customer": body.get("customer", "acme"), "amount": body.get("amount", 100),
                                 "limit": body.get("limit", 1000), "sku": body.get("sku", "A1"),
                                 "quantity": body.get("quantity", 1), "status": "received",
                                 "fail_close": bool(body.get("fail_close"))}
                s.instances[oid] = {"position": list(body.get("position", START)), "version": 0}
                return self._send(201, s.orders[oid])
        m = re.match(r"^/instances/([^/]+)/advance$", self.path)
        if m:
            with s.lock:
                inst = s.instances.get(m.group(1))
                if inst is None:
                    return self._send(404, {"error": "no such instance"})
                if body.get("version") != inst["version"]:
                    return self._send(409, {"error": "the instance moved", "version": inst["version"]})
                inst["position"] = list(body["position"])
                inst["version"] += 1
                inst.setdefault("history", []).append(body.get("task"))
                return self._send(200, inst)
        m = ACTION.match(self.path)
        if not m:
            return self._send(404, {"error": "not found"})
        oid, action = m.groups()
        with s.lock:
            s.calls.append({"method": "POST", "path": self.path, "body": body})
            order = s.orders.get(oid)
            if order is None:
                return self._send(404, {"error": f"no order {oid}"})
            if action == "credit-check":
                order["credit"] = {"approved": order["amount"] <= order["limit"], "limit": order["limit"]}
                order["status"] = "credit-checked"
                return self._send(200, order["credit"])
            if action == "reservations":
                if not (order.get("credit") or {}).get("approved"):
                    return self._send(409, {"error": "credit not approved for this order"})
                order["reservation"] = {"warehouse": body.get("warehouse"), "quantity": body.get("quantity")}
                order["status"] = "reserved"
                return self._send(201, order["reservation"])
            if action == "rejection":
                order["status"] = "rejected"
                order["rejection"] = body.get("reason")
                return self._send(200, {"status": "rejected"})
            if action == "shipments":
                order["shipment"] = {"carrier": body.get("carrier"), "tracking": f"TRK-{oid}"}
                return self._send(201, order["shipment"])
            if action == "invoices":
                order["invoice"] = {"number": f"INV-{oid}", "due_days": body.get("due_days"),
                                    "amount": order["amount"]}
                return self._send(201, order["invoice"])
            if order["fail_close"]:
                return self._send(500, {"error": "Traceback (most recent call last): /srv/erp/secret.py"})
            order["status"] = "closed"
            return self._send(200, {"status": "closed"})


def serve(port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.store = Store()
    return server


if __name__ == "__main__":
    serve(int(sys.argv[1])).serve_forever()
