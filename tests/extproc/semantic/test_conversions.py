"""extproc.semantic.conversions: each conversion and its inverse; lossless round trips (hypothesis)."""

from __future__ import annotations

import datetime as dt
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.semantic.conversions import KINDS, ConversionError, make_conversion

SETTINGS = settings(max_examples=300, deadline=None)
UTC = dt.timezone.utc
unix_seconds = st.integers(min_value=-62135596800, max_value=253402300799)
datetimes = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59))


def iso(d: dt.datetime, digits: int = 0) -> str:
    text = d.strftime("%Y-%m-%dT%H:%M:%S").rjust(19, "0")
    text = f"{d.year:04d}" + text[text.index("-"):]
    if digits:
        text += "." + f"{d.microsecond:06d}"[:digits]
    return text + "Z"


@pytest.mark.parametrize("kind,params,legacy,adapter", [
    ("iso8601_to_unix", {}, "2024-05-01T12:00:00Z", 1714564800),
    ("iso8601_to_unix", {"unit": "ms"}, "2024-05-01T12:00:00.123Z", 1714564800123),
    ("iso8601_to_unix", {"form": "date"}, "2024-05-01", 1714521600),
    ("unix_to_iso8601", {}, 0, "1970-01-01T00:00:00Z"),
    ("unix_to_iso8601", {}, -1, "1969-12-31T23:59:59Z"),
    ("unix_to_iso8601", {"unit": "ms"}, 1714564800123, "2024-05-01T12:00:00.123Z"),
    ("unix_to_iso8601", {"form": "date"}, 1714521600, "2024-05-01"),
    ("string_to_number", {}, "12.5", 12.5),
    ("string_to_number", {"type": "integer"}, "-42", -42),
    ("number_to_string", {}, 0.1, "0.1"),
    ("number_to_string", {"type": "integer"}, 7.0, "7"),
    ("enum_map", {"pairs": [["in_progress", "InProgress"], ["done", "Done"]]}, "in_progress", "InProgress"),
    ("enum_map", {"pairs": [[True, "Y"], [False, "N"]]}, False, "N"),
])
def test_examples_both_ways(kind, params, legacy, adapter):
    c = make_conversion(kind, params)
    assert c.forward(legacy) == adapter
    assert c.inverse(adapter) == legacy
    assert c.forward(None) is None and c.inverse(None) is None


def test_offsets_and_fractions():
    c = make_conversion("iso8601_to_unix")
    assert c.forward("2024-05-01T14:00:00+02:00") == 1714564800
    assert c.forward("2024-05-01T12:00:00.5Z") == 1714564800.5
    assert c.forward("2024-05-01T12:00:00") == 1714564800  # no offset: UTC
    assert c.inverse(1714564800.25) == "2024-05-01T12:00:00.25Z"
    assert make_conversion("iso8601_to_unix", {"unit": "ms"}).forward("1970-01-01T00:00:00.0015Z") == 1.5


@pytest.mark.parametrize("kind,params,value,text", [
    ("iso8601_to_unix", {}, "yesterday", "not an ISO 8601"),
    ("iso8601_to_unix", {}, "2024-02-30T00:00:00Z", "not a valid date-time"),
    ("iso8601_to_unix", {}, 5, "expected an ISO 8601 string"),
    ("unix_to_iso8601", {}, "5", "expected a Unix time number"),
    ("unix_to_iso8601", {}, True, "expected a Unix time number"),
    ("unix_to_iso8601", {}, 10**13, "outside years 1-9999"),
    ("unix_to_iso8601", {}, math.inf, "expected a Unix time number"),
    ("string_to_number", {}, "1,5", "not a decimal numeral"),
    ("string_to_number", {}, "1e999", "out of range"),
    ("string_to_number", {"type": "integer"}, "1.5", "not an integer numeral"),
    ("string_to_number", {}, 5, "expected a string"),
    ("number_to_string", {"type": "integer"}, 1.5, "not an integer"),
    ("number_to_string", {}, math.nan, "no decimal spelling"),
    ("enum_map", {"pairs": [["a", "A"]]}, "b", "not one of the mapped legacy values"),
])
def test_values_that_cannot_convert(kind, params, value, text):
    c = make_conversion(kind, params)
    with pytest.raises(ConversionError) as exc:
        c.forward(value)
    assert text in str(exc.value) and exc.value.kind == kind and exc.value.value is value


