"""Stages `openai-parse` and `openai-usage` in process on a compiled openai route: `GET /models`
answered by the processor, the request body read into `state.request` (stream_options added when a
stream does not ask for usage), refusals (413, not JSON, not an object), and the response side: usage
counted from a JSON answer (bounded by USAGE_LIMIT) and from SSE events, the usage event we asked
for ourselves removed again, and a stream that ends without `data: [DONE]` closed with an error event."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from backends.base import Usage
from extproc import codec
from extproc.config.loader import load_text
from extproc.stages.openai_api import USAGE_LIMIT, OpenAIParse, OpenAIUsage
from extproc.types import CONTINUE, HttpMessage, Mutate, Outcome, Phase, Reject, Respond, RequestState

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: oai}
spec:
  backends:
    - {name: alpha, endpoints: ["127.0.0.1:8001"], models: [m1, lora-a]}
    - {name: beta, endpoints: ["127.0.0.1:9001"], models: [m2, m1]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api, targets: [alpha, beta], model: extra,
       policy: {maxBodyBytes: 300}}
"""


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "oai.yaml")


def new_state(snap, **kw) -> RequestState:
    return RequestState(snapshot=snap, route=snap.routes["api"], started=0.0, request_id="rid", **kw)


def headers(path: str | None, method: str | None = "GET") -> HttpMessage:
    h = {}
    if path is not None:
        h[":path"] = path
    if method is not None:
        h[":method"] = method
    return HttpMessage(Phase.REQUEST_HEADERS, headers=h)


def req_body(data: bytes) -> HttpMessage:
    return HttpMessage(Phase.REQUEST_BODY, body=data, end_of_stream=True)


def resp(data: bytes, end: bool = False) -> HttpMessage:
    return HttpMessage(Phase.RESPONSE_BODY, body=data, end_of_stream=end)


# --- GET /models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/", "/v1/models?limit=5", "/v1/models?a=1?b=2"])
def test_get_models_is_answered_with_every_served_model_and_its_backend(snap, path):
    st = new_state(snap)
    before = int(time.time())
    v = OpenAIParse().on_request_headers(st, headers(path))
    after = int(time.time())
    assert isinstance(v, Respond) and (v.status, v.reason, v.headers) == (200, "models", ())
    doc = orjson.loads(v.body)
    created = doc["data"][0]["created"]
    assert isinstance(created, int) and before <= created <= after
    assert doc == {"object": "list", "data": [
        {"id": m, "object": "model", "created": created, "owned_by": "adapter-gateway", "backend": b}
        # `extra` (the route's model) is listed by no backend: the route's first target answers for it
        for m, b in (("m1", "alpha"), ("lora-a", "alpha"), ("m2", "beta"), ("extra", "alpha"))]}
    assert st.attrs["path"] == path.split("?")[0]


def test_get_models_without_a_method_header_is_a_get(snap):
    v = OpenAIParse().on_request_headers(new_state(snap), headers("/v1/models", method=None))
    assert isinstance(v, Respond) and v.status == 200


@pytest.mark.parametrize("path, method", [("/v1/models", "POST"), ("/v1/chat/completions", "GET"),
                                          ("/v1/models/m1/x", "GET"), ("/v1/chat/completions", "POST"),
                                          ("/v1/modelsX", "GET")])
def test_other_requests_go_on_with_their_path_remembered(snap, path, method):
    st = new_state(snap)
    assert OpenAIParse().on_request_headers(st, headers(path, method)) is None
    assert st.attrs == {"path": path}


def test_no_path_header_is_an_empty_path(snap):
    st = new_state(snap)
    assert OpenAIParse().on_request_headers(st, headers(None)) is None
    assert st.attrs == {"path": ""}
    st2 = new_state(snap)
    assert OpenAIParse().on_request_headers(st2, HttpMessage(Phase.REQUEST_HEADERS, headers=None)) is None
    assert st2.attrs == {"path": ""}


# --- the request body ----------------------------------------------------------------------------


def parsed(snap, path: str, data: bytes, tenant: str | None = None):
    st = new_state(snap, tenant=tenant)
    stage = OpenAIParse()
    assert stage.on_request_headers(st, headers(path, "POST")) is None
    return st, stage.on_request_body(st, req_body(data))


