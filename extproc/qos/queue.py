"""Admission and queueing per backend pool: the gateway-side queue, ordered by priority class, then tenant
fairness, then deadline (EDF), in front of the pool's adaptive concurrency limit.

What: `compile_admission` validates `spec.qos.admission` (pools, bounds, sheddable classes) into an
immutable `AdmissionConfig`; `Admission` is the worker's long-lived state (`Runtime.admission`,
reconfigured on every reload, pools whose backend is still listed keep their limit, queue and slots).
A request to a pool with admission (stage `qos-queue`, right before `dispatch`) is admitted at once
when nothing waits and the pool's in-flight count is below its limit (`extproc/qos/limiter.py`);
otherwise it waits in the pool's queue: the ext_proc stream simply does not answer yet (the stage's
coroutine awaits a future; Envoy waits up to `spec.processor.messageTimeout` for the reply, so
`maxWait` must be below it). Order of admission out of the queue:
    1. priority class (`state.attrs["qos.class"]`, `extproc/qos/priority.py`): a more urgent class first;
       within a class, its own requests before those the priority matrix raised into it (band
       "<class>/matrix"): when an SLO of the default class is missed, the matrix raises all of that
       class's latency work to P0, several times P0's own traffic; in one band with it, P0's own
       requests waited behind them and missed their TTFT (perf/RESULTS.md, bench_qos 2026-12-02 05:31
       UTC: 446 P0 requests queued for 52 sent as P0, 58 timed out). The raised requests still go
       before every request of their base class and carry the first class's engine priority;
    2. within a class, tenants by token-weighted fair share (`extproc/qos/fairness.py`);
    3. within a tenant, earliest deadline first: deadline = arrival + the smallest `ttft` of the SLOs the
       request falls under (`spec.qos.slos`), else arrival + the route's timeout; ties in arrival order.
(llm-d flow control's shape: band, then fairness between flows, then the flow's ordering policy.)
Reserve (`reserve`, a fraction of the limit, default 0; `reserveClasses`, default the critical classes,
P0): the requests of other bands are admitted only while the pool's in-flight count is below
    limit - reserve_slots,   reserve_slots = min(ceil(reserve x limit), floor(limit / 2)),
the reserved classes' own requests up to the limit. So when a P0 request comes, the engines behind the
pool are not all full: an engine whose running batch is at `--max-num-seqs` queues a new request until a
running one finishes (a whole answer's decode time: vLLM preempts for KV-cache blocks, not for a full
batch), which no queue order in the gateway can shorten. What it costs: up to reserve_slots slots idle
while no reserved request is in flight (the limiter still learns from the others' TTFTs: it grows only
when the batch used half the limit). Matrix-raised requests are not the class's own: they do not use it.
Bounds: `maxQueue` requests and `maxQueueBytes` of request bodies per pool and worker, `maxWait` per
request. Refusals, in the route's error dialect, with `Retry-After: retryAfter`:
    a sheddable class (`sheddable`, default the last class, P2): 429 `overloaded` when the queue is full,
    when it waited `maxWait`, and at once by `shedding.mode`: `immediate` (default) when its estimated
    wait (requests of its class or more urgent ahead of it + 1, times the pool's mean slot time, over the
    limit) is over `maxWait`; `gradual` with the probability of `extproc/qos/shedding.py`'s PIE-style
    controller (`PoolAdmission.shedder`, fed the pool's queueing delay), P2 before P1;
    other classes: 503 `queue_full` / `queue_timeout` (nothing can serve them in time).
Slots are released exactly once: at the request's `on_done` (`release`), or at once when a stream that
was admitted is cancelled before dispatch; a request cancelled while it waits leaves the queue (its
bytes and place with it). After a release, and every `poll` while requests wait, the queue admits
from its head while there is room.
Workers: the pool's in-flight count is gateway-wide: each worker counts its admitted requests in its
own slot file (`extproc/datalayer/inflight.InflightTable` in `<stateDir>/admission/`, key "pool:<name>";
a restarted worker's file starts at zero, so a killed worker leaks nothing) and admission compares the
sum over every worker to the limit. N workers therefore do not admit N x the limit; between one worker's
read and its write another may read too, so the pool may briefly exceed the limit by at most N - 1.
Each worker learns the limit from the TTFTs it sees (the same backend: the workers' limits agree up
to sampling noise) and keeps its own queue: order and fairness hold among the requests a worker holds
(Envoy spreads requests over workers); waiting requests of one worker see slots freed by another
within `poll`.
Metrics: adapter_qos_admission_limit{pool} (per worker), adapter_qos_admission_inflight{pool} (gateway-
wide, as last read), adapter_qos_queue_depth{pool,class} (summed over workers),
adapter_qos_queue_requests_total{pool,class,result} (result: admitted, queued, shed, full, timeout,
cancelled), adapter_qos_queue_wait_seconds{pool,class}, adapter_qos_fairness_jain{pool,class} (Jain's
index of the weighted tokens admitted per waiting tenant, per `fairnessWindow`; min over workers). The
`class` label is the band: "<class>/matrix" for the requests the priority matrix raised into a class.
Off switch: pools not listed, or `enabled: false`, have no stage and no state (perf/bench_qos.py can
write the same config with and without `admission`).
Cost: routes without a pool: no stage. Admitted at once: a dict lookup, a read of every worker's slot
for the pool (about 0.5 us each), a write, two metric updates. Queued: a heap push and pop, a future,
a timer every `poll` while anything waits.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from extproc.datalayer.inflight import InflightTable
from extproc.errors import reject
from extproc.qos.fairness import FairShare, JainWindow
from extproc.qos.limiter import GradientLimiter, LimiterParams
from extproc.qos.priority import BASE_ATTR
from extproc.qos.shedding import GRADUAL, Shedder, SheddingParams
from extproc.types import Reject

log = logging.getLogger(__name__)

SLOT_ATTR = "qos.slot"  # state.attrs: the Slot a request holds until it ends
DEFAULT_COMPLETION_TOKENS = 256  # the estimate's output part when a request names no max_tokens
PUBLISH_EVERY = 0.5  # seconds between a worker's `admission-<worker>.json` files (adapterctl status)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    pool: str
    limiter: LimiterParams
    max_queue: int
    max_queue_bytes: int
    max_wait: float
    sheddable: frozenset[str]
    retry_after: int
    poll: float
    fairness_window: float
    shedding: SheddingParams = SheddingParams()
    reserve: float = 0.0  # fraction of the limit only `reserved` classes' own requests may use
    reserved: frozenset[str] = frozenset()


@dataclass(frozen=True)
class AdmissionConfig:
    pools: Mapping[str, PoolConfig]
    weights: Mapping[str, float]  # tenant -> fair-share weight (default 1)
    slo_ttft: tuple[tuple[Any, float], ...]  # (Slo, ttft seconds) of SLOs with a TTFT objective


def compile_admission(spec: Any, backends: Mapping[str, Any], message_timeout: float, qos: Any,
                      issue: Callable[[tuple, str], None]) -> AdmissionConfig | None:
    """`spec` is schema.QosSpec (None, or no enabled pool: no admission); `qos` the compiled QosConfig."""
    if spec is None or qos is None or not spec.admission:
        return None
    base = ("spec", "qos", "admission")
    names = ", ".join(qos.classes)
    pools: dict[str, PoolConfig] = {}
    for i, a in enumerate(spec.admission):
        where = base + (i,)
        if a.backend not in backends:
            issue(where + ("backend",), f"unknown backend {a.backend!r} (backends: {', '.join(backends)})")
        if a.backend in pools:
            issue(where + ("backend",), f"backend {a.backend!r} is listed twice")
        if not a.min_limit <= a.initial_limit <= a.max_limit:
            issue(where + ("initialLimit",), f"need minLimit ({a.min_limit}) <= initialLimit ({a.initial_limit}) "
                  f"<= maxLimit ({a.max_limit})")
        wait = a.max_wait if a.max_wait is not None else 0.8 * message_timeout
        if wait <= 0 or wait >= message_timeout:
            issue(where + ("maxWait",), f"maxWait ({wait:g}s) must be above 0 and below "
                  f"spec.processor.messageTimeout ({message_timeout:g}s): Envoy fails a request whose processor "
                  "reply takes longer, and a queued request's reply waits for its admission")
        shed = a.sheddable if a.sheddable is not None else (qos.last.name,)
        for j, c in enumerate(shed):
            if c not in qos.classes:
                issue(where + ("sheddable", j), f"unknown priority class {c!r} (classes: {names})")
        sh = a.shedding
        target = sh.target if sh.target is not None else wait / 4
        if sh.mode == GRADUAL and not 0 < target < wait:
            issue(where + ("shedding", "target"), f"target ({target:g}s) must be above 0 and below maxWait "
                  f"({wait:g}s): the maxWait bound would shed before the controller acts")
        order = tuple(sorted({c for c in shed if c in qos.classes}, key=lambda c: -qos.classes[c].rank))
        reserved = a.reserve_classes if a.reserve_classes is not None else tuple(
            c.name for c in qos.classes.values() if c.critical)
        for j, c in enumerate(reserved if a.reserve > 0 or a.reserve_classes is not None else ()):
            if c not in qos.classes:
                issue(where + ("reserveClasses", j), f"unknown priority class {c!r} (classes: {names})")
            elif c in shed:
                issue(where + ("reserveClasses", j), f"class {c!r} is sheddable: the reserve is for the classes "
                      "that are never shed")
        if a.reserve > 0 and not reserved:
            issue(where + ("reserve",), "no class may use the reserve: no class is critical and reserveClasses "
                  "is not given")
        shedding = SheddingParams(sh.mode, target, sh.interval, sh.alpha, sh.beta, sh.max_probability, order)
        if not a.enabled:
            continue
        pools[a.backend] = PoolConfig(
            a.backend, LimiterParams(a.initial_limit, a.min_limit, a.max_limit, a.tolerance, a.smoothing, a.samples,
                                     a.min_rtt_window),
            a.max_queue, a.max_queue_bytes, wait, frozenset(shed), a.retry_after, a.poll, a.fairness_window, shedding,
            a.reserve, frozenset(reserved))
    if not pools:
        return None
    weights = {t.tenant: t.weight for t in spec.tenants if t.weight is not None}
    return AdmissionConfig(MappingProxyType(pools), MappingProxyType(weights),
                           tuple((s, s.ttft) for s in qos.slos if s.ttft is not None))


def admission_of(snapshot: Any) -> AdmissionConfig | None:
    """The AdmissionConfig a snapshot's `qos-queue` stages carry, or None."""
    for route in getattr(snapshot, "routes", {}).values():
        for stage in getattr(route.pipeline, "stages", ()):
            cfg = getattr(stage, "admission", None)
            if isinstance(cfg, AdmissionConfig):
                return cfg
    return None


