"""Tests for extproc.template: the JSON + JSONPath semantic-mapping templates."""

from __future__ import annotations

import copy
import json
import math
import pickle

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.template import (
    MAX_DEPTH,
    MAX_TEMPLATE_BYTES,
    WILDCARD,
    MissingPathError,
    PathRef,
    Template,
    TemplateError,
    compile_template,
    lookup,
    path_text,
)

BRIEF = (
    "# 将LLM输出JSON结构映射为会计凭证schema\n"
    '{"voucher": {"amount": $.output.amount, "account": $.output.account}}'
)
BRIEF_DOC = {"output": {"amount": 12.5, "account": "6001"}}

DOC = {
    "output": {"amount": 12.5, "account": "6001", "memo": None},
    "items": [
        {"sku": "a", "qty": 1, "tags": ["x", "y"]},
        {"sku": "b"},
        {"sku": "c", "qty": 3, "tags": []},
    ],
    "prices": {"a": 1.5, "b": 2, "c": None},
    "数据": {"金额": 100, "科目": "管理费用"},
    "x-y": "dash",
    "a b": {"c'd": 'quote"s'},
    "nested": [[1, 2], [3, 4, 5]],
    "scalar": 7,
    "text": "hello",
}


def render(template: str, doc=DOC):
    return compile_template(template).render(doc)


# --------------------------------------------------------------------------
# The brief, comments, literals
# --------------------------------------------------------------------------


def test_brief_example_with_comment_line():
    tpl = compile_template(BRIEF)
    assert tpl.render(BRIEF_DOC) == {"voucher": {"amount": 12.5, "account": "6001"}}
    assert tpl.render_json(BRIEF_DOC) == b'{"voucher":{"amount":12.5,"account":"6001"}}'
    assert [p.text for p in tpl.paths] == ["$.output.amount", "$.output.account"]
    assert [p.steps for p in tpl.paths] == [("output", "amount"), ("output", "account")]
    assert not any(p.has_default for p in tpl.paths)
    assert tpl.is_literal is False
    assert tpl.source == BRIEF
    assert isinstance(tpl, Template)


def test_brief_key_order_is_source_order():
    out = compile_template('{"b": 1, "a": $.output.amount, "c": [2]}').render(BRIEF_DOC)
    assert list(out) == ["b", "a", "c"]
    assert out == {"b": 1, "a": 12.5, "c": [2]}


def test_trailing_and_interleaved_comments():
    text = (
        "# header\n"
        "{ # open\n"
        '  "a": $.output.amount,  # the amount\n'
        '  # a full-line comment with "quotes" and {braces}\n'
        '  "b": [1, # one\n'
        "        2]\n"
        "} # end"
    )
    assert render(text) == {"a": 12.5, "b": [1, 2]}


def test_hash_inside_strings_is_not_a_comment():
    tpl = compile_template('{"#key": "value # not a comment", "k": $["#x"]}')
    assert tpl.render({"#x": "#"}) == {"#key": "value # not a comment", "k": "#"}


def test_comment_lines_with_crlf_and_cr():
    assert render("# c\r\n$.scalar") == 7
    assert render("# c\r$.scalar # t\r") == 7


def test_literal_template():
    tpl = compile_template('{"a": [1, 2.5, "s", true, false, null], "b": {}}')
    assert tpl.is_literal and tpl.paths == ()
    expected = {"a": [1, 2.5, "s", True, False, None], "b": {}}
    assert tpl.render(None) == expected
    assert tpl.render_json({"ignored": 1}) == orjson.dumps(expected)


@pytest.mark.parametrize(
    "text, value",
    [
        ("0", 0),
        ("-0", 0),
        ("12", 12),
        ("-7", -7),
        ("1.0", 1.0),
        ("1e2", 100.0),
        ("-2.5E-3", -0.0025),
        ("18446744073709551615", 2**64 - 1),
        ("-9223372036854775808", -(2**63)),
    ],
)
def test_numbers_keep_int_and_float(text, value):
    out = render(text)
    assert out == value and type(out) is type(value)


def test_strings_with_all_escapes_and_surrogate_pairs():
    text = r'"q\" b\\ s\/ \b\f\n\r\t \u00e9 \u4e2d \ud83d\ude00"'
    assert render(text) == 'q" b\\ s/ \b\f\n\r\t é 中 😀'


