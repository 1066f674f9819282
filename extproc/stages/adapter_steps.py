"""The steps the adapter stages share (`tool-call`, `sql-query`, `erp-action`); no stage of its own.

What: `client_json` reads the client's buffered JSON body (413 over the route's limit, 400
`malformed_json`). For the two-step stages, which ask the route's openai-kind backend one question
and act on its answer (`sql-query`, `erp-action`): `ask_model` puts the chat request in the body's
place; `model_answered` (response headers) lets only the model's own answer reach the response
body; `model_answer` reads what the stage needs of it, a backend's own error sanitised like
decode-response's by `backend_error` (`backend_error`, the body only in the log); `render_result`
makes the stage's result document the client's body, through the route's `transform` when it has
one. `worker_cache` is the worker's cache in which a stage keeps its clients.
Cost: what the stage would spend itself: one JSON parse, one encode, one render.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import orjson

from extproc.errors import reject
from extproc.request import InferenceRequest
from extproc.stages.body_limit import check_length
from extproc.stages.decode_response import _from_upstream
from extproc.stages.dispatch import backend_of
from extproc.template import MissingPathError
from extproc.types import HttpMessage, Mutate, Reject, RequestState, Verdict

CHAT_PATH = "/v1/chat/completions"
ERROR_LOG_LIMIT = 2048  # bytes of a backend's error body written to the log
T = TypeVar("T")


def worker_cache(state: RequestState, name: str, own: dict) -> dict:
    """The worker's `Runtime.cache(name)`; `own`, the stage's dict, when it runs without a runtime
    (unit tests, the benchmarks)."""
    return state.runtime.cache(name) if state.runtime is not None else own


def client_json(state: RequestState, msg: HttpMessage) -> Any | Reject:
    """The request body as JSON (any value: the stage checks its shape), or the 413 of `check_length`, or
    400 `malformed_json` (an empty body included)."""
    too_large = check_length(state, len(msg.body))
    if too_large is not None:
        return too_large
    try:
        return orjson.loads(msg.body)
    except orjson.JSONDecodeError as e:
        return reject(400, "malformed_json", f"request body is not valid JSON: {e}")


def ask_model(state: RequestState, doc: Any, chat: dict) -> Mutate:
    """The request rewritten into `chat`, a chat-completions request to the route's model (`dispatch`,
    next in the same reply, routes it): `state.input_doc` keeps the client's `doc` (the transform's
    `input`), `state.request` the typed request, `state.backend_request` the body sent."""
    body = orjson.dumps(chat)
    state.input_doc = doc
    state.request = InferenceRequest(api="openai", model=state.route.model, messages=tuple(chat["messages"]),
                                     max_tokens=chat["max_tokens"], tenant=state.tenant, body=chat)
    state.backend_request = body
    return Mutate(set_headers=((":path", CHAT_PATH), ("content-type", "application/json"),
                               ("content-length", str(len(body)))), body=body)


def model_answered(state: RequestState, asked: bool) -> Verdict | None:
    """At response headers: None (the body is wanted) when the model was `asked` and the answer came
    from the backend; else skip the body: answered before the model was asked, or Envoy's own error, as it is."""
    status = state.response_status or 0
    if not asked or (status >= 300 and not _from_upstream(state)):
        return Mutate(skip_body=True)
    return None


def backend_error(state: RequestState, msg: HttpMessage, log: logging.Logger) -> Reject | None:
    """The backend's own error answer (HTTP 300 or more) as `backend_error` naming the backend and the
    request id (4xx kept, else 502); its body, which can carry the server's internals, goes to `log`
    (warning, first ERROR_LOG_LIMIT bytes). None for a 2xx answer."""
    status = state.response_status or 200
    if status < 300:
        return None
    route, backend = state.route, backend_of(state)
    log.warning("route %s: backend %s (%s) answered HTTP %d to request %s; its body, not returned to the "
                "client: %r", route.name, backend.name, state.served, status, state.request_id,
                msg.body[:ERROR_LOG_LIMIT])
    return reject(status if 400 <= status < 500 else 502, "backend_error",
                  f"backend {backend.name} answered HTTP {status}; the gateway logged its answer under "
                  f"request id {state.request_id}", backend=backend.name)


def model_answer(state: RequestState, msg: HttpMessage, log: logging.Logger, want: str,
                 pick: Callable[[Any], T]) -> T | Reject:
    """What the stage needs of the model's answer: `pick(response document)`, with `state.usage` counted
    from the document; the Reject of `backend_error` for the backend's own error; 502
    `backend_bad_response` naming `want` (what `pick` reads) when the body is no JSON or `pick` fails
    (KeyError, IndexError, TypeError, AttributeError)."""
    refused = backend_error(state, msg, log)
    if refused is not None:
        return refused
    backend = backend_of(state)
    try:
        resp = orjson.loads(msg.body)
        picked = pick(resp)
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return reject(502, "backend_bad_response", f"backend {backend.name} answered with no {want}",
                      backend=backend.name)
    state.usage = backend.adapter.usage(resp)
    return picked


def render_result(state: RequestState, out: dict) -> bytes | Reject:
    """The stage's result document `out` as the response body: JSON, or through the route's `transform`
    (which also reads `input`, the client's document, added to `out`); 502 `transform_path_missing`
    when the template names a path the result lacks."""
    transform = state.route.transform
    if transform is None:
        return orjson.dumps(out)
    out["input"] = state.input_doc
    try:
        return transform.render_json(out)
    except MissingPathError as e:
        return reject(502, "transform_path_missing", f"response transform: {e.path} not found in the result",
                      path=e.path)


__all__ = ["CHAT_PATH", "ERROR_LOG_LIMIT", "worker_cache", "client_json", "ask_model", "model_answered",
           "backend_error", "model_answer", "render_result"]
