"""Fuzz target `templates`: random template sources rendered against random documents.

What: sources come from the template grammar (objects, arrays, literals, paths with every step kind,
`??` defaults, comments, Unicode), then are mutated (a character deleted, inserted or swapped, cut
short) or are plain random text over the characters the grammar gives meaning to, plus injection
payloads (Python, Jinja, shell); documents are random JSON values and documents shaped like the
template's own paths.
Properties, per case:
- `compile_template` returns a `Template` or raises `TemplateError` with a 1-based line and column
  inside the text and a non-empty reason; nothing else;
- `render` and `render_json` return or raise `MissingPathError` naming a path; nothing else;
  `render` gives only JSON values and `render_json` is exactly `orjson.dumps(render(doc))`;
- no code is executed: no `exec`, `compile`, `import`, `open`, `os.system` or `subprocess` audit
  event (`sys.addaudithook`) fires while compiling or rendering;
- the case ends within `CASE_LIMIT_S`.
Cost: about 0.5 to 2 ms per case, mostly hypothesis's generation.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import orjson
from hypothesis import given
from hypothesis import strategies as st

from extproc.template import MissingPathError, Template, TemplateError, compile_template
from tests.fuzz.harness import SUITE, Finding, refusal_class, time_limit

# --- strategies ---------------------------------------------------------------------------------------

name_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
simple_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,6}", fullmatch=True) | st.sampled_from(
    ["金额", "科目", "é", "a\u0301", "__class__", "__import__", "0", "-"])


def _quoted_key(key: str, quote: str) -> str:
    body = json.dumps(key)[1:-1]
    return quote + (body.replace("'", "\\'") if quote == "'" else body) + quote


# strategies built once (building one per draw costs more than the draw)
_STEP_KINDS = st.sampled_from(["name", "index", "star", "key"])
_INDEX = st.integers(-3, 3) | st.integers(-2**70, 2**70)
_QUOTES = st.sampled_from(["'", '"'])


@st.composite
def path_src(draw) -> str:
    steps = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(_STEP_KINDS)
        if kind == "name":
            steps.append("." + draw(simple_name))
        elif kind == "index":
            steps.append(f"[{draw(_INDEX)}]")
        elif kind == "star":
            steps.append("[*]")
        else:
            steps.append("[" + _quoted_key(draw(name_text), draw(_QUOTES)) + "]")
    return "$" + "".join(steps)


literal_src = st.one_of(
    st.sampled_from(["true", "false", "null", "0", "-0", "1.5e3", "-12", "1e400", "01", "1.", ".5", "NaN",
                     "Infinity", "18446744073709551615", "18446744073709551616", "-9223372036854775808",
                     "-9223372036854775809", "123456789012345678901234567890"]),
    st.integers(-2**70, 2**70).map(str), st.floats(allow_nan=False, allow_infinity=False).map(repr),
    name_text.map(json.dumps), name_text.map(lambda t: json.dumps(t, ensure_ascii=False)))

value_src = st.recursive(
    literal_src | path_src(),
    lambda c: st.one_of(
        st.lists(c, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(name_text.map(json.dumps), c), max_size=4).map(
            lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"),
        st.tuples(path_src(), c).map(lambda pv: f"{pv[0]} ?? {pv[1]}"),
        st.tuples(path_src(), path_src(), c).map(lambda t: f"{t[0]} ?? {t[1]} ?? {t[2]}")),
    max_leaves=10)

PAYLOADS = ["__import__('os').system('true')", "{{7*7}}", "${7*7}", "`id`", "$(id)", "eval('1')",
            "exec('x=1')", "open('/etc/passwd')", "$.__class__.__mro__", "$['__globals__']", "lambda: 0",
            "\u202e", "\x00", "#{7*7}", "$..a", "$.a()", "$.a.b(1)"]
SIGNIFICANT = "{}[]$.?*'\"\\#,: \t\n\r-0123456789aetrunlfx_\u00e9\u0301\u3000\u2028"


_EDITS = st.sampled_from(["delete", "insert", "swap", "cut", "payload"])
_SIGNIFICANT_CHAR = st.sampled_from(SIGNIFICANT)
_PAYLOAD = st.sampled_from(PAYLOADS)
_SOURCES = st.sampled_from(["grammar", "grammar", "mutated", "mutated", "random", "payload"])
_RANDOM_TEXT = st.text(_SIGNIFICANT_CHAR, max_size=40)
_PREFIXES = st.sampled_from(["# 将LLM输出JSON结构映射为会计凭证schema\n", "  ", "\u3000", "# c\r\n"])


@st.composite
def mutate(draw, src: str) -> str:
    for _ in range(draw(st.integers(0, 3))):
        how = draw(_EDITS)
        i = draw(st.integers(0, len(src)))
        if how == "delete" and src:
            src = src[:max(i - 1, 0)] + src[i:]
        elif how == "insert":
            src = src[:i] + draw(_SIGNIFICANT_CHAR) + src[i:]
        elif how == "swap" and len(src) > 1:
            j = min(i, len(src) - 2)
            src = src[:j] + src[j + 1] + src[j] + src[j + 2:]
        elif how == "cut":
            src = src[:i]
        elif how == "payload":
            src = src[:i] + draw(_PAYLOAD) + src[i:]
    return src


@st.composite
def template_src(draw) -> str:
    how = draw(_SOURCES)
    if how == "random":
        return draw(_RANDOM_TEXT)
    if how == "payload":
        return draw(_PAYLOAD)
    src = draw(value_src)
    if draw(st.booleans()):
        src = draw(_PREFIXES) + src
    return draw(mutate(src)) if how == "mutated" else src


doc_scalar = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False,
                                                                                  allow_infinity=False) | name_text
doc_value = st.recursive(doc_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(simple_name | name_text, c,
                                                                                          max_size=4), max_leaves=16)


@dataclass(frozen=True)
class TemplateCase:
    source: str
    doc: object


@st.composite
def template_cases(draw) -> TemplateCase:
    src = draw(template_src())
    doc = draw(doc_value)
    if draw(st.booleans()):  # a document with the keys the template names, so its paths resolve
        try:
            tpl = compile_template(src)
        except (TemplateError, TypeError):
            tpl = None
        if tpl is not None:
            doc = {}
            for ref in tpl.paths:
                cur = doc
                for i, step in enumerate(ref.steps):
                    if not isinstance(step, str) or not isinstance(cur, dict):
                        break
                    nxt = ref.steps[i + 1] if i + 1 < len(ref.steps) else None
                    cur = cur.setdefault(step, draw(doc_value) if nxt is None else
                                         ({} if isinstance(nxt, str) else draw(st.lists(doc_value, max_size=3))))
    return TemplateCase(src, doc)


CASES = template_cases()


# --- the properties -----------------------------------------------------------------------------------

_FORBIDDEN = {"exec", "compile", "import", "open", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
              "subprocess.Popen", "ctypes.dlopen", "socket.connect", "builtins.input"}


class _Audit:
    """A `sys.addaudithook` hook (hooks cannot be removed): records forbidden events while armed."""

    def __init__(self):
        self.armed = False
        self.events: list[str] = []
        sys.addaudithook(self)

    def __call__(self, event: str, args) -> None:
        if self.armed and event in _FORBIDDEN:
            self.events.append(event)


_audit: list[_Audit] = []


def _auditor() -> _Audit:
    if not _audit:
        _audit.append(_Audit())
    return _audit[0]


def _json_only(v, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_json_only(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_only(x, depth + 1) for k, x in v.items())
    return False


def check(case: TemplateCase) -> str | None:
    audit = _auditor()
    audit.events.clear()
    refusal = None
    with time_limit():
        audit.armed = True
        try:
            try:
                tpl = compile_template(case.source)
            except TemplateError as e:
                lines = case.source.count("\n") + case.source.count("\r") + 1
                if not (e.line >= 1 and e.column >= 1 and e.line <= lines + 1 and e.message.strip()):
                    raise Finding(f"TemplateError without a usable position or reason: {e!r}") from None
                refusal = "compile: " + refusal_class(e.message)
                tpl = None
            if tpl is not None:
                if not isinstance(tpl, Template):
                    raise Finding(f"compile_template returned {type(tpl).__name__}")
                try:
                    out = tpl.render(case.doc)
                except MissingPathError as e:
                    if "$" not in str(e):
                        raise Finding(f"MissingPathError without a path: {e!r}") from None
                    refusal = "render: missing path"
                    out = None
                else:
                    if not _json_only(out):
                        raise Finding(f"render gave a value that is not JSON: {out!r}")
                if refusal is None:
                    data = tpl.render_json(case.doc)
                    if data != orjson.dumps(out):
                        raise Finding(f"render_json {data!r} is not orjson.dumps(render) {orjson.dumps(out)!r}")
        finally:
            audit.armed = False
    if audit.events:
        raise Finding(f"compiling or rendering raised audit events {sorted(set(audit.events))}")
    return refusal


@SUITE
@given(CASES)
def test_templates_compile_or_refuse_with_a_position_and_render_or_miss(case):
    check(case)