def test_unicode_whitespace_between_tokens():
    text = '\ufeff\u3000{\xa0"a"\u2003:\u2028$.scalar\u3000,\t"b" : 1 }\u3000'
    assert render(text) == {"a": 7, "b": 1}


def test_render_json_keeps_non_ascii_as_utf8():
    tpl = compile_template('{"科目": $.数据.科目, "k": "é"}')
    out = tpl.render_json(DOC)
    assert out == '{"科目":"管理费用","k":"é"}'.encode()
    assert b"\\u" not in out


def test_no_code_execution():
    for text in ("__import__('os')", "$.__class__()", "open('x')", "1 + 1", "$.a if 1 else 2"):
        with pytest.raises(TemplateError):
            compile_template(text)
    # attribute-looking names are plain dictionary keys, never attributes
    assert render("$.__class__", {"__class__": 1}) == 1
    with pytest.raises(MissingPathError):
        render("$.__class__", {})
    with pytest.raises(MissingPathError):
        render("$.upper", "text")


# --------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$", DOC),
        ("$.scalar", 7),
        ("$.output.memo", None),
        ("$.items[0].sku", "a"),
        ("$.items[2].tags", []),
        ("$.items[-1].sku", "c"),
        ("$.items[-3].sku", "a"),
        ("$.nested[1][-1]", 5),
        ("$.nested[-2][0]", 1),
        ("$['items'][1]['sku']", "b"),
        ('$["items"][1]["sku"]', "b"),
        ("$['a b']", {"c'd": 'quote"s'}),
        ("$['a b']['c\\'d']", 'quote"s'),
        ('$["a b"]["c\'d"]', 'quote"s'),
        ("$['a\\u0020b']['c\\u0027d']", 'quote"s'),
        ("$.数据.金额", 100),
        ("$.数据['科目']", "管理费用"),
        ("$.x-y", "dash"),
        ("$.items[*].sku", ["a", "b", "c"]),
        ("$.items[*].qty", [1, 3]),
        ("$.items[*].tags[0]", ["x"]),
        ("$.items[*].missing", []),
        ("$.prices[*]", [1.5, 2, None]),
        ("$.nested[*][1]", [2, 4]),
        ("$.nested[*][*]", [[1, 2], [3, 4, 5]]),
        ("$.nested[*][2]", [5]),
        ("$[*]", list(DOC.values())),
    ],
)
def test_path_steps(text, expected):
    assert render(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "$.nope",
        "$.output.amount.deeper",  # into a number
        "$.text.length",  # into a string
        "$.text[0]",  # index into a string is not a list index
        "$.items.sku",  # key into a list
        "$.prices[0]",  # index into an object
        "$.items[3]",
        "$.items[-4]",
        "$.scalar[*]",  # wildcard over a scalar
        "$.nope[*].sku",
        "$.output.memo.x",  # into a present null
    ],
)
def test_missing_paths_raise(text):
    tpl = compile_template(text)
    with pytest.raises(MissingPathError) as exc:
        tpl.render(DOC)
    assert exc.value.path == text
    assert str(exc.value) == f"path {text} not found in the document"
    assert isinstance(exc.value, LookupError)


def test_wildcard_skips_missing_elements_and_non_containers():
    doc = {"rows": [{"v": 1}, 2, None, {"w": 3}, {"v": None}, [], {"v": {"z": 1}}]}
    assert render("$.rows[*].v", doc) == [1, None, {"z": 1}]
    assert render("$.rows[*].v.z", doc) == [1]
    assert render("$.rows[*][0]", {"rows": [[1], [], "s", [2, 3]]}) == [1, 2]


def test_unicode_names_with_combining_marks():
    doc = {"नाम": "x", "ไทย": 1, "ñame": 2, "é": 3}  # Devanagari/Thai use marks
    assert render("$.नाम", doc) == "x"
    assert render("$.ไทย", doc) == 1
    assert render("$.ñame", doc) == 2
    assert render("$['\\u00e9']", doc) == 3


