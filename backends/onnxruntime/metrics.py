"""Prometheus metrics of the ONNX Runtime server, in a registry of its own.

What (label ``model`` is the model name; version-specific state also has ``version``):

- ``ort_requests_total{model,status}``: inference requests by outcome, ``status`` being
  ``success``, ``bad_request``, ``not_found``, ``unavailable`` or ``error`` (unknown model names
  count under ``model="_unknown"``, keeping the label set bounded).
- ``ort_request_time_seconds{model}``: histogram, server time per successful request
  (parse to encoded response).
- ``ort_queue_time_seconds{model}``: histogram, time a request waited in the batcher's queue.
- ``ort_inference_time_seconds{model}``: histogram, ``session.run`` time per batch.
- ``ort_batch_size{model}``: histogram, rows per ``session.run``; ``ort_batch_requests{model}``:
  requests stacked per ``session.run``.
- ``ort_queue_depth{model,version}``: gauge, requests waiting now.
- ``ort_batching_max_batch_size{model,version}``, ``ort_batching_max_queue_delay_seconds{model,version}``:
  gauges, the batching settings in force (they change at run time).
- ``ort_model_ready{model,version}``: 1 when ready.
- ``ort_model_active_precision{model,version,precision}``: 1 for the active variant, 0 for the
  others in the model's precision order.
- ``ort_model_execution_provider{model,version,provider}``: 1 per provider the session uses.
- ``ort_model_fallback_total{model,from,to,reason}``: steps down the precision order.
- ``ort_execution_provider_available{provider}``: what this onnxruntime build offers.

Why: the QoS engine and operators read queue time against batch size to tune batching, and a
precision fallback must be visible without reading logs.  One registry per server instance keeps
tests and several servers in one process apart (no global registry).
Cost: a histogram observation is a lock and a bucket search (about 1 us); three per batch and one
or two per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .config import BatchingSettings

__all__ = ["ModelBatchObserver", "OrtMetrics", "UNKNOWN_MODEL"]

UNKNOWN_MODEL = "_unknown"
_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class OrtMetrics:
    """The server's metric families and the few operations that update several of them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ort_requests", "Inference requests by outcome.", ["model", "status"], registry=r)
        self.request_duration = Histogram("ort_request_time_seconds",
                                          "Server time per successful inference request.", ["model"],
                                          buckets=_SECONDS, registry=r)
        self.queue_duration = Histogram("ort_queue_time_seconds",
                                        "Time a request waited in the dynamic batcher's queue.", ["model"],
                                        buckets=_SECONDS, registry=r)
        self.inference_duration = Histogram("ort_inference_time_seconds",
                                            "onnxruntime session.run time per batch.", ["model"],
                                            buckets=_SECONDS, registry=r)
        self.batch_size = Histogram("ort_batch_size", "Rows per session.run.", ["model"], buckets=_BATCH,
                                    registry=r)
        self.batch_requests = Histogram("ort_batch_requests", "Requests stacked per session.run.", ["model"],
                                        buckets=_BATCH, registry=r)
        self.queue_depth = Gauge("ort_queue_depth", "Requests waiting in the batcher now.",
                                 ["model", "version"], registry=r)
        self.max_batch_size = Gauge("ort_batching_max_batch_size", "Dynamic batching: max rows per run.",
                                    ["model", "version"], registry=r)
        self.max_queue_delay = Gauge("ort_batching_max_queue_delay_seconds",
                                     "Dynamic batching: max wait of the oldest request.", ["model", "version"],
                                     registry=r)
        self.ready = Gauge("ort_model_ready", "1 when the model version is ready.", ["model", "version"],
                           registry=r)
        self.active_precision = Gauge("ort_model_active_precision",
                                      "1 for the precision variant serving the model version.",
                                      ["model", "version", "precision"], registry=r)
        self.model_provider = Gauge("ort_model_execution_provider",
                                    "1 per execution provider the model version's session uses.",
                                    ["model", "version", "provider"], registry=r)
        self.fallbacks = Counter("ort_model_fallback", "Steps down a model's precision order.",
                                 ["model", "from", "to", "reason"], registry=r)
        self.provider_available = Gauge("ort_execution_provider_available",
                                        "Execution providers this onnxruntime build offers.", ["provider"],
                                        registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def providers_available(self, providers: Iterable[str]) -> None:
        for provider in providers:
            self.provider_available.labels(provider).set(1)

    def count_request(self, model: str, status: str) -> None:
        self.requests.labels(model, status).inc()

    def fallback(self, model: str, from_precision: str, to_precision: str, reason: str) -> None:
        self.fallbacks.labels(model, from_precision, to_precision, reason).inc()

    def model_state(self, model: str, version: str, ready: bool, precision: str | None,
                    precision_order: Sequence[str], providers: Sequence[str]) -> None:
        self.ready.labels(model, version).set(1 if ready else 0)
        for tag in precision_order:
            self.active_precision.labels(model, version, tag).set(1 if ready and tag == precision else 0)
        for provider in providers:
            self.model_provider.labels(model, version, provider).set(1 if ready else 0)

    def batching(self, model: str, version: str, settings: BatchingSettings) -> None:
        self.max_batch_size.labels(model, version).set(settings.max_batch_size)
        self.max_queue_delay.labels(model, version).set(settings.max_queue_delay_us / 1e6)

    def forget_version(self, model: str, version: str) -> None:
        """Drop the gauges of an unloaded version (counters and histograms keep their history)."""
        for gauge in (self.queue_depth, self.max_batch_size, self.max_queue_delay, self.ready):
            try:
                gauge.remove(model, version)
            except KeyError:
                pass
        for gauge in (self.active_precision, self.model_provider):
            for labels in [k for k in list(gauge._metrics) if k[:2] == (model, version)]:  # noqa: SLF001
                gauge.remove(*labels)


class ModelBatchObserver:
    """The batcher's per-batch callback, bound to one model's label children (no lookups per batch)."""

    def __init__(self, metrics: OrtMetrics, model: str) -> None:
        self._queue = metrics.queue_duration.labels(model)
        self._run = metrics.inference_duration.labels(model)
        self._rows = metrics.batch_size.labels(model)
        self._requests = metrics.batch_requests.labels(model)

    def batch_done(self, rows: int, requests: int, queue_seconds: Sequence[float], run_seconds: float,
                   ok: bool) -> None:
        for seconds in queue_seconds:
            self._queue.observe(seconds)
        if ok:
            self._run.observe(run_seconds)
            self._rows.observe(rows)
            self._requests.observe(requests)
