"""compile_snapshot, exactly: every issue of a file with many faults (path, line and message, in the
order found, each fault reported and the next route still checked), and every value a valid file
compiles into (defaults, implicit backends, model and health-path choices, the built-in health
route, derived output schemas). Written for issue 9's mutation testing: substring checks on one
fault at a time let altered messages, paths and `continue`s through."""

from __future__ import annotations

import pytest

from extproc.config.compile import derive_output_schema, model_name, route_name_from_path
from extproc.config.loader import ConfigError, load_text
from extproc.template import compile_template

MANY_FAULTS = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: many}
spec:
  modelRef: m1
  listener: {port: 18080}
  admin: {port: 18080}
  processor: {basePort: 15051, adminPort: 15052, workers: 2}
  tenancy: {source: jwt, header: x-tenant, jwt: {issuer: "https://issuer", audiences: [a], jwks: "{\\"keys\\": []}", claim: tenant}}
  tenants: [{id: acme}, {id: beta}, {id: acme}, {id: beta}]
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9000", "127.0.0.1:9000", "127.0.0.1:9001", "127.0.0.1:9001"]}
    - {name: ort, kind: onnxruntime, protocol: http, endpoints: ["127.0.0.1:9002"]}
    - {name: svc, kind: rest, endpoints: ["127.0.0.1:9003"]}
    - {name: llm, endpoints: ["127.0.0.1:9004"]}
    - {name: ort, endpoints: ["127.0.0.1:9005"]}
  routes:
    - {path: /ok, target: llm}
    - {path: /dup-name, name: ok, target: llm}
    - {path: /h, name: adapter-health, target: llm}
    - {path: /ok, name: other, target: llm}
    - {path: /health/adapter, name: h2, target: llm}
    - {path: /ok, match: prefix, name: okp, target: llm}
    - {path: /both, target: llm, targets: [llm]}
    - {path: /nowhere, target: nowhere}
    - {path: /tmpl, kind: passthrough, target: llm, request: '{"a": 1}'}
    - {path: /api, kind: openai, targets: [ort, svc]}
    - {path: /api2, kind: kserve, target: llm}
    - {path: /oa, target: llm, openapi: x.yaml}
    - {path: /map, target: llm, mapping: m.yaml}
    - {path: /two, targets: [llm, llm]}
    - {path: /pre/, match: prefix, kind: llm, target: llm}
    - {path: /tensor, kind: tensor, target: ort}
    - {path: /schema, target: llm, transform: '{"x": $.output.x}', outputSchema: {type: array}}
    - {path: /jwt, target: llm, policy: {tenantHeader: x-tenant}}
    - {path: /jwt2, target: llm, policy: {tenantHeader: x-tenant}}
    - {path: /tool, kind: tool, target: svc}
    - {path: /last, target: "10.0.0.1:80"}
    - {path: /last2, target: "10.0.0.1:80"}
    - {path: /clash, target: "svc:81"}
