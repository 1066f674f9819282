"""Stack `aio` (and `aio-uvloop`, `aio-opts`): grpc.aio with the generated servicer, what extproc/server.py runs.

`ExternalProcessorServicer.Process` as an async generator over the parsed requests, each answered
with the prebuilt reply message of its phase (common.REPLIES); grpc.aio serializes it. Server
options: the gateway's own (extproc.server.grpc_options), or with `--options tuned` those plus
`grpc.optimization_target=latency` and `grpc.http2.bdp_probe=0` (bench_stacks' `aio-opts` variant).
`--loop asyncio` (default: the stdlib event loop) or `uvloop` (what run_worker installs today).
grpc.aio's I/O runs on gRPC core's own poller (a completion queue polled from its Cython layer and
handed to the loop), so the event loop only schedules the coroutines.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import grpc  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_health.v1.health import aio as health_aio  # noqa: E402  # type: ignore[attr-defined]

TUNED = [("grpc.optimization_target", "latency"), ("grpc.http2.bdp_probe", 0)]


def server_options(tuned: bool = False) -> list[tuple[str, object]]:
    from extproc.server import grpc_options

    return [*grpc_options(8 << 20), *(TUNED if tuned else [])]


class NoopServicer(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):
        replies = common.REPLIES
        async for req in request_iterator:
            phase = req.WhichOneof("request")
            if phase is not None:
                yield replies[phase]


async def serve_aio(ports: list[int], host: str, add, options) -> None:
    """Bind a grpc.aio server on every port (one server: the ports share one process, as a worker's
    one port does), register the stack's handler with `add(server)` and the health service, serve until
    SIGTERM/SIGINT."""
    server = grpc.aio.server(options=options)
    add(server)
    hs = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for p in ports:
        if not server.add_insecure_port(f"{host}:{p}"):
            raise OSError(f"cannot bind {host}:{p}")
    await server.start()
    for name in ("", common.SERVICE):
        await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    common.ready()
    await stop.wait()
    await server.stop(0)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    ap.add_argument("--options", choices=("gateway", "tuned"), default="gateway")
    args = ap.parse_args()
    if args.loop == "uvloop":
        import uvloop

        uvloop.install()
    add = lambda server: pb_grpc.add_ExternalProcessorServicer_to_server(NoopServicer(), server)  # noqa: E731
    asyncio.run(serve_aio(args.port, args.host, add, server_options(args.options == "tuned")))


if __name__ == "__main__":
    main()
