"""The OpenAPI Initiative's examples (tests/fixtures/openapi/, unmodified) converted to tools.

Per document: operations, tools produced, operations skipped (with the reason) and unsupported
parts (callbacks). The table is the one in docs/semantic.md ("OpenAPI examples"): a test fails when
the docs and the code disagree. Nothing may be skipped for a callback or a form body (issue 16 item
7), and every produced tool's parameter schema must be valid JSON Schema (the Draft 2020-12 and
Draft 7 meta-schemas), for these examples and for the other public documents under
tests/data/openapi/ (petstore 3.1 and Swagger 2.0, the 107-operation Docker Engine API).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from jsonschema import Draft7Validator, Draft202012Validator

from extproc.semantic.openapi import Resolver, iter_operations, load_spec
from extproc.semantic.tools import build_tools

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "openapi"
DATA = REPO / "tests" / "data" / "openapi"
DOCS = REPO / "docs" / "semantic.md"

# document -> (OpenAPI version, operations, tools, skipped, unsupported callbacks)
EXPECTED = {
    "v3.0/api-with-examples.yaml": ("3.0", 2, 2, 0, 0),
    "v3.0/callback-example.yaml": ("3.0", 1, 1, 0, 1),
    "v3.0/link-example.yaml": ("3.0", 6, 6, 0, 0),
    "v3.0/petstore.yaml": ("3.0", 3, 3, 0, 0),
    "v3.0/petstore-expanded.yaml": ("3.0", 4, 4, 0, 0),
    "v3.0/uspto.yaml": ("3.0", 3, 3, 0, 0),
    "v3.1/non-oauth-scopes.yaml": ("3.1", 1, 1, 0, 0),
    "v3.1/webhook-example.yaml": ("3.1", 0, 0, 0, 0),
}
OTHER_PUBLIC = ["petstore-3.1.yaml", "petstore-swagger2.yaml", "petstore-property-named-ref.yaml",
                "docker-engine-swagger2.yaml"]
FIXED_REASONS = re.compile(r"callback|x-www-form-urlencoded|multipart/form-data", re.IGNORECASE)


def coverage(path: Path) -> tuple:
    spec = load_spec(path)
    ts = build_tools(spec)
    operations = len(list(iter_operations(spec, Resolver(spec))))
    return (spec.version, operations, len(ts.tools), len(ts.skipped), len(ts.unsupported)), ts


def docs_table() -> dict:
    text = DOCS.read_text(encoding="utf-8")
    block = text.split("<!-- openapi-examples -->", 1)[1].split("<!-- /openapi-examples -->", 1)[0]
    rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], *(int(c) for c in cells[2:6]))
    return rows


def test_every_vendored_example_is_in_the_table():
    assert sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_coverage_of_each_example(name):
    got, ts = coverage(FIXTURES / name)
    assert got == EXPECTED[name], ts.report()


def test_the_docs_table_is_the_measured_one():
    assert docs_table() == EXPECTED


@pytest.mark.parametrize("path", [*(FIXTURES / n for n in sorted(EXPECTED)), *(DATA / n for n in OTHER_PUBLIC)],
                         ids=lambda p: p.name)
def test_nothing_is_skipped_for_callbacks_or_forms_and_every_schema_is_valid(path):
    _, ts = coverage(path)
    assert not [s for s in ts.skipped if FIXED_REASONS.search(s.reason)], ts.report()
    for tool in ts.tools:
        Draft202012Validator.check_schema(tool.parameters)
        Draft7Validator.check_schema(tool.parameters)
        assert tool.parameters["type"] == "object"


def test_callbacks_are_listed_unsupported_and_the_operation_is_callable():
    from extproc.semantic.toolcall import build_request, check_arguments

    _, ts = coverage(FIXTURES / "v3.0" / "callback-example.yaml")
    [u] = ts.unsupported
    assert u.pointer == "/paths/~1streams/post/callbacks" and "'onData'" in u.message
    tool = ts.tools[0]
    req = build_request(tool, check_arguments(tool, {"callbackUrl": "https://me.example/cb"}))
    assert (req.method, req.target, req.body) == ("POST", "/streams?callbackUrl=https%3A%2F%2Fme.example%2Fcb", None)
