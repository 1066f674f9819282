"""The stage pipeline: hook binding, verdict merging, rejection, stage failures."""

from __future__ import annotations

import pytest

from extproc.pipeline import Pipeline, PipelineError, reject
from extproc.types import CONTINUE, HttpMessage, Mutate, Phase, Reject, RequestState


def state() -> RequestState:
    return RequestState(snapshot=None, route=None, started=0.0, request_id="r1")


class AddHeader:
    def __init__(self, name: str, value: str):
        self.name, self.value = name, value

    def on_request_headers(self, st, msg):
        return Mutate(set_headers=((self.name, self.value),))


class Stop:
    name = "stop"

    def on_request_headers(self, st, msg):
        return reject(429, "quota", "over quota")


class Boom:
    name = "boom"

    async def on_request_body(self, st, msg):
        raise RuntimeError("bug")


def test_misspelled_hook_is_refused_at_build_time():
    class Typo:
        name = "typo"

        def on_request_header(self, st, msg):  # missing "s"
            return None

    with pytest.raises(PipelineError, match="'on_request_header', which is not a phase"):
        Pipeline([Typo()])


def test_phases_are_what_the_stages_handle():
    assert Pipeline([AddHeader("a", "1"), Boom()]).phases == {Phase.REQUEST_HEADERS, Phase.REQUEST_BODY}
    assert Pipeline([]).phases == frozenset()


async def test_mutations_merge_in_stage_order():
    p = Pipeline([AddHeader("a", "1"), AddHeader("b", "2")])
    v = await p.run(state(), HttpMessage(Phase.REQUEST_HEADERS, headers={}))
    assert isinstance(v, Mutate) and v.set_headers == (("a", "1"), ("b", "2"))


async def test_unhandled_phase_continues():
    p = Pipeline([AddHeader("a", "1")])
    assert await p.run(state(), HttpMessage(Phase.RESPONSE_BODY)) is CONTINUE


async def test_reject_stops_the_chain():
    p = Pipeline([Stop(), AddHeader("never", "x")])
    v = await p.run(state(), HttpMessage(Phase.REQUEST_HEADERS, headers={}))
    assert isinstance(v, Reject) and v.status == 429 and b'"over quota"' in v.body


async def test_a_failing_stage_becomes_a_500_naming_it():
    v = await Pipeline([Boom()]).run(state(), HttpMessage(Phase.REQUEST_BODY, body=b"{}"))
    assert isinstance(v, Reject) and v.status == 500 and v.reason == "stage_error"
    assert v.message == "internal error in stage boom"


# --- survivors of mutation testing (issue 9): exact messages, names, phases and what hooks receive ---

import logging  # noqa: E402

from extproc.types import Outcome, Respond  # noqa: E402


class Nameless:
    def on_request_body(self, st, msg):
        raise ValueError("no name")


class Seen:
    name = "seen"

    def __init__(self):
        self.calls = []

    def on_start(self, st):
        self.calls.append(("start", st.request_id))

    def on_done(self, st, outcome):
        self.calls.append(("done", st.request_id, outcome))

    async def on_response_body(self, st, msg):
        self.calls.append(("body", st.request_id, msg.body))
        return Mutate(body=b"async")


class Streams:
    name = "streams"
    streams = (Phase.RESPONSE_BODY,)

    def on_response_trailers(self, st, msg):
        return None


class Answer:
    name = "answer"

    def on_request_headers(self, st, msg):
        return Respond(200, b"{}", "health_ok")


def test_the_misspelled_hook_error_names_the_stage_and_every_known_hook():
    class Typo:
        def on_reqest_body(self, st, msg):
            return None

    with pytest.raises(PipelineError) as e:
        Pipeline([Typo()])
    assert str(e.value) == (
        "stage 'Typo' has hook 'on_reqest_body', which is not a phase or lifecycle hook (known: on_done, "
        "on_request_body, on_request_headers, on_request_trailers, on_response_body, on_response_headers, "
        "on_response_trailers, on_start)")


async def test_a_stage_without_a_name_is_named_by_its_class_in_the_500_and_the_log(caplog):
    caplog.set_level(logging.ERROR, logger="extproc.pipeline")
    v = await Pipeline([Nameless()]).run(state(), HttpMessage(Phase.REQUEST_BODY, body=b"{}"))
    assert (v.status, v.code, v.message) == (500, "stage_error", "internal error in stage Nameless")
    assert [r.getMessage() for r in caplog.records] == ["stage Nameless failed in request_body"]


async def test_hooks_get_the_state_and_message_async_ones_awaited():
    seen = Seen()
    p = Pipeline([seen, AddHeader("a", "1")])
    st = state()
    p.start(st)
    v = await p.run(st, HttpMessage(Phase.RESPONSE_BODY, body=b"x"))
    assert v == Mutate(body=b"async")
    p.done(st, Outcome.TIMEOUT)
    assert seen.calls == [("start", "r1"), ("body", "r1", b"x"), ("done", "r1", Outcome.TIMEOUT)]


async def test_merged_mutations_keep_every_header_and_the_last_body():
    class Body:
        name = "body"

        def __init__(self, b):
            self.b = b

        def on_request_headers(self, st, msg):
            return Mutate(body=self.b, remove_headers=(self.b.decode(),))

    class Nothing:
        name = "nothing"

        def on_request_headers(self, st, msg):
            return CONTINUE

    p = Pipeline([Body(b"one"), Nothing(), AddHeader("a", "1"), Body(b"two")])
    v = await p.run(state(), HttpMessage(Phase.REQUEST_HEADERS, headers={}))
    assert v == Mutate(set_headers=(("a", "1"),), remove_headers=("one", "two"), body=b"two")


async def test_a_respond_ends_the_chain_like_a_reject():
    p = Pipeline([AddHeader("a", "1"), Answer(), Stop()])
    v = await p.run(state(), HttpMessage(Phase.REQUEST_HEADERS, headers={}))
    assert v == Respond(200, b"{}", "health_ok")


def test_streamed_phases_last_phase_and_whether_the_response_is_read():
    p = Pipeline([Streams(), AddHeader("a", "1")])
    assert p.streamed == frozenset({Phase.RESPONSE_BODY})
    assert p.last is Phase.RESPONSE_TRAILERS and p.reads_response
    assert Pipeline([AddHeader("a", "1"), Boom()]).last is Phase.REQUEST_BODY
    assert not Pipeline([AddHeader("a", "1"), Boom()]).reads_response
    assert Pipeline([Seen()]).last is Phase.RESPONSE_BODY and Pipeline([Seen()]).reads_response
    assert Pipeline([Seen()]).streamed == frozenset()

    class Headers:
        name = "h"

        def on_response_headers(self, st, msg):
            return None

    assert Pipeline([Headers()]).reads_response and Pipeline([Headers()]).last is Phase.RESPONSE_HEADERS