# --- the queue ------------------------------------------------------------------------------------


def band_name(cls: str, raised: bool) -> str:
    """A band's name: the class, or "<class>/matrix" for the requests the priority matrix raised into it
    (also the `class` label of the queue's metrics)."""
    return f"{cls}/matrix" if raised else cls


class Waiter:
    __slots__ = ("state", "rank", "raised", "cls", "tenant", "deadline", "tokens", "weight", "size", "seq", "fut",
                 "enqueued", "live", "admitted")

    def __init__(self, state: Any, rank: int, cls: str, tenant: str | None, deadline: float, tokens: float,
                 weight: float, size: int, seq: int, enqueued: float, fut: Any = None, raised: bool = False):
        self.state = state
        self.rank = rank
        self.raised = raised  # the priority matrix raised it into `cls`: it waits behind the class's own requests
        self.cls = cls
        self.tenant = tenant
        self.deadline = deadline
        self.tokens = tokens
        self.weight = weight
        self.size = size
        self.seq = seq
        self.fut = fut
        self.enqueued = enqueued
        self.live = True  # in the queue
        self.admitted = False

    @property
    def band(self) -> str:
        return band_name(self.cls, self.raised)


class _Band:
    __slots__ = ("name", "flows", "fair", "count", "dead", "jain")

    def __init__(self, name: str) -> None:
        self.name = name  # the class, or "<class>/matrix" for the requests the matrix raised into it
        self.flows: dict[str | None, list] = {}  # tenant -> heap of (deadline, seq, Waiter)
        self.fair = FairShare()
        self.count = 0
        self.dead = 0  # removed waiters still in a heap (skipped when they reach its head)
        self.jain = JainWindow()


