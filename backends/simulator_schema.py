"""Deterministic JSON-Schema instance generator for the OpenAI API simulator.

The simulator answers ``response_format: {"type": "json_schema", ...}`` requests
with content that validates against the requested schema, the way a real
structured-output (guided decoding) engine would.  This module produces such a
value: :func:`instance_for` walks the schema and builds one instance, drawing
every free choice from a ``random.Random`` seeded by the caller, so the same
``(schema, seed)`` always yields the same value.

Supported subset (everything else is ignored, which is sound for keywords that
only *restrict* other types, and best-effort otherwise):

* ``type`` (a name or a list of names; the first is used, except past the
  recursion limit where a scalar/null member is preferred);
* ``enum`` / ``const`` (an enum member that meets the type, bounds and lengths
  beside it is picked by the seed);
* ``object``: ``properties`` (all are emitted, up to ``maxProperties``; an
  optional one whose schema has no instance is left out), ``required`` (names
  without a ``properties`` entry are generated from ``additionalProperties``
  when it is a schema, else as strings), ``additionalProperties``,
  ``minProperties`` / ``maxProperties``;
* ``array``: ``items``, ``prefixItems`` (and the draft-4..7 tuple form
  ``items: [...]`` with ``additionalItems``), ``minItems`` / ``maxItems``
  (items past ``minItems`` whose schema has no instance are left out),
  ``uniqueItems`` (up to 16 tries per item, varying options, types, lengths
  and object members);
* ``string``: ``enum``, ``const``, ``format`` (date-time, date, time, email,
  uuid, uri, hostname, ipv4, ipv6; a short and a long form where the format
  has them), ``minLength`` / ``maxLength``; a format and length bounds together
  are best effort.  ``pattern`` is NOT honoured: a plain word string is
  returned, so a value for a schema with a ``pattern`` may not match it;
* ``number`` / ``integer``: ``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum`` (numeric, or the draft-4 boolean form) and
  ``multipleOf``.  ``number`` values are non-integral where the bounds allow,
  so ``oneOf: [{"type": "integer"}, {"type": "number"}]`` stays unambiguous;
* ``boolean``, ``null``;
* ``anyOf`` / ``oneOf`` (the first option that has an instance; past the
  recursion limit options without a ``$ref`` first; a ``oneOf`` whose options
  overlap may get a value that matches several), ``allOf`` (members merged:
  object properties, ``required``, ``items`` and ``additional*`` schemas are
  united, numeric/length bounds take the tightest value, ``multipleOf`` the
  least common multiple, types intersect, of two formats the one jsonschema
  checks wins);
* ``$ref`` to any JSON pointer inside the document (``#``, ``#/$defs/...``,
  ``#/definitions/...``, ...); remote references raise ``ValueError``.

A schema without ``type`` (including ``{}`` and ``true``) yields a string: any
string is valid against keywords that only constrain objects, arrays or
numbers.  ``false`` has no instance and raises ``ValueError``, and so does a
schema the generator finds contradictory (bounds that exclude every value, a
``const`` outside the ``enum``, ``allOf`` members with no common type, more
required members than ``maxProperties``...): an ``anyOf`` then tries its next
option, an optional member or surplus item is left out, and the simulator
answers 400 for a top-level schema.  tests/backends/test_simulator_schema.py
checks this against hypothesis-jsonschema: for every drawn schema it can find
an instance of, this generator must make a valid one.

Recursion guard: every nested object/array level and every ``$ref`` hop counts
as one level of depth.  From depth :data:`RECURSION_LIMIT` (8) on, the generator
only emits required properties and ``minItems`` array items, and prefers options
that do not recurse, so a recursive schema such as a tree of nodes terminates.
A schema that forces unbounded recursion (a required self-reference) has no
finite instance and raises ``ValueError`` at depth :data:`HARD_DEPTH_LIMIT`.
"""

from __future__ import annotations

import functools
import math
import random
import uuid
from fractions import Fraction
from typing import Any

__all__ = ["HARD_DEPTH_LIMIT", "RECURSION_LIMIT", "instance_for"]

RECURSION_LIMIT = 8
HARD_DEPTH_LIMIT = 64

