"""One processor worker: a grpc.aio ext_proc server plus gRPC health, with an ordered lifecycle.

What: `run_worker(settings)` loads the config, binds the port (failing loudly if it cannot),
serves `ExternalProcessor` and `grpc.health.v1.Health`, then prints `ready` on stdout for the
supervisor. SIGHUP reloads the config: a valid file replaces the snapshot atomically, an invalid
one is logged and the last good snapshot stays. SIGTERM/SIGINT: health goes NOT_SERVING (Envoy's
health checks stop sending new streams), a short drain, then `server.stop(grace)` lets open streams
finish for the rest of the grace period and cancels the remainder. A second signal exits at once.
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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from prometheus_client import CollectorRegistry

from extproc.config.loader import ConfigError, load_file
from extproc.metrics import ProcessorMetrics
from extproc.stream import ConfigRef, ExtProcService

log = logging.getLogger("extproc.worker")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


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


def grpc_options(max_message: int) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),  # two workers must never silently share a port
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_concurrent_streams", 100_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ]


async def serve(settings: WorkerSettings, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
    overrides = dict(settings.endpoints) or None
    snapshot = load_file(settings.config_path, endpoints=overrides)
    config = ConfigRef(snapshot)
    metrics = ProcessorMetrics(CollectorRegistry(auto_describe=True))
    metrics.config_generation.set(snapshot.generation)
    # Bodies are buffered up to a route's limit; leave room for protobuf framing.
    max_message = max(r.max_body_bytes for r in snapshot.routes.values()) * 2 + (1 << 20)
    server = grpc.aio.server(options=grpc_options(max_message))
    service = ExtProcService(config, metrics, _recorder(settings.record_dir, settings.index))
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(f"{settings.address}:{settings.port}")
    except RuntimeError:  # grpcio raises instead of returning 0 in recent versions
        bound = 0
    if not bound:
        raise OSError(f"cannot bind {settings.address}:{settings.port} (in use, or not a local address)")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("worker %d serving on %s:%d (config %s generation %d)", settings.index, settings.address,
             settings.port, snapshot.name, snapshot.generation)
    if ready is not None:
        ready.set()

    loop = asyncio.get_running_loop()
    generation = snapshot.generation

    def reload() -> None:
        nonlocal generation
        try:
            new = load_file(settings.config_path, generation=generation + 1, endpoints=overrides)
        except ConfigError as e:
            log.error("config reload refused, keeping generation %d:\n%s", generation, e)
            return
        generation = new.generation
        config.swap(new)
        metrics.config_generation.set(generation)
        log.info("config reloaded: generation %d (digest %s)", generation, new.digest)

    loop.add_signal_handler(signal.SIGHUP, reload)
    try:
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        for name in ("", SERVICE_NAME):
            await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        drain = min(settings.drain_delay, settings.shutdown_grace / 2)
        await asyncio.sleep(drain)
        await server.stop(max(settings.shutdown_grace - drain, 0.0))
        log.info("worker %d stopped", settings.index)


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
        task = asyncio.create_task(serve(settings, stop, ready))
        ready_wait = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            ready_wait.cancel()
            task.result()  # raises the start-up error
            return 0
        print(f"ready {settings.address}:{settings.port}", flush=True)
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
