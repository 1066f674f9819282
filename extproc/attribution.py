"""Latency attribution: where a request's time went, per component, as metrics and a `Server-Timing` header.

What: on a route with `serverTiming` (docs/attribution.md), every request gets a `Timing`
(`state.attrs[TIMING_ATTR]`) that the stream feeds once per ext_proc message (`Timing.add`). The
components (the `component` label of `adapter_processor_latency_seconds{route,component}` and the
`Server-Timing` metric names):
- `envoy`: in the metrics, Envoy's whole share from its own access-log entry (`envoy_share`): the request's
  time in Envoy (first byte to the last byte sent to the client) during which neither the processor was
  working on one of its messages nor the upstream had the request (Envoy's filters, the ext_proc gRPC hop
  both ways, waiting for the client's body, the router and connection setup, sending to the client). A
  request asks for its entry with `adapter.timing` (its token) in its first reply; extproc/feedback.py
  hands the entry to `AttributionObserver.envoy_entry`, which joins it with the request's spans in either
  order. In the header (sent before the entry exists): Envoy's part before the processor's last
  request-phase reply, from Envoy's `request.time` attribute (the request's first byte) to the processor
  taking the request headers, plus the gaps between the processor's reply to one request phase and the
  next request message. Wall clocks of Envoy and the processor: exact on one host, off by the clocks'
  difference across hosts (dropped, or 0, when negative).
- `processor_request_headers`, `processor_request_body`, `processor_response_headers`,
  `processor_response_body`: processor time per phase (all messages of the phase, decode to encode).
- `queue`: time the request spent in the gateway's admission before dispatch: the `qos-queue` stage
  (`spec.qos.admission`, extproc/stages/qos_queue.py) records it in `state.attrs[QUEUE_ATTR]` as (phase,
  seconds), its wait in the pool's queue included, and it is taken out of that phase's processor time (the
  stage runs inside a phase message); 0 on routes without admission (no gateway queue), recorded so that
  dashboards have the row.
- `network_rtt`: the kernel's smoothed TCP RTT to the endpoint that served (`upstream.address`), from the
  tenant agent's eBPF snapshot (`ebpf/snapshot.py`, the same table `rtt-scorer` reads: the window mean,
  else the last srtt); absent when the agent is not running, its snapshot is stale, or it has not seen
  the endpoint.
- `upstream_ttfb`: metrics: Envoy's first byte sent upstream to its first byte received (from the entry);
  header: the processor's last request-phase reply to the first response message it receives (Envoy's
  router, connection, the network both ways, the engine's queue and, unstreamed, its whole generation).
- `upstream_first_token`: streamed answers only (the client asked for a stream): from the first byte sent
  upstream (the entry) to the processor's receipt of the first response body chunk with bytes, an SSE
  stream's first event, which engines send once the prefill produced the first token (vLLM's first event
  carries the role, with the first token); TTFT as the gateway sees it. An unstreamed answer's first body
  chunk is its whole body: not a first token.
Without the entry within JOIN_TTL (an Envoy without our access loggers, another replica's worker), these three
are recorded from the processor's view (the header's definitions). The ext_proc gRPC hop is inside `envoy`.
The header: added at response headers (one hook at the end of the route's pipeline; the phase is asked
of Envoy only on these routes: on `openai` routes, whose streamed responses otherwise skip it, this is one
more round trip before the first byte). It carries what is known then: `envoy`, the request phases, `queue`,
`network_rtt`, `upstream_ttfb` and `total` (Envoy's first byte, or the stream's start, to the header);
the response phases and the first token come later and are in the metrics only (omitted from the header,
not sent as trailers: HTTP/1.1 clients rarely read trailers). Only `mode: always`, or `trusted` for a
request whose verified tenant is listed or that carries the configured header, gets it.
Why: §4.1 of the brief attributes latency to network RTT, the engine and the gateway; an operator needs
the split per request (the header) and per route over time (the histograms, `adapterctl attribution`).
Cost: routes without `serverTiming` pay one `is None` check per message; with it, a few float
additions and a span per message, two clock reads per request phase, one access-log entry per request
(batched by Envoy, parsed and joined in the worker), and up to nine buffered observations.
"""

