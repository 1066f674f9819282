"""Endpoint arms (a rollout's arms as label selections of one backend's endpoints): the config compiles
each arm's endpoints (refusing a selector that matches none, host-name endpoints, an arm without its
backend); dispatch gives the route's picker only the arm's endpoints, and without a picker names the
arm's least-loaded endpoint first (the rest as fallbacks)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from canary.assign import Arm, Rollout, assign
from extproc.config.loader import ConfigError, load_text
from extproc.config.snapshot import DESTINATION_HEADER
from extproc.runtime import Runtime
from extproc.types import CONTINUE, HttpMessage, Mutate, Phase, RequestState

V1 = ("127.0.0.1:9001", "127.0.0.1:9002")
V2 = ("127.0.0.1:9003",)
ARMS = ('[{name: v1, backend: pool, endpoints: {matchLabels: {version: v1}}}, '
        '{name: v2, backend: pool, endpoints: {matchLabels: {version: v2}}, weight: 40}]')
CONFIG = f"""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: endpoint-arms}}
spec:
  backends:
    - name: pool
      models: [m]
      endpoints:
        - {{address: "127.0.0.1:9001", labels: {{version: v1}}}}
        - {{address: "127.0.0.1:9002", labels: {{version: v1}}}}
        - {{address: "127.0.0.1:9003", labels: {{version: v2}}}}
  plugins:
    - {{type: in-flight-scorer}}
    - {{type: max-score-picker, parameters: {{fallbacks: 2}}}}
  schedulingProfiles:
    - {{name: p, plugins: [{{pluginRef: in-flight-scorer}}, {{pluginRef: max-score-picker}}]}}
  routes:
    - {{path: /a/, match: prefix, kind: openai, name: a, target: pool, plugins: [p]}}
    - {{path: /b/, match: prefix, kind: openai, name: b, target: pool}}
  rollouts:
    - {{name: ra, route: a, arms: {ARMS}, key: {{sources: [{{header: x-user-id}}], trustedHeaders: [x-user-id]}}}}
    - {{name: rb, route: b, arms: {ARMS}, key: {{sources: [{{header: x-user-id}}], trustedHeaders: [x-user-id]}}}}
"""
ROLLOUTS = {name: Rollout(name, canaries=(Arm("v2", 4000),), baseline="v1") for name in ("ra", "rb")}


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "arms.yaml")


@pytest.fixture
def runtime(snap):
    rt = Runtime()
    rt.install(snap)
    return rt


def send(snap, runtime, route: str, user: str) -> tuple[RequestState, tuple[str, ...]]:
    r = snap.routes[route]
    state = RequestState(snapshot=snap, route=r, started=0.0, request_id="rid", runtime=runtime)
    state.attrs["x-user-id"] = user  # what the stream keeps at request headers for the rollout
    h = {":path": f"/{route}/chat/completions", ":method": "POST", "content-type": "application/json"}
    assert asyncio.run(r.pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=h))) is CONTINUE
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    v = asyncio.run(r.pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True)))
    assert isinstance(v, Mutate), v
    return state, tuple(dict(v.set_headers)[DESTINATION_HEADER].split(","))


def test_the_config_compiles_each_arms_endpoints(snap):
    ref = snap.rollouts["ra"]
    assert dict(ref.arm_endpoints) == {"v1": V1, "v2": V2}
    assert dict(ref.arm_backends) == {"v1": "pool", "v2": "pool"}


@pytest.mark.parametrize("route", ["a", "b"])
def test_every_pick_and_fallback_is_an_endpoint_of_the_requests_arm(snap, runtime, route):
    for i in range(40):
        user = f"user-{i}"
        arm = assign(ROLLOUTS["r" + route], user).arm
        state, picks = send(snap, runtime, route, user)
        assert state.variant == f"r{route}/{arm}"
        assert set(picks) <= set(V1 if arm == "v1" else V2) and picks[0] == state.endpoint
        assert len(picks) == (2 if arm == "v1" else 1)


def test_without_a_picker_the_arms_least_loaded_endpoint_comes_first(snap, runtime):
    user = next(f"u{i}" for i in range(100) if assign(ROLLOUTS["rb"], f"u{i}").arm == "v1")
    runtime.inflight.started(V1[0])
    runtime.inflight.started(V1[0])
    assert send(snap, runtime, "b", user)[1] == (V1[1], V1[0])
    for _ in range(3):
        runtime.inflight.started(V1[1])
    assert send(snap, runtime, "b", user)[1][0] == V1[0]  # 2 in flight there against 4 (3 + the last request)


@pytest.mark.parametrize("arms, field, reason", [
    ('[{name: v1, backend: pool}, {name: v2, backend: pool, endpoints: {matchLabels: {version: v9}}, weight: 10}]',
     "spec.rollouts[0].arms[1].endpoints.matchLabels", "no endpoint of backend 'pool' has labels"),
    ('[{name: v1, backend: pool}, {name: v2, endpoints: {matchLabels: {version: v2}}, weight: 10}]',
     "spec.rollouts[0].arms[1].endpoints", "an endpoint arm names its backend too"),
    ('[{name: v1, backend: pool}, {name: v2, backend: pool, endpoints: {matchLabels: {}}, weight: 10}]',
     "spec.rollouts[0].arms[1].endpoints.matchLabels", ""),
])
def test_a_bad_endpoint_arm_is_refused_with_its_field(arms, field, reason):
    text = CONFIG.split("  rollouts:\n")[0] + f"  rollouts:\n    - {{name: r, route: b, arms: {arms}}}\n"
    with pytest.raises(ConfigError) as e:
        load_text(text, "arms.yaml")
    assert field in str(e.value) and reason in str(e.value)


def test_endpoint_arms_need_ip_endpoints():
    text = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: hosts}
spec:
  backends:
    - name: pool
      models: [m]
      endpoints: [{address: "vllm-a:8000", labels: {version: v1}}, {address: "vllm-b:8000", labels: {version: v2}}]
  routes: [{path: /b/, match: prefix, kind: openai, name: b, target: pool}]
  rollouts:
    - {name: r, route: b, arms: [{name: v1, backend: pool, endpoints: {matchLabels: {version: v1}}},
                                 {name: v2, backend: pool, endpoints: {matchLabels: {version: v2}}, weight: 5}]}
"""
    with pytest.raises(ConfigError) as e:
        load_text(text, "hosts.yaml")
    assert "spec.rollouts[0].arms[0].endpoints" in str(e.value) and "host-name endpoints" in str(e.value)
