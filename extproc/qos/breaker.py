"""The glitch breaker (brief §4.3): a tenant whose P99 spikes for 3 windows in a row has its
non-critical requests shed until the spike passes.

What: per tenant with a `glitchThreshold` (`spec.qos.tenants[]`; the brief's example: tenant-a 8.5 ms,
tenant-b 12.0 ms), the latencies of its finished requests (end to end, or TTFT with
`breaker.latency: ttft`) are collected per window (`spec.qos.window`, 100 ms). At each window close:
  p99      = nearest-rank 99th percentile of the window's latencies
  quiet    = fewer than `minSamples` latencies in the window
  over     = not quiet and p99 > threshold
closed breaker: over -> run += 1, and run == `windows` (3) trips it (open); a window that is not over
  and not quiet resets run to 0; quiet windows leave run as it is, but more than `maxGap` quiet windows
  in a row reset it (a spike is consecutive windows, not three slow requests an hour apart);
open breaker: over -> calm = 0; any other window (quiet included: a tenant whose shed traffic was all
  it sent has no latencies left to show) -> calm += 1, and calm == `recoveryWindows` (3) closes it.
While open, the tenant's requests whose class is not critical (P0 by default) get 429 `tenant_glitch`
with `Retry-After` in the route's error dialect (`extproc/stages/qos_admit.py`); shed requests are not
samples. Trips and recoveries are logged (one line each), counted (`adapter_qos_breaker_trips_total`),
exported as `adapter_qos_breaker_open{tenant}` and shown by `adapterctl status`.
Across workers: each worker judges the requests it served (per-worker P99 over its share of the
tenant's traffic); the gauge's multiprocess mode is max (open in any worker) and status lists which
workers have it open.
Parameters: threshold per tenant, windows, recoveryWindows, minSamples, maxGap (schema.QosBreakerSpec).
Cost: per finished request of a tenant with a threshold, one list append; per window close and
tenant, one sort of that window's latencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from extproc.qos.slo import MAX_SAMPLES, p99


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    windows: int = 3
    recovery_windows: int = 3
    min_samples: int = 1
    max_gap: int = 10
    latency: str = "e2e"  # or "ttft"
    retry_after: int = 1


@dataclass(frozen=True, slots=True)
class Transition:
    tenant: str
    opened: bool  # True: tripped, False: recovered
    p99: float | None
    threshold: float


class TenantBreaker:
    __slots__ = ("tenant", "threshold", "samples", "run", "gap", "calm", "open", "last_p99", "trips", "since")

    def __init__(self, tenant: str, threshold: float):
        self.tenant = tenant
        self.threshold = threshold
        self.samples: list[float] = []
        self.run = 0  # consecutive windows over the threshold (closed breaker)
        self.gap = 0  # quiet windows in a row
        self.calm = 0  # windows not over the threshold since it opened
        self.open = False
        self.last_p99: float | None = None
        self.trips = 0
        self.since: int | None = None  # window index it opened at

    def add(self, latency: float) -> None:
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(latency)

    def close(self, cfg: BreakerConfig, index: int) -> Transition | None:
        samples, self.samples = self.samples, []
        quiet = len(samples) < cfg.min_samples
        value = None if quiet else p99(samples)
        self.last_p99 = value
        over = value is not None and value > self.threshold
        if not self.open:
            if quiet:
                self.gap += 1
                if self.gap > cfg.max_gap:
                    self.run = 0
                return None
            self.gap = 0
            if not over:
                self.run = 0
                return None
            self.run += 1
            if self.run >= cfg.windows:
                self.open, self.calm, self.run, self.since = True, 0, 0, index
                self.trips += 1
                return Transition(self.tenant, True, value, self.threshold)
            return None
        if over:
            self.calm = 0
            return None
        self.calm += 1
        if self.calm >= cfg.recovery_windows:
            self.open, self.calm, self.gap, self.since = False, 0, 0, None
            return Transition(self.tenant, False, value, self.threshold)
        return None


class GlitchBreaker:
    """Every tenant's breaker in one worker; `configure` keeps a tenant's state while its threshold stays."""

    def __init__(self) -> None:
        self.cfg = BreakerConfig()
        self.tenants: dict[str, TenantBreaker] = {}

    def configure(self, cfg: BreakerConfig, thresholds: Mapping[str, float]) -> None:
        old = self.tenants
        self.cfg = cfg
        self.tenants = {}
        for tenant, threshold in thresholds.items():
            prev = old.get(tenant)
            self.tenants[tenant] = prev if prev is not None and prev.threshold == threshold \
                else TenantBreaker(tenant, threshold)

    def record(self, tenant: str | None, latency: float | None) -> None:
        if tenant is None or latency is None:
            return
        b = self.tenants.get(tenant)
        if b is not None:
            b.add(latency)

    def close(self, index: int) -> list[Transition]:
        out = []
        for b in self.tenants.values():
            t = b.close(self.cfg, index)
            if t is not None:
                out.append(t)
        return out

    def is_open(self, tenant: str | None) -> bool:
        b = self.tenants.get(tenant) if tenant is not None else None
        return b is not None and b.open

    def open_tenants(self) -> Iterable[str]:
        return [t for t, b in self.tenants.items() if b.open]


__all__ = ["GlitchBreaker", "TenantBreaker", "BreakerConfig", "Transition"]
