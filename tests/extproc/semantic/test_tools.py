"""extproc.semantic.tools: one tool per operation, names, merged parameters, formats, skips."""

from __future__ import annotations

import pickle
from pathlib import Path

import orjson
import pytest
from jsonschema import Draft202012Validator

from extproc.semantic.openapi import load_spec, parse_spec
from extproc.semantic.tools import (
    NAME_RE,
    anthropic_tools,
    build_tools,
    derive_name,
    format_tools,
    mcp_tool_list,
    openai_tools,
    sanitize_name,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "openapi"
PUBLIC = sorted(p for p in DATA.glob("*.yaml") if p.name != "field-pairs.yaml")
OK = {"200": {"description": "ok"}}


def spec(paths: dict, version: str = "3.0.3", **extra):
    return parse_spec({"openapi": version, "info": {"title": "t", "version": "1"}, "paths": paths, **extra})


def tools_of(paths: dict, **kw):
    return build_tools(spec(paths, **kw.pop("extra", {})), **kw)


@pytest.fixture(scope="module")
def docker():
    return build_tools(load_spec(DATA / "docker-engine-swagger2.yaml"))


@pytest.mark.parametrize("path", PUBLIC, ids=lambda p: p.name)
def test_public_specs_give_valid_unique_names_and_schemas(path):
    ts = build_tools(load_spec(path))
    names = [t.name for t in ts.tools]
    assert len(names) == len(set(names))
    for t in ts.tools:
        assert NAME_RE.match(t.name), t.name
        assert t.parameters["type"] == "object"
        Draft202012Validator.check_schema(t.parameters)
        assert "$ref" not in orjson.dumps(t.parameters).decode()
    assert build_tools(load_spec(path)).tools == ts.tools  # stable


def test_petstore_expanded():
    ts = build_tools(load_spec(DATA / "petstore-expanded.yaml"))
    assert [t.name for t in ts.tools] == ["findPets", "addPet", "find_pet_by_id", "deletePet"]
    add = ts.by_name["addPet"]
    assert add.parameters == {"type": "object", "properties": {"name": {"type": "string"}, "tag": {"type": "string"}},
                              "required": ["name"]}
    assert add.body.arg is None and add.body.fields == ("name", "tag") and add.body.extra
    find = ts.by_name["findPets"]
    assert find.parameters["properties"]["tags"] == {"type": "array", "items": {"type": "string"},
                                                     "description": "tags to filter by"}
    assert find.parameters["additionalProperties"] is False
    assert find.description.endswith("…") and len(find.description) <= 1024
    assert ts.by_name["find_pet_by_id"].operation_id == "find pet by id"
    assert find.server_url == "https://petstore.swagger.io/v2"


def test_petstore_create_body_required_merges_required():
    ts = build_tools(load_spec(DATA / "petstore.yaml"))
    create = ts.by_name["createPets"]
    assert set(create.parameters["properties"]) == {"id", "name", "tag"}
    assert create.parameters["required"] == ["id", "name"]
    assert ts.by_name["listPets"].parameters["properties"]["limit"]["maximum"] == 100


def test_swagger2_petstore():
    ts = build_tools(load_spec(DATA / "petstore-swagger2.yaml"))
    assert [t.name for t in ts.tools] == ["listPets", "createPets", "showPetById"]
    assert ts.by_name["listPets"].server_url == "http://petstore.swagger.io/v1"
    assert ts.by_name["showPetById"].parameters["required"] == ["petId"]


def test_docker_engine_swagger2(docker):
    assert len(docker.tools) == 102 and len(docker.skipped) == 5
    assert all("only JSON request bodies" in s.reason for s in docker.skipped)
    create = docker.by_name["ContainerCreate"]
    assert create.body is not None and create.method == "POST"
    assert create.server_url == "/v1.53"


def test_server_variables_take_their_defaults():
    ts = build_tools(load_spec(DATA / "uspto.yaml"))
    assert ts.by_name["list-data-sets"].server_url == "https://developer.uspto.gov/ds-api"
    assert ts.skipped == ()  # the form-urlencoded search is a tool (issue 16 item 7)
    assert ts.by_name["perform-search"].body.content_type == "application/x-www-form-urlencoded"


def test_an_operation_with_callbacks_is_a_tool_and_its_callbacks_are_reported_unsupported():
    ts = build_tools(load_spec(DATA / "callback-example.yaml"))
    assert [t.name for t in ts.tools] == ["post_streams"] and ts.skipped == ()
    assert ts.tools[0].parameters["required"] == ["callbackUrl"]
    [u] = ts.unsupported
    assert u.pointer == "/paths/~1streams/post/callbacks" and "'onData'" in u.message
    assert "unsupported" in ts.report() and "never invoked" in ts.report()


# -- names -----------------------------------------------------------------------


@pytest.mark.parametrize("method,path,name", [
    ("get", "/users/{id}", "get_users_by_id"),
    ("get", "/", "get_root"),
    ("delete", "/users/{id}/posts/{postId}", "delete_users_by_id_posts_by_postId"),
    ("get", "/files/{name}.{ext}", "get_files_by_name_by_ext"),
    ("post", "/v1/订单/{id}", "post_v1_by_id"),
])
def test_derive_name(method, path, name):
    assert derive_name(method, path) == name


def test_sanitize_name():
    assert sanitize_name("find pet by id") == "find_pet_by_id"
    assert sanitize_name("repos/list-for-org") == "repos_list-for-org"
    assert sanitize_name("查询") == ""


def test_names_from_operation_id_path_and_fallbacks():
    ts = tools_of({"/users/{id}": {"parameters": [{"name": "id", "in": "path", "required": True,
                                                  "schema": {"type": "string"}}],
                                   "get": {"responses": OK}, "put": {"operationId": "查询", "responses": OK}}})
    assert [t.name for t in ts.tools] == ["get_users_by_id", "put_users_by_id"]
    assert any("no usable characters" in w.message for w in ts.warnings)


def test_long_names_are_cut_with_a_stable_hash():
    long_id = "x" * 100
    ts = tools_of({"/a": {"get": {"operationId": long_id, "responses": OK}}})
    name = ts.tools[0].name
    assert len(name) == 64 and name[:55] == "x" * 55 and name[55] == "_"
    assert tools_of({"/a": {"get": {"operationId": long_id, "responses": OK}}}).tools[0].name == name


def test_name_collisions_are_settled_in_document_order():
    paths = {"/a": {"get": {"operationId": "get a", "responses": OK}},
             "/b": {"get": {"operationId": "get_a", "responses": OK}},
             "/c": {"get": {"operationId": "get-a!", "responses": OK}}}
    names = [t.name for t in tools_of(paths).tools]
    assert names[0] == "get_a" and names[1].startswith("get_a_") and len(set(names)) == 3
    assert names == [t.name for t in tools_of(paths).tools]
    assert all(NAME_RE.match(n) for n in names)


def test_description_from_summary_and_description():
    ts = tools_of({"/a": {"get": {"summary": "Short", "description": "Long text.", "responses": OK},
                          "post": {"responses": OK}, "put": {"summary": "S", "description": "S and more", "responses": OK}}})
    assert [t.description for t in ts.tools] == ["Short\n\nLong text.", "S and more", "POST /a"]
    long = tools_of({"/a": {"get": {"description": "word " * 500, "responses": OK}}}, max_description=0)
    assert len(long.tools[0].description) > 2000


# -- parameters --------------------------------------------------------------------


def test_parameters_merge_in_a_fixed_order_with_overrides():
    ts = tools_of({"/p/{id}": {
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                       {"name": "verbose", "in": "query", "schema": {"type": "boolean"}}],
        "get": {"parameters": [
            {"name": "X-Trace", "in": "header", "schema": {"type": "string"}, "description": "trace id"},
            {"name": "verbose", "in": "query", "required": True, "schema": {"type": "boolean", "default": False}},
            {"name": "session", "in": "cookie", "schema": {"type": "string"}},
            {"name": "Authorization", "in": "header", "schema": {"type": "string"}},
            {"name": "sort", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
        ], "responses": OK}}})
    t = ts.tools[0]
    assert list(t.parameters["properties"]) == ["id", "verbose", "sort", "X-Trace", "session"]
    assert t.parameters["required"] == ["id", "verbose"]
    assert t.parameters["properties"]["verbose"] == {"type": "boolean", "default": False}
    assert t.parameters["properties"]["X-Trace"]["description"] == "trace id"
    assert t.parameters["properties"]["sort"]["enum"] == ["asc", "desc"]
    assert [(b.arg, b.location, b.style, b.explode) for b in t.params] == [
        ("id", "path", "simple", False), ("verbose", "query", "form", True), ("sort", "query", "form", True),
        ("X-Trace", "header", "simple", False), ("session", "cookie", "form", True)]
    assert any("Authorization" in w.message for w in ts.warnings)


def test_same_name_in_two_places():
    ts = tools_of({"/p/{id}": {"get": {"parameters": [
        {"name": "id", "in": "query", "schema": {"type": "integer"}},
        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}], "responses": OK}}})
    t = ts.tools[0]
    assert list(t.parameters["properties"]) == ["id", "query_id"]
    assert {b.arg: (b.name, b.location) for b in t.params} == {"id": ("id", "path"), "query_id": ("id", "query")}


