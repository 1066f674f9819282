"""Picker `pinned-endpoint`: send every request of the route to one named endpoint (drain, debug, canary host).

What: names `endpoint` first and, unless `fallback: false`, the backend's other endpoints after it,
so Envoy still serves the request if the pinned endpoint is removed or unhealthy. On a route with
several targets, a request dispatched to a backend without that endpoint is not pinned (Envoy
balances it). An endpoint that is not one of the route's backends' is refused at config load (the check needs the backend, so it runs
when the route is compiled).
Parameters: `endpoint` ("ip:port", required), `fallback` (bool, default true).
Data consumed: none. Cost: one tuple build.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_validator

from extproc.scheduling import Parameters, Plugin


class PinnedEndpointParameters(Parameters):
    endpoint: str
    fallback: bool = True

    @field_validator("endpoint")
    @classmethod
    def _host_port(cls, v: str) -> str:
        from extproc.config.schema import split_host_port

        split_host_port(v)
        return v


class PinnedEndpoint(Plugin):
    type: ClassVar[str] = "pinned-endpoint"
    slot: ClassVar[str] = "picker"
    standalone: ClassVar[bool] = True  # orders endpoints itself: a route picker, not a profile's
    Parameters: ClassVar[type] = PinnedEndpointParameters

    def pick(self, state: Any, backend: Any, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        pinned = self.params.endpoint
        if pinned not in endpoints:  # the request went to another of the route's backends: Envoy balances
            return ()
        if not self.params.fallback:
            return (pinned,)
        return (pinned, *(e for e in endpoints if e != pinned))
