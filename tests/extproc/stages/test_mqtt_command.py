"""Stage `mqtt-command` against a real mosquitto and a test device: the reply as the answer, 202 for
commands without a reply, and the 400 / 502 / 503 / 504 errors naming what failed."""

from __future__ import annotations

import asyncio
import types

import orjson
import pytest

from extproc.config.loader import load_text
from extproc.iot.client import MqttClients
from extproc.stack import free_port
from extproc.stages.mqtt_command import MqttCommand
from extproc.types import HttpMessage, Phase, Reject, RequestState, Respond
from tests.e2e.mosquitto import Device, Mosquitto, mosquitto_binary

pytestmark = pytest.mark.skipif(mosquitto_binary() is None,
                                reason="mosquitto is not installed (make setup installs it as root with apt-get)")


def snapshot(port: int):
    return load_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: st}}
spec:
  brokers: [{{name: plant, address: "127.0.0.1:{port}", connectTimeout: 1s}}]
  routes:
    - path: /cmd
      kind: iot
      iot:
        timeout: 200ms
        commands:
          set:
            topic: 'st/{{$.params.zone ?? "main"}}/{{$.device}}/set'
            payload: '{{"id": $.correlationId, "to": $.params.to, "tenant": $.tenant}}'
            replyTopic: "st/{{$.device}}/reply"
            params: {{type: object, required: [to], properties: {{to: {{type: integer, minimum: 0}}}}}}
          raw:
            topic: "st/{{$.device}}/raw"
            payload: '{{"id": $.correlationId}}'
            replyTopic: "st/{{$.device}}/reply"
            response: '{{"seen": $.reply.missing}}'
          fire:
            topic: "st/{{$.device}}/fire"
            payload: '{{"v": $.params.v}}'
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    if mosquitto_binary() is None:
        pytest.skip("mosquitto is not installed")
    m = Mosquitto(tmp_path_factory.mktemp("mosquitto")).start()
    devices = [Device(m.port, "st/main/+/set", client_id="st-set"),
               Device(m.port, "st/+/raw", answer=lambda t, d: "not an object", client_id="st-raw")]
    yield m, devices
    for d in devices:
        d.stop()
    m.stop()


def call(snap, body: bytes, tenant: str | None = None):
    async def go():
        runtime = types.SimpleNamespace(mqtt=MqttClients())
        st = RequestState(snapshot=snap, route=snap.routes["cmd"], started=0.0, tenant=tenant, runtime=runtime,
                          request_id="rq-1")
        st.input_doc = orjson.loads(body)
        try:
            return await MqttCommand().on_request_body(st, HttpMessage(Phase.REQUEST_BODY, body=body, end_of_stream=True))
        finally:
            runtime.mqtt.close()

    return asyncio.run(go())


def test_the_reply_is_the_answer_and_the_payload_is_the_rendered_template(broker):
    m, (dev, _) = broker
    v = call(snapshot(m.port), b'{"device": "d1", "command": "set", "params": {"to": 5}}', tenant="acme")
    assert isinstance(v, Respond) and v.status == 200
    body = orjson.loads(v.body)
    topic, payload, _props = dev.received[-1]
    assert topic == "st/main/d1/set" and payload == {"id": body["correlationId"], "to": 5, "tenant": "acme"}
    assert body["reply"] == {"ok": True, "echo": payload} and body["topic"] == "st/main/d1/set"


def test_a_command_without_a_reply_topic_is_202_once_published(broker):
    v = call(snapshot(broker[0].port), b'{"device": "d1", "command": "fire", "params": {"v": 1}}')
    assert isinstance(v, Respond) and v.status == 202 and orjson.loads(v.body)["status"] == "published"


@pytest.mark.parametrize("body, status, code, path", [
    (b'[1]', 400, "invalid_command", None),
    (b'{"device": "d 1", "command": "set"}', 400, "invalid_command", "$.device"),
    (b'{"device": "d1", "command": "nope"}', 400, "unknown_command", "$.command"),
    (b'{"device": "d1", "command": "set", "params": []}', 400, "invalid_command", "$.params"),
    (b'{"device": "d1", "command": "set", "params": {"to": -1}}', 400, "invalid_params", "$.params.to"),
    (b'{"device": "d1", "command": "set", "params": {"to": 1, "zone": "a/b"}}', 400, "invalid_topic", "$.params.zone"),
    (b'{"device": "d1", "command": "fire"}', 400, "template_path_missing", "$.params.v"),
    (b'{"device": "d1", "command": "raw"}', 502, "transform_path_missing", "$.reply.missing"),
])
def test_errors_name_the_field(broker, body, status, code, path):
    v = call(snapshot(broker[0].port), body)
    assert isinstance(v, Reject) and (v.status, v.code) == (status, code), v
    assert v.fields.get("path") == path


def test_a_silent_device_is_504_and_a_down_broker_503():
    port = free_port()
    v = call(snapshot(port), b'{"device": "d1", "command": "set", "params": {"to": 1}}')
    assert isinstance(v, Reject) and v.status == 503 and v.code == "broker_unavailable"
    assert v.fields["broker"] == "plant" and f"127.0.0.1:{port}" in v.message and v.retry_after == 1


def test_no_device_on_the_topic_is_a_504_naming_topic_and_reply_topic(broker):
    v = call(snapshot(broker[0].port), b'{"device": "d1", "command": "set", "params": {"to": 1, "zone": "z9"}}')
    assert isinstance(v, Reject) and v.status == 504 and v.code == "device_timeout"
    assert v.fields["topic"] == "st/z9/d1/set" and v.fields["reply_topic"] == "st/d1/reply"
    assert v.fields["acknowledged"] is True
