"""One processor worker: a grpc.aio ext_proc server plus gRPC health, with an ordered lifecycle.

What: `run_worker(settings)` loads the config, binds the port (failing loudly if it cannot),
serves `ExternalProcessor` and `grpc.health.v1.Health`, then prints `ready` on stdout for the
supervisor. Under the supervisor the config is a bundle (`--bundle-root`, extproc/config/bundle.py):
at start and on SIGHUP the worker loads the bundle `<root>/current` names and swaps it in; it never
reads the original file. At start it also loads the bundles published before the current one
(`previous_bundles`, as many as `ConfigRef` keeps): a worker restarted while a reload is under way
comes up on the new generation while Envoy still routes with the previous digest until the
supervisor sends it the new routes, and a worker that never restarted still holds those snapshots
(without them the restarted worker refused Envoy's streams with `config_mismatch`, issue 12; a
previous bundle that does not load is skipped with a warning). Each event is one line on stdout,
which the supervisor parses:
`ready ADDR:PORT generation=G digest=D`, `loaded generation=G digest=D` (also when SIGHUP finds
the bundle already loaded), `refused generation=G: REASON` (the last good snapshot stays). Run by
hand with `--config FILE`, SIGHUP re-reads the file instead (generation + 1).
SIGTERM/SIGINT: health goes NOT_SERVING (Envoy's health checks stop sending new streams), a short
drain, then `server.stop(grace)` lets open streams finish for the rest of the grace period and
cancels the remainder. A second signal exits at once.
Why: uvicorn's lifecycle; one process per Envoy endpoint because one Python process is one core.
Cost: start-up ~0.3 s (imports); nothing per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from prometheus_client import CollectorRegistry

from extproc.config.bundle import bundle_generation, current_bundle, load_bundle, previous_bundles, read_manifest
from extproc.config.loader import ConfigError, load_file
from extproc.metrics import ProcessorMetrics
from extproc.feedback import AccessLogFeedback
from extproc.feedback import add_to_server as add_feedback_service
from extproc.runtime import Runtime
from extproc.stream import KEEP_SNAPSHOTS, ConfigRef, ExtProcService

log = logging.getLogger("extproc.worker")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
# grpc.health.v1 service names: "" (the server), the ext_proc service, and the endpoint-picker
# protocol's `liveness` and `readiness` (GIE's EPP probes; no leader election: every replica is ready)
HEALTH_NAMES = ("", SERVICE_NAME, "liveness", "readiness")
STATE_DIR_ENV = "ADAPTER_STATE_DIR"  # where workers share gateway-wide state (the supervisor sets it)
# spec.processor.tls as the supervisor started with it (JSON, or "off"): a worker restarted after a
# reload keeps serving what Envoy's static processor cluster speaks, whatever the reloaded file says
PROCESSOR_TLS_ENV = "ADAPTER_PROCESSOR_TLS"


async def _sweep(runtime: Runtime, service: ExtProcService, interval: float = 0.25) -> None:
    """Finish requests whose access-log entry is overdue (the lifecycle's deadline); write the
    buffered metric updates."""
    while True:
        await asyncio.sleep(interval)
        try:
            runtime.lifecycle.sweep()
        except Exception:  # noqa: BLE001 - the loop must outlive any one bad request
            log.exception("lifecycle sweep failed")
        try:
            service.flush_metrics()
        except Exception:  # noqa: BLE001
            log.exception("metric flush failed")


@dataclass(frozen=True)
class WorkerSettings:
    config_path: str
    address: str
    port: int
    index: int = 0
    shutdown_grace: float = 5.0
    drain_delay: float = 1.0  # NOT_SERVING before stop(): about one Envoy health-check interval
    endpoints: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()  # backend endpoint overrides
    record_dir: str | None = None  # append every ProcessingRequest here (text format), for replay tests
    bundle_root: str | None = None  # serve `<root>/current` (the supervisor's bundles) instead of config_path


def grpc_options(max_message: int) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),  # two workers must never silently share a port
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_concurrent_streams", 100_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ]


def startup_tls(snapshot: Any) -> Any:
    """The worker's `spec.processor.tls`: the supervisor's (PROCESSOR_TLS_ENV), else the snapshot's."""
    raw = os.environ.get(PROCESSOR_TLS_ENV)
    if raw is None:
        return snapshot.processor.tls
    if raw == "off":
        return None
    from extproc.config.schema import ProcessorTlsSpec

    return ProcessorTlsSpec.model_validate_json(raw)


def mtls_server_credentials(tls) -> grpc.ServerCredentials:
    """`spec.processor.tls`: the worker's certificate, and client certificates required and checked
    against the CA (a client without one, or with another CA's, fails the handshake). Read at start:
    a reload does not change them (restart the workers: `adapterctl restart --rolling`)."""
    with open(tls.cert_file, "rb") as c, open(tls.key_file, "rb") as k, open(tls.ca_file, "rb") as ca:
        return grpc.ssl_server_credentials([(k.read(), c.read())], root_certificates=ca.read(),
                                           require_client_auth=True)


async def serve(settings: WorkerSettings, stop: asyncio.Event, ready: asyncio.Event | None = None,
                announce: Callable[[str], None] | None = None) -> None:
    """`announce(line)` gets the protocol lines (ready, loaded, refused); run_worker prints them."""
    announce = announce or (lambda line: None)
    overrides = dict(settings.endpoints) or None
    snapshot = _initial_snapshot(settings, overrides, announce)
    config = ConfigRef(snapshot, _previous_snapshots(settings, snapshot))
    metrics = ProcessorMetrics(CollectorRegistry(auto_describe=True))
    metrics.config_generation.set(snapshot.generation)
    # Bodies are buffered up to a route's limit; leave room for protobuf framing.
    routes = (*snapshot.routes.values(), *((snapshot.epp.route,) if snapshot.epp is not None else ()))
    max_message = max(r.max_body_bytes for r in routes) * 2 + (1 << 20)
    server = grpc.aio.server(options=grpc_options(max_message))
    # Long-lived state (lifecycle, in-flight table, plugins, caches): outlives every snapshot swap.
    # feedback=True: this worker serves Envoy's access log; each stream's snapshot says whether its
    # request asks for an entry (`processor.feedback`), so a reload may switch it either way
    runtime = Runtime(settings.index, state_dir=os.environ.get(STATE_DIR_ENV) or None, feedback=True)
    service = ExtProcService(config, metrics, _recorder(settings.record_dir, settings.index), runtime=runtime)
    add_feedback_service(AccessLogFeedback(runtime.lifecycle, metrics), server)  # Envoy's loggers report here
    sweeper = asyncio.get_running_loop().create_task(_sweep(runtime, service))
    runtime.start_signals()  # engine metrics of the endpoints engine-signal plugins decide over (if any)
    from extproc.negotiate import negotiator

    # each OpenAI-compatible backend's dialect (background); a backend only passthrough routes reach is
    # never re-encoded, so it gets no probe traffic at start (a health check's probe still asks)
    reached: dict[bool, set[str]] = {True: set(), False: set()}  # adapting route? -> backend names
    for r in snapshot.routes.values():
        reached[r.kind != "passthrough"].update(b.name for b in (r.backends or ((r.backend,) if r.backend else ())))
    passthrough_only = reached[False] - reached[True]
    negotiator(runtime).start([b for b in snapshot.backends.values() if b.name not in passthrough_only])
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    tls = snapshot.epp.tls if snapshot.epp is not None else None
    try:
        if (processor_tls := startup_tls(snapshot)) is not None:  # mTLS with Envoy: only clients the CA signed
            bound = server.add_secure_port(f"{settings.address}:{settings.port}", mtls_server_credentials(processor_tls))
        elif tls is None:
            bound = server.add_insecure_port(f"{settings.address}:{settings.port}")
        else:  # EPP mode over TLS (kgateway, Envoy AI Gateway connect to an EPP with TLS)
            with open(tls[0], "rb") as cert, open(tls[1], "rb") as key:
                creds = grpc.ssl_server_credentials([(key.read(), cert.read())])
            bound = server.add_secure_port(f"{settings.address}:{settings.port}", creds)
    except RuntimeError:  # grpcio raises instead of returning 0 in recent versions
        bound = 0
    if not bound:
        raise OSError(f"cannot bind {settings.address}:{settings.port} (in use, or not a local address)")
    health_server = None
    if snapshot.epp is not None and snapshot.epp.health_port is not None:
        # EPP mode: grpc.health.v1 alone on its own port too (GIE deploys its EPP probes on 9003)
        health_server = grpc.aio.server(options=grpc_options(1 << 20))
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        try:
            health_bound = health_server.add_insecure_port(f"{settings.address}:{snapshot.epp.health_port}")
        except RuntimeError:
            health_bound = 0
        if not health_bound:
            raise OSError(f"cannot bind the health port {settings.address}:{snapshot.epp.health_port}")
        await health_server.start()
    await server.start()
    for name in HEALTH_NAMES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %d serving on %s:%d (config %s generation %d)", settings.index, settings.address,
             settings.port, snapshot.name, snapshot.generation)
    loop = asyncio.get_running_loop()
    # installed before `ready`: the supervisor signals only workers that said ready
    loop.add_signal_handler(signal.SIGHUP, _reloader(settings, overrides, config, metrics, announce))
    from extproc import memdebug  # ADAPTER_TRACEMALLOC=N: SIGUSR2 dumps a tracemalloc snapshot (off: nothing)

    memdebug.install(loop, os.environ.get(STATE_DIR_ENV) or None, settings.index)
    announce(f"ready {settings.address}:{settings.port} generation={snapshot.generation} digest={snapshot.digest}")
    if ready is not None:
        ready.set()

    try:
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        for name in HEALTH_NAMES:
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        drain = min(settings.drain_delay, settings.shutdown_grace / 2)
        await asyncio.sleep(drain)
        await server.stop(max(settings.shutdown_grace - drain, 0.0))
        if health_server is not None:
            await health_server.stop(0)
        sweeper.cancel()
        await runtime.stop_signals()
        runtime.lifecycle.close()  # requests still open or waiting for Envoy's entry end here
        service.flush_metrics()
        await runtime.stop_tracing()  # queued spans exported, bounded by spec.tracing.exportTimeout
        await runtime.stop_genai_otlp()  # the GenAI metrics' last OTLP export, bounded by its exportTimeout
        log.info("worker %d stopped", settings.index)


