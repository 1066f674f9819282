"""The batch control loop: every 100 ms, SLO attainment in, a batching setting out to the server.

What: `BatchController` drives one model on one ONNX Runtime server (backends/onnxruntime) with one
policy (`extproc/qos/batch_policy.py`). Each `tick()` (one window):
1. reads the server's own latency histogram `ort_request_time_seconds{model}` from `GET /metrics`
   (cumulative counts) and takes the difference with the previous tick: requests = the window's
   count, met = the window's count in the bucket `le = slo_latency` (the SLO threshold must be one of
   the histogram's bucket bounds, checked at construction: 0.1, 0.25, 0.5 ms, 1, 2.5, 5, 10, 25, 50,
   100 ms, ...), attainment = met / requests;
2. asks the policy for the next setting;
3. writes it with `POST /admin/models/{m}/batching` (`max_batch_size`, `max_queue_delay_us`, plus the
   controller's `owner` and `lease_ms`) when it changed or when half the lease has passed; the
   server answers the settings now in force, which become `applied`.
`ControlLoop` runs ticks on a thread of its own at a fixed period (100 ms, drift-free: tick k is due
at start + k * period; a late tick is not repeated), off the request path.

Why the server's histogram, not the gateway's SLO windows (extproc/qos/slo.py): the gateway's windows
are per worker (each sees its share of the traffic) and are published every 0.5 s, too coarse for a
100 ms loop; the server sees every request of every gateway replica and worker, and its histogram is
exact per window. It measures server time (parse to encoded answer, queue wait included), not the
network hop.

Only one controller acts per endpoint: within one process, `BatchControlRuntime` keeps at most one
controller per (server, model) (a second `add` raises). Across processes and gateway replicas, the
server arbitrates: a write carries `owner` and `lease_ms` (default 1000 ms) and the server refuses
(409) writes from anyone else while the lease is held (backends/onnxruntime/server.py
`_BatchingLeases`). A controller that gets 409 is a standby: it keeps reading (cheap) but writes
nothing, and tries to take the lease again once the holder's lease could have expired; when the
active one stops (or dies), its lease lapses and a standby takes over within one lease.
Where it runs: in the supervisor (`Supervisor.batch_control`, a `BatchControlRuntime`), one thread
per (endpoint, model) declared in `spec.qos.batchControl`, reconfigured on every accepted reload
(loops whose plan did not change keep running and keep their policy's state): one per gateway, off
every worker's request path, like the canary controller's thread; workers never talk to the ORT
admin endpoint. Standalone: `python -m extproc.qos.batch_control --server URL --model M`.
Cost: per tick one GET /metrics (a few KB of text: about 1 ms of CPU in this process and as much in the
server) and, when the setting changes, one POST; nothing per inference request.
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from extproc.qos.batch_policy import POLICIES, BatchSetting, Observation, make_policy

__all__ = ["BatchControlRuntime", "BatchController", "BatchPlan", "ControlLoop", "LeaseHeld", "OrtBatchingClient",
           "SLO_BUCKETS", "TickRecord", "check_batch_control", "plans_from"]

log = logging.getLogger(__name__)

# the bounds of the server's ort_request_time_seconds histogram (backends/onnxruntime/metrics.py)
SLO_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DEFAULT_LEASE_MS = 1000


class LeaseHeld(RuntimeError):
    """The server refused a write: another controller holds the model's batching lease (409)."""


class OrtBatchingClient:
    """HTTP client of one model's batching admin endpoint and latency histogram on one server."""

    def __init__(self, base_url: str, model: str, *, timeout: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout)
        m = re.escape(model)
        self._bucket = re.compile(rf'^ort_request_time_seconds_bucket{{(?=[^}}]*model="{m}")[^}}]*le="([^"]+)"[^}}]*}} (\S+)$',
                                  re.M)
        self._count = re.compile(rf'^ort_request_time_seconds_count{{model="{m}"}} (\S+)$', re.M)

    def close(self) -> None:
        self._http.close()

    def latency_counts(self, threshold: float) -> tuple[float, float]:
        """(requests within `threshold` seconds, all requests) since the server started, cumulative."""
        text = self._http.get("/metrics").raise_for_status().text
        total = self._count.search(text)
        if total is None:
            return 0.0, 0.0
        within = 0.0
        for le, value in self._bucket.findall(text):
            if le != "+Inf" and math.isclose(float(le), threshold, rel_tol=1e-9):
                within = float(value)
                break
        return within, float(total.group(1))

    def settings(self) -> dict[str, dict[str, Any]]:
        """`{"<version>": {"max_batch_size", "max_queue_delay_us", "enabled", "batchable", "owner"}}`."""
        return self._http.get(f"/admin/models/{self.model}/batching").raise_for_status().json()

    def apply(self, setting: BatchSetting, owner: str | None = None,
              lease_ms: int | None = None) -> dict[str, dict[str, Any]]:
        body: dict[str, Any] = setting.as_body()
        if owner is not None:
            body["owner"] = owner
            body["lease_ms"] = lease_ms if lease_ms is not None else DEFAULT_LEASE_MS
        r = self._http.post(f"/admin/models/{self.model}/batching", json=body)
        if r.status_code == 409:
            raise LeaseHeld(r.json().get("error", r.text))
        r.raise_for_status()
        return r.json()

    def release(self, owner: str) -> None:
        r = self._http.post(f"/admin/models/{self.model}/batching", json={"owner": owner, "lease_ms": 0})
        if r.status_code not in (200, 409):
            r.raise_for_status()


