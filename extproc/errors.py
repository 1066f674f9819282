"""Structured errors rendered in the route's dialect: the one error model of the processor.

What: a stage returns `Reject(status, code, message, fields, retry_after)` (`extproc/types.py`);
`render(dialect, reject, route, request_id)` turns it into the body the route's clients parse:
- `adapter` (our own routes: llm, tensor, rest, passthrough, health):
  `{"error": {"status", "code", "message", ...fields, "route", "request_id"}}`;
- `openai` (openai routes; what the `openai` client raises as `APIStatusError`):
  `{"error": {"message", "type", "param", "code", "status", ...fields, "route", "request_id"}}`;
- `kserve` (kserve routes; the KServe v2 error object tritonclient reports):
  `{"error": "<message>"}`, with the code in the `x-adapter-error` header;
- `tool` (tool routes): like `adapter`; a JSON-RPC (MCP) call gets a JSON-RPC error object
  (`{"jsonrpc": "2.0", "id", "error": {"code", "message", "data"}}`) when the stage marked it;
- `anthropic` (anthropic-messages routes; what the `anthropic` client raises as `APIStatusError`):
  `{"type": "error", "error": {"type", "message"}, "request_id"}`, the type from the status
  (`extproc/apis/anthropic_messages.error_type`: 400 invalid_request_error, 404 not_found_error,
  429 rate_limit_error, 503 overloaded_error, 5xx api_error, ...).
The dialect is the route kind's (`extproc/kinds.py`), never the stage's choice, so a generic
stage (admission, shedding, dispatch) answers every client in its own API's terms.
Cost: one small dict and one orjson encode per error; nothing on successful requests.
"""

from __future__ import annotations

from typing import Any, Callable

import orjson

from extproc.types import Reject

DIALECTS = ("adapter", "openai", "kserve", "tool", "anthropic")

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 429: "rate_limit_exceeded"}


def _with_context(body: dict[str, Any], fields: Any, err: Reject, route: str | None,
                  request_id: str) -> dict[str, Any]:
    """What every JSON dialect adds after its own keys: the fields, retry-after, route, request id."""
    body.update({k: v for k, v in fields.items() if v is not None})
    if err.retry_after is not None:
        body.setdefault("retry_after_s", err.retry_after)
    if route is not None:
        body.setdefault("route", route)
    body.setdefault("request_id", request_id)
    return {"error": body}


def _adapter(err: Reject, route: str | None, request_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {"status": err.status, "code": err.code, "message": err.message}
    return _with_context(body, err.fields, err, route, request_id)


def _openai(err: Reject, route: str | None, request_id: str) -> dict[str, Any]:
    fields = dict(err.fields)
    kind = _OPENAI_TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"message": err.message, "type": kind, "param": fields.pop("param", None),
                            "code": err.code, "status": err.status}
    return _with_context(body, fields, err, route, request_id)


def _kserve(err: Reject, route: str | None, request_id: str) -> dict[str, Any]:
    return {"error": err.message}


def _tool(err: Reject, route: str | None, request_id: str) -> dict[str, Any]:
    rpc_id = err.fields.get("jsonrpc_id", _MISSING)
    if rpc_id is _MISSING:
        return _adapter(err, route, request_id)
    data = {k: v for k, v in err.fields.items() if k != "jsonrpc_id" and v is not None}
    data.update(status=err.status, code=err.code, route=route, request_id=request_id)
    # JSON-RPC: -32602 invalid params for the client's mistakes, -32603 internal error otherwise
    code = -32602 if 400 <= err.status < 500 else -32603
    return {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": err.message, "data": data}}


def _anthropic(err: Reject, route: str | None, request_id: str) -> dict[str, Any]:
    from extproc.apis.anthropic_messages import error_body

    return error_body(err.status, err.message, request_id)


_MISSING = object()
_RENDERERS: dict[str, Callable[[Reject, str | None, str], dict[str, Any]]] = {
    "adapter": _adapter, "openai": _openai, "kserve": _kserve, "tool": _tool, "anthropic": _anthropic}


def render(dialect: str, err: Reject, route: str | None = None, request_id: str = "") -> bytes:
    """The error body for `err` in `dialect` (unknown dialects fall back to `adapter`)."""
    return orjson.dumps(_RENDERERS.get(dialect, _adapter)(err, route, request_id))


def reject(status: int, code: str, message: str, retry_after: int | None = None, **fields: Any) -> Reject:
    """Shorthand: `reject(413, "body_too_large", "...", limit=1024)`."""
    return Reject(status, code, message, fields, retry_after)


__all__ = ["render", "reject", "DIALECTS"]
