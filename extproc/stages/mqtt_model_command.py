"""Stage `mqtt-model-command`: the IoT adapter's optional LLM step: a model's JSON answer is the device
command (route kind `iot` with a `target`, docs/iot-adapter.md).

What: the route's target (an OpenAI-compatible backend) is asked, by `encode-request` with the
route's default prompt (the client's `query` / `prompt` / `text`), for a JSON object matching the
route's command schema (`IotRoute.command_schema`: `device` matching the device pattern, `command`
one of the declared names, `params` the command's schema; structured output in the backend's
negotiated dialect). At the response body this stage decodes the model's answer (the backend
adapter, as `decode-response` does), checks it as a command exactly like a direct request, publishes
it and replaces the model's answer with the device's reply (`extproc/stages/mqtt_command.execute`).
Rules: the model's mistakes are the gateway's, not the client's: an answer that is not a valid
command is a 502 `invalid_model_command` with the check that failed (`reason`: unknown_command,
invalid_params, ...); a backend error is a 502 `backend_error` naming the backend (its body is not
returned); Envoy's own replies (backend down: 503) pass through; broker and device errors are
those of `mqtt-command` (503, 504).
Parameters: none (the route's `iot` block and target).
Cost: one decode of the model's answer, then what `mqtt-command` costs.
"""

from __future__ import annotations

from backends.base import BackendError
from extproc.errors import reject
from extproc.negotiate import DIALECT_ATTR, REPAIRED_ATTR
from extproc.stages.dispatch import backend_of
from extproc.stages.mqtt_command import execute
from extproc.types import HttpMessage, Mutate, Reject, RequestState, Verdict

_ERROR_ATTR = "iot.backend_error_status"


class MqttModelCommand:
    name = "mqtt-model-command"

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        status = state.response_status or 0
        details = state.response_details
        upstream = details == "via_upstream" if details is not None else bool(state.served)
        if status >= 400 and upstream and state.backend_request is not None:
            state.attrs[_ERROR_ATTR] = status
            return None
        if state.backend_request is None or status >= 300:  # Envoy's own reply: the client gets it as it is
            return Mutate(skip_body=True)
        return None

    async def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        backend = backend_of(state)
        status = state.attrs.get(_ERROR_ATTR)
        if status is not None:
            return reject(502, "backend_error", f"backend {backend.name} answered HTTP {status}", backend=backend.name)
        kw = {}
        dialect = state.attrs.get(DIALECT_ATTR)
        if dialect is not None:
            kw["structured"] = dialect.structured
        try:
            doc = backend.adapter.decode(state.route, state.response_status or 200,
                                         state.attrs.get(REPAIRED_ATTR, msg.body), **kw)
        except BackendError as e:
            return reject(e.status, e.code, e.message, backend=backend.name)
        state.usage = backend.adapter.usage(doc["response"])
        done = await execute(state, state.route.iot, doc["output"])
        if isinstance(done, Reject):
            if done.status == 400:  # the model's command failed a check a client's would fail
                return reject(502, "invalid_model_command", f"the model's command is not valid: {done.message}",
                              reason=done.code, backend=backend.name, command=doc["output"],
                              **{k: v for k, v in done.fields.items() if k in ("path", "known")})
            return done
        code, body = done
        return Mutate(set_headers=(("content-type", "application/json"), (":status", str(code))),
                      remove_headers=("content-length",), body=body)


__all__ = ["MqttModelCommand"]
