"""Stage `anthropic-messages` / `openai-responses`: a client API served on a chat-completions backend.

What, on a route of kind `anthropic-messages` (`POST /v1/messages`) or `openai-responses`
(`POST /v1/responses`), with the translation in `extproc/apis/<api>.py`:
- request headers: anything but a POST with a body is refused (405 / 400) in the API's dialect;
- request body: parsed once, translated to a chat-completions request (a `TranslationError` is a
  400 naming the field), read into `state.request` (`api` anthropic.messages / openai.responses),
  so `dispatch`, right after, picks the target serving its `model` like on an `openai` route; the
  body is replaced, `:path` set to `/v1/chat/completions`, `content-length` made exact and
  `accept-encoding` removed (the answer is rewritten here, so it must come uncompressed);
- response headers: `content-length` removed (the body changes size) and the content type set;
- response body, chunk by chunk (Envoy STREAMED mode): an SSE chat stream is cut into complete
  events as they arrive and each chunk's events are translated and sent on at once (a partial event
  waits for the next chunk; nothing else is held); a JSON chat completion is collected and
  translated at its end; usage is counted in `adapter_processor_tokens_total` as on `openai` routes.
  A stream without usage (a server that sends none, e.g. llama.cpp) gets the gateway's estimate in
  the API's final usage (prompt characters / 4, one token per chunk; `usage.estimated` in attrs);
  A stream the backend ends without `data: [DONE]` gets the API's in-stream error (Anthropic's
  `error` event, Responses' `response.failed`) and `state.observed = truncated`;
- errors: the backend's own (HTTP >= 400) become the API's error object with the same status: the
  backend's message for a 4xx (the client's mistake, e.g. too many tokens), a generic one for a 5xx
  (its body goes to the gateway's log under the request id); Envoy's own replies (503 backend down,
  504) likewise, naming Envoy's reason and the backend. The status a backend or Envoy answered
  with has already reached the client when the body comes, so a 200 chat answer that is not JSON
  becomes an error body under that 200.
Cost: one JSON parse and encode of the request; per response chunk one split of the new bytes plus
per event one JSON parse and one or two small encodes; one extra round trip per chunk (the price of
rewriting the stream) and one for the response headers.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import orjson

from backends.openai import OpenAIAdapter
from extproc.apis.common import SseSplitter, TranslationError, sse_data
from extproc.errors import reject, render
from extproc.genai import ESTIMATED_EVENTS_ATTR, estimate_output_tokens
from extproc.request import parse_json_body, parse_openai
from extproc.stages.body_limit import check_length
from extproc.stages.dispatch import backend_of
from extproc.types import HttpMessage, Mutate, Outcome, Phase, Reject, RequestState, Verdict

CHAT_PATH = OpenAIAdapter.chat_path
CTX_ATTR = "client_api.ctx"  # state.attrs: what the response translation needs from the request
RESPONSE_ATTR = "client_api.response"  # state.attrs: the response's translator state (`_Response`)
JSON_LIMIT = 16 * 1024 * 1024  # a non-streamed chat answer larger than this is refused (502 body)
ERROR_LIMIT = 64 * 1024  # bytes of an error body kept (to read its message and log it)
LOG_LIMIT = 2048
log = logging.getLogger(__name__)


class _Response:
    __slots__ = ("mode", "buf", "sse", "stream", "status", "upstream")

    def __init__(self, mode: str, status: int, upstream: bool):
        self.mode = mode  # "sse" | "json" | "error"
        self.buf = b""
        self.sse: SseSplitter | None = None
        self.stream: Any = None
        self.status = status
        self.upstream = upstream


def _from_upstream(state: RequestState) -> bool:
    details = state.response_details
    return details == "via_upstream" if details is not None else bool(state.served)


class ClientApi:
    streams = (Phase.RESPONSE_BODY,)

    def __init__(self, api: ModuleType, stream_class: type):
        self.api = api
        self.name = api.NAME
        self.stream_class = stream_class

    # --- request ------------------------------------------------------------------------------

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        headers = msg.headers or {}
        path = headers.get(":path", "").split("?", 1)[0]
        if headers.get(":method", "GET") != "POST":
            return reject(405, "method_not_allowed", f"{path} takes POST (the {self.name} API)")
        if msg.end_of_stream:
            return reject(400, "empty_body", f"{path}: the request body is empty; send a JSON {self.name} request")
        return None

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        too_large = check_length(state, len(msg.body))
        if too_large is not None:
            return too_large
        body = parse_json_body(msg.body)
        if isinstance(body, Reject):
            return body
        if not isinstance(body, dict):
            return reject(400, "invalid_request", "request body must be a JSON object")
        try:
            chat, ctx = self.api.to_chat(body)
        except TranslationError as e:
            return reject(e.status, e.code, e.message, param=e.param)
        req = parse_openai(CHAT_PATH, chat, state.tenant)
        req.api = self.api.API
        state.request = req
        state.attrs[CTX_ATTR] = ctx
        data = orjson.dumps(chat)
        state.backend_request = data
        # accept-encoding removed: the answer is read and rewritten here, so it must come uncompressed
        return Mutate(set_headers=((":path", CHAT_PATH), ("content-type", "application/json"),
                                   ("content-length", str(len(data)))), remove_headers=("accept-encoding",),
                      body=data)

    # --- response -----------------------------------------------------------------------------

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        if CTX_ATTR not in state.attrs:  # nothing was translated (cannot happen after a dispatch)
            return Mutate(skip_body=True)
        status = state.response_status or 0
        ctype = (msg.headers or {}).get("content-type", "")
        if status >= 400:
            mode = "error"
        elif status < 300 and ctype.startswith("text/event-stream"):
            mode = "sse"
        elif status < 300:
            mode = "json"
        else:
            return Mutate(skip_body=True)  # a redirect: as it is
        r = state.attrs[RESPONSE_ATTR] = _Response(mode, status, _from_upstream(state))
        if mode == "sse":
            r.sse = SseSplitter()
            r.stream = self.stream_class(state.attrs[CTX_ATTR], state.request_id)
            return Mutate(remove_headers=("content-length",))
        return Mutate(set_headers=(("content-type", "application/json"),), remove_headers=("content-length",))

    def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        r: _Response | None = state.attrs.get(RESPONSE_ATTR)
        if r is None:
            return None
        if r.mode == "sse":
            return Mutate(body=self._sse(state, r, msg))
        limit = ERROR_LIMIT if r.mode == "error" else JSON_LIMIT
        if len(r.buf) + len(msg.body) <= limit:
            r.buf += msg.body
        elif r.mode == "json":
            r.mode = "too_large"
        if not msg.end_of_stream:
            return Mutate(body=b"")  # held until the end: a JSON document is translated whole
        if r.mode == "json":
            return Mutate(body=self._json(state, r.buf))
        if r.mode == "too_large":
            return Mutate(body=self._error(state, 502, "backend_response_too_large",
                                           f"the backend's answer is larger than {JSON_LIMIT} bytes"))
        return Mutate(body=self._backend_error(state, r))

    def _sse(self, state: RequestState, r: _Response, msg: HttpMessage) -> bytes:
        out: list[bytes] = []
        events = r.sse.feed(msg.body)
        if msg.end_of_stream:
            events += r.sse.flush()
        stream = r.stream
        adapter = backend_of(state).adapter
        attrs = state.attrs
        for event in events:
            if stream.ended:
                break
            data = sse_data(event)
            if data is None:
                continue
            if data.strip() == b"[DONE]":
                if stream.usage is None:  # a server that sends no usage in streams: the gateway's estimate
                    stream.usage = _estimated_usage(state)
                out += stream.done()
                state.delivered = True  # the API's closing events: a client may close after them
                continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            attrs[ESTIMATED_EVENTS_ATTR] = attrs.get(ESTIMATED_EVENTS_ATTR, 0) + 1  # genai.py's output estimate
            if chunk.get("usage"):
                state.usage = adapter.usage(chunk)
            error = chunk.get("error")
            if error is not None and not chunk.get("choices"):
                message = error.get("message") if isinstance(error, dict) else str(error)
                out += stream.error(502, f"backend {state.backend}: {message}"[:1000])
                continue
            out += stream.feed(chunk)
        if msg.end_of_stream and not stream.ended:
            state.observed = Outcome.TRUNCATED
            out += stream.error(502, f"backend {state.backend} ended the stream before it was complete "
                                     f"(request id {state.request_id})")
        return b"".join(out)

    def _json(self, state: RequestState, raw: bytes) -> bytes:
        try:
            chat = orjson.loads(raw)
        except orjson.JSONDecodeError:
            chat = None
        if not isinstance(chat, dict):
            return self._error(state, 502, "backend_bad_response", f"backend {state.backend} answered with no JSON object")
        state.usage = backend_of(state).adapter.usage(chat)
        return orjson.dumps(self.api.from_chat(chat, state.attrs[CTX_ATTR], state.request_id))

    def _backend_error(self, state: RequestState, r: _Response) -> bytes:
        try:
            doc = orjson.loads(r.buf)
        except orjson.JSONDecodeError:
            doc = None
        backend = state.backend or "unknown"
        if not r.upstream:  # Envoy's own reply (our local-reply JSON: code = its reason)
            err = doc.get("error") if isinstance(doc, dict) else None
            reason = err.get("code") if isinstance(err, dict) and isinstance(err.get("code"), str) else "envoy_error"
            return self._error(state, r.status, "backend_unavailable",
                               f"the gateway could not get an answer from backend {backend}: {reason}",
                               backend=backend)
        if r.status < 500:
            message = _message_of(doc) or f"HTTP {r.status}"
            return self._error(state, r.status, "backend_error", f"backend {backend}: {message}"[:1000],
                               backend=backend)
        log.warning("route %s: backend %s (%s) answered HTTP %d to request %s; its body, not returned to the "
                    "client: %r", state.route.name, backend, state.served, r.status, state.request_id,
                    r.buf[:LOG_LIMIT])
        return self._error(state, r.status, "backend_error",
                           f"backend {backend} answered HTTP {r.status}; the gateway logged its answer under "
                           f"request id {state.request_id}", backend=backend)

    def _error(self, state: RequestState, status: int, code: str, message: str, **fields: Any) -> bytes:
        return render(state.route.dialect, reject(status, code, message, **fields), state.route.name,
                      state.request_id)


def _estimated_usage(state: RequestState) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens for a stream the backend sent without usage: the prompt's
    characters / 4 and one token per chunk (extproc/genai.py's estimates), marked `usage.estimated`."""
    state.attrs["usage.estimated"] = True
    req = state.request
    return (max(1, req.prompt_tokens_estimate()) if req is not None else 0), estimate_output_tokens(state) or 0, 0


def _message_of(doc: Any) -> str | None:
    """The message of an OpenAI-style error body (`{"error": {"message"}}`, vLLM's `{"message"}`)."""
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    return doc.get("message") if isinstance(doc.get("message"), str) else None


def anthropic_messages() -> ClientApi:
    from extproc.apis import anthropic_messages as api

    return ClientApi(api, api.MessagesStream)


def openai_responses() -> ClientApi:
    from extproc.apis import openai_responses as api

    return ClientApi(api, api.ResponsesStream)


__all__ = ["ClientApi", "anthropic_messages", "openai_responses", "CHAT_PATH"]
