"""Priority classes (extproc/qos/priority.py): where a request's class comes from (trusted header, route,
tenant, default), the brief's priority matrix, the engine's priority in the backend body, and the
config's refusals with their field paths."""

from __future__ import annotations

import orjson
import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.qos.engine import RouteQos, qos_of
from extproc.qos.priority import base_class, compile_classes, engine_body, matrix_class
from extproc.config.schema import QosSpec

CLASSES = {c.name: c for c in compile_classes(QosSpec().classes)}
P0, P1, P2 = CLASSES["P0"], CLASSES["P1"], CLASSES["P2"]
OBJECTIVES = {"premium": "P0", "batch": "P2"}
HEADER = "x-gateway-inference-objective"


def test_default_classes():
    assert [(c.name, c.rank, c.critical, c.engine_priority, c.triton_priority) for c in CLASSES.values()] == [
        ("P0", 0, True, 0, 1), ("P1", 1, False, 1, 2), ("P2", 2, False, 2, 3)]


def rq(cls=None, header=HEADER, workload="latency"):
    return RouteQos("r", cls, workload, header)


@pytest.mark.parametrize("route_qos, tenant, headers, expected", [
    (rq(P2), P0, {HEADER: "P0"}, ("P0", "header")),  # a class name in the trusted header
    (rq(P0), None, {HEADER: "batch"}, ("P2", "header")),  # an objective mapped to a class
    (rq(P2), P0, {HEADER: "no-such"}, ("P2", "route")),  # an unknown value is ignored
    (rq(P2, header=None), P0, {HEADER: "P0"}, ("P2", "route")),  # a route that trusts no header
    (rq(None, header=None), P0, {HEADER: "P0"}, ("P0", "tenant")),
    (rq(None), None, {}, ("P1", "default")),
    (None, None, {HEADER: "P0"}, ("P1", "default")),  # a route without QoS settings trusts nothing
    (None, P2, None, ("P2", "tenant")),
])
def test_base_class_precedence(route_qos, tenant, headers, expected):
    cls, source = base_class(CLASSES, OBJECTIVES, route_qos, tenant, P1, headers)
    assert (cls.name, source) == expected


@pytest.mark.parametrize("workload, escalated, applies, expected", [
    ("latency", True, True, "P0"),  # deviation below -5 %: latency-sensitive work raised to P0
    ("throughput", True, True, "P2"),  # throughput work lowered to P2
    ("latency", False, True, "P1"),  # within the band: kept at P1
    ("throughput", False, True, "P1"),
    ("latency", True, False, "P1"),  # a class the matrix does not apply to keeps its class
])
def test_the_brief_matrix(workload, escalated, applies, expected):
    assert matrix_class(P1, workload, escalated, P0, P2, applies).name == expected


def test_engine_body_openai_sets_vllm_priority_over_the_clients():
    body = {"model": "m", "priority": -100}
    assert orjson.loads(engine_body("vllm", P2, body, None)) == {"model": "m", "priority": 2}
    # an llm route: the adapter's encoded request
    assert orjson.loads(engine_body("openai", P0, None, b'{"messages":[]}')) == {"messages": [], "priority": 0}


def test_engine_body_kserve_sets_the_priority_parameter():
    out = engine_body("triton", P0, None, b'{"inputs":[],"parameters":{"x":1}}')
    assert orjson.loads(out) == {"inputs": [], "parameters": {"x": 1, "priority": 1}}
    assert engine_body("onnxruntime", P0, None, b'{"inputs":[]}"\x00\x01binary') is None  # binary extension
    assert engine_body("rest", P0, {"a": 1}, None) is None


BASE = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: q}
spec:
  tenants: [{id: tenant-a}]
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9"], models: [m]}
    - {name: svc, kind: rest, endpoints: ["127.0.0.1:10"]}
  routes: [{path: /v1/, match: prefix, kind: openai, name: api, target: llm}]
  qos:
"""


def refusal(qos: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_text(BASE + qos, "q.yaml")
    return str(e.value)


@pytest.mark.parametrize("qos, where, reason", [
    ("    defaultClass: P9\n", "spec.qos.defaultClass", "unknown priority class 'P9' (classes: P0, P1, P2)"),
    ("    routes: [{route: nope}]\n", "spec.qos.routes[0].route", "unknown route 'nope' (routes: api)"),
    ("    routes: [{route: api, priorityClass: gold}]\n", "spec.qos.routes[0].priorityClass", "unknown priority"),
    ("    tenants: [{tenant: tenant-z}]\n", "spec.qos.tenants[0].tenant", "unknown tenant 'tenant-z'"),
    ("    enginePriority: [svc]\n", "spec.qos.enginePriority[0]", "is of kind rest"),
    ("    objectives: {gold: P7}\n", "spec.qos.objectives.gold", "unknown priority class 'P7'"),
    ("    slos: [{name: s}]\n", "spec.qos.slos[0]", "declares no objective"),
    ("    slos: [{name: s, p99: 1s}, {name: s, ttft: 1s}]\n", "spec.qos.slos[1].name", "duplicate SLO name"),
    ("    matrix: {below: -2, recover: -5}\n", "spec.qos.matrix.recover", "must be at or above below"),
    ("    classes: [{name: A}, {name: A}]\n", "spec.qos.classes[1].name", "duplicate priority class"),
    ("    routes: [{route: api, objectiveHeader: X-Bad}]\n", "spec.qos.routes[0].objectiveHeader", ""),
])
def test_bad_qos_config_names_file_field_and_reason(qos, where, reason):
    text = refusal(qos)
    assert "q.yaml:" in text and where in text and reason in text, text


def test_config_without_qos_has_no_qos_stage():
    snap = load_text(BASE.replace("  qos:\n", ""), "q.yaml")
    assert qos_of(snap) is None
    assert not [s for s in snap.routes["api"].pipeline.stages if s.name.startswith("qos-")]


def test_qos_stages_sit_after_admit_and_last():
    snap = load_text(BASE + "    window: 50ms\n", "q.yaml")
    names = [s.name for s in snap.routes["api"].pipeline.stages]
    assert names[:2] == ["admit", "qos-admit"] and names[-1] == "qos-engine"
    assert qos_of(snap).window == 0.05
    assert [s.name for s in snap.routes["adapter-health"].pipeline.stages] == ["health"]
