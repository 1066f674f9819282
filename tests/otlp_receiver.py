"""A real OTLP/gRPC receiver for tests: the collector's `TraceService` and `MetricsService`.

What: `OtlpReceiver()` starts a grpc server (its own thread pool, a free port on 127.0.0.1) that
accepts `Export` calls from any OTLP exporter (Envoy's `envoy.tracers.opentelemetry`, the
processor's `OTLPSpanExporter`) and keeps every span it got, flattened with its resource's
`service.name` (`Span` below); `OtlpReceiver(port=P)` listens on a given port (a collector
that comes up where a dead one was). `wait(pred, timeout)` polls until the spans received satisfy `pred`;
`stop()` stops the server (tests call it in teardown). Nothing is mocked: the stubs are
`opentelemetry-proto`'s generated ones, and the wire is real gRPC.
Metrics (`opentelemetry.proto.collector.metrics.v1.MetricsService`, on the same port): every
histogram data point of every export is kept as a `HistogramPoint` (`points`); `wait_metrics(pred,
timeout)` polls like `wait`; `latest(name)` gives the newest point per exporter (`service.instance.id`)
and attribute set (cumulative temporality: the newest carries the totals), `count(name, **attrs)` the
sum of their counts over the points whose attributes include `attrs` (dots in names as `__`: pass
`**{"gen_ai.token.type": "input"}`). Other metric kinds are kept as their names only (`other`).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0


@dataclass(frozen=True)
class HistogramPoint:
    service: str
    instance: str  # the resource's service.instance.id (one per exporting process)
    resource: dict[str, Any]
    scope: str
    name: str
    unit: str
    description: str
    temporality: int  # AggregationTemporality: 2 = cumulative
    attributes: dict[str, Any]
    time_ns: int
    count: int
    sum: float
    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: "OtlpReceiver"):
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        self.receiver._export_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, address: str = "127.0.0.1", port: int = 0):
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._points: list[HistogramPoint] = []
        self.other: list[str] = []  # names of non-histogram metrics received
        self.exports = 0  # trace Export calls received
        self.metric_exports = 0  # metrics Export calls received
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self), self.server)
        self.port = self.server.add_insecure_port(f"{address}:{port}")  # 0: a free port
        assert self.port, f"cannot bind {address}:{port}"
        self.address = f"{address}:{self.port}"
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        got: list[Span] = []
        for rs in request.resource_spans:
            service = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        status_code=s.status.code))
        with self._lock:
            self._spans.extend(got)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait(self, pred: Callable[[list[Span]], bool], timeout: float = 15.0) -> list[Span]:
        """The spans received once `pred(spans)` holds; AssertionError with what came after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if pred(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the OTLP receiver did not get the expected spans in {timeout} s; got "
                                     f"{[(s.service, s.name, s.trace_id, s.span_id, s.parent_id) for s in spans]}")
            time.sleep(0.05)

    # --- metrics -------------------------------------------------------------------------------------

    def _export_metrics(self, request) -> None:
        got: list[HistogramPoint] = []
        other: list[str] = []
        for rm in request.resource_metrics:
            resource = {kv.key: _value(kv.value) for kv in rm.resource.attributes}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.WhichOneof("data") != "histogram":
                        other.append(m.name)
                        continue
                    for p in m.histogram.data_points:
                        got.append(HistogramPoint(
                            service=resource.get("service.name", ""), instance=resource.get("service.instance.id", ""),
                            resource=resource, scope=sm.scope.name, name=m.name, unit=m.unit,
                            description=m.description, temporality=m.histogram.aggregation_temporality,
                            attributes={kv.key: _value(kv.value) for kv in p.attributes}, time_ns=p.time_unix_nano,
                            count=p.count, sum=p.sum, bounds=tuple(p.explicit_bounds),
                            bucket_counts=tuple(p.bucket_counts)))
        with self._lock:
            self._points.extend(got)
            self.other.extend(other)
            self.metric_exports += 1

    @property
    def points(self) -> list[HistogramPoint]:
        with self._lock:
            return list(self._points)

    def latest(self, name: str) -> list[HistogramPoint]:
        """The newest point of `name` per exporter and attribute set."""
        newest: dict[tuple, HistogramPoint] = {}
        for p in self.points:
            if p.name != name:
                continue
            key = (p.instance, tuple(sorted(p.attributes.items())))
            if key not in newest or p.time_ns >= newest[key].time_ns:
                newest[key] = p
        return list(newest.values())

    def count(self, name: str, **attrs: Any) -> int:
        """Observations of `name` (newest cumulative points, summed over exporters) whose attributes include `attrs`."""
        return sum(p.count for p in self.latest(name) if all(p.attributes.get(k) == v for k, v in attrs.items()))

    def wait_metrics(self, pred: Callable[["OtlpReceiver"], bool], timeout: float = 15.0) -> None:
        """Poll until `pred(self)` holds; AssertionError with what came after `timeout`."""
        deadline = time.monotonic() + timeout
        while not pred(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"the OTLP receiver did not get the expected metrics in {timeout} s; got "
                                     f"{sorted({(p.name, p.count, str(p.attributes)) for p in self.points})}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.stop(0).wait()


__all__ = ["OtlpReceiver", "Span", "HistogramPoint"]
