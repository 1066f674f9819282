"""The QoS policy engine: `spec.qos` compiled once, and each worker's windows, matrix and breaker.

What: `compile_qos(spec, route_names, tenant_ids, backends, issue)` validates `spec.qos` (every route,
tenant, class and backend it names must exist; errors at their field path) into an immutable
`QosConfig`, which `extproc/config/compile.py` hands to the QoS stages of every inference route
(`extproc/stages/__init__.build_pipeline`). `QosRuntime` is the worker's long-lived state
(`Runtime.qos`, reconfigured by `Runtime.install` with the config the snapshot's stages carry; SLO
windows and breakers whose definition did not change survive a reload): `SloWindows`
(`extproc/qos/slo.py`) and `GlitchBreaker` (`extproc/qos/breaker.py`) over fixed windows
`index = floor(now / window)`. Windows close lazily: every request start and end first calls
`advance(now)`, which closes the windows that ended since (empty ones included, at most `horizon` +
`breaker.maxGap` + `recoveryWindows` of them, the most any rule looks back), updates the matrix's
escalation per SLO, the breakers, the metrics, and at most every `PUBLISH_EVERY` seconds writes
`qos-<worker>.json` into the supervisor's state dir, which `adapterctl status` adds up over workers
(`aggregate`). Between requests nothing runs; an idle gateway's published state ages (status shows
the age) and the next request sees the windows that passed as empty.
Metrics (prometheus_client, multiprocess mode under the supervisor):
| adapter_qos_slo_requests_total | counter | slo, objective, result (met, missed): added per window |
| adapter_qos_slo_attainment_ratio | gauge (all: per worker pid) | slo, objective: over the horizon |
| adapter_qos_slo_escalated | gauge (max) | slo: 1 while the matrix raises / lowers its requests |
| adapter_qos_priority_requests_total | counter | class, source (header, route, tenant, default, matrix) |
| adapter_qos_shed_total | counter | tenant, route: 429s of the glitch breaker |
| adapter_qos_breaker_trips_total | counter | tenant |
| adapter_qos_breaker_open | gauge (max) | tenant: 1 while its non-critical requests are shed |
| adapter_qos_tenant_p99_seconds | gauge (max) | tenant: the last window's P99 |
Cost: nothing for configs without `spec.qos` (no stage, no state); otherwise see the stages and
policies; a window close is O(SLOs x objectives + tenants), a publish one small JSON file write.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from extproc.qos.breaker import BreakerConfig, GlitchBreaker
from extproc.qos.priority import PriorityClass, compile_classes
from extproc.qos.slo import Slo, SloWindows

log = logging.getLogger(__name__)

PUBLISH_EVERY = 0.5  # seconds between a worker's status files


@dataclass(frozen=True, slots=True)
class RouteQos:
    route: str
    priority_class: PriorityClass | None
    workload: str
    objective_header: str | None


@dataclass(frozen=True)
class QosConfig:
    window: float
    classes: Mapping[str, PriorityClass]  # by name, in order (first: most urgent)
    default: PriorityClass
    objectives: Mapping[str, str]
    engine_backends: frozenset[str]
    slos: tuple[Slo, ...]
    routes: Mapping[str, RouteQos]
    tenant_classes: Mapping[str, PriorityClass]
    thresholds: Mapping[str, float]  # tenant -> glitch threshold (seconds)
    matrix_enabled: bool
    matrix_below: float
    matrix_recover: float
    horizon: int
    matrix_applies: frozenset[str]
    breaker: BreakerConfig
    first: PriorityClass = field(init=False)
    last: PriorityClass = field(init=False)

    def __post_init__(self) -> None:
        ordered = list(self.classes.values())
        object.__setattr__(self, "first", ordered[0])
        object.__setattr__(self, "last", ordered[-1])


def compile_qos(spec: Any, route_names: Mapping[str, int], tenant_ids: set[str], backends: Mapping[str, Any],
                issue: Callable[[tuple, str], None]) -> QosConfig | None:
    """`spec` is schema.QosSpec (None: QoS off); `route_names` route name -> index in spec.routes."""
    if spec is None:
        return None
    base = ("spec", "qos")
    classes: dict[str, PriorityClass] = {}
    for c in compile_classes(spec.classes):
        if c.name in classes:
            issue(base + ("classes", c.rank, "name"), f"duplicate priority class {c.name!r}")
        classes[c.name] = c
    names = ", ".join(classes)

    def cls(name: str | None, where: tuple) -> PriorityClass | None:
        if name is None:
            return None
        c = classes.get(name)
        if c is None:
            issue(where, f"unknown priority class {name!r} (classes: {names})")
        return c

    default = cls(spec.default_class, base + ("defaultClass",)) or next(iter(classes.values()))
    for k, v in spec.objectives.items():
        cls(v, base + ("objectives", k))
    for i, b in enumerate(spec.engine_priority):
        backend = backends.get(b)
        if backend is None:
            issue(base + ("enginePriority", i), f"unknown backend {b!r} (backends: {', '.join(backends)})")
        elif backend.kind not in ("openai", "vllm", "triton", "onnxruntime"):
            issue(base + ("enginePriority", i), f"backend {b!r} is of kind {backend.kind}: only openai, vllm "
                  "(vLLM's `priority` field), triton and onnxruntime (KServe v2 `parameters.priority`) take one")
    slos: list[Slo] = []
    seen: set[str] = set()
    for i, s in enumerate(spec.slos):
        where = base + ("slos", i)
        if s.name in seen:
            issue(where + ("name",), f"duplicate SLO name {s.name!r}")
        seen.add(s.name)
        if s.route is not None and s.route not in route_names:
            issue(where + ("route",), f"unknown route {s.route!r} (routes: {', '.join(route_names)})")
        if s.tenant is not None and s.tenant not in tenant_ids:
            issue(where + ("tenant",), f"unknown tenant {s.tenant!r} (spec.tenants: {', '.join(sorted(tenant_ids)) or 'none'})")
        cls(s.priority_class, where + ("priorityClass",))
        slos.append(Slo(s.name, s.route, s.tenant, s.priority_class, s.ttft, s.tpot, s.p99, s.error_rate, s.target))
    routes: dict[str, RouteQos] = {}
    for i, r in enumerate(spec.routes):
        where = base + ("routes", i)
        if r.route not in route_names:
            issue(where + ("route",), f"unknown route {r.route!r} (routes: {', '.join(route_names)})")
        if r.route in routes:
            issue(where + ("route",), f"route {r.route!r} is listed twice")
        routes[r.route] = RouteQos(r.route, cls(r.priority_class, where + ("priorityClass",)), r.workload,
                                   r.objective_header)
    tenant_classes: dict[str, PriorityClass] = {}
    thresholds: dict[str, float] = {}
    for i, t in enumerate(spec.tenants):
        where = base + ("tenants", i)
        if t.tenant not in tenant_ids:
            issue(where + ("tenant",), f"unknown tenant {t.tenant!r} (spec.tenants: {', '.join(sorted(tenant_ids)) or 'none'})")
        c = cls(t.priority_class, where + ("priorityClass",))
        if c is not None:
            tenant_classes[t.tenant] = c
        if t.glitch_threshold is not None:
            thresholds[t.tenant] = t.glitch_threshold
    m = spec.matrix
    if m.recover < m.below:
        issue(base + ("matrix", "recover"), f"recover ({m.recover}) must be at or above below ({m.below}): the "
              "matrix leaves its escalation only once the deviation has come back")
    applies = set()
    for i, n in enumerate(m.apply_to):
        if cls(n, base + ("matrix", "applyTo", i)) is not None:
            applies.add(n)
    b = spec.breaker
    from extproc.qos.batch_control import check_batch_control  # the supervisor runs them (batch_control.py)

    check_batch_control(spec.batch_control, backends, issue)
    return QosConfig(
        window=spec.window, classes=MappingProxyType(classes), default=default,
        objectives=MappingProxyType(dict(spec.objectives)), engine_backends=frozenset(spec.engine_priority),
        slos=tuple(slos), routes=MappingProxyType(routes), tenant_classes=MappingProxyType(tenant_classes),
        thresholds=MappingProxyType(thresholds), matrix_enabled=m.enabled, matrix_below=m.below,
        matrix_recover=m.recover, horizon=m.horizon, matrix_applies=frozenset(applies or {default.name}),
        breaker=BreakerConfig(b.windows, b.recovery_windows, b.min_samples, b.max_gap, b.latency, b.retry_after))


def qos_of(snapshot: Any) -> QosConfig | None:
    """The QosConfig a snapshot's QoS stages carry (one object per compile), or None."""
    for route in getattr(snapshot, "routes", {}).values():
        pipeline = route.pipeline
        for stage in getattr(pipeline, "stages", ()):
            cfg = getattr(stage, "qos", None)
            if isinstance(cfg, QosConfig):
                return cfg
    return None


