"""extproc.semantic.mapping: mapping files (templates + conversions) in both directions."""

from __future__ import annotations

import pytest
import yaml

from extproc.semantic.mapping import MappingError, compile_mapping, load_mapping, parse_path
from extproc.template import WILDCARD, MissingPathError

DOC = {
    "forward": '{"createdTs": $.created, "amt": $.amount, "items": $.lines, "note": $.note ?? null}',
    "inverse": '{"created": $.createdTs, "amount": $.amt, "lines": $.items, "note": $.note}',
    "conversions": [
        {"field": "$.createdTs", "source": "$.created", "kind": "unix_to_iso8601", "params": {"unit": "s"}},
        {"field": "$.amt", "source": "$.amount", "kind": "string_to_number", "params": {"type": "number"}},
        {"field": "$.items[*].state", "source": "$.lines[*].state", "kind": "enum_map",
         "params": {"pairs": [["open", "OPEN"], ["shut", "CLOSED"]]}},
    ],
}


def test_forward_and_inverse_apply_templates_then_conversions():
    m = compile_mapping(DOC)
    legacy = {"created": 1714564800, "amount": "12.5", "lines": [{"state": "open"}, {"state": "shut"}, {}],
              "note": None}
    adapter = m.forward(legacy)
    assert adapter == {"createdTs": "2024-05-01T12:00:00Z", "amt": 12.5,
                       "items": [{"state": "OPEN"}, {"state": "CLOSED"}, {}], "note": None}
    assert legacy["lines"][0] == {"state": "open"}  # the input is never modified
    assert m.inverse(adapter) == legacy
    assert m.lossless


def test_missing_paths_follow_template_rules():
    m = compile_mapping(DOC)
    with pytest.raises(MissingPathError) as exc:
        m.forward({"amount": "1", "lines": []})
    assert exc.value.path == "$.created"


def test_conversion_failures_name_the_field():
    m = compile_mapping(DOC)
    with pytest.raises(MappingError) as exc:
        m.forward({"created": 1, "amount": "12,5", "lines": []})
    assert exc.value.field == "$.amt" and "not a decimal numeral" in str(exc.value)
    assert exc.value.conversion_error.kind == "string_to_number"
    with pytest.raises(MappingError) as exc:
        m.inverse({"createdTs": "2024-05-01T12:00:00Z", "amt": 1, "items": [{"state": "LOST"}], "note": None})
    assert exc.value.field == "$.items[*].state"  # the adapter-side (client's) field


def test_to_dict_round_trips():
    m = compile_mapping(DOC)
    again = compile_mapping(yaml.safe_load(yaml.safe_dump(m.to_dict())))
    assert again.to_dict() == m.to_dict()


def test_source_defaults_to_field_and_inverse_is_optional():
    m = compile_mapping({"forward": '{"t": $.t}', "conversions": [{"field": "$.t", "kind": "iso8601_to_unix"}]})
    assert m.forward({"t": "1970-01-01T00:00:10Z"}) == {"t": 10}
    with pytest.raises(MappingError, match="no inverse template"):
        m.inverse({"t": 10})


@pytest.mark.parametrize("doc,field,text", [
    ([], "(document)", "must be a YAML mapping"),
    ({"inverse": "{}"}, "forward", "missing"),
    ({"forward": 5}, "forward", "must be template text"),
    ({"forward": '{"a": $.b,}'}, "forward", "line 1, column"),
    ({"forward": "{}", "extra": 1}, "extra", "unknown key"),
    ({"forward": "{}", "kind": "Other"}, "kind", "expected FieldMapping"),
    ({"forward": "{}", "conversions": {}}, "conversions", "must be a list"),
    ({"forward": "{}", "conversions": [{"field": "a", "kind": "enum_map"}]}, "conversions[0].field", "expected a path"),
    ({"forward": "{}", "conversions": [{"field": "$", "kind": "enum_map"}]}, "conversions[0].field", "whole document"),
    ({"forward": "{}", "conversions": [{"field": "$.a", "kind": "magic"}]}, "conversions[0].kind", "unknown conversion"),
    ({"forward": "{}", "conversions": [{"field": "$.a", "kind": "enum_map", "params": {}}]}, "conversions[0].params",
     "non-empty list"),
    ({"forward": "{}", "conversions": [{"field": "$.a", "kind": "enum_map", "when": 1}]}, "conversions[0].when",
     "unknown key"),
])
def test_invalid_mapping_files_name_the_key(doc, field, text):
    with pytest.raises(MappingError) as exc:
        compile_mapping(doc)
    assert exc.value.field == field and text in str(exc.value)


def test_parse_path():
    assert parse_path("$.a['b c'][0][*]") == ("a", "b c", 0, WILDCARD)
    with pytest.raises(ValueError):
        parse_path("$.a ?? $.b")


def test_load_mapping(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(DOC), encoding="utf-8")
    assert load_mapping(p).forward({"created": 0, "amount": "1", "lines": []})["createdTs"] == "1970-01-01T00:00:00Z"
    p.write_bytes(b"forward: '{\"a\": \xff}'")
    with pytest.raises(MappingError, match="not UTF-8"):
        load_mapping(p)
    with pytest.raises(MappingError, match="cannot read"):
        load_mapping(tmp_path / "missing.yaml")