"""

JWT_HEADER = ("x-tenant is set by Envoy from the JWT claim (clients' copies are removed); a route can only trust "
              "another header")
MANY_ISSUES = [
    (12, "spec.backends[0].endpoints[1]", "duplicate endpoint '127.0.0.1:9000'"),
    (12, "spec.backends[0].endpoints[3]", "duplicate endpoint '127.0.0.1:9001'"),
    (15, "spec.backends[3].name", "duplicate backend name 'llm'"),
    (16, "spec.backends[4].name", "duplicate backend name 'ort'"),
    (19, "spec.routes[1].name", "duplicate route name 'ok' (set a distinct `name`)"),
    (20, "spec.routes[2].name", "duplicate route name 'adapter-health' (set a distinct `name`)"),
    (21, "spec.routes[3].path", "path '/ok' is already used by routes[0]"),
    (22, "spec.routes[4].path", "path '/health/adapter' is already used by the built-in health route"),
    (24, "spec.routes[6].targets", "set target or targets, not both"),
    (25, "spec.routes[7].target", "'nowhere' is neither a declared backend (llm, ort, svc) nor host:port"),
    (26, "spec.routes[8].kind", "a passthrough route forwards bodies as they are: request, transform and outputSchema "
                                "need kind: llm or tensor"),
    (27, "spec.routes[9].kind", "a openai route needs openai backends; ort, svc speak another API (see backends[].kind)"),
    (28, "spec.routes[10].kind", "a kserve route needs kserve backends; llm speaks another API (see backends[].kind)"),
    (29, "spec.routes[11].openapi", "only tool routes read an OpenAPI document"),
    (30, "spec.routes[12].mapping", "only rest routes apply a field-mapping file"),
    (31, "spec.routes[13].targets", "a passthrough route has one target"),
    (32, "spec.routes[14].match", "a llm route maps one endpoint: use match: exact"),
    (34, "spec.routes[16].outputSchema", "must be a JSON Schema of type object"),
    (37, "spec.routes[19].openapi", "a tool route needs `openapi`: the service's OpenAPI document"),
    (40, "spec.routes[22].target", "target 'svc:81' would define implicit backend 'svc', which already exists with "
                                   "other endpoints; refer to the backend by name instead"),
    (10, "spec.tenants[2].id", "duplicate tenant id 'acme'"),
    (10, "spec.tenants[3].id", "duplicate tenant id 'beta'"),
    (35, "spec.routes[17].policy.tenantHeader", JWT_HEADER),
    (36, "spec.routes[18].policy.tenantHeader", JWT_HEADER),
    (7, "spec.admin.port", "port 18080 is also used by spec.listener.port"),
    (8, "spec.processor.basePort", "port 15052 is also used by spec.processor.adminPort"),
]


def issues(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(ConfigError) as e:
        load_text(text, "many.yaml")
    out = []
    for i in e.value.issues:
        file, _, line = i.where.rpartition(":")
        assert file == "many.yaml", i.where
        out.append((int(line), i.path, i.reason))
    return out


def test_every_fault_of_a_file_is_reported_exactly_in_order():
    assert issues(MANY_FAULTS) == MANY_ISSUES


HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: one}
spec:
"""


@pytest.mark.parametrize("spec, expected", [
    ("  backends: [{name: ort, kind: onnxruntime, endpoints: ['127.0.0.1:9']}]\n"
     "  routes: [{path: /t, kind: tensor, target: ort}, {path: /u, kind: tensor, target: ort}]\n",
     [(6, "spec.routes[0].model", "an tensor route needs a model: set route.model, spec.modelRef or the backend's models"),
      (6, "spec.routes[1].model", "an tensor route needs a model: set route.model, spec.modelRef or the backend's models")]),
    ("  backends: [{name: a, endpoints: ['127.0.0.1:9']}, {name: b, endpoints: ['127.0.0.1:8']}]\n"
     "  routes: [{path: /x}, {path: /y, target: nowhere}]\n",
     [(6, "spec.routes[0].target", "required when spec.backends does not declare exactly one backend"),
      (6, "spec.routes[1].target", "'nowhere' is neither a declared backend (a, b) nor host:port")]),
    ("  routes: [{path: /x, target: nowhere}]\n",
     [(5, "spec.routes[0].target", "'nowhere' is neither a declared backend (none declared) nor host:port")]),
    ("  routes: [{path: /x, targets: [a, 'b:1']}]\n",
     [(5, "spec.routes[0].targets[0]", "'a' is neither a declared backend (none declared) nor host:port")]),
    ("  tenancy: {jwt: {issuer: i, jwks: '{}'}}\n  routes: [{path: /x, target: '127.0.0.1:1'}]\n",
     [(5, "spec.tenancy.jwt", "source: jwt needs a jwt block, and a jwt block needs source: jwt")]),
    ("  listener: {port: 15052}\n  processor: {basePort: 15051, workers: 3, adminPort: 15051}\n"
     "  routes: [{path: /x, target: '127.0.0.1:1'}]\n",
     # one issue per entry: 15052 (also the listener's) is not reported a second time
     [(6, "spec.processor.basePort", "port 15051 is also used by spec.processor.adminPort")]),
])
def test_more_faults_exactly(spec, expected):
    assert issues(HEAD + spec) == expected


