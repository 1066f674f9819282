"""Stage `dispatch`: backend by model, endpoint by the route's picker, the EPP header + envoy.lb metadata."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from extproc import codec
from extproc.config.loader import load_text
from extproc.config.snapshot import BACKEND_HEADER, DESTINATION_HEADER, LB_METADATA_NAMESPACE, ROUTE_TARGET_HEADER
from extproc.errors import render
from extproc.request import parse_kserve, parse_openai
from extproc.runtime import Runtime
from extproc.stages.dispatch import dispatch, release
from extproc.types import CONTINUE, HttpMessage, Mutate, Outcome, Phase, Reject, RequestState

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: dispatch}
spec:
  backends:
    - {name: alpha, endpoints: ["127.0.0.1:8001"], models: [m1]}
    - {name: beta, endpoints: ["127.0.0.1:9001", "127.0.0.1:9002"], models: [m2]}
    - {name: gamma, endpoints: ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103", "127.0.0.1:9104"],
       models: [m4]}
    - {name: named, endpoints: ["vllm-a:8000", "vllm-b:8000"], models: [m3]}
    - {name: tri, kind: triton, endpoints: ["127.0.0.1:8500"], models: [fraud]}
  plugins:
    - {name: pin, type: pinned-endpoint, parameters: {endpoint: "127.0.0.1:9002"}}
    - {name: pin-only, type: pinned-endpoint, parameters: {endpoint: "127.0.0.1:9002", fallback: false}}
    - {name: pin-named, type: pinned-endpoint, parameters: {endpoint: "vllm-b:8000"}}
    - {name: busy, type: least-in-flight}
    - {name: busy0, type: least-in-flight, parameters: {fallbacks: 0}}
  routes:
    - {path: /plain/, match: prefix, kind: openai, name: plain, targets: [alpha, beta]}
    - {path: /pinned/, match: prefix, kind: openai, name: pinned, targets: [alpha, beta], plugins: [pin]}
    - {path: /strict/, match: prefix, kind: openai, name: strict, targets: [beta], plugins: [pin-only]}
    - {path: /pin-named/, match: prefix, kind: openai, name: pin-named, targets: [named], plugins: [pin-named]}
    - {path: /lif/, match: prefix, kind: openai, name: lif, targets: [alpha, beta, gamma, named], plugins: [busy]}
    - {path: /lif0/, match: prefix, kind: openai, name: lif0, targets: [gamma], plugins: [busy0]}
    - {path: /v2, match: prefix, kind: kserve, name: kserve, targets: [tri]}
"""

B1, B2 = "127.0.0.1:9001", "127.0.0.1:9002"
GAMMA = ("127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103", "127.0.0.1:9104")


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "dispatch.yaml")


@pytest.fixture
def runtime(snap):
    rt = Runtime()
    rt.install(snap)
    return rt


def new_state(snap, route: str, runtime) -> RequestState:
    return RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="rid", runtime=runtime)


def send(state: RequestState, model: str | None = "m2", path: str = "/v1/chat/completions"):
    """The route's request headers (a body follows), then its body: what the stream runs."""
    pipeline = state.route.pipeline
    headers = {":path": path, ":method": "POST", "content-type": "application/json"}
    v = asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=headers)))
    assert v is CONTINUE  # nothing to do before the body: dispatch waits for the model
    payload = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]} if model else {})
    return asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=payload, end_of_stream=True)))


def destination(v: Mutate) -> str | None:
    return dict(v.set_headers).get(DESTINATION_HEADER)


def lb(v: Mutate) -> dict | None:
    md = dict(v.dynamic_metadata)
    return md.get(LB_METADATA_NAMESPACE)


# --- backend by model ------------------------------------------------------------------------------


def test_model_picks_the_serving_backend(snap, runtime):
    st = new_state(snap, "plain", runtime)
    v = send(st, "m2")
    assert isinstance(v, Mutate) and v.clear_route_cache
    h = dict(v.set_headers)
    assert h[BACKEND_HEADER] == "beta" and h[ROUTE_TARGET_HEADER] == "plain"
    assert st.backend == "beta" and st.target is snap.backends["beta"]
    st = new_state(snap, "plain", runtime)
    assert dict(send(st, "m1").set_headers)[BACKEND_HEADER] == "alpha" and st.backend == "alpha"


