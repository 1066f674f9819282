"""OpenTelemetry traces of the processor: spans per phase, per stage and per scheduling decision.

What: `spec.tracing` (extproc/config/schema.TracingSpec, docs/tracing.md) turns tracing on for Envoy
(`extproc/envoy_render.tracing`: the HCM's `envoy.tracers.opentelemetry`) and for every worker.
A worker's `Tracing` (built by `Runtime.install` from the installed snapshot, kept while the spec
stays the same, replaced when it changes, dropped when it goes) owns an explicit `TracerProvider`
(never the OpenTelemetry global): resource `service.name` = `<serviceName>-processor`, sampler
`ParentBased(TraceIdRatioBased(samplingRatio))`, a `BatchSpanProcessor` feeding an
`OTLPSpanExporter` (gRPC, plaintext) to `spec.tracing.endpoint`.
Per stream, `Tracing.stream(metadata, state)` returns a `StreamTrace` whose parent is the W3C
`traceparent`/`tracestate` of the ext_proc stream's gRPC initial metadata (Envoy injects its
ext_proc client span there when its tracer is on), else, at request headers, the request's own
`traceparent` header (an Envoy without tracing, a client that sent one), else none (a new trace,
sampled at the ratio). The tree it produces, per message Envoy sends (of a streamed body phase, an
SSE response chunk by chunk, only the first and the last chunk, the last with
`adapter.chunks_untraced`: a long stream would otherwise cost two spans per token):

    <Envoy: ingress server span> -> <Envoy: async ...ExternalProcessor.Process egress>
        ext_proc <phase>                     SERVER; adapter.route, adapter.phase, adapter.verdict, ...
            stage <name>                     INTERNAL; one per stage hook that ran, in order
                scheduling decision          INTERNAL, under the dispatch stage: profile, candidates
                                             count, chosen endpoint, fallbacks (or the refusal)

Why: one trace id from the client through Envoy, the processor's work and the backend request, so
a slow request shows where its time went. The processor never blocks on export: spans are queued
for the `BatchSpanProcessor`'s thread, which drops them when its queue is full or the collector is
gone (the OTLP exporter retries within `exportTimeout`, in that thread, off the event loop).
Cost: tracing off (no `spec.tracing`): `Runtime.tracing` is None, checked once per stream; no span
object, no OpenTelemetry import. Tracing on: a span per phase; an unsampled phase (the sampler said
no) runs the pipeline untraced, so its stages cost no span either. Sampled: a few microseconds per
span, measured in docs/tracing.md.
"""

from __future__ import annotations

from typing import Any, Iterable

from extproc.otlp import OtlpProvider, resource
from extproc.types import Mutate, Phase, Reject, Respond

TRACE_ATTR = "trace"  # state.attrs key of the request's StreamTrace (only when it is sampled)
SCOPE = "adapter-gateway.extproc"
_REQUEST_HEADERS = Phase.REQUEST_HEADERS
_HEADERS = ("traceparent", "tracestate")


def _verdict_name(verdict: Any) -> str:
    if isinstance(verdict, Reject):
        return "reject"
    if isinstance(verdict, Respond):
        return "respond"
    if isinstance(verdict, Mutate):
        return "mutate"
    return "continue"