def test_path_names_are_not_keywords():
    doc = {"true": 1, "null": 2, "0": 3, "-": 4}
    assert render("[$.true, $.null, $.0, $.-]", doc) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "text, canonical, steps",
    [
        ("$", "$", ()),
        ("$.a", "$.a", ("a",)),
        ("$['a']", "$.a", ("a",)),
        ('$["_b1"]', "$._b1", ("_b1",)),
        ("$.数据.金额", "$.数据.金额", ("数据", "金额")),
        ("$.x-y", "$['x-y']", ("x-y",)),
        ("$.0", "$['0']", ("0",)),
        ("$['a b'][0]", "$['a b'][0]", ("a b", 0)),
        ('$["it\'s"]', "$['it\\'s']", ("it's",)),
        ('$["say \\"hi\\""]', "$['say \"hi\"']", ('say "hi"',)),
        ('$["back\\\\slash"]', "$['back\\\\slash']", ("back\\slash",)),
        ('$["nl\\n\\u0001"]', "$['nl\\n\\u0001']", ("nl\n\x01",)),
        ("$[*].a[-2]", "$[*].a[-2]", (WILDCARD, "a", -2)),
        ("$['']", "$['']", ("",)),
    ],
)
def test_canonical_path_text(text, canonical, steps):
    (ref,) = compile_template(text).paths
    assert ref == PathRef(canonical, steps, False)
    assert str(ref) == canonical
    assert path_text(steps) == canonical
    # the canonical text parses back to the same steps
    assert compile_template(canonical).paths[0].steps == steps


def test_paths_in_source_order_including_defaults():
    tpl = compile_template('[$.b ?? $.a ?? 1, {"k": $.c ?? {"d": $.d}}, $.e]')
    assert [(p.text, p.has_default) for p in tpl.paths] == [
        ("$.b", True),
        ("$.a", True),
        ("$.c", True),
        ("$.d", False),
        ("$.e", False),
    ]


# --------------------------------------------------------------------------
# Defaults
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$.nope ?? 0", 0),
        ('$.nope ?? "n/a"', "n/a"),
        ("$.nope ?? null", None),
        ('$.nope ?? {"a": [1]}', {"a": [1]}),
        ("$.nope??[]", []),
        ("$.nope ?? $.scalar", 7),
        ("$.nope ?? $.also_nope ?? $.scalar ?? 0", 7),
        ("$.nope ?? $.also_nope ?? 3", 3),
        ("$.scalar ?? 0", 7),
        ("$.output.memo ?? 1", None),  # present null is not missing
        ("$.items[9] ?? 1", 1),
        ("$.text.x ?? 1", 1),
        ("$.nope[*].x ?? 1", 1),
        ("$.items[*].nope ?? 1", []),  # a wildcard result is present, even if empty
        ('$.nope ?? {"s": $.scalar}', {"s": 7}),
        ("$.nope ?? # comment\n 5", 5),
    ],
)
def test_defaults(text, expected):
    assert render(text) == expected


def test_default_chain_ending_in_path_names_that_path():
    tpl = compile_template("$.a ?? $.b ?? $['c d'][0]")
    assert [p.has_default for p in tpl.paths] == [True, True, False]
    assert tpl.render({"c d": [5]}) == 5
    assert tpl.render({"b": 4, "c d": [5]}) == 4
    with pytest.raises(MissingPathError) as exc:
        tpl.render({})
    assert exc.value.path == "$['c d'][0]"


def test_missing_path_inside_default_value_raises():
    with pytest.raises(MissingPathError) as exc:
        render('$.nope ?? {"x": $.also.nope}')
    assert exc.value.path == "$.also.nope"


def test_missing_error_names_first_missing_path_in_source_order():
    with pytest.raises(MissingPathError) as exc:
        render('{"a": $.scalar, "b": $["no pe"][*], "c": $.nope}')
    assert exc.value.path == "$['no pe'][*]"


# --------------------------------------------------------------------------
# Fresh results
# --------------------------------------------------------------------------


def test_render_returns_fresh_literal_objects():
    tpl = compile_template('{"a": {"b": [1, {"c": 2}]}, "d": [[]], "p": $.scalar}')
    first = tpl.render(DOC)
    first["a"]["b"][1]["c"] = "changed"
    first["a"]["b"].append(9)
    first["d"][0].append(1)
    first["new"] = 1
    assert tpl.render(DOC) == {"a": {"b": [1, {"c": 2}]}, "d": [[]], "p": 7}
    assert tpl.render_json(DOC) == b'{"a":{"b":[1,{"c":2}]},"d":[[]],"p":7}'


def test_fully_literal_container_template_is_fresh():
    tpl = compile_template('[{"a": [1]}]')
    first = tpl.render(None)
    first[0]["a"].append(2)
    assert tpl.render(None) == [{"a": [1]}]


