"""OpenAPI schema objects to self-contained JSON Schema (every ``$ref`` inlined).

What: `to_json_schema(resolver, schema, version=...)` returns a JSON Schema (draft 2020-12
vocabulary, the dialect OpenAI, Anthropic and MCP tool schemas use) equivalent to an OpenAPI 2.0,
3.0 or 3.1 schema object, with no ``$ref`` left:

* ``$ref`` is replaced by its target. Before 3.1 the siblings of a ``$ref`` are ignored, as the
  specification says; in 3.1 annotation siblings (``description``, ``title``, ``default``, ...)
  override the target's and other siblings are combined with ``allOf``.
* **Recursion** is cut: while a reference is being expanded, a second reference to the same
  target on the same branch becomes a stub ``{"type": <the target's type>, "description":
  "Recursive reference to <Name>; not expanded further ..."}``, which accepts any value of that
  type. So a ``Node`` with ``children: [Node]`` is described two levels deep (the node, and its
  children as "objects"). Nesting deeper than ``max_depth`` is cut the same way.
* 3.0/2.0 keywords become their JSON Schema form: ``nullable``/``x-nullable`` -> ``"null"`` added
  to ``type`` (and to ``enum``); boolean ``exclusiveMinimum``/``exclusiveMaximum`` -> numbers;
  ``example`` -> ``examples``. OpenAPI-only keywords (``discriminator``, ``xml``,
  ``externalDocs``) and ``x-`` extensions are dropped.
* ``direction="request"`` drops ``readOnly`` properties (a client must not send them, and they
  leave ``required``); ``"response"`` drops ``writeOnly`` ones; ``"any"`` keeps both.
* A ``pattern`` that Python's ``re`` cannot compile (ECMA-262 only syntax such as ``\\p{L}``) is
  dropped: argument validation must never fail on the schema itself; the service still checks it.
* ``allOf`` whose parts are all plain object schemas (``properties``/``required``/...) is merged
  into one object schema, which LLMs follow better; anything else is kept as ``allOf``.

Why: LLM tool schemas must be self-contained, and models follow a flat, explicit schema better
than a web of references. Tools, argument validation and the contract aligner all use this form.

Cost: O(size of the expanded schema). Targets expanded without a recursion cut are memoised and
shared between the places that use them (treat the result as read-only). The expanded size is
bounded by ``max_nodes`` (`SchemaTooLarge`), so a schema that references a large graph many
times fails fast instead of growing without bound.
"""

from __future__ import annotations

import re
from typing import Any

from extproc.semantic.openapi import Resolver

__all__ = ["SchemaTooLarge", "UnsupportedSchema", "to_json_schema"]

_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "example", "deprecated",
                          "readOnly", "writeOnly", "$comment"})
_DROP = frozenset({"discriminator", "xml", "externalDocs", "$schema", "$id", "$anchor", "$comment",
                   "$defs", "definitions", "$dynamicAnchor", "nullable", "x-nullable", "example",
                   "collectionFormat"})
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("not", "contains", "propertyNames", "if", "then", "else", "unevaluatedItems",
               "unevaluatedProperties", "additionalItems", "contentSchema")
_SCHEMA_MAPS = ("patternProperties", "dependentSchemas")
_MERGEABLE = frozenset({"type", "properties", "required", "description", "title",
                        "additionalProperties"})


