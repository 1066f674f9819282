"""The KServe v2 HTTP front end of the ONNX Runtime server (raw ASGI, uvicorn or hypercorn).

What: :class:`OrtHttpApp` maps KServe v2 / Triton HTTP paths onto :class:`.service.InferenceService`;
:func:`serve` runs it (and, when asked, the gRPC front end) until a shutdown event.

Endpoints
    ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2`` (server metadata, extensions),
    ``GET /v2/models/{m}[/versions/{v}]`` (metadata plus ``precision``, ``execution_providers``,
    ``batching``), ``GET .../ready``, ``GET .../config`` (Triton-style), ``POST .../infer`` (JSON
    tensors and the binary tensor extension), ``POST /v2/repository/index`` (body ``{"ready": true}``
    optional), ``POST /v2/repository/models/{m}/load|unload``, ``GET|POST
    /admin/models/{m}[/versions/{v}]/batching`` (read or change ``max_batch_size`` /
    ``max_queue_delay_us`` at run time; kept off ``/v2`` so a gateway that forwards ``/v2/*`` does
    not expose it; a POST may carry ``owner`` and ``lease_ms``: while a lease is held, changes by anyone
    else get 409, so only one controller acts on a model, see :class:`_BatchingLeases`), ``GET /metrics``
    (Prometheus text, the server's own registry).
    Errors are ``{"error": "..."}``: 400 bad tensor (names the input), 404 unknown model, version
    or path, 405 wrong method, 413 body too large, 503 not ready, 500 the model failed to run.
    Request bodies may be gzip or deflate encoded (``Content-Encoding``), as tritonclient can send.
    An inference answer names the precision variant that computed it and why it is not the preferred
    one: response parameters ``precision`` and ``precision_fallback`` (``"int8:missing"``), and the
    headers ``x-inference-precision`` / ``x-inference-precision-fallback`` (a gateway that passes the
    response through untouched still shows them).

Serving: uvicorn with httptools by default (HTTP/1.1; measured here about 70 us of CPU per request
for a trivial app against about 550 us under hypercorn, which made hypercorn the bottleneck of
small models); ``http_server="hypercorn"`` serves HTTP/1.1 and cleartext HTTP/2 (h2c) on one
port when a client needs HTTP/2.

Why: a framework-free ASGI app keeps the per-request cost to the routing we need.
Cost: per request one path split, one body join, the codec and the service; nothing blocks the
event loop (inference runs in the service's thread pool).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson

from backends.asgi_body import BodyTooLarge, Disconnected, read_body

from .codec import encode_infer_response, error_body, json_body, parse_infer_request
from .service import InferenceService, ServiceError
from .tensors import TensorError

__all__ = ["OrtHttpApp", "ServerSettings", "serve"]

log = logging.getLogger("backends.onnxruntime.server")

SHUTDOWN_GRACE_S = 0.5
HTTP_SERVERS = ("uvicorn", "hypercorn")
_JSON = b"application/json"
_OCTETS = b"application/octet-stream"
PRECISION_HEADER = b"x-inference-precision"  # the variant that computed the answer: int8, fp16, fp32
PRECISION_FALLBACK_HEADER = b"x-inference-precision-fallback"  # "int8:missing,fp16:load_error"; absent: none
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """One server process: where the models are and where to listen."""

    repository: Path
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None  # None: no gRPC front end; 0: a free port
    threads: int | None = None  # inference thread pool size (default: CPU count, at least 2)
    strict_readiness: bool = False  # /v2/health/ready only when every model is ready
    max_body_bytes: int = 64 * 1024 * 1024
    max_queue: int = 4096  # queued requests per model version before 503
    http_server: str = "uvicorn"  # "uvicorn" (httptools, HTTP/1.1, fastest) or "hypercorn" (HTTP/1.1 + h2c)
    log_level: str = "warning"


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def _read_body(receive: Callable, limit: int) -> bytes:
    try:
        return await read_body(receive, limit)
    except BodyTooLarge as e:
        raise _HTTPError(413, str(e)) from None


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise _HTTPError(415, f"unsupported Content-Encoding {encoding!r} (gzip, deflate)")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise _HTTPError(400, f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise _HTTPError(413, f"decompressed request body larger than {limit} bytes")
    return out


async def _send(send: Callable, status: int, body: bytes, content_type: bytes,
                headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


MAX_LEASE_MS = 60_000


class _BatchingLeases:
    """Who may change a model's batching: ``POST .../batching`` with ``{"owner": "ctl-a", "lease_ms": 1000}``
    takes (or renews) the model's lease for ``lease_ms`` (0 releases it); while it is held, a change
    from any other owner, or from none, is refused with 409 naming the holder. Expired leases are free.
    Why: several gateway replicas may run a batch controller for the same server; the server is the
    one place that sees all of them, so it arbitrates (issue 14: one controller per endpoint acts).
    Cost: a dict lookup per admin call; nothing per inference request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[str, float]] = {}

    def holder(self, model: str) -> tuple[str, float] | None:
        held = self._held.get(model)
        if held is None or held[1] <= self._clock():
            return None
        return held[0], held[1] - self._clock()

    def claim(self, model: str, owner: Any, lease_ms: Any) -> None:
        if owner is not None and (not isinstance(owner, str) or not owner or len(owner) > 200):
            raise _HTTPError(400, "'owner' must be a non-empty string of at most 200 characters")
        if lease_ms is not None and (isinstance(lease_ms, bool) or not isinstance(lease_ms, int)
                                     or not 0 <= lease_ms <= MAX_LEASE_MS):
            raise _HTTPError(400, f"'lease_ms' must be an integer in [0, {MAX_LEASE_MS}]")
        if lease_ms is not None and owner is None:
            raise _HTTPError(400, "'lease_ms' needs an 'owner'")
        held = self.holder(model)
        if held is not None and held[0] != owner:
            raise _HTTPError(409, f"batching of model {model!r} is held by {held[0]!r} for another "
                                  f"{held[1] * 1000:.0f} ms")
        if owner is not None:
            if lease_ms == 0:
                self._held.pop(model, None)
            else:
                self._held[model] = (owner, self._clock() + (lease_ms if lease_ms is not None else 1000) / 1000)


