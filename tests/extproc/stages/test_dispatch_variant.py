"""The dispatch variant slot: a route's rollout chooses the backend by `canary.assign.decide`.

Sticky per key (the same arm for the same key, the one `canary.assign.assign` gives), keyless
requests weighted random, a header that is not a trusted key source never used, `x-canary` forcing
only when the rollout configures it, a fallback when the arm's backend does not serve the model;
`state.variant`, the `adapter.variant` dynamic metadata, and the stream keeping the key headers for
a dispatch at the body; the per-arm counter at `on_done`.
"""

from __future__ import annotations

import asyncio
import math
import random

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

import canary.assign
from canary.assign import assign
from extproc.config.loader import load_text
from extproc.config.snapshot import BACKEND_HEADER, DESTINATION_HEADER, LB_METADATA_NAMESPACE
from extproc.metrics import ProcessorMetrics
from extproc.runtime import Runtime
from extproc.stages.dispatch import ASSIGNMENT_ATTR, FALLBACK_ATTR
from extproc.stream import ConfigRef, ExtProcService, RequestObserver
from extproc.types import CONTINUE, HttpMessage, Mutate, Outcome, Phase, RequestState
from tests.promtext import collect

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: variants}
spec:
  backends:
    - {name: stable, endpoints: ["127.0.0.1:9001", "127.0.0.1:9002"], models: [m, m2]}
    - {name: canary, endpoints: ["127.0.0.1:9101"], models: [m]}
  plugins:
    - {name: pin, type: pinned-endpoint, parameters: {endpoint: "127.0.0.1:9002"}}
    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}
  schedulingProfiles:
    - {name: nothing-left, plugins: [{pluginRef: h100}]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: v1, targets: [stable, canary]}
    - {path: /t/, match: prefix, kind: openai, name: t, targets: [stable, canary]}
    - {path: /nf/, match: prefix, kind: openai, name: nf, targets: [stable, canary]}
    - {path: /pick/, match: prefix, kind: openai, name: pick, targets: [stable, canary], plugins: [pin]}
    - {path: /p, kind: passthrough, name: p, target: stable}
    - {path: /plain/, match: prefix, kind: openai, name: plain, targets: [stable, canary]}
    - {path: /cap/, match: prefix, kind: openai, name: cap, targets: [stable, canary], plugins: [nothing-left]}
  rollouts:
    - name: r
      route: v1
      arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 30}]
      key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id, x-canary], force: {header: x-canary}}
    - name: rt
      route: t
      arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 30}]
      key: {sources: [{tenant: true}], trustedHeaders: [x-canary]}
    - name: rnf
      route: nf
      arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 30}]
      key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id]}
    - name: rp
      route: pick
      arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 100}]
    - name: rc
      routes: [cap]
      arms: [{name: stable, backend: stable}, {name: canary, backend: canary, weight: 100}]
    - name: aa
      route: p
      arms: [{name: a, backend: stable}, {name: b, backend: stable, weight: 50}]
      key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id]}
"""


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "variants.yaml")


@pytest.fixture
def runtime(snap):
    rt = Runtime()
    rt.install(snap)
    return rt


def send(snap, runtime, route: str, headers: dict[str, str] | None = None, model: str = "m",
         tenant: str | None = None) -> tuple[RequestState, Mutate]:
    """What the stream does for one request: keep the rollout's headers at request headers (as
    extproc/stream.py does), then run the route's pipeline over the headers and the body."""
    r = snap.routes[route]
    state = RequestState(snapshot=snap, route=r, started=0.0, request_id="rid", runtime=runtime, tenant=tenant)
    h = {":path": f"/{route}/chat/completions", ":method": "POST", "content-type": "application/json",
         **(headers or {})}
    for name in r.rollout.headers if r.rollout is not None else ():
        if name in h:
            state.attrs[name] = h[name]
    pipeline = r.pipeline
    if r.kind == "passthrough":
        v = asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=h, end_of_stream=True)))
        return state, v
    assert asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=h))) is CONTINUE
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    v = asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True)))
    assert isinstance(v, Mutate), v
    return state, v


