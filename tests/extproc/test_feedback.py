"""Envoy's gRPC access log back into the lifecycle: entries -> Completion -> on_done of the owning request."""

from __future__ import annotations

import asyncio

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from prometheus_client import CollectorRegistry

from extproc.feedback import AccessLogFeedback, completion_of
from extproc.lifecycle import Completion, Lifecycle
from extproc.metrics import ProcessorMetrics
from extproc.types import Outcome, RequestState
from tests.promtext import collect


def entry(token: str | None = "0-1", *, address: str | None = "127.0.0.1", port: int = 9002, status: int | None = 200,
          flags: tuple[str, ...] = (), ttfb: tuple[int, int] | None = (0, 12_500_000), cluster: str = "beta",
          last_tx: tuple[int, int] | None = None, duration: tuple[int, int] | None = None,
          metadata: dict | None = None) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    common = e.common_properties
    if token is not None:
        common.metadata.filter_metadata["adapter"].update({"token": token, "worker": token.partition("-")[0]})
    for ns, fields in (metadata or {}).items():
        common.metadata.filter_metadata[ns].update(fields)
    if address is not None:
        common.upstream_remote_address.socket_address.address = address
        common.upstream_remote_address.socket_address.port_value = port
    if cluster:
        common.upstream_cluster = cluster
    if status is not None:
        e.response.response_code.value = status
    for f in flags:
        setattr(common.response_flags, f, True)
    if ttfb is not None:
        common.time_to_first_upstream_rx_byte.seconds, common.time_to_first_upstream_rx_byte.nanos = ttfb
    if last_tx is not None:
        common.time_to_last_downstream_tx_byte.seconds, common.time_to_last_downstream_tx_byte.nanos = last_tx
    if duration is not None:
        common.duration.seconds, common.duration.nanos = duration
    return e


def message(*entries) -> als_pb2.StreamAccessLogsMessage:
    m = als_pb2.StreamAccessLogsMessage()
    m.http_logs.log_entry.extend(entries)
    return m


# --- completion_of ---------------------------------------------------------------------------------


def test_completion_of_a_full_entry():
    token, c = completion_of(entry("0-7", last_tx=(0, 500_000_000), duration=(1, 250_000_000)))
    assert token == "0-7"
    assert c == Completion(status=200, upstream="127.0.0.1:9002", cluster="beta", flags=frozenset(),
                           first_upstream_byte=0.0125, last_downstream_byte=0.5, duration=1.25)


def test_completion_of_survives_a_wire_round_trip():
    raw = entry("3-9", status=429).SerializeToString()
    token, c = completion_of(accesslog_pb2.HTTPAccessLogEntry.FromString(raw))
    assert token == "3-9" and c.status == 429 and c.upstream == "127.0.0.1:9002"


@pytest.mark.parametrize("address, port, expected", [
    ("::1", 8000, "[::1]:8000"),
    ("fd00:10::7", 80, "[fd00:10::7]:80"),
    ("10.1.2.3", 443, "10.1.2.3:443"),
])
def test_upstream_formatting(address, port, expected):
    assert completion_of(entry(address=address, port=port))[1].upstream == expected


def test_missing_fields_are_none_or_zero():
    token, c = completion_of(accesslog_pb2.HTTPAccessLogEntry())
    assert token is None
    assert c == Completion(status=0, upstream=None, cluster=None, flags=frozenset(), first_upstream_byte=None,
                           last_downstream_byte=None, duration=None)


def test_no_response_code_is_status_zero_even_with_other_fields():
    _, c = completion_of(entry(status=None, flags=("downstream_remote_reset",), ttfb=None))
    assert c.status == 0 and c.first_upstream_byte is None and c.flags == {"downstream_remote_reset"}


def test_upstream_without_socket_address_is_none():
    e = entry(address=None)
    e.common_properties.upstream_remote_address.pipe.path = "/run/backend.sock"
    assert completion_of(e)[1].upstream is None


def test_flags_set_names():
    _, c = completion_of(entry(flags=("upstream_request_timeout", "no_healthy_upstream")))
    assert c.flags == frozenset({"upstream_request_timeout", "no_healthy_upstream"})
    _, c = completion_of(entry(flags=("downstream_connection_termination",)))
    assert c.flags == frozenset({"downstream_connection_termination"})


