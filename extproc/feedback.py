"""Envoy's access log back into the processor: how every request's end reaches the worker that owns it.

What: `AccessLogFeedback` serves `envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs`
on each worker's gRPC port. The generated Envoy config has one gRPC access logger per worker,
filtered on the dynamic metadata `adapter.worker` that worker put in its first reply, so a worker
receives exactly its own requests' entries (batched by Envoy every 100 ms or 64 KiB: at 20 ms the
per-message cost made the feedback +10% of processor CPU per request on a paced headers-only
route, at 100 ms +1.5%: perf/RESULTS.md). Each entry's
`adapter.token` finds the request in the `Lifecycle`, which fires `on_done` with a `Completion`:
status, response flags, the endpoint that served (`upstream_remote_address`: the endpoint-picker
protocol's "served" feedback), the upstream cluster, time to the upstream's first byte, time to
the last byte sent, duration. Entries that carry `adapter.timing` (requests of routes with
`serverTiming`, extproc/attribution.py) go to the lifecycle's `timing_sink` as well: Envoy's own
timings for the latency attribution's `envoy` share.
Why: routes whose ext_proc stream ends at request headers (passthrough, kserve) would otherwise
never learn how their requests ended, and adding response phases would cost a round trip on
every request; the access log costs Envoy a few microseconds and the processor one protobuf parse
per request, off the request path.
Cost: about 4 us of processor CPU per entry to parse and read it (upb parse and direct field
reads), plus the lifecycle's finish; no round trip; `on_done` lags the request's end by at most
the flush interval (100 ms) plus delivery (and a pick on such a route stays counted in flight that
much longer).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from extproc.attribution import TIMING_METADATA_KEY
from extproc.lifecycle import Completion, Lifecycle

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.accesslog.v3.AccessLogService"
def _seconds(d: Any) -> float:
    return d.seconds + d.nanos / 1e9


_UNREAD = object()


def completion_of(entry: Any, md: Any = _UNREAD) -> tuple[str | None, Completion]:
    """(token, Completion) of one HTTPAccessLogEntry; `md`: its `adapter` filter metadata when the
    caller has read it already (None: the entry has none).

    The fields are read directly (HasField for the optional durations): half the cost of walking
    `ListFields()`, which builds a Python object for every field Envoy set (3.6 vs 6.7 us per entry
    here, parse included).
    """
    cp = entry.common_properties
    token = None
    if md is _UNREAD:
        md = cp.metadata.filter_metadata.get("adapter")
    if md is not None:
        t = md.fields.get("token")
        if t is not None:
            token = t.string_value
    sa = cp.upstream_remote_address.socket_address
    address = sa.address
    upstream = None
    if address:
        upstream = f"[{address}]:{sa.port_value}" if ":" in address else f"{address}:{sa.port_value}"
    has = cp.HasField
    first = _seconds(cp.time_to_first_upstream_rx_byte) if has("time_to_first_upstream_rx_byte") else None
    last = _seconds(cp.time_to_last_downstream_tx_byte) if has("time_to_last_downstream_tx_byte") else None
    duration = _seconds(cp.duration) if has("duration") else None
    flags: frozenset[str] = frozenset()
    if has("response_flags"):
        flags = frozenset(f.name for f, v in cp.response_flags.ListFields() if v is True)
    response = entry.response
    status = response.response_code.value if response.HasField("response_code") else 0
    return token, Completion(status=status, upstream=upstream, cluster=cp.upstream_cluster or None,
                             flags=flags, first_upstream_byte=first, last_downstream_byte=last,
                             duration=duration)


class AccessLogFeedback:
    def __init__(self, lifecycle: Lifecycle, metrics: Any = None):
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.entries = 0

    def handle(self, message: Any) -> None:
        """One StreamAccessLogsMessage: every HTTP entry to the lifecycle (metrics counted per message)."""
        lc = self.lifecycle
        results: dict[str, int] = {}
        sink = lc.timing_sink
        for entry in message.http_logs.log_entry:
            md = entry.common_properties.metadata.filter_metadata.get("adapter")  # read once per entry
            if sink is not None and md is not None:  # latency attribution: Envoy's own timings
                timing = md.fields.get(TIMING_METADATA_KEY)
                if timing is not None:
                    sink(timing.string_value, entry)
                    results["timing"] = results.get("timing", 0) + 1
            token, completion = completion_of(entry, md)
            self.entries += 1
            if not token:
                continue
            result = lc.completed(token, completion)
            results[result] = results.get(result, 0) + 1
        if self.metrics is not None:
            for result, n in results.items():
                self.metrics.feedback_entries.labels(result).inc(n)  # once per message, not per entry

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[Any], context: Any) -> Any:  # noqa: N802
        from envoy.service.accesslog.v3 import als_pb2

        async for message in request_iterator:
            try:
                self.handle(message)
            except Exception:  # a bad entry must not end the log stream
                log.exception("access-log entry could not be applied")
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(feedback: AccessLogFeedback, server: Any) -> None:
    from envoy.service.accesslog.v3 import als_pb2_grpc

    als_pb2_grpc.add_AccessLogServiceServicer_to_server(feedback, server)


__all__ = ["AccessLogFeedback", "completion_of", "add_to_server", "SERVICE_NAME"]