_WORDS = (
    "alpha", "bravo", "ledger", "yield", "asset", "equity", "margin", "quote",
    "signal", "vector", "orbit", "delta", "harbor", "summit", "canvas", "ember",
)
_SCALAR_TYPES = ("null", "boolean", "integer", "number", "string")
_LOWER_BOUND_KEYS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER_BOUND_KEYS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")


def instance_for(schema: dict | bool, seed: int) -> Any:
    """Return a deterministic instance of ``schema`` (see the module docstring).

    Raises ``ValueError`` for schemas outside the supported subset that cannot
    be satisfied (``false``, remote ``$ref``, unbounded required recursion).
    """
    try:
        return _Generator(schema, seed).generate(schema, 0)
    except RecursionError as exc:  # e.g. an allOf/anyOf that references itself
        raise ValueError("schema recursion never reaches a value") from exc


class _Generator:
    def __init__(self, root: dict | bool, seed: int) -> None:
        self._root = root
        self._rng = random.Random(seed)
        self._variant = 0  # > 0 while an array retries for a distinct item: objects then add a member

    # -- dispatch -----------------------------------------------------------

    def generate(self, schema: Any, depth: int) -> Any:
        if depth > HARD_DEPTH_LIMIT:
            raise ValueError("schema has no finite instance (unbounded required recursion)")
        if schema is True or schema == {}:
            return self._string({})
        if schema is False:
            raise ValueError("the schema `false` has no valid instance")
        if not isinstance(schema, dict):
            raise ValueError(f"a schema must be an object or a boolean, not {type(schema).__name__}")

        if "$ref" in schema:
            target = self._resolve(schema["$ref"])
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            merged = _merge([target, siblings]) if _has_constraints(siblings) else target
            return self.generate(merged, depth + 1)
        if "allOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            members = [self._deref(m) for m in schema["allOf"]]
            return self.generate(_merge([rest, *members]), depth)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                error: ValueError | None = None
                for option in self._options(schema[key], depth):  # the preferred one, then the others
                    try:
                        return self.generate(_merge([rest, self._deref(option)]), depth)
                    except ValueError as exc:  # this option has no instance here: try the next
                        error = exc
                raise error if error is not None else ValueError("an empty `anyOf`/`oneOf` has no valid instance")

        if "const" in schema:
            if not _admits(schema["const"], schema):
                raise ValueError("the `const` does not meet the schema's other keywords")
            if "enum" in schema and not any(_json_equal(schema["const"], v) for v in schema["enum"]):
                raise ValueError("the `const` is not a member of the `enum`")
            return schema["const"]
        if "enum" in schema:
            # keep the members the schema's other keywords (type, bounds, lengths) admit
            choices = [v for v in schema["enum"] if _admits(v, schema)]
            if not choices:
                raise ValueError("no `enum` member meets the schema's other keywords" if schema["enum"]
                                 else "an empty `enum` has no valid instance")
            return choices[self._rng.randrange(len(choices))]

        kind = self._pick_type(schema.get("type"), depth)
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self._rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _pick_type(self, declared: Any, depth: int) -> str:
        if declared is None:
            return "string"
        if isinstance(declared, str):
            return declared
        types = list(declared)
        if not types:
            return "string"
        if depth >= RECURSION_LIMIT:
            for name in types:
                if name in _SCALAR_TYPES:
                    return name
        if self._variant:  # an array retrying for a distinct item: another of the types
            return types[self._variant % len(types)]
        return types[0]

    def _options(self, options: list, depth: int) -> list:
        """``options`` in the order to try them: as written, except that past the recursion limit
        those without a ``$ref`` come first, and that a retry for a distinct array item rotates them."""
        if depth >= RECURSION_LIMIT:
            return sorted(options, key=_mentions_ref)  # stable: False (no $ref) first
        if self._variant and options:  # an array retrying for a distinct item: start elsewhere
            shift = self._variant % len(options)
            return [*options[shift:], *options[:shift]]
        return list(options)

    # -- references ----------------------------------------------------------

    def _deref(self, schema: Any) -> Any:
        """Resolve a bare ``{"$ref": ...}`` (used where members are merged)."""
        seen = 0
        while isinstance(schema, dict) and "$ref" in schema and seen < HARD_DEPTH_LIMIT:
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            target = self._resolve(schema["$ref"])
            schema = _merge([target, siblings]) if _has_constraints(siblings) else target
            seen += 1
        return schema

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"only local references are supported, not {ref!r}")
        node: Any = self._root
        pointer = ref[1:]
        if pointer in ("", "/"):
            return node
        for raw in pointer.lstrip("/").split("/"):
            token = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise ValueError(f"unresolvable reference {ref!r}")
        return node

    # -- structured types ----------------------------------------------------

    def _object(self, schema: dict, depth: int) -> dict:
        properties: dict = schema.get("properties") or {}
        required = list(dict.fromkeys(schema.get("required") or []))
        additional = schema.get("additionalProperties", True)
        limited = depth >= RECURSION_LIMIT

        min_props = schema.get("minProperties", 0)
        max_props = schema.get("maxProperties")
        if max_props is not None and max_props < min_props:
            raise ValueError(f"no object has at least {min_props} and at most {max_props} members")
        if max_props is not None and len(required) > max_props:
            raise ValueError(f"{len(required)} required members, at most {max_props} allowed")
        outside = [n for n in required if n not in properties]
        if outside and additional is False:
            raise ValueError(f"required member {outside[0]!r} is not in `properties` and no other is allowed")

        result: dict = {}
        pending = len(required)  # required members not generated yet
        for name, sub in properties.items():
            if name in required:
                result[name] = self.generate(sub, depth + 1)
                pending -= 1
                continue
            if limited and len(result) + pending >= min_props:
                continue  # past the recursion limit, optional members only to reach minProperties
            if max_props is not None and len(result) + pending >= max_props:
                continue
            try:
                result[name] = self.generate(sub, depth + 1)
            except ValueError:
                pass  # an optional member whose schema has no instance (`false`...): left out
        for name in outside:
            result[name] = self.generate(_extra_schema(additional), depth + 1)

        if self._variant and additional is not False and (max_props is None or len(result) < max_props):
            name = f"extra_{self._variant}"
            if name not in result and name not in properties:
                try:
                    result[name] = self.generate(_extra_schema(additional), depth + 1)
                except ValueError:
                    pass
        extra_index = 0
        while len(result) < min_props and additional is not False:
            name = f"extra_{extra_index}"
            extra_index += 1
            if name not in result and name not in properties:
                result[name] = self.generate(_extra_schema(additional), depth + 1)
        if len(result) < min_props:
            raise ValueError(f"no object with the {min_props} members `minProperties` asks for is allowed")
        return result

    def _array(self, schema: dict, depth: int) -> list:
        items = schema.get("items", True)
        prefix = schema.get("prefixItems")
        if isinstance(items, list):  # draft 4..7 tuple form
            prefix, items = items, schema.get("additionalItems", True)
        prefix = list(prefix or [])

        min_items = schema.get("minItems", 0)
        max_items = schema.get("maxItems")
        if max_items is not None and max_items < min_items:
            raise ValueError(f"no array has at least {min_items} and at most {max_items} items")
        if depth >= RECURSION_LIMIT:
            count = min_items
        else:
            count = max(min_items, len(prefix), 2)
            if self._variant:  # a retry for a distinct item of an outer array: another length
                span = max_items - min_items + 1 if max_items is not None else 4
                count = min_items + (count - min_items + self._variant) % span
        if items is False:
            count = min(count, len(prefix))
            if count < min_items:
                raise ValueError(f"`minItems` {min_items} but no item is allowed past the first {len(prefix)}")
        if max_items is not None:
            count = min(count, max_items)
        count = max(count, 0)

        def item_schema(index: int) -> Any:
            return prefix[index] if index < len(prefix) else items

        result: list = []
        for index in range(count):
            try:
                value = self.generate(item_schema(index), depth + 1)
            except ValueError:
                if index < min_items:
                    raise
                break  # items past minItems whose schema has no instance: stop at a valid length
            if not schema.get("uniqueItems"):
                result.append(value)
                continue
            for attempt in range(16):
                if attempt:
                    saved, self._variant = self._variant, attempt
                    try:
                        value = self.generate(item_schema(index), depth + 1)
                    finally:
                        self._variant = saved
                if not any(_json_equal(value, other) for other in result):
                    result.append(value)
                    break
            else:
                if len(result) >= min_items:
                    break  # cannot find a distinct value; stop at a valid length
                raise ValueError(f"found fewer than the {min_items} distinct items `uniqueItems` asks for")
        return result

    # -- scalars -------------------------------------------------------------

    def _string(self, schema: dict) -> str:
        min_len = schema.get("minLength", 0)
        max_len = schema.get("maxLength")
        if max_len is not None and max_len < min_len:
            raise ValueError(f"no string is at least {min_len} and at most {max_len} characters long")
        forms = self._formatted(schema.get("format"), min_len)
        for formatted in forms:  # the usual form, then a short one
            if len(formatted) >= min_len and (max_len is None or len(formatted) <= max_len):
                return formatted
        if forms:
            raise ValueError(f"no {schema['format']} value of the lengths `minLength`/`maxLength` allow")

        word_count = 1 + self._rng.randrange(3)
        text = " ".join(_WORDS[self._rng.randrange(len(_WORDS))] for _ in range(word_count))
        while len(text) < min_len:
            text += " " + _WORDS[self._rng.randrange(len(_WORDS))]
        if max_len is not None:
            text = text[:max_len].rstrip() if max_len >= min_len else text[:max_len]
        if len(text) < min_len:  # rstrip removed too much
            text = text.ljust(min_len, "x")
        return text

    def _formatted(self, fmt: Any, min_len: int = 0) -> tuple[str, ...]:
        """Values for a ``format``: the usual form, then (where the format has them) a short form
        for a tight ``maxLength`` and a long one that reaches ``min_len``; empty for no or an
        unknown format."""
        rng = self._rng
        if fmt in ("email", "uri", "url", "iri", "hostname"):
            word = _WORDS[rng.randrange(len(_WORDS))]
        if fmt in ("date-time", "time"):
            day = f"2024-{1 + rng.randrange(12):02d}-{1 + rng.randrange(28):02d}T" if fmt == "date-time" else ""
            clock = f"{day}{rng.randrange(24):02d}:{rng.randrange(60):02d}:{rng.randrange(60):02d}"
            # fractional seconds (RFC 3339 allows any number of digits) make it as long as needed
            return f"{clock}Z", f"{clock}.{'0' * max(1, min_len - len(clock) - 2)}Z"
        if fmt == "date":
            return (f"2024-{1 + rng.randrange(12):02d}-{1 + rng.randrange(28):02d}",)
        if fmt == "email":
            usual = f"{word}{rng.randrange(1000)}@example.com"
            return usual, f"{word[0]}@{word[1]}.io", usual.rjust(min_len, "x")[-254:]
        if fmt == "uuid":
            return (str(uuid.UUID(int=rng.getrandbits(128), version=4)),)
        if fmt in ("uri", "url", "iri"):
            usual = f"https://example.com/{word}/{rng.randrange(1000)}"
            return usual, f"https://{word[0]}.io", usual.ljust(min_len, "x")
        if fmt == "hostname":
            usual = f"{word}.example.com"
            return usual, f"{word[0]}.io", ".".join(["x" * 63] * (min_len // 64) + [usual])[-253:].lstrip(".")
        if fmt == "ipv4":
            return (f"10.{rng.randrange(256)}.{rng.randrange(256)}.{1 + rng.randrange(254)}", "10.0.0.1",
                    _ipv4_of_length(min_len))
        if fmt == "ipv6":
            return f"fd00::{rng.randrange(0x10000):x}:{1 + rng.randrange(0xFFFF):x}", "::1", _ipv6_of_length(min_len)
        return ()

    def _integer(self, schema: dict) -> int:
        low, high = _integer_bounds(schema)
        multiple = schema.get("multipleOf")
        step = 1
        if multiple is not None and multiple > 0:
            step = Fraction(str(multiple)).numerator  # lcm(multipleOf, 1)
        k_low = math.ceil(Fraction(low, step)) if low is not None else None
        k_high = math.floor(Fraction(high, step)) if high is not None else None
        return step * self._pick_int(k_low, k_high)

    def _number(self, schema: dict) -> float | int:
        multiple = schema.get("multipleOf")
        if multiple is not None and multiple > 0:
            return self._number_multiple(schema, multiple)

        low, low_excl = _bound(schema, "minimum", "exclusiveMinimum", max)
        high, high_excl = _bound(schema, "maximum", "exclusiveMaximum", min)
        if low is None and high is None:
            value = round(self._rng.uniform(0, 100), 2)
            return value + 0.5 if value == int(value) else value
        if low is None:
            low = high - 100
        if high is None:
            high = low + 100
        if low > high or (low == high and (low_excl or high_excl)):
            raise ValueError("no number is within the bounds")
        if low == high:
            return low
        for _ in range(8):
            value = round(self._rng.uniform(low, high), 2)
            if value == int(value):
                value += 0.25 if value + 0.25 < high else -0.25
            if (value > low or (value == low and not low_excl)) and (
                value < high or (value == high and not high_excl)
            ):
                return value
        return (low + high) / 2

    def _number_multiple(self, schema: dict, multiple: float | int) -> float | int:
        low, low_excl = _bound(schema, "minimum", "exclusiveMinimum", max)
        high, high_excl = _bound(schema, "maximum", "exclusiveMaximum", min)
        exact = Fraction(str(multiple))
        k_low = None if low is None else _first_k(Fraction(str(low)), exact, low_excl)
        k_high = None if high is None else _last_k(Fraction(str(high)), exact, high_excl)
        k = self._pick_int(k_low, k_high)  # raises when no multiple is within the bounds
        # Prefer a k whose float product divides back exactly (validators check
        # ``instance / multipleOf`` in floating point).
        candidates = [k] + [k + d for d in range(1, 64)] + [k - d for d in range(1, 64)]
        for candidate in candidates:
            if (k_low is not None and candidate < k_low) or (k_high is not None and candidate > k_high):
                continue
            value = float(candidate * exact) if isinstance(multiple, float) else candidate * multiple
            quotient = value / multiple
            if quotient == int(quotient):
                return value
        return float(k * exact)

    def _pick_int(self, low: int | None, high: int | None) -> int:
        if low is None and high is None:
            return self._rng.randrange(1, 100)
        if low is None:
            low = high - 100
        if high is None:
            high = low + 100
        if high < low:
            raise ValueError("no integer (or multiple of `multipleOf`) is within the bounds")
        return self._rng.randint(low, high)


# -- helpers -----------------------------------------------------------------


def _ipv4_of_length(length: int) -> str:
    """A dotted quad of exactly ``length`` characters where one exists (7 to 15), else the shortest."""
    digits = min(max(length - 3, 4), 12)  # four octets of one to three digits
    sizes = [1, 1, 1, 1]
    for i in range(digits - 4):
        sizes[i % 4] += 1
    return ".".join({1: "1", 2: "10", 3: "100"}[n] for n in sizes)


def _ipv6_of_length(length: int) -> str:
    """An IPv6 address of exactly ``length`` characters where one exists (3 to 39), else the shortest."""
    length = min(max(length, 3), 39)
    if length >= 15:  # eight groups of one to four hex digits
        groups, digits = 8, length - 7
    else:  # "::" then groups
        groups = max(1, min(7, (length - 1) // 2))
        while 2 + groups - 1 + groups > length:
            groups -= 1
        digits = length - 2 - (groups - 1)
    sizes = [1] * groups
    for i in range(digits - groups):
        sizes[i % groups] += 1
    text = ":".join("f" * n for n in sizes)
    return text if groups == 8 else "::" + text


def _has_type(value: Any, declared: Any) -> bool:
    names = [declared] if isinstance(declared, str) else list(declared)
    checks = {
        "null": value is None,
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool)
        or isinstance(value, float) and value.is_integer(),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "string": isinstance(value, str),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
    }
    return any(checks.get(name, False) for name in names)


def _admits(value: Any, schema: dict) -> bool:
    """Whether a ``const``/``enum`` member meets the schema's type and scalar keywords (bounds,
    ``multipleOf``, lengths), which a merged ``allOf`` can put beside it."""
    if "type" in schema and not _has_type(value, schema["type"]):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, low_excl = _bound(schema, "minimum", "exclusiveMinimum", max)
        high, high_excl = _bound(schema, "maximum", "exclusiveMaximum", min)
        if low is not None and (value < low or (low_excl and value == low)):
            return False
        if high is not None and (value > high or (high_excl and value == high)):
            return False
        multiple = schema.get("multipleOf")
        if isinstance(multiple, (int, float)) and multiple > 0:
            try:
                if (Fraction(str(value)) / Fraction(str(multiple))).denominator != 1:
                    return False
            except (ValueError, OverflowError):  # inf or nan
                return False
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return False
        if schema.get("maxLength") is not None and len(value) > schema["maxLength"]:
            return False
        if isinstance(schema.get("format"), str) and not _format_checker().conforms(value, schema["format"]):
            return False
    return True


@functools.cache
def _format_checker():
    """jsonschema's checker of the formats it checks for draft 2020-12 (what a client's validator
    checks; its catch-all `FormatChecker()` would add draft 3's `time`, which refuses RFC 3339's "Z")."""
    import jsonschema

    return jsonschema.Draft202012Validator.FORMAT_CHECKER


def _extra_schema(additional: Any) -> Any:
    return additional if isinstance(additional, dict) else {}


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _mentions_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "$ref" in schema or any(_mentions_ref(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions_ref(v) for v in schema)
    return False


def _has_constraints(schema: dict) -> bool:
    ignored = {"$defs", "definitions", "$schema", "$id", "title", "description", "$comment", "examples", "default"}
    return any(k not in ignored for k in schema)


def _merge(schemas: list[Any]) -> dict:
    """Merge ``allOf`` members into one schema (object members are united)."""
    merged: dict = {}
    for schema in schemas:
        if schema is True or schema is None:
            continue
        if schema is False:
            raise ValueError("an `allOf` containing `false` has no valid instance")
        schema = _cross_additional(merged, schema)
        # the merged side's additionalItems as it was before this member: the member's own may be
        # applied first (its keys come in any order) and must not count as the other side's
        prior_additional_items = merged.get("additionalItems", True)
        for key, value in schema.items():
            if key not in merged:
                merged[key] = value
            elif key == "properties":
                props = dict(merged[key])
                for name, sub in value.items():
                    props[name] = {"allOf": [props[name], sub]} if name in props else sub
                merged[key] = props
            elif key == "required":
                merged[key] = list(dict.fromkeys([*merged[key], *value]))
            elif key in _LOWER_BOUND_KEYS and _both_numeric(merged[key], value):
                merged[key] = max(merged[key], value)
            elif key in _UPPER_BOUND_KEYS and _both_numeric(merged[key], value):
                merged[key] = min(merged[key], value)
            elif key == "type":
                merged[key] = _intersect_types(merged[key], value)
            elif key == "items" and (isinstance(merged[key], list) or isinstance(value, list)):
                # tuples: position by position, each side's additionalItems past its own tuple
                left_rest, right_rest = prior_additional_items, schema.get("additionalItems", True)
                left = merged[key] if isinstance(merged[key], list) else None
                right = value if isinstance(value, list) else None
                if left is None:
                    left_rest = merged[key]  # an all-items schema holds at every position
                if right is None:
                    right_rest = value
                size = max(len(left or ()), len(right or ()))
                merged[key] = [_merge_subschemas(left[i] if left and i < len(left) else left_rest,
                                                 right[i] if right and i < len(right) else right_rest)
                               for i in range(size)]
                merged["additionalItems"] = _merge_subschemas(left_rest, right_rest)
            elif key in ("additionalProperties", "additionalItems", "items", "prefixItems"):
                merged[key] = _merge_subschemas(merged[key], value)
            elif key == "allOf":
                merged[key] = [*merged[key], *value]
            elif key in ("anyOf", "oneOf"):
                # A and anyOf(B) distributes over the options already present.
                merged[key] = [{"allOf": [option, {key: value}]} for option in merged[key]]
            elif key == "enum":
                merged[key] = [v for v in merged[key] if any(_json_equal(v, w) for w in value)]
            elif key == "format" and value != merged[key]:
                checked = _format_checker().checkers
                if value in checked and merged[key] in checked:
                    raise ValueError(f"a value of both formats {merged[key]!r} and {value!r} is not made here")
                if value in checked:
                    merged[key] = value  # two formats: keep the one a validator checks
            elif key == "const":
                if not _json_equal(merged[key], value):
                    raise ValueError("an `allOf` with two different `const` values has no valid instance")
            elif key == "multipleOf" and _both_numeric(merged[key], value) and merged[key] > 0 and value > 0:
                a, b = Fraction(str(merged[key])), Fraction(str(value))  # lcm of the two steps
                step = Fraction(math.lcm(a.numerator, b.numerator), math.gcd(a.denominator, b.denominator))
                merged[key] = int(step) if step.denominator == 1 else float(step)
            else:
                merged[key] = value
    return merged


def _cross_additional(merged: dict, schema: dict) -> dict:
    """Before ``schema`` joins ``merged``: a member's ``additionalProperties`` also holds for the
    properties only the other side names (they are additional to it). Updates ``merged`` in place;
    returns ``schema`` with its own such properties constrained."""
    mine, theirs = merged.get("properties") or {}, schema.get("properties") or {}
    merged_extra, schema_extra = merged.get("additionalProperties", True), schema.get("additionalProperties", True)
    if schema_extra is not True and any(n not in theirs for n in mine):
        merged["properties"] = {n: sub if n in theirs else _merge_subschemas(sub, schema_extra)
                                for n, sub in mine.items()}
    if merged_extra is not True and any(n not in mine for n in theirs):
        schema = {**schema, "properties": {n: sub if n in mine else _merge_subschemas(sub, merged_extra)
                                           for n, sub in theirs.items()}}
    return schema


def _merge_subschemas(a: Any, b: Any) -> Any:
    """Two members' ``additionalProperties``, ``items``... schemas: both hold."""
    if isinstance(a, list) and isinstance(b, list):  # two prefixItems tuples (2020-12)
        size = max(len(a), len(b))
        return [_merge_subschemas(a[i] if i < len(a) else True, b[i] if i < len(b) else True) for i in range(size)]
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


def _both_numeric(a: Any, b: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))


def _intersect_types(a: Any, b: Any) -> Any:
    left = [a] if isinstance(a, str) else list(a)
    right = [b] if isinstance(b, str) else list(b)
    common = [t for t in left if t in right]
    if not common and "number" in left and "integer" in right:
        common = ["integer"]
    if not common and "integer" in left and "number" in right:
        common = ["integer"]
    if not common:
        raise ValueError(f"`allOf` members allow no common type ({a} and {b})")
    return common[0] if len(common) == 1 else common


def _bound(schema: dict, inclusive_key: str, exclusive_key: str, tighter) -> tuple[Any, bool]:
    """Return ``(value, exclusive)`` for one side, draft-4 and draft-6+ forms."""
    inclusive = schema.get(inclusive_key)
    exclusive = schema.get(exclusive_key)
    if isinstance(exclusive, bool):  # draft 4: a flag on the inclusive key
        return inclusive, bool(exclusive) and inclusive is not None
    if inclusive is None and exclusive is None:
        return None, False
    if exclusive is None:
        return inclusive, False
    if inclusive is None:
        return exclusive, True
    value = tighter(inclusive, exclusive)
    return value, value == exclusive


def _integer_bounds(schema: dict) -> tuple[int | None, int | None]:
    low, low_excl = _bound(schema, "minimum", "exclusiveMinimum", max)
    high, high_excl = _bound(schema, "maximum", "exclusiveMaximum", min)
    int_low = None
    if low is not None:
        int_low = math.floor(low) + 1 if low_excl else math.ceil(low)
    int_high = None
    if high is not None:
        int_high = math.ceil(high) - 1 if high_excl else math.floor(high)
    return int_low, int_high


def _first_k(low: Fraction, step: Fraction, exclusive: bool) -> int:
    k = math.ceil(low / step)
    if exclusive and k * step == low:
        k += 1
    return k


def _last_k(high: Fraction, step: Fraction, exclusive: bool) -> int:
    k = math.floor(high / step)
    if exclusive and k * step == high:
        k -= 1
    return k
