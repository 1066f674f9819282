"""One ext_proc stream per HTTP request: decode, run the route's pipeline, encode, in order.

What: `ExtProcService.Process` is the `envoy.service.ext_proc.v3.ExternalProcessor/Process`
handler. The route is named by the stream's gRPC initial metadata (`x-adapter-route`, set per
route in the generated Envoy config), so the processor never re-matches paths; the digest of the
config Envoy's route came from (`x-adapter-config-digest`) selects the snapshot: the current one,
or a recent one still held by `ConfigRef` (during a reload Envoy may briefly send the previous
digest; a worker restarted meanwhile loads the previous bundles too, `extproc/server.py`), else
the stream is refused with 503 `config_mismatch` naming both digests (counted in
`adapter_processor_config_mismatch_total`), never served with a route of another config. The
snapshot is captured once when the stream opens. The request lifecycle (`extproc/lifecycle.py`)
is started here and told when the stream ends; its first reply carries the lifecycle's dynamic
metadata so Envoy's access log can report the request's end back to this worker. Requests are
counted by outcome (and, on routes with a canary rollout, by arm) when `on_done` fires
(`RequestObserver`), not when the stream closes. Request headers later phases need are kept in
`state.attrs` at request headers: the routing hints (`HINT_HEADERS`) and the route's rollout key and
forcing headers (`RolloutRef.headers`), for a dispatch at the body.
Why: replies must match Envoy's messages one for one and in order, so a stream is handled
sequentially; Envoy ends streams by reset as soon as it needs nothing more, so a cancellation is
a normal end, not an error (the lifecycle decides, from what it knows, whether the client left).
Cost: the Python gRPC stream itself dominates (about 0.6 to 0.9 ms CPU); this loop adds a few
microseconds per message plus the stages' own work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any, AsyncIterator

from extproc import attribution, codec
from extproc.config.snapshot import (DEBUG_METADATA_KEY, DIGEST_METADATA_KEY, ROUTE_METADATA_KEY,
                                     TENANT_METADATA_KEY)
from extproc.errors import reject
from extproc.genai import GenAiObserver
from extproc.metrics import Pending, ProcessorMetrics
from extproc.runtime import Runtime
from extproc.stages.dispatch import CLAIMS_ATTR, FALLBACK_ATTR, prefilled
from extproc.types import HINT_HEADERS, Mutate, Outcome, Phase, Reject, RequestState, Respond

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 4  # recent snapshots kept for streams from Envoy routes of an older digest
_RESPONSE_HEADERS = Phase.RESPONSE_HEADERS  # module constants: an enum member lookup costs ~0.4 us
_RESPONSE_BODY = Phase.RESPONSE_BODY
_REQUEST_HEADERS = Phase.REQUEST_HEADERS
_REQUEST_PHASES = frozenset({Phase.REQUEST_HEADERS, Phase.REQUEST_BODY, Phase.REQUEST_TRAILERS})
_BODY_PHASES = frozenset({Phase.REQUEST_BODY, Phase.RESPONSE_BODY})  # streamed bodies come in chunks


def _status(value: Any) -> int:
    """The HTTP status in a response's `:status` header or `response.code` attribute; 0 when it is
    absent or not a status (a value Envoy never sends must not fail the stream)."""
    try:
        code = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return code if 100 <= code <= 999 else 0


class ConfigRef:
    """Holds the current snapshot and a few recent ones by digest; `swap` replaces it atomically."""

    __slots__ = ("current", "_recent", "listeners")

    def __init__(self, snapshot: Any, older: tuple[Any, ...] | list[Any] = ()):
        """`older`: snapshots published before `snapshot`, newest first (a restarted worker's
        previous bundles): kept like those a worker that never restarted still holds, at most
        KEEP_SNAPSHOTS in all, so Envoy's routes of a recent digest find theirs."""
        self.current = snapshot
        self._recent: OrderedDict[str, Any] = OrderedDict()
        for old in reversed(list(older)[:KEEP_SNAPSHOTS - 1]):
            if old.digest != snapshot.digest:
                self._recent[old.digest] = old
        self._recent[snapshot.digest] = snapshot  # newest last (the loop above skipped its digest)
        self.listeners: list[Any] = []  # called with the new snapshot before it becomes current

    def swap(self, snapshot: Any) -> None:
        for listener in self.listeners:
            listener(snapshot)  # the runtime reconfigures its plugins before any stream sees the snapshot
        self._recent[snapshot.digest] = snapshot
        self._recent.move_to_end(snapshot.digest)
        while len(self._recent) > KEEP_SNAPSHOTS:
            self._recent.popitem(last=False)
        self.current = snapshot  # one reference assignment: the swap

    def resolve(self, digest: str | None) -> Any:
        """The snapshot Envoy's route was rendered from: current when it matches (or no digest was
        sent), a recent one by digest, or None when this worker does not know it."""
        current = self.current
        if not digest or digest == current.digest:
            return current
        return self._recent.get(digest)

    @property
    def digests(self) -> tuple[str, ...]:
        return tuple(reversed(self._recent))


