"""WebSocket routes (`kind: websocket`, docs/websocket.md) through the real Envoy and processor, with a real
WebSocket client and two real WebSocket servers (the `websockets` package; tests/e2e/ws_echo_server.py) as
the two endpoints of one backend.

The upgrade request goes through admission (401/403), the tenant's budget (429) and the scheduling profile
(a tenant-pool filter: acme's sockets go to endpoint a, globex's to b, each server names itself in its first
message); after the 101 Envoy proxies the frames (text, binary, 1 MiB each way) with the processor out of
the way; either side can close. A backend that is down is Envoy's 503; a plain request on the route is our
426 (or, with `requireUpgrade: false`, served as plain HTTP); routes of other kinds refuse upgrades (403)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from extproc.stack import free_port, stop_process
from tests.e2e.conftest import make_stack, wait_metric
from tests.e2e.test_token_budget import away_from_window_edge

websockets = pytest.importorskip("websockets", reason="the test extra's websockets package is not installed")
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024


def start_echo(ident: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.ws_echo_server", "--port", str(port), "--id", ident],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # "ready <port>" once listening; EOF if it died
    if not line.startswith("ready"):
        stop_process(proc)
        raise RuntimeError(f"echo server {ident} did not start (exit {proc.poll()})")
    return proc, port


def config(path: Path, port_a: int, port_b: int, port_down: int) -> str:
    path.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: websocket}}
spec:
  tenants:
    - {{id: acme}}
    - {{id: globex}}
    - {{id: initech, budget: {{requestsPerMinute: 1}}}}
  plugins:
    - {{name: spread, type: least-in-flight}}
    - name: pools
      type: tenant-pool-filter
      parameters: {{tenants: {{acme: {{matchLabels: {{pool: a}}}}, globex: {{matchLabels: {{pool: b}}}}}},
                   default: {{matchLabels: {{pool: a}}}}}}
  schedulingProfiles:
    - {{name: by-tenant, plugins: [{{pluginRef: pools}}]}}
  backends:
    - name: realtime
      kind: rest
      endpoints:
        - {{address: "127.0.0.1:{port_a}", labels: {{pool: a}}}}
        - {{address: "127.0.0.1:{port_b}", labels: {{pool: b}}}}
    - {{name: gone, kind: rest, endpoints: ["127.0.0.1:{port_down}"]}}
    - {{name: plain, kind: rest, endpoints: ["127.0.0.1:{port_a}"]}}
  routes:
    - {{path: /v1/realtime, kind: websocket, target: realtime, plugins: [by-tenant], websocket: {{idleTimeout: 30s}}}}
    - {{path: /ws/spread, kind: websocket, target: realtime, plugins: [spread]}}
    - {{path: /ws/idle, kind: websocket, target: realtime, websocket: {{idleTimeout: 1s}}}}
    - {{path: /ws/down, kind: websocket, target: gone}}
    - {{path: /ws/lenient, kind: websocket, target: plain, websocket: {{requireUpgrade: false}}}}
    - {{path: /plain, kind: passthrough, target: plain}}
""")
    return str(path)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    a, port_a = start_echo("a")
    b, port_b = start_echo("b")
    try:
        cfg = config(tmp_path_factory.mktemp("ws") / "gateway.yaml", port_a, port_b, free_port())
        st = make_stack(cfg, workers=2, agent=False)
        st.start()
        try:
            yield st
        finally:
            st.stop()
    finally:
        stop_process(a)
        stop_process(b)


def ws_url(stack, path: str) -> str:
    return stack.url.replace("http://", "ws://", 1) + path


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def hello(ws) -> dict:
    return json.loads(await ws.recv())


async def refused(stack, path: str, tenant: str | None) -> tuple[int, bytes]:
    headers = {"x-tenant-id": tenant} if tenant else {}
    with pytest.raises(InvalidStatus) as e:
        async with connect(ws_url(stack, path), additional_headers=headers):
            pass
    return e.value.response.status_code, e.value.response.body