def test_a_chat_request_is_read_once_and_forwarded_as_it_is(snap):
    body = {"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "priority": 3,
            "user": "u1"}
    st, v = parsed(snap, "/v1/chat/completions", orjson.dumps(body), tenant="acme")
    assert v is None and "strip_usage" not in st.attrs
    r = st.request
    assert (r.api, r.model, r.max_tokens, r.priority, r.tenant, r.session_key, r.stream) == (
        "openai.chat", "m2", 7, 3, "acme", "u1", False)
    assert r.messages == ({"role": "user", "content": "hi"},) and r.body == body


def test_the_path_from_the_headers_names_the_api(snap):
    st, v = parsed(snap, "/v1/embeddings", b'{"model": "m1", "input": "text"}')
    assert v is None and (st.request.api, st.request.prompt) == ("openai.embeddings", "text")
    no_headers = new_state(snap)  # no headers phase seen: an unnamed API
    assert OpenAIParse().on_request_body(no_headers, req_body(b'{"model": "m1"}')) is None
    assert no_headers.request.api == "openai.other" and no_headers.request.model == "m1"


@pytest.mark.parametrize("data", [b"", b"  \n"])
def test_an_empty_body_is_an_empty_request(snap, data):
    st, v = parsed(snap, "/v1/chat/completions", data)
    assert v is None
    assert st.request.body == {} and st.request.model is None and st.request.api == "openai.chat"


def test_a_streaming_request_gets_include_usage_added(snap):
    body = {"model": "m1", "stream": True, "messages": []}
    st, v = parsed(snap, "/v1/chat/completions", orjson.dumps(body))
    assert isinstance(v, Mutate) and v.remove_headers == () and not v.clear_route_cache and not v.skip_body
    assert orjson.loads(v.body) == {**body, "stream_options": {"include_usage": True}}
    assert v.set_headers == (("content-length", str(len(v.body))),)
    assert st.attrs["strip_usage"] is True and st.request.stream is True


@pytest.mark.parametrize("options", [[None], "x", 5, True])
def test_stream_options_that_are_not_an_object_are_a_400(snap, options):
    """Found by perf/fuzz.py (stream target): `"stream_options": [null]` raised AttributeError (500 stage_error)."""
    st, v = parsed(snap, "/v1/chat/completions", orjson.dumps({"model": "m1", "stream": True, "stream_options": options}))
    assert isinstance(v, Reject) and (v.status, v.code) == (400, "invalid_request")
    assert v.message == "stream_options must be a JSON object" and v.fields == {"param": "stream_options"}


def test_a_streaming_request_keeps_its_other_stream_options(snap):
    body = {"model": "m1", "stream": True, "stream_options": {"continuous_usage_stats": True, "include_usage": False}}
    st, v = parsed(snap, "/v1/completions", orjson.dumps(body))
    assert isinstance(v, Mutate)
    assert orjson.loads(v.body)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert st.attrs["strip_usage"] is True


def test_a_stream_that_asks_for_usage_is_forwarded_untouched(snap):
    body = {"model": "m1", "stream": True, "stream_options": {"include_usage": True}}
    st, v = parsed(snap, "/v1/chat/completions", orjson.dumps(body))
    assert v is None and "strip_usage" not in st.attrs and st.request.stream is True


def test_stream_false_or_not_boolean_is_not_a_stream(snap):
    for flag in (False, "true", 1):
        st, v = parsed(snap, "/v1/chat/completions", orjson.dumps({"model": "m1", "stream": flag}))
        assert v is None and st.request.stream is False and "strip_usage" not in st.attrs


def test_a_body_over_the_route_limit_is_a_413_before_parsing(snap):
    st, v = parsed(snap, "/v1/chat/completions", b"{" + b" " * 300)
    assert isinstance(v, Reject) and (v.status, v.code) == (413, "body_too_large")
    assert v.fields == {"limit": 300} and st.request is None
    fits, ok = parsed(snap, "/v1/chat/completions", b'{"model": "m1"}' + b" " * (300 - 15))
    assert ok is None and fits.request.model == "m1"