@dataclass(frozen=True, slots=True)
class TickRecord:
    at: float  # the clock's time of the tick
    requests: int
    attainment: float | None
    wanted: BatchSetting
    applied: BatchSetting | None  # what the server reported back after a write; None: no write
    acting: bool  # False: standby (another controller holds the lease)


@dataclass
class BatchController:
    """One policy on one model of one server; `tick()` is one window. Not thread-safe: one caller."""

    policy: Any  # a batch_policy policy, or None: made by `policy_factory` from the server's setting at start
    client: OrtBatchingClient
    slo_latency: float  # seconds; one of SLO_BUCKETS
    owner: str = field(default_factory=lambda: f"batch-control-{uuid.uuid4().hex[:12]}")
    lease_ms: int = DEFAULT_LEASE_MS
    clock: Callable[[], float] = time.monotonic
    history_limit: int = 100_000
    acting: bool = True
    applied: BatchSetting | None = None
    history: list[TickRecord] = field(default_factory=list)
    policy_factory: Callable[[BatchSetting], Any] | None = None
    _prev: tuple[float, float] | None = None
    _written_at: float = -math.inf
    _retry_at: float = -math.inf

    def __post_init__(self) -> None:
        if not any(math.isclose(self.slo_latency, b, rel_tol=1e-9) for b in SLO_BUCKETS):
            raise ValueError(f"slo_latency: {self.slo_latency * 1000:g} ms is not a bucket bound of the "
                             f"server's ort_request_time_seconds (ms: {', '.join(f'{b * 1000:g}' for b in SLO_BUCKETS)})")
        if not 1 <= self.lease_ms <= 60_000:
            raise ValueError(f"lease_ms: {self.lease_ms} is outside [1, 60000]")

    def start(self) -> None:
        """Take the lease and write the policy's initial setting; read the histogram's baseline."""
        if self.policy is None:
            assert self.policy_factory is not None, "a policy or a policy_factory"
            first = next(iter(self.client.settings().values()))
            self.policy = self.policy_factory(BatchSetting(first["max_batch_size"], first["max_queue_delay_us"]))
        self._prev = self.client.latency_counts(self.slo_latency)
        self._write(self.policy.initial(), self.clock())

    def observe(self) -> Observation:
        now = self.client.latency_counts(self.slo_latency)
        prev, self._prev = self._prev or now, now
        requests = int(now[1] - prev[1])
        if requests < 0:  # the server restarted: its counters began again
            requests, met = int(now[1]), now[0]
        else:
            met = now[0] - prev[0]
        return Observation(met / requests if requests > 0 else None, requests)

    def tick(self) -> TickRecord:
        now = self.clock()
        obs = self.observe()
        wanted = self.policy.decide(obs)
        applied = None
        due = (wanted != self.applied or now - self._written_at >= self.lease_ms / 2000)
        if due and (self.acting or now >= self._retry_at):
            applied = self._write(wanted, now)
        rec = TickRecord(now, obs.requests, obs.attainment, wanted, applied, self.acting)
        if len(self.history) < self.history_limit:
            self.history.append(rec)
        return rec

    def _write(self, setting: BatchSetting, now: float) -> BatchSetting | None:
        try:
            reported = self.client.apply(setting, self.owner, self.lease_ms)
        except LeaseHeld as exc:
            if self.acting:
                log.warning("batch control %s on %s: standby (%s)", self.owner, self.client.model, exc)
            self.acting = False
            self._retry_at = now + self.lease_ms / 1000
            return None
        if not self.acting:
            log.warning("batch control %s on %s: took the lease, acting", self.owner, self.client.model)
        self.acting = True
        self._written_at = now
        first = next(iter(reported.values()))
        self.applied = BatchSetting(first["max_batch_size"], first["max_queue_delay_us"])
        return self.applied

    def stop(self) -> None:
        """Give the lease back (a standby elsewhere takes over at its next try)."""
        if self.acting:
            try:
                self.client.release(self.owner)
            except httpx.HTTPError as exc:
                log.warning("batch control %s: releasing the lease failed: %s", self.owner, exc)