class QosMetrics:
    def __init__(self, registry: Any = None):
        from prometheus_client import Counter, Gauge

        ns = "adapter_qos"
        self.slo_requests = Counter(f"{ns}_slo_requests", "requests counted by an SLO objective, met or missed",
                                    ["slo", "objective", "result"], registry=registry)
        self.attainment = Gauge(f"{ns}_slo_attainment_ratio", "share of an SLO objective's requests that met it "
                                "over the matrix horizon (this worker)", ["slo", "objective"], registry=registry,
                                multiprocess_mode="all")
        self.escalated = Gauge(f"{ns}_slo_escalated", "1 while the priority matrix re-prioritises the SLO's "
                               "requests", ["slo"], registry=registry, multiprocess_mode="max")
        self.priority = Counter(f"{ns}_priority_requests", "requests by priority class and where the class came "
                                "from", ["class", "source"], registry=registry)
        self.shed = Counter(f"{ns}_shed", "requests shed by the glitch breaker", ["tenant", "route"],
                            registry=registry)
        self.trips = Counter(f"{ns}_breaker_trips", "glitch breaker trips", ["tenant"], registry=registry)
        self.open = Gauge(f"{ns}_breaker_open", "1 while the tenant's non-critical requests are shed",
                          ["tenant"], registry=registry, multiprocess_mode="max")
        self.tenant_p99 = Gauge(f"{ns}_tenant_p99_seconds", "the last window's P99 of the tenant's requests",
                                ["tenant"], registry=registry, multiprocess_mode="max")