class Tracing(OtlpProvider):
    """The worker's tracer provider for one `TracingSpec`; `shutdown()` flushes and stops it
    (`flush`, `shutdown`, `shutdown_in_background`, `configure`: extproc/otlp.py)."""

    SHUTDOWN_FAILED = "tracing: shutting down the tracer provider failed"
    THREAD_NAME = "tracing-shutdown"

    def __init__(self, spec: Any, worker: int = 0, exporter: Any = None):
        from opentelemetry import trace as api
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from opentelemetry.trace.status import Status, StatusCode

        super().__init__(spec, worker)
        self.provider = TracerProvider(resource=resource(spec, worker),
                                       sampler=ParentBased(TraceIdRatioBased(spec.sampling_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=spec.endpoint, insecure=True, timeout=spec.export_timeout)
        # queued spans go out every second (OpenTelemetry's default is 5 s), at most 2048 queued (beyond: dropped)
        self.processor = BatchSpanProcessor(exporter, schedule_delay_millis=1000,
                                            export_timeout_millis=spec.export_timeout * 1000)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = api.set_span_in_context
        self._server = api.SpanKind.SERVER
        self._internal = api.SpanKind.INTERNAL
        self._error = lambda what: Status(StatusCode.ERROR, what)

    # --- per stream ---------------------------------------------------------------------------------

    def stream(self, metadata: Iterable[Any] | None, state: Any) -> "StreamTrace":
        """The stream's trace: its parent from the gRPC initial metadata when Envoy put one there."""
        carrier = {}
        for item in metadata or ():
            if item.key in _HEADERS:
                carrier[item.key] = item.value
        parent = self._propagator.extract(carrier) if "traceparent" in carrier else None
        return StreamTrace(self, state, parent, "grpc-metadata" if parent is not None else None)

    # --- lifecycle (extproc/otlp.py) ----------------------------------------------------------------

    def _shutdown_provider(self) -> None:
        self.provider.shutdown()  # each span processor: a last export bounded by its export timeout


def configure(current: Tracing | None, spec: Any, worker: int = 0) -> Tracing | None:
    """The worker's `Tracing` for `spec` (None: off): the current one when the spec is unchanged,
    else a new one (the old one is shut down in the background)."""
    return Tracing.configure(current, spec, worker)


class StreamTrace:
    """One stream's spans. `phase(...)` runs one message's pipeline under its phase span."""

    __slots__ = ("tracing", "state", "parent", "source", "stage_ctx", "stage_name", "untraced")

    def __init__(self, tracing: Tracing, state: Any, parent: Any, source: str | None):
        self.tracing = tracing
        self.state = state
        self.parent = parent  # an OpenTelemetry Context holding Envoy's (or the client's) span, or None
        self.source = source  # where the parent came from: grpc-metadata, request-headers, or None
        self.stage_ctx: Any = None  # the running stage span's context (the decision span's parent)
        self.stage_name: str | None = None
        self.untraced: dict[Phase, int] | None = None  # streamed phases: chunks run without a span so far

    async def phase(self, pipeline: Any, state: Any, msg: Any) -> Any:
        """`pipeline.run(state, msg)` under a span named after the phase (stages under it when sampled)."""
        t = self.tracing
        phase = msg.phase
        if self.parent is None and phase is _REQUEST_HEADERS and msg.headers:
            value = msg.headers.get("traceparent")
            if value:
                carrier = {"traceparent": value}
                state_value = msg.headers.get("tracestate")
                if state_value:
                    carrier["tracestate"] = state_value
                self.parent = t._propagator.extract(carrier)
                self.source = "request-headers"
        untraced = 0
        if phase in pipeline.streamed:  # a chunk of a streamed body: spans for the first and the last only
            seen = self.untraced
            if seen is None:
                seen = self.untraced = {}
            if phase in seen and not msg.end_of_stream:
                seen[phase] += 1
                return await pipeline.run(state, msg)
            untraced = seen.setdefault(phase, 0)
        route = state.route
        span = t.tracer.start_span(f"ext_proc {phase.value}", context=self.parent, kind=t._server, attributes={
            "adapter.route": route.name if route is not None else "unknown", "adapter.phase": phase.value,
            "adapter.request_id": state.request_id, "adapter.worker": t.worker,
            "adapter.trace_parent": self.source or "none"})
        if not span.is_recording():  # not sampled: nothing under it either
            span.end()
            return await pipeline.run(state, msg)
        ctx = t._in_context(span, self.parent)
        state.attrs[TRACE_ATTR] = self
        try:
            verdict = await pipeline.run_traced(state, msg, self, ctx)
        except BaseException as e:  # cancelled mid-phase (the client left): end the span, say so
            span.set_status(t._error(type(e).__name__))
            span.end()
            raise
        name = _verdict_name(verdict)
        span.set_attribute("adapter.verdict", name)
        if untraced:
            span.set_attribute("adapter.chunks_untraced", untraced)  # chunks between the first and this one
        if name in ("reject", "respond"):
            span.set_attribute("http.response.status_code", verdict.status)
            if name == "reject":
                span.set_attribute("error.type", verdict.code)
                span.set_status(t._error(verdict.code))
        if state.backend is not None:
            span.set_attribute("adapter.backend", state.backend)
        if state.variant is not None:
            span.set_attribute("adapter.variant", state.variant)
        span.end()
        return verdict

    # --- called by Pipeline.run_traced --------------------------------------------------------------

    def stage_start(self, name: str, phase: Phase, ctx: Any) -> Any:
        t = self.tracing
        span = t.tracer.start_span(f"stage {name}", context=ctx, kind=t._internal,
                                   attributes={"adapter.stage": name, "adapter.phase": phase.value})
        self.stage_ctx = t._in_context(span, ctx)
        self.stage_name = name
        return span

    def stage_end(self, span: Any, verdict: Any = None, error: BaseException | None = None) -> None:
        self.stage_ctx = None
        self.stage_name = None
        if error is not None:
            span.record_exception(error)
            span.set_status(self.tracing._error(f"{type(error).__name__} in stage"))
        else:
            span.set_attribute("adapter.verdict", _verdict_name(verdict))
        span.end()

    # --- called by extproc/scheduling/profile.py ----------------------------------------------------

    def decision_start(self, profile: str, backend: str, candidates: int) -> Any:
        """The scheduling decision's span, under the running stage (dispatch); None outside a stage."""
        ctx = self.stage_ctx
        if ctx is None:
            return None
        t = self.tracing
        return t.tracer.start_span("scheduling decision", context=ctx, kind=t._internal, attributes={
            "adapter.scheduling.profile": profile, "adapter.backend": backend,
            "adapter.scheduling.candidates": candidates})

    def decision_end(self, span: Any, picks: tuple[str, ...] | None, error: BaseException | None) -> None:
        if span is None:
            return
        if picks:
            span.set_attribute("adapter.scheduling.endpoint", picks[0])
            span.set_attribute("adapter.scheduling.fallbacks", list(picks[1:]))
        if error is not None:
            refused = "overloaded" if getattr(error, "sheddable", False) else "no_capacity"
            span.set_attribute("adapter.scheduling.refused", refused)
            span.set_status(self.tracing._error(refused))
        span.end()


__all__ = ["Tracing", "StreamTrace", "configure", "TRACE_ATTR"]
