"""Contract alignment: match a legacy schema's fields to an adapter schema's, propose conversions.

What: `align_schemas(legacy, adapter)` flattens both JSON Schemas into leaf fields (`schema_fields`:
nested objects are walked, arrays and maps are leaves), scores every legacy/adapter pair, assigns
them one-to-one, and returns an `Alignment` that can write a mapping file (`Alignment.mapping`,
loadable by `extproc.semantic.mapping`) and a report for a person (`report_markdown`,
`report_json`) marking **ambiguous** matches (another candidate within ``margin``) and
**unmatched** fields.

Scoring, in full (``score = name similarity x type compatibility``):

* **Names** are split into tokens at ``_``, ``-``, ``.``, spaces, camelCase and digit boundaries
  (``ImageID`` -> image id, ``addrLine1`` -> addr line 1); tokens are lower-cased, expanded by
  `ABBREVIATIONS` (amt -> amount, acct -> account, qty -> quantity, desc -> description, addr ->
  address, ts -> timestamp, num/no -> number, repo -> repository, ...), mapped to one spelling by
  `SYNONYMS` (identifier -> id; timestamp, datetime, date, at, on -> time; colour -> color; ...),
  stripped of `STOP_WORDS` (is, has, the...) and stemmed (created/create/creation -> creat).
  Similarity is a weighted soft Dice coefficient over the two token lists: equal tokens count 1,
  a token that is a prefix of the other (3+ letters) 0.85, near spellings (difflib ratio >= 0.8)
  0.9 x ratio; `WEAK_TOKENS` (time, name, code, count, bytes, epoch, ...) weigh 0.35. Names
  that are equal once separators are removed (``livemode``/``liveMode``) score 1. Context counts:
  the legacy field's parent names and the legacy schema's name may prefix its tokens
  (``refund.amount`` ~ ``refundAmt``; ``charge.id`` ~ ``chargeId``), and adapter parents
  likewise, at 0.92 of the context-free score so that an exact leaf match wins a tie.
* **Types**: same type 1; integer/number 0.9; a time-like string (``format: date-time``/``date``
  or a time-like name) and an integer/number 0.9 with an ISO 8601 <-> Unix conversion; other
  string/number pairs 0.6 with a string <-> number conversion; boolean and a two-value string
  enum 0.75 with an enum map; arrays 1 (0.7 when item types differ); anything and an untyped
  field 0.8; other pairs 0 (never matched).
* **Assignment** is greedy by score, one-to-one, above ``min_score`` (0.5). A match is
  **ambiguous** when another candidate for either side scores within ``margin`` (0.05).
* **Conversions** proposed: ISO 8601 <-> Unix time (``unit: ms`` when the Unix side's name says
  ms/millis), string <-> number, enums paired by value (case and separators ignored: ``in_progress``
  ~ ``InProgress``), boolean <-> two-value enum (Y/N, yes/no, true/false, 1/0, on/off, ...).
  Renames and nesting are the templates' job.

The generated templates use ``$.path ?? null`` for fields that are optional on the reading side:
the template language cannot leave a key out, so a missing optional field comes out as ``null``.

Why: the brief's "reverse-parse the existing contracts and align them automatically" step; the
machine proposes, a person decides what the report flags. Measured quality (precision/recall on
a labelled set) is in docs/semantic.md and recomputed by `extproc.semantic.evaluate`.

Cost: O(L x A) pair scores for L legacy and A adapter fields, each O(tokens^2); about 10 ms for
50 x 50 fields. Build time only.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import orjson
import yaml

from extproc.semantic.conversions import make_conversion
from extproc.template import path_text

__all__ = [
    "ABBREVIATIONS",
    "STOP_WORDS",
    "SYNONYMS",
    "WEAK_TOKENS",
    "Alignment",
    "Field",
    "Match",
    "align_schemas",
    "name_similarity",
    "name_tokens",
    "schema_fields",
]

ABBREVIATIONS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "acc": ("account",), "acct": ("account",), "addr": ("address",), "amt": ("amount",),
    "attr": ("attribute",), "avg": ("average",), "bal": ("balance",), "cat": ("category",),
    "ccy": ("currency",), "cfg": ("configuration",), "config": ("configuration",), "cnt": ("count",),
    "cur": ("currency",), "curr": ("currency",), "cust": ("customer",), "dept": ("department",),
    "desc": ("description",), "descr": ("description",), "dest": ("destination",), "dob": ("date", "birth"),
    "dst": ("destination",), "dt": ("date",), "env": ("environment",), "err": ("error",),
    "fname": ("first", "name"), "idx": ("index",), "img": ("image",), "info": ("information",),
    "inv": ("invoice",), "lang": ("language",), "len": ("length",), "lname": ("last", "name"),
    "loc": ("location",), "max": ("maximum",), "mgr": ("manager",), "min": ("minimum",),
    "msg": ("message",), "nbr": ("number",), "no": ("number",), "nr": ("number",), "num": ("number",),
    "org": ("organization",), "param": ("parameter",), "passwd": ("password",), "pct": ("percent",),
    "pmt": ("payment",), "pr": ("pull", "request"), "prod": ("product",), "pwd": ("password",),
    "pymt": ("payment",), "qty": ("quantity",), "ref": ("reference",), "repo": ("repository",),
    "req": ("request",), "resp": ("response",), "src": ("source",), "stat": ("status",),
    "stmt": ("statement",), "sts": ("status",), "sz": ("size",), "tel": ("phone",), "tm": ("time",),
    "ts": ("timestamp",), "tx": ("transaction",), "txn": ("transaction",), "usr": ("user",),
    "ver": ("version",),
})
"""Abbreviation -> the words it stands for (applied to lower-cased tokens)."""

SYNONYMS: Mapping[str, str] = MappingProxyType({
    "identifier": "id", "timestamp": "time", "datetime": "time", "date": "time", "at": "time",
    "on": "time", "colour": "color", "modified": "updated", "telephone": "phone", "mail": "email",
    "e": "", "quantity": "quantity", "organisation": "organization",
})
"""Token -> the one spelling used for comparison (``""`` drops the token)."""

STOP_WORDS = frozenset({"is", "has", "the", "of", "a", "an", "to", "for"})
"""Tokens ignored when comparing names."""

WEAK_TOKENS = frozenset({"time", "name", "code", "count", "bytes", "byte", "epoch", "unix", "utc", "ms",
                         "millis", "milliseconds", "sec", "secs", "seconds", "iso", "text", "value", "flag",
                         "str", "string", "int", "list", "array"})
"""Tokens that often decorate a name (units, kinds): they weigh 0.35 instead of 1."""

_WEAK_WEIGHT = 0.35
_CONTEXT_FACTOR = 0.92
_CAMEL_RE = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")
_SPLIT_RE = re.compile(r"[^A-Za-z0-9]+")
_TIME_FORMATS = frozenset({"date-time", "date", "datetime", "dateTime", "unix-time", "timestamp"})
_STEM_SUFFIXES = ("ations", "ation", "ings", "ing", "ions", "ion", "ies", "ed", "es", "s", "e")
_TRUTHY = ("true", "t", "yes", "y", "1", "on", "enabled", "enable", "active")
_FALSY = ("false", "f", "no", "n", "0", "off", "disabled", "disable", "inactive")


# --------------------------------------------------------------------------
# Fields
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One leaf of a schema: ``path`` of property names from the root, its JSON type and facets.

    ``type`` is string/integer/number/boolean/array/object/any; ``required`` is true when the
    field and all its ancestors are required; ``items_type`` is set for arrays.
    """

    path: tuple[str, ...]
    type: str
    format: str | None = None
    enum: tuple | None = None
    required: bool = False
    nullable: bool = False
    items_type: str | None = None

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def dotted(self) -> str:
        return ".".join(self.path)

    @property
    def expr(self) -> str:
        """The template path of this field (``$.a.b``, ``$['x y']``)."""
        return path_text(self.path)

    def describe(self) -> str:
        t = self.type + (f" ({self.format})" if self.format else "")
        if self.enum is not None:
            t += " enum " + ", ".join(map(_show, self.enum[:6])) + (", ..." if len(self.enum) > 6 else "")
        return t