def test_upgrade_echoes_text_and_binary_both_ways_on_the_endpoint_the_profile_chose(gateway):
    async def session(tenant: str) -> dict:
        async with connect(ws_url(gateway, "/v1/realtime?model=gpt-4o-realtime-preview"), max_size=None,
                           additional_headers={"x-tenant-id": tenant, "OpenAI-Beta": "realtime=v1"}) as ws:
            first = await hello(ws)
            await ws.send('{"type": "session.update"}')
            assert await ws.recv() == '{"type": "session.update"}'
            await ws.send(b"\x00\x01\xff")
            assert await ws.recv() == b"\x00\x01\xff"
            big_text = "x" * MiB
            big_bin = os.urandom(MiB)
            await ws.send(big_text)
            await ws.send(big_bin)
            assert await ws.recv() == big_text
            assert await ws.recv() == big_bin
            await ws.close()
            assert ws.close_code == 1000  # the client's close, answered by the server through Envoy
            return first

    for tenant, server in (("acme", "a"), ("globex", "b"), ("acme", "a"), ("globex", "b")):
        first = run(session(tenant))
        assert first["server"] == server, (tenant, first)
        # the query and the client's headers reached the backend; the gateway's routing headers did not
        assert first["path"] == "/v1/realtime?model=gpt-4o-realtime-preview"
        h = first["headers"]
        assert h["openai-beta"] == "realtime=v1" and h["upgrade"].lower() == "websocket"
        assert "x-adapter-backend" not in h and "x-adapter-route-target" not in h
    # each socket is one request, counted when it ended (Envoy's access log)
    url = gateway.processor_admin_url + "/metrics"
    assert wait_metric(url, "adapter_processor_requests_total", 4, route="v1-realtime", outcome="ok") >= 4


def test_an_open_socket_counts_in_flight_on_its_endpoint_until_it_closes(gateway):
    """least-in-flight: while one socket is open on an endpoint, the next goes to the other one."""
    async def two() -> tuple[str, str]:
        async with connect(ws_url(gateway, "/ws/spread"), additional_headers={"x-tenant-id": "acme"}) as first:
            one = (await hello(first))["server"]
            async with connect(ws_url(gateway, "/ws/spread"), additional_headers={"x-tenant-id": "acme"}) as second:
                return one, (await hello(second))["server"]

    for _ in range(3):
        one, other = run(two())
        assert {one, other} == {"a", "b"}


def test_an_idle_socket_is_closed_at_the_routes_idle_timeout_and_a_busy_one_is_not(gateway):
    async def session() -> tuple[int, int]:
        async with connect(ws_url(gateway, "/ws/idle"), additional_headers={"x-tenant-id": "acme"}) as ws:
            await hello(ws)
            echoed = 0
            for i in range(6):  # frames every 0.3 s keep it alive past its 1 s idle timeout
                await ws.send(f"tick {i}")
                assert await ws.recv() == f"tick {i}"
                echoed += 1
                await asyncio.sleep(0.3)
            with pytest.raises(ConnectionClosed):  # then silence: Envoy resets it
                await asyncio.wait_for(ws.recv(), 20)
            return echoed, ws.close_code

    url = gateway.processor_admin_url + "/metrics"
    echoed, code = run(session())
    assert echoed == 6 and code != 1000  # not a clean close: the proxy cut it (1006)
    # the access log's stream-idle-timeout flag: the request ended as a timeout
    assert wait_metric(url, "adapter_processor_requests_total", 1, route="ws-idle", outcome="timeout") == 1


def test_server_side_close_reaches_the_client_with_its_code_and_reason(gateway):
    async def session() -> tuple[int, str]:
        async with connect(ws_url(gateway, "/v1/realtime"), additional_headers={"x-tenant-id": "globex"}) as ws:
            assert (await hello(ws))["server"] == "b"
            await ws.send("close-me")
            with pytest.raises(ConnectionClosed):
                await ws.recv()
            return ws.close_code, ws.close_reason

    assert run(session()) == (4000, "bye from b")