def test_route_pipeline_body_only_as_the_brief_runs_it(snap):
    st = RequestState(snapshot=snap, route=snap.routes["plain"], started=0.0, runtime=Runtime())
    v = asyncio.run(st.route.pipeline.run(st, HttpMessage(Phase.REQUEST_BODY, body=b'{"model": "m2"}',
                                                          end_of_stream=True)))
    assert isinstance(v, Mutate) and v.clear_route_cache
    assert dict(v.set_headers)[BACKEND_HEADER] == "beta"


def test_no_model_goes_to_the_first_target(snap, runtime):
    st = new_state(snap, "plain", runtime)
    v = send(st, None)
    assert dict(v.set_headers)[BACKEND_HEADER] == "alpha"


def test_bodiless_request_dispatches_at_headers(snap, runtime):
    st = new_state(snap, "plain", runtime)
    msg = HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/plain/v1/files", ":method": "DELETE"},
                      end_of_stream=True)
    v = asyncio.run(st.route.pipeline.run(st, msg))
    assert isinstance(v, Mutate) and v.clear_route_cache
    assert dict(v.set_headers)[BACKEND_HEADER] == "alpha" and st.backend == "alpha"


def test_unknown_model_is_a_404_model_not_found_in_openai_terms(snap, runtime):
    st = new_state(snap, "plain", runtime)
    v = send(st, "nope")
    assert isinstance(v, Reject) and v.status == 404 and v.code == "model_not_found"
    assert v.message == "The model `nope` does not exist on this gateway (served: m1, m2)."
    assert st.backend is None and st.endpoint is None
    err = orjson.loads(render(st.route.dialect, v, "plain", "rid"))["error"]
    assert err["param"] == "model" and err["type"] == "invalid_request_error" and err["code"] == "model_not_found"


def test_unknown_model_in_kserve_wording(snap, runtime):
    st = new_state(snap, "plain", runtime)
    st.request = parse_kserve("/v2/models/ghost/infer")
    v = dispatch(st)
    assert isinstance(v, Reject) and v.status == 404 and v.code == "model_not_found"
    assert v.message == ("Request for unknown model: 'ghost' is not found "
                         "(served through this gateway: m1, m2)")


def test_kserve_route_unknown_model_renders_kserve_error(snap, runtime):
    st = new_state(snap, "kserve", runtime)
    msg = HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/v2/models/ghost/infer", ":method": "POST"})
    v = asyncio.run(st.route.pipeline.run(st, msg))
    assert isinstance(v, Reject) and v.status == 404
    ir = codec.encode(Phase.REQUEST_HEADERS, v, st.route.dialect, "kserve", "rid").immediate_response
    assert orjson.loads(ir.body) == {
        "error": "Request for unknown model: 'ghost' is not found (served through this gateway: fraud)"}
    # and the known model goes to its backend at request headers
    st = new_state(snap, "kserve", runtime)
    msg = HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/v2/models/fraud/versions/1/infer", ":method": "POST"})
    v = asyncio.run(st.route.pipeline.run(st, msg))
    assert isinstance(v, Mutate) and dict(v.set_headers)[BACKEND_HEADER] == "tri"


def test_extra_headers_and_body_are_carried(snap, runtime):
    st = new_state(snap, "plain", runtime)
    st.request = parse_openai("/v1/chat/completions", {"model": "m1"})
    v = dispatch(st, (":path", "/x"), body=b"new")
    assert v.set_headers[0] == (":path", "/x") and v.body == b"new"
    assert dict(v.set_headers)[BACKEND_HEADER] == "alpha"


# --- no picker -------------------------------------------------------------------------------------


