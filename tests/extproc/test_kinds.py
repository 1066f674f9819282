"""The kind registry: one KindSpec per route kind, and each kind's pipeline phases (= Envoy's round trips)."""

from __future__ import annotations

import shutil
import sqlite3
import typing

import pytest

from extproc.config.loader import load_text
from extproc.config.schema import RouteKind, RouteSpec
from extproc.config.snapshot import HEALTH_ROUTE
from extproc.envoy_render import processing_mode
from extproc.errors import DIALECTS
from extproc.kinds import KindSpec, kind_specs
from extproc.types import Phase
from tests.conftest import DATA

RH, RB, PH, PB = Phase.REQUEST_HEADERS, Phase.REQUEST_BODY, Phase.RESPONSE_HEADERS, Phase.RESPONSE_BODY

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: kinds}
spec:
  modelRef: chat-model
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9001"], models: [chat-model]}
    - {name: tri, kind: triton, endpoints: ["127.0.0.1:9002"], models: [fraud]}
    - {name: ort, kind: onnxruntime, endpoints: ["127.0.0.1:9003"], models: [fraud-mlp]}
    - {name: svc, kind: rest, endpoints: ["127.0.0.1:9004"]}
  brokers: [{name: plant, address: "127.0.0.1:1883"}]
  routes:
    - {path: /llm, name: llm, kind: llm, target: llm, transform: '{"x": $.output.x}'}
    - {path: /pass, name: passthrough, kind: passthrough, target: llm}
    - {path: /v1/, match: prefix, name: openai, kind: openai, target: llm}
    - {path: /v2, match: prefix, name: kserve, kind: kserve, target: tri}
    - {path: /tensor, name: tensor, kind: tensor, target: ort, model: fraud-mlp,
       request: '{"features": [$.features]}', transform: '{"p": $.output.scores[0][1]}'}
    - {path: /tools/pets, name: tool, kind: tool, target: svc, openapi: pets.yaml}
    - {path: /orders, name: rest, kind: rest, target: svc, mapping: orders-mapping.yaml}
    - {path: /v1/messages, name: anthropic-messages, kind: anthropic-messages, target: llm}
    - {path: /v1/responses, name: openai-responses, kind: openai-responses, target: llm}
    - {path: /ask, name: sql, kind: sql, target: llm, sql: {database: shop.db}}
    - {path: /erp, name: erp, kind: erp, target: llm, erp: {process: one.bpmn, service: "http://127.0.0.1:9005",
       timeout: 300ms, operations: {t: {path: '/o/{instance}'}}}}
    - {path: /devices, name: iot, kind: iot, iot: {commands: {ping: {topic: "d/{$.device}", payload: "{}"}}}}
    - {path: /v1/realtime, name: websocket, kind: websocket, target: svc}
