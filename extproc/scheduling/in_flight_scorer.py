"""Scorer `in-flight-scorer`: fewer requests in flight gateway-wide scores higher.

What: reads each candidate's in-flight count summed over every worker (`extproc/datalayer/inflight.py`:
incremented when dispatch names the endpoint, released by the request's `on_done`). It counts what
this gateway sent, not what the engine queues (the engine-metrics scorers add that), so it reacts
within the same request and needs no scrape. Two scales:
- relative (default, no capacity given): against the busiest candidate, so the idlest endpoint
  scores 1 and the busiest 0, however few requests that is;
- absolute (`capacity`, or per endpoint the label named by `capacityLabel`): against what the
  endpoint runs at once (vLLM's `--max-num-seqs`), so an endpoint with free slots keeps most of its
  score. The relative scale gives the busiest candidate 0 even at 2 requests of 8 slots, which, with
  prefix affinity, sends a request from its prefix's warm node to a cold one (a full prefill) only
  because the warm node is the busiest; perf/bench_routing.py measured that as the shared-prefix p99.
Bounded (`bounded = True`): the framework only clamps.
Formula: relative: score(e) = 1 - inflight(e) / max over candidates of inflight (every candidate 1.0
when none has a request in flight, so equal loads tie and the picker breaks the tie); absolute:
score(e) = max(0, 1 - inflight(e) / capacity(e)), capacity(e) = the endpoint's `capacityLabel`
label when it is a positive finite number, else `capacity`; an endpoint with neither is scored relative
to the busiest.
Parameters: `capacity` (int >= 1, default none), `capacityLabel` (label name, default none).
Data consumed: in-flight counters, the endpoints' labels. Cost: one `InflightTable.counts` over the
candidates per decision (about 0.3 us per candidate and worker: shared-memory reads), shared with
the profile's other plugins (`scheduling.inflight_counts`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin, inflight_counts
from extproc.scheduling.selectors import PerCandidates, positive_label


class InFlightScorerParameters(Parameters):
    capacity: int | None = Field(default=None, ge=1)
    capacity_label: str | None = Field(default=None, alias="capacityLabel", min_length=1)


class InFlightScorer(Plugin):
    type: ClassVar[str] = "in-flight-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    Parameters: ClassVar[type] = InFlightScorerParameters

    def __init__(self, name: str, params: Any, runtime: Any):
        super().__init__(name, params, runtime)
        self._caps = PerCandidates()  # candidate tuple -> each one's capacity (None: relative)

    def configure(self, old: Any, new: Any) -> None:
        super().configure(old, new)
        self._caps.clear()

    def _capacities(self, labels: Any, candidates: tuple[str, ...]) -> list[float | None]:
        p = self.params
        out = []
        for e in candidates:
            cap = positive_label(labels, e, p.capacity_label)
            out.append(p.capacity if cap is None else cap)
        return out

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        counts = inflight_counts(ctx, self.runtime, candidates)
        p = self.params
        if p.capacity is None and p.capacity_label is None:
            return self._relative(counts, candidates)
        out: dict[str, float] = {}
        rest = []
        for e, cap in zip(candidates, self._caps.get(ctx.labels, candidates, self._capacities)):
            if cap is None:
                rest.append(e)
            else:
                v = 1.0 - counts[e] / cap
                out[e] = v if v > 0.0 else 0.0
        if rest:
            out.update(self._relative(counts, tuple(rest)))
        return out

    @staticmethod
    def _relative(counts: dict[str, int], candidates: tuple[str, ...]) -> dict[str, float]:
        busiest = max((counts[e] for e in candidates), default=0)
        if busiest <= 0:
            return dict.fromkeys(candidates, 1.0)
        return {e: 1.0 - counts[e] / busiest for e in candidates}