class AdmissionQueue:
    """Waiting requests of one pool: class bands (by rank; a class's own requests before those the matrix
    raised into it), tenant flows, each flow a deadline heap."""

    def __init__(self) -> None:
        self.bands: dict[tuple[int, bool], _Band] = {}
        self.count = 0
        self.bytes = 0

    def push(self, w: Waiter) -> None:
        key = (w.rank, w.raised)
        band = self.bands.get(key)
        if band is None:
            band = self.bands[key] = _Band(w.band)
        heapq.heappush(band.flows.setdefault(w.tenant, []), (w.deadline, w.seq, w))
        band.count += 1
        band.jain.waiting(w.tenant)
        self.count += 1
        self.bytes += w.size

    def remove(self, w: Waiter) -> None:
        """Take `w` out (lazily: its heap entry is skipped when it reaches the head)."""
        if not w.live:
            return
        w.live = False
        band = self.bands[(w.rank, w.raised)]
        band.count -= 1
        self.count -= 1
        self.bytes -= w.size
        band.dead += 1
        if band.dead > 64 and band.dead > band.count:
            # nothing popped them (a pool whose slots never free while requests time out): drop them now,
            # so a stuck pool holds at most about twice its live waiters
            for tenant in list(band.flows):
                heap = [e for e in band.flows[tenant] if e[2].live]
                if heap:
                    heapq.heapify(heap)
                    band.flows[tenant] = heap
                else:
                    del band.flows[tenant]
            band.dead = 0

    def ahead(self, rank: int, raised: bool = False) -> int:
        """Requests that would be admitted before a new one of class `rank` (its band and more urgent ones)."""
        key = (rank, raised)
        return sum(b.count for k, b in self.bands.items() if k <= key)

    def depth(self, rank: int) -> int:
        """Requests waiting in class `rank` (its own and those the matrix raised into it)."""
        return sum(b.count for (r, _), b in self.bands.items() if r == rank)

    def peek_band(self) -> _Band | None:
        for key in sorted(self.bands):
            if self.bands[key].count:
                return self.bands[key]
        return None

    def pop(self, band: _Band | None = None) -> Waiter | None:
        """The next request to admit (see the module docstring's order), out of the queue; `band`: the
        head band when the caller already has it (`peek_band`)."""
        band = band if band is not None else self.peek_band()
        if band is None:
            return None
        best = None
        best_key = None
        for tenant, heap in list(band.flows.items()):
            while heap and not heap[0][2].live:
                heapq.heappop(heap)
                band.dead -= 1
            if not heap:
                del band.flows[tenant]
                continue
            k = (band.fair.key(tenant), heap[0][2].enqueued, heap[0][1])
            if best_key is None or k < best_key:
                best, best_key = tenant, k
        if best is None:
            return None
        _, _, w = heapq.heappop(band.flows[best])
        band.fair.charge(best, w.tokens, w.weight)
        band.jain.admitted(best, w.tokens, w.weight)
        w.live = False
        band.count -= 1
        self.count -= 1
        self.bytes -= w.size
        return w