class ControlLoop:
    """Runs a controller's `tick()` every `period` seconds on its own thread until `stop()`."""

    def __init__(self, controller: BatchController, period: float = 0.1) -> None:
        if not 0.001 <= period <= 60:
            raise ValueError(f"period: {period} s is outside [0.001, 60]")
        self.controller, self.period = controller, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"batch-control-{controller.client.model}",
                                        daemon=True)
        self.errors = 0
        self.started = False
        self.late = 0  # ticks skipped because the previous one ran past their due time

    def start(self) -> "ControlLoop":
        """Start the controller (lease, initial setting) and the thread; a server that cannot be
        reached yet is retried by the thread every period, so a gateway may start before its server."""
        try:
            self.controller.start()
            self.started = True
        except (httpx.HTTPError, ValueError, KeyError, StopIteration) as exc:
            log.warning("batch control for %s on %s: not started yet (%s); retrying every %g s",
                        self.controller.client.model, self.controller.client.base_url, exc, self.period)
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        k = 1
        while not self._stop.wait(max(0.0, start + k * self.period - time.monotonic())):
            try:
                if not self.started:
                    self.controller.start()
                    self.started = True
                else:
                    self.controller.tick()
            except (httpx.HTTPError, ValueError, KeyError, StopIteration) as exc:
                self.errors += 1
                log.warning("batch control tick failed: %s", exc)
            k += 1
            behind = int((time.monotonic() - start) / self.period) + 1
            if behind > k:
                self.late += behind - k
                k = behind

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.started:
            self.controller.stop()
        self.controller.client.close()


@dataclass(frozen=True)
class BatchPlan:
    """One controller to run: compiled from `spec.qos.batchControl[]` for one endpoint of its backend."""

    backend: str
    base_url: str
    model: str
    policy: str
    slo: float  # seconds
    period: float  # seconds
    lease_ms: int
    params: tuple[tuple[str, Any], ...]  # the policy's parameters (batch_policy field names)

    def loop(self, owner: str) -> ControlLoop:
        params = dict(self.params)
        ctl = BatchController(None, OrtBatchingClient(self.base_url, self.model), self.slo, owner=owner,
                              lease_ms=self.lease_ms,
                              policy_factory=lambda configured: make_policy(self.policy, configured, **params))
        return ControlLoop(ctl, self.period)


_BRIEF_FIELDS = ("base", "low", "high", "gain", "boost", "min_size", "max_size")
_AIMD_FIELDS = ("target", "start", "step", "factor", "hold", "cooldown", "min_size", "max_size")


def _params(spec: Any) -> tuple[tuple[str, Any], ...]:
    if spec.policy == "brief":
        return tuple((f, getattr(spec.brief, f)) for f in _BRIEF_FIELDS)
    if spec.policy == "aimd":
        return tuple((f, getattr(spec.aimd, f)) for f in _AIMD_FIELDS if getattr(spec.aimd, f) is not None)
    return ()


def check_batch_control(specs: Any, backends: Any, issue: Callable[[tuple, str], None]) -> None:
    """Validate `spec.qos.batchControl` (schema.QosBatchControlSpec items) at their field paths."""
    seen: set[tuple[str, str]] = set()
    for i, s in enumerate(specs):
        where = ("spec", "qos", "batchControl", i)
        backend = backends.get(s.backend)
        if backend is None:
            issue(where + ("backend",), f"unknown backend {s.backend!r} (backends: {', '.join(backends) or 'none'})")
        elif backend.kind != "onnxruntime":
            issue(where + ("backend",), f"backend {s.backend!r} is of kind {backend.kind}: batch control drives "
                  "our ONNX Runtime server's admin endpoint (kind onnxruntime)")
        elif backend.models and s.model not in backend.models:
            issue(where + ("model",), f"backend {s.backend!r} does not serve model {s.model!r} "
                  f"(models: {', '.join(backend.models)})")
        if (s.backend, s.model) in seen:
            issue(where, f"model {s.model!r} of backend {s.backend!r} has a batch controller already "
                  "(one controller per endpoint and model)")
        seen.add((s.backend, s.model))
        if not any(math.isclose(s.slo, b, rel_tol=1e-9) for b in SLO_BUCKETS):
            issue(where + ("slo",), f"{s.slo * 1000:g} ms is not a bucket bound of the server's "
                  f"ort_request_time_seconds (ms: {', '.join(f'{b * 1000:g}' for b in SLO_BUCKETS)})")
        try:
            make_policy(s.policy, BatchSetting(32, 1000), **dict(_params(s)))
        except ValueError as exc:
            field_, _, reason = str(exc).partition(": ")
            name = field_.split("/")[0]
            issue(where + (s.policy, re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)), reason or str(exc))


