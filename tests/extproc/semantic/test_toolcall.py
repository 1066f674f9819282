"""extproc.semantic.toolcall: parse a call, validate arguments, build the request, map the result."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.semantic.openapi import load_spec, parse_spec
from extproc.semantic.toolcall import (
    HttpRequest,
    ToolCallError,
    anthropic_tool_result,
    build_request,
    check_arguments,
    mcp_call_result,
    openai_tool_message,
    parse_tool_call,
    resolve_tool,
    tool_result,
    validate_arguments,
)
from extproc.semantic.tools import build_tools

DATA = Path(__file__).resolve().parents[2] / "data" / "openapi"
OK = {"200": {"description": "ok"}}


def tool(path: str, method: str, op: dict, item_params: list | None = None, **doc):
    item = {method: {"responses": OK, **op}}
    if item_params:
        item["parameters"] = item_params
    ts = build_tools(parse_spec({"openapi": "3.0.3", "info": {"title": "t", "version": "1"},
                                 "paths": {path: item}, **doc}))
    assert not ts.skipped, ts.skipped
    return ts.tools[0]


def q(name: str, schema: dict, **kw) -> dict:
    return {"name": name, "in": "query", "schema": schema, **kw}


@pytest.fixture(scope="module")
def petstore():
    return build_tools(load_spec(DATA / "petstore-expanded.yaml"))


# -- parsing calls -------------------------------------------------------------


def test_parse_openai_anthropic_mcp_calls():
    c = parse_tool_call({"id": "call_1", "type": "function", "function": {"name": "addPet",
                                                                          "arguments": '{"name": "Rex"}'}})
    assert (c.name, c.arguments, c.call_id, c.protocol) == ("addPet", {"name": "Rex"}, "call_1", "openai")
    c = parse_tool_call({"type": "tool_use", "id": "toolu_1", "name": "addPet", "input": {"name": "Rex"}})
    assert (c.name, c.arguments, c.call_id, c.protocol) == ("addPet", {"name": "Rex"}, "toolu_1", "anthropic")
    c = parse_tool_call(b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "addPet"}}')
    assert (c.name, c.arguments, c.call_id, c.protocol) == ("addPet", {}, "7", "mcp")
    assert parse_tool_call({"name": "x", "arguments": {"a": 1}}).arguments == {"a": 1}
    assert parse_tool_call({"type": "function", "function": {"name": "x", "arguments": ""}}).arguments == {}


@pytest.mark.parametrize("doc,text", [
    ("not json", "not valid JSON"),
    ([1], "must be a JSON object"),
    ({"function": {"name": "x", "arguments": "{bad"}}, "/function/arguments is not valid JSON"),
    ({"function": {"name": "x", "arguments": "[1]"}}, "/function/arguments must be a JSON object"),
    ({"function": {"arguments": "{}"}}, "/function/name must be a string"),
    ({"type": "tool_use", "input": {}}, "/name must be a string"),
    ({"jsonrpc": "2.0", "method": "tools/list"}, "tools/call"),
    ({"hello": 1}, "not a tool call"),
])
def test_malformed_calls(doc, text):
    with pytest.raises(ToolCallError) as exc:
        parse_tool_call(doc)
    assert exc.value.code == "malformed_tool_call" and exc.value.status == 400 and text in str(exc.value)


def test_resolve_tool(petstore):
    assert resolve_tool(petstore, "addPet").method == "POST"
    with pytest.raises(ToolCallError) as exc:
        resolve_tool(petstore, "nope")
    assert exc.value.status == 404 and exc.value.to_error()["code"] == "unknown_tool"


# -- validation -----------------------------------------------------------------


def test_a_schema_that_is_not_json_schema_refuses_the_call_instead_of_raising():
    """Found by tests/fuzz/test_fuzz_openapi.py: `format: [..]` in the document made jsonschema raise
    TypeError (unhashable) on every call (500 stage_error on a tool route)."""
    for bad in ({"format": ["email"]}, {"format": {"a": 1}}):
        t = tool("/o", "post", {"requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"a": {"type": "string", **bad}}}}}}})
        with pytest.raises(ToolCallError) as e:
            validate_arguments(t, {"a": "x"})
        assert (e.value.status, e.value.code) == (502, "invalid_tool_schema"), bad
        assert "parameter schema in the OpenAPI document is not valid JSON Schema" in e.value.message


def test_validation_errors_name_the_field():
    t = tool("/o", "post", {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["customer", "items"], "additionalProperties": False, "properties": {
            "customer": {"type": "object", "required": ["email"], "properties": {
                "email": {"type": "string", "format": "email"}}},
            "items": {"type": "array", "items": {"type": "object", "required": ["qty"], "properties": {
                "qty": {"type": "integer", "format": "int32", "minimum": 1},
                "sku": {"type": "string", "enum": ["A", "B"]}}}},
            "when": {"type": "string", "format": "date-time"}}}}}}})
    errors = validate_arguments(t, {"customer": {"email": "nope"},
                                    "items": [{"qty": 0, "sku": "C"}, {"qty": 2**31}, {}],
                                    "when": "yesterday", "extra": 1})
    got = {(e.pointer, e.path): e.message for e in errors}
    assert got == {
        ("/customer/email", "customer.email"): 'must be a valid email, not "nope"',
        ("/extra", "extra"): "is not a known field",
        ("/items/0/qty", "items[0].qty"): "0 is less than the minimum of 1",
        ("/items/0/sku", "items[0].sku"): 'must be one of ["A","B"], not "C"',
        ("/items/1/qty", "items[1].qty"): "must be a valid int32, not 2147483648",
        ("/items/2/qty", "items[2].qty"): "is required",
        ("/when", "when"): 'must be a valid date-time, not "yesterday"',
    }
    assert [e.pointer for e in errors] == sorted(e.pointer for e in errors)
    assert validate_arguments(t, {"customer": {"email": "a@b.c"}, "items": [{"qty": 1}],
                                  "when": "2024-05-01T12:00:00Z"}) == []


def test_validation_of_json_text_and_non_objects(petstore):
    add = petstore.by_name["addPet"]
    assert validate_arguments(add, '{"name": "Rex"}') == []
    assert validate_arguments(add, "{oops")[0].message.startswith("arguments is not valid JSON")
    assert validate_arguments(add, "[]")[0].message == "arguments must be a JSON object, not an array"
    assert validate_arguments(add, {"name": 5})[0].message == "must be string, not a number"


def test_check_arguments_raises_a_400_document(petstore):
    with pytest.raises(ToolCallError) as exc:
        check_arguments(petstore.by_name["find_pet_by_id"], {"id": "x"})
    err = exc.value.to_error()
    assert err["status"] == 400 and err["code"] == "invalid_tool_arguments" and err["tool"] == "find_pet_by_id"
    assert err["errors"] == [{"pointer": "/id", "path": "id", "message": "must be integer, not a string"}]
    assert "id: must be integer" in err["message"]


def test_the_validator_is_built_once_per_tool(petstore):
    t = petstore.by_name["addPet"]
    validate_arguments(t, {"name": "a"})
    v = t._memo["validator"]
    validate_arguments(t, {"name": "b"})
    assert t._memo["validator"] is v


# -- building requests ----------------------------------------------------------


def test_petstore_requests(petstore):
    r = build_request(petstore.by_name["find_pet_by_id"], {"id": 12})
    assert r == HttpRequest("GET", "/v2/pets/12", (("accept", "application/json"),), None)
    r = build_request(petstore.by_name["addPet"], {"name": "Rex", "tag": "dog"}, "http://pets.internal:8080/api/")
    assert r.method == "POST" and r.target == "/api/pets"
    assert orjson.loads(r.body) == {"name": "Rex", "tag": "dog"}
    assert ("content-type", "application/json") in r.headers
    method, target, headers, body = build_request(petstore.by_name["findPets"], {"tags": ["a b", "c/d"],
                                                                                  "limit": 5}, "")
    assert target == "/pets?tags=a%20b&tags=c%2Fd&limit=5" and body is None


@pytest.mark.parametrize("value,encoded", [
    ("a/b", "a%2Fb"), ("..", ".."), ("../etc", "..%2Fetc"), ("a b?c#d", "a%20b%3Fc%23d"), ("宠物", "%E5%AE%A0%E7%89%A9"),
    (7, "7"), (True, "true"), (1.5, "1.5"),
])
def test_path_values_are_encoded_as_one_segment(value, encoded):
    t = tool("/files/{name}/meta", "get", {"parameters": [
        {"name": "name", "in": "path", "required": True, "schema": {}}]})
    assert build_request(t, {"name": value}).target == f"/files/{encoded}/meta"


@pytest.mark.parametrize("style,explode,value,expected", [
    ("simple", False, [1, 2], "/p/1,2"),
    ("simple", False, {"a": 1, "b": "x y"}, "/p/a,1,b,x%20y"),
    ("simple", True, {"a": 1, "b": 2}, "/p/a=1,b=2"),
    ("label", False, [1, 2], "/p/.1,2"),
    ("label", True, [1, 2], "/p/.1.2"),
    ("matrix", False, [1, 2], "/p/;v=1,2"),
    ("matrix", True, [1, 2], "/p/;v=1;v=2"),
    ("matrix", False, 5, "/p/;v=5"),
])
def test_path_styles(style, explode, value, expected):
    t = tool("/p/{v}", "get", {"parameters": [{"name": "v", "in": "path", "required": True, "style": style,
                                                "explode": explode, "schema": {}}]})
    assert build_request(t, {"v": value}).target == expected


@pytest.mark.parametrize("param,value,expected", [
    (q("t", {}), ["a", "b"], "t=a&t=b"),
    (q("t", {}, explode=False), ["a", "b,c"], "t=a,b%2Cc"),
    (q("t", {}, style="spaceDelimited", explode=False), ["a", "b"], "t=a%20b"),
    (q("t", {}, style="pipeDelimited", explode=False), ["a", "b"], "t=a|b"),
    (q("f", {}, style="deepObject", explode=True), {"min": 1, "max": 9}, "f%5Bmin%5D=1&f%5Bmax%5D=9"),
    (q("f", {}), {"min": 1, "max": 9}, "min=1&max=9"),
    (q("f", {}, explode=False), {"min": 1, "max": 9}, "f=min,1,max,9"),
    (q("s", {}), "a&b=c#d", "s=a%26b%3Dc%23d"),
    (q("s", {}, allowReserved=True), "http://x/y?z=1&w", "s=http://x/y?z%3D1%26w"),
    (q("b", {}), False, "b=false"),
    (q("n", {}), None, "n="),
    ({"name": "j", "in": "query", "content": {"application/json": {"schema": {}}}}, {"a": [1]},
     "j=%7B%22a%22%3A%5B1%5D%7D"),
])
def test_query_styles(param, value, expected):
    t = tool("/p", "get", {"parameters": [param]})
    assert build_request(t, {param["name"]: value}).target == "/p?" + expected


def test_headers_and_cookies():
    t = tool("/p", "get", {"parameters": [
        {"name": "X-Ids", "in": "header", "schema": {}}, {"name": "X-Obj", "in": "header", "explode": True,
                                                          "schema": {}},
        {"name": "sid", "in": "cookie", "schema": {}}, {"name": "lang", "in": "cookie", "schema": {}}]})
    r = build_request(t, {"X-Ids": [1, 2], "X-Obj": {"a": 1}, "sid": "a b;c", "lang": "zh"})
    assert r.headers == (("x-ids", "1,2"), ("x-obj", "a=1"), ("cookie", "sid=a%20b%3Bc; lang=zh"),
                         ("accept", "application/json"))


@pytest.mark.parametrize("value", ["a\r\nInjected: 1", "a\nb", "a\x00"])
def test_header_injection_is_refused(value):
    t = tool("/p", "get", {"parameters": [{"name": "X-Note", "in": "header", "schema": {"type": "string"}}]})
    with pytest.raises(ToolCallError) as exc:
        build_request(t, {"X-Note": value})
    assert exc.value.errors[0].pointer == "/X-Note" and "CR, LF or NUL" in exc.value.errors[0].message


def test_missing_path_parameter_and_bad_unicode():
    t = tool("/p/{id}", "get", {"parameters": [{"name": "id", "in": "path", "required": True, "schema": {}}]})
    with pytest.raises(ToolCallError) as exc:
        build_request(t, {})
    assert exc.value.errors[0].path == "id"
    with pytest.raises(ToolCallError, match="lone surrogate"):
        build_request(t, {"id": "\ud800"})
    with pytest.raises(ToolCallError, match="must be a JSON object"):
        build_request(t, ["id"])


def test_merged_body_takes_unknown_arguments_when_allowed():
    t = tool("/p/{id}", "put", {"parameters": [{"name": "id", "in": "path", "required": True, "schema": {}},
                                               q("dry", {"type": "boolean"})],
                                "requestBody": {"content": {"application/json": {"schema": {
                                    "type": "object", "properties": {"a": {}}}}}}})
    r = build_request(t, {"id": 1, "dry": True, "a": 1, "z": 2})
    assert r.target == "/p/1?dry=true" and orjson.loads(r.body) == {"a": 1, "z": 2}
    r = build_request(t, {"id": 1})
    assert r.body is None and ("content-type", "application/json") not in r.headers


def test_required_empty_merged_body_is_sent_as_an_empty_object():
    t = tool("/p", "post", {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "properties": {"a": {}}}}}}})
    assert build_request(t, {}).body == b"{}"


def test_wrapped_body():
    t = tool("/p", "post", {"requestBody": {"required": True, "content": {"application/vnd.api+json": {
        "schema": {"type": "array", "items": {"type": "integer"}}}}}})
    r = build_request(t, {"body": [1, 2]})
    assert r.body == b"[1,2]" and ("content-type", "application/vnd.api+json") in r.headers


def test_base_url_forms(petstore):
    t = petstore.by_name["find_pet_by_id"]
    assert build_request(t, {"id": 1}, "http://h:1").target == "/pets/1"
    assert build_request(t, {"id": 1}, "https://h/base/path/").target == "/base/path/pets/1"
    assert build_request(t, {"id": 1}, "/mounted").target == "/mounted/pets/1"
    assert build_request(t, {"id": 1}).target == "/v2/pets/1"


def test_what_the_document_wrote_is_percent_encoded_in_the_target(petstore):
    """Found by tests/fuzz/test_fuzz_openapi.py: a server variable whose default is not a string
    (its repr went into the URL), or a path key with a space, gave a request target with spaces."""
    t = petstore.by_name["find_pet_by_id"]
    assert build_request(t, {"id": 1}, "{'$ref': '#'}://h/my api").target == \
        "/%7B'$ref':%20'%23'%7D://h/my%20api/pets/1"
    assert build_request(t, {"id": "a b"}, "/é").target == "/%C3%A9/pets/a%20b"


# -- results -------------------------------------------------------------------------


def test_tool_result_json_text_binary_and_errors():
    r = tool_result(200, [("Content-Type", "application/json"), ("Location", "/pets/1"), ("X-Other", "no")],
                    b'{"id": 1}')
    assert r == {"status": 200, "ok": True, "content_type": "application/json", "headers": {"location": "/pets/1"},
                 "body": {"id": 1}}
    assert tool_result(204, {}, b"") == {"status": 204, "ok": True, "body": None}
    r = tool_result(404, {"content-type": "application/problem+json"}, b'{"title": "no pet"}')
    assert r["ok"] is False and r["body"] == {"title": "no pet"}
    r = tool_result(200, {"content-type": "text/plain; charset=utf-8"}, "héllo".encode())
    assert r["body"] == "héllo"
    r = tool_result(200, {"content-type": "application/json"}, b"{broken")
    assert r["body"] == "{broken" and "parse_error" in r
    r = tool_result(200, {"content-type": "image/png"}, b"\x89PNG....")
    assert r["body"] == "<8 bytes of image/png, not shown>"
    r = tool_result(200, {"content-type": "application/json"}, b'"' + "é".encode() * 10 + b'"', max_bytes=6)
    assert r["truncated"] is True and r["size"] == 22 and r["body"] == '"éé'
    assert tool_result(200, None, b"\xff\xfe")["body"] == "\ufffd\ufffd"
    assert tool_result(200, {}, b'[1]')["body"] == [1]


def test_result_wrappers():
    ok = tool_result(200, {"content-type": "application/json"}, b'{"a": 1}')
    bad = tool_result(500, {}, b"boom")
    assert openai_tool_message(ok, "call_1") == {"role": "tool", "tool_call_id": "call_1",
                                                 "content": orjson.dumps(ok).decode()}
    assert anthropic_tool_result(ok, "toolu_1") == {"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": orjson.dumps(ok).decode()}
    assert anthropic_tool_result(bad, "t")["is_error"] is True
    m = mcp_call_result(ok)
    assert m["isError"] is False and m["structuredContent"] == {"a": 1} and m["content"][0]["type"] == "text"
    assert mcp_call_result(bad)["isError"] is True and "structuredContent" not in mcp_call_result(bad)