# --- per-pool admission ---------------------------------------------------------------------------


@dataclass(slots=True)
class Slot:
    pool: "PoolAdmission"
    admitted: float
    inflight: int  # the pool's in-flight count when it was admitted (the limiter's app-limited test)


class PoolAdmission:
    """One pool's limiter, queue and slot counter in one worker."""

    def __init__(self, cfg: PoolConfig, table: InflightTable, clock: Callable[[], float], metrics: Any):
        self.cfg = cfg
        self.table = table
        self.key = f"pool:{cfg.pool}"
        self.clock = clock
        self.limiter = GradientLimiter(cfg.limiter, clock)
        self.queue = AdmissionQueue()
        self.shedder = Shedder(cfg.shedding, clock)  # gradual mode's level (extproc/qos/shedding.py)
        self.metrics = metrics
        self.hold = 0.0  # EMA of a slot's time held (seconds): the wait estimate's service time
        self._timer: Any = None
        self._seq = itertools.count()
        self._window: int | None = None
        self.own = 0  # slots this worker holds
        self.on_tick: Callable[[float], None] | None = None  # Admission.maybe_publish: status while requests wait

    def configure(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.limiter.configure(cfg.limiter)
        self.shedder.configure(cfg.shedding)

    def inflight(self) -> int:
        return self.table.get(self.key)

    def reserve_slots(self) -> int:
        """Slots of the limit kept for the reserved classes' own requests: reserve x limit, rounded up,
        at most half the limit (rounded down: every class keeps at least half)."""
        if self.cfg.reserve <= 0:
            return 0
        limit = self.limiter.limit
        return min(math.ceil(self.cfg.reserve * limit), limit // 2)

    def room(self, reserved: bool = False) -> tuple[bool, int]:
        """(whether one more request of a band may start, the pool's gateway-wide in-flight count): below
        the limit for a reserved class's own requests, below limit - reserve_slots for the others."""
        n = self.table.get(self.key)
        return n < self.limiter.limit - (0 if reserved else self.reserve_slots()), n

    def take(self, state: Any, now: float, inflight: int) -> None:
        self.table.started(self.key)
        self.own += 1
        state.attrs[SLOT_ATTR] = Slot(self, now, inflight + 1)

    def release(self, state: Any, first_token: float | None) -> None:
        slot = state.attrs.pop(SLOT_ATTR, None)
        if slot is None or slot.pool is not self:
            if slot is not None:
                slot.pool.release_slot(slot, state, first_token)
            return
        self.release_slot(slot, state, first_token)

    def release_slot(self, slot: Slot, state: Any, first_token: float | None) -> None:
        self.table.finished(self.key)
        self.own -= 1
        now = self.clock()
        held = max(0.0, now - slot.admitted)
        self.hold = held if self.hold == 0.0 else self.hold + 0.2 * (held - self.hold)
        if first_token is not None and first_token >= slot.admitted:
            if self.limiter.sample(first_token - slot.admitted, slot.inflight) and self.metrics is not None:
                self.metrics.limit(self.cfg.pool).set(self.limiter.limit)
        self.drain()

    def estimate_wait(self, ahead: int) -> float | None:
        """Seconds until a request with `ahead` requests before it is admitted: ahead x mean slot time /
        limit (None before any slot was released: nothing to estimate from)."""
        if self.hold <= 0:
            return None
        return ahead * self.hold / max(1, self.limiter.limit)

    def drain(self) -> None:
        """Admit from the queue's head while there is room."""
        q = self.queue
        while q.count:
            band = q.peek_band()
            if band is None:
                break
            ok, n = self.room(band.name in self.cfg.reserved)
            if not ok:
                break
            w = q.pop(band)
            if w is None:
                break
            if w.fut is None or w.fut.done():  # timed out or cancelled at the same instant
                if self.metrics is not None:
                    self.metrics.depth(self.cfg.pool, w.band).dec()
                continue
            now = self.clock()
            self.take(w.state, now, n)
            w.admitted = True
            w.fut.set_result(True)
            if self.metrics is not None:
                self.metrics.wait(self.cfg.pool, w.band).observe(now - w.enqueued)
                self.metrics.depth(self.cfg.pool, w.band).dec()
        self._fairness(self.clock())

    def _fairness(self, now: float) -> None:
        index = int(now // self.cfg.fairness_window)
        if self._window is None:
            self._window = index
            return
        if index == self._window:
            return
        self._window = index
        for band in self.queue.bands.values():
            value = band.jain.close()
            if value is not None and self.metrics is not None:
                self.metrics.jain(self.cfg.pool, band.name).set(value)

    def expire(self, w: Waiter) -> None:
        """`w` waited `maxWait`: out of the queue, refused by its coroutine."""
        if w.live and not w.fut.done():
            self.queue.remove(w)
            if self.metrics is not None:
                self.metrics.depth(self.cfg.pool, w.band).dec()
            w.fut.set_result(False)

    def schedule(self) -> None:
        if self._timer is None and self.queue.count:
            self._timer = asyncio.get_running_loop().call_later(self.cfg.poll, self._tick)

    def observe_delay(self, now: float) -> None:
        """Gradual shedding: feed the controller the queueing delay now (Little's law: waiting x slot time / limit)."""
        if self.cfg.shedding.gradual:
            self.shedder.observe(self.estimate_wait(self.queue.count) or 0.0, now)

    def _tick(self) -> None:
        self._timer = None
        self.drain()
        self.observe_delay(self.clock())
        self.schedule()
        if self.on_tick is not None:
            self.on_tick(self.clock())

    def close(self) -> None:
        """The pool left the config: admit everything waiting (it runs without a limit from now on)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.queue.count:
            w = self.queue.pop()
            if w is not None and self.metrics is not None:
                self.metrics.depth(self.cfg.pool, w.band).dec()
            if w is not None and w.fut is not None and not w.fut.done():
                self.take(w.state, self.clock(), 0)
                w.admitted = True
                w.fut.set_result(True)


class AdmissionMetrics:
    def __init__(self, registry: Any = None):
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = registry if registry is not None else REGISTRY

        def make(kind: Any, name: str, *args: Any, **kw: Any) -> Any:
            try:
                return kind(name, *args, registry=reg, **kw)
            except ValueError:  # already registered (a second runtime in one process: tests)
                return reg._names_to_collectors[name if kind is not Counter else name + "_total"]

        ns = "adapter_qos"
        self._limit = make(Gauge, f"{ns}_admission_limit", "the pool's adaptive concurrency limit (this worker)",
                           ["pool"], multiprocess_mode="all")
        self._inflight = make(Gauge, f"{ns}_admission_inflight", "requests admitted to the pool and not ended, "
                              "over every worker (as last read)", ["pool"], multiprocess_mode="max")
        self._depth = make(Gauge, f"{ns}_queue_depth", "requests waiting in the pool's gateway queue",
                           ["pool", "class"], multiprocess_mode="livesum")
        self._requests = make(Counter, f"{ns}_queue_requests", "admission decisions", ["pool", "class", "result"])
        self._wait = make(Histogram, f"{ns}_queue_wait_seconds", "time a request waited in the gateway queue",
                          ["pool", "class"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self._jain = make(Gauge, f"{ns}_fairness_jain", "Jain's index of the weighted tokens admitted per waiting "
                          "tenant over the last fairness window", ["pool", "class"], multiprocess_mode="min")
        self._children: dict[tuple, Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric),) + labels
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def limit(self, pool: str) -> Any:
        return self._child(self._limit, pool)

    def inflight(self, pool: str) -> Any:
        return self._child(self._inflight, pool)

    def depth(self, pool: str, cls: str) -> Any:
        return self._child(self._depth, pool, cls)

    def requests(self, pool: str, cls: str, result: str) -> Any:
        return self._child(self._requests, pool, cls, result)

    def wait(self, pool: str, cls: str) -> Any:
        return self._child(self._wait, pool, cls)

    def jain(self, pool: str, cls: str) -> Any:
        return self._child(self._jain, pool, cls)


class Admission:
    """The worker's admission state (`Runtime.admission`): one PoolAdmission per pool with admission."""

    def __init__(self, worker: int = 0, state_dir: str | None = None, clock: Callable[[], float] = time.monotonic,
                 registry: Any = None):
        self.worker = worker
        self.state_dir = state_dir
        self.clock = clock
        self.cfg: AdmissionConfig | None = None
        self.pools: dict[str, PoolAdmission] = {}
        self._table: InflightTable | None = None
        self._registry = registry
        self._metrics: AdmissionMetrics | None = None
        self._published = -1e18

    @property
    def metrics(self) -> AdmissionMetrics:
        if self._metrics is None:
            self._metrics = AdmissionMetrics(self._registry)
        return self._metrics

    def table(self) -> InflightTable:
        if self._table is None:
            self._table = InflightTable(Path(self.state_dir) / "admission" if self.state_dir else None, self.worker)
        return self._table

    def configure(self, cfg: AdmissionConfig | None) -> None:
        self.cfg = cfg
        wanted = cfg.pools if cfg is not None else {}
        for name in list(self.pools):
            if name not in wanted:
                self.pools.pop(name).close()
        for name, pc in wanted.items():
            p = self.pools.get(name)
            if p is None:
                p = self.pools[name] = PoolAdmission(pc, self.table(), self.clock, self.metrics)
                p.on_tick = self.maybe_publish
                self.metrics.limit(name).set(p.limiter.limit)
            else:
                p.configure(pc)

    def maybe_publish(self, now: float) -> None:
        if self.state_dir and now - self._published >= PUBLISH_EVERY:
            self._published = now
            self.publish()

    def view(self) -> dict[str, Any]:
        """This worker's pools, as published for `adapterctl status`."""
        pools = {}
        for name, p in self.pools.items():
            lim = p.limiter
            pools[name] = {"limit": lim.limit, "reserve_slots": p.reserve_slots(), "min_rtt_s": lim.min_rtt,
                           "last_sample_rtt_s": lim.last_sample_rtt, "updates": lim.updates, "own_slots": p.own,
                           "hold_s": p.hold,
                           "shedding": {"mode": p.cfg.shedding.mode, "level": p.shedder.level},
                           "waiting": {b.name: b.count for b in p.queue.bands.values() if b.count},
                           "jain": {b.name: b.jain.last for b in p.queue.bands.values() if b.jain.last is not None}}
        return {"worker": self.worker, "pid": os.getpid(), "time": time.time(), "pools": pools}

    def publish(self) -> None:
        path = Path(self.state_dir) / f"admission-{self.worker}.json"
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.view()))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot publish admission state to %s: %s", path, e)

    def deadline(self, arrival: float, route: Any, tenant: str | None, cls: str) -> float:
        """arrival + the smallest TTFT objective of the SLOs the request falls under, else + the route's timeout."""
        cfg = self.cfg
        name = route.name if route is not None else None
        best = math.inf
        if cfg is not None:
            for slo, ttft in cfg.slo_ttft:
                if ttft < best and slo.selects(name, tenant, cls):
                    best = ttft
        if best == math.inf:
            timeout = getattr(route, "timeout", None)
            best = timeout if timeout else math.inf
        return arrival + best

    async def acquire(self, pool: PoolAdmission, state: Any, cls: Any, tokens: float, size: int) -> Reject | None:
        """Admit `state` to `pool` (None), possibly after waiting in its queue, or refuse it."""
        cfg = pool.cfg
        m = self.metrics
        name = cls.name
        q = pool.queue
        now = self.clock()
        self.maybe_publish(now)
        base = state.attrs.get(BASE_ATTR)
        raised = base is not None and base[0].rank > cls.rank  # the priority matrix raised it
        label = band_name(name, raised)  # the metrics' class label
        if not q.count:
            ok, n = pool.room(not raised and name in cfg.reserved)
            if ok:
                pool.take(state, now, n)
                m.requests(cfg.pool, label, "admitted").inc()
                return None
        m.inflight(cfg.pool).set(pool.inflight())
        if q.count >= cfg.max_queue or q.bytes + size > cfg.max_queue_bytes:
            return self._refuse(pool, cls, label, "full", f"the gateway queue of backend {cfg.pool} is full "
                                f"({q.count} requests, {q.bytes} bytes waiting; limit {cfg.max_queue} requests, "
                                f"{cfg.max_queue_bytes} bytes)")
        shed = name in cfg.sheddable
        if shed and cfg.shedding.gradual:
            pool.observe_delay(now)
            if pool.shedder.shed(name):
                return self._refuse(pool, cls, label, "shed", f"backend {cfg.pool} is overloaded (concurrency limit "
                                    f"{pool.limiter.limit}, {q.count} waiting): class {name} is shed with "
                                    f"probability {pool.shedder.probability(name):.2f}")
        elif shed:
            est = pool.estimate_wait(q.ahead(cls.rank, raised) + 1)
            if est is not None and est > cfg.max_wait:
                return self._refuse(pool, cls, label, "shed", f"backend {cfg.pool} is at its concurrency limit "
                                    f"({pool.limiter.limit}); the estimated wait ({est:.3f}s) is over the queue's "
                                    f"bound ({cfg.max_wait:g}s) for class {name}")
        tenant = state.tenant
        weight = self.cfg.weights.get(tenant, 1.0) if self.cfg is not None and tenant is not None else 1.0
        w = Waiter(state, cls.rank, name, tenant, self.deadline(state.started, state.route, tenant, name), tokens,
                   weight, size, next(pool._seq), now, asyncio.get_running_loop().create_future(), raised)
        q.push(w)
        m.requests(cfg.pool, label, "queued").inc()
        m.depth(cfg.pool, label).inc()
        pool.drain()  # a slot another worker freed since the check above
        pool.schedule()
        timer = asyncio.get_running_loop().call_later(cfg.max_wait, pool.expire, w)
        try:
            ok = await w.fut
        except asyncio.CancelledError:
            timer.cancel()
            if w.live:
                q.remove(w)
                m.depth(cfg.pool, label).dec()
            elif w.admitted:  # admitted, never dispatched: give the slot back now
                pool.release(state, None)
            m.requests(cfg.pool, label, "cancelled").inc()
            raise
        timer.cancel()
        if not ok:
            return self._refuse(pool, cls, label, "timeout", f"waited {cfg.max_wait:g}s in the gateway queue of "
                                f"backend {cfg.pool} (concurrency limit {pool.limiter.limit}) without a slot")
        return None

    def _refuse(self, pool: PoolAdmission, cls: Any, label: str, result: str, why: str) -> Reject:
        cfg = pool.cfg
        self.metrics.requests(cfg.pool, label, result).inc()
        if cls.name in cfg.sheddable:
            return reject(429, "overloaded", f"{why}; retry later", retry_after=cfg.retry_after,
                          backend=cfg.pool, priority_class=cls.name)
        return reject(503, "queue_timeout" if result == "timeout" else "queue_full", why,
                      retry_after=cfg.retry_after, backend=cfg.pool, priority_class=cls.name)

    def release(self, state: Any) -> None:
        slot = state.attrs.get(SLOT_ATTR)
        if slot is None:
            return
        first = state.first_body
        req = state.request
        # TTFT from the stream only for streamed answers (an unstreamed body comes whole at the end)
        slot.pool.release(state, first if first is not None and req is not None and req.stream else None)
        self.maybe_publish(self.clock())


def admission_view(snap: Any, state_dir: str | None, now: float | None = None) -> dict[str, Any]:
    """For `adapterctl status`: per pool with admission, the gateway-wide slots held (every worker's slot
    file, read in place) and each worker's published limit, waiting requests and Jain's index."""
    qos = getattr(getattr(snap.spec, "spec", None), "qos", None)
    names = [a.backend for a in (qos.admission if qos is not None else ()) if a.enabled]
    table = InflightTable(Path(state_dir) / "admission", reader=True) if state_dir else None
    now = time.time() if now is None else now
    workers = []
    for f in sorted(Path(state_dir).glob("admission-*.json")) if state_dir else ():
        try:
            workers.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    pools = {}
    for name in names:
        per = {str(w.get("worker")): {**w["pools"][name], "age_s": round(now - float(w.get("time", now)), 3)}
               for w in workers if name in (w.get("pools") or {})}
        waiting: dict[str, int] = {}
        for v in per.values():
            for c, n in (v.get("waiting") or {}).items():
                waiting[c] = waiting.get(c, 0) + n
        pools[name] = {"in_flight": table.get(f"pool:{name}") if table is not None else None,
                       "waiting": waiting, "workers": per}
    return {"pools": pools}


def estimate_tokens(request: Any) -> int:
    """prompt characters / 4 + max_tokens (else DEFAULT_COMPLETION_TOKENS); 1 without a parsed request."""
    if request is None:
        return 1
    try:
        prompt = request.prompt_tokens_estimate()
    except Exception:
        prompt = 0
    completion = request.max_tokens if getattr(request, "max_tokens", None) is not None else DEFAULT_COMPLETION_TOKENS
    return max(1, prompt + max(0, completion))


__all__ = ["AdmissionConfig", "PoolConfig", "compile_admission", "admission_of", "AdmissionQueue", "Waiter",
           "band_name",
           "PoolAdmission", "Admission", "AdmissionMetrics", "SLOT_ATTR", "estimate_tokens", "admission_view"]
