"""Stage `mqtt-command`: a device command in the request body, published over MQTT, the device's reply
as the response (route kind `iot`, docs/iot-adapter.md).

What: reads `{"device": ID, "command": NAME, "params": {...}}` (`state.input_doc`, parsed by
`parse-json`), renders the command's topic, payload and reply topic templates (extproc/iot/topics.py,
extproc/template.py: paths, no code) over {device, command, params, correlationId, requestId,
tenant}, publishes with the command's QoS through the worker's connection to the route's broker
(`state.runtime.mqtt`, extproc/iot/client.py, kept across reloads) and answers the client itself:
200 with `{device, command, topic, correlationId, reply}` (or the command's `response` template over
the same document plus `reply`), or 202 `{..., "status": "published"}` for a command without a
reply topic, once the broker acknowledged it.
Rules (errors in the route's dialect): 400 `invalid_command` (body not an object, `device` not
matching `iot.devicePattern`, `params` not an object), 400 `unknown_command` (naming the known
ones), 400 `invalid_params` (the command's `params` schema, with the failing path), 400
`template_path_missing` / `invalid_topic` (a template path the document lacks; a topic level
that would be empty or hold `/ + #`), 503 `broker_unavailable` (no connection within the broker's
connectTimeout, naming the broker), 504 `device_timeout` (no reply within the timeout, naming the
topic and reply topic), 502 `invalid_device_reply` (a reply that is not JSON).
Parameters: none; everything comes from the route's compiled `iot` block (`Route.iot`).
Cost: three template renders (about 1 us each), one orjson encode, the publish and the waits (see
extproc/iot/client.py); perf/bench_iot.py measures the adapter's time without Envoy.
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.errors import reject
from extproc.template import MissingPathError
from extproc.types import HttpMessage, Reject, RequestState, Respond, Verdict

def command_document(iot: Any, body: Any, request_id: str = "", tenant: str | None = None,
                     correlation: str = "") -> tuple[Any, Any] | Any:
    """(the command, the template document) for a request body, or a Reject."""
    if not isinstance(body, dict):
        return reject(400, "invalid_command", "the body must be a JSON object {device, command, params}")
    device, name, params = body.get("device"), body.get("command"), body.get("params", {})
    if not isinstance(device, str) or not iot.device_pattern.match(device):
        return reject(400, "invalid_command", f"device must be a string matching {iot.device_pattern.pattern}",
                      path="$.device")
    cmd = iot.commands.get(name) if isinstance(name, str) else None
    if cmd is None:
        return reject(400, "unknown_command", f"unknown command {name!r}; known: {', '.join(iot.commands)}",
                      path="$.command", known=list(iot.commands))
    if not isinstance(params, dict):
        return reject(400, "invalid_command", "params must be a JSON object", path="$.params")
    if cmd.params is not None:
        err = next(iter(cmd.params.iter_errors(params)), None)
        if err is not None:
            where = "$.params" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
            return reject(400, "invalid_params", f"{where}: {err.message}", path=where, command=name)
    doc = {"device": device, "command": name, "params": params, "correlationId": correlation,
           "requestId": request_id, "tenant": tenant}
    return cmd, doc


def render_command(cmd: Any, doc: Any) -> tuple[str, bytes, str | None] | Any:
    """(topic, payload, reply topic) for the document, or a Reject naming the template path."""
    from extproc.iot.topics import TopicError

    try:
        topic = cmd.topic.render(doc)
        payload = cmd.payload.render_json(doc)
        reply_topic = cmd.reply_topic.render(doc) if cmd.reply_topic is not None else None
    except MissingPathError as e:
        return reject(400, "template_path_missing", f"the command's template reads {e.path}, which the request "
                      "does not have", path=str(e.path), command=cmd.name)
    except TopicError as e:
        return reject(400, "invalid_topic", str(e), path=e.path, command=cmd.name)
    return topic, payload, reply_topic


async def execute(state: RequestState, iot: Any, body: Any) -> Reject | tuple[int, bytes]:
    """Validate `body` as a command, render, publish, wait: a Reject, or (status, the client's body)."""
    import secrets

    from extproc.iot.client import BrokerUnavailable, ReplyTimeout

    correlation = secrets.token_hex(8)
    found = command_document(iot, body, state.request_id, state.tenant, correlation)
    if not isinstance(found, tuple):
        return found
    cmd, doc = found
    rendered = render_command(cmd, doc)
    if not isinstance(rendered, tuple):
        return rendered
    topic, payload, reply_topic = rendered
    client = state.runtime.mqtt.client(iot.broker)
    try:
        reply = await client.request(topic, payload, cmd.qos, cmd.retain, cmd.timeout, reply_topic,
                                     cmd.reply_topic.filter if cmd.reply_topic is not None else None,
                                     correlation, iot.correlation_path)
    except BrokerUnavailable as e:
        return reject(503, "broker_unavailable", str(e), retry_after=1, broker=iot.broker.name, topic=topic)
    except ReplyTimeout as e:
        return reject(504, "device_timeout", str(e), topic=topic, reply_topic=reply_topic,
                      device=doc["device"], command=cmd.name, acknowledged=e.acked)
    base = {"device": doc["device"], "command": cmd.name, "topic": topic, "correlationId": correlation}
    if reply is None:
        return 202, orjson.dumps({**base, "status": "published"})
    try:
        answer = orjson.loads(reply.payload)
    except orjson.JSONDecodeError:
        return reject(502, "invalid_device_reply", f"the reply on {reply.topic} is not JSON",
                      topic=topic, reply_topic=reply.topic)
    if cmd.response is None:
        return 200, orjson.dumps({**base, "reply": answer})
    try:
        return 200, cmd.response.render_json({**doc, "reply": answer})
    except MissingPathError as e:
        return reject(502, "transform_path_missing", f"the response template reads {e.path}, which the "
                      "device's reply does not have", path=str(e.path), reply_topic=reply.topic)


class MqttCommand:
    name = "mqtt-command"

    async def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        done = await execute(state, state.route.iot, state.input_doc)
        if isinstance(done, Reject):
            return done
        status, body = done
        return Respond(status, body, "iot_reply" if status == 200 else "iot_published")


__all__ = ["MqttCommand", "command_document", "execute", "render_command"]