def test_flags_message_present_but_none_set_is_empty():
    e = entry()
    e.common_properties.response_flags.SetInParent()
    assert completion_of(e)[1].flags == frozenset()


@pytest.mark.parametrize("md", [{}, {"adapter": {"worker": "0"}}, {"other": {"token": "0-1"}}])
def test_no_token_without_the_adapter_token(md):
    e = entry(None, metadata=md)
    assert completion_of(e)[0] is None


# --- AccessLogFeedback.handle ----------------------------------------------------------------------


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, Outcome]] = []

    def __call__(self, state: RequestState, outcome: Outcome) -> None:
        self.calls.append((state.token, outcome))


def open_request(lc: Lifecycle) -> RequestState:
    st = RequestState(snapshot=None, route=None, started=0.0)
    lc.start(st)
    lc.metadata(st)  # the first reply carried the token to Envoy
    return st


def test_entry_finishes_the_request_after_its_stream_ended():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    fb = AccessLogFeedback(lc)
    st = open_request(lc)
    assert st.token == "0.a-1"
    lc.stream_ended(st, "end", now=0.0)
    assert rec.calls == [] and lc.open_count == 1  # waiting for Envoy's entry
    fb.handle(message(entry("0.a-1", status=503, flags=("upstream_connection_failure",))))
    assert rec.calls == [("0.a-1", Outcome.BACKEND_ERROR)]
    assert st.outcome is Outcome.BACKEND_ERROR and lc.open_count == 0
    assert st.completion.status == 503 and st.completion.upstream == "127.0.0.1:9002"
    assert st.completion.flags == {"upstream_connection_failure"} and fb.entries == 1
    assert lc.sweep(now=1e9) == 0  # nothing left waiting


def test_entry_before_the_stream_end_waits_for_it():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    fb = AccessLogFeedback(lc)
    st = open_request(lc)
    fb.handle(message(entry(st.token, status=200, flags=("downstream_remote_reset",))))
    assert rec.calls == [] and st.completion is not None
    lc.stream_ended(st, "cancelled")
    assert rec.calls == [(st.token, Outcome.CANCELLED)]


def test_entries_match_their_own_requests_only():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    fb = AccessLogFeedback(lc)
    a, b = open_request(lc), open_request(lc)
    for st in (a, b):
        lc.stream_ended(st, "end", now=0.0)
    fb.handle(message(entry(b.token, status=429)))
    assert rec.calls == [(b.token, Outcome.REJECTED)] and a.outcome is None
    fb.handle(message(entry(a.token, status=200)))
    assert rec.calls[-1] == (a.token, Outcome.OK)


def test_entries_without_a_token_are_ignored():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    metrics = ProcessorMetrics(registry := CollectorRegistry())
    fb = AccessLogFeedback(lc, metrics)
    st = open_request(lc)
    lc.stream_ended(st, "end", now=0.0)
    fb.handle(message(entry(None, status=500), entry("", status=500)))
    assert rec.calls == [] and st.outcome is None and st.completion is None
    assert fb.entries == 2 and lc._orphans == {}
    assert collect(registry).series("adapter_processor_feedback_entries_total") == {}  # no token: not counted
    fb.handle(message(entry(None), entry(st.token, status=200)))
    assert rec.calls == [(st.token, Outcome.OK)] and fb.entries == 4


def test_an_entry_arriving_twice_finishes_once_and_counts_late():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    metrics = ProcessorMetrics(registry := CollectorRegistry())
    fb = AccessLogFeedback(lc, metrics)
    st = open_request(lc)
    lc.stream_ended(st, "end", now=0.0)
    fb.handle(message(entry(st.token, status=200)))
    fb.handle(message(entry(st.token, status=500)))
    assert rec.calls == [(st.token, Outcome.OK)] and lc.late_entries == 1
    assert collect(registry).series("adapter_processor_feedback_entries_total") == {
        (("result", "matched"),): 1.0, (("result", "late"),): 1.0}


def test_entry_after_the_deadline_is_late():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    fb = AccessLogFeedback(lc)
    st = open_request(lc)
    st.complete = True  # the stream saw all it asked for
    lc.stream_ended(st, "end", now=0.0)
    assert lc.sweep(now=100.0) == 1  # route None: timeout 0 + grace
    assert rec.calls == [(st.token, Outcome.OK)] and st.attrs["_completion_source"] == "deadline"
    fb.handle(message(entry(st.token, status=500)))
    assert rec.calls == [(st.token, Outcome.OK)] and lc.late_entries == 1


