"""Stage `encode-request`: map the client document to the request of the backend dispatch chose.

What: that backend's adapter renders the request (template or default); this stage replaces the
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


class EncodeRequest:
    name = "encode-request"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = state.route
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