def backend(v: Mutate) -> str:
    return dict(v.set_headers)[BACKEND_HEADER]


def test_the_same_key_gets_the_same_arm_the_one_canary_assign_gives(snap, runtime):
    rollout = snap.rollouts["r"].rollout
    seen = {}
    for i in range(300):
        user = f"user-{i}"
        state, v = send(snap, runtime, "v1", {"x-user-id": user})
        arm = assign(rollout, user).arm
        assert backend(v) == arm == state.backend  # the arms' backends are named like the arms here
        assert state.variant == f"r/{arm}"
        assert v.dynamic_metadata == (("adapter", {"variant": f"r/{arm}"}),)
        a = state.attrs[ASSIGNMENT_ATTR]
        assert (a.how, a.source, a.reasons) == ("hash", "header:x-user-id", ())
        assert state.variant_unit == a.unit == canary.assign.unit(rollout.hash_salt, user)  # the feed's cluster
        seen[user] = arm
    for user, arm in list(seen.items())[:50]:  # again: sticky
        assert send(snap, runtime, "v1", {"x-user-id": user})[0].variant == f"r/{arm}"
    # 300 distinct keys at 30 %: within 4 binomial sigmas (the exact split is the hash's)
    n = sum(a == "canary" for a in seen.values())
    assert abs(n - 90) <= 4 * math.sqrt(300 * 0.3 * 0.7), n


def test_keyless_requests_are_weighted_random(snap, runtime, monkeypatch):
    monkeypatch.setattr(canary.assign, "_RNG", random.Random(7))
    arms = []
    for _ in range(2000):
        state, v = send(snap, runtime, "v1")
        a = state.attrs[ASSIGNMENT_ATTR]
        assert a.how == "random" and a.source is None and a.reasons == ("header:x-user-id: absent",)
        arms.append(a.arm)
        assert backend(v) == a.arm
    n = arms.count("canary")
    assert abs(n - 600) <= 3 * math.sqrt(2000 * 0.3 * 0.7), n  # 3 sigma: 600 +- 61


def test_a_header_that_is_not_a_trusted_key_source_is_never_used(snap, runtime, monkeypatch):
    # route t keys on the tenant: a client's x-user-id is not kept by the stream nor hashed
    assert snap.routes["t"].rollout.headers == ()
    monkeypatch.setattr(canary.assign, "_RNG", random.Random(1))
    arms = {send(snap, runtime, "t", {"x-user-id": "alice"})[0].attrs[ASSIGNMENT_ATTR].how for _ in range(20)}
    assert arms == {"random"}
    # the tenant is the key there: sticky per tenant
    for tenant in ("acme", "globex", "initech", "umbrella"):
        state, v = send(snap, runtime, "t", {"x-user-id": "alice"}, tenant=tenant)
        arm = assign(snap.rollouts["rt"].rollout, tenant).arm
        assert (state.variant, backend(v), state.attrs[ASSIGNMENT_ATTR].source) == (f"rt/{arm}", arm, "tenant")


def test_x_canary_forces_an_arm_only_where_the_rollout_configures_forcing(snap, runtime):
    user = next(f"u{i}" for i in range(1000) if assign(snap.rollouts["r"].rollout, f"u{i}").arm == "stable")
    for value, arm in (("true", "canary"), ("false", "stable"), ("canary", "canary"), ("stable", "stable")):
        state, v = send(snap, runtime, "v1", {"x-user-id": user, "x-canary": value})
        assert (state.variant, backend(v), state.attrs[ASSIGNMENT_ATTR].how) == (f"r/{arm}", arm, "forced")
    state, _ = send(snap, runtime, "v1", {"x-user-id": user, "x-canary": "bogus"})  # not an arm: ignored, hashed
    a = state.attrs[ASSIGNMENT_ATTR]
    assert (a.arm, a.how) == ("stable", "hash") and "neither true/false nor an arm" in a.reasons[-1]
    # route t trusts x-canary but configures no forcing, route nf neither: the header changes nothing
    assert snap.rollouts["rt"].policy.force is None and snap.rollouts["rnf"].policy.force is None
    for tenant in ("acme", "globex", "initech"):
        arm = assign(snap.rollouts["rt"].rollout, tenant).arm
        state, _ = send(snap, runtime, "t", {"x-canary": "true" if arm == "stable" else "false"}, tenant=tenant)
        assert (state.variant, state.attrs[ASSIGNMENT_ATTR].how) == (f"rt/{arm}", "hash")
    state, _ = send(snap, runtime, "nf", {"x-user-id": user, "x-canary": "true"})
    assert state.attrs[ASSIGNMENT_ATTR].how == "hash" and "x-canary" not in state.attrs