class UnsupportedSchema(ValueError):
    """The schema uses something that cannot be turned into a tool schema (``pointer`` says where)."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(f"#{pointer}: {message}")
        self.pointer = pointer
        self.message = message


class SchemaTooLarge(ValueError):
    """The expanded schema would have more than ``limit`` nodes."""

    def __init__(self, pointer: str, limit: int) -> None:
        super().__init__(f"#{pointer}: the schema expands to more than {limit} nodes "
                         "(every $ref inlined); raise the limit or simplify the schema")
        self.pointer = pointer
        self.limit = limit


class _Expander:
    """State of one `to_json_schema` call: recursion stack, memo, node budget."""

    __slots__ = ("resolver", "version", "direction", "max_nodes", "max_depth", "nodes", "stack",
                 "memo", "origin")

    def __init__(self, resolver: Resolver, version: str, direction: str, max_nodes: int,
                 max_depth: int, origin: str) -> None:
        self.resolver = resolver
        self.version = version
        self.direction = direction
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.nodes = 0
        self.stack: list[str] = []
        self.memo: dict[str, tuple[dict, int]] = {}
        self.origin = origin

    def count(self, n: int) -> None:
        self.nodes += n
        if self.nodes > self.max_nodes:
            raise SchemaTooLarge(self.origin, self.max_nodes)

    def convert(self, node: Any, base: str, ptr: str, depth: int) -> tuple[dict, int, bool]:
        """``(schema, size, cut)``: ``cut`` tells whether a recursion stub is inside."""
        if isinstance(node, bool):
            self.count(1)
            return ({} if node else {"not": {}}), 1, False
        if not isinstance(node, dict):
            raise UnsupportedSchema(ptr, f"a schema must be an object, not {type(node).__name__}")
        ref = node.get("$ref")
        if isinstance(ref, str):
            return self.convert_ref(node, ref, base, ptr, depth)
        if depth > self.max_depth:
            self.count(1)
            return _stub(node, f"nesting deeper than {self.max_depth} levels"), 1, True
        if "$dynamicRef" in node or "$recursiveRef" in node:
            raise UnsupportedSchema(ptr, "$dynamicRef/$recursiveRef are not supported")
        self.count(1)
        out: dict[str, Any] = {}
        size, cut = 1, False
        dropped: set[str] = set()
        for key, value in node.items():
            if key in _DROP or key.startswith("x-"):
                continue
            if key == "type":
                if value == "file":
                    raise UnsupportedSchema(f"{ptr}/type", "type 'file' (a file upload) is not supported")
                out[key] = value
            elif key == "properties" and isinstance(value, dict):
                props = {}
                for name, sub in value.items():
                    s, n, c = self.convert(sub, base, f"{ptr}/properties/{_esc(name)}", depth + 1)
                    size += n
                    cut |= c
                    if (self.direction == "request" and s.get("readOnly") is True) or (
                            self.direction == "response" and s.get("writeOnly") is True):
                        dropped.add(name)
                        continue
                    props[name] = s
                out[key] = props
            elif key in ("items", "additionalProperties") or key in _SCHEMA_ONE:
                if isinstance(value, bool):
                    out[key] = value
                elif key == "items" and isinstance(value, list):  # draft-4 tuple form
                    subs = [self.convert(s, base, f"{ptr}/items/{i}", depth + 1) for i, s in enumerate(value)]
                    out["prefixItems"] = [s for s, _, _ in subs]
                    size += sum(n for _, n, _ in subs)
                    cut |= any(c for _, _, c in subs)
                else:
                    s, n, c = self.convert(value, base, f"{ptr}/{key}", depth + 1)
                    out[key], size, cut = s, size + n, cut | c
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                subs = [self.convert(s, base, f"{ptr}/{key}/{i}", depth + 1) for i, s in enumerate(value)]
                out[key] = [s for s, _, _ in subs]
                size += sum(n for _, n, _ in subs)
                cut |= any(c for _, _, c in subs)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                m = {}
                for name, sub in value.items():
                    s, n, c = self.convert(sub, base, f"{ptr}/{key}/{_esc(name)}", depth + 1)
                    m[name], size, cut = s, size + n, cut | c
                out[key] = m
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
                bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                if value and bound in node:
                    out[key] = node[bound]
            elif key in ("minimum", "maximum") and node.get(
                    "exclusiveMinimum" if key == "minimum" else "exclusiveMaximum") is True:
                continue
            elif key == "pattern" and not _compiles(value):
                continue
            else:
                out[key] = value
        if "example" in node and "examples" not in node:
            out["examples"] = [node["example"]]
        if dropped and isinstance(out.get("required"), list):
            out["required"] = [r for r in out["required"] if r not in dropped]
            if not out["required"]:
                del out["required"]
        if self.version != "3.1" and (node.get("nullable") is True or node.get("x-nullable") is True):
            out = _nullable(out)
        if "allOf" in out:
            out = _merge_all_of(out)
        return out, size, cut

    def convert_ref(self, node: dict, ref: str, base: str, ptr: str, depth: int) -> tuple[dict, int, bool]:
        try:
            target, tbase, canonical = self.resolver.resolve(ref, base)
        except LookupError as e:
            raise UnsupportedSchema(f"{ptr}/$ref", str(e)) from None
        if canonical in self.stack:
            self.count(1)
            return _stub(target, f"recursive reference to {_ref_name(ref)}"), 1, True
        if canonical in self.memo:
            schema, size = self.memo[canonical]
            self.count(size)
            cut = False
        else:
            self.stack.append(canonical)
            try:
                schema, size, cut = self.convert(target, tbase, ref.partition("#")[2] or ptr, depth)
            finally:
                self.stack.pop()
            if not cut:
                self.memo[canonical] = (schema, size)
        if self.version == "3.1":
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            if siblings:
                if set(siblings) <= _ANNOTATIONS:
                    extra, n, c = self.convert(siblings, base, ptr, depth)
                    return {**schema, **extra}, size + n, cut or c
                extra, n, c = self.convert(siblings, base, ptr, depth)
                return _merge_all_of({"allOf": [schema, extra]}), size + n + 1, cut or c
        return schema, size, cut


def _compiles(pattern: Any) -> bool:
    """Whether Python's re (which jsonschema uses) accepts an ECMA-262 ``pattern``."""
    try:
        re.compile(pattern)
    except (re.error, TypeError):
        return False
    return True


