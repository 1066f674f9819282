"""Stage `tool-call`: execute an LLM tool call against the REST service its OpenAPI document describes.

What: the client (an agent runtime) POSTs one tool call as OpenAI (`{"id", "type": "function",
"function": {"name", "arguments"}}`), Anthropic (`{"type": "tool_use", "id", "name", "input"}`) or
MCP (`{"name", "arguments"}`, or a JSON-RPC `tools/call` request). The tool is looked up among the
route's tools (built from its `openapi` document at config load), the arguments are validated
against the tool's schema (400 naming each bad field by JSON pointer), and the service request is
built: method, path parameters substituted and percent-encoded, query, headers, a JSON or form
(urlencoded, multipart) body. The
processor rewrites the request into it; `dispatch`, next in the same reply, routes it to the
route's backend. The service's answer,
whatever its status, becomes the tool result in the caller's protocol (OpenAI `role: tool`
message, Anthropic `tool_result` block, MCP `tools/call` result), returned with status 200: the
tool call was executed; its outcome is in the result. A 5xx of the service's own has its body
replaced by a safe message naming the request id, under which the body is logged (it can carry the
service's internals); 4xx bodies, the API's error contract, are kept.
Cost: one JSON parse, one jsonschema validation (validator built once per tool), one request build;
on the way back one JSON parse and encode.
"""

from __future__ import annotations

import logging

import orjson

from extproc.errors import reject
from extproc.request import InferenceRequest
from extproc.semantic.toolcall import (ToolCallError, anthropic_tool_result, build_request, check_arguments,
                                       mcp_call_result, openai_tool_message, parse_tool_call, resolve_tool,
                                       tool_result)
from extproc.stages.adapter_steps import client_json
from extproc.types import CONTINUE, HttpMessage, Mutate, Reject, RequestState, Verdict

ERROR_LOG_LIMIT = 2048  # bytes of a service's 5xx body written to the log
log = logging.getLogger(__name__)


class ToolCall:
    name = "tool-call"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        doc = client_json(state, msg)
        if isinstance(doc, Reject):
            return doc
        try:
            call = parse_tool_call(doc)
            tool = resolve_tool(route.tools, call.name)
            args = check_arguments(tool, call.arguments)
            req = build_request(tool, args)
        except ToolCallError as e:
            err = e.to_error()
            fields = {k: v for k, v in err.items() if k not in ("status", "code", "message")}
            if isinstance(doc, dict) and doc.get("jsonrpc") is not None:
                fields["jsonrpc_id"] = doc.get("id")  # an MCP call gets a JSON-RPC error object
            return reject(e.status, e.code, err.get("message", str(e)), **fields)  # pragma: no mutate (to_error() always has message == str(e))
        state.attrs["tool_call"] = call
        state.request = InferenceRequest(api="tool", tenant=state.tenant,
                                         body=doc if isinstance(doc, dict) else None)
        if isinstance(doc, dict) and doc.get("jsonrpc") is not None:
            state.attrs["jsonrpc_id"] = doc.get("id")  # answered with the id as sent (number or string)
        headers_map = dict(req.headers)
        is_json = req.body and not headers_map.get("content-type", "").startswith(("multipart/", "application/x-www"))
        state.backend_request = orjson.dumps({"method": req.method, "target": req.target, "headers": headers_map,
                                              # a form body (urlencoded or multipart) is shown as text
                                              "body": (orjson.loads(req.body) if is_json else
                                                       req.body.decode("utf-8", "replace") if req.body else None)})
        body = req.body or b""
        headers = [(":method", req.method), (":path", req.target), *req.headers, ("content-length", str(len(body)))]
        if req.body is not None and not any(k == "content-type" for k, _ in req.headers):
            headers.append(("content-type", "application/json"))  # pragma: no mutate (unreachable: build_request sets content-type with each body)
        return Mutate(set_headers=tuple(headers), body=body)

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        if "tool_call" not in state.attrs:
            return Mutate(skip_body=True)  # answered before the call was made (e.g. 413): as it is
        state.attrs["response_headers"] = msg.headers or {}
        return None

    def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        call = state.attrs.get("tool_call")
        if call is None:  # no call was made (a response body with no request body before it): as it is
            return CONTINUE
        status = state.response_status or 0
        body = msg.body
        if status >= 500 and (state.response_details == "via_upstream" if state.response_details is not None
                              else bool(state.served)):
            # the service's own 5xx: its body can carry internals (a stack trace, a file path, a token);
            # the caller gets the status and a safe message, the log gets the body (4xx bodies are the
            # API's error contract, which the model needs to correct its call: kept)
            log.warning("route %s: tool service %s answered HTTP %d to request %s; its body, not returned: %r",
                        state.route.name, state.served, status, state.request_id, body[:ERROR_LOG_LIMIT])
            body = orjson.dumps({"error": f"the service answered HTTP {status}; the gateway logged its answer "
                                          f"under request id {state.request_id}"})
            state.attrs["response_headers"] = {"content-type": "application/json"}
        result = tool_result(status, state.attrs.get("response_headers", {}), body)
        if call.protocol == "anthropic":
            out = anthropic_tool_result(result, call.call_id)
        elif call.protocol == "mcp":
            out = mcp_call_result(result)
            if "jsonrpc_id" in state.attrs:
                out = {"jsonrpc": "2.0", "id": state.attrs["jsonrpc_id"], "result": out}
        else:
            out = openai_tool_message(result, call.call_id)
        return Mutate(set_headers=((":status", "200"), ("content-type", "application/json"),
                                   ("x-adapter-tool-status", str(state.response_status or 0))),
                      remove_headers=("content-length",), body=orjson.dumps(out))


__all__ = ["ToolCall"]