GOOD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: good}
spec:
  modelRef: "qwen@registry.internal"
  protocol: grpc
  processor: {workers: 1}
  tenants: [{id: acme}]
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9000"], models: [qwen, other], timeout: 7s}
    - {name: tri, kind: triton, endpoints: ["127.0.0.1:9001"], models: [fraud]}
    - {name: trih, kind: triton, protocol: http, endpoints: ["127.0.0.1:9002"], healthPath: /ready}
    - {name: trih2, kind: triton, protocol: http, endpoints: ["127.0.0.1:9003"]}
  routes:
    - {path: /V1/Chat--Now/, target: llm, transform: '{"a": $.output.a}'}
    - {path: /v1/, match: prefix, kind: openai, targets: [llm, llm], policy: {maxBodyBytes: 2048, timeout: 3s, failureMode: open, tenantHeader: x-t}}
    - {path: /v2, match: prefix, kind: kserve, targets: [tri, trih]}
    - {path: /imp, target: "Host.Example:8080", policy: {timeout: 9s}}
    - {path: /imp2, name: imp-again, target: "Host.Example:8080"}
    - {path: /m, target: tri, kind: tensor, request: '{"x": $.x}', transform: '{"p": $.output.p}'}
    - {path: /own, target: llm, model: mine, transform: '{"a": $.output.a}'}
