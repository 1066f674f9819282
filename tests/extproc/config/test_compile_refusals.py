"""Every refusal `compile_snapshot` makes after the schema accepted a file: one config each, the
message it must give (and that the rest of the file still compiles into nothing: no snapshot)."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_file, load_text
from tests.conftest import DATA

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: refusals}
spec:
  modelRef: m1
"""
LLM = '{path: /a, target: llm, transform: \'{"x": $.output.x}\'}'
ONE = '  backends: [{name: llm, endpoints: ["127.0.0.1:9000"]}]\n'
TWO = ('  backends: [{name: llm, endpoints: ["127.0.0.1:9000"]}, '
       '{name: ort, kind: onnxruntime, protocol: http, endpoints: ["127.0.0.1:9001"]}]\n')
REST = '  backends: [{name: svc, kind: rest, endpoints: ["127.0.0.1:9003"]}]\n'
PETS = DATA / "openapi" / "petstore.yaml"
NO_OPS = DATA.parent / "fixtures" / "openapi" / "v3.1" / "webhook-example.yaml"  # no paths, only a webhook

CASES = {
    "duplicate backend": (ONE.replace("]\n", ', {name: llm, endpoints: ["127.0.0.1:9002"]}]\n') + f"  routes: [{LLM}]\n",
                          "duplicate backend name 'llm'"),
    "duplicate route name": (ONE + f"  routes: [{LLM}, {{path: /b, name: a, target: llm}}]\n",
                             "duplicate route name 'a'"),
    "target and targets": (ONE + "  routes: [{path: /a, target: llm, targets: [llm]}]\n",
                           "set target or targets, not both"),
    "backend of another api": (TWO + "  routes: [{path: /v1/, match: prefix, kind: openai, target: ort}]\n",
                               "a openai route needs openai backends; ort speaks another API"),
    "openapi on an llm route": (ONE + f"  routes: [{{path: /a, target: llm, openapi: {PETS}}}]\n",
                                "only tool routes read an OpenAPI document"),
    "mapping on an llm route": (ONE + "  routes: [{path: /a, target: llm, mapping: m.yaml}]\n",
                                "only rest routes apply a field-mapping file"),
    "tool route without openapi": (REST + "  routes: [{path: /t, kind: tool, target: svc}]\n",
                                   "a tool route needs `openapi`"),
    "openapi without operations": (REST + f"  routes: [{{path: /t, kind: tool, target: svc, openapi: {NO_OPS}}}]\n",
                                   "no operation could be turned into a tool"),
    "unreadable mapping": (REST + "  routes: [{path: /r, kind: rest, target: svc, mapping: /nonexistent/m.yaml}]\n",
                           "/nonexistent/m.yaml:"),
    "two targets on a one-target kind": (TWO.replace("kind: onnxruntime, protocol: http, ", "") +
                                         "  routes: [{path: /a, targets: [llm, ort], transform: '{\"x\": $.output.x}'}]\n",
                                         "a llm route has one target"),
    "prefix on a one-endpoint kind": (ONE + "  routes: [{path: /a/, match: prefix, target: llm, "
                                      "transform: '{\"x\": $.output.x}'}]\n", "use match: exact"),
    "output schema not an object": (ONE + "  routes: [{path: /a, target: llm, transform: '{\"x\": $.output[0]}', "
                                    "outputSchema: {type: array}}]\n", "must be a JSON Schema of type object"),
    "duplicate tenant": (ONE + f"  routes: [{LLM}]\n  tenants: [{{id: acme}}, {{id: acme}}]\n",
                         "duplicate tenant id 'acme'"),
    "jwt source without a jwt block": (ONE + f"  routes: [{LLM}]\n  tenancy: {{source: jwt}}\n",
                                       "source: jwt needs a jwt block"),
    "no target and two backends": (TWO + "  routes: [{path: /a, transform: '{\"x\": $.output.x}'}]\n",
                                   "required when spec.backends does not declare exactly one backend"),
    "implicit backend clashing with a declared one": (
        '  backends: [{name: host-a, endpoints: ["127.0.0.1:9000"]}]\n'
        "  routes: [{path: /a, target: \"host.a:8000\", transform: '{\"x\": $.output.x}'}]\n",
        "would define implicit backend 'host-a', which already exists with other endpoints"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusal(case):
    text, message = CASES[case]
    with pytest.raises(ConfigError) as e:
        load_text(HEAD + text, "cfg.yaml")
    assert message in str(e.value), str(e.value)


def test_a_derived_output_schema_requires_each_field_once_and_only_output_paths(write_config):
    snap = load_file(write_config(HEAD + ONE + """\
  routes:
    - path: /a
      target: llm
      transform: '{"x": $.output.a, "y": $.output.a, "z": $.input.q, "n": $.output.items[0].name}'
    - path: /b
      target: llm
      request: '{"q": $.input.q}'
      transform: '{"echo": $.input.q}'
"""))
    schema = snap.routes["a"].response_schema
    assert schema["required"] == ["a", "items"]  # `a` twice in the transform, once here; $.input not at all
    assert schema["properties"]["items"]["type"] == "array"
    assert snap.routes["b"].response_schema is None  # no $.output path: nothing to derive
