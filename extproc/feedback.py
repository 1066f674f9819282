"""Envoy's access log back into the processor: how every request's end reaches the worker that owns it.

What: `AccessLogFeedback` serves `envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs`
on each worker's gRPC port. The generated Envoy config has one gRPC access logger per worker,
filtered on the dynamic metadata `adapter.worker` that worker put in its first reply, so a worker
receives exactly its own requests' entries (batched by Envoy every 20 ms or 16 KiB). Each entry's
`adapter.token` finds the request in the `Lifecycle`, which fires `on_done` with a `Completion`:
status, response flags, the endpoint that served (`upstream_remote_address`: the endpoint-picker
protocol's "served" feedback), the upstream cluster, time to the upstream's first byte, time to
the last byte sent, duration.
Why: routes whose ext_proc stream ends at request headers (passthrough, kserve) would otherwise
never learn how their requests ended, and adding response phases would cost a round trip on
every request; the access log costs Envoy a few microseconds and the processor one protobuf parse
per request, off the request path.
Cost: about 5 to 15 us of processor CPU per entry (upb parse, a dict lookup, the lifecycle's
finish); no round trip; `on_done` lags the request's end by at most the flush interval (20 ms)
plus delivery.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from extproc.lifecycle import Completion, Lifecycle

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.accesslog.v3.AccessLogService"
_FLAG_NAMES: tuple[str, ...] = ()


def _flags(rf: Any) -> frozenset[str]:
    global _FLAG_NAMES
    if not _FLAG_NAMES:
        _FLAG_NAMES = tuple(f.name for f in rf.DESCRIPTOR.fields if f.type == f.TYPE_BOOL)
    return frozenset(name for name in _FLAG_NAMES if getattr(rf, name))


def _seconds(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


def completion_of(entry: Any) -> tuple[str | None, Completion]:
    """(token, Completion) of one HTTPAccessLogEntry."""
    common = entry.common_properties
    token = None
    md = common.metadata.filter_metadata.get("adapter")
    if md is not None:
        value = md.fields.get("token")
        if value is not None:
            token = value.string_value
    upstream = None
    if common.HasField("upstream_remote_address"):
        sa = common.upstream_remote_address.socket_address
        if sa.address:
            upstream = f"[{sa.address}]:{sa.port_value}" if ":" in sa.address else f"{sa.address}:{sa.port_value}"
    return token, Completion(
        status=entry.response.response_code.value if entry.response.HasField("response_code") else 0,
        upstream=upstream,
        cluster=common.upstream_cluster or None,
        flags=_flags(common.response_flags) if common.HasField("response_flags") else frozenset(),
        first_upstream_byte=_seconds(common.time_to_first_upstream_rx_byte)
        if common.HasField("time_to_first_upstream_rx_byte") else None,
        last_downstream_byte=_seconds(common.time_to_last_downstream_tx_byte)
        if common.HasField("time_to_last_downstream_tx_byte") else None,
        duration=_seconds(common.duration) if common.HasField("duration") else None,
    )


class AccessLogFeedback:
    def __init__(self, lifecycle: Lifecycle, metrics: Any = None):
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.entries = 0

    def handle(self, message: Any) -> None:
        """One StreamAccessLogsMessage: every HTTP entry to the lifecycle."""
        lc = self.lifecycle
        for entry in message.http_logs.log_entry:
            token, completion = completion_of(entry)
            self.entries += 1
            if not token:
                continue
            result = lc.completed(token, completion)
            if self.metrics is not None:
                self.metrics.feedback_entries.labels(result).inc()

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:  # noqa: N802
        from envoy.service.accesslog.v3 import als_pb2

        try:
            async for message in request_iterator:
                try:
                    self.handle(message)
                except Exception:  # a bad entry must not end the log stream
                    log.exception("access-log entry could not be applied")
        finally:
            pass
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(feedback: AccessLogFeedback, server: Any) -> None:
    from envoy.service.accesslog.v3 import als_pb2_grpc

    als_pb2_grpc.add_AccessLogServiceServicer_to_server(feedback, server)


__all__ = ["AccessLogFeedback", "completion_of", "add_to_server", "SERVICE_NAME"]
