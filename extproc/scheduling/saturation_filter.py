"""Filter `saturation-filter`: drops the endpoints the engine metrics call saturated (the EPP saturation rule).

What: keeps a candidate unless its engine is saturated by the Gateway API Inference Extension's
saturation-detector rule (pkg/epp/saturationdetector: a pod is saturated when its metrics are
missing or older than the staleness threshold, or its waiting queue is above
`QueueDepthThreshold` (5), or its KV-cache use is above `KVCacheUtilThreshold` (0.8)), evaluated on
the worker's scraper (`ctx.runtime.signals`, `extproc/datalayer/scraper.is_saturated`). Stale
counts as saturated: a scrape that stopped answering does not keep attracting traffic on old
numbers. The staleness bound defaults to the scraper's, 4x the endpoint's scrape interval (0.8 s
busy, 8 s idle: the EPP's 200 ms over its 50 ms refresh, at our intervals). When every candidate
is saturated the profile refuses the request as the endpoint-picker protocol says
(`profile.py` `NoCapacity`): 429 `overloaded` with Retry-After for a sheddable request
(priority < 0), else 503 `no_capacity`. In GIE the same rule gates admission (the flow
controller), not a filter; here it is a filter so a profile can place it among its others.
An endpoint the scraper does not track (its engine exports no metrics we read: `openai`, or a
backend not behind an engine-signal profile) passes: nothing is known of it.
Formula: keep e iff not tracked(e) or not (sample(e) is None or age(e) > staleAfter(e) or
queue(e) > queueDepthThreshold or kv_usage(e) > kvCacheUtilThreshold); a field the engine does not
export does not count.
Parameters: `queueDepthThreshold` (default 5), `kvCacheUtilThreshold` (0.8, in [0, 1]),
`metricsStalenessThreshold` (seconds; default: the scraper's 4 x interval).
Data consumed: engine metrics (queue, KV, age). Cost: one clock read, then a dict lookup and a few
comparisons per candidate (`MetricsScraper.unsaturated`: the rule of `is_saturated`, in one pass).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.datalayer.scraper import KV_THRESHOLD, QUEUE_THRESHOLD
from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.signals import ENGINE_METRICS


class SaturationFilterParameters(Parameters):
    queue_depth_threshold: float = Field(default=QUEUE_THRESHOLD, alias="queueDepthThreshold", ge=0)
    kv_cache_util_threshold: float = Field(default=KV_THRESHOLD, alias="kvCacheUtilThreshold", ge=0, le=1)
    metrics_staleness_threshold: float | None = Field(default=None, alias="metricsStalenessThreshold", gt=0)


class SaturationFilter(Plugin):
    type: ClassVar[str] = "saturation-filter"
    slot: ClassVar[str] = "filter"
    consumes: ClassVar[tuple[str, ...]] = (ENGINE_METRICS,)
    Parameters: ClassVar[type] = SaturationFilterParameters

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str]:
        p = self.params
        return self.runtime.signals.unsaturated(candidates, p.queue_depth_threshold, p.kv_cache_util_threshold,
                                                p.metrics_staleness_threshold)
