"""A real HTTP server that echoes the form or multipart body it parsed (aiohttp's own parsers).

`EchoServer().start()` listens on 127.0.0.1 on a free port, in a thread with its own event loop;
`stop()` shuts it down. Every request gets JSON back: method, path with query, content type, and
``fields`` (urlencoded: ``[name, value]`` pairs, as ``request.post()`` parsed them) or ``parts``
(multipart: name, filename, content type and base64 of the bytes of each part, as aiohttp's
multipart reader parsed them) or ``raw`` (anything else, as text). Used by
tests/extproc/semantic/test_form_encoding.py and tests/e2e/test_form_tool_route.py.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import threading

import orjson
from aiohttp import web

from extproc.semantic import toolcall as tc
from extproc.semantic.form_encoding import MULTIPART, URLENCODED

__all__ = ["EchoServer"]


async def _echo(request: web.Request) -> web.Response:
    ctype = request.headers.get("Content-Type", "")
    out: dict = {"method": request.method, "path": request.path_qs, "content_type": ctype}
    if request.content_type == URLENCODED:
        form = await request.post()
        out["fields"] = [[k, v] for k, v in form.items()]
    elif request.content_type == MULTIPART:
        reader = await request.multipart()
        parts = []
        while (part := await reader.next()) is not None:
            data = await part.read()
            parts.append({"name": part.name, "filename": part.filename,
                          "content_type": part.headers.get("Content-Type"),
                          "data": base64.b64encode(data).decode()})
        out["parts"] = parts
    else:
        out["raw"] = (await request.read()).decode("utf-8", "replace")
    return web.json_response(out)


class EchoServer:
    """aiohttp on 127.0.0.1, a free port, in its own thread and event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="form-echo", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", _echo)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    def send(self, method: str, target: str, headers, body: bytes | None) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            hdrs = {k: v for k, v in headers if not k.startswith(":")}
            conn.request(method, target, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            assert resp.status == 200, data
            return orjson.loads(data)
        finally:
            conn.close()

    def call(self, tool, args) -> dict:
        req = tc.build_request(tool, tc.check_arguments(tool, args), f"http://127.0.0.1:{self.port}")
        return self.send(req.method, req.target, req.headers, req.body)
