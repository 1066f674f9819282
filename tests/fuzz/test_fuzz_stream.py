"""Fuzz target `stream`: ext_proc message sequences against the real servicer, in process.

What: `ExtProcService.Process` (real pipelines of every route kind of tests/fuzz/data/gateway.yaml:
llm, tensor, openai, kserve, passthrough, tool, rest and the built-in health route, plus a route
the config does not have) is fed `ProcessingRequest` sequences through the lifecycle tests' driver
(`tests/extproc/test_lifecycle.run_stream`: one message at a time, each reply awaited, as Envoy
does), ended by end of input, by a reset (cancel) or by a transport error. A sequence is either in
Envoy's order (request headers, body chunks with or without end_of_stream, trailers, response
headers, response body chunks, response trailers), cut anywhere, or shuffled and duplicated
(messages out of order, twice, response before request). Headers carry pseudo-headers, routing
hints, huge values and invalid UTF-8; bodies are each route's plausible JSON, mutated (truncated,
a byte flipped, invalid UTF-8 inserted, oversized past the route's limit, empty).
Properties, per case:
- nothing escapes `Process` but the driver's own transport error or the reset; no stage fails
  (a stage exception is answered 500 `stage_error`: counted as a finding, since client input must
  get a clear refusal, not an internal error) and nothing is logged as an exception;
- there is one reply per message read, each answering that message's phase, or an immediate
  response that ends the stream; every header a reply sets has no CR, LF or NUL;
- an immediate error body is JSON in the route's dialect (adapter, openai, kserve, tool/JSON-RPC)
  with a non-empty message, its `x-adapter-error` code is the body's;
- the case ends within `CASE_LIMIT_S` (asyncio timeout);
- afterwards (deadlines swept) the lifecycle's open-request table is empty, `streams_active` is 0
  and every endpoint's in-flight count is 0.
Cost: about 1 to 3 ms per case (hypothesis's generation included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.metrics import ProcessorMetrics
from extproc.runtime import Runtime
from extproc.stream import ConfigRef, ExtProcService
from tests.extproc.test_lifecycle import run_stream
from tests.fuzz.harness import CASE_LIMIT_S, SUITE, Finding, Hang

CONFIG = Path(__file__).parent / "data" / "gateway.yaml"
TRANSPORT_ERROR = "transport broke"  # what run_stream's "error" ending raises
_ATTR_NS = "envoy.filters.http.ext_proc"


# --- the servicers (one per feedback mode), built once per process -----------------------------------


class _Logged(logging.Handler):
    """Exceptions the processor logs (a failed stage, a failed stream) while a case runs."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.armed = False  # records only while a case runs (the handler stays for the process)

    def emit(self, record: logging.LogRecord) -> None:
        if self.armed:
            self.records.append(record)


@dataclass
class Harness:
    services: dict[bool, ExtProcService]  # feedback on/off -> servicer
    loop: asyncio.AbstractEventLoop
    logged: _Logged
    endpoints: tuple[str, ...]
    hold: socket.socket  # bound, never listening: every backend connection is refused at once


@cache
def harness() -> Harness:
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))  # keeps the port taken, so nothing else can answer on it
    port = hold.getsockname()[1]
    names = ("llm", "ort", "petstore")
    services = {}
    for feedback in (False, True):
        snap = load_file(CONFIG, endpoints={n: (("127.0.0.1", port),) for n in names})
        runtime = Runtime(feedback=feedback)
        services[feedback] = ExtProcService(ConfigRef(snap), ProcessorMetrics(CollectorRegistry()), runtime=runtime)
    logged = _Logged()
    logging.getLogger("extproc").addHandler(logged)
    endpoints = tuple(e for b in snap.backends.values() for e in b.endpoint_ids)
    return Harness(services, asyncio.new_event_loop(), logged, endpoints, hold)


# --- strategies ---------------------------------------------------------------------------------------