def _esc(token: str) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1] or ref


def _stub(target: Any, why: str) -> dict:
    """What a cut reference becomes: the target's type (when simple) and a description."""
    stub: dict[str, Any] = {}
    if isinstance(target, dict):
        t = target.get("type")
        if isinstance(t, str) and t != "file":
            stub["type"] = t
        elif isinstance(t, list):
            stub["type"] = list(t)
        elif "properties" in target:
            stub["type"] = "object"
    stub["description"] = f"{why[:1].upper()}{why[1:]}; not expanded further (any value of this type is accepted here)."
    return stub


def _nullable(out: dict) -> dict:
    """Add ``null`` to a schema's accepted values (OpenAPI 3.0 ``nullable: true``)."""
    t = out.get("type")
    if isinstance(t, str):
        out["type"] = [t, "null"]
    elif isinstance(t, list):
        if "null" not in t:
            out["type"] = [*t, "null"]
    else:
        return {"anyOf": [out, {"type": "null"}]}
    if isinstance(out.get("enum"), list) and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def _merge_all_of(out: dict) -> dict:
    """Merge ``allOf`` of plain object schemas into one object schema; else return ``out``.

    Does not mutate its input (parts may be memoised and shared).
    """
    outer = {k: v for k, v in out.items() if k != "allOf"}
    parts = [outer, *out["allOf"]]
    if not all(isinstance(p, dict) and set(p) <= _MERGEABLE and p.get("type", "object") == "object"
               for p in parts):
        return out
    props: dict[str, Any] = {}
    required: list[str] = []
    merged: dict[str, Any] = {"type": "object"}
    for p in parts:
        for name, s in (p.get("properties") or {}).items():
            if name in props and props[name] != s:
                return out  # two different definitions of one property: keep allOf
            props[name] = s
        for r in p.get("required") or ():
            if r not in required:
                required.append(r)
        for key in ("title", "description"):
            if key in p and key not in merged:
                merged[key] = p[key]
        if "additionalProperties" in p:
            ap = p["additionalProperties"]
            if ap is False or "additionalProperties" not in merged:
                merged["additionalProperties"] = ap
    merged["properties"] = props
    if required:
        merged["required"] = required
    if "description" in outer:
        merged["description"] = outer["description"]
    return merged


def to_json_schema(resolver: Resolver, schema: Any, *, version: str, base: str = "",
                   pointer: str = "", direction: str = "any", max_nodes: int = 20_000,
                   max_depth: int = 48) -> dict:
    """The self-contained JSON Schema for an OpenAPI ``schema`` (see the module docstring).

    ``base`` is the document ``schema`` was read from (``""``: the root document), ``pointer``
    where it is (for error messages). Raises `UnsupportedSchema` or `SchemaTooLarge`.
    """
    if direction not in ("request", "response", "any"):
        raise ValueError(f"direction must be 'request', 'response' or 'any', not {direction!r}")
    exp = _Expander(resolver, version, direction, max_nodes, max_depth, pointer)
    out, _, _ = exp.convert(schema, base, pointer, 0)
    return out
