"""Form and multipart request bodies of tool calls, parsed by a real HTTP server.

The server is aiohttp (its own urlencoded and multipart parsers, nothing shared with ours), started
on a free port in a thread for this module and stopped in teardown; `/echo` answers with what it
parsed: the request's content type and every field (urlencoded: name/value pairs; multipart: each
part's name, filename, content type and bytes). Covered: the uspto search (urlencoded, from the OAI
example), encoding styles (exploded and joined arrays, pipe, space, deepObject, allowReserved),
multipart text, JSON, binary (base64 arguments) and declared part content types, errors naming the
field, the choice between several content types, the tool-call stage's rewritten request sent as is,
and a hypothesis round trip: arguments -> encoded body -> parsed by the server -> the arguments.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft7Validator, Draft202012Validator

from extproc.semantic import toolcall as tc
from extproc.semantic.form_encoding import (MULTIPART, URLENCODED, FormEncoding, FormEncodingError, encode_form,
                                            encode_multipart)
from extproc.semantic.openapi import load_spec, parse_spec
from extproc.semantic.tools import build_tools
from tests.form_echo import EchoServer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "openapi"


@pytest.fixture(scope="module")
def server():
    s = EchoServer()
    s.start()
    yield s
    s.stop()


def spec_of(paths: dict, version: str = "3.0.3"):
    return parse_spec({"openapi": version, "info": {"title": "t", "version": "1"}, "paths": paths}, "t.yaml", None)


def form_tool(media: str, schema: dict, encoding: dict | None = None, required: bool = True, params=()):
    mt = {"schema": schema}
    if encoding is not None:
        mt["encoding"] = encoding
    ts = build_tools(spec_of({"/f": {"post": {"operationId": "f", "parameters": list(params),
                                              "requestBody": {"required": required, "content": {media: mt}},
                                              "responses": {"200": {"description": "ok"}}}}}))
    assert ts.skipped == (), ts.report()
    return ts.tools[0], ts


def parts(echo: dict) -> list[tuple]:
    return [(p["name"], p["filename"], p["content_type"], base64.b64decode(p["data"])) for p in echo["parts"]]


# --------------------------------------------------------------------------
# urlencoded
# --------------------------------------------------------------------------


def test_the_uspto_search_is_a_form_tool_and_the_server_parses_its_body(server):
    ts = build_tools(load_spec(FIXTURES / "v3.0" / "uspto.yaml"))
    tool = ts.by_name["perform-search"]
    assert set(tool.parameters["properties"]) == {"version", "dataset", "criteria", "start", "rows"}
    echo = server.call(tool, {"dataset": "oa_citations", "version": "v1",
                              "criteria": "patentNumber:[1 TO 2] & title:\"a+b=c\" 中文", "start": 0, "rows": 10})
    assert echo["path"] == "/oa_citations/v1/records"  # the base URL replaces the spec's server
    assert echo["content_type"] == "application/x-www-form-urlencoded"
    assert echo["fields"] == [["criteria", "patentNumber:[1 TO 2] & title:\"a+b=c\" 中文"], ["start", "0"],
                              ["rows", "10"]]


def test_urlencoded_styles_from_the_encoding_object(server):
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}},
        "ids": {"type": "array", "items": {"type": "integer"}},
        "pipes": {"type": "array", "items": {"type": "string"}},
        "spaces": {"type": "array", "items": {"type": "string"}},
        "meta": {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "object"}}},
        "flat": {"type": "object", "properties": {"x": {"type": "string"}}},
        "url": {"type": "string"},
        "flag": {"type": "boolean"}, "ratio": {"type": "number"}, "none": {"type": "string", "nullable": True}}}
    encoding = {"ids": {"style": "form", "explode": False}, "pipes": {"style": "pipeDelimited"},
                "spaces": {"style": "spaceDelimited"}, "meta": {"style": "deepObject", "explode": True},
                "url": {"allowReserved": True}}
    tool, _ = form_tool(URLENCODED, schema, encoding)
    args = {"tags": ["a b", "c&d"], "ids": [1, 2], "pipes": ["x", "y"], "spaces": ["p", "q"],
            "meta": {"a": "1", "n": {"k": "v"}}, "flat": {"x": "7"}, "url": "http://h/p?q=1",
            "flag": True, "ratio": 0.5, "none": None}
    req = tc.build_request(tool, args)
    assert b"url=http://h/p?q%3D1" in req.body  # reserved kept, "=" still encoded
    echo = server.call(tool, args)
    assert echo["fields"] == [["tags", "a b"], ["tags", "c&d"], ["ids", "1,2"], ["pipes", "x|y"],
                              ["spaces", "p q"], ["meta[a]", "1"], ["meta[n][k]", "v"], ["x", "7"],
                              ["url", "http://h/p?q=1"], ["flag", "true"], ["ratio", "0.5"]]


def test_a_form_body_wrapped_because_a_field_clashes_with_a_parameter(server):
    tool, ts = form_tool(URLENCODED, {"type": "object", "properties": {"id": {"type": "string"}}},
                         params=[{"name": "id", "in": "query", "schema": {"type": "string"}}])
    assert tool.body.arg == "body"
    echo = server.call(tool, {"id": "q", "body": {"id": "b"}})
    assert echo["path"] == "/f?id=q" and echo["fields"] == [["id", "b"]]


# --------------------------------------------------------------------------
# multipart
# --------------------------------------------------------------------------


def test_multipart_parts_have_their_content_types_and_binary_is_base64(server):
    schema = {"type": "object", "required": ["file"], "properties": {
        "title": {"type": "string"}, "count": {"type": "integer"}, "meta": {"type": "object"},
        "file": {"type": "string", "format": "binary", "description": "The picture"},
        "photos": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "labels": {"type": "array", "items": {"type": "string"}},
        "joined": {"type": "array", "items": {"type": "string"}},
        "asjson": {"type": "string"}}}
    encoding = {"file": {"contentType": "image/png, image/jpeg"}, "photos": {"contentType": "image/*"},
                "joined": {"explode": False}, "asjson": {"contentType": "application/json"},
                "meta": {"headers": {"X-Rate": {"schema": {"type": "integer"}}}}}
    tool, ts = form_tool(MULTIPART, schema, encoding)
    file_schema = tool.parameters["properties"]["file"]
    assert file_schema["contentEncoding"] == "base64" and "format" not in file_schema
    assert file_schema["description"].startswith("The picture (Binary content, given in base64")
    assert tool.parameters["properties"]["photos"]["items"]["contentEncoding"] == "base64"
    assert any("per-part headers of 'meta'" in w.message for w in ts.warnings)
    png = bytes(range(256)) + b"\r\n--not-the-boundary\r\n"
    args = {"title": "Über \"quoted\"\r\nline", "count": 3, "meta": {"k": [1, 2]},
            "file": base64.b64encode(png).decode(), "photos": [base64.b64encode(b"\x00\xff").decode(), ""],
            "labels": ["a", "b"], "joined": ["x", "y"], "asjson": "v"}
    echo = server.call(tool, args)
    assert echo["content_type"].startswith("multipart/form-data; boundary=adapter-gateway-")
    assert parts(echo) == [
        ("title", None, "text/plain; charset=utf-8", "Über \"quoted\"\r\nline".encode()),
        ("count", None, "text/plain; charset=utf-8", b"3"),
        ("meta", None, "application/json", b'{"k":[1,2]}'),
        ("file", "file", "image/png", png),
        ("photos", "photos", "application/octet-stream", b"\x00\xff"),
        ("photos", "photos", "application/octet-stream", b""),
        ("labels", None, "text/plain; charset=utf-8", b"a"),
        ("labels", None, "text/plain; charset=utf-8", b"b"),
        ("joined", None, "text/plain; charset=utf-8", b"x,y"),
        ("asjson", None, "application/json", b'"v"'),
    ]


def test_part_names_with_quotes_and_newlines_are_escaped(server):
    tool, _ = form_tool(MULTIPART, {"type": "object", "properties": {'a"b\r\nc': {"type": "string"}}})
    echo = server.call(tool, {'a"b\r\nc': "v"})
    assert [(p[0], p[3]) for p in parts(echo)] == [("a%22b%0D%0Ac", b"v")]


def test_bad_base64_and_lone_surrogates_are_refused_naming_the_field():
    tool, _ = form_tool(MULTIPART, {"type": "object", "properties": {"file": {"type": "string", "format": "binary"},
                                                                     "t": {"type": "string"}}})
    with pytest.raises(tc.ToolCallError) as e:
        tc.check_arguments(tool, {"file": "not base64!"})  # the schema's pattern catches it first
    assert e.value.errors[0].pointer == "/file"
    with pytest.raises(tc.ToolCallError) as e:
        tc.build_request(tool, {"file": "abc"})  # matches the pattern, wrong padding
    assert (e.value.status, e.value.errors[0].pointer) == (400, "/file") and "base64" in e.value.errors[0].message
    with pytest.raises(tc.ToolCallError) as e:
        tc.build_request(tool, {"t": "\ud800"})
    assert e.value.errors[0].pointer == "/t" and "Unicode" in e.value.errors[0].message
    utool, _ = form_tool(URLENCODED, {"type": "object", "properties": {"t": {"type": "array"}}})
    with pytest.raises(tc.ToolCallError) as e:
        tc.build_request(utool, {"t": ["ok", "\udfff"]})
    assert e.value.errors[0].pointer == "/t/1"


def test_a_form_tool_pickles_with_its_encoding():
    import pickle

    tool, _ = form_tool(MULTIPART, {"type": "object", "properties": {"f": {"type": "string", "format": "binary"}}},
                        {"f": {"contentType": "image/png"}})
    copy = pickle.loads(pickle.dumps(tool))
    assert copy.body == tool.body and copy.body.form.part("f").content_type == "image/png"
    assert copy.body.form.part("other") == tool.body.form.part("other") and not copy.body.form.part("other").binary


def test_a_boundary_never_occurs_in_the_content():
    form = FormEncoding(MULTIPART)
    ctype, body = encode_multipart({"a": "x--B--y"}, form, boundary="B2")
    assert ctype == "multipart/form-data; boundary=B2" and body.endswith(b"--B2--\r\n")
    with pytest.raises(FormEncodingError, match="occurs in the content"):
        encode_multipart({"a": "x--B--y"}, form, boundary="B")
    with pytest.raises(FormEncodingError, match="must be an object"):
        encode_form(["a"], form)


# --------------------------------------------------------------------------
# Choosing among content types; schemas
# --------------------------------------------------------------------------


@pytest.mark.parametrize("media,chosen", [
    (("multipart/form-data", "application/json"), "application/json"),
    (("multipart/form-data", "application/x-www-form-urlencoded"), "application/x-www-form-urlencoded"),
    (("application/octet-stream", "multipart/form-data"), "multipart/form-data"),
    (("application/x-www-form-urlencoded; charset=utf-8",), "application/x-www-form-urlencoded"),
])
def test_json_is_preferred_then_urlencoded_then_multipart(media, chosen):
    content = {m: {"schema": {"type": "object", "properties": {"a": {"type": "string"}}}} for m in media}
    ts = build_tools(spec_of({"/f": {"post": {"requestBody": {"content": content},
                                              "responses": {"200": {"description": "ok"}}}}}))
    assert ts.tools[0].body.content_type == chosen
    assert (ts.tools[0].body.form is None) == (chosen == "application/json")
    if len(media) > 1 and chosen != "application/json":
        assert any(f"sent as {chosen}" in w.message for w in ts.warnings)


def test_form_tool_schemas_are_valid_json_schema():
    tool, _ = form_tool(MULTIPART, {"type": "object", "properties": {
        "f": {"type": "string", "format": "binary"},
        "fs": {"type": "array", "items": {"type": "string", "format": "binary"}}}})
    Draft202012Validator.check_schema(tool.parameters)
    Draft7Validator.check_schema(tool.parameters)
    ts = build_tools(spec_of({"/f": {"post": {"requestBody": {"content": {MULTIPART: {"schema": {
        "type": "object", "properties": {"g": {"type": "string", "contentMediaType": "image/png"}}}}}},
        "responses": {"200": {"description": "ok"}}}}}, "3.1.0"))
    g = ts.tools[0].parameters["properties"]["g"]
    assert g["contentEncoding"] == "base64" and g["contentMediaType"] == "image/png"
    Draft202012Validator.check_schema(ts.tools[0].parameters)


def test_the_tool_call_stage_sends_the_form_as_the_server_parses_it(server, tmp_path):
    from extproc.config.loader import load_file
    from extproc.stages.tool_call import ToolCall
    from extproc.types import HttpMessage, Mutate, Phase, RequestState

    shutil.copy(FIXTURES / "v3.0" / "uspto.yaml", tmp_path / "uspto.yaml")
    (tmp_path / "gateway.yaml").write_text(f"""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: tools}}
