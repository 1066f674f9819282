"""extproc.semantic.openapi: decoding, parsing, checks with JSON pointers, $ref resolution."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from extproc.semantic.openapi import (
    Resolver,
    SpecError,
    decode_bytes,
    iter_operations,
    join_pointer,
    load_spec,
    parse_document,
    parse_spec,
    validate_document,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "openapi"
PUBLIC = sorted(p for p in DATA.glob("*.yaml") if p.name != "field-pairs.yaml")

MINIMAL = {"openapi": "3.0.3", "info": {"title": "t", "version": "1"}, "paths": {}}


def doc_with(**over) -> dict:
    d = orjson.loads(orjson.dumps(MINIMAL))
    d.update(over)
    return d


def op(**fields) -> dict:
    return {"responses": {"200": {"description": "ok"}}, **fields}


@pytest.mark.parametrize("path", PUBLIC, ids=lambda p: p.name)
def test_every_public_document_loads(path):
    spec = load_spec(path)
    assert spec.version in ("2.0", "3.0", "3.1")
    assert spec.title


def test_versions():
    assert load_spec(DATA / "petstore.yaml").version == "3.0"
    assert load_spec(DATA / "petstore-3.1.yaml").version == "3.1"
    assert load_spec(DATA / "petstore-swagger2.yaml").version == "2.0"


# -- invalid documents: the error names the faulty node ----------------------

BAD = [
    ("not-an-object", ["a", "list"], "", "must be an object"),
    ("no-version", {"info": {"title": "t", "version": "1"}, "paths": {}}, "", "neither 'openapi' nor 'swagger'"),
    ("number-version", doc_with(openapi=3.0), "/openapi", "version string"),
    ("future-version", doc_with(openapi="4.0.0"), "/openapi", "unsupported OpenAPI version"),
    ("swagger-1.2", {"swagger": "1.2", "info": {}, "paths": {}}, "/swagger", "unsupported Swagger"),
    ("no-info", {"openapi": "3.0.0", "paths": {}}, "", "missing required field 'info'"),
    ("info-title-type", doc_with(info={"title": 5, "version": "1"}), "/info/title", "must be a string"),
    ("no-paths-3.0", {"openapi": "3.0.0", "info": {"title": "t", "version": "1"}}, "", "'paths'"),
    ("paths-list", doc_with(paths=[]), "/paths", "paths must be an object"),
    ("path-no-slash", doc_with(paths={"pets": {}}), "/paths/pets", "must start with '/'"),
    ("operation-not-object", doc_with(paths={"/a": {"get": "x"}}), "/paths/~1a/get", "an operation must be an object"),
    ("no-responses", doc_with(paths={"/a": {"get": {}}}), "/paths/~1a/get", "'responses'"),
    ("param-bad-in", doc_with(paths={"/a": {"get": op(parameters=[{"name": "x", "in": "body", "schema": {}}])}}),
     "/paths/~1a/get/parameters/0/in", "parameter 'in' must be one of"),
    ("param-no-name", doc_with(paths={"/a": {"get": op(parameters=[{"in": "query", "schema": {}}])}}),
     "/paths/~1a/get/parameters/0", "string 'name'"),
    ("path-param-not-required",
     doc_with(paths={"/a/{id}": {"get": op(parameters=[{"name": "id", "in": "path", "schema": {}}])}}),
     "/paths/~1a~1{id}/get/parameters/0", "required: true"),
    ("template-undeclared", doc_with(paths={"/a/{id}": {"get": op()}}), "/paths/~1a~1{id}/get",
     "declares no path parameter 'id'"),
    ("declared-not-in-template",
     doc_with(paths={"/a": {"get": op(parameters=[{"name": "id", "in": "path", "required": True,
                                                   "schema": {}}])}}),
     "/paths/~1a/get/parameters/0", "does not appear in the path"),
    ("schema-and-content", doc_with(paths={"/a": {"get": op(parameters=[
        {"name": "q", "in": "query", "schema": {}, "content": {"application/json": {}}}])}}),
     "/paths/~1a/get/parameters/0", "exactly one of 'schema' and 'content'"),
    ("bad-schema-type", doc_with(components={"schemas": {"A": {"type": "strin"}}}),
     "/components/schemas/A/type", "unknown schema type 'strin'"),
    ("null-type-3.0", doc_with(components={"schemas": {"A": {"type": "null"}}}),
     "/components/schemas/A/type", "nullable"),
    ("required-not-list", doc_with(components={"schemas": {"A": {"required": "x"}}}),
     "/components/schemas/A/required", "list of property names"),
    ("nested-schema", doc_with(components={"schemas": {"A": {"properties": {"b": {"items": 5}}}}}),
     "/components/schemas/A/properties/b/items", "a schema must be an object"),
    ("dangling-ref", doc_with(paths={"/a": {"get": op(responses={"200": {
        "description": "ok", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Nope"}}}}})}}),
     "/paths/~1a/get/responses/200/content/application~1json/schema/$ref", "does not resolve"),
    ("duplicate-operation-id", doc_with(paths={"/a": {"get": op(operationId="x"), "post": op(operationId="x")}}),
     "/paths/~1a/post/operationId", "must be unique"),
    ("request-body-no-content", doc_with(paths={"/a": {"post": op(requestBody={})}}), "/paths/~1a/post/requestBody",
     "'content'"),
    # found by tests/fuzz/test_fuzz_openapi.py: a list or mapping here raised TypeError (unhashable)
    ("param-in-list", doc_with(paths={"/a": {"get": op(parameters=[{"name": "x", "in": [], "schema": {}}])}}),
     "/paths/~1a/get/parameters/0/in", "parameter 'in' must be one of cookie, header, path, query, not an array"),
    ("type-mapping", doc_with(components={"schemas": {"A": {"type": {"$ref": "#"}}}}),
     "/components/schemas/A/type", "schema type must be a string, not an object"),
    ("swagger2-param-type-mapping", {"swagger": "2.0", "info": {"title": "t", "version": "1"}, "paths": {"/a": {"get": {
        "parameters": [{"name": "x", "in": "query", "type": {"a": 1}}], "responses": {"200": {"description": "ok"}}}}}},
     "/paths/~1a/get/parameters/0/type", "parameter type must be one of string"),
]


@pytest.mark.parametrize("doc,pointer,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_invalid_documents_name_the_pointer(doc, pointer, text):
    with pytest.raises(SpecError) as exc:
        parse_spec(doc, "spec.yaml")
    assert exc.value.pointer == pointer, exc.value.problems
    assert text in exc.value.problems[0].message
    assert f"spec.yaml: #{pointer}: " in str(exc.value)


def test_every_problem_is_listed_not_just_the_first():
    d = doc_with(paths={"/a": {"get": {}}, "/b": {"get": {}}}, info={"title": 1, "version": "1"})
    _, problems = validate_document(d)
    assert {p.pointer for p in problems} == {"/info/title", "/paths/~1a/get", "/paths/~1b/get"}


def test_property_named_ref_is_not_a_reference():
    # petstore-property-named-ref.yaml has a property literally called "$ref"
    spec = load_spec(DATA / "petstore-property-named-ref.yaml")
    assert "$ref" in spec.doc["components"]["schemas"]["Pet"]["properties"]


def test_examples_are_data_not_references():
    d = doc_with(components={"schemas": {"A": {"type": "object", "example": {"$ref": "#/nowhere"}}}})
    assert validate_document(d)[1] == []


def test_31_path_item_ref_is_followed():
    spec = load_spec(DATA / "petstore-3.1.yaml")
    ops = [(path, method) for path, method, *_ in iter_operations(spec)]
    assert ("/pets/{petId}", "get") in ops


# -- decoding ------------------------------------------------------------------


def test_non_utf8_is_refused_with_offset_and_line():
    text = "openapi: 3.0.0\ninfo:\n  title: caf\xe9\n  version: '1'\npaths: {}\n".encode("latin-1")
    with pytest.raises(SpecError) as exc:
        load_spec(text)
    e = exc.value
    assert (e.line, e.column) == (3, 13)
    assert "byte 0xe9 at offset 33" in str(e) and "--encoding" in str(e)


def test_named_encoding_reads_legacy_files():
    text = "openapi: '3.0.0'\ninfo:\n  title: caf\xe9\n  version: '1'\npaths: {}\n".encode("latin-1")
    assert load_spec(text, encoding="latin-1").title == "café"
    with pytest.raises(SpecError, match="unknown text encoding"):
        load_spec(text, encoding="no-such-codec")


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig"])
def test_unicode_encodings_by_bom_or_nul_pattern(codec):
    text = "openapi: '3.1.0'\ninfo: {title: 宠物, version: '1'}\npaths: {}\n"
    assert load_spec(text.encode(codec)).title == "宠物"


def test_decode_bytes_strips_bom():
    assert decode_bytes(b"\xef\xbb\xbf{}") == "{}"


def test_unparsable_yaml_gives_line_and_column():
    with pytest.raises(SpecError) as exc:
        load_spec(b"openapi: 3.0.0\ninfo: {title: [\n")
    assert exc.value.line is not None and "not valid YAML" in str(exc.value)


def test_yaml_keys_become_strings_and_dates_stay_strings():
    doc = parse_document("a:\n  200: x\n  true: y\nb: 2024-05-01\n")
    assert doc == {"a": {"200": "x", "true": "y"}, "b": "2024-05-01"}


def test_json_fast_path_and_fallback():
    assert parse_document('{"a": 1}') == {"a": 1}
    assert parse_document('{"a": 1, # comment\n}') == {"a": 1}  # YAML flow with a comment


def test_too_large_is_refused_before_parsing(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_bytes(b"x" * 2000)
    with pytest.raises(SpecError, match="over the 1000-byte limit"):
        load_spec(p, max_bytes=1000)


@pytest.mark.timeout(30)
def test_yaml_alias_bomb_does_not_explode():
    # "billion laughs": 4**24 leaves if expanded, so a walk that expanded it would never end (the
    # test's timeout); shared anchors stay shared objects and walks visit each once
    lines = ["openapi: 3.0.0", "info: {title: t, version: '1'}", "paths: {}", "tags:", "  - a0: &a0 [1, 2]"]
    lines += [f"    a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 25)]
    tags = load_spec("\n".join(lines).encode()).doc["tags"][0]
    assert all(member is tags["a23"] for member in tags["a24"])  # the alias still points at one object


# -- $ref resolution -----------------------------------------------------------


def test_resolver_local_and_escaped_pointers():
    spec = parse_spec(doc_with(components={"schemas": {"a/b": {"type": "string"}, "c~d": {"type": "integer"},
                                                       "sp ace": {"type": "boolean"}}}))
    r = Resolver(spec)
    assert r.resolve("#/components/schemas/a~1b")[0] == {"type": "string"}
    assert r.resolve("#/components/schemas/c~0d")[0] == {"type": "integer"}
    assert r.resolve("#/components/schemas/sp%20ace")[0] == {"type": "boolean"}
    with pytest.raises(LookupError, match="no 'x'"):
        r.resolve("#/components/schemas/x")
    with pytest.raises(LookupError, match="URLs are not followed"):
        r.resolve("https://example.com/s.json#/a")


def test_relative_file_refs(tmp_path):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "pet.yaml").write_text(
        "Pet:\n  type: object\n  properties:\n    owner: {$ref: '#/Owner'}\nOwner: {type: string}\n")
    main = doc_with(paths={"/pets": {"get": op(responses={"200": {"description": "ok", "content": {
        "application/json": {"schema": {"$ref": "schemas/pet.yaml#/Pet"}}}}})}})
    (tmp_path / "api.yaml").write_text(yaml.safe_dump(main))
    spec = load_spec(tmp_path / "api.yaml")
    r = Resolver(spec)
    pet, base, canonical = r.resolve("schemas/pet.yaml#/Pet")
    assert base.endswith("pet.yaml") and canonical.endswith("pet.yaml#/Pet")
    assert r.resolve(pet["properties"]["owner"]["$ref"], base)[0] == {"type": "string"}
    with pytest.raises(LookupError, match="not read from a file"):
        Resolver(parse_spec(main)).resolve("schemas/pet.yaml#/Pet")


def test_deref_detects_cycles():
    spec = parse_spec(doc_with(components={"parameters": {"a": {"$ref": "#/components/parameters/b"},
                                                          "b": {"$ref": "#/components/parameters/a"}}}))
    with pytest.raises(LookupError, match="circular"):
        Resolver(spec).deref({"$ref": "#/components/parameters/a"})


def test_join_pointer_escapes():
    assert join_pointer("/paths", "/pets/{id}", "get") == "/paths/~1pets~1{id}/get"
    assert join_pointer("", "a~b") == "/a~0b"
