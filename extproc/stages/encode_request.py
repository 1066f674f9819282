"""Stage `encode-request`: map the client document to the request of the backend dispatch chose.

What: that backend's adapter renders the request (template or default; a rollout's bundle arm
brings its own templates: `variant_route`); this stage replaces the
body and sets `:path` to the backend API path, `content-type` and an exact `content-length`. It
runs after `dispatch` in the same request-body reply, whose routing headers it joins.
For an OpenAI-compatible backend the request is encoded in the dialect negotiated with it
(extproc/negotiate.py: structured output as the server takes it, or asked in the prompt; a route
with `policy.structuredFallback: refuse` answers 501 instead); in the `prompt` dialect this stage
also makes the one repair retry of an answer that does not match the schema (response body).
Why: adapting and choosing the destination happen in the same ext_proc reply: one round trip.
Cost: one template render plus one JSON encode; at request headers a dict lookup per target (a wait
only for a backend this worker never negotiated with).
"""

from __future__ import annotations

from backends.base import InputError
from extproc.errors import reject
from extproc.negotiate import (DIALECT_ATTR, dialect_of, dialects_known, negotiates_kind, refuse_structured,
                               repair_answer)
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

    async def on_request_headers(self, state: RequestState, msg: HttpMessage) -> None:
        """An OpenAI-compatible backend this worker has not negotiated with yet: wait for that (once,
        bounded: extproc/negotiate.py), so the body is encoded in the dialect the backend speaks."""
        await dialects_known(state)

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict:
        route = variant_route(state)
        backend = backend_of(state)
        kw = {}
        if negotiates_kind(backend):
            dialect = state.attrs[DIALECT_ATTR] = dialect_of(state, backend)
            if route.response_schema is not None and dialect.structured == "prompt" \
                    and route.structured_fallback == "refuse":
                return refuse_structured(state, backend)
            kw["dialect"] = dialect
        try:
            encoded = backend.adapter.encode(route, state.input_doc, state.attrs.get("model_metadata"), **kw)
        except InputError as e:
            return reject(400, e.code, e.message, path=e.path)
        state.backend_request = encoded.body
        path = ((":path", encoded.path),) if encoded.path else ()  # "": the client's path as it is
        # a buffered body keeps an exact content-length (some upstreams refuse chunked requests)
        return Mutate(set_headers=(*path, ("content-type", encoded.content_type),
                                   ("content-length", str(len(encoded.body)))), body=encoded.body)

    async def on_response_body(self, state: RequestState, msg: HttpMessage) -> None:
        """The `prompt` dialect's one repair retry (extproc/negotiate.py `repair_answer`): an answer that
        is not the route's JSON is sent back to the same endpoint once, with the validation error;
        decode-response then reads the repaired answer."""
        await repair_answer(state, variant_route(state), msg.body)
