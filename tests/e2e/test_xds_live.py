"""Envoy's config from files, live: routes, backends and endpoints change under load without a
restart; endpoint picks (override_host); per-worker access logs. Real Envoy 1.40, free ports,
every process started here stopped by its PID."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from extproc.config.loader import load_file
from extproc.envoy_bin import find_envoy
from extproc.envoy_render import DESTINATION_HEADER
from extproc.stack import free_port, free_port_block, stop_process, wait_http
from extproc.xds import (CDS_FILE, LDS_FILE, RDS_FILE, EnvoyAdminAck, XdsError, XdsWriter, bootstrap_yaml,
                         render_resources)
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def gateway(path: Path, listen: int, admin: int, base_port: int, backends: dict[str, str],
            routes: list[tuple[str, str]], failure_mode: str = "open") -> Path:
    """A small AdapterGateway file: passthrough routes (path -> backend); endpoints come from
    `with_endpoints`, host names excepted (`named: localhost:P` stays a STRICT_DNS cluster)."""
    lines = ["apiVersion: adapter.ai/v1", "kind: AdapterGateway", "metadata: {name: xds-live}", "spec:",
             f"  listener: {{address: 127.0.0.1, port: {listen}}}", f"  admin: {{address: 127.0.0.1, port: {admin}}}",
             f"  processor: {{address: 127.0.0.1, basePort: {base_port}, adminPort: {free_port()}}}", "  backends:"]
    lines += [f"    - {{name: {n}, endpoints: [\"{ep}\"]}}" for n, ep in backends.items()]
    lines.append("  routes:")
    lines += [f"    - {{path: {p}, target: {t}, policy: {{failureMode: {failure_mode}}}}}" for p, t in routes]
    path.write_text("\n".join(lines) + "\n")
    return path


class Echo:
    """tests/e2e/port_echo.py on a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.port_echo", str(self.port)], cwd=REPO,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def ep(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"

    def count(self) -> int:
        return httpx.get(f"http://127.0.0.1:{self.port}/__count", timeout=5).json()["count"]


