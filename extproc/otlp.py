"""What the processor's two OTLP exports share: the resource, the lifecycle, the reload rule.

What: `OtlpProvider` is the base of `extproc.tracing.Tracing` (spans, `spec.tracing`) and of
`extproc.genai_otlp.GenAiOtlp` (GenAI metrics, `spec.otlpMetrics`): a worker's own OpenTelemetry
provider (never the global one) for one spec, with `flush`, an idempotent `shutdown` (a collector
problem is logged, never raised) and `shutdown_in_background`; `configure(current, spec, worker)`
keeps the current provider while the spec is unchanged, else shuts it down in the background and
builds a new one (None: off). `resource(spec, worker)` is the resource both export under:
`service.name` = `<serviceName>-processor`, `service.instance.id` = `<host>-<pid>`, `adapter.worker`.
Cost: nothing per request; importing this module imports no OpenTelemetry module (`resource`
imports the SDK when called, by a provider being built).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any


def resource(spec: Any, worker: int) -> Any:
    """The OpenTelemetry `Resource` of this worker's exports for `spec` (its `service_name`)."""
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": f"{spec.service_name}-processor",
                            "service.instance.id": f"{socket.gethostname()}-{os.getpid()}",
                            "adapter.worker": worker})


class OtlpProvider:
    """A worker's provider for one spec (`spec.export_timeout` in seconds); subclasses set
    `self.provider` and say how it shuts down (`_shutdown_provider`)."""

    SHUTDOWN_FAILED = "shutting down the provider failed"  # logged (the subclass's module's logger)
    THREAD_NAME = "otlp-shutdown"  # the background shutdown's thread
    provider: Any

    def __init__(self, spec: Any, worker: int = 0):
        self.spec = spec
        self.worker = worker
        self._closed = False
        self.stopped = threading.Event()  # set once `shutdown` has finished

    def _shutdown_provider(self) -> None:
        raise NotImplementedError

    def flush(self, timeout: float | None = None) -> bool:
        """Export what is pending now (tests, shutdown); False when it did not finish in time."""
        return self.provider.force_flush(int((timeout or self.spec.export_timeout) * 1000))

    def shutdown(self) -> None:
        """A last export (bounded by the export timeout), then stop the export thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._shutdown_provider()
        except Exception:  # noqa: BLE001 - a collector problem must not fail a reload or a stop
            logging.getLogger(type(self).__module__).exception(self.SHUTDOWN_FAILED)
        self.stopped.set()

    def shutdown_in_background(self) -> None:
        """`shutdown` in a daemon thread: a reload (the event loop) never waits for a collector."""
        threading.Thread(target=self.shutdown, name=self.THREAD_NAME, daemon=True).start()

    @classmethod
    def configure(cls, current: OtlpProvider | None, spec: Any, worker: int = 0) -> Any:
        """The worker's provider for `spec` (None: off): `current` when its spec is the same, else a
        new one (the old one is shut down in the background, after its last export)."""
        if current is not None and current.spec == spec:
            return current
        if current is not None:
            current.shutdown_in_background()
        if spec is None:
            return None
        return cls(spec, worker)


__all__ = ["OtlpProvider", "resource"]