def test_an_arm_whose_backend_does_not_serve_the_model_falls_back_to_the_first_candidate(snap, runtime):
    rollout = snap.rollouts["r"].rollout
    user = next(f"u{i}" for i in range(1000) if assign(rollout, f"u{i}").arm == "canary")
    state, v = send(snap, runtime, "v1", {"x-user-id": user}, model="m2")  # canary serves m only
    assert backend(v) == "stable" and state.variant == "r/stable"  # the arm that did serve it
    assert state.attrs[FALLBACK_ATTR] == "canary"
    assert v.dynamic_metadata == (("adapter", {"variant": "r/stable"}),)
    state, v = send(snap, runtime, "v1", {"x-user-id": user}, model="m")
    assert backend(v) == "canary" and FALLBACK_ATTR not in state.attrs


def test_the_variant_travels_with_the_endpoint_pick_and_on_headers_only_routes(snap, runtime):
    state, v = send(snap, runtime, "pick")  # canary at 100 %, no key; the pinned endpoint is stable's
    assert backend(v) == "canary" and state.variant == "rp/canary"
    assert v.dynamic_metadata == (("adapter", {"variant": "rp/canary"}),)  # the pin is not an endpoint of canary
    user = next(f"u{i}" for i in range(1000) if assign(snap.rollouts["aa"].rollout, f"u{i}").arm == "a")
    state, v = send(snap, runtime, "p", {"x-user-id": user})  # passthrough: dispatch at request headers
    assert (backend(v), state.variant) == ("stable", "aa/a")
    state, v = send(snap, runtime, "plain", {"x-user-id": user})  # no rollout: nothing changes
    assert state.variant is None and v.dynamic_metadata == () and backend(v) == "stable"


def test_a_pick_and_a_variant_both_go_into_the_dynamic_metadata(runtime):
    snap = load_text(CONFIG.replace("weight: 100}]", "weight: 0}]"), "variants.yaml")
    rt = Runtime()
    rt.install(snap)
    state, v = send(snap, rt, "pick")
    assert state.variant == "rp/stable"
    assert v.dynamic_metadata == (("adapter", {"variant": "rp/stable"}),
                                  (LB_METADATA_NAMESPACE, {DESTINATION_HEADER: "127.0.0.1:9002,127.0.0.1:9001"}))


def test_a_refusal_after_the_arm_was_chosen_names_the_arm(snap, runtime):
    from extproc.types import Reject

    r = snap.routes["cap"]
    state = RequestState(snapshot=snap, route=r, started=0.0, request_id="rid", runtime=runtime)
    h = {":path": "/cap/chat/completions", ":method": "POST", "content-type": "application/json"}
    asyncio.run(r.pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=h)))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    v = asyncio.run(r.pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True)))
    assert isinstance(v, Reject) and (v.status, v.code) == (503, "no_capacity")
    assert v.headers == (("x-adapter-variant", "rc/canary"),) and state.variant == "rc/canary"
    # the codec puts it on the immediate response
    from extproc import codec

    reply = codec.encode(Phase.REQUEST_BODY, v, "openai", "cap", "rid")
    sent = {h.header.key: h.header.raw_value.decode() for h in reply.immediate_response.headers.set_headers}
    assert sent["x-adapter-variant"] == "rc/canary" and sent["x-adapter-error"] == "no_capacity"


