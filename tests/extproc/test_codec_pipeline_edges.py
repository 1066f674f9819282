"""Branches of the protobuf boundary and the stage runner that the recorded traffic never takes:
trailers both ways, attributes of another filter, metadata of every value type, header removal, and
the lifecycle hooks (`on_start`, `on_done`) with a stage that raises."""

from __future__ import annotations

import logging

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import codec
from extproc.pipeline import Pipeline
from extproc.types import CONTINUE, Mutate, Outcome, Phase, RequestState


def test_trailers_decode_to_headers_that_end_the_stream():
    for which, phase in (("request_trailers", Phase.REQUEST_TRAILERS), ("response_trailers", Phase.RESPONSE_TRAILERS)):
        req = pb.ProcessingRequest()
        h = getattr(req, which).trailers.headers.add()
        h.key, h.raw_value = "grpc-status", b"0"
        msg = codec.decode(req)
        assert (msg.phase, msg.headers, msg.end_of_stream, msg.attributes) == (phase, {"grpc-status": "0"}, True, None)


def test_attributes_of_another_namespace_are_empty_not_missing():
    req = pb.ProcessingRequest()
    req.request_body.body = b"{}"
    req.attributes["envoy.filters.http.other"].update({"x": 1})
    assert codec.decode(req).attributes == {}


def test_trailer_replies_carry_the_header_mutation_or_nothing():
    resp = codec.encode(Phase.RESPONSE_TRAILERS, Mutate(set_headers=(("x-a", "1"),), remove_headers=("x-b",)))
    hm = resp.response_trailers.header_mutation
    assert [(o.header.key, o.header.raw_value) for o in hm.set_headers] == [("x-a", b"1")]
    assert list(hm.remove_headers) == ["x-b"]
    empty = codec.encode(Phase.REQUEST_TRAILERS, CONTINUE)
    assert empty.WhichOneof("response") == "request_trailers" and not empty.request_trailers.HasField("header_mutation")


def test_header_removal_and_metadata_of_every_value_type():
    resp = codec.encode(Phase.REQUEST_HEADERS, Mutate(remove_headers=("x-drop", "x-also")),
                        metadata={"adapter": {"s": "v", "b": True, "n": 3, "f": 0.5, "o": ("t",)}})
    assert list(resp.request_headers.response.header_mutation.remove_headers) == ["x-drop", "x-also"]
    fields = resp.dynamic_metadata.fields["adapter"].struct_value.fields
    assert fields["s"].string_value == "v" and fields["b"].WhichOneof("kind") == "bool_value" and fields["b"].bool_value
    assert fields["n"].number_value == 3 and fields["f"].number_value == 0.5
    assert fields["o"].string_value == "('t',)"  # anything else: its text


class _Starts:
    name = "starts"

    def __init__(self, log: list):
        self.log = log

    def on_start(self, state: RequestState) -> None:
        self.log.append(("start", state.request_id))

    def on_done(self, state: RequestState, outcome: Outcome) -> None:
        self.log.append(("done", outcome))


class _Broken:
    name = "broken"

    def on_start(self, state: RequestState) -> None:
        raise RuntimeError("start bug")

    def on_done(self, state: RequestState, outcome: Outcome) -> None:
        raise RuntimeError("done bug")


def test_lifecycle_hooks_run_in_order_and_one_stage_raising_hides_nothing_from_the_next(caplog):
    log: list = []
    pipeline = Pipeline([_Broken(), _Starts(log)])
    assert pipeline.phases == frozenset() and pipeline.last is None and not pipeline.reads_response
    state = RequestState(snapshot=None, route=None, started=0.0, request_id="r1")
    caplog.set_level(logging.ERROR, logger="extproc.pipeline")
    pipeline.start(state)
    pipeline.done(state, Outcome.CANCELLED)
    assert log == [("start", "r1"), ("done", Outcome.CANCELLED)]
    assert [r.getMessage() for r in caplog.records] == ["stage broken failed in on_start", "stage broken failed in on_done"]


def test_an_immediate_reply_keeps_the_callers_metadata_next_to_its_own_mark():
    from extproc.errors import reject

    resp = codec.encode(Phase.REQUEST_BODY, reject(400, "bad", "no"), metadata={"envoy.lb": {"x": "1"}})
    fields = resp.dynamic_metadata.fields
    assert fields["envoy.lb"].struct_value.fields["x"].string_value == "1"
    assert fields["adapter"].struct_value.fields["processor_reply"].bool_value
    assert resp.immediate_response.status.code == 400


def test_a_route_of_an_unknown_kind_gets_no_pipeline():
    import pytest

    from extproc.stages import build_pipeline

    class Route:
        kind = "no-such-kind"

    with pytest.raises(ValueError, match="no pipeline for route kind 'no-such-kind'"):
        build_pipeline(Route())