def _show(v: Any) -> str:
    return orjson.dumps(v).decode()


def _unwrap(s: Any) -> tuple[dict, bool]:
    """``(schema, nullable)``: a schema with ``null`` taken out of its type/anyOf/oneOf."""
    if not isinstance(s, dict):
        return {}, False
    nullable = False
    for key in ("anyOf", "oneOf"):
        alts = s.get(key)
        if isinstance(alts, list):
            non_null = [a for a in alts if not (isinstance(a, dict) and a.get("type") == "null")]
            if len(non_null) < len(alts):
                nullable = True
            if len(non_null) == 1 and isinstance(non_null[0], dict):
                merged = {k: v for k, v in s.items() if k != key}
                inner, n2 = _unwrap(non_null[0])
                return {**inner, **{k: v for k, v in merged.items() if k not in inner}}, nullable or n2
    t = s.get("type")
    if isinstance(t, list):
        non_null = [x for x in t if x != "null"]
        nullable = nullable or len(non_null) < len(t)
        s = {**s, "type": non_null[0] if len(non_null) == 1 else non_null}
    return s, nullable


def _type_of(s: dict) -> str:
    t = s.get("type")
    if isinstance(t, str):
        return t if t != "null" else "any"
    if isinstance(t, list):
        return "any" if len(t) != 1 else t[0]
    for key in ("anyOf", "oneOf"):
        alts = s.get(key)
        if isinstance(alts, list) and alts:
            types = {_type_of(_unwrap(a)[0]) for a in alts if isinstance(a, dict)}
            return types.pop() if len(types) == 1 else "any"
    if "properties" in s:
        return "object"
    if "items" in s:
        return "array"
    if isinstance(s.get("enum"), list) and s["enum"]:
        kinds = {_json_kind(v) for v in s["enum"] if v is not None}
        return kinds.pop() if len(kinds) == 1 else "any"
    if "const" in s:
        return _json_kind(s["const"])
    return "any"