def test_entry_of_an_unknown_token_waits_as_an_orphan():
    lc = Lifecycle(0, feedback=True, boot="a")
    fb = AccessLogFeedback(lc)
    fb.handle(message(entry("0.a-99", status=200)))
    assert "0.a-99" in lc._orphans and lc.late_entries == 0


def test_orphan_entries_are_counted_as_orphans():
    lc = Lifecycle(0, feedback=True, boot="a")
    metrics = ProcessorMetrics(registry := CollectorRegistry())
    fb = AccessLogFeedback(lc, metrics)
    fb.handle(message(entry("0.a-99", status=200)))
    assert collect(registry).series("adapter_processor_feedback_entries_total") == {(("result", "orphan"),): 1.0}


# --- the gRPC method ------------------------------------------------------------------------------


def test_stream_access_logs_applies_every_message_and_survives_a_bad_one():
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    fb = AccessLogFeedback(lc)
    a, b = open_request(lc), open_request(lc)
    for st in (a, b):
        lc.stream_ended(st, "end", now=0.0)
    real = lc.completed
    calls = []

    def flaky(token, completion, now=None):
        calls.append(token)
        if len(calls) == 1:
            raise RuntimeError("boom")
        real(token, completion, now)

    lc.completed = flaky  # type: ignore[method-assign]

    async def source():
        yield message(entry(a.token, status=200))
        yield message(entry(b.token, status=200))

    resp = asyncio.run(fb.StreamAccessLogs(source(), None))
    assert isinstance(resp, als_pb2.StreamAccessLogsResponse)
    assert calls == [a.token, b.token] and rec.calls == [(b.token, Outcome.OK)]


def test_an_entry_for_a_previous_process_of_the_worker_is_dropped_not_applied():
    """A restarted worker (same index, new pid) never takes its predecessor's entries."""
    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="new", observers=[rec])
    fb = AccessLogFeedback(lc)
    st = open_request(lc)
    lc.stream_ended(st, "end", now=0.0)
    fb.handle(message(entry("0.old-1", status=500)))  # same number, the old process's token
    assert rec.calls == [] and lc.late_entries == 1 and not lc._orphans
    fb.handle(message(entry(st.token, status=200)))
    assert rec.calls == [(st.token, Outcome.OK)]


# --- survivors of mutation testing (issue 9) ------------------------------------------------------


def test_entries_of_one_message_are_counted_per_result_with_their_number():
    registry = CollectorRegistry()
    lc = Lifecycle(0, feedback=True, boot="a")
    fb = AccessLogFeedback(lc, ProcessorMetrics(registry))
    a, b = open_request(lc), open_request(lc)
    for st in (a, b):
        lc.stream_ended(st, "end", now=0.0)
    fb.handle(message(entry(a.token), entry(b.token), entry("0.a-77"), entry(None)))
    assert fb.entries == 4
    assert collect(registry).series("adapter_processor_feedback_entries_total") == {
        (("result", "matched"),): 2.0, (("result", "orphan"),): 1.0}


def test_a_bad_message_is_logged_and_the_stream_goes_on(caplog):
    lc = Lifecycle(0, feedback=True, boot="a")
    fb = AccessLogFeedback(lc)
    lc.completed = None  # type: ignore[assignment]  # every entry with a token fails to apply

    async def source():
        yield message(entry("0.a-1"))

    caplog.set_level("ERROR", logger="extproc.feedback")
    asyncio.run(fb.StreamAccessLogs(source(), None))
    assert [r.getMessage() for r in caplog.records] == ["access-log entry could not be applied"]


async def test_add_to_server_serves_the_access_log_service_over_grpc():
    import grpc
    from envoy.service.accesslog.v3 import als_pb2_grpc

    from extproc.feedback import add_to_server

    rec = Recorder()
    lc = Lifecycle(0, feedback=True, boot="a", observers=[rec])
    st = open_request(lc)
    lc.stream_ended(st, "end", now=0.0)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_to_server(AccessLogFeedback(lc), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            async def source():
                yield message(entry(st.token, status=503))
            resp = await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(source())
    finally:
        await server.stop(0)
    assert isinstance(resp, als_pb2.StreamAccessLogsResponse)
    assert rec.calls == [(st.token, Outcome.BACKEND_ERROR)]
