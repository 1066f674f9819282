"""Stage `parse-json`: the buffered request body -> `state.input_doc`, or 400 with the parse error.

Why: every llm route reads the client's JSON; parsing once here keeps later stages simple.
Cost: one orjson parse of the body (about 1 us per 100 bytes). A body over the route's limit is a
413 before parsing (bodies over the listener-wide limit never get here: Envoy answers 413).
"""

from __future__ import annotations

import orjson

from extproc.pipeline import reject
from extproc.stages.body_limit import check_length
from extproc.types import HttpMessage, RequestState, Verdict


class ParseJson:
    name = "parse-json"

    def on_request_body(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        body = msg.body
        too_large = check_length(state, len(body))
        if too_large is not None:
            return too_large
        if not body.strip():
            return reject(400, "empty_body", "request body is empty; this route expects a JSON document",
                          route=state.route.name, request_id=state.request_id)
        try:
            state.input_doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            return reject(400, "malformed_json", f"request body is not valid JSON: {e}",
                          route=state.route.name, request_id=state.request_id)
        return None
