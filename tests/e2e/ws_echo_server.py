"""A WebSocket echo server (the `websockets` package's asyncio server) for tests/e2e/test_websocket.py.

`python -m tests.e2e.ws_echo_server --port P --id NAME [--host 127.0.0.1]`: prints `ready <port>` once
listening. On each upgraded connection it first sends one text message, the JSON
`{"server": NAME, "path": <request path with query>, "headers": {<the upgrade request's headers,
lower-case>}}` (so a test sees which endpoint the gateway chose and what reached it), then echoes every
message back as it came (text as text, binary as binary). The text message `close-me` makes the
server close with code 4000 and reason `bye from NAME`. A plain HTTP request (no upgrade) is answered
200 with `plain http from NAME` (health checks, and routes with `websocket.requireUpgrade: false`).
Stopped by SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

MAX_MESSAGE = 16 * 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--id", required=True)
    args = ap.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.id))
    return 0


async def _serve(host: str, port: int, ident: str) -> None:
    async def handler(ws: ServerConnection) -> None:
        req = ws.request
        headers = {k.lower(): v for k, v in req.headers.raw_items()} if req is not None else {}
        await ws.send(json.dumps({"server": ident, "path": req.path if req else "", "headers": headers}))
        async for message in ws:
            if message == "close-me":
                await ws.close(4000, f"bye from {ident}")
                return
            await ws.send(message)

    def process_request(conn: ServerConnection, request: Request) -> Response | None:
        if "websocket" not in request.headers.get("upgrade", "").lower():
            body = f"plain http from {ident}\n".encode()
            return Response(200, "OK", Headers([("content-type", "text/plain"), ("content-length", str(len(body)))]),
                            body)
        return None

    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    async with serve(handler, host, port, process_request=process_request, max_size=MAX_MESSAGE,
                     compression=None):
        print(f"ready {port}", flush=True)
        await stop


if __name__ == "__main__":
    sys.exit(main())
