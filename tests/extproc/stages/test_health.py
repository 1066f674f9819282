"""The health stage and protocol-negotiation probes against real local servers."""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest

from extproc.config.loader import load_text
from extproc.probe import probe_endpoint
from extproc.runtime import Runtime
from extproc.stack import free_port, stop_process, wait_http
from extproc.stages.health import Health
from extproc.types import HttpMessage, Phase, Reject, RequestState, Respond

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
        stop_process(p)  # SIGTERM, bounded wait, then SIGKILL


@pytest.fixture(scope="module")
def http1_server():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/", 20, p)
        yield port
    finally:
        stop_process(p)  # SIGTERM, bounded wait, then SIGKILL


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


class SilentServers:
    """`n` listening sockets that accept connections and never answer, on a thread of their own.

    `events` records, in the order this thread saw them, `("accept", i)` when endpoint i's
    connection was accepted and `("closed", i)` when the prober closed it (EOF)."""

    def __init__(self, n: int):
        self.listeners = []
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(16)
            s.setblocking(False)
            self.listeners.append(s)
        self.ports = [s.getsockname()[1] for s in self.listeners]
        self.events: list[tuple[str, int]] = []
        self._conns: dict[socket.socket, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-servers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for i, s in enumerate(self.listeners):
            sel.register(s, selectors.EVENT_READ, ("listener", i))
        while not self._stop.is_set():
            ready = sel.select(timeout=0.05)
            # accepts first: a connection is never reported closed before another one ready now
            for key, _ in sorted(ready, key=lambda kv: kv[0].data[0] != "listener"):
                what, i = key.data
                if what == "listener":
                    try:
                        conn, _ = key.fileobj.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    self._conns[conn] = i
                    self.events.append(("accept", i))
                    sel.register(conn, selectors.EVENT_READ, ("conn", i))
                else:
                    try:
                        data = key.fileobj.recv(65536)  # the probe's request: read, never answered
                    except ConnectionError:
                        data = b""
                    if not data:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()
                        self.events.append(("closed", i))
        sel.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in [*self.listeners, *self._conns]:
            s.close()


@pytest.fixture
def silent_servers():
    servers = SilentServers(6)
    yield servers
    servers.close()


@pytest.mark.timeout(30)  # without the probe timeout this test hangs: the guard turns that into a failure
async def test_probes_run_in_parallel_and_each_is_bounded_by_the_timeout(silent_servers):
    """Two backends of three endpoints each, all accepting and never answering: the health stage
    returns, every endpoint is reported as not answering within the probe timeout, and every
    connection was accepted before any probe gave up (the probes ran at the same time)."""
    ports = silent_servers.ports
    snap = load_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: h}}
spec:
  backends:
    - {{name: a, endpoints: [{", ".join(f'"127.0.0.1:{p}"' for p in ports[:3])}]}}
    - {{name: b, endpoints: [{", ".join(f'"127.0.0.1:{p}"' for p in ports[3:])}]}}
  routes:
    - {{path: /a, target: a}}
    - {{path: /b, target: b}}
