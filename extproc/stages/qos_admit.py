"""Stage `qos-admit`: the request's priority class, the priority matrix and the glitch breaker, at request headers.

What (routes of configs with `spec.qos`, right after `admit`, so the tenant is known and valid):
1. the base class (`extproc/qos/priority.base_class`: a trusted objective header on routes that
   declare one, the route's class, the tenant's, the default);
2. the matrix (`priority.matrix_class`): a request of a class the matrix applies to runs as the first
   class (latency work) or the last (throughput work) while an SLO it falls under is escalated
   (`extproc/qos/slo.py`);
3. the result goes to `state.attrs[PRIORITY_ATTR]` (a `PriorityClass`: scheduling plugins and a gateway
   queue read it; `qos-engine` passes it to the engine);
4. the glitch breaker (`extproc/qos/breaker.py`): while the tenant's breaker is open, a request whose
   class is not critical gets 429 `tenant_glitch` with `Retry-After`, in the route's error dialect.
At `on_done` the request's sample (TTFT, TPOT, end to end, error) goes into the worker's SLO windows
and the tenant's breaker, under the class it ran as (`Runtime.qos`, `extproc/qos/engine.py`); shed
requests are not samples.
Cost: `advance` (an integer division and a compare, a window close every 100 ms), three dict lookups,
one flag test per SLO; at `on_done` one `measure` and a loop over the SLOs.
"""

from __future__ import annotations

from typing import Any

from extproc.errors import reject
from extproc.qos.engine import QosConfig, QosRuntime
from extproc.qos.priority import BASE_ATTR, PRIORITY_ATTR, base_class, matrix_class
from extproc.qos.slo import measure
from extproc.types import HttpMessage, Outcome, RequestState, Verdict

SHED_ATTR = "qos.shed"


class QosAdmit:
    name = "qos-admit"

    def __init__(self, qos: QosConfig):
        self.qos = qos
        self._own: QosRuntime | None = None  # without a runtime (unit tests)

    def runtime(self, state: RequestState) -> QosRuntime:
        rt = state.runtime
        q = getattr(rt, "qos", None) if rt is not None else None
        if q is None:
            if self._own is None:
                self._own = QosRuntime()
                self._own.configure(self.qos)
            q = self._own
        return q

    def on_request_headers(self, state: RequestState, msg: HttpMessage) -> Verdict | None:
        cfg = self.qos
        q = self.runtime(state)
        q.advance()
        route = state.route
        name = route.name if route is not None else None
        rq = cfg.routes.get(name)
        tenant = state.tenant
        base, source = base_class(cfg.classes, cfg.objectives, rq, cfg.tenant_classes.get(tenant), cfg.default,
                                  msg.headers)
        cls = base
        if cfg.matrix_enabled and base.name in cfg.matrix_applies and q.escalated(name, tenant, base.name):
            cls = matrix_class(base, rq.workload if rq is not None else "latency", True, cfg.first, cfg.last, True)
            if cls is not base:
                source = "matrix"
        state.attrs[BASE_ATTR] = (base, source)
        state.attrs[PRIORITY_ATTR] = cls
        sink = getattr(state.runtime, "metrics_sink", None)
        q.count(q.metrics.priority, (cls.name, source), sink)
        if not cls.critical and q.breaker.is_open(tenant):
            state.attrs[SHED_ATTR] = True
            q.count(q.metrics.shed, (tenant, name or "unknown"), sink)
            return reject(429, "tenant_glitch",
                          f"tenant {tenant}'s P99 latency is over its glitch threshold "
                          f"({cfg.thresholds[tenant] * 1000:g} ms) for {cfg.breaker.windows} windows in a row: its "
                          f"{cls.name} requests are shed until it recovers; retry later",
                          retry_after=cfg.breaker.retry_after, tenant=tenant, priority_class=cls.name)
        return None

    def on_done(self, state: RequestState, outcome: Outcome) -> None:
        cls = state.attrs.get(PRIORITY_ATTR)
        if cls is None or state.attrs.get(SHED_ATTR):
            return
        q = self.runtime(state)
        now = q.clock()
        q.advance(now)
        route = state.route
        q.record(measure(state, outcome, now), route.name if route is not None else None, state.tenant,
                 state.attrs[BASE_ATTR][0].name)


__all__ = ["QosAdmit", "SHED_ATTR"]