class RequestObserver:
    """Lifecycle observer: the per-request metrics, counted once when the request ends (buffered in
    `pending`, written to the shared metrics by `flush`)."""

    def __init__(self, metrics: ProcessorMetrics):
        self.metrics = metrics
        self.pending = Pending()
        self._children: dict[tuple, Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric),) + labels
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels) if labels else metric
        return c

    def __call__(self, state: RequestState, outcome: Outcome) -> None:
        m = self.metrics
        pending = self.pending
        route = state.route
        label = route.name if route is not None else "unknown"
        pending.inc(self.child(m.requests, label, outcome.value))
        if route is None:
            return
        tenants = state.snapshot.tenants_by_id
        if state.tenant in tenants:
            result = ("rejected" if state.reply_code == "tenant_over_quota"
                      else "stale" if state.quota_stale else "admitted")
            pending.inc(self.child(m.admission, state.tenant, result))
        variant = state.variant
        if variant is not None:  # "<rollout>/<arm>": both names from the config, never a client's
            rollout, _, arm = variant.partition("/")
            pending.inc(self.child(m.variant_requests, label, rollout, arm, outcome.value))
        fallback = state.attrs.get(FALLBACK_ATTR)
        if fallback is not None and route.rollout is not None:
            pending.inc(self.child(m.variant_fallbacks, label, route.rollout.name, fallback))
        c = state.completion
        if c is not None and c.first_upstream_byte is not None and state.backend is not None:
            pending.observe(self.child(m.upstream_first_byte, label, state.backend), c.first_upstream_byte)
        usage = state.usage
        if usage is not None:
            backend = state.backend or "none"
            model = (state.request.model if state.request is not None else None) or route.model or "unknown"
            if model not in route.models and model != "unknown":
                model = "other"  # only models the config names become label values (a client's never)
            tenant = state.tenant if state.tenant in tenants else "none"  # never a client-chosen label value
            if usage.prompt_tokens and usage.prompt_tokens > 0:
                pending.inc(self.child(m.tokens, label, backend, model, tenant, "prompt"), usage.prompt_tokens)
            if usage.completion_tokens and usage.completion_tokens > 0:
                pending.inc(self.child(m.tokens, label, backend, model, tenant, "completion"), usage.completion_tokens)
            if usage.batch_size and usage.batch_size > 0:
                pending.observe(self.child(m.batch_size, label, backend, model), usage.batch_size)


