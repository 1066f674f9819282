"""Engine metrics scraper: each endpoint's `/metrics`, off the request path, with its age and an adaptive interval.

What: `MetricsScraper` runs one asyncio task per worker process that GETs each endpoint's metrics
URL with httpx (short timeout, body size cap), parses it into an `EngineSample`
(`extproc/datalayer/engine_metrics.py`) and keeps, per endpoint id ("ip:port"), the latest sample
and when it arrived (`scraped_at`, monotonic). API: `start(endpoints)` with
`{id: (url, engine)}` inside a running loop, `update(endpoints)` on a reload (endpoints still
present keep their sample; a changed URL or engine starts over), `await stop()`; readers:
`sample(id)`, `age(id)`, `saturated(id)`, `interval(id)`, `errors(id)`, `stats()`; `await
scrape(id)` scrapes one endpoint now. A failed scrape (connection, timeout, non-200, oversized or
unparsable body) keeps the previous sample, so its age grows, and counts an error.
Scrape interval, per endpoint (`next_interval`): `busy_interval` (0.2 s) while the last sample
had requests running or queued, or the gateway has requests in flight to it (the optional
`inflight(id)` callable, e.g. `Runtime.inflight.get`), else `idle_interval` (2 s). The loop
re-checks at least every `busy_interval`, so an idle endpoint that starts receiving traffic is
scraped within 0.2 s.
Saturation (`is_saturated`, the EPP's saturation-detector rule, per endpoint): saturated when
there is no sample, or it is older than `stale_after`, or `queue > queue_threshold` (5), or
`kv_usage > kv_threshold` (0.8). The EPP defaults (gateway-api-inference-extension
pkg/epp/saturationdetector: DefaultQueueDepthThreshold = DefaultQueueThresholdCritical = 5,
DefaultKVCacheUtilThreshold = 0.8, DefaultMetricsStalenessThreshold = 200 ms, "4x the default
TickInterval (50ms) to tolerate up to 3 missed scrapes") are kept except the staleness bound,
which follows the same ratio over our own interval: `stale_after` defaults to
`STALE_FACTOR` (4) x the interval in force at the endpoint's last scrape attempt (0.8 s busy,
8 s idle); a fixed 200 ms would call every idle endpoint stale. A field the engine does not
export (ONNX Runtime has no KV gauge) does not count against it.
Why: scoring and the saturation filter need queue and KV per endpoint without a network call per
request; an adaptive interval keeps idle fleets cheap and busy ones fresh; the age makes stale
data visible instead of silently trusted.
Cost: per scrape one HTTP GET (connection reused) and a parse of the needed series (about 0.5 ms
for a vLLM exposition, see engine_metrics); the loop wakes at most every `busy_interval`.
Readers are dict lookups and a clock read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping

import httpx

from .engine_metrics import EngineSample, MetricsParseError, normalise_engine, parse_metrics

log = logging.getLogger(__name__)

BUSY_INTERVAL_S = 0.2
IDLE_INTERVAL_S = 2.0
TIMEOUT_S = 0.5
MAX_BODY_BYTES = 8 << 20
QUEUE_THRESHOLD = 5  # EPP DefaultQueueDepthThreshold
KV_THRESHOLD = 0.8  # EPP DefaultKVCacheUtilThreshold
EPP_STALENESS_S = 0.2  # EPP DefaultMetricsStalenessThreshold, at its 50 ms refresh
STALE_FACTOR = 4.0  # the EPP's ratio of staleness bound to refresh interval

Endpoints = Mapping[str, tuple[str, str]]


# --- pure decisions ---------------------------------------------------------------------------------------

def next_interval(sample: EngineSample | None, inflight: int = 0, busy_interval: float = BUSY_INTERVAL_S,
                  idle_interval: float = IDLE_INTERVAL_S) -> float:
    """Seconds until the next scrape: busy when requests ran or queued at the last scrape, or are in flight now."""
    if inflight > 0 or (sample is not None and sample.busy):
        return busy_interval
    return idle_interval


def stale_bound(interval: float, factor: float = STALE_FACTOR) -> float:
    """The default staleness bound for an endpoint scraped every `interval` seconds."""
    return factor * interval


def sample_age(scraped_at: float | None, now: float) -> float:
    """Seconds since the sample arrived; infinite when there is none."""
    return math.inf if scraped_at is None else max(now - scraped_at, 0.0)


def is_saturated(sample: EngineSample | None, age: float, stale_after: float,
                 queue_threshold: float = QUEUE_THRESHOLD, kv_threshold: float = KV_THRESHOLD) -> bool:
    """The EPP rule: no sample, a stale one, a queue above the threshold or KV use above it."""
    if sample is None or age > stale_after:
        return True
    if sample.queue is not None and sample.queue > queue_threshold:
        return True
    return sample.kv_usage is not None and sample.kv_usage > kv_threshold


# --- state and the task ----------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True, eq=False)
class EndpointState:
    url: str
    engine: str
    sample: EngineSample | None = None
    scraped_at: float | None = None  # monotonic time the last good response arrived
    attempted_at: float = -math.inf  # monotonic time the last scrape started
    interval: float = IDLE_INTERVAL_S  # interval chosen at the last attempt (drives the default staleness bound)
    scrapes: int = 0
    errors: int = 0
    last_error: str | None = None
    task: asyncio.Task | None = None


class _ScrapeError(Exception):
    pass


class MetricsScraper:
    def __init__(self, *, busy_interval: float = BUSY_INTERVAL_S, idle_interval: float = IDLE_INTERVAL_S,
                 timeout: float = TIMEOUT_S, stale_factor: float = STALE_FACTOR,
                 queue_threshold: float = QUEUE_THRESHOLD, kv_threshold: float = KV_THRESHOLD,
                 inflight: Callable[[str], int] | None = None, clock: Callable[[], float] = time.monotonic,
                 max_body: int = MAX_BODY_BYTES):
        if not 0 < busy_interval <= idle_interval:
            raise ValueError("need 0 < busy_interval <= idle_interval")
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self.timeout = timeout
        self.stale_factor = stale_factor
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.max_body = max_body
        self._inflight = inflight
        self._clock = clock
        self._states: dict[str, EndpointState] = {}
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    # -- lifecycle --

    def start(self, endpoints: Endpoints) -> None:
        """Begin scraping `endpoints` ({id: (metrics URL, engine)}); call inside the worker's event loop."""
        if self._task is not None:
            raise RuntimeError("the scraper is already running")
        self.update(endpoints)
        self._client = httpx.AsyncClient(timeout=self.timeout, headers={"Accept": "text/plain"},
                                         limits=httpx.Limits(max_keepalive_connections=64), trust_env=False)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-scraper")

    def update(self, endpoints: Endpoints) -> None:
        """Replace the endpoint set; those with the same URL and engine keep their state and sample."""
        new: dict[str, EndpointState] = {}
        for endpoint, (url, engine) in endpoints.items():
            engine = normalise_engine(engine)
            old = self._states.get(endpoint)
            if old is not None and old.url == url and old.engine == engine:
                new[endpoint] = old
            else:
                new[endpoint] = EndpointState(url=url, engine=engine, interval=self.idle_interval)
        for endpoint, old in self._states.items():
            if new.get(endpoint) is not old and old.task is not None:
                old.task.cancel()
        self._states = new
        if self._wake is not None:
            self._wake.set()

    async def stop(self) -> None:
        task, self._task = self._task, None  # the loop ends at its next turn even if a cancel were lost
        if self._wake is not None:
            self._wake.set()
        scrapes = [st.task for st in self._states.values() if st.task is not None]
        for t in ([task] if task else []) + scrapes:
            t.cancel()
        for t in ([task] if task else []) + scrapes:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping: errors were counted already
                pass
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- readers --

    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._states)

    def sample(self, endpoint: str) -> EngineSample | None:
        st = self._states.get(endpoint)
        return None if st is None else st.sample

    def scraped_at(self, endpoint: str) -> float | None:
        st = self._states.get(endpoint)
        return None if st is None else st.scraped_at

    def age(self, endpoint: str, now: float | None = None) -> float:
        """Seconds since the endpoint's sample arrived (infinite without one)."""
        st = self._states.get(endpoint)
        return sample_age(None if st is None else st.scraped_at, self._clock() if now is None else now)

    def interval(self, endpoint: str) -> float | None:
        """The interval the next scrape of `endpoint` waits (busy or idle, from the sample and in-flight)."""
        st = self._states.get(endpoint)
        return None if st is None else next_interval(st.sample, self._inflight_of(endpoint),
                                                     self.busy_interval, self.idle_interval)

    def stale_after(self, endpoint: str) -> float:
        st = self._states.get(endpoint)
        return stale_bound(self.busy_interval if st is None else st.interval, self.stale_factor)

    def unsaturated(self, candidates: tuple[str, ...], queue_threshold: float, kv_threshold: float,
                    stale_after: float | None = None) -> list[str]:
        """The candidates `is_saturated` does not call saturated, in order, plus those not tracked (nothing
        is known of them); one clock read for all: saturation-filter's whole pass."""
        states = self._states
        now = self._clock()
        factor = self.stale_factor
        out = []
        for e in candidates:
            st = states.get(e)
            if st is None:
                out.append(e)
                continue
            sample, at = st.sample, st.scraped_at
            if sample is None or at is None:
                continue
            bound = factor * st.interval if stale_after is None else stale_after
            if now - at > bound:
                continue
            q, kv = sample.queue, sample.kv_usage
            if (q is not None and q > queue_threshold) or (kv is not None and kv > kv_threshold):
                continue
            out.append(e)
        return out

    def saturated(self, endpoint: str, stale_after: float | None = None, now: float | None = None) -> bool:
        """The EPP saturation rule for one endpoint; an unknown endpoint is saturated."""
        st = self._states.get(endpoint)
        if st is None:
            return True
        bound = self.stale_after(endpoint) if stale_after is None else stale_after
        return is_saturated(st.sample, sample_age(st.scraped_at, self._clock() if now is None else now), bound,
                            self.queue_threshold, self.kv_threshold)

    def errors(self, endpoint: str) -> int:
        st = self._states.get(endpoint)
        return 0 if st is None else st.errors

    def stats(self) -> dict[str, dict]:
        """Per endpoint: scrapes, errors, last error, age and interval (for metrics or a debug page)."""
        now = self._clock()
        return {ep: {"engine": st.engine, "scrapes": st.scrapes, "errors": st.errors, "last_error": st.last_error,
                     "age_s": sample_age(st.scraped_at, now), "interval_s": self.interval(ep)}
                for ep, st in self._states.items()}

    # -- scraping --

    def _inflight_of(self, endpoint: str) -> int:
        return self._inflight(endpoint) if self._inflight is not None else 0

    async def scrape(self, endpoint: str) -> bool:
        """Scrape one endpoint now; True when a new sample was stored."""
        st = self._states[endpoint]
        if self._client is None:
            raise RuntimeError("start() the scraper first")
        st.attempted_at = self._clock()
        try:
            body, arrived = await self._fetch(st.url)
            sample = parse_metrics(st.engine, body, st.sample)
        except (httpx.HTTPError, _ScrapeError, MetricsParseError, UnicodeDecodeError) as exc:
            self._failed(endpoint, st, f"{type(exc).__name__}: {exc}")
            return False
        if self._states.get(endpoint) is not st:
            return False  # removed or replaced by update() while in flight
        if st.errors and st.last_error is not None:
            log.info("metrics of %s scraped again after: %s", endpoint, st.last_error)
        st.sample, st.scraped_at, st.last_error = sample, arrived, None
        st.scrapes += 1
        st.interval = next_interval(sample, self._inflight_of(endpoint), self.busy_interval, self.idle_interval)
        return True

    def _failed(self, endpoint: str, st: EndpointState, reason: str) -> None:
        if st.last_error is None:
            log.warning("metrics scrape of %s (%s) failed: %s", endpoint, st.url, reason)
        st.errors += 1
        st.last_error = reason
        st.interval = next_interval(st.sample, self._inflight_of(endpoint), self.busy_interval, self.idle_interval)

    async def _fetch(self, url: str) -> tuple[str, float]:
        assert self._client is not None
        async with self._client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise _ScrapeError(f"HTTP {resp.status_code}")
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > self.max_body:
                    raise _ScrapeError(f"body over {self.max_body} bytes")
                chunks.append(chunk)
        arrived = self._clock()
        return b"".join(chunks).decode(resp.encoding or "utf-8"), arrived

    async def _scrape_task(self, endpoint: str, st: EndpointState) -> None:
        try:
            await self.scrape(endpoint)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in one scrape must not stop the loop
            self._failed(endpoint, st, f"{type(exc).__name__}: {exc}")
        finally:
            st.task = None
            if self._wake is not None:
                self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while self._task is not None:
            now = self._clock()
            wake = now + self.busy_interval  # in-flight requests can turn an idle endpoint busy: look again soon
            for endpoint, st in self._states.items():
                if st.task is not None:
                    continue
                due = st.attempted_at + next_interval(st.sample, self._inflight_of(endpoint),
                                                      self.busy_interval, self.idle_interval)
                if due <= now:
                    st.task = asyncio.create_task(self._scrape_task(endpoint, st), name=f"scrape {endpoint}")
                else:
                    wake = min(wake, due)
            self._wake.clear()
            # call_later + Event rather than asyncio.wait_for: on 3.11 wait_for can swallow a
            # cancel that lands as its timeout fires, and stop() would wait on a loop that goes on
            timer = loop.call_later(max(wake - self._clock(), 0.0), self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()


__all__ = ["BUSY_INTERVAL_S", "EPP_STALENESS_S", "EndpointState", "IDLE_INTERVAL_S", "KV_THRESHOLD",
           "MetricsScraper", "QUEUE_THRESHOLD", "STALE_FACTOR", "TIMEOUT_S", "is_saturated", "next_interval",
           "sample_age", "stale_bound"]
