"""Stage `model-metadata` against a real HTTP server on a local port: chunked and plain answers, the
endpoint dispatch picked, a 404 that becomes the client's, answers that are not metadata, an
unreachable backend logged once, and the per-(backend, model) cache."""

from __future__ import annotations

import asyncio
import logging

from extproc.config.loader import load_file
from extproc.runtime import Runtime
from extproc.stack import free_port
from extproc.stages.model_metadata import ModelMetadata
from extproc.types import HttpMessage, Phase, Reject, RequestState

META = b'{"name": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]}'


class Backend:
    """An HTTP/1.1 server answering GET /v2/models/<model> as `answers[model]` says; counts requests."""

    def __init__(self, answers: dict[str, bytes]):
        self.answers, self.paths, self.server = answers, [], None

    async def _handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ", 2)[1].decode()
        self.paths.append(path)
        writer.write(self.answers[path.rsplit("/", 1)[1]])
        await writer.drain()
        writer.close()

    async def __aenter__(self):
        self.port = free_port()
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        self.server.close()
        await self.server.wait_closed()


def plain(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def chunked(body: bytes) -> bytes:
    parts = [body[:10], body[10:]]
    chunks = b"".join(f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n" for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"


def state_for(write_config, port: int, model: str, runtime=None, endpoint: str | None = None) -> RequestState:
    snap = load_file(write_config(f"""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {{name: meta}}
        spec:
          backends: [{{name: ort, kind: onnxruntime, protocol: http, endpoints: ["127.0.0.1:{port}"]}}]
          routes:
            - {{path: /score, kind: tensor, target: ort, model: {model}, request: '{{"x": [$.x]}}',
                transform: '{{"y": $.output.y}}'}}
        """))
    route = snap.routes["score"]
    return RequestState(snapshot=snap, route=route, started=0.0, runtime=runtime, endpoint=endpoint)


BODY = HttpMessage(Phase.REQUEST_BODY, body=b'{"x": [1, 2]}', end_of_stream=True)


async def test_chunked_metadata_is_read_and_cached_per_backend_and_model(write_config):
    async with Backend({"m": chunked(META)}) as backend:
        stage, runtime = ModelMetadata(ttl=60), Runtime()
        first = state_for(write_config, backend.port, "m", runtime)
        assert await stage.on_request_body(first, BODY) is None
        assert first.attrs["model_metadata"]["inputs"][0]["shape"] == [-1, 2]
        again = state_for(write_config, backend.port, "m", runtime)
        assert await stage.on_request_body(again, BODY) is None
        assert again.attrs["model_metadata"] == first.attrs["model_metadata"]
        assert backend.paths == ["/v2/models/m"]  # the second came from the cache


async def test_the_endpoint_dispatch_picked_is_asked(write_config):
    async with Backend({"m": plain("200 OK", META)}) as picked:
        state = state_for(write_config, free_port(), "m", endpoint=f"[127.0.0.1]:{picked.port}")
        assert await ModelMetadata().on_request_body(state, BODY) is None
        assert picked.paths == ["/v2/models/m"] and state.attrs["model_metadata"]["name"] == "m"


async def test_a_404_is_the_clients_and_other_answers_leave_the_request_alone(write_config):
    answers = {"gone": plain("404 Not Found", b'{"error": "no"}'), "html": plain("200 OK", b"<html>"),
               "down": plain("503 Service Unavailable", b'{"error": "loading"}')}
    async with Backend(answers) as backend:
        stage = ModelMetadata()
        verdict = await stage.on_request_body(state_for(write_config, backend.port, "gone"), BODY)
        assert isinstance(verdict, Reject) and (verdict.status, verdict.code) == (404, "model_not_found")
        for model in ("html", "down"):  # not JSON, not 200: no metadata, not cached, no error
            state = state_for(write_config, backend.port, model)
            assert await stage.on_request_body(state, BODY) is None and "model_metadata" not in state.attrs
        assert await stage.on_request_body(state_for(write_config, backend.port, "down"), BODY) is None
        assert backend.paths.count("/v2/models/down") == 2


async def test_an_unreachable_backend_is_logged_once_and_the_request_goes_on(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.stages.model_metadata")
    stage, port = ModelMetadata(timeout=0.5), free_port()  # nothing listens there
    for _ in range(3):
        state = state_for(write_config, port, "m")
        assert await stage.on_request_body(state, BODY) is None and "model_metadata" not in state.attrs
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot fetch metadata of model m from ort" in warnings[0]

