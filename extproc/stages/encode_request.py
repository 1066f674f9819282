"""Stage `encode-request`: map the client document to the backend request and route to it.

What: the route's backend adapter renders the request (template or default), then this stage
replaces the body, sets `:path` to the backend API path and `x-adapter-backend` to the backend,
and asks Envoy to re-match the route (`clear_route_cache`) so the request goes to that cluster.
Why: adapting and choosing the destination happen in the same ext_proc reply: one round trip.
Cost: one template render plus one JSON encode.
"""

from __future__ import annotations

from backends.base import InputError
from extproc.pipeline import reject
from extproc.stages.select_backend import route_to
from extproc.types import HttpMessage, RequestState, Verdict


class EncodeRequest:
    name = "encode-request"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
        backend = route.backend
        try:
            encoded = backend.adapter.encode(route, state.input_doc, state.attrs.get("model_metadata"))
        except InputError as e:
            return reject(400, e.code, e.message, path=e.path, route=route.name, request_id=state.request_id)
        state.backend_request = encoded.body
        path = ((":path", encoded.path),) if encoded.path else ()  # "": the client's path as it is
        # a buffered body keeps an exact content-length (some upstreams refuse chunked requests)
        return route_to(state, backend, *path, ("content-type", encoded.content_type),
                        ("content-length", str(len(encoded.body))), body=encoded.body)
