"""Stage `erp-action`: a request about a BPMN process instance -> the model picks one enabled action -> checked
against the instance's state and the action's schema -> run on the ERP service -> the result to the client.

What: at the request body the client's JSON (`{"instance": "SO-1001", "message": "..."}`, fields
named by `erp.instanceField` / `erp.messageField`) names an instance; the stage reads its state
from the ERP service (`GET {service}{instancePath}` -> `{"position": [element ids], "version": n}`:
the ERP service keeps the instance, the client never states it), works out the service tasks
enabled at that position (`extproc.semantic.bpmn.enabled`) and asks the route's openai-kind
backend with exactly those tasks as tools (`extproc.semantic.tools.openai_tools`, the tool
routes' writer; `tool_choice: required`, `temperature: 0`); `dispatch`, next in the same reply,
routes it. With nothing enabled (the instance waits for a person, or has ended) it answers 409
`no_enabled_action` without asking the model.
At the response body the model's first tool call is parsed (`toolcall.parse_tool_call`), its
action looked up among the tasks enabled *at request time* (409 `action_not_enabled` naming the
position, what it waits for and the enabled actions; 422 `unknown_action` for a name that is no
action of the process), its arguments validated against the action's JSON Schema
(`toolcall.check_arguments`: 422 `invalid_action_arguments`, each field by JSON pointer), the
REST request built (`toolcall.build_request`) and sent to the ERP service; on a 2xx the instance
is advanced there (`POST {instancePath}/advance` with `{"version", "task", "position"}`: the new
position from `bpmn.advance`; the service answers 409 if the version moved: 409 `instance_changed`).
The client gets 200 with `{"instance", "action", "task", "arguments", "result" (toolcall.tool_result
of the service's answer), "position", "enabled" (the actions enabled next), "ended"}`, or that
document through the route's `transform`. The service refusing the action (4xx) is 422
`erp_action_refused` with its answer (the instance is not advanced); a 5xx, a timeout or no
connection is 502 `erp_unavailable` (bodies only in the log). A backend's own error is sanitised
like sql-query's (`backend_error`).
The action and the advance are two calls: an action that succeeded whose advance is refused (a
concurrent change) is reported as 409 `instance_changed` with the action's result; make actions
idempotent on the service side (docs/erp-adapter.md).
Parameters: the route's `erp` block (docs/erp-adapter.md). Client: one `httpx.AsyncClient` per
worker (`Runtime.cache("erp")`, connections kept alive).
Cost: request: one JSON parse, one ERP read, one walk of the gateways after each token, one encode;
response: one JSON parse, one jsonschema validation, the action and the advance (two ERP calls), one
encode (perf/bench_erp.py: adapter time without the model).
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson

from extproc.errors import reject
from extproc.semantic.bpmn import BpmnError, advance, enabled, normalize
from extproc.semantic.toolcall import ToolCallError, build_request, check_arguments, parse_tool_call, tool_result
from extproc.semantic.tools import openai_tools
from extproc.stages.adapter_steps import (ERROR_LOG_LIMIT, ask_model, client_json, model_answer, model_answered,
                                          render_result, worker_cache)
from extproc.types import HttpMessage, Mutate, Reject, RequestState, Verdict

CACHE = "erp"
log = logging.getLogger(__name__)


def client(state: RequestState, own: dict) -> httpx.AsyncClient:
    """The worker's ERP client (`Runtime.cache("erp")`), one per event loop; without a runtime the stage's own."""
    cache = worker_cache(state, CACHE, own)
    loop = asyncio.get_running_loop()
    held = cache.get("client")
    if held is None or held[0] is not loop:
        held = cache["client"] = (loop, httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=32)))
    return held[1]


def _state_fields(erp, position, waiting, enabled_tasks) -> dict:
    p = erp.process
    return {"position": list(position), "waiting_for": [p.describe(w) for w in waiting],
            "enabled": [erp.tool_name(t) for t in enabled_tasks]}


def _message_and_calls(resp: dict) -> tuple[dict, list]:
    """The model's message and its tool calls (none: `[]`)."""
    message = resp["choices"][0]["message"]
    return message, message.get("tool_calls") or []


