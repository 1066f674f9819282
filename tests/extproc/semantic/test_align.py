"""extproc.semantic.align: tokens, field extraction, matching, conversions, outputs; a generated
mapping round-trips (hypothesis)."""

from __future__ import annotations

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from extproc.semantic.align import align_schemas, name_similarity, name_tokens, schema_fields
from extproc.semantic.mapping import compile_mapping
from extproc.template import compile_template

LEGACY = {"type": "object", "title": "order", "required": [
    "order_id", "created_at", "amount", "status", "is_gift", "updated", "customer", "tags"], "properties": {
    "order_id": {"type": "string"},
    "created_at": {"type": "string", "format": "date-time"},
    "amount": {"type": "string", "description": "decimal as text"},
    "status": {"type": "string", "enum": ["in_progress", "done", "cancelled"]},
    "is_gift": {"type": "boolean"},
    "updated": {"type": "integer"},
    "customer": {"type": "object", "required": ["name", "email"], "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}}},
    "tags": {"type": "array", "items": {"type": "string"}},
}}
ADAPTER = {"type": "object", "required": ["orderId", "createdTs", "amt", "orderStatus", "giftFlag", "updatedAt",
                                          "customerName", "customerEmail", "tags"], "properties": {
    "orderId": {"type": "string"},
    "createdTs": {"type": "integer"},
    "amt": {"type": "number"},
    "orderStatus": {"type": "string", "enum": ["InProgress", "Done", "Cancelled"]},
    "giftFlag": {"type": "string", "enum": ["Y", "N"]},
    "updatedAt": {"type": "string", "format": "date-time"},
    "customerName": {"type": "string"},
    "customerEmail": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "channel": {"type": "string"},
}}


@pytest.fixture(scope="module")
def alignment():
    return align_schemas(LEGACY, ADAPTER, legacy_name="legacy.json", adapter_name="adapter.json")


@pytest.mark.parametrize("name,tokens", [
    ("created_at", ("creat", "time")),
    ("createdAt", ("creat", "time")),
    ("created-at", ("creat", "time")),
    ("ImageID", ("imag", "id")),
    ("HTMLUrl", ("html", "url")),
    ("addrLine1", ("address", "line", "1")),
    ("acctNo", ("account", "number")),
    ("qty", ("quantity",)),
    ("txnDesc", ("transact", "descript")),
    ("isPaid", ("paid",)),
    ("userIdentifier", ("user", "id")),
    ("e_mail", ("email",)),
])
def test_name_tokens(name, tokens):
    assert name_tokens(name) == tokens


def test_name_similarity_orders_candidates():
    assert name_similarity("amount", "amt") == 1.0
    assert name_similarity("livemode", "liveMode") == 1.0
    assert name_similarity("created", "createdTs") > name_similarity("created", "customerName")
    assert name_similarity("id", "chargeId", legacy_root="charge") > name_similarity("id", "chargeId")
    assert name_similarity(("repository", "slug"), "repoSlug") > 0.9
    assert name_similarity("color", "colour") == 1.0


def test_schema_fields_flatten_nested_objects():
    fields = schema_fields({"type": "object", "required": ["a"], "properties": {
        "a": {"type": "object", "required": ["b"], "properties": {"b": {"type": "string"}, "c": {"type": "integer"}}},
        "d": {"type": ["string", "null"], "format": "date"},
        "e": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "f": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
        "g": {"enum": ["x", "y", None]},
        "h": {"type": "object", "additionalProperties": {"type": "string"}},
    }})
    got = {f.dotted: (f.type, f.required, f.nullable) for f in fields}
    assert got == {"a.b": ("string", True, False), "a.c": ("integer", False, False), "d": ("string", False, True),
                   "e": ("number", False, True), "f": ("array", False, False), "g": ("string", False, False),
                   "h": ("object", False, False)}
    assert fields[5].enum == ("x", "y") and fields[4].items_type == "object"
    with pytest.raises(ValueError, match="no properties"):
        schema_fields({"type": "string"})


def test_alignment_pairs_and_conversions(alignment):
    assert alignment.pairs() == {
        "order_id": "orderId", "created_at": "createdTs", "amount": "amt", "status": "orderStatus",
        "is_gift": "giftFlag", "updated": "updatedAt", "customer.name": "customerName",
        "customer.email": "customerEmail", "tags": "tags"}
    conv = {m.legacy.dotted: m.conversion for m in alignment.matches if m.conversion}
    assert conv == {
        "created_at": {"kind": "iso8601_to_unix", "params": {"unit": "s", "form": "datetime"}},
        "amount": {"kind": "string_to_number", "params": {"type": "number"}},
        "status": {"kind": "enum_map", "params": {"pairs": [["in_progress", "InProgress"], ["done", "Done"],
                                                            ["cancelled", "Cancelled"]]}},
        "is_gift": {"kind": "enum_map", "params": {"pairs": [[True, "Y"], [False, "N"]]}},
        "updated": {"kind": "unix_to_iso8601", "params": {"unit": "s", "form": "datetime"}},
    }
    assert [f.dotted for f in alignment.unmatched_adapter] == ["channel"]
    assert alignment.unmatched_legacy == ()


def test_generated_templates_compile_and_read_well(alignment):
    fwd = alignment.forward_template()
    compile_template(fwd)
    compile_template(alignment.inverse_template())
    assert '"customerName": $.customer.name,' in fwd
    assert "# converted: iso8601_to_unix" in fwd
    inv = alignment.inverse_template()
    assert '"customer": {' in inv and '"name": $.customerName,' in inv


def test_mapping_yaml_loads_as_a_transform(alignment):
    doc = yaml.safe_load(alignment.mapping_yaml())
    assert doc["kind"] == "FieldMapping" and doc["forward"].startswith("# legacy.json -> adapter.json")
    m = compile_mapping(doc)
    assert m.lossless and len(m.conversions) == 5


def test_reports(alignment):
    md = alignment.report_markdown()
    assert md.startswith("# Alignment: legacy.json -> adapter.json")
    assert "| `amount` | `amt` |" in md and "canonical numerals" in md  # string->number needs a look
    j = alignment.report_json()
    assert j["summary"] == {"legacy_fields": 9, "adapter_fields": 10, "matched": 9, "ambiguous": 0,
                            "unmatched_legacy": 0, "unmatched_adapter": 1}
    orjson.dumps(j)


def test_ambiguous_and_unmatched_are_flagged():
    a = align_schemas({"type": "object", "required": ["phone", "geo"], "properties": {
        "phone": {"type": "string"}, "geo": {"type": "object", "properties": {"elevation": {"type": "number"}}}}},
        {"type": "object", "required": ["home_phone", "latitude"], "properties": {
            "home_phone": {"type": "string"}, "work_phone": {"type": "string"}, "latitude": {"type": "number"}}})
    (m,) = a.matches
    assert m.ambiguous and m.legacy.dotted == "phone"
    assert {p for p, _ in m.alternatives} == {"home_phone", "work_phone"} - {m.adapter.dotted}
    assert [f.dotted for f, _ in a.unmatched_legacy] == ["geo.elevation"]
    md = a.report_markdown()
    assert "ambiguous: also" in md and "unmatched legacy field" in md
    assert "required adapter field with no legacy counterpart" in md
    assert "# TODO: required adapter field $.latitude" in a.forward_template()
    assert "# AMBIGUOUS: also" in a.forward_template()


def test_incompatible_types_are_never_matched():
    a = align_schemas({"type": "object", "properties": {"address": {"type": "object", "additionalProperties": True}}},
                      {"type": "object", "properties": {"address": {"type": "string"}}})
    assert a.matches == () and a.unmatched_legacy[0][1] is None


def test_enum_partial_and_lossy_number_are_noted():
    a = align_schemas({"type": "object", "properties": {"state": {"type": "string", "enum": ["open", "held"]},
                                                        "qty": {"type": "number"}}},
                      {"type": "object", "properties": {"state": {"type": "string", "enum": ["OPEN", "CLOSED"]},
                                                        "quantity": {"type": "integer"}}})
    by = {m.legacy.dotted: m for m in a.matches}
    assert by["state"].conversion["params"]["pairs"] == [["open", "OPEN"]]
    assert any("without a counterpart" in n for n in by["state"].notes)
    assert by["qty"].lossless is False and "fractions" in by["qty"].notes[0]


# -- two-way property: forward then inverse returns the original -------------------------

numerals = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
                     st.floats(allow_nan=False, allow_infinity=False).map(repr))
iso_text = st.integers(min_value=-62135596800, max_value=253402300799).map(
    lambda s: __import__("extproc.semantic.conversions", fromlist=["x"]).make_conversion("unix_to_iso8601").forward(s))
legacy_docs = st.fixed_dictionaries({
    "order_id": st.text(),
    "created_at": iso_text,
    "amount": numerals,
    "status": st.sampled_from(["in_progress", "done", "cancelled"]),
    "is_gift": st.booleans(),
    "updated": st.integers(min_value=-62135596800, max_value=253402300799),
    "customer": st.fixed_dictionaries({"name": st.text(), "email": st.text()}),
    "tags": st.lists(st.text(), max_size=3),
})


@settings(max_examples=300, deadline=None)
@given(legacy_docs)
def test_lossless_mapping_round_trips(doc):
    m = compile_mapping(yaml.safe_load(ALIGNED_YAML))
    adapter = orjson.loads(orjson.dumps(m.forward(doc)))  # through the wire
    ADAPTER_VALIDATOR.validate(adapter)
    assert m.inverse(adapter) == doc


ALIGNED_YAML = align_schemas(LEGACY, ADAPTER).mapping_yaml()
ADAPTER_VALIDATOR = Draft202012Validator(ADAPTER)
