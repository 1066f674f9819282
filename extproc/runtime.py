"""The per-worker runtime: state that outlives config snapshots.

What: one `Runtime` per worker process holds what must survive a config swap: the request
`Lifecycle` (requests in flight and their exactly-once end), the gateway-wide in-flight table
(`extproc/datalayer/inflight.py`), the plugin instances of `spec.plugins` (built once; on a
reload `install(snapshot)` calls `configure(old_params, new_params)` on each one still declared
with the same type, builds new ones and drops removed ones), the scheduling profiles
(`extproc/scheduling/profile.py`, one per profile name, rebound to the kept plugin instances by
`configure(old_ref, new_ref)` on every install), named caches for stages (model metadata, the
tenant snapshot reader), the metrics sink the framework times plugins into (`metrics_sink`:
the service's `RequestObserver`, buffered) and the worker's start time. Stages reach it as
`state.runtime`; stage objects themselves are rebuilt with every snapshot and keep no state.

| state | lives in | for how long | shared across workers |
|---|---|---|---|
| config snapshot (routes, pipelines, compiled templates) | `ConfigRef` (current + recent by digest) | until replaced (kept a few generations for Envoy's older routes) | same bundle, loaded by each |
| per-request state | `RequestState` | one request | no |
| open requests, deadlines | `Runtime.lifecycle` | until `on_done` | no (Envoy's access log comes back to the owning worker) |
| in-flight per endpoint | `Runtime.inflight` (mmap file per worker) | worker lifetime | yes: readers sum every worker's slots |
| canary feed (finished requests of rollouts) | `Runtime.canary_feed` (`canary/feed.py`, a ring file per worker) | worker lifetime | yes: the supervisor's controller tails every worker's file |
| plugin instances (filters, scorers, pickers) | `Runtime._plugins` | worker lifetime, reconfigured on reload | no |
| scheduling profiles | `Runtime._profiles` | worker lifetime, rebound on reload | no |
| caches (model metadata, tenant snapshot reader) | `Runtime.cache(name)` | worker lifetime | no |
| engine metrics per endpoint (queue, KV, LoRA; age) | `Runtime.signals` (`extproc/scheduling/signals.py`, a `MetricsScraper`) | worker lifetime; endpoints re-chosen on every install | no: each worker scrapes on its own |
| concurrency limits and gateway queues per backend pool (`spec.qos.admission`) | `Runtime.admission` (`extproc/qos/queue.py`; slots in `<state_dir>/admission/`) | worker lifetime; pools still listed keep limit, queue and slots across reloads | the in-flight count yes (every worker's slot file summed); limit and queue per worker |
| tracer provider (`spec.tracing`: OTLP export thread) | `Runtime.tracing` (`extproc/tracing.py`; None when off) | while the spec is unchanged; replaced or dropped by an install | no: each worker exports its own spans |
| GenAI meter provider (`spec.otlpMetrics`: OTLP export thread) | `Runtime.genai_otlp` (`extproc/genai_otlp.py`; None when off) | while the spec is unchanged; replaced or dropped by an install | no: each worker exports its own metrics |
| MQTT connections of iot routes (paho's network thread each) | `Runtime.mqtt` (`extproc/iot/client.py`) | while the broker's config is unchanged; made on first use | no: one connection per worker and broker |

Engine signals: `signals` is the worker's one scraper. `install` sets its endpoints to
`scrape_targets(snapshot)` (the endpoints of routes whose profile uses a plugin that consumes
`engine_metrics`; none for other configs); `start_signals()` starts it inside the worker's running
loop (`extproc/server.serve`, next to the sweeper; its `inflight` reader is this runtime's
gateway-wide table, so an endpoint with requests in flight is scraped at the busy interval) and
`await stop_signals()` stops it on shutdown. An install after the start updates the running
scraper (kept endpoints keep their samples); one before it only records the endpoints.
Why: a prefix index, EWMA latencies, SLO windows or concurrency limits rebuilt on every config
push would be wiped by it, and requests in flight across a reload would release their counters
into orphaned objects (mitmproxy's addons keep their state across `configure`).
Cost: nothing per request beyond what the lifecycle and in-flight table say; `install` runs per reload.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable

from canary.feed import FeedObserver, FeedWriter
from extproc.config.snapshot import ProfileRef
from extproc.datalayer.inflight import InflightTable
from extproc.genai_otlp import configure as configure_genai_otlp
from extproc.iot.client import MqttClients
from extproc.lifecycle import Lifecycle
from extproc.qos.engine import QosRuntime, qos_of
from extproc.qos.queue import Admission, admission_of
from extproc.requestlog import RequestLog
from extproc.scheduling.signals import EngineSignals, scrape_targets
from extproc.stages.dispatch import release
from extproc.tracing import configure as configure_tracing

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, worker: int = 0, state_dir: str | None = None, feedback: bool = False,
                 observers: Iterable[Callable] = ()):
        self.worker = worker
        self.started = time.time()
        self.inflight = InflightTable(state_dir, worker)
        # canary/feed.py: under a supervisor (a state dir), each finished request of a rollout becomes a
        # record its canary controller reads; without one nobody would read it: no observer
        self.canary_feed = FeedWriter(state_dir, worker)
        feed = [FeedObserver(self.canary_feed)] if state_dir else []
        # extproc/requestlog.py: one record per finished request while `adapterctl logs -f` follows
        self.request_log = RequestLog(state_dir, worker) if state_dir else None
        if self.request_log is not None:
            feed.append(self.request_log)
        self.lifecycle = Lifecycle(worker, feedback=feedback, observers=[release, *observers, *feed])  # tokens carry the pid
        self._plugins: dict[tuple[str, str], Any] = {}
        self._params: dict[tuple[str, str], Any] = {}
        self._profiles: dict[str, Any] = {}  # name -> extproc.scheduling.profile.SchedulingProfile
        self.metrics_sink: Any = None  # extproc.stream.RequestObserver (.metrics, .pending, .child), set by the service
        self._caches: dict[str, Any] = {}
        self.installed: Any = None  # the snapshot installed last
        self.signals = EngineSignals(inflight=self.inflight.get)  # engine metrics per endpoint (scraped)
        self.scrape_targets: dict[str, tuple[str, str]] = {}  # what install chose for `signals`
        self._signals_started = False
        # extproc/qos/engine.py: SLO windows, the priority matrix and glitch breakers (spec.qos; idle without it)
        self.qos = QosRuntime(worker, state_dir)
        # extproc/qos/queue.py: per backend pool, the adaptive concurrency limit and the gateway queue
        # (spec.qos.admission; no pool, no state); slots counted gateway-wide in <state_dir>/admission/
        self.admission = Admission(worker, state_dir)
        # extproc/tracing.py: the worker's tracer provider for the installed snapshot's spec.tracing;
        # None when tracing is off (streams check it once: no span, no OpenTelemetry import)
        self.tracing: Any = None
        # extproc/genai_otlp.py: the worker's meter provider for spec.otlpMetrics (the GenAI metrics over
        # OTLP, recorded by extproc/genai.py); None when off (one check per finished request)
        self.genai_otlp: Any = None
        # extproc/iot/client.py: this worker's MQTT connections (iot routes), kept while a broker's config
        # is unchanged, so a reload that changes only templates keeps the connection
        self.mqtt = MqttClients()

    def cache(self, name: str) -> dict:
        """A dict that lives as long as the worker (stages keep what a reload must not lose here)."""
        c = self._caches.get(name)
        if c is None:
            c = self._caches[name] = {}
        return c

    def install(self, snapshot: Any) -> None:
        """Reconcile plugin instances with `snapshot.plugins` and the plugins its profiles use
        (configure kept ones, drop removed ones), then the profiles (rebind kept ones, build new
        ones, drop removed ones)."""
        profiles = getattr(snapshot, "profiles", {})
        wanted = {(ref.name, ref.type): ref for ref in snapshot.plugins.values()}
        for prof in profiles.values():
            for ref in prof.refs:  # a profile's default picker is not in spec.plugins
                wanted.setdefault((ref.name, ref.type), ref)
        for key in list(self._plugins):
            if key not in wanted:
                inst = self._plugins.pop(key)
                self._params.pop(key, None)
                close = getattr(inst, "close", None)
                if close is not None:
                    close()
        for key, ref in wanted.items():
            if key in self._plugins:
                old = self._params[key]
                if old != ref.params:
                    self._plugins[key].configure(old, ref.params)
                    self._params[key] = ref.params
            else:
                self._build(ref)
        for name in list(self._profiles):
            if name not in profiles:
                del self._profiles[name]
        for name, pref in profiles.items():
            prof = self._profiles.get(name)
            if prof is None:
                self._build_profile(pref)
            else:
                prof.configure(prof.ref, pref)
        self.qos.configure(qos_of(snapshot))
        self.mqtt.configure(snapshot)
        self.admission.configure(admission_of(snapshot))
        self.installed = snapshot
        self.scrape_targets = scrape_targets(snapshot)
        spec = getattr(snapshot, "spec", None)
        self.tracing = configure_tracing(self.tracing, getattr(getattr(spec, "spec", None), "tracing", None),
                                         self.worker)
        self.genai_otlp = configure_genai_otlp(self.genai_otlp,
                                               getattr(getattr(spec, "spec", None), "otlp_metrics", None), self.worker)
        if self._signals_started:
            self._apply_targets()

    # --- engine signals ----------------------------------------------------------------------------

    def start_signals(self) -> None:
        """Start scraping the installed snapshot's targets (call inside the worker's running loop);
        with no target the scraper starts with the first install that has some."""
        self._signals_started = True
        self._apply_targets()

    def _apply_targets(self) -> None:
        if self.signals.running:
            self.signals.update(self.scrape_targets)
        elif self.scrape_targets:
            self.signals.start(self.scrape_targets)

    async def stop_signals(self) -> None:
        self._signals_started = False
        await self.signals.stop()

    async def stop_tracing(self) -> None:
        """Export the spans still queued and stop the export thread, waiting at most the export timeout
        (a dead collector must not hold up a worker's stop)."""
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(tracing.shutdown), tracing.spec.export_timeout + 1.0)
            except asyncio.TimeoutError:
                log.warning("tracing: spans still queued at shutdown were not exported in time")

    async def stop_genai_otlp(self) -> None:
        """A last export of the GenAI metrics and stop the reader's thread, waiting at most the export
        timeout (a dead collector must not hold up a worker's stop)."""
        otlp, self.genai_otlp = self.genai_otlp, None
        if otlp is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(otlp.shutdown), otlp.spec.export_timeout + 1.0)
            except asyncio.TimeoutError:
                log.warning("otlpMetrics: the last export at shutdown did not finish in time")

    def _build(self, ref: Any) -> Any:
        from extproc.scheduling import plugin_types

        cls = plugin_types()[ref.type]
        inst = self._plugins[(ref.name, ref.type)] = cls(ref.name, ref.params, self)
        self._params[(ref.name, ref.type)] = ref.params
        return inst

    def _build_profile(self, ref: Any) -> Any:
        from extproc.scheduling.profile import SchedulingProfile

        prof = self._profiles[ref.name] = SchedulingProfile(ref, self)
        return prof

    def plugin(self, ref: Any) -> Any:
        """The long-lived instance of a declared plugin or scheduling profile (built on first use
        for older snapshots); what dispatch calls `pick(state, backend, endpoints)` on."""
        if isinstance(ref, ProfileRef):
            prof = self._profiles.get(ref.name)
            return prof if prof is not None else self._build_profile(ref)
        inst = self._plugins.get((ref.name, ref.type))
        return inst if inst is not None else self._build(ref)


__all__ = ["Runtime"]
