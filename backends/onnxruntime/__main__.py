"""``python -m backends.onnxruntime``: run the ONNX Runtime KServe v2 server until SIGTERM or SIGINT.

What: parses the command line, optionally builds the demo repository first
(``--build-demo-models``), loads the repository, listens, and prints one line once it serves::

    onnxruntime server listening on http://127.0.0.1:8000

(followed by `` (grpc 127.0.0.1:8001)`` when ``--grpc-port`` is given).  SIGTERM or SIGINT stops
it within about a second; a second signal exits at once.
Why: the demo stack and tests start the server as a process, as a deployment would.
Cost: start-up is dominated by importing onnxruntime and loading the models (about a second).

Examples::

    python -m backends.onnxruntime --repository models --build-demo-models --port 8000
    python -m backends.onnxruntime --repository models --port 0 --grpc-port 0 --threads 4
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from .server import ServerSettings, serve


def _parse_args(argv: list[str] | None) -> tuple[ServerSettings, bool]:
    parser = argparse.ArgumentParser(prog="python -m backends.onnxruntime",
                                     description="ONNX Runtime model server (KServe v2 HTTP, optional gRPC).")
    parser.add_argument("--repository", type=Path, required=True, help="model repository folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="also serve KServe v2 gRPC on this port (0 picks a free one)")
    parser.add_argument("--build-demo-models", action="store_true",
                        help="write the demo models (fraud-mlp, risk-classifier) into the repository first")
    parser.add_argument("--threads", type=int, default=None,
                        help="inference thread pool size (default: CPU count, at least 2)")
    parser.add_argument("--strict-readiness", action="store_true",
                        help="/v2/health/ready answers 200 only when every model is ready")
    parser.add_argument("--http-server", choices=["uvicorn", "hypercorn"], default="uvicorn",
                        help="uvicorn: HTTP/1.1 with httptools (fastest); hypercorn: HTTP/1.1 and h2c")
    parser.add_argument("--max-queue", type=int, default=4096, help="queued requests per model before 503")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error", "critical"])
    args = parser.parse_args(argv)
    settings = ServerSettings(repository=args.repository, host=args.host, port=args.port,
                              grpc_port=args.grpc_port, threads=args.threads,
                              strict_readiness=args.strict_readiness, max_queue=args.max_queue,
                              http_server=args.http_server, log_level=args.log_level)
    return settings, args.build_demo_models


async def _run_until_signalled(settings: ServerSettings) -> None:
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if shutdown.is_set():
            os._exit(1)  # second signal: stop now
        shutdown.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)

    def announce(host: str, port: int, grpc_port: int | None) -> None:
        shown = f"[{host}]" if ":" in host else host
        extra = f" (grpc {shown}:{grpc_port})" if grpc_port is not None else ""
        print(f"onnxruntime server listening on http://{shown}:{port}{extra}", flush=True)

    await serve(settings, shutdown, on_ready=announce)


def main(argv: list[str] | None = None) -> int:
    settings, build_demo = _parse_args(argv)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # ORT warnings duplicate what the server logs
    if build_demo:
        from .models import write_demo_repository

        write_demo_repository(settings.repository)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        asyncio.run(_run_until_signalled(settings))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_run_until_signalled(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