spec:
  backends: [{{name: uspto, kind: rest, endpoints: ["127.0.0.1:{server.port}"]}}]
  routes: [{{path: /tools/uspto, kind: tool, target: uspto, openapi: uspto.yaml}}]
""")
    snap = load_file(tmp_path / "gateway.yaml")
    route = snap.routes["tools-uspto"]
    call = {"type": "tool_use", "id": "t1", "name": "perform-search",
            "input": {"dataset": "oa_citations", "version": "v1", "criteria": "a:b c", "rows": 5}}
    state = RequestState(snapshot=snap, route=route, started=0.0)
    out = ToolCall().on_request_body(state, HttpMessage(Phase.REQUEST_BODY, body=orjson.dumps(call),
                                                        end_of_stream=True))
    assert isinstance(out, Mutate)
    hdrs = dict(out.set_headers)
    assert hdrs["content-type"] == URLENCODED and hdrs["content-length"] == str(len(out.body))
    assert orjson.loads(state.backend_request)["body"] == "criteria=a%3Ab+c&rows=5"
    echo = server.send(hdrs[":method"], hdrs[":path"], [(k, v) for k, v in out.set_headers
                                                        if k != "content-length"], out.body)
    assert echo["fields"] == [["criteria", "a:b c"], ["rows", "5"]]


# --------------------------------------------------------------------------
# Round trip: arguments -> encoded body -> parsed by the server -> arguments
# --------------------------------------------------------------------------

_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_SCALARS = {
    "string": _TEXT,
    "integer": st.integers(-(2**53), 2**53),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=64),
    "boolean": st.booleans(),
}


def _from_text(kind: str, text: str):
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    if kind == "boolean":
        return {"true": True, "false": False}[text]
    return text


@st.composite
def _form_case(draw, multipart: bool):
    """``(schema, args)``: an object of scalars, arrays of scalars and (multipart) binary fields."""
    kinds = ["string", "integer", "number", "boolean", "array"] + (["binary", "object"] if multipart else [])
    names = draw(st.lists(_NAMES, min_size=1, max_size=6, unique=True))
    props, args = {}, {}
    for name in names:
        kind = draw(st.sampled_from(kinds))
        if kind == "array":
            item = draw(st.sampled_from(sorted(_SCALARS)))
            props[name] = {"type": "array", "items": {"type": item}}
            args[name] = draw(st.lists(_SCALARS[item], min_size=1, max_size=4))
        elif kind == "binary":
            props[name] = {"type": "string", "format": "binary"}
            args[name] = base64.b64encode(draw(st.binary(max_size=64))).decode()
        elif kind == "object":
            props[name] = {"type": "object"}
            args[name] = draw(st.dictionaries(_NAMES, _SCALARS["string"] | _SCALARS["integer"], max_size=3))
        else:
            props[name] = {"type": kind}
            args[name] = draw(_SCALARS[kind])
    return {"type": "object", "properties": props}, args


def _decode(schema: dict, echo: dict, multipart: bool) -> dict:
    """What the server parsed, read back into arguments with the schema's types."""
    if multipart:
        fields = [(p["name"], base64.b64decode(p["data"]), p["content_type"], p["filename"]) for p in echo["parts"]]
    else:
        fields = [(k, v, None, None) for k, v in echo["fields"]]
    out: dict = {}
    for name, value, ctype, filename in fields:
        prop = schema["properties"][name]
        if prop.get("format") == "binary":
            assert filename == name and ctype == "application/octet-stream"
            out[name] = base64.b64encode(value).decode()
            continue
        text = value.decode("utf-8") if isinstance(value, bytes) else value
        if prop["type"] == "object":
            assert ctype == "application/json"
            out[name] = orjson.loads(text)
        elif prop["type"] == "array":
            out.setdefault(name, []).append(_from_text(prop["items"]["type"], text))
        else:
            assert ctype in (None, "text/plain; charset=utf-8")
            out[name] = _from_text(prop["type"], text)
    return out


@pytest.mark.parametrize("media", [URLENCODED, MULTIPART])
def test_round_trip_through_a_real_server(server, media):
    multipart = media == MULTIPART

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_form_case(multipart))
    def check(case):
        schema, args = case
        tool, _ = form_tool(media, schema)
        assert _decode(schema, server.call(tool, args), multipart) == args

    check()
