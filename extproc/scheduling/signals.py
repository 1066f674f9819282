"""Engine signals for the scheduling plugins: the worker's one `MetricsScraper`, plus consecutive scrape failures.

What: `EngineSignals` is `extproc/datalayer/scraper.MetricsScraper` (each endpoint's engine
metrics, scraped off the request path with an adaptive interval; `sample(id)`, `age(id)`,
`saturated(id)`, `stale_after(id)`, `errors(id)`, `endpoints()`) with two additions the filters
need: `consecutive_errors(id)` (failed scrapes since the last good one; reset by a good one or
when the endpoint's URL or engine changes) and `tracked(id)` (whether the endpoint is scraped at
all: an endpoint whose engine exports no metrics is not, and filters treat it as "no
information", not as saturated). The `Runtime` owns one instance per worker for the worker's
lifetime (`runtime.signals`); plugins read it as `ctx.runtime.signals`.
Which endpoints: `scrape_targets(snapshot)` = every endpoint of the backends of routes whose
scheduler (profile) uses a plugin class with `"engine_metrics"` in its `consumes`, whose engine
is one the scraper can parse (vllm, sglang, triton, onnxruntime, llamacpp; `openai` is a
generic OpenAI server with no known metrics and is skipped), at `http://ip:port<metricsPath>`.
A config with no such plugin scrapes nothing.
Why: one scraper per worker shared by every plugin and profile (N plugins reading queue and KV
cost no more scrapes than one); it outlives reloads, so endpoints that stay keep their samples.
Staleness: per worker, each worker scrapes on its own (N workers = N scrapes per interval per
endpoint); a sample is at most `interval` old plus the scrape's own latency, and older ones are
treated as saturated by the saturation rule.
Cost: readers are dict lookups and a clock read; scraping cost is the scraper's.
"""

from __future__ import annotations

from typing import Any, Mapping

from extproc.datalayer.engine_metrics import MetricsParseError, normalise_engine
from extproc.datalayer.scraper import MetricsScraper

ENGINE_METRICS = "engine_metrics"  # what a plugin class lists in `consumes` to have its endpoints scraped


class EngineSignals(MetricsScraper):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._consecutive: dict[str, int] = {}

    def update(self, endpoints: Mapping[str, tuple[str, str]]) -> None:
        before = {ep: (st.url, st.engine) for ep, st in self._states.items()}
        super().update(endpoints)
        for ep in list(self._consecutive):
            st = self._states.get(ep)
            if st is None or before.get(ep) != (st.url, st.engine):
                del self._consecutive[ep]

    async def scrape(self, endpoint: str) -> bool:
        ok = await super().scrape(endpoint)
        if ok:
            self._consecutive.pop(endpoint, None)
        return ok

    def _failed(self, endpoint: str, st: Any, reason: str) -> None:  # every failure path of the scraper
        super()._failed(endpoint, st, reason)
        if self._states.get(endpoint) is st:
            self._consecutive[endpoint] = self._consecutive.get(endpoint, 0) + 1

    def consecutive_errors(self, endpoint: str) -> int:
        return self._consecutive.get(endpoint, 0)

    def tracked(self, endpoint: str) -> bool:
        return endpoint in self._states


def consumes_engine_metrics(plugin_type: str) -> bool:
    from extproc.scheduling import plugin_types

    return ENGINE_METRICS in getattr(plugin_types().get(plugin_type), "consumes", ())


def scrape_targets(snapshot: Any) -> dict[str, tuple[str, str]]:
    """{endpoint id: (metrics URL, engine)} for the endpoints some engine-signal plugin decides over."""
    out: dict[str, tuple[str, str]] = {}
    for route in getattr(snapshot, "routes", {}).values():
        sched = getattr(route, "picker", None)
        refs = getattr(sched, "refs", None)
        if not refs or not any(consumes_engine_metrics(r.type) for r in refs):
            continue
        for backend in route.backends:
            for ep in backend.endpoint_ids:
                engine = backend.endpoint_engines.get(ep)
                if not engine:
                    continue
                try:
                    engine = normalise_engine(engine)
                except MetricsParseError:  # e.g. `openai`: no metric names we know
                    continue
                out[ep] = (f"http://{ep}{backend.endpoint_metrics_paths.get(ep, '/metrics')}", engine)
    return out


__all__ = ["ENGINE_METRICS", "EngineSignals", "consumes_engine_metrics", "scrape_targets"]
