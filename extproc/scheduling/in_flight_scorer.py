"""Scorer `in-flight-scorer`: fewer requests in flight gateway-wide scores higher.

What: reads each candidate's in-flight count summed over every worker (`extproc/datalayer/inflight.py`:
incremented when dispatch names the endpoint, released by the request's `on_done`) and scores it
against the busiest candidate, so the idlest endpoint scores 1 and the busiest 0. It counts what
this gateway sent, not what the engine queues (the engine-metrics scorers add that), so it reacts
within the same request and needs no scrape. Bounded (`bounded = True`): the framework only clamps.
Formula: score(e) = 1 - inflight(e) / max over candidates of inflight; every candidate 1.0 when
none has a request in flight (so equal loads tie, and the picker breaks the tie).
Parameters: none.
Data consumed: in-flight counters. Cost: one `InflightTable.counts` over the candidates (about 0.3 us
per candidate and worker: shared-memory reads).
"""

from __future__ import annotations

from typing import Any, ClassVar

from extproc.scheduling import Parameters, Plugin


class InFlightScorerParameters(Parameters):
    pass


class InFlightScorer(Plugin):
    type: ClassVar[str] = "in-flight-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    Parameters: ClassVar[type] = InFlightScorerParameters

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        counts = self.runtime.inflight.counts(candidates)
        busiest = max(counts.values(), default=0)
        if busiest <= 0:
            return dict.fromkeys(candidates, 1.0)
        return {e: 1.0 - n / busiest for e, n in counts.items()}
