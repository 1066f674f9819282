"""Stage `decode-response`: backend response -> model output document -> route transform -> client.

What: the backend adapter decodes the buffered response into
`{"output", "model", "usage", "response"}` plus `input` (the client's document); the route's
transform renders the client body from it (without a transform the client gets `output`).
A path missing from the output gives 502 naming the path (unless the template declares a `??`
default). Error responses (the backend's, or Envoy's own such as 503 for a backend that is down)
are not transformed: the response-headers reply tells Envoy to pass their body through.
With debug on (`x-adapter-debug: 1` from the client), the reply carries the backend request the
processor produced in `x-adapter-backend-request` (base64 JSON) for `adapterctl test`.
Cost: two JSON parses (response, model content), one render, one encode.
"""

from __future__ import annotations

import base64

import orjson

from backends.base import BackendError
from extproc.errors import reject
from extproc.stages.dispatch import backend_of
from extproc.stages.encode_request import variant_route
from extproc.template import MissingPathError
from extproc.types import HttpMessage, Mutate, RequestState, Verdict

DEBUG_LIMIT = 16 * 1024


class DecodeResponse:
    name = "decode-response"

    def on_response_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        status = state.response_status or 0
        if state.backend_request is None or status >= 300:
            # Envoy's own reply (413, 503 backend down, 504: already JSON naming the backend) or
            # the backend's error: the client gets it as it is, and Envoy need not send us the body.
            return Mutate(skip_body=True)
        return None

    def on_response_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = variant_route(state)
        backend = backend_of(state)
        try:
            doc = backend.adapter.decode(route, state.response_status or 200, msg.body)
        except BackendError as e:
            return reject(e.status, e.code, e.message, backend=backend.name)
        state.usage = backend.adapter.usage(doc["response"])
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
        if state.debug:
            headers.append(("x-adapter-route", route.name))
            headers.append(("x-adapter-backend", backend.name))
            if state.backend_request is not None:
                headers.append(("x-adapter-backend-request",
                                base64.b64encode(state.backend_request[:DEBUG_LIMIT]).decode()))
        return Mutate(set_headers=tuple(headers), remove_headers=("content-length",), body=body)