"""
OBJECT_A = {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False}


def test_a_valid_file_compiles_into_exactly_these_backends_and_routes():
    s = load_text(GOOD, "good.yaml", generation=5)
    assert (s.generation, s.source, s.model_ref) == (5, "good.yaml", "qwen@registry.internal")
    assert [t.id for t in s.tenants] == ["acme"] and s.processor.workers == 1
    assert {n: (b.kind, b.protocol, b.endpoints, b.models, b.health_path, b.timeout, b.implicit, type(b.adapter).__name__)
            for n, b in s.backends.items()} == {
        "llm": ("openai", "grpc", (("127.0.0.1", 9000),), ("qwen", "other"), "/health", 7.0, False, "OpenAIAdapter"),
        "tri": ("triton", "grpc", (("127.0.0.1", 9001),), ("fraud",), "/inference.GRPCInferenceService/ServerReady",
                60.0, False, "TritonAdapter"),
        "trih": ("triton", "http", (("127.0.0.1", 9002),), (), "/ready", 60.0, False, "TritonAdapter"),
        "trih2": ("triton", "http", (("127.0.0.1", 9003),), (), "/v2/health/ready", 60.0, False, "TritonAdapter"),
        # a host:port target: an implicit openai backend named after the host, the route's timeout, spec.protocol
        "host-example": ("openai", "grpc", (("Host.Example", 8080),), (), "/health", 9.0, True, "OpenAIAdapter"),
    }
    assert all(r.tools is None and r.mapping is None for r in s.routes.values())
    assert (s.tenancy.source, s.tenancy.header) == ("header", "x-tenant-id")
    routes = {n: (r.name, r.path, r.kind, r.backend and r.backend.name, r.model, r.max_body_bytes, r.timeout, r.failure_mode,
                  r.match, r.tenant_header, tuple(b.name for b in r.backends), r.dialect, r.response_schema,
                  r.request is not None, r.transform is not None) for n, r in s.routes.items()}
    assert routes == {
        "v1-chat-now": ("v1-chat-now", "/V1/Chat--Now/", "llm", "llm", "qwen", 1048576, 60.0, "closed", "exact", None, ("llm",),
                        "adapter", OBJECT_A, False, True),
        "v1": ("v1", "/v1/", "openai", "llm", "qwen", 2048, 3.0, "open", "prefix", "x-t", ("llm",), "openai", None, False, False),
        "v2": ("v2", "/v2", "kserve", "tri", "qwen", 1048576, 60.0, "closed", "prefix", None, ("tri", "trih"), "kserve", None,
               False, False),
        "imp": ("imp", "/imp", "passthrough", "host-example", "qwen", 1048576, 9.0, "closed", "exact", None, ("host-example",),
                "adapter", None, False, False),
        "imp-again": ("imp-again", "/imp2", "passthrough", "host-example", "qwen", 1048576, 60.0, "closed", "exact", None,
                      ("host-example",), "adapter", None, False, False),
        "m": ("m", "/m", "tensor", "tri", "qwen", 1048576, 60.0, "closed", "exact", None, ("tri",), "adapter",
              {"type": "object", "properties": {"p": {}}, "required": ["p"], "additionalProperties": False}, True, True),
        "own": ("own", "/own", "llm", "llm", "mine", 1048576, 60.0, "closed", "exact", None, ("llm",), "adapter", OBJECT_A,
                False, True),
        "adapter-health": ("adapter-health", "/health/adapter", "health", None, None, 4096, 5.0, "closed", "exact", None, (), "adapter",
                           None, False, False),
    }
    assert s.routes["imp"].backend is s.routes["imp-again"].backend is s.backends["host-example"]
    assert all(r.pipeline is not None for r in s.routes.values())
    assert [st.name for st in s.routes["adapter-health"].pipeline.stages] == ["health"]


def test_without_a_model_ref_the_backends_first_model_is_the_default():
    s = load_text(HEAD + "  backends: [{name: llm, endpoints: ['127.0.0.1:9'], models: [first, second]}]\n"
                  "  routes: [{path: /a, transform: '{\"a\": $.output.a}'}, {path: /b}]\n")
    assert (s.routes["a"].model, s.routes["b"].model, s.routes["a"].backend.name) == ("first", "first", "llm")
    s = load_text(HEAD + "  backends: [{name: llm, endpoints: ['127.0.0.1:9']}]\n  routes: [{path: /b}]\n")
    assert s.routes["b"].model is None and s.model_ref is None


@pytest.mark.parametrize("ref, name", [("qwen@registry.internal", "qwen"), ("a@b@c", "a"), ("plain", "plain"),
                                       ("@registry", None), ("", None), (None, None)])
def test_model_name(ref, name):
    assert model_name(ref) == name


@pytest.mark.parametrize("path, name", [
    ("/v1/chat/completions", "v1-chat-completions"), ("/V1/Chat--Now/", "v1-chat-now"), ("/", "root"),
    ("/a_b.c", "a-b-c"), ("/" + "x" * 62 + "/y", "x" * 62), ("/" + "x" * 70, "x" * 63), ("/--/", "root"),
    ("/X", "x"), ("/Xa/", "xa"),
])
def test_route_name_from_path(path, name):
    assert route_name_from_path(path) == name


def test_derived_output_schema_nests_objects_and_arrays_required_unless_defaulted():
    t = compile_template('{"a": $.output.user.name, "b": $.output.user.tags[0], "c": $.output.items[*].id,'
                         ' "d": $.output.opt ?? 1, "e": $.input.q, "f": $.output.user.name, "g": $.output}')
    assert derive_output_schema(t) == {
        "type": "object", "additionalProperties": False, "required": ["user", "items"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
                     "properties": {"name": {}, "tags": {"type": "array", "items": {}}}},
            "items": {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["id"],
                                                 "properties": {"id": {}}}},
            "opt": {}}}
    assert derive_output_schema(compile_template('{"e": $.input.q, "g": $.output}')) is None


def test_files_a_route_names_are_read_relative_to_the_config_and_their_faults_name_the_file(tmp_path):
    import shutil

    from extproc.config.loader import load_file
    from tests.conftest import DATA

    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    shutil.copy(DATA.parent / "fixtures" / "openapi" / "v3.1" / "webhook-example.yaml", tmp_path / "noops.yaml")
    shutil.copy(DATA / "contract" / "rest-mapping.yaml", tmp_path / "orders.yaml")
    (tmp_path / "bad.yaml").write_text("not: [a mapping\n")
    base = HEAD + "  backends: [{name: svc, kind: rest, endpoints: ['127.0.0.1:9']}]\n  routes:\n"
    good = base + ("    - {path: /t, kind: tool, target: svc, openapi: pets.yaml}\n"
                   f"    - {{path: /t2, kind: tool, target: svc, openapi: {tmp_path / 'pets.yaml'}}}\n"
                   "    - {path: /r, kind: rest, target: svc, mapping: orders.yaml}\n")
    (tmp_path / "good.yaml").write_text(good)
    s = load_file(tmp_path / "good.yaml")
    assert s.routes["t"].tools.tools and s.routes["t2"].tools.tools and s.routes["r"].mapping is not None
    bad = base + ("    - {path: /t, kind: tool, target: svc, openapi: noops.yaml}\n"
                  "    - {path: /t2, kind: tool, target: svc, openapi: missing.yaml}\n"
                  "    - {path: /r, kind: rest, target: svc, mapping: bad.yaml}\n"
                  "    - {path: /r2, kind: rest, target: svc, mapping: none.yaml}\n")
    (tmp_path / "bad-config.yaml").write_text(bad)
    with pytest.raises(ConfigError) as e:
        load_file(tmp_path / "bad-config.yaml")
    got = [(i.where.rpartition(":")[2], i.path, i.reason) for i in e.value.issues]
    assert [g[:2] for g in got] == [("7", "spec.routes[0].openapi"), ("8", "spec.routes[1].openapi"),
                                    ("9", "spec.routes[2].mapping"), ("10", "spec.routes[3].mapping")]
    assert got[0][2] == "noops.yaml: no operation could be turned into a tool"
    assert got[1][2].startswith("missing.yaml: ") and str(tmp_path / "missing.yaml") in got[1][2]
    assert got[2][2].startswith("bad.yaml: ") and got[3][2].startswith("none.yaml: ")
    assert str(tmp_path / "none.yaml") in got[3][2]


def test_a_bad_template_points_at_its_own_line_or_at_the_route_field():
    text = HEAD + ("  backends: [{name: llm, endpoints: ['127.0.0.1:9'], models: [m]}]\n  routes:\n"
                   "    - path: /a\n      transform: |\n        {\"a\": $.output.a,\n         \"b\": $$}\n"
                   "    - {path: /b, request: '{\"x\": ]'}\n")
    got = issues(text)
    assert [(line, path) for line, path, _ in got] == [(10, "spec.routes[0].transform"), (11, "spec.routes[1].request")]
    assert all(reason.startswith("template error at line ") for _, _, reason in got)
    assert got[0][2].startswith("template error at line 2, column ")


def test_without_workers_the_processor_ports_span_the_cpu_count():
    import os

    n = os.cpu_count() or 1
    text = HEAD + "  processor: {basePort: 15051, adminPort: ADMIN}\n  routes: [{path: /x, target: '127.0.0.1:1'}]\n"
    assert issues(text.replace("ADMIN", str(15051 + n - 1))) == [
        (5, "spec.processor.basePort", f"port {15051 + n - 1} is also used by spec.processor.adminPort")]
    assert load_text(text.replace("ADMIN", str(15051 + n))).processor.admin_port == 15051 + n


def test_compile_snapshot_alone_reads_files_relative_to_the_config_and_defaults_generation_and_digest(tmp_path):
    import shutil

    from extproc.config.compile import compile_snapshot
    from extproc.config.loader import parse_text
    from tests.conftest import DATA

    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    text = HEAD + ("  backends: [{name: svc, kind: rest, endpoints: ['127.0.0.1:9']}]\n  routes:\n"
                   "    - {path: /t, kind: tool, target: svc, openapi: pets.yaml}\n"
                   f"    - {{path: /u, kind: tool, target: svc, openapi: {tmp_path / 'pets.yaml'}}}\n")
    s = compile_snapshot(*parse_text(text, str(tmp_path / "gateway.yaml")))
    assert (s.generation, s.digest) == (1, "")
    assert s.routes["t"].tools.tools and s.routes["u"].tools.tools
    with pytest.raises(ConfigError) as e:
        compile_snapshot(*parse_text(text, str(tmp_path / "elsewhere" / "gateway.yaml")))
    assert [i.path for i in e.value.issues] == ["spec.routes[0].openapi"]  # not next to that file; the absolute one is


def test_a_route_with_a_fault_is_not_checked_further_and_the_next_route_is():
    text = HEAD + ("  backends: [{name: llm, endpoints: ['127.0.0.1:9'], models: [m]}]\n  routes:\n"
                   "    - {path: /a, plugins: [nope], transform: '{\"x\": ]'}\n"
                   "    - {path: /b, request: '{\"x\": ]', outputSchema: {type: array}}\n"
                   "    - {path: /c, transform: '{\"x\": $.output.x}', outputSchema: {type: array}}\n")
    got = [(path, reason.split(" (")[0] if path.endswith("plugins[0]") else reason[:15]) for _, path, reason in issues(text)]
    assert got == [("spec.routes[0].plugins[0]", "no plugin or scheduling profile named 'nope'"),
                   ("spec.routes[1].request", "template error "),
                   ("spec.routes[2].outputSchema", "must be a JSON ")]


def test_an_output_schema_without_a_type_is_an_object_schema():
    s = load_text(HEAD + "  backends: [{name: llm, endpoints: ['127.0.0.1:9'], models: [m]}]\n"
                  "  routes: [{path: /a, transform: '{\"x\": $.output.x}', outputSchema: {properties: {x: {type: integer}}}}]\n")
    assert s.routes["a"].response_schema == {"properties": {"x": {"type": "integer"}}}


def test_an_implicit_backend_is_reused_only_for_the_same_endpoint_and_never_over_a_declared_one():
    text = HEAD + ("  backends: [{name: host-a, endpoints: ['host.a:8000']}]\n  routes:\n"
                   "    - {path: /a, target: 'host.a:8000'}\n"
                   "    - {path: /b, target: '10.0.0.1:80'}\n    - {path: /c, target: '10.0.0.1:81'}\n")
    assert issues(text) == [
        (7, "spec.routes[0].target", "target 'host.a:8000' would define implicit backend 'host-a', which already exists "
                                     "with other endpoints; refer to the backend by name instead"),
        (9, "spec.routes[2].target", "target '10.0.0.1:81' would define implicit backend '10-0-0-1', which already "
                                     "exists with other endpoints; refer to the backend by name instead")]


def test_a_pipeline_that_cannot_be_built_is_reported_at_the_route_and_the_route_kept():
    from extproc.config.compile import _with_pipeline
    from extproc.pipeline import PipelineError

    s = load_text(HEAD + "  routes: [{path: /a, target: '127.0.0.1:1'}]\n")
    route, found = s.routes["a"], []

    def broken(r):
        raise PipelineError(f"stage of {r.name} is malformed")

    assert _with_pipeline(route, broken, ("spec", "routes", 0), lambda path, reason: found.append((path, reason))) is route
    assert found == [(("spec", "routes", 0), "stage of a is malformed")]


# --- spec.epp (EPP mode, extproc/epp.py) ----------------------------------------------------------------

EPP = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: epp}
spec:
  processor: {basePort: 9002, feedback: stream}
  backends:
    - {name: pool, endpoints: ["10.0.0.1:8000", "10.0.0.2:8000"], timeout: 12s, lbPolicy: roundRobin}
    - {name: svc, kind: rest, endpoints: ["10.0.0.3:80"]}
    - {name: named, endpoints: ["model-a:8000"]}
  plugins: [{type: max-score-picker}]
  epp: {pool: pool, profile: max-score-picker, healthPort: 9003, maxBodyBytes: 4096, modelRewrites: {alias: base}}
"""