def _json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object" if isinstance(v, dict) else "any"


def schema_fields(schema: Any, *, max_depth: int = 8) -> list[Field]:
    """The leaf fields of a JSON Schema object, in declaration order (depth-first).

    Objects with ``properties`` are walked (up to ``max_depth`` levels); arrays, maps and
    everything else are leaves. Raises ValueError when the root has no properties.
    """
    root, _ = _unwrap(schema)
    if not isinstance(root.get("properties"), dict) or not root["properties"]:
        raise ValueError("the schema has no properties to align (expected an object schema with 'properties')")
    out: list[Field] = []

    def walk(s: dict, path: tuple, required: bool, nullable: bool, depth: int) -> None:
        t = _type_of(s)
        props = s.get("properties")
        if t == "object" and isinstance(props, dict) and props and depth < max_depth:
            req = set(s.get("required") or ())
            for name, sub in props.items():
                inner, n = _unwrap(sub)
                walk(inner, (*path, str(name)), required and name in req, n, depth + 1)
            return
        items_type = None
        if t == "array" and isinstance(s.get("items"), dict):
            items_type = _type_of(_unwrap(s["items"])[0])
        enum = tuple(v for v in s["enum"] if v is not None) if isinstance(s.get("enum"), list) else None
        fmt = s.get("format") if isinstance(s.get("format"), str) else None
        out.append(Field(path, t, fmt, enum, required, nullable, items_type))

    req0 = set(root.get("required") or ())
    for name, sub in root["properties"].items():
        inner, n = _unwrap(sub)
        walk(inner, (str(name),), name in req0, n, 1)
    return out


# --------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------


def _stem(t: str) -> str:
    if len(t) <= 4 or t.isdigit():
        return t
    for suf in _STEM_SUFFIXES:
        if t.endswith(suf) and len(t) - len(suf) >= 3:
            if suf == "s" and (t.endswith("ss") or t.endswith("us")):
                return t
            return t[: -len(suf)] + ("y" if suf == "ies" else "")
    return t


def _words(name: str) -> list[str]:
    """Lower-cased words of a name after abbreviation and synonym mapping, before stemming."""
    raw: list[str] = []
    for part in _SPLIT_RE.split(name):
        raw.extend(_CAMEL_RE.findall(part))
    out: list[str] = []
    for tok in raw:
        tok = tok.lower()
        for word in ABBREVIATIONS.get(tok, (tok,)):
            word = SYNONYMS.get(word, word)
            if word and word not in STOP_WORDS:
                out.append(word)
    return out


