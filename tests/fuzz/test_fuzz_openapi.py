"""Fuzz target `openapi`: OpenAPI documents to tool specifications, and calls of the tools built.

What: the repo's OpenAPI fixtures (tests/data/openapi: petstore in 3.0, 3.1 and Swagger 2.0, the
expanded petstore, uspto, the GitHub and Stripe excerpts, callbacks, links, ...; the 465 KB Docker
Engine document is left out for speed) are parsed and mutated as data (a field dropped, an item
duplicated, a value retyped, a `$ref` pointed elsewhere or at itself, a schema keyword given the
wrong type, an operation copied under another path) and written back as JSON or YAML, or mutated
as text and bytes (cut short, a byte flipped, a UTF-16 BOM), or are random JSON values.
Properties, per case:
- `load_spec` returns a `Spec` or raises `SpecError` whose every problem has a JSON pointer (""
  or starting with "/") and a non-empty message; nothing else;
- `build_tools` on a `Spec` never raises; every tool has a valid name (`^[a-zA-Z0-9_-]{1,64}$`,
  unique) and its OpenAI, Anthropic and MCP forms are JSON;
- calling a built tool with random arguments (`check_arguments`, `build_request`) returns a
  request or raises `ToolCallError`; a built request's target starts with "/" and has no CR, LF,
  NUL or space, and no header value has CR, LF or NUL;
- the case ends within `CASE_LIMIT_S`.
Cost: about 2 to 20 ms per case (YAML or JSON parsing, schema expansion).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import orjson
import yaml
from hypothesis import given
from hypothesis import strategies as st

from extproc.semantic.openapi import Problem, SpecError, load_spec
from extproc.semantic.toolcall import ToolCallError, build_request, check_arguments
from extproc.semantic.tools import anthropic_tools, build_tools, mcp_tool_list, openai_tools
from tests.fuzz.harness import SUITE, Finding, pick, refusal_class, time_limit
from tests.fuzz.test_fuzz_config import _copy, _get, _paths

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "openapi"
LEFT_OUT = {"docker-engine-swagger2.yaml"}  # 465 KB: 0.2 s a parse, it would take most of the time
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@cache
def fixtures() -> tuple[tuple[str, bytes, object], ...]:
    out = []
    for p in sorted(FIXTURES.glob("*.yaml")):
        if p.name in LEFT_OUT:
            continue
        data = p.read_bytes()
        out.append((p.name, data, yaml.safe_load(data)))
    return tuple(out)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: the same text, 8x faster

# --- strategies ---------------------------------------------------------------------------------------

scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.text(max_size=10), st.sampled_from(
    ["object", "array", "string", "integer", "number", "boolean", "null", "query", "path", "header", "cookie",
     "body", "formData", "#/components/schemas/Pet", "#/definitions/Pet", "#/", "#", "#/paths", "other.yaml#/x",
     "http://example.com/x.json", "{id}", "/pets/{petId}", "3.0.0", "3.1.0", "2.0", "application/json",
     "multipart/form-data", "form", "deepObject", "matrix", "label", "simple", "spaceDelimited", "file"]))
value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
    ["type", "$ref", "properties", "items", "required", "allOf", "anyOf", "oneOf", "in", "name", "schema", "enum",
     "additionalProperties", "content", "parameters", "responses"]), c, max_size=3), max_leaves=6)


@st.composite
def mutate_doc(draw, doc):
    doc = _copy(doc)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        how = draw(pick(["drop", "dup", "retype", "null", "ref", "selfref", "extra", "copy-op", "swap"]))
        if not path:
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        current = parent[key]
        if how == "drop":
            del parent[key]
        elif how == "dup" and isinstance(parent, list):
            parent.insert(key, _copy(current))
        elif how == "retype":
            parent[key] = draw(value) if not isinstance(current, (dict, list)) else draw(scalar)
        elif how == "null":
            parent[key] = None
        elif how == "ref":  # a $ref to a random place of the document (or nowhere)
            target = draw(st.sampled_from(paths))
            pointer = "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in target)
            parent[key] = {"$ref": draw(st.sampled_from([pointer, pointer + "/x", "#/nowhere", pointer]))}
        elif how == "selfref":  # a $ref to itself or to its parent: a cycle
            pointer = "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1")
                                    for p in path[:draw(st.integers(0, len(path)))])
            parent[key] = {"$ref": pointer}
        elif how == "extra" and isinstance(current, dict):
            current[draw(pick(["type", "$ref", "properties", "items", "required", "in", "name", "style",
                                          "explode", "allOf", "x-extra"]))] = draw(value)
        elif how == "copy-op" and isinstance(doc.get("paths"), dict) and doc["paths"]:
            src = draw(st.sampled_from(sorted(doc["paths"], key=str)))
            doc["paths"][draw(pick(["/copy/{id}", "/copy", "/{a}/{a}", "copy", "/x/{petId}", "/é"]))] = \
                _copy(doc["paths"][src])
        elif how == "swap":
            other = _get(doc, draw(st.sampled_from(paths)))
            parent[key] = _copy(other) if other is not doc else draw(value)
    return doc


@st.composite
def mutate_bytes(draw, data: bytes) -> bytes:
    how = draw(pick(["cut", "flip", "bom16", "nul", "insert"]))
    i = draw(st.integers(0, len(data)))
    if how == "cut":
        return data[:i]
    if how == "flip" and data:
        i = min(i, len(data) - 1)
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    if how == "bom16":
        return b"\xff\xfe" + data.decode("utf-8", "replace").encode("utf-16-le")
    if how == "nul":
        return data[:i] + b"\x00" + data[i:]
    return data[:i] + draw(pick([b":", b"- ", b"{", b"[", b"&a ", b"*a", b"!!python/object:os.system ",
                                            b"\t", b"\n  ", b"'", b"\xff"])) + data[i:]


args_value = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False)
                          | st.text(max_size=10) | st.sampled_from(["a\r\nx-injected: 1", "\x00", "../..", "a b/c?d#e",
                                                                    "%2F", "\u2028"]),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=6)


@dataclass(frozen=True)
class OpenAPICase:
    data: bytes
    calls: tuple  # (tool index, arguments) pairs, tried on the tools the document gives

    def __repr__(self) -> str:
        return f"OpenAPICase(calls={self.calls!r}, data=<<<\n{self.data.decode('utf-8', 'backslashreplace')}\n>>>)"


_CALLS = st.lists(st.tuples(st.integers(0, 20), st.dictionaries(
        st.sampled_from(["petId", "limit", "id", "name", "tag", "body", "query_id", "owner", "repo"]) | st.text(max_size=6),
        args_value, max_size=4) | args_value), max_size=3)
_RANDOM_DOC = value | st.fixed_dictionaries({"openapi": st.sampled_from(["3.0.0", "3.1.0"]), "info": value, "paths": value})


@st.composite
def openapi_cases(draw) -> OpenAPICase:
    name, data, doc = fixtures()[draw(pick(range(len(fixtures()))))]
    how = draw(pick(["doc", "doc", "doc", "bytes", "random", "as-is"]))
    if how == "doc":
        doc = draw(mutate_doc(doc))
        data = orjson.dumps(doc) if draw(st.booleans()) else yaml.dump(doc, Dumper=_DUMPER, allow_unicode=True).encode()
    elif how == "bytes":
        data = draw(mutate_bytes(data))
    elif how == "random":
        data = json.dumps(draw(_RANDOM_DOC)).encode()
    calls = draw(_CALLS)
    return OpenAPICase(data, tuple(calls))


CASES = openapi_cases()


# --- the properties -----------------------------------------------------------------------------------

_BAD_TARGET = re.compile(r"[\r\n\x00 ]")
_BAD_HEADER = re.compile(r"[\r\n\x00]")


def check(case: OpenAPICase) -> str | None:
    with time_limit():
        try:
            spec = load_spec(case.data)
        except SpecError as e:
            if not e.problems:
                raise Finding(f"SpecError with no problem: {e!r}") from None
            for p in e.problems:
                if not isinstance(p, Problem) or not (p.pointer == "" or p.pointer.startswith("/")) \
                        or not p.message.strip():
                    raise Finding(f"problem without a JSON pointer or a message: {p!r}") from None
            return refusal_class(e.problems[0].message, 80)
        toolset = build_tools(spec)
        names = [t.name for t in toolset.tools]
        if len(set(names)) != len(names) or not all(_NAME.fullmatch(n) for n in names):
            raise Finding(f"tool names not unique or not valid: {names}")
        for fmt in (openai_tools, anthropic_tools, mcp_tool_list):
            orjson.dumps(fmt(toolset))
        refusal = None if toolset.tools else "no operation could be a tool"
        for index, args in case.calls:
            if not toolset.tools:
                break
            tool = toolset.tools[index % len(toolset.tools)]
            try:
                req = build_request(tool, check_arguments(tool, args))
            except ToolCallError as e:
                if not e.message.strip():
                    raise Finding(f"ToolCallError without a message: {e!r}") from None
                refusal = refusal or "call: " + refusal_class(e.code, 80)
                continue
            if _BAD_TARGET.search(req.target) or not req.target.startswith("/"):
                raise Finding(f"built request target {req.target!r} has CR, LF, NUL or a space, or no leading /")
            for k, v in req.headers:
                if _BAD_HEADER.search(k) or _BAD_HEADER.search(v):
                    raise Finding(f"built request header {k!r}: {v!r} has CR, LF or NUL")
        return refusal


@SUITE
@given(CASES)
def test_openapi_documents_convert_or_are_refused_with_pointers(case):
    check(case)
