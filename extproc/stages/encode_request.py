"""Stage `encode-request`: map the client document to the request of the backend dispatch chose.

What: that backend's adapter renders the request (template or default; a rollout's bundle arm
brings its own templates: `variant_route`); this stage replaces the
body and sets `:path` to the backend API path, `content-type` and an exact `content-length`. It
runs after `dispatch` in the same request-body reply, whose routing headers it joins.
Why: adapting and choosing the destination happen in the same ext_proc reply: one round trip.
Cost: one template render plus one JSON encode.
"""

from __future__ import annotations

from backends.base import InputError
from extproc.errors import reject
from extproc.stages.dispatch import backend_of
from extproc.types import HttpMessage, Mutate, RequestState, Verdict


def variant_route(state: RequestState):
    """The route whose templates this request uses: its rollout arm's when that arm is an adapter
    bundle (`Route.variants`, by the arm of `state.variant` = "<rollout>/<arm>"), else the route."""
    route = state.route
    if route.variants and state.variant:
        return route.variants.get(state.variant.rpartition("/")[2], route)
    return route


class EncodeRequest:
    name = "encode-request"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = variant_route(state)
        backend = backend_of(state)
        try:
            encoded = backend.adapter.encode(route, state.input_doc, state.attrs.get("model_metadata"))
        except InputError as e:
            return reject(400, e.code, e.message, path=e.path)
        state.backend_request = encoded.body
        path = ((":path", encoded.path),) if encoded.path else ()  # "": the client's path as it is
        # a buffered body keeps an exact content-length (some upstreams refuse chunked requests)
        return Mutate(set_headers=(*path, ("content-type", encoded.content_type),
                                   ("content-length", str(len(encoded.body)))), body=encoded.body)