def _initial_snapshot(settings: WorkerSettings, overrides: dict | None, announce: Callable[[str], None]):
    if not settings.bundle_root:
        return load_file(settings.config_path, endpoints=overrides)
    path = None
    try:
        path = current_bundle(settings.bundle_root)
        return load_bundle(path)
    except ConfigError as e:
        announce(f"refused generation={_generation_of(path)}: {_one_line(e)}")
        raise


def _previous_snapshots(settings: WorkerSettings, current: Any) -> list[Any]:
    """The snapshots of the bundles published before `current`, newest first (bundle root only):
    Envoy may still send their digests. About 20 ms each for the reliability test's config."""
    if not settings.bundle_root:
        return []
    out: list[Any] = []
    seen = {current.digest}
    for path in previous_bundles(settings.bundle_root, KEEP_SNAPSHOTS - 1):
        try:
            if read_manifest(path)["digest"] in seen:
                continue
            snap = load_bundle(path)
        except Exception as e:  # noqa: BLE001 - pruned meanwhile, or not loadable here: not needed to serve
            log.warning("previous config bundle %s not loaded (streams from Envoy routes of its digest would be "
                        "refused): %s", path, _one_line(e))
            continue
        seen.add(snap.digest)
        out.append(snap)
    if out:
        log.info("also holding the previous generation(s) %s (digests %s)", ", ".join(str(s.generation) for s in out),
                 ", ".join(s.digest for s in out))
    return out


