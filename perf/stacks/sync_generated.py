"""Stack `sync`: the synchronous grpc server (grpc.server + ThreadPoolExecutor), generated servicer.

Each stream holds one pool thread for its whole life (the servicer's generator runs on it), so the
pool has `--threads` (default 64) threads, above the benchmark's 32 concurrent streams plus Envoy's
health checks; every message is handed between gRPC core's poller thread and that thread under the
GIL. Same server options as `aio` (the gateway's).
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import grpc  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402


class NoopServicer(pb_grpc.ExternalProcessorServicer):
    def Process(self, request_iterator, context):
        replies = common.REPLIES
        for req in request_iterator:
            phase = req.WhichOneof("request")
            if phase is not None:
                yield replies[phase]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--threads", type=int, default=64)
    args = ap.parse_args()
    from aio_generated import server_options

    server = grpc.server(ThreadPoolExecutor(max_workers=args.threads), options=server_options())
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopServicer(), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for p in args.port:
        if not server.add_insecure_port(f"{args.host}:{p}"):
            raise OSError(f"cannot bind {args.host}:{p}")
    server.start()
    for name in ("", common.SERVICE):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    common.ready()
    while not stop.wait(1):
        pass
    server.stop(0)


if __name__ == "__main__":
    main()
