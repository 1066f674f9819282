"""Envoy 1.40 and `envoy.reloadable_features.ext_proc_graceful_grpc_close` (issue 12 item 6).

Without it Envoy ends every ext_proc side stream with RST_STREAM; a reset that reaches a grpc.aio
server while it awaits the next message leaks native memory (grpc/grpc#43360, about 100 B a
stream), and a reset that beats the worker's own status makes grpc log an ExecuteBatchError. With
it Envoy half-closes and waits (up to 1 s) for the processor's status. The rendered bootstraps do
not set it (extproc/envoy_render.py `RUNTIME` says why: a half-close does not cancel a worker
busy in a stage, e.g. queued for admission); these tests pin what it does, for the follow-up.

- A bootstrap with it in `layered_runtime` (`envoy_render.layered_runtime`), static and live,
  passes `--mode validate` (which does not check runtime keys, hence the next test).
- Through the real Envoy 1.40 and the live bootstrap as rendered: a grpc.aio ext_proc server that
  never ends a stream itself (it keeps reading after the route's only phase). With the flag on,
  each stream ends with Envoy's half-close, the server sends its status, and Envoy resets none of
  them (`cluster.adapter_processor.upstream_rq_tx_reset` 0); with the flag false, or as rendered
  (no `layered_runtime`: Envoy's default, off in this binary), Envoy resets every one (5 of 5),
  though the server's read may still see the END_STREAM Envoy sends just before its RST_STREAM.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]

from extproc.cli import envoy_validate
from extproc.config.loader import load_file
from extproc.envoy_bin import find_envoy
from extproc.envoy_render import PROCESSOR_CLUSTER, RUNTIME, dump_yaml, layered_runtime, render
from extproc.stack import free_port, free_port_block, stop_process, wait_http
from extproc.xds import XdsWriter, render_bootstrap
from tests.conftest import BRIEF_EXAMPLE
from tests.e2e.test_xds_live import echo, gateway, procs  # noqa: F401  (procs is a fixture)

pytestmark = pytest.mark.e2e

FLAG = "envoy.reloadable_features.ext_proc_graceful_grpc_close"


def with_flag(boot: dict, value: bool) -> dict:
    return {**boot, "layered_runtime": layered_runtime({FLAG: value})}


def test_the_flag_in_layered_runtime_passes_envoy_validate_and_is_not_rendered(tmp_path):
    snap = load_file(BRIEF_EXAMPLE)
    static = render(snap, workers=2)
    writer = XdsWriter(tmp_path / "xds")
    writer.write(snap, 2, wait=False)  # the files the live bootstrap names
    live = render_bootstrap(snap, 2, writer.dir)
    assert FLAG not in RUNTIME and "layered_runtime" not in static and "layered_runtime" not in live
    for name, boot in (("static", static), ("live", live)):
        boot = with_flag(boot, True)
        layers = boot["layered_runtime"]["layers"]
        assert layers[0]["static_layer"][FLAG] is True and layers[-1] == {"name": "admin", "admin_layer": {}}
        out = tmp_path / f"{name}.yaml"
        out.write_text(dump_yaml(boot))
        ok, output = envoy_validate(str(out))
        assert ok, (name, output)


class NeverEnds(pb_grpc.ExternalProcessorServicer):
    """Answers each message with "continue" and keeps reading: the stream ends only by Envoy."""

    def __init__(self) -> None:
        self.ends: list[str] = []
        self.finished: list[bool] = []  # one per RPC over (status sent, or the stream reset)

    async def Process(self, request_iterator, context):  # noqa: N802
        context.add_done_callback(lambda ctx: self.finished.append(True))
        try:
            async for req in request_iterator:
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse()) \
                    if req.HasField("request_headers") else pb.ProcessingResponse()
            self.ends.append("half-close")
        except asyncio.CancelledError:
            self.ends.append("reset")
            raise


def envoy_resets(admin: int) -> float:
    """Streams to the processor cluster that Envoy reset (RST_STREAM it sent)."""
    stats = httpx.get(f"http://127.0.0.1:{admin}/stats", params={"format": "json"}, timeout=5).json()["stats"]
    name = f"cluster.{PROCESSOR_CLUSTER}.upstream_rq_tx_reset"
    return next((s["value"] for s in stats if s.get("name") == name), 0.0)


async def ends_seen(tmp_path, procs, variant: str, n: int = 5) -> tuple[list[str], float]:  # noqa: F811
    """How the probe saw each of n streams end, and how many of them Envoy reset."""
    backend = echo(procs)
    listen, admin, base = free_port(), free_port(), free_port_block(1)
    cfg = gateway(tmp_path / f"gw-{variant}.yaml", listen, admin, base, {"echo": backend.id},
                  [("/echo", "echo")], failure_mode="closed")
    snap = load_file(cfg)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    probe = NeverEnds()
    pb_grpc.add_ExternalProcessorServicer_to_server(probe, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    assert server.add_insecure_port(f"127.0.0.1:{base}") == base
    await server.start()
    for name in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    envoy = None
    try:
        writer = XdsWriter(tmp_path / f"xds-{variant}")
        writer.write(snap, 1, wait=False)
        boot = copy.deepcopy(render_bootstrap(snap, 1, writer.dir))
        if variant != "as rendered":
            boot = with_flag(boot, variant == "flag on")
        path = tmp_path / f"envoy-{variant.replace(' ', '-')}.yaml"
        path.write_text(dump_yaml(boot))
        envoy = subprocess.Popen([find_envoy(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                  "-l", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(envoy)
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{admin}/ready", 30, envoy, "envoy")
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{listen}/__adapter_not_a_route__", 10, envoy, "listener")
        runtime = httpx.get(f"http://127.0.0.1:{admin}/runtime", timeout=5).json()["entries"]
        expected = {"flag on": "true", "flag false": "false", "as rendered": None}[variant]
        assert (runtime.get(FLAG) or {}).get("final_value") == expected, runtime.get(FLAG)
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(n):
                r = await client.get(f"http://127.0.0.1:{listen}/echo")
                assert r.status_code == 200, r.text
        resets = 0.0
        for _ in range(100):  # each stream ends when Envoy is done with its request: wait for all n
            resets = envoy_resets(admin)
            if len(probe.finished) >= n or resets >= n:
                break
            await asyncio.sleep(0.05)
        return list(probe.ends), resets
    finally:
        if envoy is not None:
            await asyncio.to_thread(stop_process, envoy)
        await server.stop(0)


async def test_with_the_flag_envoy_half_closes_ext_proc_streams(tmp_path, procs):  # noqa: F811
    ends, resets = await ends_seen(tmp_path, procs, "flag on")
    assert ends == ["half-close"] * 5 and resets == 0, (ends, resets)


@pytest.mark.parametrize("variant", ["flag false", "as rendered"])
async def test_without_the_flag_envoy_resets_them(tmp_path, procs, variant):  # noqa: F811
    # the processor's read may still see Envoy's half-close first (Envoy sends END_STREAM, then
    # RST_STREAM at once): what tells is Envoy's own count of the resets it sent
    ends, resets = await ends_seen(tmp_path, procs, variant)
    assert resets == 5, (ends, resets)