class QosRuntime:
    """One worker's QoS state (in `Runtime.qos`); `clock` is injectable for tests."""

    def __init__(self, worker: int = 0, state_dir: str | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics: QosMetrics | None = None):
        self.worker = worker
        self.state_dir = state_dir
        self.clock = clock
        self.cfg: QosConfig | None = None
        self.slo = SloWindows()
        self.breaker = GlitchBreaker()
        self._metrics = metrics
        self._index: int | None = None  # the current window's number
        self._published = -1e18
        self.windows_closed = 0
        self._children: dict[tuple, Any] = {}

    def count(self, metric: Any, labels: tuple[str, ...], sink: Any = None) -> None:
        """A per-request counter: buffered in the worker's `Pending` (`sink`: Runtime.metrics_sink, flushed
        every 250 ms with the other request metrics) when there is one; the labelled child is cached."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        if sink is not None:
            sink.pending.inc(child)
        else:
            child.inc()

    @property
    def metrics(self) -> QosMetrics:
        if self._metrics is None:
            self._metrics = QosMetrics()
        return self._metrics

    def configure(self, cfg: QosConfig | None) -> None:
        if cfg is None:
            self.cfg = None
            return
        if self.cfg is not None and self.cfg.window != cfg.window:
            self._index = None
        self.cfg = cfg
        self.slo.configure(cfg.slos, cfg.horizon)
        self.breaker.configure(cfg.breaker, cfg.thresholds)

    def advance(self, now: float | None = None) -> None:
        """Close every window that ended before `now`."""
        cfg = self.cfg
        if cfg is None:
            return
        now = self.clock() if now is None else now
        index = int(now // cfg.window)
        if self._index is None:
            self._index = index
            return
        if index <= self._index:
            return
        b = cfg.breaker
        lookback = cfg.horizon + b.max_gap + b.recovery_windows + b.windows + 1
        first = max(self._index, index - lookback)
        for i in range(first, index):
            self._close(i)
        self._index = index
        if self.state_dir and now - self._published >= PUBLISH_EVERY:
            self._published = now
            self.publish(now)

    def _close(self, index: int) -> None:
        cfg = self.cfg
        m = self.metrics
        self.windows_closed += 1
        for st, w in self.slo.close(index, cfg.matrix_below, cfg.matrix_recover):
            counted = dict(w.counted)
            for o, met in w.met:
                if counted[o]:
                    m.slo_requests.labels(st.slo.name, o, "met").inc(met)
                    m.slo_requests.labels(st.slo.name, o, "missed").inc(counted[o] - met)
            if w.counted and any(c for _, c in w.counted):
                for o, (met, c) in st.attainment().items():
                    if c:
                        m.attainment.labels(st.slo.name, o).set(met / c)
            m.escalated.labels(st.slo.name).set(1 if st.escalated else 0)
        for t in self.breaker.close(index):
            if t.opened:
                m.trips.labels(t.tenant).inc()
                log.warning("glitch breaker open for tenant %s: P99 %.2f ms over its %.2f ms threshold for %d "
                            "windows in a row; its non-critical requests are shed (worker %s)", t.tenant,
                            (t.p99 or 0) * 1000, t.threshold * 1000, cfg.breaker.windows, self.worker)
            else:
                log.warning("glitch breaker closed for tenant %s: %d windows within its %.2f ms threshold "
                            "(worker %s)", t.tenant, cfg.breaker.recovery_windows, t.threshold * 1000, self.worker)
            m.open.labels(t.tenant).set(1 if t.opened else 0)
        for tenant, tb in self.breaker.tenants.items():
            if tb.last_p99 is not None:
                m.tenant_p99.labels(tenant).set(tb.last_p99)

    def escalated(self, route: str | None, tenant: str | None, cls: str | None) -> bool:
        return self.slo.escalated(route, tenant, cls)

    def record(self, sample: Any, route: str | None, tenant: str | None, cls: str | None) -> None:
        if sample is None:
            return
        self.slo.record(sample, route, tenant, cls)
        if tenant is not None and tenant in self.breaker.tenants:
            latency = sample.ttft if self.cfg is not None and self.cfg.breaker.latency == "ttft" else sample.e2e
            self.breaker.record(tenant, latency)

    def view(self, now: float | None = None) -> dict[str, Any]:
        """This worker's state, as published for `adapterctl status`."""
        slos = {}
        for name, st in self.slo.states.items():
            last = st.last
            slos[name] = {"horizon": {o: {"met": m, "counted": c} for o, (m, c) in st.attainment().items()},
                          "total": {o: {"met": st.totals[0][o], "counted": st.totals[1][o]} for o in st.slo.objectives},
                          "targets": {o: st.slo.target_of(o) for o in st.slo.objectives},
                          "deviation": st.deviation(), "escalated": st.escalated,
                          "last_window_p99_s": last.p99 if last is not None else None}
        tenants = {t: {"open": b.open, "last_p99_s": b.last_p99, "threshold_s": b.threshold, "trips": b.trips,
                       "run": b.run, "calm": b.calm} for t, b in self.breaker.tenants.items()}
        return {"worker": self.worker, "pid": os.getpid(), "time": time.time(),
                "window_s": self.cfg.window if self.cfg else None, "slos": slos, "tenants": tenants}

    def publish(self, now: float | None = None) -> None:
        if not self.state_dir:
            return
        path = Path(self.state_dir) / f"qos-{self.worker}.json"
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.view(now)))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("cannot publish QoS state to %s: %s", path, e)


