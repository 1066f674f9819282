"""Semantic-mapping templates: JSON with embedded JSONPath expressions.

What: a small, safe template language that maps one JSON document (for
example an LLM's structured output) to another (for example an accounting
voucher schema)::

    # 将LLM输出JSON结构映射为会计凭证schema
    {"voucher": {"amount": $.output.amount, "account": $.output.account}}

rendered against ``{"output": {"amount": 12.5, "account": "6001"}}`` gives
``{"voucher": {"amount": 12.5, "account": "6001"}}``.

Why: templates come from configuration, so they are *data*. They are parsed
and compiled once, at config load, into nested closures over precomputed
structures; nothing in a template is ever evaluated or executed as code (no
``eval``/``exec``, no attribute access, no function calls). A malformed
template fails at load with the exact line and column, never at request time.

Grammar (informal)::

    template := value                      # surrounded by whitespace/comments
    value    := object | array | string | number | true | false | null
              | path ("??" value)?         # default; chains right-assoc
    path     := "$" step*                  # no whitespace inside a path
    step     := "." name                   # name: letters, digits, marks, _ -
              | "[" integer "]"            # index; negative counts from the end
              | "[" "*" "]"                # wildcard over array items / object values
              | "[" quoted-key "]"         # '...' or "..." with JSON escapes, \\' too

* Objects, arrays, strings and numbers are strict JSON (RFC 8259): no
  trailing commas, duplicate keys are an error, integers stay ``int``,
  other numbers are ``float`` (non-finite ones are rejected).
* ``#`` starts a comment that runs to the end of the line (outside strings).
* Between tokens any Unicode whitespace is allowed.
* A path is *missing* when a key is absent, an index is out of range, or a
  step goes into a value of the wrong kind. A present ``null`` is not
  missing. A missing path takes its default (``$.a ?? $.b ?? null``); with no
  default, rendering raises `MissingPathError`. After a ``[*]`` the rest of
  the path is applied to each element, elements where it is missing are
  skipped, and the result is a list.
* Limits: 64 KiB of template text (UTF-8), 64 levels of object/array nesting,
  integer literals from -2^63 to 2^64-1 (what the JSON output can hold).

Cost: `compile_template` is O(template size) and runs once. `Template.render`
does no parsing; it is O(size of the output): literal parts are prebuilt
(copied with ``dict.copy``/``list.copy``), paths are a few dictionary or list
subscripts, and JSON containers taken from the document are deep-copied so
the result is always fresh. `Template.render_json` skips those copies (orjson
only reads) and returns a precomputed ``bytes`` for literal-only templates.
Rendering the example above takes about a microsecond (run this module as a
script for the micro-benchmark).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable

import orjson

# Defined beside the backend adapters, which catch it without importing the processor (backends/base.py);
# re-exported here as this module's render-time error: `extproc.template.MissingPathError` is that class.
from backends.base import MissingPathError

__all__ = [
    "MAX_DEPTH",
    "MAX_TEMPLATE_BYTES",
    "WILDCARD",
    "MissingPathError",
    "PathRef",
    "Template",
    "TemplateError",
    "compile_template",
    "lookup",
    "path_text",
]

MAX_TEMPLATE_BYTES = 64 * 1024
MAX_DEPTH = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # integer literals: what orjson can write


# --------------------------------------------------------------------------
# Public values and errors
# --------------------------------------------------------------------------


class _Wildcard:
    """Type of the `WILDCARD` step sentinel; a singleton even across copy/pickle."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WILDCARD"

    def __reduce__(self) -> str:
        return "WILDCARD"

    def __copy__(self) -> _Wildcard:
        return self

    def __deepcopy__(self, memo: dict) -> _Wildcard:
        return self


WILDCARD = _Wildcard()
"""The ``[*]`` step in `PathRef.steps`; compare with ``is``."""


class TemplateError(ValueError):
    """A template failed to compile.

    ``line`` and ``column`` are 1-based positions in the template text
    (comment lines count; columns count code points). Raised only by
    `compile_template`, i.e. at config load, never while rendering.
    """

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"line {line}, column {column}: {message}")
        self.message = message
        self.line = line
        self.column = column

    def __reduce__(self):
        return (type(self), (self.message, self.line, self.column))


