"""Tests for the simulator's JSON-Schema instance generator."""

from __future__ import annotations

import datetime
import re
import urllib.parse
import uuid

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.simulator_schema import instance_for


def assert_valid(schema: dict | bool, instance) -> None:
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator_class.check_schema(schema)
    validator_class(schema, format_checker=validator_class.FORMAT_CHECKER).validate(instance)


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["label", "children"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}

LINKED_LIST = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "definitions": {
        "cell": {
            "type": "object",
            "properties": {
                "value": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"$ref": "#/definitions/cell"}, {"type": "null"}]},
            },
            "required": ["value", "next"],
        }
    },
    "$ref": "#/definitions/cell",
}

# A schema as pydantic emits it for OpenAI structured outputs (strict mode).
PYDANTIC_STYLE = {
    "$defs": {
        "Holding": {
            "properties": {
                "ticker": {"title": "Ticker", "type": "string", "maxLength": 5, "minLength": 1},
                "weight": {"title": "Weight", "type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "sector": {"enum": ["tech", "energy", "finance"], "title": "Sector", "type": "string"},
            },
            "required": ["ticker", "weight", "sector"],
            "title": "Holding",
            "type": "object",
            "additionalProperties": False,
        }
    },
    "properties": {
        "portfolio_id": {"format": "uuid", "title": "Portfolio Id", "type": "string"},
        "holdings": {"items": {"$ref": "#/$defs/Holding"}, "title": "Holdings", "type": "array", "minItems": 1},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
        "as_of": {"format": "date-time", "title": "As Of", "type": "string"},
    },
    "required": ["portfolio_id", "holdings", "note", "as_of"],
    "title": "Portfolio",
    "type": "object",
    "additionalProperties": False,
}

CORPUS: dict[str, dict | bool] = {
    "empty": {},
    "true": True,
    "string": {"type": "string"},
    "string_lengths": {"type": "string", "minLength": 40, "maxLength": 45},
    "short_string": {"type": "string", "maxLength": 3},
    "string_enum": {"type": "string", "enum": ["buy", "sell", "hold"]},
    "typed_mixed_enum": {"type": "integer", "enum": ["one", 2, None, 3.0]},
    "const": {"const": {"fixed": [1, 2]}},
    "formats": {
        "type": "object",
        "properties": {f: {"type": "string", "format": f}
                       for f in ("date-time", "date", "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname")},
    },
    "integer_exclusive": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 12},
    "integer_multiple": {"type": "integer", "minimum": 10, "maximum": 30, "multipleOf": 7},
    "integer_fractional_multiple": {"type": "integer", "multipleOf": 2.5, "minimum": 1},
    "number_multiple": {"type": "number", "minimum": 0.25, "maximum": 0.95, "multipleOf": 0.1},
    "number_exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
    "draft4_exclusive": {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "number", "minimum": 5, "exclusiveMinimum": True, "maximum": 6, "exclusiveMaximum": True,
    },
    "type_list": {"type": ["string", "null"], "minLength": 2},
    "scalars": {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "null"}, {"type": "number"}],
                "items": False},
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000},
                     "minItems": 5, "maxItems": 6, "uniqueItems": True},
    "tuple_draft7": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                     "items": [{"type": "string"}, {"type": "integer"}], "additionalItems": False},
    "one_of_numeric": {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    "any_of_with_base": {"type": "object", "required": ["kind"],
                         "anyOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}]},
    "all_of_objects": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "string", "format": "email"}}, "required": ["b"]},
            {"properties": {"a": {"minimum": 100}}},
        ],
    },
    "min_properties": {"type": "object", "minProperties": 3, "additionalProperties": {"type": "boolean"}},
    "required_without_properties": {"type": "object", "required": ["x", "y"],
                                    "additionalProperties": {"type": "integer"}},
    "tree": TREE,
    "linked_list": LINKED_LIST,
    "pydantic_style": PYDANTIC_STYLE,
}


@pytest.mark.parametrize("name", list(CORPUS))
@pytest.mark.parametrize("seed", [0, 1, 7, 123456789])
def test_corpus_instances_validate(name: str, seed: int) -> None:
    schema = CORPUS[name]
    assert_valid(schema, instance_for(schema, seed))


def test_same_seed_same_value_and_seeds_vary() -> None:
    assert instance_for(PYDANTIC_STYLE, 42) == instance_for(PYDANTIC_STYLE, 42)
    values = {repr(instance_for(PYDANTIC_STYLE, seed)) for seed in range(10)}
    assert len(values) > 1


def test_untyped_schema_yields_a_string() -> None:
    assert isinstance(instance_for({}, 3), str)
    assert isinstance(instance_for({"properties": {"a": {"type": "integer"}}}, 3), str)
    assert isinstance(instance_for({"description": "anything"}, 3), str)


