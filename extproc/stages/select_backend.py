"""Stage `select-backend`: pick the backend for a passthrough route and route to it.

Today a route has one backend, so the pick is the route's target; the scheduling work (filters,
scorers, picker over endpoint metrics) replaces this stage without touching the others.
Cost: one header mutation in the request-headers reply.
"""

from __future__ import annotations

from extproc.config.snapshot import BACKEND_HEADER, ROUTE_TARGET_HEADER
from extproc.types import HttpMessage, Mutate, RequestState, Verdict


class SelectBackend:
    name = "select-backend"

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict:
        backend = state.route.backend
        state.backend = backend.name
        return Mutate(set_headers=((BACKEND_HEADER, backend.name), (ROUTE_TARGET_HEADER, state.route.name)),
                      clear_route_cache=True)