def test_without_picker_envoy_balances(snap, runtime):
    st = new_state(snap, "plain", runtime)
    v = send(st, "m2")
    assert destination(v) is None and lb(v) is None and v.dynamic_metadata == ()
    assert st.endpoint is None
    assert runtime.inflight.get(B1) == 0 and runtime.inflight.get(B2) == 0
    resp = codec.encode(Phase.REQUEST_BODY, v)
    assert LB_METADATA_NAMESPACE not in resp.dynamic_metadata.fields


def test_without_runtime_no_pick(snap):
    st = RequestState(snapshot=snap, route=snap.routes["pinned"], started=0.0)
    st.request = parse_openai("/v1/chat/completions", {"model": "m2"})
    v = dispatch(st)
    assert destination(v) is None and st.endpoint is None and dict(v.set_headers)[BACKEND_HEADER] == "beta"


# --- pinned-endpoint -------------------------------------------------------------------------------


def test_pinned_endpoint_header_and_lb_metadata_agree(snap, runtime):
    st = new_state(snap, "pinned", runtime)
    v = send(st, "m2")
    assert destination(v) == "127.0.0.1:9002,127.0.0.1:9001"
    assert lb(v) == {DESTINATION_HEADER: "127.0.0.1:9002,127.0.0.1:9001"}
    assert st.endpoint == B2
    # what Envoy receives: the header in the mutation and the list in envoy.lb dynamic metadata
    resp = codec.encode(Phase.REQUEST_BODY, v)
    md = resp.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    assert md[DESTINATION_HEADER].string_value == "127.0.0.1:9002,127.0.0.1:9001"
    sent = {o.header.key: o.header.raw_value.decode()
            for o in resp.request_body.response.header_mutation.set_headers}
    assert sent[DESTINATION_HEADER] == "127.0.0.1:9002,127.0.0.1:9001"


def test_pick_is_in_flight_until_release(snap, runtime):
    st = new_state(snap, "pinned", runtime)
    send(st, "m2")
    assert runtime.inflight.get(B2) == 1 and runtime.inflight.get(B1) == 0
    st2 = new_state(snap, "pinned", runtime)
    send(st2, "m2")
    assert runtime.inflight.get(B2) == 2
    release(st, Outcome.OK)
    assert runtime.inflight.get(B2) == 1
    release(st2, Outcome.BACKEND_ERROR)
    assert runtime.inflight.get(B2) == 0


def test_release_without_pick_changes_nothing(snap, runtime):
    runtime.inflight.started(B2)
    st = new_state(snap, "plain", runtime)
    send(st, "m2")
    release(st, Outcome.OK)
    assert runtime.inflight.get(B2) == 1


def test_lifecycle_end_releases_the_pick(snap, runtime):
    st = new_state(snap, "pinned", runtime)
    runtime.lifecycle.start(st)
    send(st, "m2")
    assert runtime.inflight.get(B2) == 1
    st.complete = True  # what the stream marks once it saw the phases the route reads
    runtime.lifecycle.stream_ended(st, "end")  # feedback off: on_done fires now, release is an observer
    assert st.outcome is Outcome.OK and runtime.inflight.get(B2) == 0
    runtime.lifecycle.stream_ended(st, "end")
    assert runtime.inflight.get(B2) == 0  # exactly once


def test_pinned_without_fallback_names_only_the_pin(snap, runtime):
    st = new_state(snap, "strict", runtime)
    v = send(st, "m2")
    assert destination(v) == B2 and lb(v) == {DESTINATION_HEADER: B2} and st.endpoint == B2


def test_pin_of_another_backend_is_not_named(snap, runtime):
    st = new_state(snap, "pinned", runtime)
    v = send(st, "m1")  # served by alpha (127.0.0.1:8001); the pin is beta's
    assert dict(v.set_headers)[BACKEND_HEADER] == "alpha"
    assert B2 not in (destination(v) or "")
    assert st.endpoint != B2 and runtime.inflight.get(B2) == 0


