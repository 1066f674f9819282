"""Picker `least-in-flight`: the endpoint with the fewest requests in flight gateway-wide, then the rest.

What: orders the chosen backend's endpoints by their in-flight count summed over every worker
(`extproc/datalayer/inflight.py`: incremented at dispatch, released by `on_done`), ties broken by
rotating from a per-worker counter so equal endpoints share the load; the first is the pick, the
others are the fallbacks Envoy tries if the pick is gone.
Formula: pick = argmin_e inflight(e); order = sort by (inflight(e), (index(e) - rr) mod n).
Parameters: `fallbacks` (int, default 2): how many fallbacks to name after the pick.
Data consumed: in-flight counters. Cost: about 2 us per endpoint per worker (shared-memory reads).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin


class LeastInFlightParameters(Parameters):
    fallbacks: int = Field(default=2, ge=0, le=16)


class LeastInFlight(Plugin):
    type: ClassVar[str] = "least-in-flight"
    slot: ClassVar[str] = "picker"
    standalone: ClassVar[bool] = True  # orders endpoints itself: a route picker, not a profile's
    Parameters: ClassVar[type] = LeastInFlightParameters

    def __init__(self, name: str, params: LeastInFlightParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self._rr = 0  # still valid after a reload: Plugin.configure only takes the new parameters

    def pick(self, state: Any, backend: Any, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        if not endpoints:
            return ()
        n = len(endpoints)
        self._rr = (self._rr + 1) % n
        inflight = self.runtime.inflight
        order = sorted(range(n), key=lambda i: (inflight.get(endpoints[i]), (i - self._rr) % n))
        return tuple(endpoints[i] for i in order[: 1 + self.params.fallbacks])
