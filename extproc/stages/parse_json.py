"""Stage `parse-json`: the buffered request body -> `state.input_doc` and `state.request`, or 400.

What: the client's JSON document becomes `state.input_doc` (what templates read) and the typed
`state.request` (`extproc/request.py`: the route's model; what dispatch reads).
Why: every llm, tensor and rest route reads the client's JSON; parsing once here keeps later stages simple.
Cost: one orjson parse of the body (about 1 us per 100 bytes). A body over the route's limit is a
413 before parsing (bodies over the listener-wide limit never get here: Envoy answers 413).
"""

from __future__ import annotations

from extproc.request import parse_document, parse_json_body
from extproc.stages.body_limit import check_length
from extproc.types import HttpMessage, Reject, RequestState, Verdict


class ParseJson:
    name = "parse-json"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        too_large = check_length(state, len(msg.body))
        if too_large is not None:
            return too_large
        doc = parse_json_body(msg.body)
        if isinstance(doc, Reject):
            return doc
        state.input_doc = doc
        state.request = parse_document(doc, state.route.model, state.tenant)
        return None