class OrtHttpApp:
    """The ASGI application; the service must be started (models loaded) before traffic counts."""

    def __init__(self, service: InferenceService, max_body_bytes: int = 64 * 1024 * 1024) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.leases = _BatchingLeases()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        try:
            body = await _read_body(receive, self.max_body_bytes)
            status, payload, content_type, headers = await self._dispatch(scope, body)
        except Disconnected:
            return
        except _HTTPError as exc:
            status, payload, content_type, headers = exc.status, error_body(exc.message), _JSON, ()
        except ServiceError as exc:
            status, payload, content_type, headers = exc.status, error_body(exc.message), _JSON, ()
        await _send(send, status, payload, content_type, headers)

    # -- routing -----------------------------------------------------------------------------------

    async def _dispatch(self, scope: dict, body: bytes) -> tuple[int, bytes, bytes, Iterable]:
        method = scope["method"]
        parts = [p for p in scope["path"].split("/") if p]
        if parts[:1] == ["v2"]:
            rest = parts[1:]
            if not rest:
                _allow(method, "GET")
                return 200, json_body(self.service.server_metadata()), _JSON, ()
            if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
                _allow(method, "GET")
                ok = self.service.live() if rest[1] == "live" else self.service.ready()
                return (200 if ok else 503), json_body({rest[1]: ok}), _JSON, ()
            if rest[0] == "repository":
                return await self._repository(method, rest[1:], body)
            if rest[0] == "models" and len(rest) >= 2:
                name, version, op = _model_path(rest[1:])
                return await self._model(method, name, version, op, scope, body)
        elif parts[:2] == ["admin", "models"] and len(parts) >= 4:
            name, version, op = _model_path(parts[2:])
            if op == "batching":
                return self._batching(method, name, version, body)
        elif parts == ["metrics"]:
            _allow(method, "GET")
            return 200, self.service.metrics.exposition(), _PROMETHEUS, ()
        raise _HTTPError(404, f"no such endpoint: {method} {scope['path']}")

    async def _repository(self, method: str, rest: list[str], body: bytes):
        _allow(method, "POST")
        if rest == ["index"]:
            doc = _json_object(body)
            ready_only = doc.get("ready", False)
            if not isinstance(ready_only, bool):
                raise _HTTPError(400, "'ready' must be a boolean")
            return 200, json_body(self.service.repository_index(ready_only)), _JSON, ()
        if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
            _json_object(body)  # parameters (config overrides, files) are not supported; accept {}
            if rest[2] == "load":
                await self.service.load_model(rest[1])
            else:
                await self.service.unload_model(rest[1])
            return 200, b"", _JSON, ()
        raise _HTTPError(404, f"no such repository endpoint: /v2/repository/{'/'.join(rest)}")

    async def _model(self, method: str, name: str, version: str | None, op: str, scope: dict, body: bytes):
        if op == "":
            _allow(method, "GET")
            return 200, json_body(self.service.model_metadata(name, version)), _JSON, ()
        if op == "ready":
            _allow(method, "GET")
            ready = self.service.model_ready(name, version)
            return (200 if ready else 503), json_body({"name": name, "ready": ready}), _JSON, ()
        if op == "config":
            _allow(method, "GET")
            return 200, json_body(self.service.model_config(name, version)), _JSON, ()
        if op == "infer":
            _allow(method, "POST")
            return await self._infer(name, version, scope, body)
        raise _HTTPError(404, f"no such model endpoint: {op!r}")

    def _batching(self, method: str, name: str, version: str | None, body: bytes):
        if method == "GET":
            return 200, json_body(self._with_owner(name, self.service.batching(name, version))), _JSON, ()
        _allow(method, "POST")
        changes = _json_object(body)
        owner, lease_ms = changes.pop("owner", None), changes.pop("lease_ms", None)
        self.service.resolve(name, version)  # 404 / 503 before a lease is taken
        self.leases.claim(name, owner, lease_ms)
        result = self.service.set_batching(name, version, **changes)
        return 200, json_body(self._with_owner(name, result)), _JSON, ()

    def _with_owner(self, name: str, doc: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        held = self.leases.holder(name)
        for entry in doc.values():
            entry["owner"] = held[0] if held is not None else None
        return doc

    async def _infer(self, name: str, version: str | None, scope: dict, body: bytes):
        started = time.perf_counter()
        status = "success"
        try:
            self.service.resolve(name, version)  # 404 / 503 before spending time on the body
            header_length, encoding = None, ""
            for key, value in scope["headers"]:
                if key == b"inference-header-content-length":
                    try:
                        header_length = int(value)
                    except ValueError:
                        raise _HTTPError(400, "Inference-Header-Content-Length is not an integer") from None
                elif key == b"content-encoding":
                    encoding = value.decode("latin-1").strip().lower()
            if encoding:
                body = _decompress(body, encoding, self.max_body_bytes)
            try:
                request = parse_infer_request(body, header_length)
            except TensorError as exc:
                raise _HTTPError(400, str(exc)) from None
            wanted = [o.name for o in request.outputs] if request.outputs is not None else None
            model, outputs = await self.service.infer(
                name, version, {t.name: (t.datatype, t.array) for t in request.inputs}, wanted)
            binary = ([o.binary for o in request.outputs] if request.outputs is not None
                      else [request.binary_output] * len(outputs))
            precision, fallback = model.served_precision()
            parameters = {"precision": precision}
            if fallback:
                parameters["precision_fallback"] = fallback
            payload, json_length = encode_infer_response(
                name, model.version, request.id,
                ((n, a, b) for (n, a), b in zip(outputs, binary)), parameters)
        except ServiceError as exc:
            status = exc.label
            raise
        except _HTTPError as exc:
            status = "bad_request" if exc.status < 500 else "error"
            raise
        except Exception as exc:
            status = "error"
            log.exception("model %s: inference failed", name)
            raise _HTTPError(500, f"inference failed: {exc}") from None
        finally:
            self.service.record_request(name, status, time.perf_counter() - started)
        headers = [(PRECISION_HEADER, precision.encode())]
        if fallback:
            headers.append((PRECISION_FALLBACK_HEADER, fallback.encode()))
        if json_length is None:
            return 200, payload, _JSON, tuple(headers)
        return 200, payload, _OCTETS, ((b"inference-header-content-length", str(json_length).encode()), *headers)


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise _HTTPError(405, f"method {method} not allowed here (allowed: {', '.join(allowed)})")


def _model_path(parts: list[str]) -> tuple[str, str | None, str]:
    """``m``, ``m/op``, ``m/versions/v``, ``m/versions/v/op`` -> (model, version or None, op)."""
    name, rest = parts[0], parts[1:]
    version = None
    if len(rest) >= 2 and rest[0] == "versions":
        version, rest = rest[1], rest[2:]
    if len(rest) > 1:
        raise _HTTPError(404, f"no such model endpoint: {'/'.join(parts)}")
    return name, version, rest[0] if rest else ""


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _HTTPError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _HTTPError(400, "body must be a JSON object")
    return doc


# -- serving ---------------------------------------------------------------------------------------


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


async def _serve_hypercorn(app: OrtHttpApp, sock: socket.socket, settings: ServerSettings,
                           shutdown_event: asyncio.Event) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from backends import hypercorn_drain

    hypercorn_drain.install()  # finish the HTTP/2 responses begun when the stop came
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the listening socket from here
    config.loglevel = settings.log_level.upper()
    config.accesslog = None
    config.graceful_timeout = SHUTDOWN_GRACE_S
    config.h2_max_concurrent_streams = 1024
    reaper = asyncio.create_task(hypercorn_drain.reap_after(  # the hard stop behind hypercorn's
        shutdown_event, config.graceful_timeout + 0.5, protect={asyncio.current_task()}))
    try:
        await hypercorn_serve(app, config, shutdown_trigger=shutdown_event.wait)
    finally:
        reaper.cancel()
        await asyncio.gather(reaper, return_exceptions=True)


async def _serve_uvicorn(app: OrtHttpApp, sock: socket.socket, settings: ServerSettings,
                         shutdown_event: asyncio.Event) -> None:
    import contextlib

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # signals belong to the caller, who sets shutdown_event
            yield

    try:
        import httptools  # noqa: F401

        http = "httptools"
    except ImportError:  # pragma: no cover - httptools is pinned next to uvicorn
        http = "h11"
    config = uvicorn.Config(app, http=http, lifespan="off", access_log=False, log_level=settings.log_level,
                            proxy_headers=False, server_header=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, backlog=1024)
    server = _Server(config)

    async def stop_when_asked() -> None:
        await shutdown_event.wait()
        server.should_exit = True

    stopper = asyncio.get_running_loop().create_task(stop_when_asked())
    try:
        await server.serve(sockets=[sock])
    finally:
        stopper.cancel()
        sock.close()


async def serve(settings: ServerSettings, shutdown_event: asyncio.Event, *,
                on_ready: Callable[[str, int, int | None], None] | None = None,
                service: InferenceService | None = None) -> None:
    """Load the repository, listen, call ``on_ready(host, http_port, grpc_port)``, serve until
    ``shutdown_event`` is set, then stop within about a second (in-flight requests get
    :data:`SHUTDOWN_GRACE_S`)."""
    if settings.http_server not in HTTP_SERVERS:
        raise ValueError(f"http_server must be one of {', '.join(HTTP_SERVERS)}")
    service = service or InferenceService(settings.repository, threads=settings.threads,
                                          strict_readiness=settings.strict_readiness,
                                          max_queue=settings.max_queue)
    await service.start()
    sock = _listening_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    app = OrtHttpApp(service, settings.max_body_bytes)

    grpc_server = None
    grpc_port = None
    try:
        if settings.grpc_port is not None:
            from .grpc_server import start_grpc_server

            grpc_server, grpc_port = await start_grpc_server(service, settings.host, settings.grpc_port)
        if on_ready is not None:
            on_ready(host, port, grpc_port)
        if settings.http_server == "hypercorn":
            await _serve_hypercorn(app, sock, settings, shutdown_event)
        else:
            await _serve_uvicorn(app, sock, settings, shutdown_event)
    finally:
        if grpc_server is not None:
            await grpc_server.stop(SHUTDOWN_GRACE_S)
        await service.stop()
        if sock.fileno() != -1:
            sock.close()
    log.info("onnxruntime server on %s:%d stopped", host, port)