ROUTES = {  # route name -> (paths a client may use on it, body kind)
    "v1-analyze": (["/v1/analyze"], "analyze"),
    "v1-fraud-score": (["/v1/fraud-score"], "features"),
    "v1": (["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/models/",
            "/v1/chat/completions?x=1", "/v1/"], "openai"),
    "v2": (["/v2/models/fraud-mlp/infer", "/v2/health/ready", "/v2"], "kserve"),
    "raw-chat": (["/raw/chat"], "openai"),
    "tools-petstore": (["/tools/petstore"], "tool"),
    "orders": (["/orders"], "order"),
    "adapter-health": (["/health/adapter", "/health/adapter?probe=processor", "/health/adapter?probe=x",
                        "/health/adapter?probe="], "none"),
    "no-such-route": (["/nowhere"], "none"),
}

INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xed\xa0\x80", b"\xf0\x28\x8c\x28",
                b"\xc0\xaf", b"\x80", b"\xf8\x88\x80\x80\x80"]
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)  # protobuf strings: valid UTF-8
json_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | text
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4),
                          max_leaves=12)


def _dumps(value) -> bytes:
    """JSON text of a drawn value: integers past 64 bits and non-finite floats (`Infinity`) kept."""
    return json.dumps(value, ensure_ascii=False).encode()


@cache  # a strategy is built (and validated) once per kind, not per draw
def _doc(kind: str) -> st.SearchStrategy:
    """A plausible request body of `kind`, as a JSON value (sometimes any JSON value at all)."""
    model = st.sampled_from(["qwen2.5-finance", "fraud-mlp", "", "nope"]) | text
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                               "content": text | json_value}), max_size=3)
    plausible = {
        "analyze": st.fixed_dictionaries({"query": text | json_value}),
        "features": st.fixed_dictionaries({"features": st.lists(st.floats(allow_nan=False) | json_value, max_size=6)
                                           | json_value}),
        "openai": st.fixed_dictionaries({"model": model}, optional={
            "messages": messages, "prompt": text | json_value, "input": text | json_value,
            "stream": st.booleans() | json_value, "max_tokens": st.integers(-5, 10**12) | json_value,
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_value})
            | json_value, "priority": st.integers(-3, 3) | json_value}),
        "kserve": st.fixed_dictionaries({"inputs": st.lists(st.fixed_dictionaries({
            "name": text, "datatype": st.sampled_from(["FP32", "INT64", "BYTES", "x"]),
            "shape": st.lists(st.integers(-1, 4), max_size=3), "data": st.lists(json_scalar, max_size=6)}), max_size=2)}),
        "tool": st.one_of(
            st.fixed_dictionaries({"jsonrpc": st.just("2.0"), "id": st.integers(0, 9) | text | st.none() | json_value,
                                   "method": st.sampled_from(["tools/call", "tools/list", "initialize", "x"]) | text},
                                  optional={"params": st.fixed_dictionaries({}, optional={
                                      "name": st.sampled_from(["listPets", "createPets", "showPetById", "x"]) | text,
                                      "arguments": st.dictionaries(st.sampled_from(["petId", "limit", "id", "name", "tag"])
                                                                   | text, json_value, max_size=3) | json_value})
                                      | json_value}),
            st.fixed_dictionaries({"name": st.sampled_from(["listPets", "showPetById"]) | text,
                                   "arguments": st.dictionaries(st.sampled_from(["petId", "limit"]) | text, json_value,
                                                                max_size=3) | json_value | text})),
        "order": st.fixed_dictionaries({"orderId": json_value, "createdAt": st.sampled_from(
            ["2026-01-01T00:00:00Z", "x", ""]) | json_value, "status": st.sampled_from(["open", "closed", "x"]) | json_value}),
        "none": st.just({}),
    }[kind]
    return st.one_of(plausible, plausible, json_value)


@st.composite
def mutated(draw, body: bytes, limit: int = 1024 * 1024) -> bytes:
    how = draw(st.sampled_from(["as-is", "as-is", "truncate", "flip", "utf8", "oversize", "empty", "junk"]))
    if how == "truncate" and body:
        return body[:draw(st.integers(0, len(body) - 1))]
    if how == "flip" and body:
        i = draw(st.integers(0, len(body) - 1))
        return body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    if how == "utf8":
        i = draw(st.integers(0, len(body)))
        return body[:i] + draw(st.sampled_from(INVALID_UTF8)) + body[i:]
    if how == "oversize":  # just past the route's limit (1 MiB), or far past it
        return body + b" " * (limit + 1 - len(body) + draw(st.sampled_from([0, 0, 1, 4096])))
    if how == "empty":
        return b""
    if how == "junk":
        return draw(st.binary(max_size=64))
    return body


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts}) if data else []
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