def test_the_variant_counter_counts_by_route_rollout_arm_and_outcome_at_on_done(snap, runtime):
    registry = CollectorRegistry()
    observer = RequestObserver(ProcessorMetrics(registry))
    rollout = snap.rollouts["r"].rollout
    users = [f"u{i}" for i in range(40)]
    for user in users:
        state, _ = send(snap, runtime, "v1", {"x-user-id": user})
        observer(state, Outcome.OK)
    canary_user = next(u for u in users if assign(rollout, u).arm == "canary")
    state, _ = send(snap, runtime, "v1", {"x-user-id": canary_user}, model="m2")
    observer(state, Outcome.BACKEND_ERROR)
    state, _ = send(snap, runtime, "plain")
    observer(state, Outcome.OK)
    observer.pending.flush()
    s = collect(registry)
    n = sum(assign(rollout, u).arm == "canary" for u in users)
    assert s.series("adapter_processor_variant_requests_total") == {
        (("arm", "canary"), ("outcome", "ok"), ("rollout", "r"), ("route", "v1")): float(n),
        (("arm", "stable"), ("outcome", "ok"), ("rollout", "r"), ("route", "v1")): float(40 - n),
        (("arm", "stable"), ("outcome", "backend_error"), ("rollout", "r"), ("route", "v1")): 1.0,
    }
    assert s.series("adapter_processor_variant_fallbacks_total") == {
        (("arm", "canary"), ("rollout", "r"), ("route", "v1")): 1.0}
    assert s.total("adapter_processor_requests_total") == 42  # the existing counter is unchanged in shape
    assert {lab for lab in s.series("adapter_processor_requests_total")} == {
        (("outcome", "ok"), ("route", "v1")), (("outcome", "backend_error"), ("route", "v1")),
        (("outcome", "ok"), ("route", "plain"))}


class _Md:
    def __init__(self, key: str, value: str):
        self.key, self.value = key, value


class _Context:
    def __init__(self, route: str):
        self.md = [_Md("x-adapter-route", route), _Md("x-request-id", "rid")]

    def invocation_metadata(self):
        return self.md


def _headers(**headers: str) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    req.request_headers.SetInParent()
    for k, v in {":path": "/v1/chat/completions", ":method": "POST", "content-type": "application/json",
                 **headers}.items():
        req.request_headers.headers.headers.add(key=k.replace("_", "-"), raw_value=v.encode())
    return req


def _body(data: bytes, phase: str = "request_body") -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    part = getattr(req, phase)
    part.body = data
    part.end_of_stream = True
    if phase == "response_body":
        req.attributes["envoy.filters.http.ext_proc"].fields["response.code"].number_value = 200
    return req


async def test_the_stream_keeps_the_key_headers_for_a_dispatch_at_the_body_and_counts_the_arm(snap):
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(snap), ProcessorMetrics(registry))
    states = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: states.append((state, outcome)))
    user = next(f"u{i}" for i in range(1000) if assign(snap.rollouts["r"].rollout, f"u{i}").arm == "canary")

    async def source():
        yield _headers(x_user_id=user, x_session_id="s1", x_canary="false")
        yield _body(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        yield _body(b'{"choices": []}', "response_body")

    replies = [r async for r in svc.Process(source(), _Context("v1"))]
    state, outcome = states[0]
    assert outcome is Outcome.OK
    assert {k: state.attrs[k] for k in ("x-user-id", "x-canary")} == {"x-user-id": user, "x-canary": "false"}
    assert "x-session-id" not in state.attrs  # only the rollout's headers are kept
    assert state.variant == "r/stable" and state.attrs[ASSIGNMENT_ATTR].how == "forced"
    body_reply = replies[1]
    sets = {h.header.key: h.header.raw_value.decode() for h in body_reply.request_body.response.header_mutation.set_headers}
    assert sets[BACKEND_HEADER] == "stable"
    assert body_reply.dynamic_metadata.fields["adapter"].struct_value.fields["variant"].string_value == "r/stable"
    svc.flush_metrics()
    assert collect(registry).series("adapter_processor_variant_requests_total") == {
        (("arm", "stable"), ("outcome", "ok"), ("rollout", "r"), ("route", "v1")): 1.0}