def test_no_tenant_is_401_and_an_unknown_tenant_403_without_an_upgrade(gateway):
    status, body = run(refused(gateway, "/v1/realtime", None))
    assert status == 401, body
    status, body = run(refused(gateway, "/v1/realtime", "mallory"))
    assert status == 403, body
    err = json.loads(body)["error"]
    assert err["route"] == "v1-realtime" and "mallory" in err["message"]


def test_a_tenant_over_its_budget_gets_429_with_retry_after(gateway):
    away_from_window_edge()

    async def ok() -> str:
        async with connect(ws_url(gateway, "/v1/realtime"), additional_headers={"x-tenant-id": "initech"}) as ws:
            return (await hello(ws))["server"]

    assert run(ok()) == "a"  # initech has no pool: the default one
    headers = {"x-tenant-id": "initech"}

    async def over():
        with pytest.raises(InvalidStatus) as e:
            async with connect(ws_url(gateway, "/v1/realtime"), additional_headers=headers):
                pass
        return e.value.response

    r = run(over())
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 60
    err = json.loads(r.body)["error"]
    assert err["code"] == "tenant_over_budget" and err["tenant"] == "initech" and err["budget"] == "requestsPerMinute"


def test_a_backend_that_is_down_is_503_naming_it(gateway):
    status, body = run(refused(gateway, "/ws/down", "acme"))
    assert status == 503
    err = json.loads(body)["error"]
    assert err["backend"] == "gone" and err["route"].startswith("ws-down")


def test_a_plain_request_on_a_websocket_route_is_426_or_served_when_the_route_allows_it(gateway):
    r = httpx.get(gateway.url + "/v1/realtime", headers={"x-tenant-id": "acme"}, timeout=10)
    assert r.status_code == 426
    err = r.json()["error"]
    assert err["code"] == "websocket_upgrade_required" and err["route"] == "v1-realtime"
    r = httpx.get(gateway.url + "/ws/lenient", headers={"x-tenant-id": "acme"}, timeout=10)
    assert r.status_code == 200 and r.text == "plain http from a\n"
    # and the lenient route still upgrades
    async def upgraded() -> str:
        async with connect(ws_url(gateway, "/ws/lenient"), additional_headers={"x-tenant-id": "acme"}) as ws:
            return (await hello(ws))["server"]

    assert run(upgraded()) == "a"


def test_routes_of_other_kinds_refuse_upgrades(gateway):
    # /plain forwards to the same echo server, which would accept the upgrade: Envoy refuses it first
    assert httpx.get(gateway.url + "/plain", headers={"x-tenant-id": "acme"}, timeout=10).text == "plain http from a\n"
    status, body = run(refused(gateway, "/plain", "acme"))
    assert status == 403
    assert json.loads(body)["error"]["code"] == "upgrade_failed"  # Envoy's own refusal: no processor, no backend
    status, _ = run(refused(gateway, "/no/such/route", "acme"))
    assert status in (403, 404)


# --- config and Envoy rendering (no processes) ------------------------------------------------------

def test_example_config_renders_upgrades_on_the_websocket_route_only():
    from extproc.config.loader import load_file
    from extproc.envoy_render import processing_mode, route_configuration

    snap = load_file(ROOT / "examples" / "websocket.yaml")
    route = snap.routes["v1-realtime"]
    assert route.kind == "websocket" and route.timeout == 1800.0  # the lifecycle waits maxDuration for its end
    assert processing_mode(route) == {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                      "request_body_mode": "NONE", "response_body_mode": "NONE"}
    entries = {e["name"]: e for e in route_configuration(snap)["virtual_hosts"][0]["routes"]}
    for name in ("v1-realtime", "v1-realtime--realtime"):  # the client's entry and the processor-chosen one
        action = entries[name]["route"]
        assert action["upgrade_configs"] == [{"upgrade_type": "websocket"}]
        assert action["timeout"] == "0s" and action["idle_timeout"] == "120.000s"
        assert action["max_stream_duration"] == {"max_stream_duration": "1800.000s"}
    others = [e for n, e in entries.items() if not n.startswith("v1-realtime")]
    assert others and all("upgrade_configs" not in e.get("route", {}) for e in others)
    assert entries["v1"]["route"]["timeout"] == "60.000s"