header_value = st.one_of(
    st.binary(max_size=32), text.map(str.encode), st.sampled_from(INVALID_UTF8),
    st.integers(1, 70_000).map(lambda n: b"v" * n),  # a huge header (Envoy's default limit is 60 KiB)
    st.sampled_from([b"", b" ", b"0", b"-1", b"\xc2\xb2", b"\xd9\xa1\xd9\xa2", b"1e3", b"99999999999999999999",
                     b"1.5", b"\r\n", b"\x00"]))
header_name = st.sampled_from(["content-length", "content-type", "x-adapter-tenant", "x-task-intent", "x-slo-ttft-ms",
                               "x-adapter-debug", "authorization", "accept", "x-request-id", "x-gateway-model-name",
                               "transfer-encoding", ":status", ":path", ":method", "x-adapter-variant"]) \
    | st.text("abcdefghijklmnopqrstuvwxyz-:", min_size=1, max_size=12)


@st.composite
def _headers(draw, base: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    headers = [h for h in base if draw(st.integers(0, 9)) > 0]  # each base header dropped one time in ten
    headers += draw(st.lists(st.tuples(header_name, header_value), max_size=4))
    return draw(st.permutations(headers)) if draw(st.booleans()) else headers


def _msg(kind: str, *, headers=(), body=b"", eos=False, attributes=None, protocol=False) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    if kind in ("request_headers", "response_headers"):
        part = getattr(req, kind)
        for k, v in headers:
            part.headers.headers.add(key=k, raw_value=v)
        part.end_of_stream = eos
    elif kind in ("request_body", "response_body"):
        part = getattr(req, kind)
        part.body = body
        part.end_of_stream = eos
    else:
        part = getattr(req, kind)
        for k, v in headers:
            part.trailers.headers.add(key=k, raw_value=v)
        part.SetInParent()
    if attributes:
        req.attributes[_ATTR_NS].update(attributes)
    if protocol:
        req.protocol_config.request_body_mode = 1  # BUFFERED
        req.protocol_config.response_body_mode = 1
    return req


@cache
def _response_body(kind: str) -> st.SearchStrategy:
    output = json_value | st.fixed_dictionaries({"amount": json_value, "account": json_value})
    chat = st.builds(lambda content, usage: {"id": "c", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}], **usage},
        output.map(lambda v: _dumps(v).decode()) | text | json_value,
        st.just({}) | st.fixed_dictionaries({"usage": st.fixed_dictionaries(
            {"prompt_tokens": st.integers(-1, 99) | json_value, "completion_tokens": st.integers(-1, 99) | json_value})}))
    kserve = st.fixed_dictionaries({"model_name": st.just("fraud-mlp"), "outputs": st.lists(st.fixed_dictionaries({
        "name": st.sampled_from(["scores", "x"]), "datatype": st.sampled_from(["FP32", "BYTES", "x"]),
        "shape": st.lists(st.integers(-1, 3), max_size=3), "data": st.lists(json_scalar, max_size=6)}), max_size=2)})
    sse = st.lists(chat.map(lambda c: b"data: " + _dumps(c) + b"\n\n")
                   | st.sampled_from([b"data: [DONE]\n\n", b": ping\n\n", b"event: x\n", b"data: {\n\n", b"data:"]),
                   max_size=4).map(b"".join)
    plain = {"analyze": chat, "openai": chat, "features": kserve, "kserve": kserve}.get(kind, json_value)
    return st.one_of(plain.map(_dumps), plain.map(_dumps), sse, st.binary(max_size=48))


@dataclass(frozen=True)
class StreamCase:
    route: str
    messages: tuple[pb.ProcessingRequest, ...]
    ending: str  # eof, cancel, error
    feedback: bool

    def __repr__(self) -> str:  # what a crash report shows: the messages in text format
        from google.protobuf import text_format
        def short(line: str) -> str:  # a 1 MiB body or a 70 KB header shown by its start and size
            return line if len(line) <= 300 else f"{line[:300]}... (+{len(line) - 300} characters)"
        msgs = "\n".join("# message\n" + "\n".join(map(short, text_format.MessageToString(m).splitlines()))
                         for m in self.messages)
        return f"StreamCase(route={self.route!r}, ending={self.ending!r}, feedback={self.feedback}):\n{msgs}"


