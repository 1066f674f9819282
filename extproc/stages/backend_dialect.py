"""Stage `backend-dialect`: the chat request a client-API route built, in the chosen backend's dialect.

What: on `anthropic-messages` and `openai-responses` routes the chat request is built by the
translation (`extproc/stages/client_api.py`) before `dispatch`; after dispatch this stage rewrites it
for the backend dispatch chose, in the dialect `extproc/negotiate.py` learned or the config fixed
(`backends/dialects.translate`): a `response_format: json_schema` (Responses `text.format`) as that
server takes structured output, or the schema in a system message for the `prompt` dialect (a
route with `policy.structuredFallback: refuse` answers 501 instead); `stream_options` dropped for a
server that refuses them (usage is then estimated by `client-api`, as it is for a server that sends
none). At request headers it waits, bounded (`negotiate.REQUEST_WAIT`), for the first negotiation of
the route's targets, as `openai` routes do.
Cost: nothing when the dialect needs no change; else one JSON encode of the body.
"""

from __future__ import annotations

from typing import Callable

import orjson

from backends.dialects import client_schema, translate
from extproc.negotiate import DIALECT_ATTR, dialect_of, dialects_known, negotiates_kind, refuse_structured
from extproc.stages.dispatch import backend_of
from extproc.types import HttpMessage, Mutate, RequestState, Verdict


def in_dialect(state: RequestState,
               drop_stream_options: Callable[[RequestState, dict], bool]) -> bytes | Verdict | None:
    """After dispatch: the client's chat body (`state.request.body`, rewritten in place) in the dialect of the
    backend dispatch chose (recorded in `state.attrs[DIALECT_ATTR]`), encoded; None when it needs no change
    or is no chat body for an OpenAI-compatible backend; the 501 of `refuse_structured` for a `prompt`
    dialect on a route with `structuredFallback: refuse`. For a server that refuses `stream_options`,
    `drop_stream_options(state, body)` removes what it must and says whether the body changed."""
    backend = backend_of(state)
    req = state.request
    if req is None or req.body is None or not negotiates_kind(backend):
        return None
    dialect = state.attrs[DIALECT_ATTR] = dialect_of(state, backend)
    body = req.body
    if dialect.structured == "prompt" and client_schema(body) is not None \
            and state.route.structured_fallback == "refuse":
        return refuse_structured(state, backend)
    changed = translate(body, dialect)
    if dialect.stream_usage == "refused" and drop_stream_options(state, body):
        changed = True
    return orjson.dumps(body) if changed else None


def _drop_clients_stream_options(state: RequestState, body: dict) -> bool:
    """The `stream_options` the translation put in the chat body (to count usage), removed."""
    if "stream_options" not in body:
        return False
    del body["stream_options"]
    return True


class BackendDialect:
    name = "backend-dialect"

    async def on_request_headers(self, state: RequestState, msg: HttpMessage) -> None:
        await dialects_known(state)

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        data = in_dialect(state, _drop_clients_stream_options)
        if not isinstance(data, bytes):
            return data
        state.backend_request = data
        return Mutate(set_headers=(("content-length", str(len(data))),), body=data)


__all__ = ["BackendDialect", "in_dialect"]
