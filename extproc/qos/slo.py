"""SLO attainment over fixed windows (100 ms by default), per worker, from each request's end.

What: an `Slo` (compiled from `spec.qos.slos[]`) selects requests by route, tenant and priority class
and declares objectives; `measure(state, outcome, now)` turns one finished request into a `Sample`
(TTFT, time per output token, end-to-end latency, error); `SloWindows` counts, per SLO and objective,
the requests that met it in the current window and keeps the last `horizon` closed windows.
Per request and objective ("met" / "counted"):
- ttft: OK streamed requests, TTFT = first response body seen by the stream - start; met if <= threshold;
- tpot: OK streamed requests with more than one output token, (duration - TTFT) / (output tokens - 1)
  (the OpenTelemetry GenAI definition, `extproc/genai.py`); met if <= threshold;
- e2e (`p99`): OK requests, duration = Envoy's or the stream's end - start; met if <= threshold;
- error: requests a backend was asked for (not refused by the gateway, not cancelled by the client);
  met unless the outcome is backend_error, timeout or truncated.
Formulas, over the last `horizon` windows (a window's own numbers are in `last`):
  attainment(o) = sum(met) / sum(counted)                        (None when nothing was counted)
  target(o)     = slo.target for ttft, tpot, e2e; 100 - errorRate for error
  deviation     = min over objectives with data of (100 * attainment(o) - target(o))   [points]
  escalated     = deviation < matrix.below, and stays so until deviation >= matrix.recover (or no data)
A window's p99 (nearest rank over its e2e latencies, kept up to MAX_SAMPLES) is reported too.
Across workers: each worker counts its own requests (its windows are its share of the traffic); the
status command adds the workers' counts (`extproc/qos/engine.py` publishes them), and the Prometheus
counters `adapter_qos_slo_requests_total` are summed by the multiprocess collector, so the gateway-wide
attainment is exact; the matrix decides on the worker's own share.
Cost: per finished request, one loop over the declared SLOs with up to three comparisons each and a
few integer additions; per window close, O(SLOs x objectives).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from extproc.types import Outcome

OBJECTIVES = ("ttft", "tpot", "e2e", "error")
ERROR_OUTCOMES = frozenset({Outcome.BACKEND_ERROR, Outcome.TIMEOUT, Outcome.TRUNCATED})
MAX_SAMPLES = 4096  # e2e latencies kept per window for its p99


@dataclass(frozen=True, slots=True)
class Slo:
    name: str
    route: str | None
    tenant: str | None
    priority_class: str | None
    ttft: float | None  # seconds
    tpot: float | None
    e2e: float | None
    error_rate: float | None  # percent
    target: float  # percent

    def selects(self, route: str | None, tenant: str | None, cls: str | None) -> bool:
        return ((self.route is None or self.route == route) and (self.tenant is None or self.tenant == tenant)
                and (self.priority_class is None or self.priority_class == cls))

    def target_of(self, objective: str) -> float:
        return 100.0 - (self.error_rate or 0.0) if objective == "error" else self.target

    @property
    def objectives(self) -> tuple[str, ...]:
        return tuple(o for o, v in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e),
                                    ("error", self.error_rate)) if v is not None)


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request as the SLOs see it (None: not counted for that objective)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    error: bool | None = None


def measure(state: Any, outcome: Outcome, now: float) -> Sample | None:
    """The request's sample, or None when it says nothing about service (refused by the gateway,
    cancelled by the client)."""
    if outcome is Outcome.REJECTED or outcome is Outcome.CANCELLED:
        return None
    if outcome is not Outcome.OK:
        return Sample(error=outcome in ERROR_OUTCOMES)
    c = state.completion
    duration = c.duration if c is not None and c.duration is not None else now - state.started
    ttft = tpot = None
    req = state.request
    if req is not None and req.stream and state.first_body is not None:
        ttft = max(0.0, state.first_body - state.started)
        usage = state.usage
        tokens = usage.completion_tokens if usage is not None and usage.completion_tokens else None
        if tokens is None:
            from extproc.genai import estimate_output_tokens

            tokens = estimate_output_tokens(state)
        if tokens and tokens > 1 and duration > ttft:
            tpot = (duration - ttft) / (tokens - 1)
    return Sample(ttft=ttft, tpot=tpot, e2e=duration, error=False)


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile: the smallest value with at least 99 % of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class _Counts:
    __slots__ = ("met", "counted", "e2e")

    def __init__(self) -> None:
        self.met = dict.fromkeys(OBJECTIVES, 0)
        self.counted = dict.fromkeys(OBJECTIVES, 0)
        self.e2e: list[float] = []


@dataclass(frozen=True, slots=True)
class WindowSummary:
    index: int  # window number: floor(monotonic seconds / window)
    met: tuple[tuple[str, int], ...]
    counted: tuple[tuple[str, int], ...]
    p99: float | None


class SloState:
    """One SLO's windows in one worker."""

    __slots__ = ("slo", "current", "history", "escalated", "last", "totals")

    def __init__(self, slo: Slo, horizon: int):
        self.slo = slo
        self.current = _Counts()
        self.history: deque[WindowSummary] = deque(maxlen=horizon)
        self.escalated = False
        self.last: WindowSummary | None = None
        self.totals = (dict.fromkeys(OBJECTIVES, 0), dict.fromkeys(OBJECTIVES, 0))  # since start: met, counted

    def add(self, s: Sample) -> None:
        slo, cur = self.slo, self.current
        met, counted = cur.met, cur.counted
        if s.error is not None and slo.error_rate is not None:
            counted["error"] += 1
            met["error"] += not s.error
        if s.ttft is not None and slo.ttft is not None:
            counted["ttft"] += 1
            met["ttft"] += s.ttft <= slo.ttft
        if s.tpot is not None and slo.tpot is not None:
            counted["tpot"] += 1
            met["tpot"] += s.tpot <= slo.tpot
        if s.e2e is not None and slo.e2e is not None:
            counted["e2e"] += 1
            met["e2e"] += s.e2e <= slo.e2e
            if len(cur.e2e) < MAX_SAMPLES:
                cur.e2e.append(s.e2e)

    def close(self, index: int) -> WindowSummary:
        cur = self.current
        objs = self.slo.objectives
        w = WindowSummary(index, tuple((o, cur.met[o]) for o in objs), tuple((o, cur.counted[o]) for o in objs),
                          p99(cur.e2e))
        for o in objs:
            self.totals[0][o] += cur.met[o]
            self.totals[1][o] += cur.counted[o]
        self.history.append(w)
        self.last = w
        self.current = _Counts()
        return w

    def attainment(self) -> dict[str, tuple[int, int]]:
        """objective -> (met, counted) over the horizon."""
        out: dict[str, list[int]] = {o: [0, 0] for o in self.slo.objectives}
        for w in self.history:
            for o, n in w.met:
                out[o][0] += n
            for o, n in w.counted:
                out[o][1] += n
        return {o: (m, c) for o, (m, c) in out.items()}

    def deviation(self) -> float | None:
        worst = None
        for o, (m, c) in self.attainment().items():
            if c:
                d = 100.0 * m / c - self.slo.target_of(o)
                worst = d if worst is None or d < worst else worst
        return worst

    def update_escalation(self, below: float, recover: float) -> bool:
        d = self.deviation()
        if d is None:
            self.escalated = False
        elif d < below:
            self.escalated = True
        elif d >= recover:
            self.escalated = False
        return self.escalated