def test_an_epp_section_compiles_into_its_route_and_settings():
    s = load_text(EPP, "epp.yaml")
    e, r = s.epp, s.epp.route
    assert (e.health_port, dict(e.model_rewrites), e.tls) == (9003, {"alias": "base"}, None)
    assert (r.name, r.path, r.kind, r.backend, r.model, r.failure_mode, r.max_body_bytes, r.timeout, r.match,
            r.backends, r.dialect) == ("epp", "/", "openai", s.backends["pool"], None, "closed", 4096, 12.0,
                                       "prefix", (s.backends["pool"],), "openai")
    assert r.picker.name == "max-score-picker"
    assert (s.backends["pool"].lb_policy, s.backends["svc"].lb_policy) == ("roundRobin", "leastRequest")


def test_epp_tls_files_are_kept_when_readable(tmp_path):
    cert, key = tmp_path / "epp.crt", tmp_path / "epp.key"
    cert.write_text("c")
    key.write_text("k")
    s = load_text(EPP.replace("healthPort: 9003", f"tls: {{certFile: {cert}, keyFile: {key}}}"))
    assert s.epp.tls == (str(cert), str(key))
    with pytest.raises(ConfigError) as e:
        load_text(EPP.replace("healthPort: 9003", f"tls: {{certFile: {cert}, keyFile: {tmp_path / 'none.key'}}}"))
    assert [(i.path, i.reason) for i in e.value.issues] == [
        ("spec.epp.tls.keyFile", f"cannot read {tmp_path / 'none.key'}")]


