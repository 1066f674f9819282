"""An iot route's config, compiled once: what is accepted, and errors that name the file, field and reason."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_text

BASE = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: iot}}
spec:
  brokers: [{{name: plant, address: "127.0.0.1:1883"}}{more_brokers}]
  routes:
    - path: /cmd
      kind: iot
{target}      iot:
{iot}
"""
GOOD = """        commands:
          set:
            topic: "plant/{$.device}/set"
            payload: '{"id": $.correlationId, "c": $.params.c}'
            replyTopic: "plant/{$.device}/reply"
            params: {type: object, properties: {c: {type: number}}}
          fire:
            topic: "plant/{$.device}/fire"
            payload: '{}'
            qos: 0"""


def load(iot: str = GOOD, target: str = "", more_brokers: str = ""):
    return load_text(BASE.format(iot=iot, target=target, more_brokers=more_brokers), filename="gw.yaml")


def errors(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        load(**kw)
    return str(e.value)


def test_a_good_route_compiles_with_its_broker_commands_and_no_backend():
    snap = load()
    r = snap.routes["cmd"]
    assert r.kind == "iot" and r.backend is None and r.dialect == "adapter"
    assert r.iot.broker.address == "127.0.0.1:1883" and r.iot.timeout == 0.5
    assert list(r.iot.commands) == ["set", "fire"]
    cmd = r.iot.commands["set"]
    assert cmd.qos == 1 and cmd.reply_topic.filter == "plant/+/reply" and cmd.params is not None
    assert r.iot.commands["fire"].qos == 0 and r.iot.commands["fire"].reply_topic is None
    assert [s.name for s in r.pipeline.stages] == ["admit", "body-limit", "parse-json", "mqtt-command"]


def test_template_errors_name_the_command_field_line_and_column():
    out = errors(iot=GOOD.replace("$.params.c}", "$.params.c,}"))
    assert "gw.yaml:" in out and "spec.routes[0].iot.commands.set.payload" in out and "column" in out


def test_topic_wildcards_are_refused():
    out = errors(iot=GOOD.replace('"plant/{$.device}/set"', '"plant/+/set"'))
    assert "spec.routes[0].iot.commands.set.topic" in out and "wildcards" in out


def test_a_timeout_at_or_over_the_processors_message_timeout_is_refused():
    out = errors(iot="        timeout: 1s\n" + GOOD)
    assert "spec.routes[0].iot.commands.set" in out and "messageTimeout" in out


def test_an_unknown_broker_and_an_ambiguous_default_are_refused():
    assert "no broker 'elsewhere'" in errors(iot="        broker: elsewhere\n" + GOOD)
    out = errors(more_brokers=', {name: other, address: "127.0.0.1:1884"}')
    assert "spec.routes[0].iot.broker" in out and "exactly one broker" in out


def test_a_target_a_bad_schema_and_a_response_without_reply_are_refused():
    assert "at most one target" in errors(target="      targets: [127.0.0.1:9, 127.0.0.1:10]\n")
    assert "not a valid JSON Schema" in errors(iot=GOOD.replace("type: number", "type: numbr"))
    out = errors(iot=GOOD + "\n            response: '{\"x\": $.reply}'")
    assert "spec.routes[0].iot.commands.fire.response" in out and "needs a replyTopic" in out


def test_with_a_target_the_model_is_asked_for_a_command_and_a_non_chat_backend_is_refused():
    r = load(target="      target: 127.0.0.1:9\n").routes["cmd"]
    assert r.backend is not None and r.backend.adapter.api == "openai"
    assert [s.name for s in r.pipeline.stages] == ["admit", "body-limit", "parse-json", "token-budget", "dispatch",
                                                   "encode-request", "mqtt-model-command"]
    options = r.response_schema["anyOf"]
    assert [o["properties"]["command"] for o in options] == [{"const": "set"}, {"const": "fire"}]
    assert options[0]["properties"]["params"]["properties"] == {"c": {"type": "number"}}
    assert options[1]["properties"]["device"]["pattern"] == r.iot.device_pattern.pattern
    text = BASE.format(iot=GOOD, target="      target: svc\n", more_brokers="").replace(
        "  routes:", "  backends: [{name: svc, kind: rest, endpoints: [\"127.0.0.1:9\"]}]\n  routes:")
    with pytest.raises(ConfigError, match="needs an openai backend; svc speaks rest"):
        load_text(text)


def test_an_iot_block_on_another_kind_and_a_missing_one_are_refused():
    text = BASE.format(iot=GOOD, target="", more_brokers="").replace("kind: iot", "kind: passthrough\n      target: 127.0.0.1:9")
    with pytest.raises(ConfigError, match="only iot routes"):
        load_text(text)
    text = BASE.format(iot=GOOD, target="", more_brokers="").split("      iot:")[0]
    with pytest.raises(ConfigError, match="needs an `iot` block"):
        load_text(text)


def test_the_example_config_loads():
    from extproc.config.loader import load_file
    from tests.conftest import REPO

    r = load_file(REPO / "examples" / "iot-adapter.yaml").routes["v1-devices-command"]
    assert list(r.iot.commands) == ["set-temperature", "status", "reboot"]
    assert r.iot.commands["status"].timeout == 0.3 and r.iot.commands["reboot"].reply_topic is None
    assert r.iot.broker.client_id == "plant-gateway"