def test_render_does_not_share_objects_with_the_document():
    doc = {"obj": {"list": [1, {"k": "v"}]}, "rows": [{"v": [1]}]}
    snapshot = copy.deepcopy(doc)
    tpl = compile_template('{"o": $.obj, "w": $.rows[*].v, "d": $.nope ?? $.obj.list, "all": $}')
    out = tpl.render(doc)
    out["o"]["list"][1]["k"] = "changed"
    out["w"][0].append(2)
    out["d"].append(3)
    out["all"]["obj"]["x"] = 1
    assert doc == snapshot
    again = tpl.render(doc)
    assert again["o"] == {"list": [1, {"k": "v"}]}
    assert again["o"] is not out["o"]


def test_default_literal_container_is_fresh():
    tpl = compile_template('$.nope ?? {"a": [1]}')
    tpl.render({})["a"].append(2)
    assert tpl.render({}) == {"a": [1]}


# --------------------------------------------------------------------------
# lookup, sentinels, pickling
# --------------------------------------------------------------------------


def test_lookup_helper():
    assert lookup(DOC, ("items", 0, "sku")) == "a"
    assert lookup(DOC, ["items", WILDCARD, "qty"]) == [1, 3]
    assert lookup(DOC, ()) is DOC
    ref = compile_template("$.output['amount']").paths[0]
    assert lookup(DOC, ref) == 12.5
    with pytest.raises(MissingPathError) as exc:
        lookup(DOC, ("items", -9, "a b"))
    assert exc.value.path == "$.items[-9]['a b']"
    with pytest.raises(TypeError):
        lookup(DOC, (1.5,))


def test_wildcard_is_a_singleton_and_errors_pickle():
    assert copy.deepcopy(WILDCARD) is WILDCARD
    assert pickle.loads(pickle.dumps(WILDCARD)) is WILDCARD
    ref = compile_template("$[*]").paths[0]
    assert copy.deepcopy(ref).steps[0] is WILDCARD
    err = pickle.loads(pickle.dumps(TemplateError("boom", 2, 3)))
    assert (err.message, err.line, err.column) == ("boom", 2, 3)
    assert str(err) == "line 2, column 3: boom"
    miss = pickle.loads(pickle.dumps(MissingPathError("$.a")))
    assert miss.path == "$.a" and str(miss) == "path $.a not found in the document"