class ExtProcService:
    def __init__(self, config: ConfigRef, metrics: ProcessorMetrics, recorder: Any = None,
                 runtime: Runtime | None = None):
        self.config = config
        self.metrics = metrics
        self.observer = RequestObserver(metrics)
        self.runtime = runtime if runtime is not None else Runtime()
        self.runtime.lifecycle.observers.append(self.observer)
        self.runtime.lifecycle.observers.append(GenAiObserver(metrics, self.observer.pending, self.observer.child))
        attributing = attribution.AttributionObserver(metrics, self.observer.pending, self.observer.child)
        self.runtime.lifecycle.observers.append(attributing)
        self.runtime.lifecycle.timing_sink = attributing.envoy_entry  # Envoy's access log feeds its envoy share
        self.runtime.metrics_sink = self.observer  # scheduling profiles time their plugins into `pending`
        if self.runtime.installed is None:
            self.runtime.install(config.current)
        config.listeners.append(self.runtime.install)
        # Optional `recorder(route_name, request_id, ProcessingRequest)`: captures real Envoy
        # traffic for replay tests (`adapterctl serve --record-dir`); None costs one check per message.
        self.recorder = recorder
        self._child = self.observer.child
        self._pending = self.observer.pending

    def flush_metrics(self) -> None:
        """Write the buffered metric updates (the worker does every 250 ms; tests before reading)."""
        self._pending.flush()

    async def Process(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
        route_name = debug = request_id = tenant = digest = None
        for item in context.invocation_metadata() or ():
            key = item.key
            if key == ROUTE_METADATA_KEY:
                route_name = item.value
            elif key == DIGEST_METADATA_KEY:
                digest = item.value
            elif key == DEBUG_METADATA_KEY:
                debug = item.value
            elif key == "x-request-id":
                request_id = item.value
            elif key == TENANT_METADATA_KEY:
                tenant = item.value
        snap = self.config.resolve(digest)
        if route_name is None and snap is not None and snap.epp is not None:
            # EPP mode: a Gateway API inference gateway's Envoy names no route (extproc/epp.py)
            from extproc import epp

            async for resp in epp.serve(self, snap, request_iterator, request_id):
                yield resp
            return
        refusal: Reject | None = None
        if snap is None:
            snap = self.config.current
            self._pending.inc(self._child(self.metrics.config_mismatch))
            refusal = reject(503, "config_mismatch",
                             f"Envoy's route {route_name!r} comes from config digest {digest}; this processor worker "
                             f"runs generation {snap.generation} (digest {snap.digest}) and knows "
                             f"{', '.join(self.config.digests)}: Envoy and the processor were given different "
                             "AdapterGateway configs (reload both from the same file)", envoy_digest=digest,
                             processor_digest=snap.digest)
        route = snap.routes.get(route_name) if route_name else None
        if route is None and refusal is None:
            refusal = reject(503, "unknown_route",
                             f"processor has no route {route_name!r} in config generation {snap.generation}; "
                             "re-render the Envoy config from the same AdapterGateway file")
        state = RequestState(snapshot=snap, route=route if refusal is None else None, started=time.monotonic(),
                             request_id=request_id or "", debug=debug in ("1", "true"), tenant=tenant or None,
                             runtime=self.runtime)
        lifecycle = self.runtime.lifecycle
        lifecycle.start(state)
        timing = attribution.start(state)  # routes with serverTiming: per-phase times (extproc/attribution.py)
        dialect = route.dialect if route is not None else "adapter"
        label = route.name if route is not None else "unknown"
        pipeline = route.pipeline if route is not None else None
        # request headers later phases read (dispatch may run at the body): the routing hints for plugins
        # deciding at the body, and a rollout's key and forcing headers
        keep = HINT_HEADERS + route.rollout.headers if route is not None and route.rollout is not None \
            else HINT_HEADERS
        last_phase = pipeline.last if pipeline is not None else None
        feedback = (lifecycle.feedback and snap.processor.feedback == "accessLog" and pipeline is not None
                    and not pipeline.reads_response)
        timing_feedback = lifecycle.feedback and lifecycle.timing_sink is not None
        # spec.tracing on (extproc/tracing.py): the stream's spans, parented on Envoy's traceparent; off: None
        tracing = self.runtime.tracing
        trace = tracing.stream(context.invocation_metadata(), state) if tracing is not None else None
        m = self.metrics
        pending = self._pending
        m.streams_active.inc()
        busy = 0.0
        how = "end"
        try:
            async for req in request_iterator:
                if self.recorder is not None:
                    self.recorder(route_name, state.request_id, req)
                t0 = time.perf_counter()
                msg = codec.decode(req)
                phase = msg.phase
                if refusal is not None:
                    verdict: Any = refusal
                else:
                    if state.first_byte is None and (phase is _RESPONSE_HEADERS or phase is _RESPONSE_BODY):
                        # the first response message carries the status and the endpoint that served
                        # (filter `response_attributes`), also on routes that skip response headers
                        state.first_byte = time.monotonic()
                        attrs = msg.attributes
                        if attrs:
                            code = _status(attrs.get("response.code"))
                            if code:
                                state.response_status = code
                            state.served = attrs.get("upstream.address") or None
                            state.response_details = attrs.get("response.code_details") or None
                    if phase is _RESPONSE_BODY and state.first_body is None and msg.body:
                        state.first_body = time.monotonic()
                        if state.inflight is not None:  # a pick's prefill is done at its first token
                            prefilled(state)
                    if phase is _RESPONSE_HEADERS and msg.headers:
                        state.response_status = _status(msg.headers.get(":status"))
                    elif phase is _REQUEST_HEADERS and msg.headers:
                        for name in keep:
                            value = msg.headers.get(name)
                            if value is not None:
                                state.attrs[name] = value
                        if msg.claims is not None:  # a rollout keys on a verified JWT claim
                            state.attrs[CLAIMS_ATTR] = msg.claims
                    verdict = await (pipeline.run(state, msg) if trace is None else trace.phase(pipeline, state, msg))
                    if (phase is last_phase and (msg.end_of_stream or phase is not _RESPONSE_BODY)) or \
                            (phase is _RESPONSE_HEADERS and isinstance(verdict, Mutate) and verdict.skip_body):
                        state.complete = True
                # Envoy's access log reports the end only of requests whose stream cannot see it
                # (routes reading no response phase) and that the processor did not answer itself
                metadata = lifecycle.metadata(state) if (feedback and not state.token_sent and not
                                                         isinstance(verdict, (Reject, Respond))) else None
                if timing is not None and timing_feedback and not timing.envoy_expected and \
                        not isinstance(verdict, (Reject, Respond)):  # Envoy's entry, for its latency share
                    metadata = timing.metadata(state, metadata)
                resp = codec.encode(phase, verdict, dialect, label, state.request_id, metadata)
                dt = time.perf_counter() - t0
                busy += dt
                if timing is not None:
                    timing.add(msg, t0, dt)
                pending.observe(self._child(m.phase_duration, label, phase.value), dt)
                answered = isinstance(verdict, (Reject, Respond))
                if answered:  # recorded before the reply goes out: Envoy may close the stream right after it
                    state.reply_status = verdict.status
                    state.reply_code = verdict.reason
                    if isinstance(verdict, Reject):
                        pending.inc(self._child(m.errors, label, verdict.code))
                        if phase in _REQUEST_PHASES and state.observed is None and verdict.code != "stage_error":
                            # refused before any backend was asked (unknown route, config mismatch,
                            # quota, no capacity): a rejection whatever its status, never a backend error
                            # (a stage's own failure, 500 stage_error, stays counted by its status)
                            state.observed = Outcome.REJECTED
                    state.complete = True
                yield resp
                if answered or (state.complete and (msg.end_of_stream or phase not in _BODY_PHASES)):
                    # nothing more will come: end the stream here (status OK; Envoy's ext_proc takes a
                    # server close as "processing complete"), never waiting on a read that Envoy's reset
                    # fails: grpc.aio leaks a failed batch's grpc_op array (~100 B a stream, grpc/grpc#43360)
                    return
        except asyncio.CancelledError:
            # Envoy resets the side stream once it needs nothing more: a normal end, unless the
            # lifecycle learns (from the stream's progress or Envoy's access log) that the client left.
            how = "cancelled"
            raise
        except Exception:
            how = "error"
            log.exception("stream for route %s failed", label)
            raise
        finally:
            m.streams_active.dec()
            pending.observe(self._child(m.request_duration, label), busy)
            lifecycle.stream_ended(state, how)
