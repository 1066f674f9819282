"""Stage `body-limit`: 413 for a request body over the route's `policy.maxBodyBytes`.

What: at request headers, a declared `content-length` over the limit is refused before any body is
read. Routes that buffer the body (llm) also check its actual length in `parse-json` through
`check_length` (chunked uploads carry no content-length); this stage has no body hook, so a
passthrough route's body is never sent to the processor.
Why: Envoy's own 413 comes from the listener-wide buffer limit (the largest route limit), and Envoy
1.40 applies a route's buffer limit only after ext_proc has buffered the body, so per-route limits
are the processor's job. Passthrough bodies stream, so only their declared length is checked.
Cost: one header lookup; one len().
"""

from __future__ import annotations

from extproc.errors import reject
from extproc.types import HttpMessage, RequestState, Verdict


class BodyLimit:
    name = "body-limit"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        declared = (msg.headers or {}).get("content-length")
        if declared and declared.isascii() and declared.isdigit():  # "²".isdigit() but int("²") fails
            return check_length(state, int(declared))
        return None


def check_length(state: RequestState, size: int) -> Verdict | None:
    """413 naming the size and the route's limit, or None when `size` fits."""
    limit = state.route.max_body_bytes
    if size <= limit:
        return None
    return reject(413, "body_too_large", f"request body is {size} bytes; route {state.route.name} accepts at most {limit}",
                  limit=limit)
