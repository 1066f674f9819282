"""The health stage and protocol-negotiation probes against real local servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest

from extproc.config.loader import load_text
from extproc.probe import probe_endpoint
from extproc.stack import free_port, wait_http
from extproc.stages.health import Health
from extproc.types import HttpMessage, Phase, Reject, RequestState

# A hypercorn server speaks HTTP/1.1 and h2c; python's http.server speaks only HTTP/1.1.
HYPERCORN_APP = """
import asyncio, sys
from hypercorn.asyncio import serve
from hypercorn.config import Config
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200 if scope["path"] == "/health" else 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})
c = Config(); c.bind = [f"127.0.0.1:{sys.argv[1]}"]; c.loglevel = "error"
asyncio.run(serve(app, c))
"""


@pytest.fixture(scope="module")
def h2_server():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", HYPERCORN_APP, str(port)])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, p)
        yield port
    finally:
        p.terminate()
        p.wait(5)


@pytest.fixture(scope="module")
def http1_server():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 20, p)
        yield port
    finally:
        p.terminate()
        p.wait(5)


async def test_probe_speaks_each_protocol(h2_server, http1_server):
    ok = await probe_endpoint("127.0.0.1", h2_server, "/health", "grpc", 2.0)
    assert ok["status"] == "ok" and ok["http_version"] == "HTTP/2"
    ok1 = await probe_endpoint("127.0.0.1", h2_server, "/health", "http", 2.0)
    assert ok1["status"] == "ok" and ok1["http_version"] == "HTTP/1.1"
    # an HTTP/1.1-only server fails an h2c negotiation: Envoy's HTTP/2 cluster could not use it
    bad = await probe_endpoint("127.0.0.1", http1_server, "/", "grpc", 2.0)
    assert bad["status"] == "down" and "HTTP/2" in bad["error"]
    missing = await probe_endpoint("127.0.0.1", h2_server, "/nope", "http", 2.0)
    assert missing["status"] == "down" and "answered HTTP 404" in missing["error"]
    closed = await probe_endpoint("127.0.0.1", free_port(), "/health", "http", 2.0)
    assert closed["status"] == "down" and "refused" in closed["error"].lower()


def health_snapshot(up_port: int, down_port: int):
    return load_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: h}}
spec:
  protocol: grpc
  backends:
    - {{name: up, endpoints: ["127.0.0.1:{up_port}"]}}
    - {{name: down, endpoints: ["127.0.0.1:{down_port}"]}}
  routes:
    - {{path: /a, target: up}}
    - {{path: /b, target: down}}
""")


async def run_health(snap, path: str) -> Reject:
    st = RequestState(snapshot=snap, route=snap.routes["adapter-health"], started=0.0)
    return await Health(timeout=1.0).on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={":path": path}))


async def test_health_names_what_failed(h2_server):
    snap = health_snapshot(h2_server, free_port())
    v = await run_health(snap, "/health/adapter?probe=protocol-negotiation")
    doc = orjson.loads(v.body)
    assert v.status == 503 and doc["failed"] == ["backend down"]
    assert doc["backends"]["up"]["status"] == "ok" and doc["processor"]["status"] == "serving"
    only_processor = await run_health(snap, "/health/adapter?probe=processor")
    assert only_processor.status == 200 and "backends" not in orjson.loads(only_processor.body)
    unknown = await run_health(snap, "/health/adapter?probe=everything")
    assert unknown.status == 400


async def test_health_all_ok(h2_server):
    snap = health_snapshot(h2_server, h2_server)
    v = await run_health(snap, "/health/adapter")
    assert v.status == 200 and orjson.loads(v.body)["status"] == "ok"


def test_probes_run_in_parallel_within_the_timeout(h2_server):
    # Ten unreachable endpoints (a non-routable address would hang): all bounded by one timeout.
    async def main():
        return await asyncio.gather(*(probe_endpoint("127.0.0.1", free_port(), "/", "http", 0.5) for _ in range(10)))

    assert all(r["status"] == "down" for r in asyncio.run(main()))
