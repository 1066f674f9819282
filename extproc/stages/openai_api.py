"""Stages `openai-parse` and `openai-usage`: the OpenAI API (vLLM) through the gateway, with token usage.

What, per request on an `openai` route (for example `path: /v1/, match: prefix`):
- `GET .../models` is answered by the processor: the models every target serves (LoRA names
  included), in OpenAI's list format;
- `openai-parse` reads the JSON body once into `state.request` (`extproc/request.py`); `dispatch`
  then picks the target serving its `model` (404 naming the served models otherwise). The body is
  forwarded byte for byte, except that a streaming request without
  `stream_options.include_usage` gets it added, so usage can be counted; that extra final usage
  chunk is then removed from the stream again so the client sees what it asked for;
- a backend's own 5xx body is logged and replaced by OpenAI's error shape naming the backend and the
  request id (it can carry the server's internals), other error responses pass
  through untouched; successful ones are read chunk by chunk
  by `openai-usage` (Envoy STREAMED mode: an SSE stream reaches the client event by event, never
  buffered whole) and their usage is counted in `adapter_processor_tokens_total{route,backend,model,tenant,type}`.
- a stream the backend ends without `data: [DONE]` gets an error event (`code:
  backend_stream_truncated`, vLLM's in-stream error shape, which the `openai` client raises as
  APIError) and a clean `data: [DONE]` end. A connection *reset* mid-stream cannot be turned into
  an event: Envoy resets the client's stream at once, so the client fails fast instead of hanging.
vLLM specifics (`priority`, LoRA adapters as `model`, `stream_options`) pass through unchanged,
except where the backend's negotiated dialect (extproc/negotiate.py) says otherwise: `openai-usage`
rewrites the body after dispatch (a client's `json_schema` response format as that server takes
it, a `priority` it refuses removed), and when the client asked for `include_usage` from a server
that sends none, adds the gateway's estimate as the usage chunk (`"estimated": true`).
Cost: one JSON parse of the request; per response chunk a scan for `"usage"` (events without it are
not parsed); one extra round trip per chunk, which is the price of seeing the stream.
"""

from __future__ import annotations

import logging
import time

import orjson

from extproc.errors import reject
from extproc.genai import ESTIMATED_EVENTS_ATTR, estimate_output_tokens
from extproc.negotiate import dialects_known
from extproc.stages.decode_response import ERROR_LOG_LIMIT, _from_upstream
from extproc.request import parse_json_body, parse_openai
from extproc.stages.backend_dialect import in_dialect
from extproc.stages.body_limit import check_length
from extproc.stages.dispatch import backend_of
from extproc.types import CONTINUE, HttpMessage, Mutate, Outcome, Phase, Reject, RequestState, Respond, Verdict

USAGE_LIMIT = 8 * 1024 * 1024  # non-streamed JSON responses larger than this are not parsed for usage
log = logging.getLogger(__name__)


class OpenAIParse:
    name = "openai-parse"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        headers = msg.headers or {}
        path = headers.get(":path", "").split("?", 1)[0]
        state.attrs["path"] = path
        method = headers.get(":method", "GET")
        if method == "GET" and path.rstrip("/").endswith("/models"):
            return self._models(state)
        return None

    def _models(self, state: RequestState) -> Respond:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "adapter-gateway",
                 "backend": (state.route.backend_for_model(m) or state.route.backend).name}
                for m in state.route.models]
        return Respond(200, orjson.dumps({"object": "list", "data": data}), "models")

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        too_large = check_length(state, len(msg.body))
        if too_large is not None:
            return too_large
        body = parse_json_body(msg.body, allow_empty=True)
        if isinstance(body, Reject):
            return body
        if body is None and not msg.body.strip():  # an empty body; `null` is JSON that is not an object
            body = {}
        if not isinstance(body, dict):
            return reject(400, "invalid_request", "request body must be a JSON object")
        req = state.request = parse_openai(state.attrs.get("path", ""), body, state.tenant)
        if req.stream:
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):  # (was AttributeError: a 500 for the client's mistake)
                return reject(400, "invalid_request", "stream_options must be a JSON object", param="stream_options")
            if not options.get("include_usage"):
                body["stream_options"] = {**options, "include_usage": True}
                state.attrs["strip_usage"] = True
                data = orjson.dumps(body)
                return Mutate(set_headers=(("content-length", str(len(data))),), body=data)
        return None


# An SSE stream may open with a comment (": ping", some servers' keep-alive) or an event/id/retry
# field before its first `data:` line; a JSON answer or error opens with "{".
SSE_STARTS = (b"data:", b":", b"event:", b"id:", b"retry:")


def _drop_our_stream_options(state: RequestState, body: dict) -> bool:
    """`stream_options` removed when openai-parse added `include_usage` to them (`strip_usage`); else kept."""
    if not state.attrs.get("strip_usage"):
        return False
    body.pop("stream_options", None)
    state.attrs.pop("strip_usage")
    return True


