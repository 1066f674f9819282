"""Stage `model-metadata` against a real HTTP server on a local port: chunked and plain answers, the
endpoint dispatch picked, a 404 that becomes the client's, answers that are not metadata, an
unreachable backend logged once, and the per-(backend, model) cache."""

from __future__ import annotations

import asyncio
import logging

import orjson

from extproc.config.loader import load_file
from extproc.runtime import Runtime
from extproc.stack import free_port
from extproc.stages.model_metadata import ModelMetadata, _dechunk, http_get_json
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



class Recorder(Backend):
    """Also keeps each request's head as sent, to check the request line and headers byte for byte."""

    def __init__(self, answers: dict[str, bytes]):
        super().__init__(answers)
        self.heads: list[bytes] = []

    async def _handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        self.paths.append(head.split(b" ", 2)[1].decode())
        answer = self.answers[self.paths[-1].rsplit("/", 1)[1]]
        if answer is not None:  # None: accept, read the request, never answer (until closed)
            writer.write(answer)
            await writer.drain()
            writer.close()
        else:
            self.silent.append(writer)

    async def __aenter__(self):
        self.silent = []
        return await super().__aenter__()

    async def __aexit__(self, *exc):
        for w in self.silent:
            w.close()
        await super().__aexit__(*exc)


async def test_the_request_is_a_plain_http1_get_with_connection_close(write_config):
    async with Recorder({"m": plain("200 OK", META)}) as backend:
        state = state_for(write_config, backend.port, "m")
        assert await ModelMetadata().on_request_body(state, BODY) is None
        assert backend.heads == [f"GET /v2/models/m HTTP/1.1\r\nHost: 127.0.0.1:{backend.port}\r\n"
                                 "Accept: application/json\r\nConnection: close\r\n\r\n".encode()]
        assert state.attrs["model_metadata"] == orjson.loads(META)


async def test_a_body_holding_a_blank_line_is_read_whole():
    data = b'{"name": "m",\r\n\r\n"inputs": []}'  # CRLF CRLF is JSON whitespace too
    async with Recorder({"m": plain("200 OK", data), "c": chunked(data)}) as backend:
        # the body starts after the head's blank line, not after the last blank line
        assert await http_get_json("127.0.0.1", backend.port, "/v2/models/m", 5.0) == (200, {"name": "m", "inputs": []})
        assert await http_get_json("127.0.0.1", backend.port, "/v2/models/c", 5.0) == (200, {"name": "m", "inputs": []})


def test_dechunk_reads_sizes_in_hex_with_extensions():
    body = b"a;x=y\r\n0123456789\r\n10\r\n" + b"q" * 16 + b"\r\n0\r\n\r\n"
    assert _dechunk(body) == b"0123456789" + b"q" * 16
    assert _dechunk(b"0\r\n\r\n") == b""


async def test_metadata_is_cached_in_the_runtime_so_a_new_pipeline_keeps_it(write_config):
    async with Backend({"m": plain("200 OK", META)}) as backend:
        runtime = Runtime()
        first = state_for(write_config, backend.port, "m", runtime)
        assert await ModelMetadata().on_request_body(first, BODY) is None
        cached = runtime.cache("model-metadata")
        assert list(cached) == [("ort", "m")] and cached[("ort", "m")][1] == orjson.loads(META)
        again = state_for(write_config, backend.port, "m", runtime)  # a reload: a new stage, same runtime
        assert await ModelMetadata().on_request_body(again, BODY) is None
        assert again.attrs["model_metadata"] == orjson.loads(META) and backend.paths == ["/v2/models/m"]
        alone = state_for(write_config, backend.port, "m")  # no runtime: the stage's own cache, empty
        assert await ModelMetadata().on_request_body(alone, BODY) is None
        assert backend.paths == ["/v2/models/m"] * 2