@pytest.mark.parametrize("kind,params,text", [
    ("nope", {}, "unknown conversion kind"),
    ("iso8601_to_unix", {"unit": "h"}, "unit must be"),
    ("iso8601_to_unix", {"zone": "x"}, "unknown param"),
    ("string_to_number", {"type": "text"}, "type must be"),
    ("enum_map", {}, "non-empty list"),
    ("enum_map", {"pairs": [["a"]]}, "pairs[0] must be"),
    ("enum_map", {"pairs": [["a", "A"], ["a", "B"]]}, "listed twice"),
    ("enum_map", {"pairs": [[["a"], "A"]]}, "must be scalars"),
])
def test_bad_params(kind, params, text):
    with pytest.raises(ConversionError, match=text.replace("[", r"\[").replace("]", r"\]")):
        make_conversion(kind, params)


def test_lossless_flags():
    assert all(make_conversion(k, p).lossless for k, p in [
        ("iso8601_to_unix", {}), ("unix_to_iso8601", {}), ("string_to_number", {}), ("number_to_string", {})])
    assert make_conversion("enum_map", {"pairs": [["a", "A"], ["b", "B"]]}).lossless
    many_to_one = make_conversion("enum_map", {"pairs": [["a", "A"], ["b", "A"]]})
    assert not many_to_one.lossless and many_to_one.inverse("A") == "a"
    assert set(KINDS) == {"iso8601_to_unix", "unix_to_iso8601", "string_to_number", "number_to_string", "enum_map"}


# -- property tests: where lossless, there and back returns the original ------------------


@SETTINGS
@given(unix_seconds)
def test_unix_seconds_round_trip(v):
    c = make_conversion("unix_to_iso8601")
    assert c.inverse(c.forward(v)) == v
    assert make_conversion("iso8601_to_unix").forward(c.forward(v)) == v


@SETTINGS
@given(st.integers(min_value=-62135596800000, max_value=253402300799999))
def test_unix_millis_round_trip(v):
    c = make_conversion("unix_to_iso8601", {"unit": "ms"})
    assert c.inverse(c.forward(v)) == v


@SETTINGS
@given(datetimes)
def test_canonical_iso_round_trip(d):
    c = make_conversion("iso8601_to_unix")
    text = iso(d)
    assert c.inverse(c.forward(text)) == text
    ms = make_conversion("iso8601_to_unix", {"unit": "ms"})
    text_ms = iso(d, 3)
    assert ms.inverse(ms.forward(text_ms)) == text_ms


@SETTINGS
@given(datetimes)
def test_forward_agrees_with_datetime(d):
    expected = int(d.replace(tzinfo=UTC, microsecond=0).timestamp())
    assert make_conversion("iso8601_to_unix").forward(iso(d)) == expected


@SETTINGS
@given(st.dates(min_value=dt.date(1, 1, 1), max_value=dt.date(9999, 12, 31)))
def test_date_round_trip(d):
    c = make_conversion("iso8601_to_unix", {"form": "date"})
    assert c.inverse(c.forward(d.isoformat())) == d.isoformat()


@SETTINGS
@given(st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False)))
def test_numbers_as_text_round_trip(v):
    c = make_conversion("number_to_string")
    back = c.inverse(c.forward(v))
    assert back == v and type(back) is type(v)
    s = make_conversion("string_to_number")
    text = c.forward(v)
    assert s.inverse(s.forward(text)) == text  # canonical numerals come back exactly


@SETTINGS
@given(st.integers())
def test_integer_text_round_trip(v):
    c = make_conversion("string_to_number", {"type": "integer"})
    assert c.inverse(c.forward(str(v))) == str(v)


scalars = st.one_of(st.booleans(), st.integers(), st.text(max_size=8), st.none())


@SETTINGS
@given(st.lists(st.tuples(scalars.filter(lambda v: v is not None), scalars.filter(lambda v: v is not None)),
                min_size=1, max_size=8, unique_by=(lambda p: (type(p[0]), p[0]), lambda p: (type(p[1]), p[1]))))
def test_injective_enum_maps_round_trip(pairs):
    c = make_conversion("enum_map", {"pairs": [list(p) for p in pairs]})
    assert c.lossless
    for a, b in pairs:
        assert c.forward(a) == b and type(c.forward(a)) is type(b)
        assert c.inverse(c.forward(a)) == a and type(c.inverse(b)) is type(a)