def test_malformed_json_is_a_400_in_openai_terms(snap):
    st, v = parsed(snap, "/v1/chat/completions", b'{"model": ')
    assert isinstance(v, Reject) and (v.status, v.code) == (400, "malformed_json") and st.request is None
    err = orjson.loads(codec.encode(Phase.REQUEST_BODY, v, st.route.dialect, "api", "rid").immediate_response.body)
    assert err["error"]["code"] == "malformed_json" and err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("data", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_json_that_is_not_an_object_is_a_400(snap, data):
    st, v = parsed(snap, "/v1/chat/completions", data)
    assert isinstance(v, Reject) and (v.status, v.code, v.message) == (
        400, "invalid_request", "request body must be a JSON object")
    assert v.fields == {} and st.request is None


# --- the response: usage ---------------------------------------------------------------------------


def answered(snap, backend: str | None = "beta", **attrs) -> RequestState:
    st = new_state(snap, backend=backend, target=snap.backends[backend] if backend else None)
    st.attrs.update(attrs)
    return st


def completion(prompt: int, completion_tokens: int, pad: int = 0) -> bytes:
    body = orjson.dumps({"id": "c", "choices": [{"message": {"content": "x"}}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": completion_tokens}})
    return body + b" " * pad


def test_a_json_answer_is_counted_at_its_end_from_every_chunk(snap):
    st, stage = answered(snap), OpenAIUsage()
    data = completion(11, 4)
    assert stage.on_response_body(st, resp(data[:20])) is CONTINUE
    assert st.usage is None and st.attrs == {"sse": False, "pending": data[:20]}
    assert stage.on_response_body(st, resp(data[20:], end=True)) is CONTINUE
    assert st.usage == Usage(11, 4)


def test_a_json_answer_of_exactly_the_limit_is_counted_and_one_byte_more_is_not(snap):
    data = completion(3, 2)
    exact = answered(snap)
    OpenAIUsage().on_response_body(exact, resp(data + b" " * (USAGE_LIMIT - len(data)), end=True))
    assert exact.usage == Usage(3, 2)
    over = answered(snap)
    stage = OpenAIUsage()
    stage.on_response_body(over, resp(data[:-1]))
    stage.on_response_body(over, resp(data[-1:] + b" " * (USAGE_LIMIT - len(data) + 1), end=True))
    assert over.usage is None and over.attrs["pending"] == data[:-1]  # what fitted: not the whole answer


def test_an_answer_that_is_not_json_counts_nothing(snap):
    st = answered(snap)
    assert OpenAIUsage().on_response_body(st, resp(b"<html>oops</html>", end=True)) is CONTINUE
    assert st.usage is None


def test_an_answer_without_usage_counts_zero(snap):
    st = answered(snap)
    OpenAIUsage().on_response_body(st, resp(b'{"error": {"message": "bad"}}', end=True))
    assert st.usage == Usage(0, 0)


def test_a_reply_without_a_backend_is_never_read_as_a_stream(snap):
    # e.g. the processor's own error: no backend was chosen, so `data:` text is not an SSE stream
    st = answered(snap, backend=None)
    v = OpenAIUsage().on_response_body(st, resp(b"data: {}\n\n", end=True))
    assert v is CONTINUE and st.attrs["sse"] is False and st.observed is None


def event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DELTA = event({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None})
USAGE = event({"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
DONE = b"data: [DONE]\n\n"


def test_a_stream_counts_its_usage_event_and_passes_when_the_client_asked_for_it(snap):
    st, stage = answered(snap), OpenAIUsage()
    assert stage.on_response_body(st, resp(b"\n" + DELTA)) is CONTINUE  # leading blank line: still SSE
    assert st.attrs["sse"] is True and st.usage is None and st.attrs["pending"] == b""
    assert stage.on_response_body(st, resp(USAGE)) is CONTINUE  # not stripped: the client asked
    assert st.usage == Usage(5, 2)
    assert not st.delivered
    assert stage.on_response_body(st, resp(DONE, end=True)) is CONTINUE
    assert st.observed is None
    assert st.delivered  # a client closing at [DONE] got the whole answer (lifecycle.derive_outcome)


def test_the_usage_event_we_asked_for_is_removed_from_the_stream(snap):
    st, stage = answered(snap, strip_usage=True), OpenAIUsage()
    assert stage.on_response_body(st, resp(DELTA)) is CONTINUE
    v = stage.on_response_body(st, resp(USAGE + DONE, end=True))
    assert isinstance(v, Mutate) and v.body == DONE and v.set_headers == () and v.remove_headers == ()
    assert st.usage == Usage(5, 2) and st.observed is None


def test_only_a_usage_event_with_no_choices_is_removed(snap):
    # continuous usage stats: usage rides on content events, which the client must still get
    with_choices = event({"id": "c", "choices": [{"delta": {"content": "a"}}],
                          "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    st = answered(snap, strip_usage=True)
    assert OpenAIUsage().on_response_body(st, resp(with_choices)) is CONTINUE
    assert st.usage == Usage(1, 1)


def test_usage_events_in_one_chunk_are_each_counted_and_removed(snap):
    second = event({"id": "c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 8}})
    st = answered(snap, strip_usage=True)
    v = OpenAIUsage().on_response_body(st, resp(USAGE + DELTA + second + USAGE))
    assert isinstance(v, Mutate) and v.body == DELTA
    assert st.usage == Usage(5, 2)  # the last one counted is the stream's
    assert st.attrs["pending"] == b""


def test_events_split_across_chunks_are_counted_once_complete(snap):
    st, stage = answered(snap, strip_usage=True), OpenAIUsage()
    first, rest = USAGE[:25], USAGE[25:]
    assert stage.on_response_body(st, resp(DELTA + first)) is CONTINUE
    assert st.usage is None and st.attrs["pending"] == first
    # complete now, but its first bytes already went out: counted, not removed
    assert stage.on_response_body(st, resp(rest)) is CONTINUE
    assert st.usage == Usage(5, 2) and st.attrs["pending"] == b""


def test_an_event_arriving_in_pieces_without_a_separator_is_kept_until_complete(snap):
    st, stage = answered(snap), OpenAIUsage()
    assert stage.on_response_body(st, resp(USAGE[:10])) is CONTINUE
    assert stage.on_response_body(st, resp(USAGE[10:30])) is CONTINUE
    assert st.attrs["pending"] == USAGE[:30] and st.usage is None
    assert stage.on_response_body(st, resp(USAGE[30:])) is CONTINUE
    assert st.usage == Usage(5, 2) and st.attrs["pending"] == b""


def test_events_that_are_not_usage_data_are_left_alone(snap):
    st = answered(snap, strip_usage=True)
    odd = (b': comment "usage"\n\n'  # not a data event
           b'data: ["usage"]\n\n'  # not an object
           b'data: {"usage": \n\n'  # not JSON
           b'data: {"usage": {}, "choices": []}\n\n'  # empty usage
           b'data: {"usage": 0, "choices": []}\n\n')
    assert OpenAIUsage().on_response_body(st, resp(DELTA + odd)) is CONTINUE
    assert st.usage is None
    # ... and do not stop the usage event after them from being counted and removed
    for before in (b": keepalive\n\n", b'data: {"usage": \n\n', DELTA):
        later, stage = answered(snap, strip_usage=True), OpenAIUsage()
        assert stage.on_response_body(later, resp(DELTA)) is CONTINUE
        v = stage.on_response_body(later, resp(before + USAGE))
        assert isinstance(v, Mutate) and v.body == before and later.usage == Usage(5, 2)


def test_a_usage_event_not_at_a_line_start_is_not_parsed(snap):
    st = answered(snap, strip_usage=True)
    assert OpenAIUsage().on_response_body(st, resp(b"data: x" + USAGE)) is CONTINUE
    assert st.usage is None


def truncated_error(st) -> dict:
    return {"error": {"message": "backend beta ended the stream before it was complete", "type": "server_error",
                      "code": "backend_stream_truncated", "route": "api", "request_id": "rid"}}


def test_a_stream_ended_without_done_gets_an_error_event_and_a_clean_end(snap):
    st, stage = answered(snap), OpenAIUsage()
    stage.on_response_body(st, resp(DELTA))
    v = stage.on_response_body(st, resp(DELTA, end=True))
    assert isinstance(v, Mutate)
    assert v.body == DELTA + event(truncated_error(st)) + DONE
    assert st.observed is Outcome.TRUNCATED


def test_a_stream_cut_inside_an_event_ends_that_event_before_the_error(snap):
    st, stage = answered(snap), OpenAIUsage()
    v = stage.on_response_body(st, resp(DELTA + b'data: {"id": "c", "cho', end=True))
    assert isinstance(v, Mutate)
    assert v.body == DELTA + b'data: {"id": "c", "cho' + b"\n\n" + event(truncated_error(st)) + DONE
    assert st.observed is Outcome.TRUNCATED


def test_a_stream_whose_done_came_earlier_ends_as_it_is(snap):
    st, stage = answered(snap), OpenAIUsage()
    stage.on_response_body(st, resp(DELTA + DONE))
    assert stage.on_response_body(st, resp(b"", end=True)) is CONTINUE
    assert st.observed is None


def test_a_truncated_stream_with_our_usage_event_drops_it_and_still_closes(snap):
    st = answered(snap, strip_usage=True)
    v = OpenAIUsage().on_response_body(st, resp(DELTA + USAGE, end=True))
    assert isinstance(v, Mutate) and v.body == DELTA + event(truncated_error(st)) + DONE
    assert st.usage == Usage(5, 2) and st.observed is Outcome.TRUNCATED


def test_the_route_pipeline_runs_parse_then_dispatch_on_the_body(snap):
    """The stages as the compiled route runs them: the body reply carries our body and the routing."""
    st = new_state(snap)
    pipeline = st.route.pipeline
    asyncio.run(pipeline.run(st, headers("/v1/chat/completions", "POST")))
    v = asyncio.run(pipeline.run(st, req_body(b'{"model": "m2", "stream": true}')))
    assert isinstance(v, Mutate) and st.backend == "beta"
    assert orjson.loads(v.body) == {"model": "m2", "stream": True, "stream_options": {"include_usage": True}}
    assert dict(v.set_headers)["content-length"] == str(len(v.body))


# --- through the servicer, in process -------------------------------------------------------------


def _headers_msg(field: str, pairs: dict[str, str], end: bool = False):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])
    return pb.ProcessingRequest(**{field: pb.HttpHeaders(headers=hm, end_of_stream=end)})


def _body_msg(field: str, data: bytes, end: bool):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return pb.ProcessingRequest(**{field: pb.HttpBody(body=data, end_of_stream=end)})


class _Md:
    def __init__(self, key, value):
        self.key, self.value = key, value


class _Context:
    def __init__(self, *pairs):
        self.md = [_Md(k, v) for k, v in pairs]

    def invocation_metadata(self):
        return self.md


async def test_a_stream_through_the_servicer_counts_tokens_and_hides_the_usage_it_asked_for():
    from prometheus_client import CollectorRegistry

    from extproc.metrics import ProcessorMetrics
    from extproc.stream import ConfigRef, ExtProcService
    from tests.promtext import collect

    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_text(CONFIG, "oai.yaml")), ProcessorMetrics(registry))
    sequence = [
        _headers_msg("request_headers", {":path": "/v1/chat/completions", ":method": "POST",
                                         "content-type": "application/json"}),
        _body_msg("request_body", b'{"model": "m2", "stream": true, "messages": []}', True),
        _headers_msg("response_headers", {":status": "200", "content-type": "text/event-stream"}),
        _body_msg("response_body", DELTA, False),
        _body_msg("response_body", USAGE + DONE, True),
    ]

    async def source():
        for r in sequence:
            yield r

    replies = [r async for r in svc.Process(source(), _Context(("x-adapter-route", "api"), ("x-request-id", "rid"),
                                                                 ("x-adapter-tenant", "acme")))]
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers", "request_body", "response_headers", "response_body", "response_body"]
    sent = orjson.loads(replies[1].request_body.response.body_mutation.body)
    assert sent == {"model": "m2", "stream": True, "messages": [], "stream_options": {"include_usage": True}}
    assert not replies[3].response_body.response.HasField("body_mutation")  # passed as it came
    assert replies[4].response_body.response.body_mutation.body == DONE  # our usage event removed
    samples = collect(registry, [svc])
    # acme is not a configured tenant (tenancy is off): the label is "none", never the client's value
    labels = dict(route="api", backend="beta", model="m2", tenant="none")
    assert samples.value("adapter_processor_tokens_total", type="prompt", **labels) == 5
    assert samples.value("adapter_processor_tokens_total", type="completion", **labels) == 2


def test_a_stream_opening_with_a_comment_or_event_field_is_still_a_stream(snap):
    # some servers open with a keep-alive comment or an `event:` line before the first `data:`
    for opening in (b": ping\n\n", b"event: message\n", b"id: 1\n", b"retry: 100\n\n"):
        st, stage = answered(snap, strip_usage=True), OpenAIUsage()
        assert stage.on_response_body(st, resp(opening + DELTA)) is CONTINUE
        assert st.attrs["sse"] is True, opening
        v = stage.on_response_body(st, resp(USAGE + DONE, end=True))
        assert isinstance(v, Mutate) and v.body == DONE and st.usage == Usage(5, 2), opening
