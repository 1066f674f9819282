"""Stage `decode-response`: backend response -> model output document -> route transform -> client.

What: the backend adapter decodes the buffered response into
`{"output", "model", "usage", "response"}` plus `input` (the client's document); the route's
transform renders the client body from it (without a transform the client gets `output`).
A path missing from the output gives 502 naming the path (unless the template declares a `??`
default). Envoy's own error replies (503 for a backend that is down, 413, 504: JSON naming the
backend; their `response.code_details` attribute is not "via_upstream") pass through untouched: the
response-headers reply tells Envoy not to send their body. A backend's own error (status 400 or
more, "via_upstream") is sanitised: its body can carry a server's internals (a llama.cpp
500 names the server's source file and line), so the client gets the route's error with the same
status, code `backend_error`, the backend's name and the request id, and the body itself goes to
the gateway's log (warning, first 2 KiB) under that request id.
A KServe backend's answer names the precision it was computed in (`extproc/precision.py`): the client
gets `x-adapter-precision` (int8, fp16, fp32; "unknown" when the backend does not say, as Triton) and,
after a fallback, `x-adapter-precision-fallback` ("int8:missing"), counted in
`adapter_processor_precision_total{route,backend,precision,fallback}`.
With debug on (`x-adapter-debug: 1` from the client), the reply carries the backend request the
processor produced in `x-adapter-backend-request` (base64 JSON) for `adapterctl test`.
Cost: two JSON parses (response, model content), one render, one encode.
"""

from __future__ import annotations

import base64
import logging

import orjson

from backends.base import BackendError
from extproc.errors import reject
from extproc import precision as precision_report
from extproc.genai import ANSWER_ATTR, GENERATIVE_KINDS
from extproc.negotiate import DIALECT_ATTR, REPAIRED_ATTR
from extproc.stages.dispatch import backend_of
from extproc.stages.encode_request import variant_route
from extproc.template import MissingPathError
from extproc.types import HttpMessage, Mutate, RequestState, Verdict

DEBUG_LIMIT = 16 * 1024
ERROR_LOG_LIMIT = 2048  # bytes of a backend's error body written to the log
SANITISE_ATTR = "decode.backend_error_status"  # state.attrs: the backend's error status, its body to log
log = logging.getLogger(__name__)


def _from_upstream(state: RequestState) -> bool:
    """The response came from the backend, not from Envoy: its `response.code_details` attribute is
    "via_upstream" (without the attribute, e.g. a hand-written Envoy config, an upstream address)."""
    details = state.response_details
    return details == "via_upstream" if details is not None else bool(state.served)


class DecodeResponse:
    name = "decode-response"

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        status = state.response_status or 0
        if state.backend_request is not None and status >= 400 and _from_upstream(state):
            state.attrs[SANITISE_ATTR] = status  # the backend's own error: read its body, to log it
            return None
        if state.backend_request is None or status >= 300:
            # Envoy's own reply (413, 503 backend down, 504: already JSON naming the backend) or a
            # redirect: the client gets it as it is, and Envoy need not send us the body.
            return Mutate(skip_body=True)
        return None

    def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = variant_route(state)
        backend = backend_of(state)
        status = state.attrs.get(SANITISE_ATTR)
        if status is not None:
            log.warning("route %s: backend %s (%s) answered HTTP %d to request %s; its body, not returned to the "
                        "client: %r", route.name, backend.name, state.served, status, state.request_id,
                        msg.body[:ERROR_LOG_LIMIT])
            return reject(status if status < 600 else 502, "backend_error",
                          f"backend {backend.name} answered HTTP {status}; the gateway logged its answer under "
                          f"request id {state.request_id}", backend=backend.name)
        kw = {}
        dialect = state.attrs.get(DIALECT_ATTR)
        if dialect is not None:  # an OpenAI-compatible backend: `prompt` answers are validated (negotiate.py)
            kw["structured"] = dialect.structured
        try:  # the repaired answer when encode-request made the prompt dialect's repair retry
            doc = backend.adapter.decode(route, state.response_status or 200, state.attrs.get(REPAIRED_ATTR, msg.body),
                                         **kw)
        except BackendError as e:
            return reject(e.status, e.code, e.message, backend=backend.name)
        state.usage = backend.adapter.usage(doc["response"])
        if not state.usage.total_tokens and backend.kind in GENERATIVE_KINDS:  # no usage: the GenAI metric estimates
            state.attrs[ANSWER_ATTR] = state.attrs.get(REPAIRED_ATTR, msg.body)
        if route.transform is None:
            body = orjson.dumps(doc["output"])
        else:
            doc["input"] = state.input_doc
            try:
                body = route.transform.render_json(doc)
            except MissingPathError as e:
                return reject(502, "transform_path_missing",
                              f"response transform: {e.path} not found in the backend output",
                              path=e.path, backend=backend.name)
        headers = [("content-type", "application/json")]
        if backend.adapter.api == "kserve":
            precision, fallback = precision_report.from_response(backend.kind, doc["response"])
            headers.extend(precision_report.headers(precision, fallback))
            sink = getattr(state.runtime, "metrics_sink", None)
            if sink is not None:
                sink.pending.inc(sink.child(sink.metrics.precision, route.name, backend.name, precision, fallback))
        if state.debug:
            headers.append(("x-adapter-route", route.name))
            headers.append(("x-adapter-backend", backend.name))
            if state.backend_request is not None:
                headers.append(("x-adapter-backend-request",
                                base64.b64encode(state.backend_request[:DEBUG_LIMIT]).decode()))
        return Mutate(set_headers=tuple(headers), remove_headers=("content-length",), body=body)