@st.composite
def stream_cases(draw) -> StreamCase:
    route = draw(st.sampled_from(sorted(ROUTES)))
    paths, kind = ROUTES[route]
    path = draw(st.sampled_from(paths))
    body = draw(mutated(_dumps(draw(_doc(kind)))))
    declared = draw(st.sampled_from(["exact", "exact", "absent", "other"]))
    base = [(":authority", b"gw"), (":path", path.encode()), (":method", draw(st.sampled_from(
        [b"POST", b"POST", b"GET", b"PUT", b"DELETE", b"HEAD"]))), (":scheme", b"http"),
        ("content-type", draw(st.sampled_from([b"application/json", b"text/plain", b"application/json; charset=utf-8"]))),
        ("x-request-id", b"fuzz")]
    if declared == "exact":
        base.append(("content-length", str(len(body)).encode()))
    elif declared == "other":
        base.append(("content-length", draw(header_value)))
    request_headers = draw(_headers(base))
    has_body = draw(st.integers(0, 5)) > 0
    chunks = _chunks(body, draw(st.lists(st.integers(0, 1 << 20), max_size=3))) if has_body else []
    ordered = [_msg("request_headers", headers=request_headers, eos=not has_body, protocol=draw(st.booleans()))]
    last_eos = draw(st.integers(0, 4)) > 0  # the last chunk without end_of_stream: trailers end it, or nothing
    for i, c in enumerate(chunks):
        ordered.append(_msg("request_body", body=c, eos=last_eos and i == len(chunks) - 1))
    if draw(st.integers(0, 6)) == 0:
        ordered.append(_msg("request_trailers", headers=draw(st.lists(st.tuples(header_name, header_value), max_size=2))))
    status = draw(st.sampled_from([b"200", b"200", b"200", b"404", b"429", b"500", b"503", b"504", b"0", b"abc", b"",
                                   b"99999", b"\xff", b"2\xc2\xb2"]))
    resp_body = draw(_response_body(kind))
    rh = [(":status", status), ("content-type", draw(st.sampled_from(
        [b"application/json", b"text/event-stream", b"text/plain"])))]
    attributes = draw(st.none() | st.fixed_dictionaries({}, optional={
        "response.code": st.sampled_from([200, 200, 500, 404, 0, -1, 1e300, 200.5]) | st.sampled_from(["200", "x", ""]),
        "upstream.address": st.sampled_from(["127.0.0.1:1", "", "[::1]:80"]) | text}))
    resp_chunks = _chunks(resp_body, draw(st.lists(st.integers(0, 1 << 16), max_size=3)))
    ordered.append(_msg("response_headers", headers=draw(_headers(rh)), eos=not resp_chunks, attributes=attributes))
    resp_eos = draw(st.integers(0, 4)) > 0
    for i, c in enumerate(resp_chunks):
        ordered.append(_msg("response_body", body=c, eos=resp_eos and i == len(resp_chunks) - 1,
                            attributes=attributes if i == 0 and draw(st.booleans()) else None))
    if draw(st.integers(0, 6)) == 0:
        ordered.append(_msg("response_trailers", headers=[("grpc-status", b"0")]))
    order = draw(st.sampled_from(["envoy", "envoy", "envoy", "shuffled"]))
    if order == "envoy":
        messages = ordered[:draw(st.integers(1, len(ordered)))]
    else:  # out of order, duplicated, response before request
        messages = [ordered[i] for i in draw(st.lists(st.integers(0, len(ordered) - 1), min_size=1, max_size=8))]
    return StreamCase(route, tuple(messages), draw(st.sampled_from(["eof", "eof", "cancel", "error"])),
                      draw(st.booleans()))


CASES = stream_cases()


# --- the properties -----------------------------------------------------------------------------------

_DIALECTS = {"v1": "openai", "v2": "kserve", "tools-petstore": "tool"}