async def test_each_model_is_fetched_and_cached_on_its_own(write_config):
    other = META.replace(b'"m"', b'"n"')
    async with Backend({"m": plain("200 OK", META), "n": plain("200 OK", other)}) as backend:
        stage = ModelMetadata(ttl=60)
        for model in ("m", "n", "m", "n"):
            state = state_for(write_config, backend.port, model)
            assert await stage.on_request_body(state, BODY) is None
            assert state.attrs["model_metadata"]["name"] == model
        assert backend.paths == ["/v2/models/m", "/v2/models/n"]


async def test_an_expired_entry_is_fetched_again(write_config):
    async with Backend({"m": plain("200 OK", META)}) as backend:
        stage = ModelMetadata(ttl=0)  # every entry is already expired when the next request looks
        for _ in range(2):
            state = state_for(write_config, backend.port, "m")
            assert await stage.on_request_body(state, BODY) is None and "model_metadata" in state.attrs
        assert backend.paths == ["/v2/models/m"] * 2


def test_the_compiled_tensor_route_caches_a_minute_and_waits_half_a_second(write_config):
    snap = load_file(write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: meta}
        spec:
          backends: [{name: ort, kind: onnxruntime, protocol: http, endpoints: ["127.0.0.1:9"]}]
          routes: [{path: /score, kind: tensor, target: ort, model: m, request: '{"x": [$.x]}'}]
        """))
    stage = next(s for s in snap.routes["score"].pipeline.stages if isinstance(s, ModelMetadata))
    assert (stage.ttl, stage.timeout) == (60.0, 0.5)


async def test_a_404_names_the_backend_and_the_model(write_config):
    async with Backend({"gone": plain("404 Not Found", b"")}) as backend:
        state = state_for(write_config, backend.port, "gone")
        v = await ModelMetadata().on_request_body(state, BODY)
        assert isinstance(v, Reject) and (v.status, v.code) == (404, "model_not_found")
        assert v.message == "backend ort does not serve model gone" and v.fields == {"backend": "ort"}
        assert "model_metadata" not in state.attrs


async def test_broken_answers_are_fetch_failures_logged_once_per_model(write_config, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.stages.model_metadata")
    answers = {"empty": b"", "badstatus": b"HTTP/1.1 abc\r\n\r\n{}", "silent": None}
    async with Recorder(answers) as backend:
        runtime = Runtime()
        stage = ModelMetadata(timeout=0.3)
        for model in ("empty", "badstatus", "silent", "empty"):
            state = state_for(write_config, backend.port, model, runtime)
            assert await stage.on_request_body(state, BODY) is None and "model_metadata" not in state.attrs
        assert [p.rsplit("/", 1)[1] for p in backend.paths] == ["empty", "badstatus", "silent", "empty"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert warnings[0] == "cannot fetch metadata of model empty from ort (list index out of range); encoding without it"
    assert set(runtime.cache("model-metadata-warned")) == {("ort", "empty"), ("ort", "badstatus"), ("ort", "silent")}
    assert runtime.cache("model-metadata") == {}


async def test_an_ipv6_endpoint_picked_by_dispatch_is_asked():
    server_paths = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        server_paths.append(head.split(b"\r\n")[1])
        writer.write(plain("200 OK", META))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        status, meta = await http_get_json(*_endpoint_of(f"[::1]:{port}"), "/v2/models/m", 5.0)
        assert (status, meta) == (200, orjson.loads(META)) and server_paths == [f"Host: ::1:{port}".encode()]
    finally:
        server.close()
        await server.wait_closed()


async def test_the_endpoints_own_address_is_dialled():
    """A server on 127.0.0.2 only: reaching it proves the host is the endpoint's, not a default."""
    server = await asyncio.start_server(lambda r, w: _answer(r, w, plain("200 OK", META)), "127.0.0.2", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await http_get_json("127.0.0.2", port, "/v2/models/m", 5.0) == (200, orjson.loads(META))
    finally:
        server.close()
        await server.wait_closed()


async def _answer(reader, writer, data: bytes):
    await reader.readuntil(b"\r\n\r\n")
    writer.write(data)
    await writer.drain()
    writer.close()


def _endpoint_of(endpoint: str):
    from extproc.stages.model_metadata import _endpoint

    return _endpoint(RequestState(snapshot=None, route=None, started=0.0, endpoint=endpoint), None)