class OpenAIUsage:
    name = "openai-usage"
    streams = (Phase.RESPONSE_BODY,)

    async def on_request_headers(self, state: RequestState, msg: HttpMessage) -> None:
        """A target this worker has not negotiated with yet: wait for it once (bounded, negotiate.py)."""
        await dialects_known(state)

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        """After dispatch: the client's body in the chosen backend's dialect (backends/dialects.py):
        `response_format: json_schema` as that server takes structured output (or the schema in a
        system message, `prompt`; a route with `structuredFallback: refuse` answers 501), `priority`
        removed where it makes the server fail, our `stream_options` where the server refuses them."""
        data = in_dialect(state, _drop_our_stream_options)
        if not isinstance(data, bytes):
            return data
        return Mutate(set_headers=(("content-length", str(len(data))),), body=data)

    def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        if (state.response_status or 0) >= 500 and state.backend is not None and _from_upstream(state):
            return self._sanitised(state, msg)
        # No response-headers phase (it would cost a round trip before the first token): the first
        # chunk tells an SSE stream (`data: ...`) from a JSON answer or an error.
        if "sse" not in state.attrs:
            state.attrs["sse"] = state.backend is not None and msg.body.lstrip().startswith(SSE_STARTS)
            state.attrs["pending"] = b""
        if state.attrs["sse"]:
            return self._sse_chunk(state, msg)
        pending = state.attrs["pending"]
        if len(pending) + len(msg.body) <= USAGE_LIMIT:
            state.attrs["pending"] = pending + msg.body
        if msg.end_of_stream:
            try:
                self._count(state, orjson.loads(state.attrs["pending"]))
            except orjson.JSONDecodeError:
                pass
        return CONTINUE

    def _sse_chunk(self, state: RequestState, msg: HttpMessage) -> Verdict:
        """Count usage from complete SSE events; drop the usage-only event we asked for ourselves."""
        attrs = state.attrs  # events with a JSON payload: the output-token estimate without usage (genai.py)
        attrs[ESTIMATED_EVENTS_ATTR] = attrs.get(ESTIMATED_EVENTS_ATTR, 0) + msg.body.count(b"data: {")
        data = state.attrs["pending"] + msg.body
        head, sep, rest = data.rpartition(b"\n\n")
        state.attrs["pending"] = rest if sep else data
        if b"data: [DONE]" in data:
            state.delivered = True  # the stream's end is going out; a client may close at it (lifecycle.derive_outcome)
        body = msg.body
        if sep and b'"usage"' in head:
            body = self._usage_events(state, head, body)
        if state.delivered and state.usage is None and b"data: [DONE]" in body and self._asked_usage(state):
            body = body.replace(b"data: [DONE]", b"data: " + self._estimated_usage(state) + b"\n\ndata: [DONE]", 1)
        if msg.end_of_stream and not state.delivered:
            # The backend ended the stream without `data: [DONE]`: tell the client in-band, in the
            # shape vLLM uses for errors inside a stream, then end the stream cleanly.
            error = {"error": {"message": f"backend {state.backend} ended the stream before it was complete",
                               "type": "server_error", "code": "backend_stream_truncated",
                               "route": state.route.name, "request_id": state.request_id}}
            state.observed = Outcome.TRUNCATED
            prefix = b"" if not state.attrs["pending"] else b"\n\n"
            return Mutate(body=body + prefix + b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n")
        return Mutate(body=body) if body is not msg.body else CONTINUE

    def _usage_events(self, state: RequestState, head: bytes, body: bytes) -> bytes:
        for event in head.split(b"\n\n"):
            if b'"usage"' not in event or not event.startswith(b"data: {"):
                continue
            try:
                chunk = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict) or not chunk.get("usage"):
                continue
            self._count(state, chunk)
            # Only an event wholly inside this chunk can be dropped (earlier bytes already went out).
            if state.attrs.get("strip_usage") and chunk.get("choices") == [] and event + b"\n\n" in body:
                body = body.replace(event + b"\n\n", b"", 1)
        return body

    @staticmethod
    def _sanitised(state: RequestState, msg: HttpMessage) -> Verdict:
        """A backend's own 5xx body can carry its internals (llama.cpp's names its source file and
        line): it goes to the log, the client gets OpenAI's error shape naming the backend and the
        request id. The response headers went out without a headers phase, but Envoy streams a body
        the processor may rewrite without content-length (chunked), so the error may differ in
        length; later chunks of the backend's body are dropped."""
        if "sanitised" in state.attrs:
            return Mutate(body=b"")
        state.attrs["sanitised"] = True
        log.warning("route %s: backend %s (%s) answered HTTP %d to request %s; its body, not returned to the "
                    "client: %r", state.route.name, state.backend, state.served, state.response_status,
                    state.request_id, msg.body[:ERROR_LOG_LIMIT])
        full = orjson.dumps({"error": {
            "message": f"backend {state.backend} answered HTTP {state.response_status}; the gateway logged its "
                       f"answer under request id {state.request_id}",
            "type": "server_error", "code": "backend_error", "request_id": state.request_id}})
        return Mutate(body=full)

    @staticmethod
    def _asked_usage(state: RequestState) -> bool:
        """The client asked for `stream_options.include_usage` itself (not the gateway for it)."""
        req = state.request
        options = req.body.get("stream_options") if req is not None and req.body is not None else None
        return bool(isinstance(options, dict) and options.get("include_usage")) and not state.attrs.get("strip_usage")

    @staticmethod
    def _estimated_usage(state: RequestState) -> bytes:
        """The usage chunk a backend without stream usage did not send (its dialect's stream_usage is
        `no`): the gateway's estimate (extproc/genai.py), marked `"estimated": true`."""
        req = state.request
        prompt = max(1, req.prompt_tokens_estimate()) if req is not None else 0  # a message is a token at least
        completion = estimate_output_tokens(state) or 0
        state.attrs["usage.estimated"] = True
        return orjson.dumps({"id": f"chatcmpl-{state.request_id}", "object": "chat.completion.chunk",
                             "created": int(time.time()), "model": req.model if req is not None else None,
                             "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                                      "total_tokens": prompt + completion, "estimated": True}})

    @staticmethod
    def _count(state: RequestState, response) -> None:
        state.usage = backend_of(state).adapter.usage(response)
