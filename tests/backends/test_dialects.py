"""Backend dialects (backends/dialects.py), their encoding by the OpenAI adapter, the config that fixes
them, and how negotiation joins what a backend's endpoints answered (extproc/negotiate.py).

The negotiation itself, against a real server, is tested in tests/e2e/test_llamacpp.py."""

from __future__ import annotations

import orjson
import pytest

from backends.base import BackendError
from backends.dialects import (PRESETS, Dialect, DialectConfig, client_schema, first_json_object, schema_error,
                               structured_fields, translate)
from backends.openai import OpenAIAdapter
from extproc.config.loader import ConfigError, load_text
from extproc.negotiate import join

SCHEMA = {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0}}, "required": ["amount"],
          "additionalProperties": False}


def gateway(route_extra: str = "", backend_extra: str = "", kind: str = "openai") -> str:
    return f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: d}}
spec:
  modelRef: m
  backends:
    - name: llm
      kind: {kind}
      endpoints: ["127.0.0.1:9"]
{backend_extra}
  routes:
    - path: /v1/analyze
      target: llm
      transform: '{{"amount": $.output.amount}}'
      outputSchema: {orjson.dumps(SCHEMA).decode()}
{route_extra}
"""


def route_of(text: str):
    return load_text(text).routes["v1-analyze"]


@pytest.mark.parametrize("structured, fields", [
    ("json_schema", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}}),
    ("json_object_schema", {"response_format": {"type": "json_object", "schema": SCHEMA}}),
    ("structured_outputs", {"structured_outputs": {"json": SCHEMA}}),
    ("guided_json", {"guided_json": SCHEMA}),
    ("sglang_json_schema", {"json_schema": orjson.dumps(SCHEMA).decode()}),
    ("ollama_format", {"format": SCHEMA}),
    ("prompt", {}),
])
def test_each_structured_output_dialect_has_its_fields(structured, fields):
    assert structured_fields(structured, "r", SCHEMA) == fields


def test_an_unknown_dialect_is_an_error_not_a_silent_default():
    with pytest.raises(ValueError, match="unknown structured-output dialect 'xml'"):
        structured_fields("xml", "r", SCHEMA)


def test_the_llm_route_is_encoded_in_the_backends_dialect():
    route = route_of(gateway())
    adapter = OpenAIAdapter()
    default = orjson.loads(adapter.encode(route, {"query": "q"}).body)
    assert default["response_format"]["type"] == "json_schema"  # no dialect: OpenAI's
    llama = orjson.loads(adapter.encode(route, {"query": "q"}, dialect=PRESETS["llamacpp"]).body)
    assert llama["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert llama["messages"][-1] == {"role": "user", "content": "q"}
    vllm = orjson.loads(adapter.encode(route, {"query": "q"}, dialect=Dialect("structured_outputs")).body)
    assert vllm["structured_outputs"] == {"json": SCHEMA} and "response_format" not in vllm


def test_the_prompt_dialect_puts_the_schema_in_the_system_prompt():
    route = route_of(gateway())
    body = orjson.loads(OpenAIAdapter().encode(route, {"query": "q"}, dialect=Dialect("prompt")).body)
    system, user = body["messages"]
    assert system["role"] == "system" and orjson.dumps(SCHEMA).decode() in system["content"]
    assert user == {"role": "user", "content": "q"}
    assert not {"response_format", "guided_json", "structured_outputs"} & set(body)


def test_a_request_template_gets_the_schema_prompt_before_its_messages():
    route = route_of(gateway(route_extra="""      request: '{"messages": [{"role": "user", "content": $.query}], "max_tokens": 9}'"""))
    body = orjson.loads(OpenAIAdapter().encode(route, {"query": "q"}, dialect=Dialect("prompt")).body)
    assert body["max_tokens"] == 9 and [m["role"] for m in body["messages"]] == ["system", "user"]


def test_a_template_that_asks_for_structured_output_itself_wins():
    route = route_of(gateway(route_extra="""      request: '{"messages": [], "guided_json": {"type": "object"}}'"""))
    body = orjson.loads(OpenAIAdapter().encode(route, {}, dialect=PRESETS["llamacpp"]).body)
    assert body["guided_json"] == {"type": "object"} and "response_format" not in body


def response(content: str) -> bytes:
    return orjson.dumps({"choices": [{"message": {"content": content}}], "model": "m"})


def test_prompt_answers_are_found_in_prose_and_validated():
    route = route_of(gateway())
    adapter = OpenAIAdapter()
    doc = adapter.decode(route, 200, response('Sure! ```json\n{"amount": 5}\n```'), structured="prompt")
    assert doc["output"] == {"amount": 5}
    with pytest.raises(BackendError) as e:
        adapter.decode(route, 200, response('{"amount": -1}'), structured="prompt")
    assert e.value.code == "model_output_invalid" and "amount" in e.value.message and "minimum" in e.value.message
    with pytest.raises(BackendError) as e:
        adapter.decode(route, 200, response("no json here"), structured="prompt")
    assert e.value.code == "model_output_invalid" and "no JSON object" in e.value.message


def test_first_json_object_and_schema_error():
    assert first_json_object('x {"a": {"b": 1}} y') == {"a": {"b": 1}}
    with pytest.raises(ValueError, match="malformed"):
        first_json_object("{not json}")
    assert schema_error(SCHEMA, {"amount": 1}) is None
    assert schema_error(SCHEMA, {"amount": 1, "x": 2}).startswith("(root): Additional properties")


def test_a_clients_json_schema_is_translated_for_the_backend():
    asked = {"messages": [{"role": "user", "content": "q"}], "priority": 3,
             "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
    assert client_schema(asked) == ("n", SCHEMA)
    same = orjson.loads(orjson.dumps(asked))
    assert translate(same, PRESETS["openai"]) is False and same == asked  # OpenAI's own: untouched
    llama = orjson.loads(orjson.dumps(asked))
    assert translate(llama, PRESETS["llamacpp"]) is True
    assert llama["response_format"] == {"type": "json_object", "schema": SCHEMA} and llama["priority"] == 3
    prompt = orjson.loads(orjson.dumps(asked))
    assert translate(prompt, Dialect("prompt", priority="refused")) is True
    assert "response_format" not in prompt and "priority" not in prompt
    assert prompt["messages"][0]["role"] == "system" and prompt["messages"][1:] == asked["messages"]
    text = {"messages": [], "response_format": {"type": "text"}}
    assert translate(text, PRESETS["llamacpp"]) is False and text["response_format"] == {"type": "text"}


def test_config_fixes_parts_of_the_dialect_over_what_is_learned():
    backend = load_text(gateway(backend_extra="""      dialect: {preset: llamacpp, streamUsage: "yes", negotiate: false}""")).backends["llm"]
    cfg = backend.dialect
    assert cfg == DialectConfig(negotiate=False, preset="llamacpp", stream_usage="yes")
    assert cfg.base("openai") == Dialect("json_object_schema", "yes", "ignored", "none", "llamacpp")
    learned = Dialect("prompt", "no", "refused", "none", "x")
    assert cfg.apply(learned) == Dialect("prompt", "yes", "refused", "none", "x")
    assert DialectConfig().base("vllm") == PRESETS["vllm"] and DialectConfig().base("openai") == PRESETS["openai"]


def test_bad_dialect_config_names_the_field():
    with pytest.raises(ConfigError) as e:
        load_text(gateway(backend_extra="""      dialect: {structuredOutput: xml}"""), filename="gw.yaml")
    assert "spec.backends[0].dialect.structuredOutput" in str(e.value) and "gw.yaml:" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_text(gateway(kind="triton", backend_extra="""      dialect: {preset: vllm}"""), filename="gw.yaml")
    assert "spec.backends[0].dialect" in str(e.value) and "openai or vllm, not triton" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_text(gateway(route_extra="""      policy: {structuredFallback: never}"""), filename="gw.yaml")
    assert "spec.routes[0].policy.structuredFallback" in str(e.value)


def ok(address: str, structured: str = "json_schema", usage: str = "yes", priority: str = "honoured",
       lora: str = "runtime", engine: str = "vllm") -> dict:
    return {"address": address, "status": "ok", "engine": engine, "structured": structured, "stream_usage": usage,
            "priority": priority, "lora": lora}


def test_a_backend_can_what_all_its_answering_endpoints_can():
    base = PRESETS["openai"]
    assert join([ok("a"), ok("b")], base) == Dialect("json_schema", "yes", "honoured", "runtime", "vllm")
    mixed = join([ok("a"), ok("b", "json_object_schema", "no", "ignored", "none", "llamacpp"),
                  {"address": "c", "status": "down", "error": "refused"}], base)
    assert mixed == Dialect("prompt", "no", "ignored", "none", "mixed")  # endpoints disagree: the safe side
    assert join([{"address": "a", "status": "down"}], base) is None


def test_unquoted_yes_and_no_are_the_words():
    """YAML 1.1 reads `no` as false; `streamUsage: no` means the word."""
    for word in ("yes", "no"):
        backend = load_text(gateway(backend_extra=f"""      dialect: {{streamUsage: {word}}}""")).backends["llm"]
        assert backend.dialect.stream_usage == word
