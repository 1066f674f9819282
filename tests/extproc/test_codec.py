"""The protobuf boundary: what Envoy receives for each verdict, and what stages receive."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import codec
from extproc.types import CONTINUE, Mutate, Phase, Reject, Respond


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
    resp = codec.encode(Phase.REQUEST_BODY, Reject(400, "malformed_json", "bad JSON", {"limit": 3}), "adapter",
                        "r1", "rid-1")
    ir = resp.immediate_response
    assert ir.status.code == 400 and ir.details == "malformed_json"
    assert orjson.loads(ir.body) == {"error": {"status": 400, "code": "malformed_json", "message": "bad JSON",
                                               "limit": 3, "route": "r1", "request_id": "rid-1"}}
    headers = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert headers == {"content-type": b"application/json", "x-adapter-error": b"malformed_json"}
    assert resp.dynamic_metadata.fields["adapter"].struct_value.fields["processor_reply"].bool_value


def test_a_reject_is_rendered_in_the_routes_dialect_with_retry_after():
    err = Reject(429, "tenant_over_quota", "over quota", {"tenant": "acme"}, retry_after=2)
    openai = codec.encode(Phase.REQUEST_HEADERS, err, "openai", "v1", "rid").immediate_response
    body = orjson.loads(openai.body)["error"]
    assert body["type"] == "rate_limit_exceeded" and body["code"] == "tenant_over_quota"
    assert body["message"] == "over quota" and body["tenant"] == "acme" and body["param"] is None
    headers = {h.header.key: h.header.raw_value for h in openai.headers.set_headers}
    assert headers["retry-after"] == b"2"
    kserve = codec.encode(Phase.REQUEST_HEADERS, err, "kserve", "v2", "rid").immediate_response
    assert orjson.loads(kserve.body) == {"error": "over quota"}  # KServe v2's error object, nothing else


def test_a_200_answer_has_no_error_header():
    resp = codec.encode(Phase.REQUEST_HEADERS, Respond(200, b"{}", "health_ok"))
    assert resp.immediate_response.body == b"{}"
    keys = [h.header.key for h in resp.immediate_response.headers.set_headers]
    assert "x-adapter-error" not in keys


def test_mutate_and_lifecycle_metadata_share_the_replys_dynamic_metadata():
    m = Mutate(set_headers=(("x-gateway-destination-endpoint", "10.0.0.1:80"),),
               dynamic_metadata=(("envoy.lb", {"x-gateway-destination-endpoint": "10.0.0.1:80"}),))
    resp = codec.encode(Phase.REQUEST_HEADERS, m, metadata={"adapter": {"worker": "1", "token": "1-7"}})
    md = resp.dynamic_metadata.fields
    assert md["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value == "10.0.0.1:80"
    assert md["adapter"].struct_value.fields["token"].string_value == "1-7"


# --- survivors of mutation testing (issue 9): whole replies compared field for field ----------------

from google.protobuf import text_format  # noqa: E402
from google.protobuf.struct_pb2 import NULL_VALUE  # noqa: E402


def reply(text: str) -> pb.ProcessingResponse:
    return text_format.Parse(text, pb.ProcessingResponse())


def test_attributes_keep_nulls_bools_numbers_and_strings_and_absent_attributes_are_none():
    req = pb.ProcessingRequest()
    req.response_headers.end_of_stream = True
    attrs = req.attributes["envoy.filters.http.ext_proc"]
    attrs.update({"response.code": 201, "upstream.address": "10.0.0.1:80", "flag": True})
    attrs.fields["none"].null_value = NULL_VALUE
    msg = codec.decode(req)
    assert msg.attributes == {"response.code": 201.0, "upstream.address": "10.0.0.1:80", "flag": True, "none": None}
    assert msg.end_of_stream is True and msg.headers == {}
    bare = pb.ProcessingRequest()
    bare.request_headers.SetInParent()
    assert codec.decode(bare).attributes is None and codec.decode(bare).end_of_stream is False


def test_header_values_that_are_not_utf8_are_replaced_not_refused():
    req = pb.ProcessingRequest()
    h = req.response_headers.headers.headers.add()
    h.key, h.raw_value = "x-bin", b"a\xffb"
    assert codec.decode(req).headers == {"x-bin": "a\ufffdb"}
    req2 = pb.ProcessingRequest()
    t = req2.response_trailers.trailers.headers.add()
    t.key, t.raw_value = "x-t", b"\xfe"
    assert codec.decode(req2).headers == {"x-t": "\ufffd"}


def test_a_full_mutation_reply_is_exactly_this():
    m = Mutate(set_headers=(("x-a", "1"), ("x-b", "é")), remove_headers=("content-length",), body=b"new",
               clear_route_cache=True, skip_body=True, dynamic_metadata=(("envoy.lb", {"k": "v"}),))
    assert codec.encode(Phase.REQUEST_HEADERS, m, metadata={"adapter": {"worker": "0", "token": "0.a-1"}}) == reply("""
        request_headers { response {
          header_mutation {
            set_headers { header { key: "x-a" raw_value: "1" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            set_headers { header { key: "x-b" raw_value: "\\303\\251" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            remove_headers: "content-length"
          }
          body_mutation { body: "new" }
          clear_route_cache: true
        } }
        mode_override { request_body_mode: NONE response_body_mode: NONE }
        dynamic_metadata { fields { key: "adapter" value { struct_value {
            fields { key: "token" value { string_value: "0.a-1" } }
            fields { key: "worker" value { string_value: "0" } } } } }
          fields { key: "envoy.lb" value { struct_value { fields { key: "k" value { string_value: "v" } } } } } }
    """)


def test_a_plain_mutate_sets_only_what_it_names():
    assert codec.encode(Phase.RESPONSE_BODY, Mutate()) == reply("response_body { }")
    assert codec.encode(Phase.RESPONSE_BODY, Mutate(body=b"")) == reply(
        'response_body { response { body_mutation { body: "" } } }')
    assert codec.encode(Phase.REQUEST_BODY, Mutate(set_headers=(("k", "v"),))) == reply("""
        request_body { response { header_mutation {
          set_headers { header { key: "k" raw_value: "v" } append_action: OVERWRITE_IF_EXISTS_OR_ADD } } } }""")
    assert codec.encode(Phase.RESPONSE_HEADERS, Mutate(clear_route_cache=True)) == reply(
        "response_headers { response { header_mutation { } clear_route_cache: true } }")
    assert codec.encode(Phase.RESPONSE_TRAILERS, Mutate()) == reply("response_trailers { }")
    assert codec.encode(Phase.REQUEST_TRAILERS, CONTINUE) == reply("request_trailers { }")
    assert codec.encode(Phase.RESPONSE_HEADERS, CONTINUE, metadata={"adapter": {"n": 2}}) == reply("""
        response_headers { }
        dynamic_metadata { fields { key: "adapter" value { struct_value {
          fields { key: "n" value { number_value: 2 } } } } } }""")


def test_a_reject_reply_is_exactly_this_with_default_route_and_request_id():
    err = Reject(429, "tenant_over_quota", "over", {}, retry_after=3, headers=(("x-extra", "1"),))
    resp = codec.encode(Phase.REQUEST_HEADERS, err, metadata={"adapter": {"token": "t"}})
    body = resp.immediate_response.body
    assert orjson.loads(body) == {"error": {"status": 429, "code": "tenant_over_quota", "message": "over",
                                            "retry_after_s": 3, "request_id": ""}}
    resp.immediate_response.ClearField("body")
    assert resp == reply("""
        immediate_response {
          status { code: TooManyRequests }
          headers {
            set_headers { header { key: "content-type" raw_value: "application/json" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            set_headers { header { key: "x-adapter-error" raw_value: "tenant_over_quota" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            set_headers { header { key: "retry-after" raw_value: "3" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            set_headers { header { key: "x-extra" raw_value: "1" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
          }
          details: "tenant_over_quota"
        }
        dynamic_metadata { fields { key: "adapter" value { struct_value {
          fields { key: "processor_reply" value { bool_value: true } }
          fields { key: "token" value { string_value: "t" } } } } } }""")


def test_a_respond_reply_is_exactly_this():
    resp = codec.encode(Phase.REQUEST_BODY, Respond(200, b'{"ok": true}', "health_ok", (("cache-control", "no-store"),)))
    assert resp == reply("""
        immediate_response {
          status { code: OK }
          headers {
            set_headers { header { key: "content-type" raw_value: "application/json" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
            set_headers { header { key: "cache-control" raw_value: "no-store" } append_action: OVERWRITE_IF_EXISTS_OR_ADD }
          }
          body: "{\\"ok\\": true}"
          details: "health_ok"
        }
        dynamic_metadata { fields { key: "adapter" value { struct_value {
          fields { key: "processor_reply" value { bool_value: true } } } } } }""")


def test_trailers_keep_their_attributes():
    req = pb.ProcessingRequest()
    req.response_trailers.trailers.headers.add(key="grpc-status", raw_value=b"0")
    req.attributes["envoy.filters.http.ext_proc"].update({"response.code": 200})
    assert codec.decode(req).attributes == {"response.code": 200.0}


def test_filter_metadata_gives_scalars_and_lists_of_them_and_none_for_the_rest():
    from google.protobuf.struct_pb2 import Value

    req = pb.ProcessingRequest()
    assert codec.filter_metadata(req, "ns", "k") is None  # no metadata_context
    fields = req.metadata_context.filter_metadata["ns"].fields
    fields["s"].string_value = "a"
    fields["n"].number_value = 2
    fields["b"].bool_value = True
    fields["l"].list_value.values.add().string_value = "x"
    fields["l"].list_value.values.add().struct_value.SetInParent()
    fields["l"].list_value.values.add().null_value = NULL_VALUE
    fields["l"].list_value.values.add().CopyFrom(Value())  # a value with no kind
    fields["st"].struct_value.fields["inner"].string_value = "v"
    fields["nul"].null_value = NULL_VALUE
    got = {k: codec.filter_metadata(req, "ns", k) for k in ("s", "n", "b", "l", "st", "nul", "missing")}
    assert got == {"s": "a", "n": 2.0, "b": True, "l": ["x", None, None, None], "st": None, "nul": None, "missing": None}
    assert codec.filter_metadata(req, "other", "s") is None


def test_a_forwarded_jwt_payload_is_kept_as_a_struct_and_read_as_json_on_demand():
    req = pb.ProcessingRequest()
    req.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/chat/completions")
    req.metadata_context.filter_metadata["envoy.filters.http.jwt_authn"].update(
        {"jwt_payload": {"sub": "user-1", "org": {"id": "o-7"}, "exp": 1700000000}})
    msg = codec.decode(req)
    assert msg.claims is not None
    assert codec.claims_dict(msg.claims) == {"sub": "user-1", "org": {"id": "o-7"}, "exp": 1700000000.0}
    plain = pb.ProcessingRequest()
    plain.request_headers.headers.headers.add(key=":path", raw_value=b"/")
    assert codec.decode(plain).claims is None and codec.claims_dict(None) is None
    other = pb.ProcessingRequest()
    other.request_headers.SetInParent()
    other.metadata_context.filter_metadata["envoy.filters.http.jwt_authn"].update({"jwt_payload": "not a struct"})
    assert codec.decode(other).claims is None