def name_tokens(name: str) -> tuple[str, ...]:
    """Normalised tokens of a field name (see the module docstring). O(len(name))."""
    return tuple(_stem(w) for w in _words(name))


class _Name(tuple):
    """Tokens of a name (a tuple) plus ``joined``: the stemmed concatenation of its words."""

    joined: str

    def __new__(cls, words: list[str]) -> _Name:
        self = super().__new__(cls, (_stem(w) for w in words))
        self.joined = _stem("".join(words))
        return self


def _token_sim(a: str, b: str) -> float:
    if a == b:
        return 1.0
    if min(len(a), len(b)) >= 3 and (a.startswith(b) or b.startswith(a)):
        return 0.85
    if a.isdigit() or b.isdigit():
        return 0.0
    r = difflib.SequenceMatcher(None, a, b).ratio()
    return 0.9 * r if r >= 0.8 else 0.0


def _weight(t: str) -> float:
    return _WEAK_WEIGHT if t in WEAK_TOKENS else 1.0


def _soft_dice(a: tuple[str, ...], b: tuple[str, ...]) -> float:
    if not a or not b:
        return 0.0
    if getattr(a, "joined", "".join(a)) == getattr(b, "joined", "".join(b)):
        return 1.0
    wa = [_weight(t) for t in a]
    wb = [_weight(t) for t in b]
    sa = sum(w * max(_token_sim(t, u) for u in b) for t, w in zip(a, wa))
    sb = sum(w * max(_token_sim(u, t) for t in a) for u, w in zip(b, wb))
    return (sa + sb) / (sum(wa) + sum(wb))


def _variants(path: tuple[str, ...], root: list[str]) -> list[tuple[_Name, bool]]:
    """Token lists for a field: the leaf alone, then with parent/root context (flagged)."""
    leaf = _words(path[-1])
    out = [(_Name(leaf), False)]
    parents = [_words(p) for p in path[:-1]]
    if parents:
        out.append((_Name(parents[-1] + leaf), True))
        if len(parents) > 1:
            out.append((_Name([w for p in parents for w in p] + leaf), True))
    if root:
        out.append((_Name(root + leaf), True))
        if parents:
            out.append((_Name(root + parents[-1] + leaf), True))
    return out


def name_similarity(legacy: tuple[str, ...] | str, adapter: tuple[str, ...] | str,
                    legacy_root: str = "", adapter_root: str = "") -> float:
    """Name score in [0, 1] of two field paths (a name is a one-element path)."""
    lp = (legacy,) if isinstance(legacy, str) else legacy
    ap = (adapter,) if isinstance(adapter, str) else adapter
    return _name_score(_variants(lp, _words(legacy_root) if legacy_root else []),
                       _variants(ap, _words(adapter_root) if adapter_root else []))


def _name_score(lv: list, av: list) -> float:
    best = 0.0
    for lt, lctx in lv:
        for at, actx in av:
            s = _soft_dice(lt, at)
            if lctx or actx:
                s *= _CONTEXT_FACTOR
            if s > best:
                best = s
    return best


# --------------------------------------------------------------------------
# Types and conversions
# --------------------------------------------------------------------------


def _time_like(f: Field) -> bool:
    if f.format in _TIME_FORMATS:
        return True
    toks = name_tokens(f.name)
    return "time" in toks or any(t in ("creat", "updat", "expir", "expires", "start", "finish", "due", "birth")
                                 for t in toks[:1] + toks[-1:])


def _norm_value(v: Any) -> str:
    return re.sub(r"[^a-z0-9]", "", str(v).lower())


def _pair_enums(legacy: tuple, adapter: tuple) -> tuple[list, list]:
    """``(pairs, unpaired legacy values)`` matching enum values by normalised spelling."""
    by_norm: dict[str, Any] = {}
    for v in adapter:
        by_norm.setdefault(_norm_value(v), v)
    pairs, unpaired = [], []
    for v in legacy:
        target = by_norm.get(_norm_value(v))
        if target is None:
            unpaired.append(v)
        else:
            pairs.append([v, target])
    return pairs, unpaired