class SloWindows:
    """Every declared SLO's state in one worker; `configure` keeps the windows of SLOs whose
    definition did not change across a reload."""

    def __init__(self) -> None:
        self.states: dict[str, SloState] = {}
        self.slos: tuple[Slo, ...] = ()

    def configure(self, slos: Iterable[Slo], horizon: int) -> None:
        old = self.states
        self.slos = tuple(slos)
        self.states = {}
        for s in self.slos:
            prev = old.get(s.name)
            if prev is not None and prev.slo == s and prev.history.maxlen == horizon:
                self.states[s.name] = prev
            else:
                self.states[s.name] = SloState(s, horizon)

    def record(self, sample: Sample, route: str | None, tenant: str | None, cls: str | None) -> None:
        for st in self.states.values():
            if st.slo.selects(route, tenant, cls):
                st.add(sample)

    def close(self, index: int, below: float, recover: float) -> list[tuple[SloState, WindowSummary]]:
        out = []
        for st in self.states.values():
            out.append((st, st.close(index)))
            st.update_escalation(below, recover)
        return out

    def escalated(self, route: str | None, tenant: str | None, cls: str | None) -> bool:
        for st in self.states.values():
            if st.escalated and st.slo.selects(route, tenant, cls):
                return True
        return False


__all__ = ["Slo", "Sample", "measure", "p99", "SloState", "SloWindows", "WindowSummary", "OBJECTIVES"]