@dataclass(frozen=True)
class PathRef:
    """One path expression of a template.

    ``steps`` holds ``str`` (object key), ``int`` (list index) or `WILDCARD`;
    ``text`` is their canonical spelling; ``has_default`` tells whether the
    path is followed by ``??``.
    """

    text: str
    steps: tuple
    has_default: bool

    def __str__(self) -> str:
        return self.text


class _Missing(Exception):
    """Internal, cheap signal that a path resolved to nothing."""


# --------------------------------------------------------------------------
# Canonical path text
# --------------------------------------------------------------------------

_SIMPLE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# \w on str patterns is str.isalnum() or "_"; combining marks are added by hand.
_NAME_RE = re.compile(r"[\w\-]+")
_KEY_ESCAPE_RE = re.compile(r"[\\'\x00-\x1f]")
_KEY_ESCAPES = MappingProxyType(
    {"\\": "\\\\", "'": "\\'", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
)


def _is_name_char(c: str) -> bool:
    """Whether ``c`` may appear in a ``.name`` step: letters, digits, marks, ``_``, ``-``."""
    return c.isalnum() or c == "_" or c == "-" or unicodedata.category(c)[0] == "M"


def _escape_key_char(m: re.Match) -> str:
    c = m.group()
    return _KEY_ESCAPES.get(c) or f"\\u{ord(c):04x}"


def _step_text(step: Any) -> str:
    if step is WILDCARD:
        return "[*]"
    if type(step) is int:
        return f"[{step}]"
    if _SIMPLE_NAME_RE.match(step) or (
        step.isidentifier() and all(map(_is_name_char, step))
    ):
        return "." + step
    return "['" + _KEY_ESCAPE_RE.sub(_escape_key_char, step) + "']"


def path_text(steps: Iterable) -> str:
    """Canonical text of a path: ``$`` then ``.name``, ``['key']``, ``[n]``, ``[*]``.

    ``.name`` is used when the key is an identifier made of name characters
    (so the text parses back to the same steps); other keys are single-quoted
    with JSON escapes plus ``\\'``. Cost: O(path length).
    """
    return "$" + "".join(map(_step_text, steps))


# --------------------------------------------------------------------------
# Path resolution (render time)
# --------------------------------------------------------------------------

_CONTAINERS = (dict, list, tuple)
_SEQUENCES = (list, tuple)


def _copy(v: Any) -> Any:
    """Deep copy of a JSON value (tuples become lists). O(size of ``v``)."""
    if isinstance(v, dict):
        return {k: _copy(x) if isinstance(x, _CONTAINERS) else x for k, x in v.items()}
    if isinstance(v, _SEQUENCES):
        return [_copy(x) if isinstance(x, _CONTAINERS) else x for x in v]
    return v


def _walk(cur: Any, steps: tuple, i: int) -> Any:
    """Resolve ``steps[i:]`` from ``cur``; raise `_Missing`. Returns document objects."""
    n = len(steps)
    while i < n:
        s = steps[i]
        t = s.__class__
        if t is str:
            try:
                cur = cur[s]  # TypeError: a list, string, number... is not an object
            except (KeyError, TypeError):
                raise _Missing from None
        elif t is int:
            if not isinstance(cur, _SEQUENCES):
                raise _Missing
            try:
                cur = cur[s]
            except IndexError:
                raise _Missing from None
        else:  # WILDCARD
            if isinstance(cur, dict):
                elems = cur.values()
            elif isinstance(cur, _SEQUENCES):
                elems = cur
            else:
                raise _Missing
            i += 1
            if i == n:
                return list(elems)
            out = []
            for e in elems:
                try:
                    out.append(_walk(e, steps, i))
                except _Missing:
                    pass
            return out
        i += 1
    return cur


def lookup(doc: Any, steps: Iterable | PathRef) -> Any:
    """Resolve a path's ``steps`` (or a `PathRef`) in ``doc``.

    Returns the document's own object (not a copy; wildcard lists are new
    lists of document objects). Raises `MissingPathError` naming the
    canonical path when it is missing. Cost: O(path length), times the
    elements visited after a wildcard.
    """
    if isinstance(steps, PathRef):
        text: str | None = steps.text
        steps = steps.steps
    else:
        text = None
        steps = tuple(steps)
        for s in steps:
            if not (s is WILDCARD or type(s) is int or isinstance(s, str)):
                raise TypeError(f"path step must be str, int or WILDCARD, not {type(s).__name__}")
        steps = tuple(s if s is WILDCARD or type(s) is int else str(s) for s in steps)
    try:
        return _walk(doc, steps, 0)
    except _Missing:
        raise MissingPathError(text or path_text(steps)) from None


# --------------------------------------------------------------------------
# Parser (compile time)
# --------------------------------------------------------------------------

# Parsed nodes are tuples: ("lit", scalar) | ("obj", ((key, node), ...), literal)
# | ("arr", (node, ...), literal) | ("path", PathRef)
# | ("chain", (PathRef with default, ...), last) where last is a node, or None
#   when the chain ends in a path without a default (the last ref).

_SKIP_RE = re.compile(r"(?:\s+|#[^\n\r]*)*")  # \s is str.isspace(): all Unicode whitespace
_NEWLINE_RE = re.compile(r"\r\n?|\n")
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_JUNK_RE = re.compile(r"[\w.+\-]*")
_WORD_RE = re.compile(r"\w+")
_INDEX_RE = re.compile(r"-?[0-9]+")
_HEX4_RE = re.compile(r"[0-9a-fA-F]{4}")
_DQ_PLAIN_RE = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]*')
_SQ_PLAIN_RE = re.compile(r"[^'\\\x00-\x1f\ud800-\udfff]*")
_ESCAPES = MappingProxyType(
    {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
)
_WORDS = MappingProxyType({"true": True, "false": False, "null": None})


def _line_col(text: str, pos: int) -> tuple[int, int]:
    """1-based line and column of ``pos``; lines end at LF, CRLF or CR."""
    line, start = 1, 0
    for m in _NEWLINE_RE.finditer(text, 0, pos):
        line += 1
        start = m.end()
    return line, pos - start + 1


class _Parser:
    """Recursive-descent parser; one instance per `compile_template` call."""

    __slots__ = ("text", "n", "pos", "depth", "paths")

    def __init__(self, text: str) -> None:
        self.text = text
        self.n = len(text)
        self.pos = 0
        self.depth = 0
        self.paths: list[PathRef] = []

    # -- helpers -----------------------------------------------------------

    def error(self, message: str, pos: int) -> TemplateError:
        line, col = _line_col(self.text, pos)
        return TemplateError(message, line, col)

    def describe(self, pos: int, opener: int | None = None) -> str:
        """Human name of the character at ``pos`` for 'found ...' messages."""
        if pos >= self.n:
            if opener is not None:
                line, col = _line_col(self.text, opener)
                return (
                    f"end of template (the '{self.text[opener]}' at line {line}, "
                    f"column {col} is never closed)"
                )
            return "end of template"
        c = self.text[pos]
        if c in "\n\r":
            return "end of line"
        if c == "'":
            return "\"'\""
        if c.isprintable() and not c.isspace():
            return f"'{c}'"
        return f"U+{ord(c):04X}"

    def skip(self) -> None:
        self.pos = _SKIP_RE.match(self.text, self.pos).end()

    # -- values ------------------------------------------------------------

    def template(self) -> tuple:
        text = self.text
        if text.startswith("\ufeff"):
            self.pos = 1
        self.skip()
        if self.pos >= self.n:
            raise self.error("empty template", 0)
        node = self.value()
        self.skip()
        if self.pos < self.n:
            raise self.error("unexpected trailing content after the template value", self.pos)
        return node

    def value(self) -> tuple:
        text, pos = self.text, self.pos
        if pos >= self.n:
            raise self.error("unexpected end of template, expected a value", pos)
        c = text[pos]
        if c == "$":
            return self.chain()
        if c == "{":
            node = self.obj()
        elif c == "[":
            node = self.arr()
        elif c == '"':
            node = ("lit", self.string('"', in_path=False))
        elif c == "-" or "0" <= c <= "9":
            node = ("lit", self.number())
        elif c == "'":
            raise self.error(
                "single-quoted strings are only allowed in path keys like $['key']; "
                "use double quotes",
                pos,
            )
        elif c == "_" or c.isalnum():
            word = _WORD_RE.match(text, pos).group()
            if word not in _WORDS:
                raise self.error(
                    f"unknown word '{word}': expected a value (object, array, string, "
                    "number, true, false, null or a $ path)",
                    pos,
                )
            self.pos = pos + len(word)
            node = ("lit", _WORDS[word])
        else:
            raise self.error(f"expected a value, found {self.describe(pos)}", pos)
        after = _SKIP_RE.match(text, self.pos).end()
        if text.startswith("??", after):
            raise self.error("a default ('??') may only follow a path", after)
        return node

    def chain(self) -> tuple:
        """``path ("??" value)?``, with the right-assoc chain parsed iteratively."""
        text = self.text
        refs: list[PathRef] = []
        while True:
            start = self.pos
            steps = self.path()
            end = self.pos
            after = _SKIP_RE.match(text, end).end()
            if text.startswith("??", after):
                ref = PathRef(path_text(steps), steps, True)
                self.paths.append(ref)
                refs.append(ref)
                self.pos = after + 2
                self.skip()
                if self.pos < self.n and text[self.pos] == "$":
                    continue
                if self.pos >= self.n:
                    raise self.error("expected a default value after '??'", self.pos)
                return ("chain", tuple(refs), self.value())
            if after < self.n:
                c = text[after]
                if after > end and c in ".[":
                    raise self.error(
                        f"whitespace is not allowed inside a path (after '{text[start:end]}')",
                        end,
                    )
                if c == "?":
                    raise self.error(
                        "expected '??' (a default) after the path, found a single '?'", after
                    )
            ref = PathRef(path_text(steps), steps, False)
            self.paths.append(ref)
            if refs:
                refs.append(ref)
                return ("chain", tuple(refs), None)
            return ("path", ref)

    def path(self) -> tuple:
        """``"$" step*`` starting at ``self.pos``; returns the steps."""
        text, n = self.text, self.n
        i = self.pos + 1
        steps: list = []
        while i < n:
            c = text[i]
            if c == ".":
                j = i + 1
                while True:
                    m = _NAME_RE.match(text, j)
                    if m:
                        j = m.end()
                    if j < n and unicodedata.category(text[j])[0] == "M":
                        j += 1
                        continue
                    break
                if j == i + 1:
                    raise self.error(
                        f"invalid path step after '{path_text(steps)}': "
                        "expected a name, '[' index or key",
                        j,
                    )
                steps.append(text[i + 1 : j])
                i = j
            elif c == "[":
                j = i + 1
                c2 = text[j] if j < n else ""
                if c2 == "*":
                    steps.append(WILDCARD)
                    j += 1
                elif c2 == '"' or c2 == "'":
                    self.pos = j
                    steps.append(self.string(c2, in_path=True))
                    j = self.pos
                elif c2 == "-" or "0" <= c2 <= "9":
                    m = _INDEX_RE.match(text, j)
                    if m is None:
                        raise self.error(
                            f"invalid index after '{path_text(steps)}': expected digits after '-'",
                            j + 1,
                        )
                    tok = m.group()
                    digits = tok.lstrip("-")
                    if len(digits) > 1 and digits[0] == "0":
                        raise self.error(
                            f"invalid index '{tok}': leading zeros are not allowed", j
                        )
                    steps.append(int(tok))
                    j = m.end()
                else:
                    raise self.error(
                        f"invalid path step after '{path_text(steps)}': expected an integer "
                        "index, '*' or a quoted key after '['",
                        j,
                    )
                if j >= n or text[j] != "]":
                    raise self.error(
                        f"expected ']' to close the '[' step after '{path_text(steps[:-1])}', "
                        f"found {self.describe(j)}",
                        j,
                    )
                i = j + 1
            elif c == "$" or _is_name_char(c):
                raise self.error(
                    f"invalid path step after '{path_text(steps)}': "
                    f"expected '.' or '[' before {self.describe(i)}",
                    i,
                )
            else:
                break
        self.pos = i
        return tuple(steps)

    def enter(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nesting deeper than {MAX_DEPTH} levels", pos)

    def obj(self) -> tuple:
        text = self.text
        open_pos = self.pos
        self.enter(open_pos)
        self.pos += 1
        self.skip()
        items: list = []
        seen: dict[str, int] = {}
        if self.pos < self.n and text[self.pos] == "}":
            self.pos += 1
            self.depth -= 1
            return ("obj", (), True)
        comma = -1
        while True:
            pos = self.pos
            c = text[pos] if pos < self.n else ""
            if c != '"':
                if c == "}" and comma >= 0:
                    raise self.error("trailing comma before '}' is not allowed", comma)
                if c == "'":
                    raise self.error("object keys must use double quotes", pos)
                raise self.error(
                    f"expected a string key, found {self.describe(pos, open_pos)}", pos
                )
            key = self.string('"', in_path=False)
            if key in seen:
                line, col = _line_col(text, seen[key])
                raise self.error(
                    f"duplicate key {orjson.dumps(key).decode()} in object "
                    f"(first at line {line}, column {col})",
                    pos,
                )
            seen[key] = pos
            self.skip()
            if self.pos >= self.n or text[self.pos] != ":":
                raise self.error(
                    f"expected ':' after object key, found {self.describe(self.pos, open_pos)}",
                    self.pos,
                )
            self.pos += 1
            self.skip()
            items.append((key, self.value()))
            self.skip()
            pos = self.pos
            c = text[pos] if pos < self.n else ""
            if c == ",":
                comma = pos
                self.pos += 1
                self.skip()
                continue
            if c == "}":
                self.pos += 1
                break
            raise self.error(
                f"expected ',' or '}}' after object member, found {self.describe(pos, open_pos)}",
                pos,
            )
        self.depth -= 1
        return ("obj", tuple(items), all(_is_literal(v) for _, v in items))

    def arr(self) -> tuple:
        text = self.text
        open_pos = self.pos
        self.enter(open_pos)
        self.pos += 1
        self.skip()
        elems: list = []
        if self.pos < self.n and text[self.pos] == "]":
            self.pos += 1
            self.depth -= 1
            return ("arr", (), True)
        while True:
            elems.append(self.value())
            self.skip()
            pos = self.pos
            c = text[pos] if pos < self.n else ""
            if c == ",":
                self.pos += 1
                self.skip()
                if self.pos < self.n and text[self.pos] == "]":
                    raise self.error("trailing comma before ']' is not allowed", pos)
                continue
            if c == "]":
                self.pos += 1
                break
            raise self.error(
                f"expected ',' or ']' after array element, found {self.describe(pos, open_pos)}",
                pos,
            )
        self.depth -= 1
        return ("arr", tuple(elems), all(map(_is_literal, elems)))

    def string(self, quote: str, in_path: bool) -> str:
        """A quoted string at ``self.pos``; ``\\'`` is allowed only in path keys."""
        text, n = self.text, self.n
        start = self.pos
        plain = _DQ_PLAIN_RE if quote == '"' else _SQ_PLAIN_RE
        parts: list[str] = []
        i = start + 1
        while True:
            j = plain.match(text, i).end()
            if j > i:
                parts.append(text[i:j])
            if j >= n:
                raise self.error("unterminated string", start)
            c = text[j]
            if c == quote:
                self.pos = j + 1
                return "".join(parts)
            if c == "\\":
                e = text[j + 1] if j + 1 < n else ""
                if e == "u":
                    ch, i = self.unicode_escape(j)
                    parts.append(ch)
                    continue
                r = _ESCAPES.get(e)
                if r is None and in_path and e == "'":
                    r = "'"
                if r is None:
                    if e == "" or e in "\n\r":
                        raise self.error("unterminated string", start)
                    shown = e if e.isprintable() else f"U+{ord(e):04X}"
                    raise self.error(f"invalid escape '\\{shown}' in string", j)
                parts.append(r)
                i = j + 2
            elif c == "\n" or c == "\r":
                raise self.error("unterminated string", start)
            elif c < " ":
                raise self.error(
                    f"control character U+{ord(c):04X} must be escaped in a string", j
                )
            else:
                raise self.error(f"invalid character U+{ord(c):04X} (lone surrogate) in string", j)

    def unicode_escape(self, j: int) -> tuple[str, int]:
        """``\\uXXXX`` (or a surrogate pair) at ``j``; returns (char, next index)."""
        text = self.text
        h = text[j + 2 : j + 6]
        if not _HEX4_RE.fullmatch(h):
            raise self.error("invalid \\u escape: expected 4 hex digits", j)
        cp = int(h, 16)
        if 0xD800 <= cp <= 0xDBFF:
            lo = text[j + 8 : j + 12]
            if text.startswith("\\u", j + 6) and _HEX4_RE.fullmatch(lo):
                lcp = int(lo, 16)
                if 0xDC00 <= lcp <= 0xDFFF:
                    return chr(0x10000 + ((cp - 0xD800) << 10) + (lcp - 0xDC00)), j + 12
            raise self.error(
                f"invalid \\u escape: high surrogate \\u{h} is not followed by a low surrogate", j
            )
        if 0xDC00 <= cp <= 0xDFFF:
            raise self.error(f"invalid \\u escape: lone low surrogate \\u{h}", j)
        return chr(cp), j + 6

    def number(self) -> int | float:
        text, pos = self.text, self.pos
        m = _NUMBER_RE.match(text, pos)
        end = m.end() if m else pos
        if m is None or (end < self.n and (text[end] in ".+-" or text[end].isalnum())):
            junk = _NUMBER_JUNK_RE.match(text, pos).group() or text[pos]
            raise self.error(f"invalid number '{junk}'", pos)
        tok = m.group()
        self.pos = end
        if m.group(1) or m.group(2):
            v = float(tok)
            if v in (float("inf"), float("-inf")):
                raise self.error(f"number {tok} is out of range", pos)
            return v
        try:
            v = int(tok)
        except ValueError:  # over sys.get_int_max_str_digits()
            raise self.error(f"number with {len(tok)} digits is too long", pos) from None
        if not _INT_MIN <= v <= _INT_MAX:  # JSON output (orjson) has 64-bit integers
            raise self.error(f"integer {tok} is out of range (-2^63 to 2^64-1)", pos)
        return v


def _is_literal(node: tuple) -> bool:
    kind = node[0]
    return kind == "lit" or (kind in ("obj", "arr") and node[2])


def _literal_value(node: tuple) -> Any:
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "obj":
        return {k: _literal_value(v) for k, v in node[1]}
    return [_literal_value(v) for v in node[1]]


# --------------------------------------------------------------------------
# Code generation into closures (compile time)
# --------------------------------------------------------------------------

Render = Callable[[Any], Any]


def _const(value: Any) -> Render:
    def render(doc: Any) -> Any:
        return value

    return render


def _compile(node: tuple, fresh: bool) -> Render:
    """Closure for ``node``. ``fresh``: results share nothing with the template or doc."""
    kind = node[0]
    if kind == "lit":
        return _const(node[1])
    if kind in ("obj", "arr") and node[2] and not fresh:
        return _const(_literal_value(node))
    if kind == "obj":
        return _compile_obj(node[1], fresh)
    if kind == "arr":
        return _compile_arr(node[1], fresh)
    if kind == "path":
        return _compile_path(node[1], fresh)
    return _compile_chain(node[1], node[2], fresh)


def _static(child: tuple, fresh: bool) -> bool:
    """Whether ``child`` can live in a prebuilt base container."""
    return child[0] == "lit" or (not fresh and _is_literal(child))


def _compile_obj(items: tuple, fresh: bool) -> Render:
    base: dict = {}
    dyn: list = []
    for key, child in items:
        if _static(child, fresh):
            base[key] = _literal_value(child)
        else:
            base[key] = None  # placeholder: keeps the key's position in source order
            dyn.append((key, _compile(child, fresh)))
    if not dyn:
        return lambda doc: base.copy()
    if len(dyn) == len(items) and len(dyn) <= 3:
        if len(dyn) == 1:
            ((k0, f0),) = dyn

            def render1(doc: Any) -> dict:
                return {k0: f0(doc)}

            return render1
        if len(dyn) == 2:
            (k0, f0), (k1, f1) = dyn

            def render2(doc: Any) -> dict:
                return {k0: f0(doc), k1: f1(doc)}

            return render2
        (k0, f0), (k1, f1), (k2, f2) = dyn

        def render3(doc: Any) -> dict:
            return {k0: f0(doc), k1: f1(doc), k2: f2(doc)}

        return render3
    dyn_t = tuple(dyn)

    def render(doc: Any) -> dict:
        d = base.copy()
        for k, f in dyn_t:
            d[k] = f(doc)
        return d

    return render


def _compile_arr(elems: tuple, fresh: bool) -> Render:
    base: list = []
    dyn: list = []
    for i, child in enumerate(elems):
        if _static(child, fresh):
            base.append(_literal_value(child))
        else:
            base.append(None)
            dyn.append((i, _compile(child, fresh)))
    if not dyn:
        return lambda doc: base.copy()
    if len(dyn) == len(elems) and len(dyn) <= 2:
        if len(dyn) == 1:
            f0 = dyn[0][1]
            return lambda doc: [f0(doc)]
        f0, f1 = dyn[0][1], dyn[1][1]
        return lambda doc: [f0(doc), f1(doc)]
    dyn_t = tuple(dyn)

    def render(doc: Any) -> list:
        out = base.copy()
        for i, f in dyn_t:
            out[i] = f(doc)
        return out

    return render


def _raw_getter(steps: tuple) -> Render:
    """Closure returning the document object at ``steps`` or raising `_Missing`."""
    if all(type(s) is str for s in steps):

        def get_keys(doc: Any) -> Any:
            try:
                for k in steps:
                    doc = doc[k]
            except (KeyError, TypeError):
                raise _Missing from None
            return doc

        return get_keys
    return lambda doc: _walk(doc, steps, 0)


def _compile_path(ref: PathRef, fresh: bool) -> Render:
    """A path without a default: raises `MissingPathError` when missing."""
    steps, text = ref.steps, ref.text
    if all(type(s) is str for s in steps):
        return _compile_key_path(steps, text, fresh)

    def walk(doc: Any) -> Any:
        try:
            v = _walk(doc, steps, 0)
        except _Missing:
            raise MissingPathError(text) from None
        return _copy(v) if fresh and isinstance(v, _CONTAINERS) else v

    return walk


def _compile_key_path(steps: tuple, text: str, fresh: bool) -> Render:
    """The common case, inlined: key subscripts only (unrolled up to 3 keys).

    A ``TypeError`` means a step went into a non-object (list, string,
    number, null), i.e. the path is missing.
    """
    n = len(steps)
    if n == 1:
        (k0,) = steps

        def get1(doc: Any) -> Any:
            try:
                v = doc[k0]
            except (KeyError, TypeError):
                raise MissingPathError(text) from None
            return _copy(v) if fresh and isinstance(v, _CONTAINERS) else v

        return get1
    if n == 2:
        k0, k1 = steps

        def get2(doc: Any) -> Any:
            try:
                v = doc[k0][k1]
            except (KeyError, TypeError):
                raise MissingPathError(text) from None
            return _copy(v) if fresh and isinstance(v, _CONTAINERS) else v

        return get2
    if n == 3:
        k0, k1, k2 = steps

        def get3(doc: Any) -> Any:
            try:
                v = doc[k0][k1][k2]
            except (KeyError, TypeError):
                raise MissingPathError(text) from None
            return _copy(v) if fresh and isinstance(v, _CONTAINERS) else v

        return get3

    def get(doc: Any) -> Any:
        try:
            for k in steps:
                doc = doc[k]
        except (KeyError, TypeError):
            raise MissingPathError(text) from None
        return _copy(doc) if fresh and isinstance(doc, _CONTAINERS) else doc

    return get


def _compile_chain(refs: tuple, last: tuple | None, fresh: bool) -> Render:
    """``p1 ?? p2 ?? ... ?? last``: the first present path wins, else ``last``."""
    if last is None:
        getters = tuple(_raw_getter(r.steps) for r in refs[:-1])
        fallback = _compile_path(refs[-1], fresh)
    else:
        getters = tuple(_raw_getter(r.steps) for r in refs)
        fallback = _compile(last, fresh)

    def render(doc: Any) -> Any:
        for g in getters:
            try:
                v = g(doc)
            except _Missing:
                continue
            return _copy(v) if fresh and isinstance(v, _CONTAINERS) else v
        return fallback(doc)

    return render


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


class Template:
    """A compiled template; build one with `compile_template`.

    ``source`` is the template text, ``paths`` every `PathRef` in source
    order (paths inside defaults included), ``is_literal`` whether there are
    none. Rendering is thread-safe and does no parsing.
    """

    __slots__ = ("source", "paths", "is_literal", "_fresh", "_shared", "_json")

    def __init__(
        self,
        source: str,
        paths: tuple,
        fresh: Render,
        shared: Render,
        json_const: bytes | None,
    ) -> None:
        self.source = source
        self.paths = paths
        self.is_literal = not paths
        self._fresh = fresh
        self._shared = shared
        self._json = json_const

    def render(self, doc: Any) -> Any:
        """The output value for ``doc``: fresh objects the caller may mutate.

        Raises `MissingPathError` for a missing path without a default.
        Cost: O(size of the output), containers taken from ``doc`` are copied.
        """
        return self._fresh(doc)

    def render_json(self, doc: Any) -> bytes:
        """``orjson.dumps(self.render(doc))`` (UTF-8, not ASCII-escaped).

        Cheaper than that: no defensive copies are made, since serialising
        only reads; a literal-only template returns precomputed bytes.
        """
        if self._json is not None:
            return self._json
        return orjson.dumps(self._shared(doc))

    def __repr__(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Template({src!r})"


def compile_template(text: str) -> Template:
    """Parse and compile ``text``; raise `TemplateError` with line and column.

    Cost: O(len(text)); run it once at config load and keep the `Template`.
    """
    if not isinstance(text, str):
        raise TypeError(f"template text must be str, not {type(text).__name__}")
    if len(text) * 4 > MAX_TEMPLATE_BYTES:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_TEMPLATE_BYTES:
            total = 0
            for pos, c in enumerate(text):  # first character past the limit
                total += len(c.encode("utf-8", "surrogatepass"))
                if total > MAX_TEMPLATE_BYTES:
                    break
            line, col = _line_col(text, pos)
            raise TemplateError(
                f"template is {size} bytes, over the {MAX_TEMPLATE_BYTES}-byte limit", line, col
            )
    parser = _Parser(text)
    node = parser.template()
    json_const = None
    if _is_literal(node):
        try:
            json_const = orjson.dumps(_literal_value(node))
        except orjson.JSONEncodeError:  # e.g. an integer beyond 64 bits
            json_const = None
    return Template(
        text, tuple(parser.paths), _compile(node, True), _compile(node, False), json_const
    )


if __name__ == "__main__":
    import functools
    import timeit

    _BRIEF = (
        "# 将LLM输出JSON结构映射为会计凭证schema\n"
        '{"voucher": {"amount": $.output.amount, "account": $.output.account}}'
    )
    _tpl = compile_template(_BRIEF)
    _doc = {"output": {"amount": 12.5, "account": "6001"}}
    print(f"template: {_BRIEF!r}")
    print(f"result:   {_tpl.render_json(_doc).decode()}")
    _n = 200_000
    for _name, _fn in (("render", _tpl.render), ("render_json", _tpl.render_json)):
        _best = min(timeit.repeat(functools.partial(_fn, _doc), number=_n, repeat=7))
        print(f"{_name:12s} {_best / _n * 1e6:.2f} µs per render (best of 7 x {_n})")
    _best = min(timeit.repeat(functools.partial(compile_template, _BRIEF), number=2000, repeat=5))
    print(f"{'compile':12s} {_best / 2000 * 1e6:.1f} µs per compile")