def body(schema: dict, required: bool = True, media: str = "application/json") -> dict:
    return {"required": required, "content": {media: {"schema": schema}}}


def test_body_clashing_with_a_parameter_is_wrapped():
    ts = tools_of({"/p/{id}": {"put": {
        "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "requestBody": body({"type": "object", "required": ["id"], "properties": {"id": {"type": "string"},
                                                                               "v": {"type": "integer"}}}),
        "responses": OK}}})
    t = ts.tools[0]
    assert list(t.parameters["properties"]) == ["id", "body"] and t.parameters["required"] == ["id", "body"]
    assert t.body.arg == "body" and t.parameters["additionalProperties"] is False


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}},
    {"type": "string"},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "string"}]},
    {"type": "object", "additionalProperties": {"type": "integer"}},
])
def test_non_object_bodies_are_wrapped(schema):
    t = tools_of({"/p": {"post": {"requestBody": body(schema, False), "responses": OK}}}).tools[0]
    assert t.parameters["properties"]["body"] == schema and "required" not in t.parameters


def test_optional_body_required_list_does_not_leak():
    t = tools_of({"/p": {"post": {"requestBody": body({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string"}}}, required=False), "responses": OK}}}).tools[0]
    assert "required" not in t.parameters and t.body.required is False


def test_body_argument_renamed_when_a_parameter_is_called_body():
    t = tools_of({"/p": {"post": {"parameters": [{"name": "body", "in": "query", "schema": {"type": "string"}}],
                                  "requestBody": body({"type": "array"}), "responses": OK}}}).tools[0]
    assert t.body.arg == "request_body" and list(t.parameters["properties"]) == ["body", "request_body"]


def test_body_additional_properties_is_kept():
    t = tools_of({"/p": {"post": {"requestBody": body({"type": "object", "additionalProperties": False,
                                                       "properties": {"a": {"type": "string"}}}),
                                  "responses": OK}}}).tools[0]
    assert t.parameters["additionalProperties"] is False and t.body.extra is False


def test_json_like_media_types_are_accepted():
    t = tools_of({"/p": {"patch": {"requestBody": body({"type": "object", "properties": {"a": {}}}, True,
                                                       "application/merge-patch+json"), "responses": OK}}}).tools[0]
    assert t.body.content_type == "application/merge-patch+json"


@pytest.mark.parametrize("op,reason", [
    ({"requestBody": body({"type": "object"}, True, "application/octet-stream")}, "only JSON request bodies"),
    ({"requestBody": body({"type": "string"}, True, "multipart/form-data")}, "must be an object schema"),
    ({"parameters": [{"name": "q", "in": "query", "style": "deepObject", "explode": True, "schema": {}},
                     {"name": "x", "in": "header", "style": "form", "schema": {}}]}, "style 'form' in header"),
    ({"parameters": [{"name": "q", "in": "query", "content": {"text/plain": {}}}]}, "only JSON is supported"),
    ({"requestBody": body({"$ref": "https://example.com/s.json"})}, "URLs are not followed"),
    # found by tests/fuzz/test_fuzz_openapi.py: a style that is a list raised TypeError (unhashable)
    ({"parameters": [{"name": "q", "in": "query", "style": ["form"], "schema": {}}]}, "style ['form'] in query"),
])
def test_unsupported_operations_are_skipped_with_a_reason(op, reason):
    ts = tools_of({"/p": {"post": {**op, "responses": OK}, "get": {"responses": OK}}})
    assert [t.name for t in ts.tools] == ["get_p"]
    assert reason in ts.skipped[0].reason and ts.skipped[0].pointer == "/paths/~1p/post"


def test_optional_empty_non_json_body_is_not_sent():
    # Stripe's GET operations carry an optional form body that declares no fields
    empty = {"required": False, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "properties": {}, "additionalProperties": False}}}}
    ts = tools_of({"/p": {"get": {"requestBody": empty, "responses": OK}}})
    assert [t.name for t in ts.tools] == ["get_p"] and ts.tools[0].body is None
    assert "is not sent" in ts.warnings[0].message
    with_fields = {"content": {"application/x-www-form-urlencoded": {"schema": {"properties": {"a": {}}}}}}
    t = tools_of({"/p": {"post": {"requestBody": with_fields, "responses": OK}}}).tools[0]
    assert t.body.fields == ("a",) and t.body.content_type == "application/x-www-form-urlencoded"


def test_swagger2_collection_format_that_is_not_a_string_is_skipped():
    """Found by tests/fuzz/test_fuzz_openapi.py: a mapping as collectionFormat raised TypeError (unhashable)."""
    s = parse_spec({"swagger": "2.0", "info": {"title": "t", "version": "1"}, "paths": {"/p": {
        "get": {"parameters": [{"name": "ids", "in": "query", "type": "array", "items": {"type": "integer"},
                                "collectionFormat": {"a": 1}}], "responses": OK}}}})
    ts = build_tools(s)
    assert ts.tools == () and "collectionFormat {'a': 1} in query" in ts.skipped[0].reason


def test_swagger2_schemes_host_and_base_path_of_the_wrong_type():
    """Found by tests/fuzz/test_fuzz_openapi.py: `schemes` as a mapping raised KeyError 0 in build_tools."""
    for extra, url in (({"host": "h", "schemes": {"a": 1}}, "https://h/v1"), ({"host": "h", "schemes": [7]}, "https://h/v1"),
                       ({"host": ["h"], "schemes": ["http"]}, "/v1"), ({"host": "h", "basePath": 5}, "https://h")):
        doc = {"swagger": "2.0", "info": {"title": "t", "version": "1"}, "basePath": "/v1",
               "paths": {"/p": {"get": {"responses": OK}}}, **extra}
        assert build_tools(parse_spec(doc)).tools[0].server_url == url, extra


def test_server_variables_that_are_not_a_mapping_are_ignored():
    """Found by perf/fuzz.py (openapi target): `variables: "x"` raised AttributeError in build_tools."""
    for variables in ("x", ["a"], None):
        doc = {"openapi": "3.0.3", "info": {"title": "t", "version": "1"},
               "servers": [{"url": "https://h/{v}/api", "variables": variables}], "paths": {"/p": {"get": {"responses": OK}}}}
        assert build_tools(parse_spec(doc)).tools[0].server_url == "https://h/{v}/api"


def test_swagger2_form_data_and_collection_formats():
    s = parse_spec({"swagger": "2.0", "info": {"title": "t", "version": "1"}, "paths": {"/p": {
        "post": {"parameters": [{"name": "f", "in": "formData", "type": "string"}], "responses": OK},
        "get": {"parameters": [{"name": "ids", "in": "query", "type": "array", "items": {"type": "integer"},
                                "collectionFormat": "multi"},
                               {"name": "tags", "in": "query", "type": "array", "items": {"type": "string"},
                                "collectionFormat": "pipes"}], "responses": OK}}}})
    ts = build_tools(s)
    assert [t.name for t in ts.tools] == ["get_p"] and "form data" in ts.skipped[0].reason
    b = {x.arg: (x.style, x.explode) for x in ts.tools[0].params}
    assert b == {"ids": ("form", True), "tags": ("pipeDelimited", False)}
    assert ts.tools[0].parameters["properties"]["ids"] == {"type": "array", "items": {"type": "integer"}}


def test_schema_budget_skips_a_tool():
    schemas = {f"L{i}": {"type": "object", "properties": {"a": {"$ref": f"#/components/schemas/L{i + 1}"},
                                                          "b": {"$ref": f"#/components/schemas/L{i + 1}"}}}
               for i in range(16)}
    schemas["L16"] = {"type": "string"}
    ts = build_tools(spec({"/p": {"post": {"requestBody": body({"$ref": "#/components/schemas/L0"}),
                                           "responses": OK}}}, components={"schemas": schemas}))
    assert not ts.tools and "expands to more than 20000 nodes" in ts.skipped[0].reason


# -- formats ---------------------------------------------------------------------------


def test_output_formats():
    ts = build_tools(load_spec(DATA / "petstore.yaml"))
    o, a, m = openai_tools(ts), anthropic_tools(ts), mcp_tool_list(ts)
    assert o[0] == {"type": "function", "function": {"name": "listPets", "description": "List all pets",
                                                     "parameters": ts.tools[0].parameters}}
    assert a[0] == {"name": "listPets", "description": "List all pets", "input_schema": ts.tools[0].parameters}
    assert m["tools"][0]["inputSchema"] == ts.tools[0].parameters
    assert m["tools"][0]["annotations"] == {"readOnlyHint": True, "idempotentHint": True}
    assert m["tools"][1]["annotations"] == {"readOnlyHint": False, "idempotentHint": False}
    assert format_tools(ts.tools, "anthropic") == a
    with pytest.raises(ValueError, match="unknown tool format"):
        format_tools(ts, "gemini")


def test_tools_pickle_without_their_caches():
    t = build_tools(load_spec(DATA / "petstore.yaml")).tools[0]
    t.cached("x", lambda tool: object())
    t2 = pickle.loads(pickle.dumps(t))
    assert t2 == t and t2._memo == {}


# -- scale -----------------------------------------------------------------------------


def big_spec(n: int) -> dict:
    paths = {}
    for i in range(n // 2):
        paths[f"/things{i}/{{id}}"] = {
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"operationId": f"getThing{i}", "summary": f"Get thing {i}", "parameters": [
                {"name": "q", "in": "query", "schema": {"$ref": "#/components/schemas/Q"}}],
                "responses": {"200": {"description": "ok", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Thing"}}}}}},
            "post": {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Thing"}}}}, "responses": {"201": {"description": "made"}}}}
    return {"openapi": "3.0.3", "info": {"title": "big", "version": "1"}, "paths": paths, "components": {"schemas": {
        "Q": {"type": "string", "enum": ["a", "b"]},
        "Thing": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/components/schemas/Thing"}}}}}}}


def test_five_thousand_operations_all_become_tools():
    # what it costs is measured by perf/bench_openapi.py; here: all of them, each with its own name
    # and its $refs resolved (a cost that grew with the square of the operations would hit the timeout)
    ts = build_tools(load_spec(orjson.dumps(big_spec(5000))))
    assert len(ts.tools) == 5000 and not ts.skipped
    assert len({t.name for t in ts.tools}) == 5000
    last = ts.by_name["post_things2499_by_id"].parameters  # the $ref to Thing, resolved in the last one too
    assert last["required"] == ["id", "name"] and last["properties"]["name"] == {"type": "string"}