def _bool_pairs(values: tuple) -> list | None:
    if len(values) != 2:
        return None
    norm = [_norm_value(v) for v in values]
    if norm[0] in _TRUTHY and norm[1] in _FALSY:
        return [[True, values[0]], [False, values[1]]]
    if norm[1] in _TRUTHY and norm[0] in _FALSY:
        return [[True, values[1]], [False, values[0]]]
    return None


def _unit(f: Field) -> str:
    toks = set(name_tokens(f.name))
    return "ms" if toks & {"ms", "millis", "milliseconds", "millisecond"} else "s"


def _compat(lf: Field, af: Field) -> tuple[float, dict | None, tuple[str, ...]]:
    """``(factor, conversion {kind, params} or None, notes)`` for a legacy/adapter type pair."""
    lt, at = lf.type, af.type
    notes: list[str] = []
    if lt == "any" or at == "any":
        return 0.8, None, ("one side has no declared type",)
    if lt == at:
        if lt == "string" and (lf.enum or af.enum):
            if lf.enum and af.enum:
                if set(map(_show, lf.enum)) == set(map(_show, af.enum)):
                    return 1.0, None, ()
                pairs, unpaired = _pair_enums(lf.enum, af.enum)
                if not pairs:
                    return 0.8, None, ("enum values share nothing: map them by hand",)
                if unpaired:
                    notes.append("legacy enum values without a counterpart: " + ", ".join(map(_show, unpaired)))
                return 1.0, {"kind": "enum_map", "params": {"pairs": pairs}}, tuple(notes)
            if af.enum:
                return 0.95, None, ("the adapter allows only " + ", ".join(map(_show, af.enum[:8]))
                                    + "; the legacy field is free text: add an enum_map if the spellings differ",)
            return 1.0, None, ()
        if lt == "array" and lf.items_type and af.items_type and lf.items_type != af.items_type:
            return 0.7, None, (f"array items differ: {lf.items_type} vs {af.items_type}",)
        return 1.0, None, ()
    if {lt, at} == {"integer", "number"}:
        return 0.9, None, (("legacy numbers may have fractions the adapter's integer cannot hold",)
                           if lt == "number" else ())
    if lt == "string" and at in ("integer", "number"):
        if _time_like(lf) or (_time_like(af) and lf.format != "byte"):
            form = "date" if lf.format == "date" else "datetime"
            return 0.9, {"kind": "iso8601_to_unix", "params": {"unit": _unit(af), "form": form}}, ()
        return 0.6, {"kind": "string_to_number", "params": {"type": at}}, (
            "lossless only for canonical numerals (no leading zeros, no trailing fraction zeros)",)
    if lt in ("integer", "number") and at == "string":
        if _time_like(lf) or _time_like(af):
            form = "date" if af.format == "date" else "datetime"
            return 0.9, {"kind": "unix_to_iso8601", "params": {"unit": _unit(lf), "form": form}}, ()
        return 0.6, {"kind": "number_to_string", "params": {"type": lt}}, ()
    if lt == "boolean" and at == "string" and af.enum:
        pairs = _bool_pairs(af.enum)
        if pairs:
            return 0.75, {"kind": "enum_map", "params": {"pairs": pairs}}, ()
    if lt == "string" and at == "boolean" and lf.enum:
        pairs = _bool_pairs(lf.enum)
        if pairs:
            return 0.75, {"kind": "enum_map", "params": {"pairs": [[b, a] for a, b in pairs]}}, ()
    if {lt, at} == {"boolean", "string"}:
        return 0.3, None, ("boolean vs free text: no automatic conversion",)
    return 0.0, None, ()


# --------------------------------------------------------------------------
# Alignment
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Match:
    """A proposed legacy -> adapter field pair.

    ``alternatives`` are other candidates within the margin (``(path, score)``, either side);
    ``ambiguous`` is true when there are any. ``conversion`` is ``{"kind", "params"}`` or None.
    """

    legacy: Field
    adapter: Field
    score: float
    name_score: float
    conversion: dict | None = None
    lossless: bool = True
    notes: tuple[str, ...] = ()
    alternatives: tuple[tuple[str, float], ...] = ()

    @property
    def ambiguous(self) -> bool:
        return bool(self.alternatives)


