"""The IoT adapter end to end: client -> Envoy -> processor -> a real mosquitto -> a test device -> back.

Commands become MQTT messages (topic and payload templates, QoS 1), the device's reply is the
answer; a silent device is a 504 naming the topic, a broker that is down a 503 (and the gateway
connects once it is up); a template change takes effect on the next request after a reload, with
the same worker processes (the MQTT connection lives in the runtime).
"""

from __future__ import annotations

import time

import httpx
import pytest

from extproc.stack import free_port
from tests.e2e.iot_gateway import iot_gateway
from tests.e2e.mosquitto import Device, Mosquitto, mosquitto_binary

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(mosquitto_binary() is None,
                                 reason="mosquitto is not installed (make setup installs it as root with apt-get)")]

COMMANDS = """\
          set-temperature:
            topic: "plant/{{$.device}}/set"
            payload: '{payload}'
            replyTopic: "plant/{{$.device}}/reply"
            params: {{type: object, required: [celsius], properties: {{celsius: {{type: number, maximum: 90}}}}}}
          legacy-status:
            topic: "plant/{{$.device}}/legacy"
            payload: '{{"correlationId": $.correlationId}}'
            replyTopic: "plant/{{$.device}}/legacy-reply"
            response: '{{"device": $.device, "state": $.reply.state}}'
          reboot:
            topic: "plant/{{$.device}}/reboot"
            payload: '{{"at": $.params.at ?? "now"}}'
          silent:
            topic: "plant/{{$.device}}/silent"
            payload: '{{}}'
            replyTopic: "plant/{{$.device}}/reply"
"""
PAYLOAD_V1 = '{"id": $.correlationId, "celsius": $.params.celsius}'
PAYLOAD_V2 = '{"id": $.correlationId, "setpoint": {"value": $.params.celsius, "unit": "C"}}'


def config(broker: str, payload: str = PAYLOAD_V1) -> str:
    return iot_gateway("iot", broker, COMMANDS.format(payload=payload), "300ms")


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    m = Mosquitto(tmp_path_factory.mktemp("mosquitto")).start()
    devices = [Device(m.port, "plant/+/set", client_id="thermostats"),
               Device(m.port, "plant/+/legacy", v5=False, client_id="legacy",
                      reply_topic=lambda t: t.rsplit("/", 1)[0] + "/legacy-reply",
                      answer=lambda t, doc: {"correlationId": doc["correlationId"], "state": "idle"}),
               Device(m.port, "plant/+/reboot", answer=False, client_id="rebooters"),
               Device(m.port, "plant/+/silent", answer=False, client_id="silent")]
    try:
        yield m, devices
    finally:
        for d in devices:
            d.stop()
        m.stop()


@pytest.fixture(scope="module")
def stack(broker, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    cfg = tmp_path_factory.mktemp("iot") / "gateway.yaml"
    cfg.write_text(config(broker[0].address))
    st = make_stack(cfg)
    try:
        st.start()
        yield st, cfg
    finally:
        st.stop()


def command(st, doc, path="/v1/devices/command") -> httpx.Response:
    return httpx.post(f"{st.url}{path}", json=doc, timeout=10)


def test_a_command_is_published_with_qos1_and_the_device_reply_is_the_answer(stack, broker):
    st, _ = stack
    thermostats = broker[1][0]
    r = command(st, {"device": "boiler-7", "command": "set-temperature", "params": {"celsius": 21.5}})
    assert r.status_code == 200, r.text
    body = r.json()
    topic, payload, props = thermostats.received[-1]
    assert topic == "plant/boiler-7/set"
    assert payload == {"id": body["correlationId"], "celsius": 21.5}
    assert props.ResponseTopic == "plant/boiler-7/reply"
    assert props.CorrelationData == body["correlationId"].encode()
    assert body == {"device": "boiler-7", "command": "set-temperature", "topic": "plant/boiler-7/set",
                    "correlationId": body["correlationId"], "reply": {"ok": True, "echo": payload}}


def test_the_published_message_is_qos1(stack, broker):
    st, _ = stack
    m = broker[0]
    seen = []
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    spy = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="spy", protocol=mqtt.MQTTv5)
    spy.on_message = lambda c, u, msg: seen.append(msg.qos)
    spy.connect("127.0.0.1", m.port)
    spy.subscribe("plant/+/reboot", qos=1)
    spy.loop_start()
    try:
        time.sleep(0.3)  # the SUBACK (no callback needed: a missed message fails the assertion below)
        r = command(st, {"device": "pump-1", "command": "reboot"})
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "published" and r.json()["topic"] == "plant/pump-1/reboot"
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.02)
        assert seen == [1]
    finally:
        spy.disconnect()
        spy.loop_stop()


def test_a_reply_correlated_by_its_payload_goes_through_the_response_template(stack):
    st, _ = stack
    r = command(st, {"device": "old-plc", "command": "legacy-status"})
    assert r.status_code == 200, r.text
    assert r.json() == {"device": "old-plc", "state": "idle"}


def test_a_silent_device_is_a_504_naming_the_topic(stack):
    st, _ = stack
    r = command(st, {"device": "boiler-7", "command": "silent"})
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "device_timeout" and err["topic"] == "plant/boiler-7/silent"
    assert "plant/boiler-7/reply" in err["message"] and err["acknowledged"] is True
    assert r.headers["x-adapter-error"] == "device_timeout"


