"""The GenAI metrics over OTLP/gRPC: the OpenTelemetry sink of `extproc.genai.GenAiObserver`.

What: `spec.otlpMetrics` (extproc/config/schema.OtlpMetricsSpec, docs/operations.md "GenAI metrics
over OTLP") makes every worker export the four GenAI metrics it records for Prometheus
(extproc/genai.py) over OTLP too. A worker's `GenAiOtlp` (built by `Runtime.install` from the
installed snapshot, kept while the spec stays the same, replaced when it changes, dropped when it
goes; `Runtime.genai_otlp`) owns an explicit `MeterProvider` (never the OpenTelemetry global):
resource `service.name` = `<serviceName>-processor` (as the tracer's), `service.instance.id`,
`adapter.worker`; one `PeriodicExportingMetricReader` feeding an `OTLPMetricExporter` (gRPC,
plaintext, cumulative temporality) every `interval`; Views giving each histogram the explicit
bucket boundaries the conventions advise (the same tuples as the Prometheus histograms'):

| instrument | unit | boundaries | attributes |
|---|---|---|---|
| gen_ai.server.request.duration | s | 0.01 x 2^k .. 81.92 | + error.type (not OK only) |
| gen_ai.server.time_to_first_token | s | 0.001 .. 10 (16) | |
| gen_ai.server.time_per_output_token | s | 0.01 .. 2.5 (13) | |
| gen_ai.client.token.usage | {token} | 1, 4, ..., 4^13 | + gen_ai.token.type, estimated |

Attributes of all four: `gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model`,
`server.address`, `server.port` (an int), with the values of the Prometheus labels; an attribute
whose Prometheus label is empty is absent here. `estimated` (a bool; not a convention attribute,
the same name as the Prometheus label, so a collector's Prometheus exporter gives the same label)
is true when the backend reported no usage and the count is the gateway's estimate.
Why: one recording point (GenAiObserver works the values out once, each sink records them), so
the OTLP and the Prometheus numbers cannot drift apart.
Cost: off (no `spec.otlpMetrics`): `Runtime.genai_otlp` is None, one check per finished request,
no OpenTelemetry object or import. On: per finished request up to five SDK histogram records
(the SDK hashes the attributes, takes a lock and searches the buckets: about 8 us each measured on the
2-core development machine, 40 us per request against 5 us for the Prometheus side; no exemplars;
our attribute dicts are built once per label set and kept);
collection and export run in the reader's thread, off the event loop. A dead collector costs the
requests nothing: the exporter retries within `exportTimeout` in that thread, then drops the batch
(cumulative temporality: the next export that reaches a collector carries the totals again).
"""

from __future__ import annotations

from typing import Any

from extproc.metrics import GENAI_DURATION_BUCKETS, GENAI_TOKEN_BUCKETS, GENAI_TPOT_BUCKETS, GENAI_TTFT_BUCKETS
from extproc.otlp import OtlpProvider, resource

SCOPE = "adapter-gateway.extproc"
# (name, unit, description, boundaries): the conventions' definitions (docs/gen-ai/gen-ai-metrics.md)
INSTRUMENTS = (
    ("gen_ai.server.request.duration", "s",
     "Generative AI server request duration such as time-to-last byte or last output token.", GENAI_DURATION_BUCKETS),
    ("gen_ai.server.time_to_first_token", "s", "Time to generate first token for successful responses.",
     GENAI_TTFT_BUCKETS),
    ("gen_ai.server.time_per_output_token", "s",
     "Time per output token generated after the first token for successful responses.", GENAI_TPOT_BUCKETS),
    ("gen_ai.client.token.usage", "{token}", "Number of input and output tokens used.", GENAI_TOKEN_BUCKETS),
)
MAX_ATTRIBUTE_SETS = 4096  # label sets are bounded by the config; beyond this the cache starts over


class GenAiOtlp(OtlpProvider):
    """The worker's meter provider for one `OtlpMetricsSpec`, and the `GenAiSink` recording into it
    (`flush`, `shutdown`, `shutdown_in_background`, `configure`: extproc/otlp.py)."""

    SHUTDOWN_FAILED = "otlpMetrics: shutting down the meter provider failed"
    THREAD_NAME = "genai-otlp-shutdown"

    def __init__(self, spec: Any, worker: int = 0, exporter: Any = None):
        from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        super().__init__(spec, worker)
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=spec.endpoint, insecure=True, timeout=spec.export_timeout)
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(boundaries=bounds))
                 for name, _, _, bounds in INSTRUMENTS]
        self.reader = PeriodicExportingMetricReader(exporter, export_interval_millis=spec.interval * 1000,
                                                    export_timeout_millis=spec.export_timeout * 1000)
        # no exemplars: they would cost a context lookup per record, and these records run after the request
        self.provider = MeterProvider(metric_readers=[self.reader], resource=resource(spec, worker), views=views,
                                      exemplar_filter=AlwaysOffExemplarFilter())
        meter = self.provider.get_meter(SCOPE)
        self._duration, self._ttft, self._tpot, self._tokens = (
            meter.create_histogram(name, unit=unit, description=desc) for name, unit, desc, _ in INSTRUMENTS)
        self._attrs: dict[tuple, dict[str, Any]] = {}

    # --- the GenAiSink interface (extproc/genai.py) --------------------------------------------------

    def _attributes(self, key: tuple, extra: tuple = ()) -> dict[str, Any]:
        cache_key = key + extra
        attrs = self._attrs.get(cache_key)
        if attrs is None:
            operation, provider, model, host, port = key
            attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": provider}
            if model:
                attrs["gen_ai.request.model"] = model
            if host:
                attrs["server.address"] = host
            if port:
                attrs["server.port"] = int(port)
            if extra and extra[0] == "error":
                attrs["error.type"] = extra[1]
            elif extra:
                attrs["gen_ai.token.type"] = extra[0]
                attrs["estimated"] = extra[1]
            if len(self._attrs) >= MAX_ATTRIBUTE_SETS:
                self._attrs.clear()
            self._attrs[cache_key] = attrs
        return attrs

    def duration(self, key: tuple, error: str, seconds: float) -> None:
        self._duration.record(seconds, self._attributes(key, ("error", error) if error else ()))

    def tokens(self, key: tuple, token_type: str, estimated: bool, count: int) -> None:
        self._tokens.record(count, self._attributes(key, (token_type, estimated)))

    def ttft(self, key: tuple, seconds: float) -> None:
        self._ttft.record(seconds, self._attributes(key))

    def tpot(self, key: tuple, seconds: float) -> None:
        self._tpot.record(seconds, self._attributes(key))

    # --- lifecycle (extproc/otlp.py) ----------------------------------------------------------------

    def _shutdown_provider(self) -> None:
        self.provider.shutdown(timeout_millis=self.spec.export_timeout * 1000)  # the reader's last export


def configure(current: GenAiOtlp | None, spec: Any, worker: int = 0) -> GenAiOtlp | None:
    """The worker's `GenAiOtlp` for `spec` (None: off): the current one when the spec is unchanged,
    else a new one (the old one is shut down in the background, after its last export)."""
    return GenAiOtlp.configure(current, spec, worker)


__all__ = ["GenAiOtlp", "configure", "INSTRUMENTS"]
