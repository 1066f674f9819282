"""Stage `select-backend`: pick the backend for a passthrough route and route to it.

Today a route has one backend, so the pick is the route's target; the scheduling work (filters,
scorers, picker over endpoint metrics) replaces this stage without touching the others.
`route_to` is how every stage sends a request to a backend: the two headers Envoy's generated
route entries match, plus `clear_route_cache` so Envoy re-matches.
Cost: one header mutation in the request-headers reply.
"""

from __future__ import annotations

from typing import Any

from extproc.config.snapshot import BACKEND_HEADER, ROUTE_TARGET_HEADER
from extproc.types import HttpMessage, Mutate, RequestState, Verdict


def route_to(state: RequestState, backend: Any, *extra: tuple[str, str], body: bytes | None = None) -> Mutate:
    """Send this request to `backend` (recorded in `state.backend`), with `extra` headers and `body`."""
    state.backend = backend.name
    return Mutate(set_headers=(*extra, (BACKEND_HEADER, backend.name), (ROUTE_TARGET_HEADER, state.route.name)),
                  body=body, clear_route_cache=True)


class SelectBackend:
    name = "select-backend"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict:
        return route_to(state, state.route.backend)