@pytest.fixture
def procs():
    """Everything a test starts; stopped (by handle, i.e. PID) at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for p in reversed(started):
        stop_process(p)


def echo(procs) -> Echo:
    e = Echo()
    procs.append(e.proc)
    return e


def start_envoy(procs, writer: XdsWriter, snap, workers: int, run_dir: Path) -> subprocess.Popen:
    boot = run_dir / "envoy.yaml"
    boot.write_text(bootstrap_yaml(snap, workers, writer.dir))
    envoy = subprocess.Popen([find_envoy(), "-c", str(boot), "--disable-hot-restart", "--concurrency", "1",
                              "-l", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(envoy)
    admin = f"http://127.0.0.1:{snap.admin.port}"
    wait_http(f"{admin}/ready", 30, envoy, "envoy")
    ack = EnvoyAdminAck(admin)
    assert ack.rejected(ack.baseline()) == []
    writer.ack = ack
    return envoy


class Load:
    """Requests in a loop over the paths in `self.paths` (changed by the test while it runs)."""

    def __init__(self, url: str, paths: list[str]) -> None:
        self.url, self.paths = url, list(paths)
        self.sent = 0
        self.failed: list[str] = []
        self.ports: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            i = 0
            while not self._stop.is_set():
                paths = list(self.paths)
                path = paths[i % len(paths)]
                i += 1
                self.sent += 1
                try:
                    r = client.get(self.url + path)
                    if r.status_code != 200:
                        self.failed.append(f"{path}: {r.status_code} {r.text[:200]}")
                    else:
                        self.ports.setdefault(path, set()).add(r.json()["port"])
                except httpx.HTTPError as e:
                    self.failed.append(f"{path}: {type(e).__name__} {e}")

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_for(pred, timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.02)


def test_routes_backends_and_endpoints_change_under_load_without_a_restart(tmp_path, procs):
    a1, a2, b1, n1 = echo(procs), echo(procs), echo(procs), echo(procs)
    listen, admin, base = free_port(), free_port(), free_port_block(1)
    url = f"http://127.0.0.1:{listen}"
    cfg = tmp_path / "gw.yaml"

    def snapshot(backends: dict[str, str], routes, endpoints):
        gateway(cfg, listen, admin, base, backends, routes)
        return load_file(cfg).with_endpoints(endpoints)

    named = {"named": f"localhost:{n1.port}"}  # a host name: STRICT_DNS, endpoints inline in cds.yaml
    s0 = snapshot({"a": "127.0.0.1:9", **named}, [("/a", "a"), ("/n", "named")], {"a": (a1.ep,)})
    writer = XdsWriter(tmp_path / "xds")
    first = writer.write(s0, 1, wait=False)
    assert first.changed == ("eds-a.yaml", CDS_FILE, RDS_FILE, LDS_FILE)
    envoy = start_envoy(procs, writer, s0, 1, tmp_path)
    took: list[float] = []
    plain_write = writer.write

    def timed_write(*a, **kw):
        t = time.perf_counter()
        try:
            return plain_write(*a, **kw)
        finally:
            took.append(time.perf_counter() - t)

    writer.write = timed_write
    pid = envoy.pid
    wait_http(f"{url}/a", 10, envoy, "route /a")

    started = time.monotonic()
    with Load(url, ["/a", "/n"]) as load:
        time.sleep(1)
        # 1. a new route to an existing backend: only the route configuration changes
        s1 = snapshot({"a": "127.0.0.1:9", **named}, [("/a", "a"), ("/n", "named"), ("/a2", "a")],
                      {"a": (a1.ep,)})
        r1 = writer.write(s1, 1)
        assert r1.changed == (RDS_FILE,) and r1.steps == ("routes",)
        assert httpx.get(f"{url}/a2", timeout=5).json()["port"] == a1.port  # answers at once: the ack waited
        load.paths.append("/a2")
        time.sleep(1)
        # 2. a new backend and its route: clusters and endpoints first, then routes
        s2 = snapshot({"a": "127.0.0.1:9", **named, "b": "127.0.0.1:9"},
                      [("/a", "a"), ("/n", "named"), ("/a2", "a"), ("/b", "b")], {"a": (a1.ep,), "b": (b1.ep,)})
        r2 = writer.write(s2, 1)
        assert r2.changed == ("eds-b.yaml", CDS_FILE, RDS_FILE) and r2.steps == ("clusters", "routes")
        assert httpx.get(f"{url}/b", timeout=5).json()["port"] == b1.port
        load.paths.append("/b")
        time.sleep(1)
        # 3. an endpoint added: its EDS file only
        s3 = s2.with_endpoints({"a": (a1.ep, a2.ep)})
        r3 = writer.write(s3, 1)
        assert r3.changed == ("eds-a.yaml",) and r3.steps == ("clusters",)
        before = a2.count()
        wait_for(lambda: a2.count() > before + 5, what="traffic on the added endpoint")
        # 4. an endpoint removed: its EDS file only; no request fails, none reaches it afterwards
        r4 = writer.write(s2.with_endpoints({"a": (a2.ep,)}), 1)
        assert r4.changed == ("eds-a.yaml",)
        time.sleep(0.3)  # requests already on their way to a1 finish there
        gone = a1.count()
        time.sleep(1)
        assert a1.count() == gone, "a removed endpoint still got requests"
        # 5. a backend and its route removed: routes first, then the cluster, then its EDS file
        load.paths.remove("/b")
        time.sleep(0.2)
        s5 = snapshot({"a": "127.0.0.1:9", **named}, [("/a", "a"), ("/n", "named"), ("/a2", "a")],
                      {"a": (a2.ep,)})
        r5 = writer.write(s5, 1)
        assert r5.changed == (RDS_FILE, CDS_FILE) and r5.steps == ("routes", "prune")
        assert r5.removed == ("eds-b.yaml",)
        # 6. nothing changed: nothing written (every rename makes Envoy re-read every file)
        assert not writer.write(s5, 1)
        while time.monotonic() - started < 10:
            time.sleep(0.1)
    assert load.sent > 200, load.sent
    assert load.failed == [], f"{len(load.failed)} of {load.sent} failed: {load.failed[:5]}"
    assert envoy.poll() is None and envoy.pid == pid  # the same Envoy all along
    assert load.ports["/n"] == {n1.port} and load.ports["/b"] == {b1.port}
    assert load.ports["/a"] == {a1.port, a2.port}
    assert httpx.get(f"{url}/b", timeout=5).status_code == 404
    stats = EnvoyAdminAck(f"http://127.0.0.1:{admin}").stats()
    assert stats["listener_manager.lds.update_success"] >= 1
    assert stats.get("listener_manager.listener_modified", 0) == 0  # the listener itself never changed
    print(f"\nxds live: {load.sent} requests during 5 config changes, {len(load.failed)} failed, envoy pid {pid}; "
          f"write+ack ms: {', '.join(f'{t * 1000:.0f}' for t in took)}")


def test_a_rejected_file_raises_naming_it_and_is_put_back(tmp_path, procs):
    a1 = echo(procs)
    listen, admin = free_port(), free_port()
    snap = load_file(gateway(tmp_path / "gw.yaml", listen, admin, free_port_block(1), {"a": "127.0.0.1:9"},
                             [("/a", "a")])).with_endpoints({"a": (a1.ep,)})
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 1, wait=False)
    envoy = start_envoy(procs, writer, snap, 1, tmp_path)
    good = (writer.dir / CDS_FILE).read_bytes()
    res = render_resources(snap, 1, writer.dir)
    bad = dict(res.clusters[0], connect_timeout="-1s")  # valid JSON, refused by Envoy's validation
    with pytest.raises(XdsError, match=r"rejected .*cds\.yaml in step clusters"):
        writer.write_resources(type(res)(res.listeners, res.route_configs, (bad,), res.endpoints))
    assert (writer.dir / CDS_FILE).read_bytes() == good  # the directory says what Envoy runs
    assert httpx.get(f"http://127.0.0.1:{listen}/a", timeout=5).json()["port"] == a1.port
    assert envoy.poll() is None


def test_endpoint_picks_by_header_with_fallbacks_and_client_copies_stripped(tmp_path, procs):
    """override_host on a backend cluster: the pick wins, a first entry outside the cluster falls
    back to the next, no valid pick balances, and a client cannot pick (its header is stripped)."""
    a1, a2 = echo(procs), echo(procs)
    listen, admin = free_port(), free_port()
    snap = load_file(gateway(tmp_path / "gw.yaml", listen, admin, free_port_block(1), {"a": "127.0.0.1:9"},
                             [("/a", "a")])).with_endpoints({"a": (a1.ep, a2.ep)})
    res = render_resources(snap, 1, tmp_path / "xds")
    vhost = res.route_configs[0]["virtual_hosts"][0]

    def pin(path: str, value: str) -> dict:  # stands in for the processor setting the header
        return {"name": path.strip("/"), "match": {"path": path}, "route": {"cluster": "a"},
                "request_headers_to_add": [{"header": {"key": DESTINATION_HEADER, "value": value},
                                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}

    vhost["routes"][:0] = [pin("/pin", a2.id), pin("/pin-fallback", f"127.0.0.1:1,{a2.id}"),
                           pin("/pin-outside", "127.0.0.1:1")]
    writer = XdsWriter(tmp_path / "xds")
    writer.write_resources(res, wait=False)
    start_envoy(procs, writer, snap, 1, tmp_path)
    url = f"http://127.0.0.1:{listen}"

    def run(path: str, n: int = 20, **kw) -> tuple[int, int, set]:
        c1, c2 = a1.count(), a2.count()
        seen = {httpx.get(url + path, timeout=5, **kw).json()["destination"] for _ in range(n)}
        return a1.count() - c1, a2.count() - c2, seen

    assert run("/pin") == (0, 20, {a2.id})  # the upstream sees the pick too
    assert run("/pin-fallback") == (0, 20, {f"127.0.0.1:1,{a2.id}"})
    on1, on2, _ = run("/pin-outside", 40)
    assert on1 > 0 and on2 > 0  # no endpoint of the cluster named: least request
    on1, on2, seen = run("/a", 40, headers={DESTINATION_HEADER: a2.id})
    assert on1 > 0 and on2 > 0 and seen == {None}  # the client's header never reached the balancer


def test_each_worker_gets_the_access_logs_of_its_own_requests(tmp_path, procs):
    """A stand-in processor (two workers, ext_proc + access-log service + health on each port)
    names the endpoint in the header and in envoy.lb metadata and tags each request with its
    worker; Envoy sends every log entry to the worker that served the request, and nowhere else."""
    import asyncio

    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.accesslog.v3 import als_pb2_grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from google.protobuf import struct_pb2
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    a1, a2 = echo(procs), echo(procs)
    listen, admin, base = free_port(), free_port(), free_port_block(2)
    snap = load_file(gateway(tmp_path / "gw.yaml", listen, admin, base, {"a": "127.0.0.1:9"}, [("/a", "a")],
                             failure_mode="closed")).with_endpoints({"a": (a1.ep, a2.ep)})
    streams = {0: 0, 1: 0}
    digests: set[str] = set()
    logs: dict[int, list] = {0: [], 1: []}
    log_names: dict[int, set[str]] = {0: set(), 1: set()}

    class Processor(ep_grpc.ExternalProcessorServicer):
        def __init__(self, i: int) -> None:
            self.i = i

        async def Process(self, requests, context):  # noqa: N802
            streams[self.i] += 1
            digests.update(v for k, v in context.invocation_metadata() if k == "x-adapter-config-digest")
            async for req in requests:
                if req.WhichOneof("request") != "request_headers":
                    continue
                meta = struct_pb2.Struct()
                meta.update({"adapter": {"worker": str(self.i)}, "envoy.lb": {DESTINATION_HEADER: a2.id}})
                mutation = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=a2.id.encode()))])
                yield ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation)),
                    dynamic_metadata=meta)

    class Logs(als_pb2_grpc.AccessLogServiceServicer):
        def __init__(self, i: int) -> None:
            self.i = i

        async def StreamAccessLogs(self, requests, context):  # noqa: N802
            async for msg in requests:
                if msg.identifier.log_name:
                    log_names[self.i].add(msg.identifier.log_name)
                logs[self.i].extend(msg.http_logs.log_entry)
            from envoy.service.accesslog.v3 import als_pb2
            return als_pb2.StreamAccessLogsResponse()

    loop = asyncio.new_event_loop()
    servers = []

    async def serve() -> None:
        for i in range(2):
            server = grpc.aio.server()
            ep_grpc.add_ExternalProcessorServicer_to_server(Processor(i), server)
            als_pb2_grpc.add_AccessLogServiceServicer_to_server(Logs(i), server)
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            server.add_insecure_port(f"127.0.0.1:{base + i}")
            await server.start()
            servers.append(server)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    try:
        writer = XdsWriter(tmp_path / "xds")
        writer.write(snap, 2, wait=False)
        start_envoy(procs, writer, snap, 2, tmp_path)
        url = f"http://127.0.0.1:{listen}"
        wait_for(lambda: httpx.get(url + "/a", timeout=5).status_code == 200, 10, "processor healthy")
        c2 = a2.count()
        n = 40
        with httpx.Client(timeout=5) as client:
            for _ in range(n):
                r = client.get(url + "/a")
                assert r.status_code == 200 and r.json()["port"] == a2.port, r.text
        assert a2.count() - c2 == n  # the processor's pick, every time
        wait_for(lambda: len(logs[0]) + len(logs[1]) >= n + 1, 5, "access logs")
        time.sleep(0.2)
        assert len(logs[0]) + len(logs[1]) == n + 1  # the readiness request too
        assert streams[0] > 0 and streams[1] > 0  # both workers served some
        for i in (0, 1):
            assert len(logs[i]) == streams[i], (i, len(logs[i]), streams)
            assert log_names[i] == {f"adapter-w{i}"}
            for entry in logs[i]:
                assert entry.common_properties.upstream_remote_address.socket_address.port_value == a2.port
                meta = entry.common_properties.metadata.filter_metadata
                assert meta["adapter"]["worker"] == str(i)
                assert meta["envoy.lb"][DESTINATION_HEADER] == a2.id
        assert digests == {snap.digest}
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_stack_reload_changes_envoy_live(tmp_path, procs, stack_factory):
    """`Stack.reload()` after the config file changed: the new route and backend answer through
    the same Envoy process (its files rewritten by the supervisor, or by the stack itself)."""
    a1, b1 = echo(procs), echo(procs)
    cfg = tmp_path / "gw.yaml"
    gateway(cfg, 9, 10, 11, {"a": a1.id}, [("/a", "a")])  # ports: the stack puts its own over these
    st = stack_factory(cfg, workers=1, run_dir=str(tmp_path / "run"))
    pid = st.envoy_pid
    assert httpx.get(f"{st.url}/a", timeout=5).json()["port"] == a1.port
    assert sorted(p.name for p in st.xds.dir.iterdir()) == ["cds.yaml", "eds-a.yaml", "lds.yaml", "rds.yaml"]
    gateway(cfg, 9, 10, 11, {"a": a1.id, "b": b1.id}, [("/a", "a"), ("/b", "b")])
    result = st.reload()
    if result is not None:  # the supervisor that writes Envoy's files returns what it did
        assert result.accepted and not result.errors, result
    wait_for(lambda: httpx.get(f"{st.url}/b", timeout=5).status_code == 200, 10, "the new route")
    assert httpx.get(f"{st.url}/b", timeout=5).json()["port"] == b1.port
    assert st.envoy_pid == pid and st.envoy.poll() is None
    assert (st.xds.dir / "eds-b.yaml").exists()