def plans_from(qos_spec: Any, backends: Any) -> tuple[BatchPlan, ...]:
    """The controllers a validated config asks for: one per endpoint of each entry's backend."""
    if qos_spec is None:
        return ()
    out = []
    for s in qos_spec.batch_control:
        backend = backends[s.backend]
        for host, port in backend.endpoints:
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            out.append(BatchPlan(s.backend, url, s.model, s.policy, s.slo, s.period, max(1, round(s.lease * 1000)),
                                 _params(s)))
    return tuple(out)


class BatchControlRuntime:
    """The long-lived controllers of one process, at most one per (server, model)."""

    def __init__(self, owner_prefix: str = "gateway") -> None:
        self.loops: dict[tuple[str, str], ControlLoop] = {}
        self.plans: dict[tuple[str, str], BatchPlan] = {}
        self.owner = f"{owner_prefix}-{uuid.uuid4().hex[:8]}"  # one per process: replicas differ

    def add(self, loop: ControlLoop) -> ControlLoop:
        key = (loop.controller.client.base_url, loop.controller.client.model)
        if key in self.loops:
            raise ValueError(f"a batch controller for model {key[1]!r} on {key[0]} runs already "
                             "(one controller per endpoint)")
        self.loops[key] = loop
        return loop.start()

    def configure(self, plans: tuple[BatchPlan, ...]) -> None:
        """Run exactly `plans`: unchanged ones keep running (and their policy's state), others stop or start."""
        wanted = {(p.base_url, p.model): p for p in plans}
        for key in list(self.loops):
            if self.plans.get(key) != wanted.get(key):
                self.loops.pop(key).stop()
                self.plans.pop(key, None)
        for key, plan in wanted.items():
            if key not in self.loops:
                self.plans[key] = plan
                self.add(plan.loop(f"{self.owner}-{plan.backend}"))

    def status(self) -> list[dict[str, Any]]:
        out = []
        for (url, model), loop in self.loops.items():
            ctl = loop.controller
            last = ctl.history[-1] if ctl.history else None
            out.append({"server": url, "model": model, "policy": getattr(ctl.policy, "name", None),
                        "acting": ctl.acting and loop.started, "started": loop.started,
                        "applied": None if ctl.applied is None else ctl.applied.as_body(),
                        "attainment": None if last is None else last.attainment, "errors": loop.errors})
        return out

    def stop(self) -> None:
        for loop in self.loops.values():
            loop.stop()
        self.loops.clear()
        self.plans.clear()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m extproc.qos.batch_control",
                                description="Run one batch policy against one model of an ONNX Runtime server.")
    p.add_argument("--server", required=True, help="the server's HTTP base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--policy", choices=POLICIES, default="brief")
    p.add_argument("--slo-ms", type=float, default=5.0, help="latency objective (a histogram bucket bound)")
    p.add_argument("--period-ms", type=float, default=100.0)
    p.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = OrtBatchingClient(args.server, args.model)
    first = next(iter(client.settings().values()))
    configured = BatchSetting(first["max_batch_size"], first["max_queue_delay_us"])
    ctl = BatchController(make_policy(args.policy, configured), client, args.slo_ms / 1000, lease_ms=args.lease_ms)
    loop = ControlLoop(ctl, args.period_ms / 1000).start()
    try:
        while True:
            time.sleep(1.0)
            rec = ctl.history[-1] if ctl.history else None
            if rec is not None:
                log.info("attainment %s over %d requests; size %d (%s)",
                         "-" if rec.attainment is None else f"{rec.attainment:.3f}", rec.requests,
                         rec.wanted.max_batch_size, "acting" if ctl.acting else "standby")
    except KeyboardInterrupt:
        pass
    finally:
        loop.stop()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