@pytest.mark.parametrize("change, expected", [
    (("pool: pool,", "pool: svc,"), [("spec.epp.pool", "EPP mode parses OpenAI-API bodies: backend 'svc' is kind rest")]),
    (("pool: pool,", "pool: named,"), [("spec.epp.pool", "the endpoint-picker protocol names endpoints as ip:port: "
                                        "backend 'named' lists host names (give the InferencePool's pod IPs)")]),
    (("pool: pool,", "pool: nope,"), [("spec.epp.pool", "no backend named 'nope' (backends: pool, svc, named)")]),
    (("basePort: 9002,", "basePort: 9002, workers: 3,"), [
        ("spec.processor.workers", "EPP mode serves one port (the InferencePool's endpointPickerRef port, basePort): "
                                   "workers must be 1; scale with replicas"),
        ("spec.epp.healthPort", "port 9003 is also used by spec.processor.basePort")]),
    (("healthPort: 9003", "healthPort: 9002"), [("spec.epp.healthPort", "port 9002 is also used by spec.processor.basePort")]),
])
def test_epp_faults_exactly(change, expected):
    with pytest.raises(ConfigError) as e:
        load_text(EPP.replace(*change))
    assert [(i.path, i.reason) for i in e.value.issues] == expected


def test_an_epp_pool_in_a_file_without_backends():
    text = EPP.split("  backends:")[0] + "  epp: {pool: pool, profile: p}\n"
    with pytest.raises(ConfigError) as e:
        load_text(text)
    assert [(i.path, i.reason) for i in e.value.issues] == [("spec.epp.pool", "no backend named 'pool' (backends: none)")]


def test_an_epp_profile_pinning_an_endpoint_is_checked_against_the_pool():
    pinned = EPP.replace("plugins: [{type: max-score-picker}]",
                         'plugins: [{name: pin, type: pinned-endpoint, parameters: {endpoint: "ENDPOINT"}}]'
                         ).replace("profile: max-score-picker", "profile: pin")
    assert load_text(pinned.replace("ENDPOINT", "10.0.0.2:8000")).epp.route.picker.name == "pin"
    with pytest.raises(ConfigError) as e:
        load_text(pinned.replace("ENDPOINT", "10.0.0.9:8000"))
    assert [(i.path, i.reason) for i in e.value.issues] == [
        ("spec.epp.profile", "plugin 'pin' pins endpoint 10.0.0.9:8000, which is not an endpoint of this route's "
                             "backends (10.0.0.1:8000, 10.0.0.2:8000)")]
