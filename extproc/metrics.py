"""Every processor metric, declared in one place, on a registry the caller owns.

What: `ProcessorMetrics(registry)` declares the counters and histograms below. Worker processes
write them through prometheus_client's multiprocess mode (one mmap file per process under
`PROMETHEUS_MULTIPROC_DIR`); the supervisor serves the merged view on the admin port.
Labels are bounded: route names come from config, phases are six, reasons are stage codes.
Why: no global registry (tests build their own, in parallel), one module to read to know what is
exported.
Cost: a counter or histogram update is about 1 to 3 us in multiprocess mode; the request path
buffers its updates (`Pending`) and writes them every 250 ms, so a request costs a few dict additions.

| metric | type | labels |
|---|---|---|
| adapter_processor_requests_total | counter | route, outcome (ok, rejected, backend_error, truncated, cancelled, timeout), counted when the request ends (`on_done`) |
| adapter_processor_errors_total | counter | route, reason (malformed_json, backend_error, ...) |
| adapter_processor_request_duration_seconds | histogram | route (processor time over the stream) |
| adapter_processor_phase_duration_seconds | histogram | route, phase (processor time per message) |
| adapter_processor_streams_active | gauge | (live sum over workers) |
| adapter_processor_config_generation | gauge | (max over workers) |
| adapter_processor_tokens_total | counter | route, backend, model, tenant, type (prompt, completion) |
| adapter_processor_batch_size | histogram | route, backend, model (tensor routes) |
| adapter_processor_admission_total | counter | tenant, result (admitted, rejected, stale) |
| adapter_processor_config_mismatch_total | counter | (streams refused: Envoy's config digest unknown to the worker) |
| adapter_processor_upstream_first_byte_seconds | histogram | route, backend (time to the backend's first byte: TTFT for streams; from Envoy's access log, or the ext_proc stream on routes that read the response) |
| adapter_processor_feedback_entries_total | counter | result (matched, late, orphan: a request's end; timing: a serverTiming request's entry for latency attribution): Envoy access-log entries received |
| adapter_processor_scheduler_decision_duration_seconds | histogram | profile (one scheduling profile's whole decision) |
| adapter_processor_scheduler_plugin_duration_seconds | histogram | profile, plugin, slot (filter, scorer, picker): each plugin call in a profile |
| adapter_processor_scheduler_plugin_errors_total | counter | profile, plugin, slot (plugin calls that raised and were skipped: a filter keeps all, a scorer adds 0) |
| adapter_processor_variant_requests_total | counter | route, rollout, arm, outcome (requests of routes with a rollout, `spec.rollouts`, by the arm that served them; counted at `on_done`) |
| adapter_processor_variant_fallbacks_total | counter | route, rollout, arm (requests assigned an arm whose backend does not serve their model: sent to the route's first candidate) |
| adapter_processor_latency_seconds | histogram | route, component (envoy, processor_request_headers, processor_request_body, processor_response_headers, processor_response_body, queue, network_rtt, upstream_ttfb, upstream_first_token): latency attribution of routes with `serverTiming` (extproc/attribution.py) |
| adapter_processor_precision_total | counter | route, backend, precision, fallback (precision: int8, fp16, fp32, ..., unknown; fallback: none, unknown, or the steps, "int8:missing"): tensor answers from KServe backends, by the precision the backend reports (extproc/precision.py) |
| gen_ai_server_request_duration_seconds | histogram | gen_ai_operation_name, gen_ai_provider_name, gen_ai_request_model, server_address, server_port, error_type (OpenTelemetry GenAI conventions: extproc/genai.py) |
| gen_ai_server_time_to_first_token_seconds | histogram | gen_ai_operation_name, gen_ai_provider_name, gen_ai_request_model, server_address, server_port |
| gen_ai_server_time_per_output_token_seconds | histogram | gen_ai_operation_name, gen_ai_provider_name, gen_ai_request_model, server_address, server_port |
| gen_ai_client_token_usage | histogram | gen_ai_operation_name, gen_ai_provider_name, gen_ai_request_model, server_address, server_port, gen_ai_token_type, estimated (token type input or output; estimated true: the gateway's estimate, no usage from the backend) |
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Processor time per phase is sub-millisecond; the buckets resolve 50 us to 1 s.
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A scheduling plugin call is microseconds; fine between 10 and 100 us, where a decision's cost is
# judged (issue 10: at most 50 us p50 with 8 endpoints).
SCHEDULER_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 4e-5, 5e-5, 6e-5, 8e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4,
                     1e-3, 5e-3, 0.025)
# The OpenTelemetry GenAI conventions' advised boundaries (docs/gen-ai/gen-ai-metrics.md)
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
GENAI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_TOKEN_BUCKETS = tuple(float(4 ** k) for k in range(14))  # 1, 4, 16, ..., 67108864
GENAI_LABELS = ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "server_address",
                "server_port"]
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# latency attribution: processor phases (tens of us) to a long prefill (seconds), five per decade, fine
# enough for `adapterctl attribution`'s quantiles (a bucket spans at most a factor of two)
ATTRIBUTION_BUCKETS = tuple(round(m * 10.0 ** e, 9) for e in range(-5, 1) for m in (2, 3, 5, 7, 10)) + (20.0, 30.0)


class ProcessorMetrics:
    def __init__(self, registry: CollectorRegistry):
        ns = "adapter_processor"
        self.requests = Counter(f"{ns}_requests", "ext_proc streams handled, by route and outcome",
                                ["route", "outcome"], registry=registry)
        self.errors = Counter(f"{ns}_errors", "requests the processor answered with an error, by reason",
                              ["route", "reason"], registry=registry)
        self.request_duration = Histogram(f"{ns}_request_duration_seconds",
                                          "processor time spent on one request, all phases",
                                          ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.phase_duration = Histogram(f"{ns}_phase_duration_seconds",
                                        "processor time per ext_proc message, by route and phase",
                                        ["route", "phase"], buckets=LATENCY_BUCKETS, registry=registry)
        self.streams_active = Gauge(f"{ns}_streams_active", "ext_proc streams open now",
                                    registry=registry, multiprocess_mode="livesum")
        self.tokens = Counter(f"{ns}_tokens", "tokens used, from backend usage reports",
                              ["route", "backend", "model", "tenant", "type"], registry=registry)
        self.batch_size = Histogram(f"{ns}_batch_size", "batch size of tensor requests",
                                    ["route", "backend", "model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                                    registry=registry)
        self.admission = Counter(f"{ns}_admission", "admission decisions for tenants with quotas",
                                 ["tenant", "result"], registry=registry)
        self.config_mismatch = Counter(f"{ns}_config_mismatch", "streams refused because Envoy's config digest "
                                       "is not one this worker holds", registry=registry)
        self.upstream_first_byte = Histogram(f"{ns}_upstream_first_byte_seconds",
                                             "time from the request's start to the backend's first byte "
                                             "(Envoy's access log)", ["route", "backend"],
                                             buckets=TTFB_BUCKETS, registry=registry)
        self.feedback_entries = Counter(f"{ns}_feedback_entries", "Envoy access-log entries received, by result",
                                        ["result"], registry=registry)
        self.scheduler_decision_duration = Histogram(f"{ns}_scheduler_decision_duration_seconds",
                                                     "time of one scheduling profile's decision (filters, scorers, "
                                                     "picker, framework)", ["profile"], buckets=SCHEDULER_BUCKETS,
                                                     registry=registry)
        self.scheduler_plugin_duration = Histogram(f"{ns}_scheduler_plugin_duration_seconds",
                                                   "time of one plugin call in a scheduling profile",
                                                   ["profile", "plugin", "slot"], buckets=SCHEDULER_BUCKETS,
                                                   registry=registry)
        self.scheduler_plugin_errors = Counter(f"{ns}_scheduler_plugin_errors", "scheduling plugin calls that raised "
                                               "(the plugin was skipped)", ["profile", "plugin", "slot"],
                                               registry=registry)
        self.variant_requests = Counter(f"{ns}_variant_requests", "requests of routes with a canary rollout, by the "
                                        "arm that served them and outcome", ["route", "rollout", "arm", "outcome"],
                                        registry=registry)
        self.variant_fallbacks = Counter(f"{ns}_variant_fallbacks", "requests assigned an arm whose backend does not "
                                         "serve their model (sent to the route's first candidate)",
                                         ["route", "rollout", "arm"], registry=registry)
        self.precision = Counter(f"{ns}_precision", "tensor answers by the precision the backend computed them in "
                                 "and the fallback that led there", ["route", "backend", "precision", "fallback"],
                                 registry=registry)
        # the OpenTelemetry GenAI semantic conventions' metrics (extproc/genai.py records them)
        self.genai_request_duration = Histogram("gen_ai_server_request_duration_seconds",
                                                "GenAI server request duration: the gateway's request to the last byte",
                                                GENAI_LABELS + ["error_type"], buckets=GENAI_DURATION_BUCKETS,
                                                registry=registry)
        self.genai_ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                                    "time to generate the first token, for successful streamed responses",
                                    GENAI_LABELS, buckets=GENAI_TTFT_BUCKETS, registry=registry)
        self.genai_tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                                    "time per output token after the first, for successful streamed responses",
                                    GENAI_LABELS, buckets=GENAI_TPOT_BUCKETS, registry=registry)
        self.genai_token_usage = Histogram("gen_ai_client_token_usage",
                                           "input and output tokens used per request (estimated=true: the gateway's "
                                           "estimate, the backend reported none)",
                                           GENAI_LABELS + ["gen_ai_token_type", "estimated"],
                                           buckets=GENAI_TOKEN_BUCKETS, registry=registry)
        self.latency = Histogram("adapter_processor_latency_seconds",
                                 "latency attribution: seconds per component of one request (routes with serverTiming)",
                                 ["route", "component"], buckets=ATTRIBUTION_BUCKETS, registry=registry)
        self.config_generation = Gauge(f"{ns}_config_generation", "generation of the config snapshot in use",
                                       registry=registry, multiprocess_mode="max")


class Pending:
    """Metric updates of the request path, applied to the real metrics in one go every flush.

    What: `inc(child, n)` and `observe(child, value)` add to plain dicts (a histogram's bucket is
    found by bisect over its bounds); `flush()` applies the sums with one write per touched series
    (`child.inc(total)`; a histogram's `_sum` and each touched bucket, exactly what `observe` would
    have written, one observation at a time). The worker flushes every 250 ms and when it stops;
    tests call `flush()` before reading a registry.
    Why: in multiprocess mode every update is a locked mmap write with a pid check (about 1 to
    2 us); a request makes 5 to 15 of them. Buffered, a request costs dict additions and the
    writes are shared by every request of the flush interval. Scrapes see values at most one flush
    interval old.
    Cost: about 0.2 us per update; a flush is one write per series touched since the last one.
    Relies on prometheus_client's Histogram internals (`_upper_bounds`, `_buckets`, `_sum`), pinned
    in pyproject.toml and checked by tests/extproc/test_metrics.py against direct `observe` calls.
    """

    __slots__ = ("_counts", "_hists")

    def __init__(self) -> None:
        self._counts: dict[Any, float] = {}
        self._hists: dict[Any, list] = {}  # child -> [sum, count per bucket...]

    def inc(self, child: Any, amount: float = 1.0) -> None:
        self._counts[child] = self._counts.get(child, 0.0) + amount

    def observe(self, child: Any, value: float) -> None:
        h = self._hists.get(child)
        if h is None:
            h = self._hists[child] = [0.0] + [0] * len(child._upper_bounds)
        h[0] += value
        h[1 + bisect_left(child._upper_bounds, value)] += 1

    def flush(self) -> None:
        counts, hists = self._counts, self._hists
        self._counts, self._hists = {}, {}
        for child, amount in counts.items():
            child.inc(amount)
        for child, h in hists.items():
            child._sum.inc(h[0])
            for i, n in enumerate(h[1:]):
                if n:
                    child._buckets[i].inc(n)
