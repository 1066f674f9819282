"""extproc.semantic.schemas: OpenAPI schema objects to self-contained JSON Schema."""

from __future__ import annotations

import orjson
import pytest
from jsonschema import Draft202012Validator

from extproc.semantic.openapi import Resolver, parse_spec
from extproc.semantic.schemas import SchemaTooLarge, UnsupportedSchema, to_json_schema


def spec_of(schemas: dict, version: str = "3.0.3"):
    key = "swagger" if version == "2.0" else "openapi"
    doc = {key: version, "info": {"title": "t", "version": "1"}, "paths": {}}
    if version == "2.0":
        doc["definitions"] = schemas
    else:
        doc["components"] = {"schemas": schemas}
    return parse_spec(doc)


def convert(schemas: dict, root: str, version: str = "3.0.3", **kw) -> dict:
    spec = spec_of(schemas, version)
    prefix = "#/definitions/" if version == "2.0" else "#/components/schemas/"
    return to_json_schema(Resolver(spec), {"$ref": prefix + root}, version=spec.version, **kw)


def test_refs_are_inlined():
    out = convert({"A": {"type": "object", "properties": {"b": {"$ref": "#/components/schemas/B"}}},
                   "B": {"type": "string", "enum": ["x", "y"], "default": "x", "format": "slug"}}, "A")
    assert out == {"type": "object", "properties": {"b": {"type": "string", "enum": ["x", "y"], "default": "x",
                                                          "format": "slug"}}}
    assert "$ref" not in orjson.dumps(out).decode()


def test_self_recursion_is_cut_with_a_typed_stub():
    out = convert({"Node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/components/schemas/Node"}}}}},
        "Node")
    stub = out["properties"]["children"]["items"]
    assert stub["type"] == "object" and "Recursive reference to Node" in stub["description"]
    Draft202012Validator.check_schema(out)
    Draft202012Validator(out).validate({"v": 1, "children": [{"anything": True}]})


def test_mutual_recursion_is_cut():
    out = convert({"A": {"type": "object", "properties": {"b": {"$ref": "#/components/schemas/B"}}},
                   "B": {"type": "object", "properties": {"a": {"$ref": "#/components/schemas/A"}}}}, "A")
    assert out["properties"]["b"]["properties"]["a"]["description"].startswith("Recursive reference to A")


def test_shared_non_recursive_targets_are_memoised():
    out = convert({"A": {"type": "object", "properties": {"x": {"$ref": "#/components/schemas/S"},
                                                          "y": {"$ref": "#/components/schemas/S"}}},
                   "S": {"type": "string"}}, "A")
    assert out["properties"]["x"] is out["properties"]["y"]


def test_node_budget():
    schemas = {f"L{i}": {"type": "object", "properties": {
        "a": {"$ref": f"#/components/schemas/L{i + 1}"}, "b": {"$ref": f"#/components/schemas/L{i + 1}"}}}
        for i in range(20)}
    schemas["L20"] = {"type": "string"}
    with pytest.raises(SchemaTooLarge):
        convert(schemas, "L0", max_nodes=5000)  # 2^20 leaves once expanded


def test_deep_nesting_is_cut():
    inner = {"type": "string"}
    for _ in range(80):
        inner = {"type": "object", "properties": {"n": inner}}
    out = convert({"Deep": inner}, "Deep")
    node, depth = out, 0
    while "properties" in node:
        node, depth = node["properties"]["n"], depth + 1
    assert depth <= 50 and "Nesting deeper than 48" in node["description"]