@pytest.mark.parametrize("doc, code, where", [
    ({"device": "boiler-7", "command": "melt"}, "unknown_command", "$.command"),
    ({"device": "boiler-7", "command": "set-temperature", "params": {"celsius": 900}}, "invalid_params",
     "$.params.celsius"),
    ({"device": "plant/#", "command": "set-temperature", "params": {"celsius": 20}}, "invalid_command", "$.device"),
])
def test_bad_commands_are_400s_naming_the_field_and_nothing_is_published(stack, broker, doc, code, where):
    st, _ = stack
    before = sum(len(d.received) for d in broker[1])
    r = command(st, doc)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["path"] == where
    assert sum(len(d.received) for d in broker[1]) == before


def test_a_template_change_applies_on_the_next_request_without_a_worker_restart(stack, broker):
    st, cfg = stack
    thermostats = broker[1][0]
    pids = st.supervisor.pids
    cfg.write_text(config(broker[0].address, PAYLOAD_V2))
    try:
        assert st.reload().accepted
        r = command(st, {"device": "boiler-8", "command": "set-temperature", "params": {"celsius": 19}})
        assert r.status_code == 200, r.text
        assert thermostats.received[-1][1] == {"id": r.json()["correlationId"], "setpoint": {"value": 19, "unit": "C"}}
        assert st.supervisor.pids == pids
    finally:
        cfg.write_text(config(broker[0].address))
        assert st.reload().accepted


def test_a_broker_that_is_down_is_a_503_and_the_gateway_connects_once_it_is_up(stack_factory, tmp_path):
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(config(f"127.0.0.1:{port}"))
    st = stack_factory(cfg, workers=1)
    doc = {"device": "boiler-7", "command": "set-temperature", "params": {"celsius": 20}}
    r = command(st, doc)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "broker_unavailable" and err["broker"] == "plant" and f"127.0.0.1:{port}" in err["message"]
    m = Mosquitto(tmp_path, port=port).start()
    device = Device(port, "plant/+/set")
    try:
        deadline = time.monotonic() + 15  # paho's thread retries, backing off to 2 s
        while (r := command(st, doc)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert r.json()["reply"]["ok"] is True
    finally:
        device.stop()
        m.stop()


# --- the optional LLM step: a chat model answers with the command (tests/e2e/sql_chat_service.py answers
# each question with the content a test chose) ---------------------------------------------------------

LLM_COMMANDS = """\
          set-temperature:
            topic: "plant/{$.device}/set"
            payload: '{"id": $.correlationId, "celsius": $.params.celsius}'
            replyTopic: "plant/{$.device}/reply"
            params: {type: object, required: [celsius], properties: {celsius: {type: number}}}
"""


def llm_config(broker: str, chat: int) -> str:
    backends = (f'  backends: [{{name: model, kind: openai, endpoints: ["127.0.0.1:{chat}"], models: [iot-model],\n'
                "               dialect: {negotiate: false, preset: openai}}]\n")
    return iot_gateway("iot-llm", broker, LLM_COMMANDS, "300ms", path="/v1/devices/ask", backends=backends,
                       target="model")


@pytest.fixture(scope="module")
def llm_stack(broker, tmp_path_factory):
    import subprocess
    import sys

    from extproc.stack import wait_http
    from tests.conftest import REPO
    from tests.e2e.conftest import make_stack

    port = free_port()
    chat = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "sql_chat_service.py"), str(port)])
    cfg = tmp_path_factory.mktemp("iot-llm") / "gateway.yaml"
    cfg.write_text(llm_config(broker[0].address, port))
    st = make_stack(cfg, workers=1)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 20, chat)
        st.start()
        st.chat_url = f"http://127.0.0.1:{port}"
        yield st
    finally:
        st.stop()
        chat.terminate()
        chat.wait(5)


def ask(st, question: str, answer: str) -> httpx.Response:
    httpx.post(f"{st.chat_url}/answers", json={"question": question, "content": answer}, timeout=5).raise_for_status()
    return httpx.post(f"{st.url}/v1/devices/ask", json={"query": question}, timeout=10)


def test_the_models_command_is_published_and_the_device_reply_is_the_answer(llm_stack, broker):
    thermostats = broker[1][0]
    r = ask(llm_stack, "make boiler 9 a bit warmer",
            '{"device": "boiler-9", "command": "set-temperature", "params": {"celsius": 23}}')
    assert r.status_code == 200, r.text
    topic, payload, _ = thermostats.received[-1]
    assert topic == "plant/boiler-9/set" and payload == {"id": r.json()["correlationId"], "celsius": 23}
    assert r.json()["reply"] == {"ok": True, "echo": payload}
    sent = httpx.get(f"{llm_stack.chat_url}/last", timeout=5).json()  # what the model was asked
    schema = sent["response_format"]["json_schema"]["schema"]
    assert sent["response_format"]["type"] == "json_schema"
    assert schema["properties"]["command"] == {"const": "set-temperature"}
    assert schema["properties"]["params"]["required"] == ["celsius"]


def test_a_model_command_that_fails_the_checks_is_a_502_and_nothing_is_published(llm_stack, broker):
    before = sum(len(d.received) for d in broker[1])
    r = ask(llm_stack, "melt boiler 9", '{"device": "boiler-9", "command": "melt", "params": {}}')
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_model_command" and err["reason"] == "unknown_command"
    assert err["command"]["command"] == "melt" and err["backend"] == "model"
    assert sum(len(d.received) for d in broker[1]) == before