def test_host_name_backend_is_never_picked_even_pinned(snap, runtime):
    st = new_state(snap, "pin-named", runtime)
    v = send(st, "m3")
    assert dict(v.set_headers)[BACKEND_HEADER] == "named"
    assert destination(v) is None and lb(v) is None and st.endpoint is None
    assert runtime.inflight.get("vllm-b:8000") == 0


# --- least-in-flight -------------------------------------------------------------------------------


def test_least_in_flight_picks_the_less_loaded(snap, runtime):
    runtime.inflight.started(B1)
    st = new_state(snap, "lif", runtime)
    v = send(st, "m2")
    assert destination(v) == f"{B2},{B1}" and st.endpoint == B2
    assert lb(v) == {DESTINATION_HEADER: f"{B2},{B1}"}
    assert runtime.inflight.get(B2) == 1


def test_least_in_flight_orders_by_load_and_honours_fallbacks(snap, runtime):
    for ep, n in zip(GAMMA, (3, 1, 0, 2)):
        for _ in range(n):
            runtime.inflight.started(ep)
    st = new_state(snap, "lif", runtime)
    v = send(st, "m4")
    # default fallbacks: 2 -> the pick and two more, by load
    assert destination(v) == f"{GAMMA[2]},{GAMMA[1]},{GAMMA[3]}"
    assert st.endpoint == GAMMA[2] and runtime.inflight.get(GAMMA[2]) == 1


def test_least_in_flight_fallbacks_zero_names_one(snap, runtime):
    runtime.inflight.started(GAMMA[0])
    st = new_state(snap, "lif0", runtime)
    v = send(st, "m4")
    picks = destination(v).split(",")
    assert len(picks) == 1 and picks[0] != GAMMA[0] and st.endpoint == picks[0]


def test_least_in_flight_rotates_on_ties(snap, runtime):
    firsts = []
    for _ in range(4):
        st = new_state(snap, "lif", runtime)
        send(st, "m2")
        firsts.append(st.endpoint)
        release(st, Outcome.OK)  # back to a tie
    assert set(firsts) == {B1, B2}
    assert firsts[0] != firsts[1] and firsts[1] != firsts[2] and firsts[2] != firsts[3]


def test_least_in_flight_spreads_concurrent_requests(snap, runtime):
    picks = []
    for _ in range(4):
        st = new_state(snap, "lif", runtime)
        send(st, "m4")
        picks.append(st.endpoint)
    assert sorted(picks) == sorted(GAMMA)  # each new request sees the earlier ones in flight
    assert all(runtime.inflight.get(ep) == 1 for ep in GAMMA)


def test_least_in_flight_skips_host_name_backends(snap, runtime):
    st = new_state(snap, "lif", runtime)
    v = send(st, "m3")
    assert dict(v.set_headers)[BACKEND_HEADER] == "named"
    assert destination(v) is None and lb(v) is None and st.endpoint is None


def test_single_endpoint_backend_is_still_named(snap, runtime):
    st = new_state(snap, "lif", runtime)
    v = send(st, "m1")
    assert destination(v) == "127.0.0.1:8001" and st.endpoint == "127.0.0.1:8001"


# --- scheduling profiles: a refusal when the filters leave nothing ---------------------------------

PROFILES = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: dispatch-profiles}
spec:
  backends:
    - name: pool
      models: [m]
      endpoints:
        - {address: "127.0.0.1:9001", labels: {gpu: a100}}
        - {address: "127.0.0.1:9002", labels: {gpu: v100}}
  plugins:
    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}
    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}
    - {type: in-flight-scorer}
  schedulingProfiles:
    - name: on-a100
      plugins: [{pluginRef: a100}, {pluginRef: in-flight-scorer}]
    - name: on-h100
      plugins: [{pluginRef: h100}, {pluginRef: in-flight-scorer}]
  routes:
    - {path: /a/, match: prefix, kind: openai, name: a, targets: [pool], plugins: [on-a100]}
    - {path: /h/, match: prefix, kind: openai, name: h, targets: [pool], plugins: [on-h100]}
    - {path: /raw, kind: passthrough, name: raw, targets: [pool], plugins: [on-h100]}