"""

# The table in extproc/kinds.py's docstring, stage by stage and phase by phase.
STAGES = {
    # encode-request at request headers: waits for a first negotiation (extproc/negotiate.py); at the
    # response body: the `prompt` dialect's repair retry
    "llm": {RH: ["admit", "body-limit", "encode-request"], RB: ["parse-json", "token-budget", "dispatch", "encode-request"],
            PH: ["decode-response"], PB: ["encode-request", "decode-response"]},
    "passthrough": {RH: ["admit", "body-limit", "token-budget", "dispatch"]},
    # openai-usage at the request: negotiation, then the body in the chosen backend's dialect
    "openai": {RH: ["admit", "body-limit", "openai-parse", "dispatch", "openai-usage"],
               RB: ["openai-parse", "token-budget", "dispatch", "openai-usage"], PB: ["openai-usage"]},
    "kserve": {RH: ["admit", "body-limit", "kserve-parse", "token-budget", "dispatch"]},
    "tensor": {RH: ["admit", "body-limit", "encode-request"],
               RB: ["parse-json", "token-budget", "dispatch", "model-metadata", "encode-request"],
               PH: ["decode-response"], PB: ["encode-request", "decode-response"]},
    "tool": {RH: ["admit", "body-limit"], RB: ["tool-call", "token-budget", "dispatch"], PH: ["tool-call"], PB: ["tool-call"]},
    "rest": {RH: ["admit", "body-limit", "encode-request"], RB: ["parse-json", "token-budget", "dispatch", "encode-request"],
             PH: ["decode-response"], PB: ["encode-request", "decode-response"]},
    "health": {RH: ["health"]},
    "anthropic-messages": {RH: ["admit", "body-limit", "anthropic-messages", "backend-dialect"],
                           RB: ["anthropic-messages", "token-budget", "dispatch", "backend-dialect"],
                           PH: ["anthropic-messages"], PB: ["anthropic-messages"]},
    "openai-responses": {RH: ["admit", "body-limit", "openai-responses", "backend-dialect"],
                         RB: ["openai-responses", "token-budget", "dispatch", "backend-dialect"],
                         PH: ["openai-responses"], PB: ["openai-responses"]},
    "sql": {RH: ["admit", "body-limit"], RB: ["sql-query", "token-budget", "dispatch"], PH: ["sql-query"],
            PB: ["sql-query"]},
    "erp": {RH: ["admit", "body-limit"], RB: ["erp-action", "token-budget", "dispatch"], PH: ["erp-action"],
            PB: ["erp-action"]},
    "iot": {RH: ["admit", "body-limit"], RB: ["parse-json", "mqtt-command"]},
    "websocket": {RH: ["admit", "body-limit", "websocket-upgrade", "token-budget", "dispatch"]},
}
DIALECT = {"erp": "adapter", "llm": "adapter", "passthrough": "adapter", "openai": "openai", "kserve": "kserve", "tensor": "adapter",
           "tool": "tool", "rest": "adapter", "health": "adapter", "anthropic-messages": "anthropic",
           "openai-responses": "openai", "sql": "adapter", "iot": "adapter", "websocket": "adapter"}
# What Envoy is told per kind (ExtProcPerRoute processing_mode): the round trips a request costs.
MODES = {
    "sql": ("SEND", "SEND", "BUFFERED", "BUFFERED"),  # the model's answer replaced by the rows
    "erp": ("SEND", "SEND", "BUFFERED", "BUFFERED"),  # the model's tool call replaced by the action's result
    "llm": ("SEND", "SEND", "BUFFERED", "BUFFERED"),
    "passthrough": ("SEND", "SKIP", "NONE", "NONE"),
    "openai": ("SEND", "SKIP", "BUFFERED", "STREAMED"),
    "kserve": ("SEND", "SKIP", "NONE", "NONE"),
    "tensor": ("SEND", "SEND", "BUFFERED", "BUFFERED"),
    "tool": ("SEND", "SEND", "BUFFERED", "BUFFERED"),
    "rest": ("SEND", "SEND", "BUFFERED", "BUFFERED"),
    "health": ("SEND", "SKIP", "NONE", "NONE"),
    "iot": ("SEND", "SKIP", "BUFFERED", "NONE"),  # the processor answers at the request body
    "websocket": ("SEND", "SKIP", "NONE", "NONE"),  # the upgrade's headers only: the frames never reach us
    # the translations rewrite the response: its headers (content-length) and each streamed chunk
    "anthropic-messages": ("SEND", "SEND", "BUFFERED", "STREAMED"),
    "openai-responses": ("SEND", "SEND", "BUFFERED", "STREAMED"),
}


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    d = tmp_path_factory.mktemp("kinds")
    shutil.copy(DATA / "openapi" / "petstore.yaml", d / "pets.yaml")
    shutil.copy(DATA / "contract" / "rest-mapping.yaml", d / "orders-mapping.yaml")
    (d / "one.bpmn").write_text('<definitions xmlns="http://www.omg.org/spec/BPMN/20100524/MODEL"><process id="p">'
                                 '<startEvent id="s"/><serviceTask id="t"/><sequenceFlow id="f" sourceRef="s" '
                                 'targetRef="t"/></process></definitions>')
    sqlite3.connect(d / "shop.db").executescript("CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL);")
    cfg = d / "gateway.yaml"
    cfg.write_text(CONFIG)
    return load_text(CONFIG, str(cfg))


def route_of(snap, kind: str):
    return snap.routes[HEALTH_ROUTE if kind == "health" else kind]


def test_every_route_kind_has_a_spec_and_every_spec_a_kind():
    literals = set(typing.get_args(RouteKind))
    assert literals == {"llm", "passthrough", "openai", "kserve", "tensor", "tool", "rest", "erp", "anthropic-messages",
                        "openai-responses", "sql", "iot", "websocket"}
    assert set(kind_specs()) == literals | {"health"}
    # the schema's field uses that literal (a kind added to one and not the other is caught here)
    assert typing.get_args(RouteSpec.model_fields["kind"].annotation)[0] is RouteKind


def test_specs_are_named_after_their_key_and_use_known_dialects():
    for name, spec in kind_specs().items():
        assert isinstance(spec, KindSpec) and spec.name == name
        assert spec.dialect in DIALECTS
        assert spec.doc


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        kind_specs()["new"] = None  # type: ignore[index]


def test_the_test_tables_cover_every_kind():
    assert set(STAGES) == set(DIALECT) == set(MODES) == set(kind_specs())


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_pipeline_phases_per_kind(snap, kind):
    route = route_of(snap, kind)
    assert route.kind == kind
    assert route.pipeline.phases == frozenset(STAGES[kind])


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_pipeline_stages_per_phase_in_order(snap, kind):
    hooks = route_of(snap, kind).pipeline._hooks
    assert {p: [name for name, _, _ in h] for p, h in hooks.items()} == STAGES[kind]


@pytest.mark.parametrize("kind", sorted(STAGES))
def test_only_openai_streams_its_response(snap, kind):
    expected = frozenset({PB}) if kind in ("openai", "anthropic-messages", "openai-responses") else frozenset()
    assert route_of(snap, kind).pipeline.streamed == expected


@pytest.mark.parametrize("kind", sorted(MODES))
def test_envoy_processing_mode_per_kind(snap, kind):
    mode = processing_mode(route_of(snap, kind))
    assert (mode["request_header_mode"], mode["response_header_mode"], mode["request_body_mode"],
            mode["response_body_mode"]) == MODES[kind]


@pytest.mark.parametrize("kind", sorted(DIALECT))
def test_dialect_per_kind(snap, kind):
    assert kind_specs()[kind].dialect == DIALECT[kind]
    assert route_of(snap, kind).dialect == DIALECT[kind]


def test_kind_properties():
    ks = kind_specs()
    assert {k for k, s in ks.items() if s.multi_target} == {"openai", "kserve", "anthropic-messages", "openai-responses"}
    assert {k for k, s in ks.items() if s.needs_model} == {"llm", "tensor", "sql", "erp"}
    assert {k for k, s in ks.items() if not s.prefix} == {"llm", "tensor", "health", "anthropic-messages", "erp",
                                                          "openai-responses", "sql", "iot"}
    assert {k for k, s in ks.items() if not s.needs_target} == {"iot"}
    assert {k for k, s in ks.items() if s.templates} == {"llm", "tensor", "tool", "rest", "sql", "erp"}
    assert {k for k, s in ks.items() if s.openapi} == {"tool"}
    assert {k for k, s in ks.items() if s.mapping} == {"rest"}
    assert {k: s.api for k, s in ks.items()} == {
        "erp": "openai", "llm": "openai", "passthrough": None, "openai": "openai", "kserve": "kserve", "tensor": "kserve",
        "tool": "rest", "rest": "rest", "health": None, "anthropic-messages": "openai", "openai-responses": "openai", "sql": "openai",
        "iot": None, "websocket": None}


def test_default_kind_is_llm_with_templates_and_passthrough_without():
    routes = ("  routes:\n    - {path: /a, target: llm, transform: '{\"x\": $.output.x}'}\n"
              "    - {path: /b, target: llm}\n")
    text = CONFIG.split("  routes:\n")[0] + routes
    s = load_text(text)
    assert s.routes["a"].kind == "llm" and s.routes["b"].kind == "passthrough"
    assert s.routes["b"].pipeline.phases == frozenset({RH})


async def test_an_openai_route_dispatches_at_request_headers_only_a_request_without_body():
    from extproc.runtime import Runtime
    from extproc.types import CONTINUE, HttpMessage, Mutate, RequestState

    routes = "  routes:\n    - {path: /v1/, match: prefix, name: openai, kind: openai, target: llm}\n"
    snap = load_text(CONFIG.split("  routes:\n")[0] + routes)  # built here, not by the module fixture
    route = route_of(snap, "openai")
    runtime = Runtime()
    runtime.install(snap)
    verdicts = []
    for end in (False, True):
        st = RequestState(snapshot=snap, route=route, started=0.0, runtime=runtime)
        msg = HttpMessage(RH, headers={":path": "/v1/chat/completions", ":method": "POST"}, end_of_stream=end)
        verdicts.append((await route.pipeline.run(st, msg), st.backend))
    assert verdicts[0] == (CONTINUE, None)  # the body comes next: dispatch waits for the model in it
    v, backend = verdicts[1]
    assert isinstance(v, Mutate) and ("x-adapter-backend", "llm") in v.set_headers and backend == "llm"