from __future__ import annotations

import time
from collections import deque
from datetime import datetime
from typing import Any, Callable, NamedTuple

from extproc.types import Outcome, Phase, RequestState

TIMING_ATTR = "attribution.timing"
QUEUE_ATTR = "attribution.queue"  # (phase, seconds) in the qos-queue stage (extproc/stages/qos_queue.py)
TIMING_METADATA_KEY = "timing"  # adapter.timing: the token, in the first reply of a request whose entry is wanted
LATE_SPANS = 16  # response-phase spans kept for Envoy's share (the last ones: after the upstream's last byte)
JOIN_TTL = 10.0  # seconds a request (or an entry) waits for its other half in `EnvoyJoin`
ENVOY_COMPONENTS = ("envoy", "upstream_ttfb", "upstream_first_token")  # observed from Envoy's entry when it comes
REQUEST_TIME_ATTR = "request.time"  # the Envoy attribute asked for on routes with serverTiming
HEADER = "server-timing"
COMPONENTS = ("envoy", "processor_request_headers", "processor_request_body", "processor_response_headers",
              "processor_response_body", "queue", "network_rtt", "upstream_ttfb", "upstream_first_token")
PHASE_COMPONENT = {Phase.REQUEST_HEADERS: "processor_request_headers", Phase.REQUEST_BODY: "processor_request_body",
                   Phase.REQUEST_TRAILERS: "processor_request_body",
                   Phase.RESPONSE_HEADERS: "processor_response_headers",
                   Phase.RESPONSE_BODY: "processor_response_body",
                   Phase.RESPONSE_TRAILERS: "processor_response_body"}
_REQUEST_PHASES = frozenset({Phase.REQUEST_HEADERS, Phase.REQUEST_BODY, Phase.REQUEST_TRAILERS})
_PROCESSOR = ("processor_request_headers", "processor_request_body", "processor_response_headers",
              "processor_response_body")


