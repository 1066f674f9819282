"""Stage `model-metadata`: fetch (and cache) a KServe model's metadata for tensor routes.

What: before a tensor route encodes the client's JSON into input tensors, this stage makes sure
the model's metadata (`GET /v2/models/{model}`: input names, datatypes, shapes) is known, so
encoding can check shapes and types and name the bad input in a 400. It asks the endpoint dispatch
picked (else the backend's first). Metadata is cached per (backend, model) for `ttl` seconds in the
worker's runtime, so a config reload does not empty the cache; a fetch failure is logged once and the request goes on
without it (datatypes are then inferred from the JSON and the backend has the last word); a 404
from the backend is a 404 to the client.
Cost: one HTTP/1.1 request per model per `ttl` (bounded by `timeout`); a dict lookup otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from extproc.errors import reject
from extproc.stages.dispatch import backend_of
from extproc.types import HttpMessage, RequestState, Verdict

log = logging.getLogger(__name__)


async def http_get_json(host: str, port: int, path: str, timeout: float) -> tuple[int, object]:
    """A minimal HTTP/1.1 GET (Connection: close) returning (status, parsed JSON or None)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: application/json\r\n"
                         "Connection: close\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    try:
        return status, orjson.loads(body)
    except orjson.JSONDecodeError:
        return status, None


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


class ModelMetadata:
    name = "model-metadata"

    def __init__(self, ttl: float = 60.0, timeout: float = 0.5):
        self.ttl, self.timeout = ttl, timeout
        self._own_cache: dict = {}  # used only without a runtime (unit tests)
        self._own_warned: dict = {}

    async def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        route = state.route
        backend = backend_of(state)
        runtime = state.runtime
        cache = runtime.cache("model-metadata") if runtime is not None else self._own_cache
        warned = runtime.cache("model-metadata-warned") if runtime is not None else self._own_warned
        key = (backend.name, route.model)
        hit = cache.get(key)
        now = time.monotonic()
        if hit is not None and now - hit[0] < self.ttl:
            state.attrs["model_metadata"] = hit[1]
            return None
        host, port = _endpoint(state, backend)
        try:
            status, meta = await http_get_json(host, port, f"/v2/models/{route.model}", self.timeout)
        except (OSError, TimeoutError, ValueError, IndexError) as e:
            if key not in warned:
                warned[key] = True  # pragma: no mutate (only the key's presence is read)
                log.warning("cannot fetch metadata of model %s from %s (%s); encoding without it", route.model,
                            backend.name, e)
            return None
        if status == 404:
            return reject(404, "model_not_found", f"backend {backend.name} does not serve model {route.model}",
                          backend=backend.name)
        if status == 200 and isinstance(meta, dict):
            cache[key] = (now, meta)
            state.attrs["model_metadata"] = meta
        return None


def _endpoint(state: RequestState, backend) -> tuple[str, int]:
    if state.endpoint is not None:
        host, _, port = state.endpoint.rpartition(":")
        return host.strip("[]"), int(port)
    return backend.endpoints[0]
