"""The protobuf boundary: what Envoy receives for each verdict, and what stages receive."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import codec
from extproc.types import CONTINUE, Mutate, Phase, Reject


def test_decode_request_headers_reads_raw_value():
    req = pb.ProcessingRequest()
    h = req.request_headers.headers.headers.add()
    h.key, h.raw_value = ":path", "/v1/analyze?x=1".encode()
    msg = codec.decode(req)
    assert msg.phase is Phase.REQUEST_HEADERS and msg.headers == {":path": "/v1/analyze?x=1"}


def test_decode_body_and_attributes():
    req = pb.ProcessingRequest()
    req.response_body.body = b'{"a":1}'
    req.response_body.end_of_stream = True
    req.attributes["envoy.filters.http.ext_proc"].update({"response.code": 200, "request.path": "/p"})
    msg = codec.decode(req)
    assert msg.phase is Phase.RESPONSE_BODY and msg.body == b'{"a":1}' and msg.end_of_stream
    assert msg.attributes == {"response.code": 200.0, "request.path": "/p"}


def test_continue_is_an_empty_but_present_reply_for_the_phase():
    resp = codec.encode(Phase.REQUEST_BODY, CONTINUE)
    assert resp.WhichOneof("response") == "request_body"
    assert not resp.request_body.response.HasField("header_mutation")


def test_mutation_uses_raw_value_and_carries_header_mutation_with_clear_route_cache():
    resp = codec.encode(Phase.REQUEST_HEADERS, Mutate(set_headers=(("x-adapter-backend", "b1"),),
                                                      clear_route_cache=True))
    common = resp.request_headers.response
    assert common.clear_route_cache and common.HasField("header_mutation")
    opt = common.header_mutation.set_headers[0]
    assert opt.header.key == "x-adapter-backend" and opt.header.raw_value == b"b1" and opt.header.value == ""
    # clear_route_cache alone still gets the (empty) header_mutation Envoy requires
    bare = codec.encode(Phase.REQUEST_HEADERS, Mutate(clear_route_cache=True)).request_headers.response
    assert bare.HasField("header_mutation")


def test_body_replacement_and_skip_body():
    resp = codec.encode(Phase.RESPONSE_BODY, Mutate(body=b"new", remove_headers=("content-length",)))
    assert resp.response_body.response.body_mutation.body == b"new"
    assert list(resp.response_body.response.header_mutation.remove_headers) == ["content-length"]
    skip = codec.encode(Phase.RESPONSE_HEADERS, Mutate(skip_body=True))
    assert skip.HasField("mode_override") and skip.mode_override.response_body_mode == 0  # NONE


def test_reject_is_an_immediate_json_response_marked_for_envoy():
    body = orjson.dumps({"error": {"status": 400}})
    resp = codec.encode(Phase.REQUEST_BODY, Reject(400, body, "malformed_json"))
    ir = resp.immediate_response
    assert ir.status.code == 400 and ir.body == body and ir.details == "malformed_json"
    headers = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert headers == {"content-type": b"application/json", "x-adapter-error": b"malformed_json"}
    assert resp.dynamic_metadata.fields["adapter"].struct_value.fields["processor_reply"].bool_value


def test_a_200_answer_has_no_error_header():
    resp = codec.encode(Phase.REQUEST_HEADERS, Reject(200, b"{}", "health_ok"))
    keys = [h.header.key for h in resp.immediate_response.headers.set_headers]
    assert "x-adapter-error" not in keys