def envoy_time(value: Any) -> float | None:
    """Envoy's `request.time` attribute as epoch seconds: an RFC 3339 string (how Envoy exports a CEL
    timestamp), a protobuf Struct with seconds/nanos, or a number; None when it is none of these."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("Z"):
            text = text[:-1] + "+00:00"
        frac = ""
        if "." in text:  # fromisoformat takes at most 6 fractional digits before 3.11's wider parser
            head, _, rest = text.partition(".")
            digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
            tail = rest[len(digits):]
            frac, text = "0." + digits, head + tail
        try:
            stamp = datetime.fromisoformat(text).timestamp()
        except ValueError:
            return None
        return stamp + (float(frac) if frac else 0.0)
    fields = getattr(value, "fields", None)
    if fields is not None and "seconds" in fields:
        return fields["seconds"].number_value + fields["nanos"].number_value / 1e9 if "nanos" in fields \
            else fields["seconds"].number_value
    return None


class Timing:
    """One request's attribution: fed by the stream (`add`), read by the header hook and `on_done`."""

    __slots__ = ("spec", "processor", "envoy", "gaps", "released", "started_wall", "trusted_header", "_end",
                 "spans", "late", "perf_epoch", "mono_epoch", "envoy_expected")

    def __init__(self, spec: Any):
        self.spec = spec  # the route's ServerTimingSpec
        self.processor = dict.fromkeys(_PROCESSOR, 0.0)  # component -> seconds (only phases seen stay > 0)
        self.envoy: float | None = None  # seconds in Envoy before the processor took the request headers
        self.gaps = 0.0  # seconds between a request-phase reply and the next request message (Envoy's)
        self._end: float | None = None  # perf_counter: the end of the last request-phase message
        self.released: float | None = None  # monotonic: the last request-phase reply
        self.started_wall: float | None = None  # epoch: Envoy's first byte (request.time), else None
        self.trusted_header = False  # the request carried spec.header
        # for Envoy's share (`envoy_share`): the processor's busy spans as epoch (start, end), request phases
        # all, response phases the last LATE_SPANS (earlier ones lie inside the upstream's window)
        self.spans: list[tuple[float, float]] = []
        self.late: deque[tuple[float, float]] = deque(maxlen=LATE_SPANS)
        now = time.time()
        self.perf_epoch = now - time.perf_counter()  # epoch = perf_counter + perf_epoch
        self.mono_epoch = now - time.monotonic()  # epoch = monotonic + mono_epoch
        self.envoy_expected = False  # the first reply asked Envoy's access log for this request's entry

    def add(self, msg: Any, t0: float, dt: float) -> None:
        """One ext_proc message took the processor `dt` seconds from `t0` (perf_counter)."""
        phase = msg.phase
        self.processor[PHASE_COMPONENT[phase]] += dt
        start = t0 + self.perf_epoch
        if phase in _REQUEST_PHASES:
            self.spans.append((start, start + dt))
            self.released = time.monotonic()
            if self._end is not None and t0 > self._end:
                self.gaps += t0 - self._end
            self._end = t0 + dt
            if phase is Phase.REQUEST_HEADERS:
                attrs = msg.attributes
                start = envoy_time(attrs.get(REQUEST_TIME_ATTR)) if attrs else None
                if start is not None:
                    took = time.time() - dt - start  # when the processor began on the headers
                    self.started_wall = start
                    self.envoy = took if took >= 0 else None
                header = self.spec.header
                if header is not None and msg.headers and msg.headers.get(header) is not None:
                    self.trusted_header = True
        else:
            self.late.append((start, start + dt))

    def metadata(self, state: RequestState, metadata: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
        """The first reply's dynamic metadata plus `adapter.timing` (the request's token, which starts with the
        worker index): the access logger of this worker (`envoy_render.access_loggers`) sends its entry here."""
        self.envoy_expected = True
        out = dict(metadata) if metadata else {}
        out["adapter"] = {**out.get("adapter", {}), TIMING_METADATA_KEY: state.token}
        return out

    def trusted(self, state: RequestState) -> bool:
        spec = self.spec
        if spec.mode == "always":
            return True
        if spec.mode != "trusted":
            return False
        return self.trusted_header or (state.tenant is not None and state.tenant in spec.tenants
                                       and state.tenant in state.snapshot.tenants_by_id)

    def components(self, state: RequestState, rtt: "RttLookup | None") -> dict[str, float]:
        """Seconds per component known now, as the processor saw them (absent: not measured for this request).
        `envoy` here is only Envoy's part before the processor's last request-phase reply (the header's);
        `envoy_share` gives the whole share once Envoy's access-log entry has come."""
        out: dict[str, float] = {}
        if self.envoy is not None or self.gaps > 0.0:
            out["envoy"] = (self.envoy or 0.0) + self.gaps
        queued = state.attrs.get(QUEUE_ATTR)
        waited, in_phase = (queued[1], PHASE_COMPONENT[queued[0]]) if queued is not None else (0.0, None)
        for name, value in self.processor.items():
            if value > 0.0:
                # the admission stage ran inside this phase's message: its time is the queue's, not the processor's
                out[name] = max(0.0, value - waited) if name == in_phase else value
        out["queue"] = waited  # 0.0 on routes without admission (spec.qos.admission): no gateway queue
        endpoint = state.served or state.endpoint
        if rtt is not None and endpoint:
            r = rtt.seconds(state, endpoint)
            if r is not None:
                out["network_rtt"] = r
        released = self.released
        if released is not None:
            if state.first_byte is not None and state.first_byte >= released:
                out["upstream_ttfb"] = state.first_byte - released
            req = state.request
            if state.first_body is not None and state.first_body >= released and req is not None \
                    and getattr(req, "stream", False):
                out["upstream_first_token"] = state.first_body - released  # a streamed answer's first event
        return out


def header_value(components: dict[str, float], total: float | None) -> str:
    """The W3C Server-Timing value: `name;dur=<ms>` entries, comma-separated, in COMPONENTS order."""
    parts = []
    for name in COMPONENTS:
        value = components.get(name)
        if value is None:
            continue
        entry = f"{name};dur={value * 1000.0:.3f}"
        if name == "queue":
            entry += ';desc="no gateway queue"' if value == 0.0 else ';desc="gateway admission"'
        elif name == "network_rtt":
            entry += ';desc="ebpf srtt"'
        parts.append(entry)
    if total is not None and total >= 0:
        parts.append(f'total;dur={total * 1000.0:.3f};desc="gateway to response headers"')
    return ", ".join(parts)


class RttLookup:
    """{endpoint: srtt} from the tenant agent's snapshot, rebuilt once per published snapshot (per worker,
    in `runtime.cache`)."""

    def __init__(self, stale_after_s: float = 2.0):
        self.stale_after_s = stale_after_s
        self._readers: dict[str, Any] = {}
        self._of: Any = None
        self._table: dict[str, float] = {}

    def seconds(self, state: RequestState, endpoint: str) -> float | None:
        tenancy = getattr(state.snapshot, "tenancy", None)
        path = getattr(tenancy, "snapshot", None)
        if not path:
            return None
        reader = self._readers.get(path)
        if reader is None:
            try:
                from ebpf.snapshot import SnapshotReader
            except ImportError:  # the agent's package is optional
                return None
            reader = self._readers[path] = SnapshotReader(path, stale_after_s=self.stale_after_s)
        try:
            snap = reader.current()
        except Exception:  # noqa: BLE001 - a torn or foreign file is "no RTT", never a failed request
            return None
        if snap is None or snap.stale:
            return None
        if snap is not self._of:
            table = {}
            for u in snap.upstreams:
                if u.window_count > 0 and u.window_mean_us > 0:
                    table[u.endpoint] = u.window_mean_us / 1e6
                elif u.count > 0:
                    table[u.endpoint] = u.last_srtt_us / 1e6
            self._of, self._table = snap, table
        return self._table.get(endpoint)


def rtt_lookup(state: RequestState) -> RttLookup | None:
    runtime = state.runtime
    if runtime is None:
        return None
    cache = runtime.cache("attribution")
    lookup = cache.get("rtt")
    if lookup is None:
        lookup = cache["rtt"] = RttLookup()
    return lookup


def start(state: RequestState) -> Timing | None:
    """The stream's one check per request: a Timing when the route has `serverTiming`, else None."""
    route = state.route
    spec = route.server_timing if route is not None else None
    if spec is None:
        return None
    timing = state.attrs[TIMING_ATTR] = Timing(spec)
    return timing


class ServerTimingStage:
    """The last stage of a route with `serverTiming` (not `metrics`): adds the header at response headers."""

    name = "server-timing"

    def on_response_headers(self, state: RequestState, msg: Any) -> Any:
        from extproc.types import CONTINUE, Mutate

        timing = state.attrs.get(TIMING_ATTR)
        if timing is None or not timing.trusted(state):
            return CONTINUE
        components = timing.components(state, rtt_lookup(state))
        total = (time.time() - timing.started_wall) if timing.started_wall is not None else \
            time.monotonic() - state.started
        return Mutate(set_headers=((HEADER, header_value(components, total)),))


def pipeline_builder(build: Any) -> Any:
    """`build(route)` with the server-timing hook appended on routes whose header may be sent."""
    def build_with_timing(route: Any) -> Any:
        pipeline = build(route)
        spec = getattr(route, "server_timing", None)
        if spec is None:
            return pipeline
        try:  # imported with the config, not on a request (the first import takes a good part of a second)
            import ebpf.snapshot  # noqa: F401
        except ImportError:
            pass
        if spec.mode == "metrics":
            return pipeline
        from extproc.pipeline import Pipeline

        return Pipeline(pipeline.stages + (ServerTimingStage(),))
    return build_with_timing


class EnvoyMarks(NamedTuple):
    """Envoy's own timings of one request, from its access-log entry: `start` epoch seconds (the downstream
    request's first byte), the rest seconds from it (None when Envoy did not report it)."""

    start: float
    end: float | None  # the last byte sent to the client (else the stream's duration)
    upstream_tx: float | None  # the first byte sent upstream
    upstream_rx: float | None  # the first byte received from upstream
    upstream_end: float | None  # the last byte received from upstream


def envoy_marks(entry: Any) -> EnvoyMarks | None:
    """The EnvoyMarks of an HTTPAccessLogEntry (None without a start time)."""
    cp = entry.common_properties
    has = cp.HasField
    if not has("start_time"):
        return None

    def offset(name: str) -> float | None:
        if not has(name):
            return None
        d = getattr(cp, name)
        return d.seconds + d.nanos / 1e9

    end = offset("time_to_last_downstream_tx_byte")
    return EnvoyMarks(cp.start_time.seconds + cp.start_time.nanos / 1e9,
                      end if end is not None else offset("duration"), offset("time_to_first_upstream_tx_byte"),
                      offset("time_to_first_upstream_rx_byte"), offset("time_to_last_upstream_rx_byte"))


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of `spans`."""
    total, reach = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


def envoy_share(timing: Timing, marks: EnvoyMarks, first_body: float | None, streamed: bool) -> dict[str, float]:
    """The components Envoy's entry measures (seconds):
    - `envoy`: the request's whole time in Envoy (its first byte to the last byte sent to the client) during
      which neither the processor was working on one of its messages nor the upstream had the request (from
      the first byte sent upstream to the last byte received; to the end when none came): Envoy's filters,
      the ext_proc gRPC hop both ways, waiting for the client's body, the router and connection setup,
      handing response data to ext_proc, sending to the client;
    - `upstream_ttfb`: the first byte sent upstream to the first byte received (the network both ways, the
      engine's queue and prefill; unstreamed, its whole generation);
    - `upstream_first_token` (streamed answers): the first byte sent upstream to the processor's receipt of
      the first response body chunk with bytes (`first_body`, epoch)."""
    out: dict[str, float] = {}
    if marks.end is None:
        return out
    lo = marks.start
    hi = lo + marks.end
    spans = [*timing.spans, *timing.late]
    tx = marks.upstream_tx
    if tx is not None:
        last = marks.upstream_end if marks.upstream_end is not None else marks.end
        spans.append((lo + tx, lo + last))
    out["envoy"] = max(0.0, (hi - lo) - _covered(spans, lo, hi))
    if tx is not None and marks.upstream_rx is not None and marks.upstream_rx >= tx:
        out["upstream_ttfb"] = marks.upstream_rx - tx
        if streamed and first_body is not None and first_body >= lo + tx:
            out["upstream_first_token"] = first_body - (lo + tx)
    return out


class AttributionObserver:
    """Lifecycle observer: one observation per measured component into
    `adapter_processor_latency_seconds{route,component}` (buffered in `pending`). For a request whose
    first reply asked for Envoy's access-log entry (`Timing.metadata`), `envoy`, `upstream_ttfb` and
    `upstream_first_token` are observed from that entry (`envoy_share`) when both it and the request's end
    are here (`envoy_entry`, fed by extproc/feedback.py, joins them in either order); an entry that does not
    come within JOIN_TTL leaves the processor's own view of the three (`Timing.components`)."""

    def __init__(self, metrics: Any, pending: Any, child: Any):
        self.metrics = metrics
        self.pending = pending
        self.child = child
        # token -> (deadline, route, timing, first body epoch, streamed, the processor's view of ENVOY_COMPONENTS)
        self._requests: dict[str, tuple[float, str, Timing, float | None, bool, dict[str, float]]] = {}
        self._entries: dict[str, tuple[float, EnvoyMarks]] = {}  # token -> (deadline, marks): came first
        self.joined = 0
        self.expired = 0  # requests whose entry never came (their processor-view values were observed)

    def _observe(self, route: str, components: dict[str, float]) -> None:
        metric, child, pending = self.metrics.latency, self.child, self.pending
        for name, value in components.items():
            pending.observe(child(metric, route, name), value)

    def __call__(self, state: RequestState, outcome: Outcome) -> None:
        timing = state.attrs.get(TIMING_ATTR)
        if timing is None or state.route is None:
            return
        route = state.route.name
        components = timing.components(state, rtt_lookup(state))
        if timing.envoy_expected and state.token:
            fallback = {k: components.pop(k) for k in ENVOY_COMPONENTS if k in components}
            first_body = state.first_body + timing.mono_epoch if state.first_body is not None else None
            streamed = bool(state.request is not None and getattr(state.request, "stream", False))
            entry = self._entries.pop(state.token, None)
            if entry is not None:
                self.joined += 1
                self._observe(route, envoy_share(timing, entry[1], first_body, streamed))
            else:
                self._requests[state.token] = (time.monotonic() + JOIN_TTL, route, timing, first_body, streamed,
                                               fallback)
            self._sweep()
        self._observe(route, components)

    def envoy_entry(self, token: str, entry: Any) -> None:
        """Envoy's access-log entry of a request whose first reply carried `adapter.timing` = `token`."""
        marks = envoy_marks(entry)
        if marks is None:
            return
        parked = self._requests.pop(token, None)
        if parked is not None:
            _, route, timing, first_body, streamed, _ = parked
            self.joined += 1
            self._observe(route, envoy_share(timing, marks, first_body, streamed))
        else:
            self._entries[token] = (time.monotonic() + JOIN_TTL, marks)
        self._sweep()

    def _sweep(self, now: float | None = None) -> None:
        """Drop what waited JOIN_TTL (insertion order is deadline order): a request observes its fallback."""
        now = time.monotonic() if now is None else now
        while self._requests:
            token, (deadline, route, _, _, _, fallback) = next(iter(self._requests.items()))
            if deadline > now:
                break
            del self._requests[token]
            self.expired += 1
            self._observe(route, fallback)
        while self._entries:
            token, (deadline, _) = next(iter(self._entries.items()))
            if deadline > now:
                break
            del self._entries[token]


def check_route(spec: Any, kind: str, reads_response: bool, tenant_ids: set[str]) -> list[tuple[tuple, str]]:
    """Config problems of a route's `serverTiming` as (field path under the route, reason)."""
    problems: list[tuple[tuple, str]] = []
    if spec is None:
        return problems
    if not reads_response and kind in ("passthrough", "kserve"):
        problems.append((("serverTiming",), f"a {kind} route's ext_proc stream ends at the request headers: "
                         "the processor never sees its response, so it can neither time the upstream nor add the "
                         "header; use an openai, llm, tensor, tool or rest route"))
    for j, tenant in enumerate(spec.tenants):
        if tenant not in tenant_ids:
            problems.append((("serverTiming", "tenants", j), f"unknown tenant {tenant!r} (not in spec.tenants)"))
    return problems


__all__ = ["Timing", "ServerTimingStage", "AttributionObserver", "RttLookup", "header_value", "envoy_time",
           "start", "pipeline_builder", "check_route", "envoy_marks", "envoy_share", "EnvoyMarks", "COMPONENTS",
           "TIMING_ATTR", "TIMING_METADATA_KEY", "HEADER", "QUEUE_ATTR"]