def _reloader(settings: WorkerSettings, overrides: dict | None, config: ConfigRef, metrics: ProcessorMetrics,
              announce: Callable[[str], None]) -> Callable[[], None]:
    """The SIGHUP handler: load the current bundle (or, run by hand, re-read the file) and swap it in;
    on any failure keep the snapshot in use and say `refused`."""

    def reload() -> None:
        current = config.current
        path = None
        try:
            if settings.bundle_root:
                path = current_bundle(settings.bundle_root)  # resolved once for this load
                manifest = read_manifest(path)
                if (manifest["generation"], manifest["digest"]) == (current.generation, current.digest):
                    announce(f"loaded generation={current.generation} digest={current.digest}")  # idempotent
                    return
                new = load_bundle(path)
            else:
                new = load_file(settings.config_path, generation=current.generation + 1, endpoints=overrides)
            config.swap(new)  # its listeners (the runtime's plugins) may refuse it too
        except Exception as e:  # noqa: BLE001 - whatever it is, the worker keeps serving the last good one
            generation = _generation_of(path) if settings.bundle_root else current.generation + 1
            what = f"config bundle {path} not loaded" if settings.bundle_root else "config reload refused"
            log.error("%s, keeping generation %d (digest %s):\n%s", what, current.generation, current.digest, e)
            announce(f"refused generation={generation}: {_one_line(e)}")
            return
        metrics.config_generation.set(new.generation)
        log.info("config loaded: generation %d (digest %s)", new.generation, new.digest)
        announce(f"loaded generation={new.generation} digest={new.digest}")

    return reload


def _generation_of(path) -> str:
    if path is None:
        return "?"
    try:
        return str(read_manifest(path)["generation"])
    except ConfigError:
        g = bundle_generation(path)
        return "?" if g is None else str(g)


def _one_line(e: BaseException) -> str:
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def _announce(line: str) -> None:
    print(line, flush=True)


def _recorder(record_dir: str | None, index: int):
    """Writes each stream's requests to `<dir>/<route>-<request id>.txtpb` (debugging and tests)."""
    if not record_dir:
        return None
    from pathlib import Path

    from google.protobuf import text_format

    base = Path(record_dir)
    base.mkdir(parents=True, exist_ok=True)

    def record(route: str | None, request_id: str, req: object) -> None:
        name = f"{route or 'unknown'}-{request_id or index}.txtpb"
        with open(base / name, "a", encoding="utf-8") as f:
            f.write("# message\n" + text_format.MessageToString(req, as_utf8=True))

    return record


def run_worker(settings: WorkerSettings) -> int:
    """Process entry point: serve until a signal; returns the exit code."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it: never die of an early SIGHUP
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def main() -> int:
        stop = asyncio.Event()
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if signals > 1:
                log.warning("second signal: exiting now")
                os._exit(1)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        task = asyncio.create_task(serve(settings, stop, ready, _announce))
        ready_wait = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            ready_wait.cancel()
            task.result()  # raises the start-up error
            return 0
        await task
        return 0

    try:
        return asyncio.run(main())
    except ConfigError as e:
        print(f"invalid config:\n{e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"worker {settings.index}: {e}", file=sys.stderr)
        return 3