class ErpAction:
    name = "erp-action"

    def __init__(self) -> None:
        self._own: dict = {}  # the client when run without a runtime (unit tests, the benchmark)

    async def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        erp = route.erp
        doc = client_json(state, msg)
        if isinstance(doc, Reject):
            return doc
        instance = doc.get(erp.instance_field) if isinstance(doc, dict) else None
        if not isinstance(instance, str) or not erp.instance_re.match(instance):
            return reject(400, "missing_instance", f"the body needs `{erp.instance_field}`: the process instance's "
                          f"id, a string matching {erp.instance_re.pattern}", path=f"/{erp.instance_field}")
        message = doc.get(erp.message_field, "")
        if not isinstance(message, str):
            return reject(400, "invalid_message", f"`{erp.message_field}` must be a string",
                          path=f"/{erp.message_field}")
        url = erp.service + erp.instance_target(instance)
        try:
            resp = await client(state, self._own).get(url, timeout=erp.timeout)
        except httpx.HTTPError as e:
            log.warning("route %s: ERP service %s unreachable for request %s: %r", route.name, url,
                        state.request_id, e)
            return reject(502, "erp_unavailable", f"the ERP service did not answer the instance read "
                          f"({type(e).__name__})", instance=instance)
        if resp.status_code == 404:
            return reject(404, "unknown_instance", f"the ERP service has no instance {instance!r}", instance=instance)
        try:
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            inst = resp.json()
            position, version = inst["position"], inst.get("version")
            if not isinstance(position, list) or not all(isinstance(t, str) for t in position):
                raise ValueError("`position` is not a list of element ids")
            position = normalize(erp.process, position)
            now = enabled(erp.process, position)
        except (ValueError, KeyError, TypeError, BpmnError) as e:
            log.warning("route %s: ERP instance %s for request %s unusable: %s; body: %r", route.name, instance,
                        state.request_id, e, resp.content[:ERROR_LOG_LIMIT])
            return reject(502, "erp_bad_state", f"the ERP service's state of instance {instance!r} is unusable: {e}",
                          instance=instance)
        if not now.tasks:
            what = ("has ended" if not position else
                    "waits for " + ", ".join(erp.process.describe(w) for w in now.waiting))
            return reject(409, "no_enabled_action", f"instance {instance!r} {what}: no action can run now",
                          instance=instance, **_state_fields(erp, position, now.waiting, ()))
        tools = openai_tools([erp.tools[t] for t in now.tasks])
        for t, task in zip(tools, now.tasks):
            branch = now.branch_text.get(task)
            if branch:
                t["function"]["description"] += f" (the process branch: {branch})"
        system = (f"You act in the business process {erp.process.name or erp.process.id!r} on instance "
                  f"{instance!r}. Call exactly one of the offered tools: the actions that can run now. "
                  f"The instance is at: {', '.join(erp.process.describe(t) for t in position)}.")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": message or "Next step?"}]
        chat = {"model": route.model, "messages": messages, "tools": tools, "tool_choice": "required",
                "temperature": 0, "max_tokens": erp.max_tokens}
        state.attrs["erp"] = (instance, position, version, now)
        return ask_model(state, doc, chat)

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        return model_answered(state, "erp" in state.attrs)

    async def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        erp = route.erp
        instance, position, version, now = state.attrs["erp"]
        answer = model_answer(state, msg, log, "choices[0].message", _message_and_calls)
        if isinstance(answer, Reject):
            return answer
        message, calls = answer
        fields = _state_fields(erp, position, now.waiting, now.tasks)
        if not calls:
            text = message.get("content") if isinstance(message.get("content"), str) else ""
            return reject(422, "no_action_chosen", "the model chose no action (no tool call)", instance=instance,
                          model_text=text[:500], **fields)
        try:
            call = parse_tool_call(calls[0])
        except ToolCallError as e:
            return reject(422, "malformed_action", f"the model's tool call is malformed: {e}", instance=instance,
                          **fields)
        task = erp.task_of.get(call.name)
        if task is None:
            return reject(422, "unknown_action", f"the model chose {call.name[:80]!r}, which is no action of process "
                          f"{erp.process.id!r}", instance=instance, action=call.name[:80], **fields)
        if task not in now.tasks:
            return reject(409, "action_not_enabled", f"action {call.name!r} ({erp.process.describe(task)}) is not "
                          f"enabled for instance {instance!r} at {', '.join(position) or 'its end'}; enabled now: "
                          f"{', '.join(fields['enabled'])}", instance=instance, action=call.name, **fields)
        tool = erp.tools[task]
        try:
            args = check_arguments(tool, call.arguments)
            req = build_request(tool, {**args, "instance": instance})
        except ToolCallError as e:
            err = e.to_error()
            return reject(422, "invalid_action_arguments", err["message"], instance=instance, action=call.name,
                          errors=err.get("errors"), **fields)
        after = advance(erp.process, position, task)
        http = client(state, self._own)
        try:
            result = await http.request(req.method, erp.service + req.target, headers=dict(req.headers),
                                        content=req.body, timeout=erp.timeout)
        except httpx.HTTPError as e:
            log.warning("route %s: ERP action %s for request %s failed: %r", route.name, call.name,
                        state.request_id, e)
            return reject(502, "erp_unavailable", f"the ERP service did not answer action {call.name!r} "
                          f"({type(e).__name__})", instance=instance, action=call.name)
        if result.status_code >= 500:
            log.warning("route %s: ERP action %s for request %s: HTTP %d; body not returned: %r", route.name,
                        call.name, state.request_id, result.status_code, result.content[:ERROR_LOG_LIMIT])
            return reject(502, "erp_unavailable", f"the ERP service answered HTTP {result.status_code} to action "
                          f"{call.name!r}; the gateway logged its answer under request id {state.request_id}",
                          instance=instance, action=call.name)
        outcome = tool_result(result.status_code, result.headers.items(), result.content)
        if result.status_code >= 300:
            return reject(422, "erp_action_refused", f"the ERP service refused action {call.name!r} "
                          f"(HTTP {result.status_code}); the instance did not move", instance=instance,
                          action=call.name, service_status=result.status_code, detail=outcome.get("body"), **fields)
        target = erp.service + erp.instance_target(instance) + "/advance"
        try:
            moved = await http.post(target, content=orjson.dumps({"version": version, "task": task,
                                                                  "position": list(after)}),
                                    headers={"content-type": "application/json"}, timeout=erp.timeout)
        except httpx.HTTPError as e:
            moved = None
            log.warning("route %s: advancing ERP instance %s after %s failed for request %s: %r", route.name,
                        instance, call.name, state.request_id, e)
        if moved is None or moved.status_code >= 300:
            code = 409 if moved is not None and moved.status_code == 409 else 502
            log.warning("route %s: action %s ran on instance %s but the advance got %s (request %s)", route.name,
                        call.name, instance, moved.status_code if moved is not None else "no answer",
                        state.request_id)
            return reject(code, "instance_changed" if code == 409 else "erp_unavailable",
                          f"action {call.name!r} ran, but instance {instance!r} could not be advanced "
                          + ("(it changed meanwhile)" if code == 409 else "(no answer)"),
                          instance=instance, action=call.name, result=outcome)
        nxt = enabled(erp.process, after)
        out = {"instance": instance, "action": call.name, "task": task, "arguments": args, "result": outcome,
               "position": list(after), "enabled": [erp.tool_name(t) for t in nxt.tasks], "ended": not after}
        body = render_result(state, out)
        if isinstance(body, Reject):
            return body
        return Mutate(set_headers=((":status", "200"), ("content-type", "application/json"),
                                   ("x-adapter-erp-action", call.name)),
                      remove_headers=("content-length",), body=body)


__all__ = ["ErpAction"]