"""


@pytest.fixture(scope="module")
def psnap():
    return load_text(PROFILES, "profiles.yaml")


def send_chat(state: RequestState, **fields):
    pipeline = state.route.pipeline
    headers = {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json"}
    assert asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=headers))) is CONTINUE
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    return asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True)))


def immediate(v: Reject, route):
    """What Envoy gets for a refusal on `route`: status, headers, parsed body (in the route's dialect)."""
    ir = codec.encode(Phase.REQUEST_BODY, v, route.dialect, route.name, "rid").immediate_response
    return ir.status.code, {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}, \
        orjson.loads(ir.body)


def test_a_profile_picks_the_labelled_endpoint(psnap):
    rt = Runtime()
    rt.install(psnap)
    for _ in range(5):
        st = new_state(psnap, "a", rt)
        v = send_chat(st)
        assert isinstance(v, Mutate) and destination(v) == "127.0.0.1:9001" and st.endpoint == "127.0.0.1:9001"
        assert lb(v) == {DESTINATION_HEADER: "127.0.0.1:9001"}
    assert rt.inflight.get("127.0.0.1:9001") == 5 and rt.inflight.get("127.0.0.1:9002") == 0


def test_no_endpoint_left_is_a_503_no_capacity_in_openai_terms(psnap):
    rt = Runtime()
    rt.install(psnap)
    st = new_state(psnap, "h", rt)
    v = send_chat(st)
    assert isinstance(v, Reject) and (v.status, v.code, v.retry_after) == (503, "no_capacity", None)
    assert st.endpoint is None and rt.inflight.get("127.0.0.1:9001") == 0
    status, headers, body = immediate(v, st.route)
    assert status == 503 and "retry-after" not in headers and headers["x-adapter-error"] == "no_capacity"
    err = body["error"]
    assert (err["type"], err["code"], err["status"], err["profile"], err["backend"]) == (
        "server_error", "no_capacity", 503, "on-h100", "pool")
    assert err["message"] == ("scheduling profile 'on-h100' left no endpoint of backend 'pool' (2 before filter "
                              "'h100') to serve this request")


def test_a_sheddable_request_gets_429_overloaded_with_retry_after_in_openai_terms(psnap):
    rt = Runtime()
    rt.install(psnap)
    st = new_state(psnap, "h", rt)
    v = send_chat(st, priority=-1)
    assert isinstance(v, Reject) and (v.status, v.code, v.retry_after) == (429, "overloaded", 1)
    status, headers, body = immediate(v, st.route)
    assert status == 429 and headers["retry-after"] == "1"
    err = body["error"]
    assert (err["type"], err["code"], err["retry_after_s"]) == ("rate_limit_exceeded", "overloaded", 1)
    assert "sheddable (priority -1)" in err["message"]
    # priority 0 is not sheddable
    assert send_chat(new_state(psnap, "h", rt), priority=0).status == 503


def test_no_endpoint_left_in_the_adapter_dialect(psnap):
    rt = Runtime()
    rt.install(psnap)
    st = new_state(psnap, "raw", rt)
    msg = HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/raw", ":method": "GET"}, end_of_stream=True)
    v = asyncio.run(st.route.pipeline.run(st, msg))  # a passthrough route: no body, no parsed request
    assert isinstance(v, Reject) and (v.status, v.code) == (503, "no_capacity")
    assert st.route.dialect == "adapter"
    status, headers, body = immediate(v, st.route)
    assert status == 503 and body["error"]["status"] == 503 and body["error"]["code"] == "no_capacity"
    assert body["error"]["profile"] == "on-h100" and "type" not in body["error"]
    # the 429 of a sheddable request in the same dialect (our routes parse no priority today; a request
    # that carries one is refused alike)
    st = new_state(psnap, "raw", rt)
    st.request = parse_openai("/raw", {"model": "m", "priority": -2})
    v = dispatch(st)
    status, headers, body = immediate(v, st.route)
    assert status == 429 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "overloaded" and body["error"]["retry_after_s"] == 1
