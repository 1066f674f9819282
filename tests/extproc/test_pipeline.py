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