def test_template_text_must_be_str():
    with pytest.raises(TypeError):
        compile_template(b"{}")  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Compile errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line, column, fragment",
    [
        (
            '# comment\n{"voucher": {"amount": 1,"x":2]}',
            2,
            31,
            "expected ',' or '}' after object member, found ']'",
        ),
        ('[ "abc', 1, 3, "unterminated string"),
        ('{"a": "abc\n"}', 1, 7, "unterminated string"),
        ("$.a.", 1, 5, "invalid path step after '$.a': expected a name, '[' index or key"),
        ("$.a.+", 1, 5, "invalid path step after '$.a': expected a name, '[' index or key"),
        ("1\n\n2", 3, 1, "unexpected trailing content after the template value"),
        ("", 1, 1, "empty template"),
        ("  # only a comment\n\t", 1, 1, "empty template"),
        ('{"a": 1,}', 1, 8, "trailing comma before '}' is not allowed"),
        ("[1, 2,\n]", 1, 6, "trailing comma before ']' is not allowed"),
        ('{"a" 1}', 1, 6, "expected ':' after object key, found '1'"),
        ("{a: 1}", 1, 2, "expected a string key, found 'a'"),
        ("{'a': 1}", 1, 2, "object keys must use double quotes"),
        ("'a'", 1, 1, "single-quoted strings are only allowed in path keys"),
        ('{"a": 1', 1, 8, "found end of template (the '{' at line 1, column 1 is never closed)"),
        ("[1 2]", 1, 4, "expected ',' or ']' after array element, found '2'"),
        ('"tab\there"', 1, 5, "control character U+0009 must be escaped"),
        ('"\\x"', 1, 2, "invalid escape '\\x' in string"),
        ('"\\\'"', 1, 2, "invalid escape '\\'' in string"),
        ('"\\u12"', 1, 2, "invalid \\u escape: expected 4 hex digits"),
        ('"\\ud83d"', 1, 2, "high surrogate \\ud83d is not followed by a low surrogate"),
        ('"\\ude00"', 1, 2, "lone low surrogate"),
        ("01", 1, 1, "invalid number '01'"),
        ("1.", 1, 1, "invalid number '1.'"),
        (".5", 1, 1, "expected a value, found '.'"),
        ("+1", 1, 1, "expected a value, found '+'"),
        ("NaN", 1, 1, "unknown word 'NaN'"),
        ("-Infinity", 1, 1, "invalid number '-Infinity'"),
        ("1e400", 1, 1, "number 1e400 is out of range"),
        # found by tests/fuzz/test_fuzz_templates.py: these compiled, then render_json raised
        # orjson.JSONEncodeError on every request (the JSON output has 64-bit integers)
        ("18446744073709551616", 1, 1, "integer 18446744073709551616 is out of range (-2^63 to 2^64-1)"),
        ('{"a": [1, -9223372036854775809]}', 1, 11, "integer -9223372036854775809 is out of range"),
        ("123456789012345678901234567890", 1, 1, "is out of range"),
        ("True", 1, 1, "unknown word 'True'"),
        ("nul", 1, 1, "unknown word 'nul'"),
        ("$a", 1, 2, "invalid path step after '$': expected '.' or '[' before 'a'"),
        ("$.a$", 1, 4, "invalid path step after '$.a': expected '.' or '['"),
        ("$[x]", 1, 3, "after '$': expected an integer index, '*' or a quoted key"),
        ("$.a[]", 1, 5, "invalid path step after '$.a'"),
        ("$.a[0", 1, 6, "expected ']' to close the '[' step after '$.a', found end of template"),
        ("$.a[*x]", 1, 6, "expected ']' to close the '[' step after '$.a', found 'x'"),
        ("$['a'", 1, 6, "expected ']'"),
        ("$['a]", 1, 3, "unterminated string"),
        ("$[01]", 1, 3, "invalid index '01': leading zeros are not allowed"),
        ("$[-]", 1, 4, "expected digits after '-'"),
        ("$[1.5]", 1, 4, "expected ']'"),
        ("$.a .b", 1, 4, "whitespace is not allowed inside a path"),
        ("$.a [0]", 1, 4, "whitespace is not allowed inside a path"),
        ("$.a ?? ", 1, 8, "expected a default value after '??'"),
        ("$.a ?", 1, 5, "expected '??'"),
        ("1 ?? 2", 1, 3, "a default ('??') may only follow a path"),
        ("$.a ?? 1 ?? 2", 1, 10, "a default ('??') may only follow a path"),
        ('{"a": 1, "b": 2, "a": 3}', 1, 18, 'duplicate key "a" in object (first at line 1, col'),
        ('{"a": 1,\n "\\u0061": 2}', 2, 2, 'duplicate key "a"'),
        ("@", 1, 1, "expected a value, found '@'"),
        ('{"a": }', 1, 7, "expected a value, found '}'"),
        ('{"a":', 1, 6, "unexpected end of template, expected a value"),
        ("{}}", 1, 3, "unexpected trailing content"),
        ('"ok"\n\u3000x', 2, 2, "unexpected trailing content"),
        ("\u00a0\u00a0\x01", 1, 3, "expected a value, found U+0001"),
    ],
)
def test_compile_errors(text, line, column, fragment):
    with pytest.raises(TemplateError) as exc:
        compile_template(text)
    err = exc.value
    assert fragment in err.message, err.message
    assert (err.line, err.column) == (line, column), str(err)
    assert str(err) == f"line {line}, column {column}: {err.message}"
    assert isinstance(err, ValueError)


def test_exact_error_strings_from_the_brief():
    cases = {
        '# c\n{"voucher": {"amount": 1,"x":2]}': (
            "line 2, column 31: expected ',' or '}' after object member, found ']'"
        ),
        '[ "abc': "line 1, column 3: unterminated string",
        "$.a.": (
            "line 1, column 5: invalid path step after '$.a': expected a name, '[' index or key"
        ),
        "1\n\n2": "line 3, column 1: unexpected trailing content after the template value",
        "": "line 1, column 1: empty template",
    }
    for text, message in cases.items():
        with pytest.raises(TemplateError) as exc:
            compile_template(text)
        assert str(exc.value) == message


