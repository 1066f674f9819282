"""The request lifecycle: outcomes derived correctly, and `on_done` exactly once whatever the ending.

The property test drives `ExtProcService.Process` (the real stream handler, real pipelines) with
ProcessingRequest sequences recorded from Envoy 1.40 (tests/data/recorded), cut at any point and
ended in every way Envoy or a client can end a stream (end of input, reset/cancel, an error), with
Envoy's access-log entry for the request arriving never, before the stream's end, after it, or
twice, and the deadline sweep run at any time: the route pipeline's `on_done` and every lifecycle
observer fire exactly once per request.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.lifecycle import Completion, Lifecycle, derive_outcome
from extproc.metrics import ProcessorMetrics
from extproc.runtime import Runtime
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import Outcome, RequestState
from tests.conftest import DATA
from tests.promtext import collect

RECORDED = DATA / "recorded"
SEQUENCES = {
    "v1-analyze": "v1-analyze-rec-llm-ok.txtpb",
    "v1-chat-completions": "v1-chat-completions-rec-passthrough.txtpb",
    "adapter-health": "adapter-health-rec-health.txtpb",
}


def recorded(name: str) -> list[pb.ProcessingRequest]:
    chunks = (RECORDED / name).read_text().split("# message\n")[1:]
    return [text_format.Parse(c, pb.ProcessingRequest()) for c in chunks]


class _Md:
    def __init__(self, key: str, value: str):
        self.key, self.value = key, value


class _Context:
    def __init__(self, route: str, digest: str | None = None):
        self.md = [_Md("x-adapter-route", route), _Md("x-request-id", "rid")]
        if digest is not None:
            self.md.append(_Md("x-adapter-config-digest", digest))

    def invocation_metadata(self):
        return self.md


class Recorder:
    """Counts on_done per request token (pipeline hook and runtime observer both wrap into this)."""

    def __init__(self):
        self.done: dict[str, list[Outcome]] = {}

    def __call__(self, state: RequestState, outcome: Outcome) -> None:
        self.done.setdefault(state.token, []).append(outcome)


def service(feedback: bool) -> tuple[ExtProcService, Recorder, CollectorRegistry]:
    rec = Recorder()
    registry = CollectorRegistry()
    runtime = Runtime(feedback=feedback, observers=[rec])
    svc = ExtProcService(ConfigRef(load_file(RECORDED / "config.yaml")), ProcessorMetrics(registry), runtime=runtime)
    return svc, rec, registry


async def run_stream(svc: ExtProcService, route: str, requests: list, ending: str,
                     on_first_reply=None) -> RequestState | None:
    """Feed `requests` one by one (waiting for each reply, as Envoy does), then end as `ending` says."""
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    gate = asyncio.Event()
    held = asyncio.Event()

    async def source():
        while not queue.empty():
            yield queue.get_nowait()
            await asyncio.sleep(0)
        if ending == "error":
            raise RuntimeError("transport broke")
        if ending == "cancel":
            held.set()
            await gate.wait()  # held open until cancelled, like a stream Envoy resets

    replies = []

    async def consume():
        async for reply in svc.Process(source(), _Context(route)):
            replies.append(reply)
            if len(replies) == 1 and on_first_reply is not None:
                on_first_reply()

    task = asyncio.create_task(consume())
    if ending == "cancel":
        # every request was read and the stream waits for more: then Envoy resets it
        held_wait = asyncio.ensure_future(held.wait())
        await asyncio.wait({held_wait, task}, return_when=asyncio.FIRST_COMPLETED)
        held_wait.cancel()
        task.cancel()
    try:
        await task
    except (asyncio.CancelledError, RuntimeError):
        pass
    return replies


def lc_tokens(svc: ExtProcService) -> list[str]:
    return list(svc.runtime.lifecycle._open)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(sorted(SEQUENCES)), cut=st.integers(0, 4),
       ending=st.sampled_from(["eof", "cancel", "error"]), feedback=st.booleans(),
       entry=st.sampled_from(["never", "before_end", "after_end", "twice"]),
       status=st.sampled_from([0, 200, 429, 500, 504]), sweep_early=st.booleans())
def test_on_done_fires_exactly_once_whatever_the_ending(route, cut, ending, feedback, entry, status, sweep_early):
    async def scenario():
        svc, rec, _ = service(feedback)
        lc = svc.runtime.lifecycle
        requests = recorded(SEQUENCES[route])[:cut]
        tokens: list[str] = []
        completion = Completion(status=status, upstream="127.0.0.1:18101",
                                flags=frozenset({"downstream_remote_reset"}) if status == 0 else frozenset())

        def first_reply():
            tokens.extend(lc_tokens(svc))
            if entry == "before_end":  # Envoy's log can outrun the stream's end in this worker
                for t in tokens:
                    lc.completed(t, completion)

        await run_stream(svc, route, requests, ending, on_first_reply=first_reply)
        if sweep_early:
            lc.sweep()  # before the deadline: finishes nothing that is still waiting
        if entry in ("after_end", "twice"):
            for t in tokens:
                lc.completed(t, completion)
        if entry == "twice":
            for t in tokens:
                lc.completed(t, completion)
        lc.sweep(now=10**9)  # every deadline passed
        return rec, lc

    rec, lc = asyncio.run(scenario())
    assert lc.open_count == 0, "a request was never finished"
    assert lc.done_count == 1, f"one stream, {lc.done_count} on_done"
    assert len(rec.done) == 1 and all(len(v) == 1 for v in rec.done.values()), rec.done
    (outcome,) = next(iter(rec.done.values()))
    assert isinstance(outcome, Outcome)


async def test_processor_rejection_is_done_at_once_and_a_later_entry_is_ignored():
    svc, rec, registry = service(feedback=True)
    reqs = recorded("v1-analyze-rec-llm-malformed.txtpb")
    await run_stream(svc, "v1-analyze", reqs, "eof")
    assert [o for v in rec.done.values() for o in v] == [Outcome.REJECTED]  # the processor answered: known
    (token,) = rec.done
    assert svc.runtime.lifecycle.completed(token, Completion(status=400)) == "late"
    assert collect(registry, [svc]).series("adapter_processor_requests_total") == {
        (("outcome", "rejected"), ("route", "v1-analyze")): 1.0}


async def test_a_route_that_reads_the_response_learns_its_end_from_the_stream():
    """Status and served endpoint come with the first response message (Envoy's response_attributes):
    no access-log entry is asked for (no `adapter.worker` metadata), on_done fires at the stream's end."""
    svc, rec, _ = service(feedback=True)
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    # Envoy's own 503 (the backend reset before answering): the body is not asked for
    reqs[2].attributes["envoy.filters.http.ext_proc"].update({
        "response.code": 503, "upstream.address": "10.0.0.9:8000",
        "response.code_details": "upstream_reset_before_response_started{connection_failure}"})
    status = next(h for h in reqs[2].response_headers.headers.headers if h.key == ":status")
    status.raw_value = b"503"
    replies = await run_stream(svc, "v1-analyze", reqs[:3], "eof")
    assert all("adapter" not in r.dynamic_metadata.fields for r in replies)
    assert [o for v in rec.done.values() for o in v] == [Outcome.BACKEND_ERROR]
    assert svc.runtime.lifecycle.open_count == 0


async def test_served_endpoint_and_first_byte_are_recorded_from_the_stream():
    svc, rec, _ = service(feedback=True)
    completions = []
    svc.runtime.lifecycle.observers.append(lambda st, o: completions.append(st.completion))
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    reqs[2].attributes["envoy.filters.http.ext_proc"].update({"response.code": 200,
                                                               "upstream.address": "10.0.0.9:8000"})
    await run_stream(svc, "v1-analyze", reqs, "eof")
    (c,) = completions
    assert c.source == "stream" and c.status == 200 and c.upstream == "10.0.0.9:8000"
    assert c.first_upstream_byte is not None and c.first_upstream_byte >= 0


async def test_the_first_response_body_bytes_are_timed_after_the_first_response_message():
    """`state.first_body`: when the first response body bytes came (an SSE stream's first event comes with
    the first token: predicted-ttft-scorer learns TTFT from it); headers alone do not set it."""
    svc, rec, _ = service(feedback=True)
    states = []
    svc.runtime.lifecycle.observers.append(lambda st, o: states.append(st))
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    assert reqs[3].HasField("response_body") and reqs[3].response_body.body  # the recording's answer
    await run_stream(svc, "v1-analyze", reqs, "eof")
    (st,) = states
    assert st.first_byte is not None and st.first_body is not None
    assert st.started <= st.first_byte <= st.first_body
    states.clear()
    await run_stream(svc, "v1-analyze", reqs[:3], "eof")  # no response body message
    (st,) = states
    assert st.first_byte is not None and st.first_body is None


async def test_backend_500_is_a_backend_error_not_ok():
    svc, rec, registry = service(feedback=False)
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    status = next(h for h in reqs[2].response_headers.headers.headers if h.key == ":status")
    status.raw_value = b"500"
    await run_stream(svc, "v1-analyze", reqs[:3], "eof")
    assert collect(registry, [svc]).series("adapter_processor_requests_total") == {  # and no `ok`
        (("outcome", "backend_error"), ("route", "v1-analyze")): 1.0}


async def test_passthrough_outcome_comes_from_envoys_entry():
    svc, rec, registry = service(feedback=True)
    await run_stream(svc, "v1-chat-completions", recorded("v1-chat-completions-rec-passthrough.txtpb"), "cancel")
    (token,) = lc_tokens(svc)
    assert rec.done == {}  # the stream ended at request headers: nothing known yet
    svc.runtime.lifecycle.completed(token, Completion(status=503, upstream=None, flags=frozenset({"upstream_connection_failure"})))
    assert rec.done == {token: [Outcome.BACKEND_ERROR]}


async def test_client_cancel_mid_response_is_cancelled_without_feedback():
    svc, rec, _ = service(feedback=False)
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    await run_stream(svc, "v1-analyze", reqs[:3], "cancel")  # reset before the response body came
    assert [o for v in rec.done.values() for o in v] == [Outcome.CANCELLED]


async def test_deadline_finishes_from_what_the_stream_saw():
    svc, rec, _ = service(feedback=True)
    await run_stream(svc, "v1-chat-completions", recorded("v1-chat-completions-rec-passthrough.txtpb"), "eof")
    (token,) = lc_tokens(svc)
    lc = svc.runtime.lifecycle
    assert lc.sweep() == 0 and rec.done == {}  # not overdue yet
    assert lc.sweep(now=10**9) == 1
    assert rec.done == {token: [Outcome.OK]}
    lc.completed(token, Completion(status=200))  # too late: counted, not applied
    assert lc.late_entries == 1 and len(rec.done[token]) == 1


def _state(**kw) -> RequestState:
    return RequestState(snapshot=None, route=None, started=0.0, **kw)


@pytest.mark.parametrize("kw, completion, expected", [
    ({}, Completion(200), Outcome.OK),
    ({}, Completion(404), Outcome.REJECTED),
    ({}, Completion(500), Outcome.BACKEND_ERROR),
    ({}, Completion(503, flags=frozenset({"upstream_connection_failure"})), Outcome.BACKEND_ERROR),
    ({}, Completion(504, flags=frozenset({"upstream_request_timeout"})), Outcome.TIMEOUT),
    ({}, Completion(0, flags=frozenset({"downstream_remote_reset"})), Outcome.CANCELLED),
    ({}, Completion(200, flags=frozenset({"upstream_remote_reset"})), Outcome.TRUNCATED),
    ({}, Completion(0, flags=frozenset({"upstream_connection_termination"})), Outcome.BACKEND_ERROR),
    ({}, Completion(200, flags=frozenset({"downstream_connection_termination"})), Outcome.CANCELLED),
    ({"observed": Outcome.TRUNCATED}, Completion(200), Outcome.TRUNCATED),
    ({"reply_status": 429}, None, Outcome.REJECTED),
    ({"reply_status": 200}, None, Outcome.OK),
    ({"response_status": 502}, None, Outcome.BACKEND_ERROR),
    ({"stream_end": "cancelled"}, None, Outcome.CANCELLED),
    # the client closed at the stream's `[DONE]` (the openai SDK does) before the end of body reached Envoy
    ({"stream_end": "cancelled", "delivered": True, "response_status": 200}, None, Outcome.OK),
    ({"stream_end": "cancelled", "delivered": True, "response_status": 200},
     Completion(200, flags=frozenset({"downstream_remote_reset"})), Outcome.CANCELLED),  # Envoy's word first
    ({"stream_end": "error"}, None, Outcome.BACKEND_ERROR),
])
def test_outcome_derivation(kw, completion, expected):
    assert derive_outcome(_state(**kw), completion) is expected


def test_entries_before_their_stream_wait_as_orphans_then_expire():
    lc = Lifecycle(worker=3, feedback=True, boot="a")
    lc.completed("3.a-99", Completion(200), now=0.0)  # a token this worker has not issued yet
    assert lc._orphans and lc.late_entries == 0
    lc.sweep(now=1000.0)
    assert not lc._orphans


async def test_close_finishes_every_open_request():
    svc, rec, _ = service(feedback=True)
    await run_stream(svc, "v1-chat-completions", recorded("v1-chat-completions-rec-passthrough.txtpb"), "eof")
    assert rec.done == {} and svc.runtime.lifecycle.open_count == 1  # waiting for Envoy's entry
    svc.runtime.lifecycle.close()  # the worker stops
    assert [o for v in rec.done.values() for o in v] == [Outcome.OK] and svc.runtime.lifecycle.open_count == 0


async def test_feedback_off_in_the_snapshot_asks_envoy_for_nothing(write_config):
    text = (RECORDED / "config.yaml").read_text().replace("  processor: {basePort", "  processor: {feedback: stream, basePort")
    assert "feedback: stream" in text
    rec = Recorder()
    svc = ExtProcService(ConfigRef(load_file(write_config(text))), ProcessorMetrics(CollectorRegistry()),
                         runtime=Runtime(feedback=True, observers=[rec]))
    replies = await run_stream(svc, "v1-chat-completions", recorded("v1-chat-completions-rec-passthrough.txtpb"), "eof")
    assert all("adapter" not in r.dynamic_metadata.fields for r in replies)
    assert [o for v in rec.done.values() for o in v] == [Outcome.OK]  # done at the stream's end


async def test_only_configured_models_become_token_label_values():
    from backends.base import Usage
    from extproc.request import InferenceRequest

    svc, rec, registry = service(feedback=False)
    svc.runtime.lifecycle.observers.insert(0, lambda st, o: setattr(st, "usage", Usage(prompt_tokens=3)))
    for model in ("qwen2.5-finance", "client-made-up-model"):
        reqs = recorded("v1-chat-completions-rec-passthrough.txtpb")

        async def stream():
            async def source():
                for r in reqs:
                    yield r
            ctx = _Context("v1-chat-completions")
            async for _ in svc.Process(source(), ctx):
                pass

        svc.runtime.lifecycle.observers.insert(
            0, lambda st, o, m=model: setattr(st, "request", InferenceRequest(api="openai.chat", model=m)))
        await stream()
        del svc.runtime.lifecycle.observers[0]
    assert collect(registry, [svc]).series("adapter_processor_tokens_total") == {
        (("backend", "fake"), ("model", m), ("route", "v1-chat-completions"), ("tenant", "none"), ("type", "prompt")): 3.0
        for m in ("qwen2.5-finance", "other")}


# --- survivors of mutation testing (issue 9): exact tokens, deadlines and counts -------------------


def _open(lc: Lifecycle, **kw) -> RequestState:
    st = _state(**kw)
    lc.start(st)
    return st


def test_metadata_names_the_worker_and_the_token_and_marks_it_sent():
    lc = Lifecycle(worker=3, feedback=True, boot="b")
    st = _open(lc)
    assert st.token == "3.b-1" and st.token_sent is False
    assert lc.metadata(st) == {"adapter": {"worker": "3", "token": "3.b-1"}}
    assert st.token_sent is True
    assert _open(lc).token == "3.b-2"


def test_the_token_number_is_read_after_the_last_dash_of_a_boot_with_dashes():
    lc = Lifecycle(worker=0, feedback=True, boot="x-y")
    st = _open(lc)
    assert st.token == "0.x-y-1"
    assert lc.completed("0.x-y-5", Completion(200), now=0.0) == "orphan"  # not issued yet: may come
    assert lc.completed("0.x-y-2", Completion(200), now=0.0) == "orphan"  # the next one, not issued either
    assert lc.completed("0.x-y-0", Completion(200), now=0.0) == "late"
    assert lc.completed("0.other-1", Completion(200), now=0.0) == "late"
    assert lc.late_entries == 2 and sorted(lc._orphans) == ["0.x-y-2", "0.x-y-5"]


def test_an_orphan_is_kept_for_its_ttl_and_dropped_at_it():
    from extproc.lifecycle import ORPHAN_TTL

    lc = Lifecycle(worker=0, feedback=True, boot="a")
    assert lc.completed("0.a-1", Completion(200), now=100.0) == "orphan"
    lc.sweep(now=100.0 + ORPHAN_TTL - 0.5)
    assert list(lc._orphans) == ["0.a-1"]
    lc.sweep(now=100.0 + ORPHAN_TTL)
    assert lc._orphans == {}


def test_an_orphan_entry_completes_its_stream_when_it_ends():
    rec = Recorder()
    lc = Lifecycle(worker=0, feedback=True, boot="a", observers=[rec])
    assert lc.completed("0.a-1", Completion(503, flags=frozenset({"upstream_connection_failure"})), now=0.0) == "orphan"
    st = _open(lc)
    lc.metadata(st)
    lc.stream_ended(st, "end", now=0.0)
    assert rec.done == {"0.a-1": [Outcome.BACKEND_ERROR]} and lc._orphans == {} and lc._waiting == {}


def test_the_deadline_is_the_route_timeout_plus_the_grace_and_sweep_finishes_at_it():
    from extproc.lifecycle import FEEDBACK_GRACE

    svc, rec, _ = service(feedback=True)
    lc = svc.runtime.lifecycle
    route = svc.config.current.routes["v1-chat-completions"]
    st = RequestState(snapshot=svc.config.current, route=route, started=0.0, complete=True)
    lc.start(st)
    lc.metadata(st)
    lc.stream_ended(st, "end", now=100.0)
    deadline = 100.0 + route.timeout + FEEDBACK_GRACE
    assert route.timeout > 0 and lc._waiting == {st.token: deadline}
    assert lc.sweep(now=deadline - 0.001) == 0 and rec.done == {}
    assert lc.sweep(now=deadline) == 1
    assert rec.done == {st.token: [Outcome.OK]} and st.attrs["_completion_source"] == "deadline"
    assert lc._waiting == {} and lc.open_count == 0


def test_late_entries_are_counted_each():
    lc = Lifecycle(worker=0, feedback=True, boot="a")
    st = _open(lc)
    lc.stream_ended(st, "end")  # no token sent: done at once
    for _ in range(3):
        assert lc.completed(st.token, Completion(200)) == "late"
    assert lc.late_entries == 3


def test_an_entry_for_a_stream_still_open_waits_for_its_end():
    rec = Recorder()
    lc = Lifecycle(worker=0, feedback=True, boot="a", observers=[rec])
    st = _open(lc)
    lc.metadata(st)
    assert lc.completed(st.token, Completion(429), now=0.0) == "matched"
    assert rec.done == {} and st.completion == Completion(429)
    lc.stream_ended(st, "end", now=0.0)
    assert rec.done == {st.token: [Outcome.REJECTED]} and lc._waiting == {}


def test_close_marks_the_source_and_finishes_from_what_is_known():
    seen = []
    lc = Lifecycle(worker=0, feedback=True, boot="a",
                   observers=[lambda st, o: seen.append((st.token, o, st.attrs.get("_completion_source")))])
    a, b = _open(lc, complete=True), _open(lc, reply_status=429)
    for s in (a, b):
        lc.metadata(s)
        lc.stream_ended(s, "end", now=0.0)
    assert len(lc._waiting) == 2
    lc.close()
    assert seen == [("0.a-1", Outcome.OK, "shutdown"), ("0.a-2", Outcome.REJECTED, "shutdown")]
    assert lc._waiting == {} and lc.open_count == 0 and lc.done_count == 2
    lc.close()  # nothing left: nothing fires twice
    assert len(seen) == 2


def test_stream_ended_twice_or_after_done_changes_nothing():
    rec = Recorder()
    lc = Lifecycle(worker=0, feedback=False, boot="a", observers=[rec])
    st = _open(lc)
    lc.stream_ended(st, "error")
    lc.stream_ended(st, "end")
    assert st.stream_end == "error" and rec.done == {st.token: [Outcome.BACKEND_ERROR]} and lc.done_count == 1


def test_a_raising_observer_is_logged_and_the_next_still_runs(caplog):
    rec = Recorder()

    def broken(state, outcome):
        raise RuntimeError("observer bug")

    lc = Lifecycle(worker=0, feedback=False, boot="a", observers=[broken, rec])
    st = _open(lc, complete=True)
    caplog.set_level("ERROR", logger="extproc.lifecycle")
    lc.stream_ended(st, "end")
    assert rec.done == {st.token: [Outcome.OK]}
    assert [r.getMessage() for r in caplog.records] == [f"lifecycle observer {broken!r} failed"]


def test_a_stream_side_completion_has_the_status_endpoint_and_times_from_the_start():
    seen = []
    lc = Lifecycle(worker=0, feedback=False, boot="a", observers=[lambda st, o: seen.append(st.completion)])
    st = _open(lc, response_status=201, served="10.0.0.1:80", first_byte=5.0)
    st.started = 4.0
    lc.stream_ended(st, "end")
    (c,) = seen
    assert (c.status, c.upstream, c.first_upstream_byte, c.source, c.flags, c.cluster) == \
        (201, "10.0.0.1:80", 1.0, "stream", frozenset(), None)
    assert c.duration is not None and c.duration > 0
    st2 = _open(lc, first_byte=5.0)  # no status seen
    st2.started = 5.0
    lc.stream_ended(st2, "end")
    assert seen[1].status == 0 and seen[1].first_upstream_byte == 0.0
    st3 = _open(lc)  # no response message seen: no stream completion
    lc.stream_ended(st3, "end")
    assert seen[2] is None


@pytest.mark.parametrize("kw, completion, expected", [
    ({}, Completion(504), Outcome.TIMEOUT),
    ({}, Completion(200, flags=frozenset({"stream_idle_timeout"})), Outcome.TIMEOUT),
    ({}, Completion(399, flags=frozenset({"local_reset"})), Outcome.TRUNCATED),
    ({}, Completion(400, flags=frozenset({"local_reset"})), Outcome.BACKEND_ERROR),
    ({}, Completion(1, flags=frozenset({"upstream_overflow"})), Outcome.TRUNCATED),
    ({}, Completion(0), Outcome.CANCELLED),  # an entry without a status: nothing was sent
    ({"reply_status": 503}, Completion(0), Outcome.BACKEND_ERROR),
    ({"observed": Outcome.REJECTED}, Completion(500), Outcome.REJECTED),
    ({"observed": Outcome.TRUNCATED}, Completion(200, flags=frozenset({"downstream_remote_reset"})), Outcome.CANCELLED),
    ({"stream_end": "end"}, None, Outcome.CANCELLED),
    ({"stream_end": "end", "complete": True}, None, Outcome.OK),
    ({"stream_end": "cancelled", "reply_status": 200}, None, Outcome.OK),
    ({"stream_end": "error", "complete": True}, None, Outcome.BACKEND_ERROR),
    ({"stream_end": "error", "response_status": 200}, None, Outcome.OK),
    ({"stream_end": "end", "complete": True, "response_status": 504}, None, Outcome.TIMEOUT),
    ({"response_status": 500}, None, Outcome.BACKEND_ERROR),
    ({"response_status": 499}, None, Outcome.REJECTED),
    ({"response_status": 400}, None, Outcome.REJECTED),
    ({"response_status": 399}, None, Outcome.OK),
    ({"reply_status": 404, "response_status": 200}, None, Outcome.REJECTED),
])
def test_outcome_derivation_boundaries(kw, completion, expected):
    assert derive_outcome(_state(**kw), completion) is expected


def test_a_504_with_an_upstream_failure_flag_is_a_timeout():
    assert derive_outcome(_state(), Completion(504, flags=frozenset({"upstream_remote_reset"}))) is Outcome.TIMEOUT


def test_defaults_worker_0_no_feedback_and_the_pid_in_hex_as_boot():
    import os

    lc = Lifecycle()
    assert (lc.worker, lc.feedback, lc.boot) == ("0", False, f"0.{os.getpid():x}")
    st = _open(lc)
    assert st.token == f"0.{os.getpid():x}-1"


def test_a_second_stream_end_while_waiting_for_envoy_changes_nothing():
    from extproc.lifecycle import FEEDBACK_GRACE

    lc = Lifecycle(worker=0, feedback=True, boot="a")
    st = _open(lc)
    lc.metadata(st)
    lc.stream_ended(st, "end", now=10.0)
    assert lc._waiting == {st.token: 10.0 + FEEDBACK_GRACE}  # no route: no route timeout
    lc.stream_ended(st, "cancelled", now=50.0)
    assert st.stream_end == "end" and lc._waiting == {st.token: 10.0 + FEEDBACK_GRACE}


def test_the_route_pipelines_hooks_get_the_state_and_the_outcome():
    import dataclasses

    from extproc.pipeline import Pipeline

    calls = []

    class Hooks:
        name = "hooks"

        def on_start(self, st):
            calls.append(("start", st.token))

        def on_done(self, st, outcome):
            calls.append(("done", st.token, outcome))

    snap = load_file(RECORDED / "config.yaml")
    route = dataclasses.replace(snap.routes["v1-analyze"], pipeline=Pipeline([Hooks()]))
    lc = Lifecycle(worker=0, feedback=False, boot="a")
    st = RequestState(snapshot=snap, route=route, started=0.0, reply_status=429)
    lc.start(st)
    lc.stream_ended(st, "end")
    assert calls == [("start", "0.a-1"), ("done", "0.a-1", Outcome.REJECTED)]


def test_a_stream_side_duration_is_the_time_since_the_start():
    seen = []
    lc = Lifecycle(worker=0, feedback=False, boot="a", observers=[lambda st, o: seen.append(st.completion)])
    started = time.monotonic()
    st = _open(lc, first_byte=started)
    st.started = started
    lc.stream_ended(st, "end")
    assert 0 <= seen[0].duration <= time.monotonic() - started


async def test_a_picks_pending_prefill_ends_at_the_first_response_body_and_the_rest_at_its_end(monkeypatch):
    """A picked request counts (tokens, prefill) in the in-flight table (dispatch.dispatched); the
    stream's first response body bytes take the prefill back (the engine sends the first token only
    after it), the request's end the tokens and the request; without a response body, the end takes
    everything back."""
    svc, rec, _ = service(feedback=True)
    rt = svc.runtime
    ep = "10.0.0.9:8000"
    real_start = rt.lifecycle.start
    seen = []

    def start(state):  # what dispatch does for a pick, at the stream's start (this route picks none)
        state.endpoint, state.inflight = ep, (300, 200)
        rt.inflight.started(ep, 300, 200)
        return real_start(state)

    monkeypatch.setattr(rt.lifecycle, "start", start)
    # observers run in order and the runtime's release is the first: one put before it sees the table
    # as the request leaves it
    rt.lifecycle.observers.insert(0, lambda st, o: seen.append(("before release", rt.inflight.loads([ep])[ep],
                                                                 st.inflight)))
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    await run_stream(svc, "v1-analyze", reqs, "eof")
    assert rt.inflight.loads([ep]) == {ep: (0, 0, 0)}  # after release: nothing left
    assert ("before release", (1, 300, 0), (300, 0)) in seen  # the body came: prefill done, tokens still in
    seen.clear()
    await run_stream(svc, "v1-analyze", reqs[:3], "eof")  # no response body: the prefill stays pending...
    assert ("before release", (1, 300, 200), (300, 200)) in seen
    assert rt.inflight.loads([ep]) == {ep: (0, 0, 0)}  # ...until the end takes it back