@pytest.mark.parametrize("change, where, why", [
    (("      plugins: [spread]\n", "      plugins: [spread]\n      policy: {timeout: 5s}\n"),
     "spec.routes[0].policy.timeout", "bounded by websocket.idleTimeout and websocket.maxDuration"),
    (("target: realtime}", "target: realtime, websocket: {idleTimeout: 1s}}"),
     "spec.routes[1].websocket", "only websocket routes (kind: websocket) have a websocket block"),
    (("idleTimeout: 2m", "idleTimeout: 0s"), "spec.routes[0].websocket.idleTimeout", "duration must be positive"),
    (("requireUpgrade: true", "requireUpgrades: true"), "spec.routes[0].websocket.requireUpgrades", "unknown field"),
])
def test_bad_websocket_config_names_file_line_field_and_reason(change, where, why):
    from extproc.config.loader import ConfigError, load_text

    text = (ROOT / "examples" / "websocket.yaml").read_text()
    assert text.count(change[0]) == 1
    with pytest.raises(ConfigError) as e:
        load_text(text.replace(*change), filename="gw.yaml")
    msg = str(e.value)
    assert f": {where}: " in msg and why in msg and "gw.yaml:" in msg


def test_upgrade_header_detection():
    from extproc.stages.websocket_upgrade import is_upgrade

    assert is_upgrade({"upgrade": "websocket", "connection": "Upgrade"})
    assert is_upgrade({"upgrade": "WebSocket"}) and is_upgrade({"upgrade": "h2c, websocket"})
    assert not is_upgrade({"upgrade": "h2c"}) and not is_upgrade({}) and not is_upgrade(None)


def test_an_upgraded_socket_ended_by_a_closed_connection_is_ok_other_closes_keep_their_outcome():
    from extproc.lifecycle import Completion, derive_outcome
    from extproc.types import Outcome, RequestState

    def outcome(status: int, *flags: str) -> Outcome:
        state = RequestState(snapshot=None, route=None, started=0.0, complete=True)
        return derive_outcome(state, Completion(status=status, flags=frozenset(flags)))

    assert outcome(101, "upstream_connection_termination") is Outcome.OK  # how every socket ends
    assert outcome(200, "upstream_connection_termination") is Outcome.TRUNCATED  # an HTTP answer cut off
    assert outcome(101, "stream_idle_timeout") is Outcome.TIMEOUT
    assert outcome(101, "downstream_connection_termination") is Outcome.CANCELLED


def test_with_spec_qos_a_websocket_route_still_sends_only_the_upgrade_headers():
    """qos-engine reads the request body: on a websocket route Envoy would buffer the frames as one (never
    ending) body; and a socket's life is no request latency for the SLO windows. spec.qos leaves it out."""
    from extproc.config.loader import load_text
    from extproc.envoy_render import processing_mode
    from extproc.types import Phase

    text = (ROOT / "examples" / "websocket.yaml").read_text().replace("spec:\n", "spec:\n  qos: {}\n", 1)
    snap = load_text(text, filename="gw.yaml")
    route = snap.routes["v1-realtime"]
    assert route.pipeline.phases == frozenset({Phase.REQUEST_HEADERS})
    assert processing_mode(route)["request_body_mode"] == "NONE"
    assert "qos-admit" in [n for n, _, _ in snap.routes["v1"].pipeline._hooks[Phase.REQUEST_HEADERS]]  # others keep it