def test_error_lines_count_comment_lines():
    text = "# one\n# two\n{\n  # four\n  \"a\": $.b.,\n}"
    with pytest.raises(TemplateError) as exc:
        compile_template(text)
    assert (exc.value.line, exc.value.column) == (5, 12)


def test_depth_limit():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert compile_template(ok).render(None) == json.loads(ok)
    objs = '{"a":' * MAX_DEPTH + "1" + "}" * MAX_DEPTH
    assert compile_template(objs).render(None) == json.loads(objs)
    with pytest.raises(TemplateError) as exc:
        compile_template("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert (exc.value.line, exc.value.column) == (1, MAX_DEPTH + 1)
    assert "nesting deeper than 64 levels" in exc.value.message
    mixed = '{"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}"
    with pytest.raises(TemplateError, match="nesting deeper"):
        compile_template(mixed)


def test_long_default_chain_does_not_recurse():
    text = " ?? ".join(f"$.k{i}" for i in range(5000)) + " ?? 42"
    assert len(text.encode()) < MAX_TEMPLATE_BYTES
    tpl = compile_template(text)
    assert tpl.render({}) == 42
    assert tpl.render({"k4999": "last"}) == "last"
    assert len(tpl.paths) == 5000


def test_size_limit():
    body = '"' + "a" * (MAX_TEMPLATE_BYTES - 2) + '"'
    assert len(body) == MAX_TEMPLATE_BYTES
    assert compile_template(body).render(None) == "a" * (MAX_TEMPLATE_BYTES - 2)
    with pytest.raises(TemplateError) as exc:
        compile_template(body + " ")
    assert "over the 65536-byte limit" in exc.value.message
    assert (exc.value.line, exc.value.column) == (1, MAX_TEMPLATE_BYTES + 1)
    # the limit is in UTF-8 bytes, not characters
    wide = '"' + "中" * (MAX_TEMPLATE_BYTES // 3) + '"'
    assert len(wide) < MAX_TEMPLATE_BYTES
    with pytest.raises(TemplateError, match="byte limit"):
        compile_template(wide)


# --------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # the integer literals a template takes
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=json_values,
    ascii_only=st.booleans(),
    indent=st.sampled_from([None, 1, "\t"]),
    doc=json_values,
)
def test_any_json_document_is_a_literal_template(value, ascii_only, indent, doc):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    tpl = compile_template(text)
    assert tpl.is_literal and tpl.paths == ()
    out = tpl.render(doc)
    assert out == value
    # ints stay ints, floats stay floats
    if isinstance(value, float):
        assert type(out) is float and math.copysign(1, out) == math.copysign(1, value)
    elif isinstance(value, int):
        assert type(out) is type(value)


def _paths_into(value, prefix=()):
    """Every (steps, sub-value) reachable from ``value`` by keys and indices >= 0."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths_into(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths_into(v, prefix + (i,))


def _spell(steps, data):
    """Spell ``steps`` as path text, choosing among the equivalent spellings."""
    out = "$"
    for s in steps:
        if isinstance(s, int):
            out += f"[{s}]"
            continue
        choice = data.draw(st.integers(0, 2))
        if choice == 0:
            out += "[" + json.dumps(s, ensure_ascii=data.draw(st.booleans())) + "]"
        elif choice == 1:
            inner = json.dumps(s)[1:-1].replace('\\"', '"').replace("'", "\\'")
            out += "['" + inner + "']"
        else:
            out += path_text((s,))[1:]
    return out


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(doc=st.dictionaries(st.text(), json_values, min_size=1, max_size=6), data=st.data())
def test_existing_paths_render_their_value(doc, data):
    candidates = [p for p in _paths_into(doc) if p[0]]
    steps, expected = data.draw(st.sampled_from(candidates))
    # spell some list indices from the end: the same element, a negative index
    steps = tuple(
        s - len(lookup(doc, steps[:i])) if isinstance(s, int) and data.draw(st.booleans()) else s
        for i, s in enumerate(steps)
    )
    text = _spell(steps, data)
    tpl = compile_template(text)
    assert tpl.paths[0].text == path_text(tuple(steps))
    out = tpl.render(doc)
    assert out == expected
    assert lookup(doc, steps) == expected
    if isinstance(out, (dict, list)) and out:
        assert out is not expected  # a copy, not the document's object
    assert compile_template(text + ' ?? "default"').render(doc) == expected