def test_openapi_30_keywords_become_json_schema():
    out = convert({"A": {"type": "object", "properties": {
        "n": {"type": "string", "nullable": True, "enum": ["a", "b"]},
        "m": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 9, "exclusiveMaximum": False},
        "e": {"type": "string", "example": "hello", "xml": {"name": "x"}, "x-internal": 1},
        "c": {"allOf": [{"$ref": "#/components/schemas/B"}], "nullable": True},
    }, "discriminator": {"propertyName": "n"}}, "B": {"type": "string"}}, "A")
    p = out["properties"]
    assert p["n"] == {"type": ["string", "null"], "enum": ["a", "b", None]}
    assert p["m"] == {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}
    assert p["e"] == {"type": "string", "examples": ["hello"]}
    assert p["c"] == {"anyOf": [{"allOf": [{"type": "string"}]}, {"type": "null"}]}
    assert "discriminator" not in out
    Draft202012Validator.check_schema(out)


def test_read_only_dropped_from_requests_write_only_from_responses():
    schemas = {"A": {"type": "object", "required": ["id", "name", "pw"], "properties": {
        "id": {"type": "integer", "readOnly": True}, "name": {"type": "string"},
        "pw": {"type": "string", "writeOnly": True}}}}
    req = convert(schemas, "A", direction="request")
    assert set(req["properties"]) == {"name", "pw"} and req["required"] == ["name", "pw"]
    resp = convert(schemas, "A", direction="response")
    assert set(resp["properties"]) == {"id", "name"} and resp["required"] == ["id", "name"]
    assert set(convert(schemas, "A")["properties"]) == {"id", "name", "pw"}


def test_all_of_of_objects_is_merged():
    out = convert({"Pet": {"allOf": [{"$ref": "#/components/schemas/NewPet"},
                                      {"type": "object", "required": ["id"], "properties": {"id": {"type": "integer"}}}]},
                   "NewPet": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
                  "Pet")
    assert out == {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
                   "required": ["name", "id"]}


def test_all_of_with_conflicts_is_kept():
    out = convert({"A": {"allOf": [{"type": "object", "properties": {"x": {"type": "string"}}},
                                   {"type": "object", "properties": {"x": {"type": "integer"}}}]}}, "A")
    assert "allOf" in out


def test_31_ref_siblings_apply():
    spec = parse_spec({"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "components": {"schemas": {
        "S": {"type": "string", "description": "target"}}}})
    r = Resolver(spec)
    out = to_json_schema(r, {"$ref": "#/components/schemas/S", "description": "sibling"}, version="3.1")
    assert out == {"type": "string", "description": "sibling"}
    out = to_json_schema(r, {"$ref": "#/components/schemas/S", "maxLength": 3}, version="3.1")
    assert out == {"allOf": [{"type": "string", "description": "target"}, {"maxLength": 3}]}
    assert to_json_schema(r, True, version="3.1") == {} and to_json_schema(r, False, version="3.1") == {"not": {}}


def test_30_ref_siblings_are_ignored():
    out = convert({"A": {"type": "object", "properties": {"s": {"$ref": "#/components/schemas/S", "maxLength": 3}}},
                   "S": {"type": "string"}}, "A")
    assert out["properties"]["s"] == {"type": "string"}


def test_unsupported_constructs_name_where():
    with pytest.raises(UnsupportedSchema) as exc:
        convert({"F": {"type": "file"}}, "F", version="2.0")
    assert exc.value.pointer.endswith("/type")
    with pytest.raises(UnsupportedSchema, match="does not resolve"):
        to_json_schema(Resolver(spec_of({})), {"$ref": "#/components/schemas/Missing"}, version="3.0")
    with pytest.raises(ValueError, match="direction"):
        to_json_schema(Resolver(spec_of({})), {}, version="3.0", direction="sideways")


def test_patterns_python_cannot_compile_are_dropped():
    out = convert({"A": {"type": "object", "properties": {"ok": {"type": "string", "pattern": "^[a-z]+$"},
                                                          "ecma": {"type": "string", "pattern": "^\\p{L}+$"}}}}, "A")
    assert out["properties"]["ok"]["pattern"] == "^[a-z]+$" and "pattern" not in out["properties"]["ecma"]
