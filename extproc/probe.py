"""Backend probes: does each endpoint answer its health path over the protocol the config declares?

What: `probe_backend(backend, timeout)` sends `GET <health_path>` to every endpoint, over HTTP/1.1
for `protocol: http` or HTTP/2 with prior knowledge (h2c, the transport gRPC uses) for
`protocol: grpc`, and reports per endpoint whether the answer came back, in that protocol, with a
2xx status ("protocol negotiation"). A health path shaped like a gRPC method
(`/inference.GRPCInferenceService/ServerReady`, the default for KServe backends over gRPC) is
called as gRPC instead, and must answer grpc-status 0 (and `ready: true`). A backend is ok when at
least one endpoint is.
Why: a backend that is up but speaks another protocol than Envoy's cluster is configured for fails
every request; this catches it in one operator request.
Cost: one short connection per endpoint, all in parallel, bounded by `timeout`; only on the health
route, never on inference requests.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

_EXPECTED = {"http": "HTTP/1.1", "grpc": "HTTP/2"}


async def _get_http1(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str) -> tuple[str, int]:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nUser-Agent: adapter-probe\r\n\r\n".encode())
    await writer.drain()
    line = (await reader.readline()).decode("latin-1").split()
    if len(line) < 2 or not line[0].startswith("HTTP/") or not line[1].isdigit():
        raise ConnectionError(f"not an HTTP/1.1 answer: {' '.join(line)[:60]!r}")
    return line[0], int(line[1])


def _h2c_open(host: str, headers: list[tuple[str, str]], body: bytes | None) -> tuple[object, int]:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    pseudo = [h for h in headers if h[0].startswith(":")] + [(":scheme", "http"), (":authority", host)]
    regular = [("user-agent", "adapter-probe")] + [h for h in headers if not h[0].startswith(":")]
    conn.send_headers(sid, pseudo + regular, end_stream=body is None)  # pseudo-headers must come first
    if body is not None:
        conn.send_data(sid, body, end_stream=True)
    return conn, sid


async def _h2c_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn, sid: int):
    """Send what `conn` has queued, then yield the events of stream `sid` as they arrive."""
    writer.write(conn.data_to_send())
    await writer.drain()
    while True:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("connection closed before an HTTP/2 answer (does it speak h2c?)")
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            raise ConnectionError(f"not an HTTP/2 answer: {type(e).__name__}") from None
        writer.write(conn.data_to_send())
        for ev in events:
            if isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                raise ConnectionError(f"HTTP/2 stream refused: {type(ev).__name__}")
            if getattr(ev, "stream_id", None) == sid:
                yield ev


async def _get_h2c(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str) -> tuple[str, int]:
    conn, sid = _h2c_open(host, [(":method", "GET"), (":path", path)], None)
    async for ev in _h2c_events(reader, writer, conn, sid):
        if isinstance(ev, h2.events.ResponseReceived):
            return "HTTP/2", int(dict(ev.headers).get(":status", "0"))
    raise ConnectionError("no HTTP/2 response")  # pragma: no cover - the generator raises first


async def _grpc_unary_h2c(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                          path: str) -> tuple[str, int]:
    """A gRPC call with an empty request message (a KServe `ServerReady`): 200 when grpc-status is 0."""
    conn, sid = _h2c_open(host, [(":method", "POST"), (":path", path), ("content-type", "application/grpc"),
                                 ("te", "trailers")], b"\x00\x00\x00\x00\x00")  # one empty message
    fields: dict[str, str] = {}
    payload = b""
    async for ev in _h2c_events(reader, writer, conn, sid):
        if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            fields.update(dict(ev.headers))
        elif isinstance(ev, h2.events.DataReceived):
            payload += ev.data
            conn.acknowledge_received_data(ev.flow_controlled_length, sid)
        elif isinstance(ev, h2.events.StreamEnded):
            if fields.get("grpc-status", "") != "0":
                raise ConnectionError(f"gRPC {path} failed: grpc-status {fields.get('grpc-status', 'missing')} "
                                      f"{fields.get('grpc-message', '')}".strip())
            # KServe's ServerReady/ModelReady answer `ready: true` as field 1 = 1
            not_ready = path.endswith("Ready") and payload[5:7] != b"\x08\x01"
            return "HTTP/2", 503 if not_ready else 200
    raise ConnectionError("no gRPC response")  # pragma: no cover


def is_grpc_method(path: str) -> bool:
    """`/package.Service/Method`: probed with a gRPC call instead of an HTTP GET."""
    parts = path.split("/")
    return len(parts) == 3 and not parts[0] and "." in parts[1] and parts[2].isidentifier()


async def probe_endpoint(host: str, port: int, path: str, protocol: str, timeout: float) -> dict[str, Any]:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    started = time.perf_counter()
    result: dict[str, Any] = {"address": address, "protocol": protocol}
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            if protocol == "grpc":
                get = _grpc_unary_h2c if is_grpc_method(path) else _get_h2c
            else:
                get = _get_http1
            version, status = await get(reader, writer, address, path)
        result["latency_ms"] = round((time.perf_counter() - started) * 1000, 2)
        result["http_version"] = version
        if status >= 300:
            result.update(status="down", error=f"{path} answered HTTP {status}")
        else:
            result["status"] = "ok"
    except TimeoutError:
        result.update(status="down", error=f"no answer within {timeout:g}s")
    except OSError as e:
        reason = os.strerror(e.errno).lower() if e.errno else (str(e) or type(e).__name__)
        result.update(status="down", error=reason)
    except (ConnectionError, ValueError) as e:
        result.update(status="down", error=str(e) or type(e).__name__)
    finally:
        if writer is not None:
            writer.close()
    return result


async def probe_backend(backend: Any, timeout: float) -> dict[str, Any]:
    results = await asyncio.gather(
        *(probe_endpoint(h, p, backend.health_path, backend.protocol, timeout) for h, p in backend.endpoints)
    )
    ok = any(r["status"] == "ok" for r in results)
    return {"status": "ok" if ok else "down", "kind": backend.kind, "protocol": backend.protocol,
            "endpoints": list(results)}
