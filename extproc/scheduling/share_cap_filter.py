"""Filter `share-cap-filter`: no endpoint takes much more than its capacity-weighted share of recent requests.

What: a balance guard for profiles whose scorers concentrate traffic (prefix affinity, predicted
TTFT: both prefer the fast warm nodes, and at low load nothing else pulls requests away from
them). It remembers this worker's last `window` picks per backend (the profile tells it each pick:
`picked(ctx, endpoint)`) and drops a candidate whose share of those picks is above `maxShareRatio`
times its share of the candidates' capacity, read from the `capacityLabel` label (an endpoint
without a positive number there counts 1). Shares are taken over the candidates this filter sees,
so endpoints that earlier filters removed (unhealthy, saturated) neither count nor make room. It
never refuses a request: when every candidate is over its cap it keeps the one(s) least over
(lowest share / capacity share). Before `minPicks` picks of the backend it keeps everyone.
The SGLang cache-aware router has the same kind of guard (its balance thresholds switch from cache
affinity to shortest queue when loads diverge); this one bounds the measured quantity itself, the
share of requests, which is what an operator sizing a fleet by capacity reads.
Formula, over the candidates C, with n(e) = e's picks among the backend's last `window` picks:
  cap(e)   = positive label capacityLabel of e, else 1
  share(e) = n(e) / sum_{c in C} n(c)            fair(e) = cap(e) / sum_{c in C} cap(c)
  keep e iff sum_{c in C} n(c) < minPicks or share(e) <= maxShareRatio * fair(e)
  nothing kept: keep argmin_e share(e) / fair(e) (ties: all of them)
Parameters: `maxShareRatio` (default 1.5, > 1), `window` (picks remembered per backend, default
256), `minPicks` (default 32), `capacityLabel` (default `speed`).
Per worker: each worker bounds its own picks; with requests spread evenly over workers (Envoy's
least request over them) the gateway-wide shares are bounded the same way.
Data consumed: the endpoints' labels, this filter's own pick history. Cost: a dict lookup per
candidate (capacities cached per labels object and candidate set); a deque append and two dict
updates per pick; about 2 us for 8 candidates.
"""

from __future__ import annotations

from collections import deque
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.selectors import PerCandidates, positive_label


class ShareCapFilterParameters(Parameters):
    max_share_ratio: float = Field(default=1.5, alias="maxShareRatio", gt=1.0, allow_inf_nan=False)
    window: int = Field(default=256, ge=1)
    min_picks: int = Field(default=32, alias="minPicks", ge=0)
    capacity_label: str = Field(default="speed", alias="capacityLabel", min_length=1)


class _History:
    """One backend's last `window` picks, with each endpoint's count among them."""

    __slots__ = ("picks", "counts")

    def __init__(self) -> None:
        self.picks: deque[str] = deque()
        self.counts: dict[str, int] = {}

    def add(self, endpoint: str, window: int) -> None:
        self.picks.append(endpoint)
        self.counts[endpoint] = self.counts.get(endpoint, 0) + 1
        self.trim(window)

    def trim(self, window: int) -> None:
        picks, counts = self.picks, self.counts
        while len(picks) > window:
            old = picks.popleft()
            n = counts[old] - 1
            if n:
                counts[old] = n
            else:
                del counts[old]


class ShareCapFilter(Plugin):
    type: ClassVar[str] = "share-cap-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = ShareCapFilterParameters

    def __init__(self, name: str, params: ShareCapFilterParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self.history: dict[str, _History] = {}  # backend name -> its recent picks
        self._caps = PerCandidates()  # candidate tuple -> (capacities, their sum)

    def configure(self, old: ShareCapFilterParameters, new: ShareCapFilterParameters) -> None:
        self.params = new
        self._caps.clear()
        for h in self.history.values():  # a smaller window forgets the oldest picks; the rest stays
            h.trim(new.window)

    def capacities(self, labels: Any, candidates: tuple[str, ...]) -> tuple[list[float], float]:
        """Each candidate's capacity and their sum (kept per candidate tuple and labels object)."""
        return self._caps.get(labels, candidates, self._capacities)

    def _capacities(self, labels: Any, candidates: tuple[str, ...]) -> tuple[list[float], float]:
        label = self.params.capacity_label
        caps = [positive_label(labels, e, label) or 1.0 for e in candidates]
        return caps, sum(caps)

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> tuple[str, ...]:
        h = self.history.get(ctx.backend.name)
        if h is None or len(candidates) < 2:
            return candidates
        p = self.params
        get = h.counts.get
        n = [get(e, 0) for e in candidates]
        total = sum(n)
        if total < p.min_picks or total == 0:
            return candidates
        caps, cap_total = self.capacities(ctx.labels, candidates)
        # share(e) <= r * fair(e)  <=>  n(e) <= (r * total / cap_total) * cap(e)  (no division per candidate)
        limit = p.max_share_ratio * total / cap_total
        kept = tuple(e for e, k, c in zip(candidates, n, caps) if k <= limit * c)
        if kept:
            return kept
        over = [k / c for k, c in zip(n, caps)]
        least = min(over)
        return tuple(e for e, o in zip(candidates, over) if o == least)

    def picked(self, ctx: Any, endpoint: str) -> None:
        name = ctx.backend.name
        h = self.history.get(name)
        if h is None:
            h = self.history[name] = _History()
        h.add(endpoint, self.params.window)