def _error_message(route: str, body: dict) -> str:
    """The message of an immediate error body in `route`'s dialect ('' when the shape is wrong)."""
    dialect = _DIALECTS.get(route, "adapter")
    err = body.get("error") if isinstance(body, dict) else None
    if dialect == "kserve":
        return err if isinstance(err, str) else ""
    if dialect == "tool" and isinstance(body, dict) and body.get("jsonrpc") == "2.0":
        ok = isinstance(err, dict) and isinstance(err.get("code"), int) and "id" in body
        return err.get("message", "") if ok else ""
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        return ""
    if dialect == "openai" and not isinstance(err.get("type"), str):
        return ""
    return err.get("message") if isinstance(err.get("message"), str) else ""


def _check_headers(where: str, mutation) -> None:
    for opt in mutation.set_headers:
        if any(c in opt.header.raw_value for c in (b"\r", b"\n", b"\0")):
            raise Finding(f"{where} sets header {opt.header.key!r} to a value with CR, LF or NUL: {opt.header.raw_value[:80]!r}")


def check_replies(case: StreamCase, replies: list) -> str | None:
    """The reply properties; returns the refusal's class ('<route> <status> <code>') or None."""
    if len(replies) > len(case.messages):
        raise Finding(f"{len(replies)} replies to {len(case.messages)} messages")
    for i, (req, reply) in enumerate(zip(case.messages, replies)):
        which = reply.WhichOneof("response")
        if which == "immediate_response":
            if i != len(replies) - 1:
                raise Finding(f"reply {i} is an immediate response but the stream went on")
            ir = reply.immediate_response
            headers = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
            _check_headers(f"immediate response {i}", ir.headers)
            if not 200 <= ir.status.code <= 599:
                raise Finding(f"immediate response with status {ir.status.code}")
            try:
                body = orjson.loads(ir.body)
            except orjson.JSONDecodeError as e:
                raise Finding(f"immediate response body is not JSON ({e}): {ir.body[:200]!r}") from None
            code = headers.get("x-adapter-error")
            if code is None:
                if ir.status.code >= 400 and case.route != "adapter-health":
                    raise Finding(f"immediate {ir.status.code} without x-adapter-error: {ir.body[:200]!r}")
                return None  # the processor answered (health, GET /models)
            code = code.decode()
            if code == "stage_error":
                raise Finding(f"a stage failed on this input (500 stage_error): {ir.body[:300]!r}")
            message = _error_message(case.route, body)
            if not message.strip():
                raise Finding(f"immediate error body without a message in the route's dialect: {ir.body[:300]!r}")
            return f"{case.route} {ir.status.code} {code}"
        if which != req.WhichOneof("request"):
            raise Finding(f"reply {i} answers {which} to a {req.WhichOneof('request')} message")
        part = getattr(reply, which)
        if which.endswith("trailers"):
            _check_headers(f"reply {i}", part.header_mutation)
        else:
            _check_headers(f"reply {i}", part.response.header_mutation)
    return None


def check(case: StreamCase) -> str | None:
    h = harness()
    svc = h.services[case.feedback]
    lc = svc.runtime.lifecycle
    h.logged.records.clear()

    async def bounded():
        try:
            return await asyncio.wait_for(run_stream(svc, case.route, list(case.messages), case.ending), CASE_LIMIT_S)
        except TimeoutError:
            raise Hang(f"stream did not end within {CASE_LIMIT_S:g} s") from None

    h.logged.armed = True
    try:
        replies = h.loop.run_until_complete(bounded())
    finally:
        h.logged.armed = False
    for record in h.logged.records:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, RuntimeError) and str(exc) == TRANSPORT_ERROR):
            raise Finding(f"the processor logged {record.getMessage()!r}: {exc!r}")
    refusal = check_replies(case, replies)
    lc.sweep(now=10**9)  # every access-log deadline passed
    if lc.open_count:
        raise Finding(f"{lc.open_count} request(s) still open after the stream ended and every deadline passed")
    active = svc.metrics.streams_active._value.get()
    if active != 0:
        raise Finding(f"streams_active is {active} after the stream ended")
    for e in h.endpoints:
        n = svc.runtime.inflight.own(e)
        if n != 0:
            raise Finding(f"in-flight count of {e} is {n} after the request ended")
    return refusal


@SUITE
@given(CASES)
def test_stream_sequences_get_valid_replies_and_leave_nothing_open(case):
    check(case)