def aggregate(state_dir: str | None, now: float | None = None) -> dict[str, Any] | None:
    """Every worker's published QoS state added up: per SLO the workers' met/counted summed (so the
    attainment is gateway-wide), per tenant the breaker open if open in any worker (and which)."""
    if not state_dir:
        return None
    files = sorted(Path(state_dir).glob("qos-*.json"))
    if not files:
        return None
    now = time.time() if now is None else now
    workers, slos, tenants = [], {}, {}
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        workers.append({"worker": doc.get("worker"), "pid": doc.get("pid"),
                        "age_s": round(now - float(doc.get("time", now)), 3)})
        for name, s in (doc.get("slos") or {}).items():
            agg = slos.setdefault(name, {"horizon": {}, "total": {}, "targets": s.get("targets", {}),
                                         "escalated_workers": []})
            for part in ("horizon", "total"):
                for o, v in (s.get(part) or {}).items():
                    cur = agg[part].setdefault(o, {"met": 0, "counted": 0})
                    cur["met"] += v.get("met", 0)
                    cur["counted"] += v.get("counted", 0)
            if s.get("escalated"):
                agg["escalated_workers"].append(doc.get("worker"))
        for t, v in (doc.get("tenants") or {}).items():
            agg = tenants.setdefault(t, {"open_workers": [], "threshold_s": v.get("threshold_s"), "trips": 0,
                                         "last_p99_s": None})
            agg["trips"] += v.get("trips", 0)
            if v.get("open"):
                agg["open_workers"].append(doc.get("worker"))
            p = v.get("last_p99_s")
            if p is not None and (agg["last_p99_s"] is None or p > agg["last_p99_s"]):
                agg["last_p99_s"] = p
    for s in slos.values():
        for part in ("horizon", "total"):
            for v in s[part].values():
                v["attainment"] = v["met"] / v["counted"] if v["counted"] else None
        devs = [100 * v["attainment"] - s["targets"].get(o, 100) for o, v in s["horizon"].items()
                if v["attainment"] is not None]
        s["deviation"] = min(devs) if devs else None
    for t in tenants.values():
        t["open"] = bool(t["open_workers"])
    return {"workers": workers, "slos": slos, "tenants": tenants}


__all__ = ["QosConfig", "RouteQos", "compile_qos", "qos_of", "QosRuntime", "QosMetrics", "aggregate"]