""")
    st = RequestState(snapshot=snap, route=snap.routes["adapter-health"], started=0.0)
    v = await Health(timeout=0.5).on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS,
                                                                     headers={":path": "/health/adapter"}))
    doc = orjson.loads(v.body)
    assert v.status == 503 and doc["failed"] == ["backend a", "backend b"]
    reported = {e["address"]: e for b in ("a", "b") for e in doc["backends"][b]["endpoints"]}
    assert set(reported) == {f"127.0.0.1:{p}" for p in ports}
    assert all(e["status"] == "down" and e["error"] == "no answer within 0.5s" for e in reported.values())
    # every probe closed its connection when it gave up; wait for the server thread to see all of it
    while len(silent_servers.events) < 2 * len(ports):
        await asyncio.sleep(0.01)
    events = list(silent_servers.events)
    assert sorted(events[:len(ports)]) == [("accept", i) for i in range(len(ports))], events
    assert sorted(events[len(ports):]) == [("closed", i) for i in range(len(ports))], events


def exact_body(v, snap, probe: str, status: str = "ok", **extra) -> dict:
    """The body as documented, with pid, config identity and uptime (checked apart) filled in."""
    doc = orjson.loads(v.body)
    processor = {"status": "serving", "pid": os.getpid(), "config": snap.name, "generation": snap.generation,
                 "digest": snap.digest, "uptime_s": doc["processor"]["uptime_s"]}
    assert doc == {"status": status, "probe": probe, "processor": processor, **extra}
    return doc


def uptime_within(uptime: float, started: float, before: float, after: float) -> bool:
    """uptime_s is `now - started` rounded to 0.1 s, `now` taken between `before` and `after` (with `started`
    0.34 s past a whole second, a rounding to whole seconds or to 0.01 s fails one of the two checks)."""
    tenths = uptime * 10
    return abs(tenths - round(tenths)) < 1e-6 and before - started - 0.05 <= uptime <= after - started + 0.05


async def test_the_processor_probe_reports_the_worker_from_the_runtimes_start(h2_server):
    snap = health_snapshot(h2_server, free_port())
    runtime = Runtime()
    runtime.started = time.time() - 1000.34  # the worker has run longer than this stage instance
    stage = Health(timeout=1.0)
    stage.started = time.time() - 5.0
    st = RequestState(snapshot=snap, route=snap.routes["adapter-health"], started=0.0, runtime=runtime)
    before = time.time()
    v = await stage.on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS,
                                                       headers={":path": "/health/adapter?probe=processor&x=1"}))
    after = time.time()
    assert isinstance(v, Respond) and (v.status, v.reason, v.headers) == (200, "health_ok", ())
    doc = exact_body(v, snap, "processor")
    assert uptime_within(doc["processor"]["uptime_s"], runtime.started, before, after)


async def test_without_a_runtime_uptime_counts_from_the_stage():
    snap = health_snapshot(free_port(), free_port())
    stage = Health(timeout=1.0)
    stage.started = time.time() - 42.34
    st = RequestState(snapshot=snap, route=snap.routes["adapter-health"], started=0.0)
    before = time.time()
    v = await stage.on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/health/adapter?probe=processor"}))
    after = time.time()
    assert uptime_within(exact_body(v, snap, "processor")["processor"]["uptime_s"], stage.started, before, after)


async def test_backends_down_are_a_503_degraded_naming_each():
    snap = health_snapshot(free_port(), free_port())  # nothing listens: both refuse at once
    st = RequestState(snapshot=snap, route=snap.routes["adapter-health"], started=0.0)
    v = await Health(timeout=1.0).on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={}))
    assert isinstance(v, Respond) and (v.status, v.reason) == (503, "health_failed")
    doc = orjson.loads(v.body)
    assert set(doc["backends"]) == {"up", "down"} and all(b["status"] != "ok" for b in doc["backends"].values())
    exact_body(v, snap, "protocol-negotiation", status="degraded", backends=doc["backends"],
               failed=["backend up", "backend down"])


async def test_all_backends_up_is_a_200_with_each_backend(h2_server):
    snap = health_snapshot(h2_server, h2_server)
    v = await run_health(snap, "/health/adapter?probe=protocol-negotiation")
    assert isinstance(v, Respond) and (v.status, v.reason) == (200, "health_ok")
    doc = orjson.loads(v.body)
    assert [b["status"] for b in doc["backends"].values()] == ["ok", "ok"]
    exact_body(v, snap, "protocol-negotiation", backends=doc["backends"])


async def test_an_unknown_probe_is_a_400_listing_the_known_ones():
    snap = health_snapshot(free_port(), free_port())
    v = await run_health(snap, "/health/adapter?probe=everything")
    assert isinstance(v, Reject) and (v.status, v.code) == (400, "unknown_probe")
    assert v.message == "unknown probe 'everything'; known: protocol-negotiation, processor"


def test_the_compiled_health_route_probes_with_half_a_second():
    snap = health_snapshot(free_port(), free_port())
    (stage,) = snap.routes["adapter-health"].pipeline.stages
    assert isinstance(stage, Health) and stage.timeout == 0.5  # under Envoy's message timeout