def test_all_properties_are_emitted() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
    assert set(instance_for(schema, 0)) == {"a", "b"}


def test_formats_are_well_formed() -> None:
    value = instance_for(CORPUS["formats"], 5)
    datetime.datetime.fromisoformat(value["date-time"])
    datetime.date.fromisoformat(value["date"])
    datetime.time.fromisoformat(value["time"])
    assert re.fullmatch(r"[^@\s]+@[^@\s]+\.[a-z]+", value["email"])
    assert str(uuid.UUID(value["uuid"])) == value["uuid"]
    parsed = urllib.parse.urlparse(value["uri"])
    assert parsed.scheme == "https" and parsed.netloc


def test_pattern_is_ignored_but_a_string_is_returned() -> None:
    value = instance_for({"type": "string", "pattern": "^[0-9]{3}$"}, 0)
    assert isinstance(value, str)  # documented: the pattern is not honoured


def test_recursion_stops_and_keeps_required_members() -> None:
    def depth(node) -> int:
        return 1 + max((depth(child) for child in node["children"]), default=0)

    tree = instance_for(TREE, 0)
    assert 1 < depth(tree) <= 9

    cell, length = instance_for(LINKED_LIST, 0), 0
    while cell is not None:
        cell, length = cell["next"], length + 1
    assert 1 < length <= 9


@pytest.mark.parametrize("schema", [
    False,
    {"$ref": "https://example.com/schema.json"},
    {"$ref": "#/$defs/missing"},
    {"$defs": {"self": {"allOf": [{"$ref": "#/$defs/self"}]}}, "$ref": "#/$defs/self"},
    {"$defs": {"loop": {"type": "object", "properties": {"x": {"$ref": "#/$defs/loop"}}, "required": ["x"]}},
     "$ref": "#/$defs/loop"},
])
def test_unsatisfiable_or_unsupported_schemas_raise_value_error(schema) -> None:
    with pytest.raises(ValueError):
        instance_for(schema, 0)


# -- property-based: random simple schemas -----------------------------------

_bound = st.integers(min_value=-1000, max_value=1000)


@st.composite
def _numeric(draw, kind: str) -> dict:
    schema: dict = {"type": kind}
    low, high = sorted((draw(_bound), draw(_bound)))
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = high + 2
    if draw(st.booleans()):
        schema["multipleOf"] = draw(st.sampled_from([1, 2, 5, 0.5] if kind == "integer" else [0.5, 0.25, 3]))
        if "exclusiveMaximum" in schema or "maximum" in schema:
            key = "exclusiveMaximum" if "exclusiveMaximum" in schema else "maximum"
            schema[key] = high + 12  # leave room for a multiple
    return schema


@st.composite
def _string(draw) -> dict:
    schema: dict = {"type": "string"}
    if draw(st.booleans()):  # a format, or length bounds (together they may be unsatisfiable)
        schema["format"] = draw(st.sampled_from(["date-time", "date", "email", "uuid", "uri"]))
        return schema
    low = draw(st.integers(min_value=0, max_value=30))
    if draw(st.booleans()):
        schema["minLength"] = low
    if draw(st.booleans()):
        schema["maxLength"] = low + draw(st.integers(min_value=0, max_value=30))
    return schema


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))
_leaf = st.one_of(
    _numeric("integer"),
    _numeric("number"),
    _string(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(_json_scalar, min_size=1, max_size=4).map(lambda values: {"enum": values}),
    _json_scalar.map(lambda value: {"const": value}),
)


def _compound(children: st.SearchStrategy) -> st.SearchStrategy:
    def object_schema(props: dict, required_flags: list[bool], closed: bool) -> dict:
        required = [name for name, flag in zip(props, required_flags) if flag]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": not closed}

    objects = st.builds(
        object_schema,
        st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4), children, max_size=4),
        st.lists(st.booleans(), min_size=4, max_size=4),
        st.booleans(),
    )
    arrays = st.builds(
        lambda items, low, extra: {"type": "array", "items": items, "minItems": low, "maxItems": low + extra},
        children, st.integers(0, 3), st.integers(0, 3),
    )
    unions = st.lists(children, min_size=1, max_size=3).map(lambda options: {"anyOf": options})
    nullable = children.map(lambda child: {"anyOf": [child, {"type": "null"}]})
    return st.one_of(objects, arrays, unions, nullable)


_schemas = st.recursive(_leaf, _compound, max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schemas, seed=st.integers(min_value=0, max_value=2**32))
def test_generated_simple_schemas_validate(schema: dict, seed: int) -> None:
    assert_valid(schema, instance_for(schema, seed))