@dataclass(frozen=True)
class Alignment:
    """The result of `align_schemas`: matches, unmatched fields, and writers for its outputs."""

    legacy_name: str
    adapter_name: str
    matches: tuple[Match, ...]
    unmatched_legacy: tuple[tuple[Field, tuple[str, float] | None], ...]
    unmatched_adapter: tuple[Field, ...]
    min_score: float
    margin: float
    legacy_fields: tuple[Field, ...] = field(default=(), repr=False)
    adapter_fields: tuple[Field, ...] = field(default=(), repr=False)

    @property
    def ambiguous(self) -> tuple[Match, ...]:
        return tuple(m for m in self.matches if m.ambiguous)

    def pairs(self) -> dict[str, str]:
        """``{legacy dotted path: adapter dotted path}`` of every proposed match."""
        return {m.legacy.dotted: m.adapter.dotted for m in self.matches}

    # -- mapping file ------------------------------------------------------

    def forward_template(self) -> str:
        """Template text mapping a legacy document to the adapter schema (renames, nesting)."""
        entries = []
        for m in self.matches:
            expr = m.legacy.expr + ("" if m.legacy.required else " ?? null")
            comment = []
            if m.ambiguous:
                comment.append("AMBIGUOUS: also " + ", ".join(f"{p} ({s:.2f})" for p, s in m.alternatives))
            if m.conversion:
                comment.append(f"converted: {m.conversion['kind']}")
            entries.append((m.adapter.path, expr, "; ".join(comment)))
        missing = [f for f in self.unmatched_adapter if f.required]
        header = [f"# {self.legacy_name} -> {self.adapter_name} (generated by adapterctl align; review the report)"]
        header += [f"# TODO: required adapter field {f.expr} has no legacy counterpart" for f in missing]
        return "\n".join(header) + "\n" + _render_tree(entries) + "\n"

    def inverse_template(self) -> str:
        """Template text mapping an adapter document back to the legacy schema."""
        entries = []
        for m in self.matches:
            expr = m.adapter.expr + ("" if m.adapter.required else " ?? null")
            entries.append((m.legacy.path, expr, f"converted: {m.conversion['kind']}" if m.conversion else ""))
        missing = [f for f, _ in self.unmatched_legacy if f.required]
        header = [f"# {self.adapter_name} -> {self.legacy_name} (generated by adapterctl align; review the report)"]
        header += [f"# TODO: required legacy field {f.expr} has no adapter counterpart" for f in missing]
        return "\n".join(header) + "\n" + _render_tree(entries) + "\n"

    def mapping(self) -> dict:
        """The mapping-file document (`extproc.semantic.mapping.compile_mapping` reads it)."""
        conversions = []
        for m in self.matches:
            if m.conversion:
                conversions.append({"field": m.adapter.expr, "source": m.legacy.expr, **m.conversion})
        return {
            "apiVersion": "adapter.ai/v1",
            "kind": "FieldMapping",
            "legacy": self.legacy_name,
            "adapter": self.adapter_name,
            "forward": self.forward_template(),
            "inverse": self.inverse_template(),
            "conversions": conversions,
        }

    def mapping_yaml(self) -> str:
        """`mapping` as YAML text, templates as literal blocks."""
        return yaml.dump(self.mapping(), Dumper=_BlockDumper, sort_keys=False, allow_unicode=True, width=120)

    # -- reports -----------------------------------------------------------

    def report_json(self) -> dict:
        """Everything the report says, as data."""
        def fd(f: Field) -> dict:
            return {"path": f.dotted, "type": f.describe(), "required": f.required}

        return {
            "legacy": self.legacy_name,
            "adapter": self.adapter_name,
            "min_score": self.min_score,
            "margin": self.margin,
            "summary": {
                "legacy_fields": len(self.legacy_fields), "adapter_fields": len(self.adapter_fields),
                "matched": len(self.matches), "ambiguous": len(self.ambiguous),
                "unmatched_legacy": len(self.unmatched_legacy), "unmatched_adapter": len(self.unmatched_adapter),
            },
            "matches": [{
                "legacy": fd(m.legacy), "adapter": fd(m.adapter), "score": round(m.score, 3),
                "conversion": m.conversion, "lossless": m.lossless, "ambiguous": m.ambiguous,
                "alternatives": [{"path": p, "score": round(s, 3)} for p, s in m.alternatives],
                "notes": list(m.notes)} for m in self.matches],
            "unmatched_legacy": [{**fd(f), "closest": ({"path": c[0], "score": round(c[1], 3)} if c else None)}
                                 for f, c in self.unmatched_legacy],
            "unmatched_adapter": [fd(f) for f in self.unmatched_adapter],
        }

    def report_markdown(self) -> str:
        """A Markdown report: what needs a decision first, then matches and unmatched fields."""
        j = self.report_json()["summary"]
        lines = [f"# Alignment: {self.legacy_name} -> {self.adapter_name}", "",
                 f"{j['legacy_fields']} legacy and {j['adapter_fields']} adapter fields: {j['matched']} matched "
                 f"({j['ambiguous']} ambiguous), {j['unmatched_legacy']} legacy and {j['unmatched_adapter']} adapter "
                 f"fields unmatched. Threshold {self.min_score}, ambiguity margin {self.margin}.", ""]
        review = [m for m in self.matches if m.ambiguous or m.notes or not m.lossless]
        lines += ["## Needs a decision", ""]
        if review or self.unmatched_legacy or any(f.required for f in self.unmatched_adapter):
            lines += ["| legacy field | proposed adapter field | score | why |", "|---|---|---:|---|"]
            for m in review:
                why = []
                if m.ambiguous:
                    why.append("ambiguous: also " + ", ".join(f"`{p}` ({s:.2f})" for p, s in m.alternatives))
                if not m.lossless:
                    why.append("conversion is not lossless")
                why.extend(m.notes)
                lines.append(f"| `{m.legacy.dotted}` | `{m.adapter.dotted}` | {m.score:.2f} | {'; '.join(why)} |")
            for f, closest in self.unmatched_legacy:
                hint = f"closest: `{closest[0]}` ({closest[1]:.2f})" if closest else "no candidate"
                lines.append(f"| `{f.dotted}` | (none) | | unmatched legacy field{' (required)' if f.required else ''}"
                             f"; {hint} |")
            for f in self.unmatched_adapter:
                if f.required:
                    lines.append(f"| (none) | `{f.dotted}` | | required adapter field with no legacy counterpart |")
        else:
            lines.append("Nothing: every field matched unambiguously.")
        lines += ["", "## Matches", "", "| legacy field | legacy type | adapter field | adapter type | score | "
                  "conversion |", "|---|---|---|---|---:|---|"]
        for m in self.matches:
            conv = "" if not m.conversion else f"{m.conversion['kind']} {_show(m.conversion['params'])}"
            lines.append(f"| `{m.legacy.dotted}` | {m.legacy.describe()} | `{m.adapter.dotted}` | "
                         f"{m.adapter.describe()} | {m.score:.2f}{' ⚠' if m.ambiguous else ''} | {conv} |")
        if self.unmatched_adapter:
            lines += ["", "## Adapter fields with no legacy counterpart", ""]
            lines += [f"- `{f.dotted}` ({f.describe()}{', required' if f.required else ''})"
                      for f in self.unmatched_adapter]
        return "\n".join(lines) + "\n"


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings as ``|`` blocks (templates stay readable)."""


def _str_representer(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_BlockDumper.add_representer(str, _str_representer)


def _render_tree(entries: list[tuple[tuple[str, ...], str, str]]) -> str:
    """Template text for ``(target path, expression, comment)`` entries, nested by path."""
    tree: dict = {}
    for path, expr, comment in entries:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"two matches write into {'.'.join(path)}")
        node[path[-1]] = (expr, comment)

    def render(node: dict, indent: int) -> list[str]:
        pad = "  " * (indent + 1)
        items = list(node.items())
        out: list[str] = []
        for i, (key, value) in enumerate(items):
            comma = "," if i < len(items) - 1 else ""
            k = orjson.dumps(key).decode()
            if isinstance(value, dict):
                out.append(f"{pad}{k}: {{")
                out.extend(render(value, indent + 1))
                out.append(f"{pad}}}{comma}")
            else:
                expr, comment = value
                if comment:
                    out.append(f"{pad}# {comment}")
                out.append(f"{pad}{k}: {expr}{comma}")
        return out

    if not tree:
        return "{}"
    return "\n".join(["{", *render(tree, 0), "}"])


def align_schemas(legacy: Any, adapter: Any, *, legacy_name: str = "legacy", adapter_name: str = "adapter",
                  legacy_root: str | None = None, adapter_root: str | None = None,
                  min_score: float = 0.5, margin: float = 0.05) -> Alignment:
    """Align two JSON Schemas (see the module docstring); ValueError if either has no properties.

    ``legacy_root``/``adapter_root`` are the schemas' own names (``charge``, ``simple-user``),
    used as name context; by default the schema's ``title``.
    """
    lfields = schema_fields(legacy)
    afields = schema_fields(adapter)
    lroot = legacy_root if legacy_root is not None else str(legacy.get("title", "")) if isinstance(legacy, dict) else ""
    aroot = adapter_root if adapter_root is not None else str(adapter.get("title", "")) if isinstance(adapter, dict) else ""
    lvars = [_variants(f.path, _words(lroot) if lroot else []) for f in lfields]
    avars = [_variants(f.path, _words(aroot) if aroot else []) for f in afields]
    scores: dict[tuple[int, int], tuple[float, float, dict | None, tuple]] = {}
    for i, lf in enumerate(lfields):
        for j, af in enumerate(afields):
            factor, conv, notes = _compat(lf, af)
            if factor == 0.0:
                continue
            ns = _name_score(lvars[i], avars[j])
            scores[(i, j)] = (ns * factor, ns, conv, notes)
    ranked = sorted(((s[0], i, j) for (i, j), s in scores.items() if s[0] >= min_score),
                    key=lambda x: (-x[0], x[1], x[2]))
    taken_l: dict[int, int] = {}
    taken_a: set[int] = set()
    for s, i, j in ranked:
        if i in taken_l or j in taken_a:
            continue
        taken_l[i] = j
        taken_a.add(j)
    matches = []
    for i in sorted(taken_l):
        j = taken_l[i]
        s, ns, conv, notes = scores[(i, j)]
        alts: list[tuple[str, float]] = []
        for jj in range(len(afields)):
            if jj != j and (i, jj) in scores and scores[(i, jj)][0] >= max(min_score, s - margin):
                alts.append((afields[jj].dotted, scores[(i, jj)][0]))
        for ii in range(len(lfields)):
            if ii != i and (ii, j) in scores and scores[(ii, j)][0] >= max(min_score, s - margin):
                alts.append((lfields[ii].dotted, scores[(ii, j)][0]))
        lossless = True
        if conv is not None:
            lossless = make_conversion(conv["kind"], conv["params"]).lossless
        if lfields[i].type == "number" and afields[j].type == "integer":
            lossless = False
        lf, af = lfields[i], afields[j]
        extra = list(notes)
        if af.required and not lf.required:
            extra.append("the adapter requires this field; the legacy side may omit it (forward gives null)")
        if lf.nullable and not af.nullable and af.type != "any":
            extra.append("legacy value may be null; the adapter type does not allow null")
        matches.append(Match(lf, af, s, ns, conv, lossless, tuple(extra),
                             tuple(sorted(alts, key=lambda x: -x[1]))))
    unmatched_l = []
    for i, lf in enumerate(lfields):
        if i in taken_l:
            continue
        cands = [(afields[j].dotted, scores[(i, j)][0]) for j in range(len(afields)) if (i, j) in scores]
        best = max(cands, key=lambda x: x[1]) if cands else None
        unmatched_l.append((lf, best if best and best[1] > 0.2 else None))
    unmatched_a = tuple(af for j, af in enumerate(afields) if j not in taken_a)
    return Alignment(legacy_name, adapter_name, tuple(matches), tuple(unmatched_l), unmatched_a,
                     min_score, margin, tuple(lfields), tuple(afields))


def fields_by_path(fields: Iterable[Field]) -> dict[str, Field]:
    """``{dotted path: field}``."""
    return {f.dotted: f for f in fields}
