"""Filter `health-filter`: drops the endpoints known to be down; passes those nothing is known about.

What: an endpoint is known unhealthy when its last `failureThreshold` (default 3) metric scrapes
in a row failed (connection refused, timeout, non-200, unparsable: the worker's scraper,
`ctx.runtime.signals.consecutive_errors(e)`, reset by the next good scrape). Endpoints the scraper
does not track (engine without metrics, or no engine-signal profile) and endpoints with fewer
failures pass: no information is not bad news. The processor's own health probe
(`extproc/probe.py`) runs only on the operator's health route and keeps no per-endpoint state in
the runtime, so it is not consulted. When every candidate is down the profile refuses the request
(503 `no_capacity`, 429 for sheddable requests). Unlike `saturation-filter` an endpoint with an
old but once-good sample passes until the failures add up, so a slow scrape is not an outage.
GIE has no filter of this name: its datastore drops pods that are not Ready in Kubernetes.
Formula: keep e iff consecutive_failed_scrapes(e) < failureThreshold.
Parameters: `failureThreshold` (int >= 1, default 3).
Data consumed: scrape outcomes of the engine-metrics scraper. Cost: one dict lookup per candidate.
At the busy interval (0.2 s) a dead endpoint is dropped after about 3 x 0.2 s plus the timeouts;
at the idle one (2 s), about 6 s: the filter reacts at the speed of the scrapes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.signals import ENGINE_METRICS


class HealthFilterParameters(Parameters):
    failure_threshold: int = Field(default=3, alias="failureThreshold", ge=1)


class HealthFilter(Plugin):
    type: ClassVar[str] = "health-filter"
    slot: ClassVar[str] = "filter"
    consumes: ClassVar[tuple[str, ...]] = (ENGINE_METRICS,)
    Parameters: ClassVar[type] = HealthFilterParameters

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str]:
        failures = self.runtime.signals.consecutive_errors
        limit = self.params.failure_threshold
        return [e for e in candidates if failures(e) < limit]
