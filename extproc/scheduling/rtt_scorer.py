"""Scorer `rtt-scorer`: lower network round-trip time to the endpoint scores higher.

What: the RTT of each candidate, from the first source that has it:
- `ebpf`: the tenant agent's shared snapshot (`ebpf/snapshot.py`, written by `ebpf/agent.py`
  with `--rtt-ports`): the kernel's TCP smoothed RTT per remote `addr:port`, which is what the
  endpoint-picker names endpoints by (tcp_rtt.bpf.c on tcp:tcp_probe; the agent runs on the
  Envoy host, so these are Envoy's connections to the engines). Per endpoint, not per tenant:
  the window mean (`window_mean_us`) when the agent's last window had samples, else the last
  srtt it saw (`last_srtt_us`, of unknown age: no traffic, no newer sample). A snapshot older
  than `staleAfterS` (agent dead or stuck) is not used;
- `ttfb`: without the agent (or for endpoints it has not seen), a per-endpoint EWMA of the
  upstream time to first byte Envoy reports at each request's end (`state.completion.
  first_upstream_byte`), learned in this plugin's `on_done` (the `Plugin` base registers it on the worker's
  `runtime.lifecycle.observers`). It is a proxy:
  network RTT plus the engine's queueing and prefill. Staleness: an endpoint's EWMA moves only when
  it serves requests, so it is dropped (unknown again) `maxAgeS` after its last observation: an
  endpoint shunned for a bad value is retried at the neutral score instead of being starved; each
  worker learns from its own requests only.
In `auto`, a decision uses `ebpf` when the snapshot covers at least one candidate, else `ttfb`
(the two are never mixed in one decision: microseconds of RTT and milliseconds of TTFB do not
compare). Bounded (`bounded = True`): the framework only clamps.
Formula: score(e) = min_c rtt(c) / rtt(e) over the candidates with a value (the fastest 1.0, twice
as slow 0.5); a candidate without one gets `unknownScore` (0.5).
Parameters: `source` (`auto` | `ebpf` | `ttfb`, default auto); `snapshot` (the agent's snapshot
path; default `spec.tenancy.snapshot`); `staleAfterS` (2.0); `alpha` (EWMA weight of a new
observation, 0.2); `maxAgeS` (60); `unknownScore` (0.5).
Data consumed: the agent's snapshot (one `os.stat` per 5 ms at most, fields read in place; the
per-endpoint table built once per published snapshot), Envoy's upstream first-byte time per
finished request. Cost: a dict lookup per candidate; the observer a few float operations per request.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.types import Outcome

MAX_TRACKED = 4096  # endpoints with a TTFB estimate (the oldest is dropped beyond)


class RttScorerParameters(Parameters):
    source: Literal["auto", "ebpf", "ttfb"] = "auto"
    snapshot: str | None = Field(default=None, min_length=1)
    stale_after_s: float = Field(default=2.0, alias="staleAfterS", gt=0.0)
    alpha: float = Field(default=0.2, gt=0.0, le=1.0)
    max_age_s: float = Field(default=60.0, alias="maxAgeS", gt=0.0)
    unknown_score: float = Field(default=0.5, alias="unknownScore", ge=0.0, le=1.0)


class RttScorer(Plugin):
    type: ClassVar[str] = "rtt-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    Parameters: ClassVar[type] = RttScorerParameters

    def __init__(self, name: str, params: Any, runtime: Any, clock: Any = time.monotonic):
        super().__init__(name, params, runtime)
        self.clock = clock
        self.ttfb: dict[str, list[float]] = {}  # endpoint -> [ewma ms, last update (clock), observations]
        self._readers: dict[tuple[str, float], Any] = {}
        self._table_of: Any = None  # the snapshot `_table` was built from
        self._table: dict[str, float] = {}

    # --- ttfb: learned from finished requests ------------------------------------------------------

    def on_done(self, state: Any, outcome: Outcome) -> None:
        if outcome is not Outcome.OK:
            return
        c = state.completion
        if c is None or c.first_upstream_byte is None:
            return
        endpoint = c.upstream or state.served or state.endpoint
        if endpoint:
            self.observe(endpoint, c.first_upstream_byte * 1000.0)

    def observe(self, endpoint: str, ms: float, now: float | None = None) -> None:
        if not (ms >= 0.0 and math.isfinite(ms)):
            return
        now = self.clock() if now is None else now
        entry = self.ttfb.get(endpoint)
        if entry is None or now - entry[1] > self.params.max_age_s:
            if entry is None and len(self.ttfb) >= MAX_TRACKED:
                del self.ttfb[min(self.ttfb, key=lambda k: self.ttfb[k][1])]
            self.ttfb[endpoint] = [ms, now, 1]
            return
        entry[0] += self.params.alpha * (ms - entry[0])
        entry[1] = now
        entry[2] += 1

    def ttfb_ms(self, endpoint: str, now: float | None = None) -> float | None:
        entry = self.ttfb.get(endpoint)
        if entry is None:
            return None
        now = self.clock() if now is None else now
        return entry[0] if now - entry[1] <= self.params.max_age_s else None

    # --- ebpf: the agent's snapshot ----------------------------------------------------------------

    def snapshot_path(self, ctx: Any) -> str:
        if self.params.snapshot:
            return self.params.snapshot
        tenancy = getattr(getattr(ctx.state, "snapshot", None), "tenancy", None)
        path = getattr(tenancy, "snapshot", None)
        if path:
            return path
        from ebpf.snapshot import snapshot_path

        return str(snapshot_path())

    def rtt_table(self, ctx: Any) -> dict[str, float]:
        """{endpoint: srtt us} from the agent's current snapshot; {} when there is none or it is stale."""
        key = (self.snapshot_path(ctx), self.params.stale_after_s)
        reader = self._readers.get(key)
        if reader is None:
            from ebpf.snapshot import SnapshotReader

            reader = self._readers[key] = SnapshotReader(key[0], stale_after_s=key[1])
        snap = reader.current()
        if snap is None or snap.stale:
            return {}
        if snap is not self._table_of:
            table = {}
            for u in snap.upstreams:
                if u.window_count > 0 and u.window_mean_us > 0:
                    table[u.endpoint] = float(u.window_mean_us)
                elif u.count > 0:
                    table[u.endpoint] = float(u.last_srtt_us)
            self._table_of, self._table = snap, table
        return self._table

    # --- the score ---------------------------------------------------------------------------------

    def rtts(self, ctx: Any, candidates: tuple[str, ...]) -> tuple[str, dict[str, float]]:
        """(source used, {candidate: rtt}) for the candidates that have a value."""
        source = self.params.source
        if source != "ttfb":
            table = self.rtt_table(ctx)
            values = {e: table[e] for e in candidates if e in table}
            if values or source == "ebpf":
                return "ebpf", values
        now = self.clock()
        values = {}
        for e in candidates:
            v = self.ttfb_ms(e, now)
            if v is not None:
                values[e] = v
        return "ttfb", values

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        _, values = self.rtts(ctx, candidates)
        unknown = self.params.unknown_score
        if not values:
            return dict.fromkeys(candidates, unknown)
        best = max(min(values.values()), 1e-6)
        return {e: (best / max(values[e], 1e-6) if e in values else unknown) for e in candidates}
