"""Read, check and navigate OpenAPI documents (3.0, 3.1 and Swagger 2.0).

What: `load_spec(path_or_bytes)` decodes the bytes (UTF-8, or UTF-16/32 by BOM or NUL pattern, or
an explicit ``encoding``), parses JSON or YAML, checks the structure the tool builder and the
aligner rely on, and returns a `Spec`. Every fault is a `Problem` with the JSON pointer of the
faulty node (``#/paths/~1pets/get/parameters/0/in``); `SpecError` carries them all.
`Resolver` follows ``$ref`` strings (local pointers and relative files) for the other modules.

Why: the semantic layer turns service contracts into LLM tools and field mappings; a wrong contract
must fail at build time with a location a person can find, never half-way through a request.
The checks are hand-written rather than the OAI meta-schemas because the meta-schemas answer
"valid under none of oneOf" for most faults, and we want the node that is wrong.

What is checked (a subset of the specification: the parts whose faults would make a wrong tool):
the version field; ``info.title``/``info.version``; ``paths`` keys and item types; operations and
their ``responses``; parameters (``name``, ``in``, path parameters required, ``schema`` or
``content``; path templates and declared path parameters agree); request bodies; schema keyword
types (``type``, ``properties``, ``items``, ``required``, ``allOf``/``anyOf``/``oneOf``, ...);
every local ``$ref`` resolves; ``operationId`` values are unique. Unknown fields are ignored.

YAML is read with the safe loader (libyaml when present) with timestamps left as strings, and
mapping keys are made strings (YAML reads ``200:`` as an integer). Shared YAML anchors stay shared
objects: every walk here is bounded by the node count of the document as written.

Cost: O(document size) to decode, parse and check; about 0.2 s for the 465 KB Docker Engine spec
with libyaml, most of it YAML parsing. A `Resolver` caches relative files it has read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote

import orjson
import yaml

__all__ = [
    "HTTP_METHODS",
    "MAX_SPEC_BYTES",
    "Problem",
    "Resolver",
    "Spec",
    "SpecError",
    "decode_bytes",
    "escape_token",
    "iter_operations",
    "join_pointer",
    "load_spec",
    "parse_document",
    "parse_spec",
    "validate_document",
]

MAX_SPEC_BYTES = 64 * 1024 * 1024
"""Documents larger than this are refused before parsing (64 MiB)."""

HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
"""Operation keys of a path item, in the order tools are emitted."""

_MAX_PROBLEMS = 100
_PARAM_LOCATIONS_3 = frozenset({"query", "header", "path", "cookie"})
_PARAM_LOCATIONS_2 = frozenset({"query", "header", "path", "formData", "body"})
_SCHEMA_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
_SCHEMA_TYPES_2 = _SCHEMA_TYPES | {"file"}
_TEMPLATE_RE = re.compile(r"\{([^{}/]+)\}")
_DATA_KEYS = frozenset({"example", "examples", "default", "enum", "const"})


# --------------------------------------------------------------------------
# Errors and results
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One fault in a document: ``pointer`` is a JSON pointer (``""`` is the root)."""

    pointer: str
    message: str

    def __str__(self) -> str:
        return f"#{self.pointer}: {self.message}"


class SpecError(ValueError):
    """The input is not a usable OpenAPI document.

    ``problems`` lists every fault found (at most 100), each with its JSON pointer; ``pointer`` is
    the first one's. ``source`` names the input. For undecodable or unparsable input the pointer is
    ``""`` and ``line``/``column`` (1-based) say where, when known.
    """

    def __init__(self, source: str, problems: list[Problem], line: int | None = None,
                 column: int | None = None) -> None:
        self.source = source
        self.problems = tuple(problems)
        self.pointer = problems[0].pointer if problems else ""
        self.line = line
        self.column = column
        where = f"{source}:{line}:{column}: " if line is not None else f"{source}: "
        lines = [where + str(p) for p in self.problems[:20]]
        if len(self.problems) > 20:
            lines.append(f"... and {len(self.problems) - 20} more problem(s)")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.source, list(self.problems), self.line, self.column))


@dataclass(frozen=True)
class Spec:
    """A checked OpenAPI document.

    ``doc`` is the parsed document (treat it as read-only), ``version`` one of ``"2.0"``,
    ``"3.0"``, ``"3.1"``; ``source`` the file name or ``"<input>"``; ``base_dir`` the folder
    relative ``$ref`` files are read from (None: relative files are not followed).
    """

    doc: dict
    version: str
    source: str = "<input>"
    base_dir: Path | None = None
    problems: tuple = field(default=(), compare=False)

    @property
    def title(self) -> str:
        info = self.doc.get("info")
        return str(info.get("title", "")) if isinstance(info, dict) else ""


# --------------------------------------------------------------------------
# JSON pointers
# --------------------------------------------------------------------------


def escape_token(token: Any) -> str:
    """One JSON-pointer reference token: ``~`` -> ``~0``, ``/`` -> ``~1`` (RFC 6901)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def join_pointer(pointer: str, *tokens: Any) -> str:
    """``pointer`` extended by ``tokens`` (each escaped). O(length)."""
    return pointer + "".join("/" + escape_token(t) for t in tokens)


def _split_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError(f"JSON pointer {pointer!r} must be empty or start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _walk_pointer(doc: Any, pointer: str) -> Any:
    """The node at ``pointer``; raises LookupError naming the first token that is missing."""
    cur = doc
    for token in _split_pointer(pointer):
        if isinstance(cur, dict):
            if token not in cur:
                raise LookupError(f"no {token!r} in the object")
            cur = cur[token]
        elif isinstance(cur, list):
            if not token.isdigit() or int(token) >= len(cur) or (token != "0" and token[0] == "0"):
                raise LookupError(f"no index {token!r} in the array of {len(cur)}")
            cur = cur[int(token)]
        else:
            raise LookupError(f"cannot step into a {type(cur).__name__} with {token!r}")
    return cur


# --------------------------------------------------------------------------
# Bytes -> text -> document
# --------------------------------------------------------------------------

_BOMS = (
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\xef\xbb\xbf", "utf-8-sig"),
    (b"\xfe\xff", "utf-16-be"),
    (b"\xff\xfe", "utf-16-le"),
)


def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    line = data.count(b"\n", 0, offset) + 1
    start = data.rfind(b"\n", 0, offset) + 1
    return line, offset - start + 1


def decode_bytes(data: bytes, source: str = "<input>", encoding: str | None = None) -> str:
    """Text of a document: ``encoding`` if given, else by BOM / NUL pattern, else strict UTF-8.

    Why: JSON must be UTF-8 (RFC 8259) and YAML is UTF-8 or UTF-16/32 with a BOM; silently
    replacing bad bytes would put U+FFFD into tool names and descriptions. A file in a legacy
    encoding is refused with the offset of the first bad byte; pass ``encoding`` (for example
    ``"latin-1"`` or ``"gb18030"``) to read it anyway. Cost: O(size).
    """
    if encoding is None:
        for bom, enc in _BOMS:
            if data.startswith(bom):
                encoding = enc
                break
        else:
            head = data[:4]
            if len(head) == 4 and head[0] == 0 and head[1] == 0 and head[2] == 0:
                encoding = "utf-32-be"
            elif len(head) == 4 and head[1] == 0 and head[2] == 0 and head[3] == 0:
                encoding = "utf-32-le"
            elif len(head) >= 2 and head[0] == 0:
                encoding = "utf-16-be"
            elif len(head) >= 2 and head[1] == 0:
                encoding = "utf-16-le"
            else:
                encoding = "utf-8"
    try:
        text = data.decode(encoding)
    except LookupError:
        raise SpecError(source, [Problem("", f"unknown text encoding {encoding!r}")]) from None
    except UnicodeDecodeError as e:
        line, col = _line_col(data, e.start)
        hint = "" if encoding not in ("utf-8", "utf-8-sig") else (
            "; the file is not UTF-8: name its encoding (e.g. --encoding latin-1)")
        raise SpecError(source, [Problem("", f"cannot decode as {encoding}: byte 0x{data[e.start]:02x} "
                                         f"at offset {e.start}{hint}")], line, col) from None
    return text[1:] if text.startswith("\ufeff") else text


def _make_yaml_loader() -> type:
    """The safe loader (C if available) without the timestamp resolver: dates stay strings."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    resolvers = {
        first: [(tag, rx) for tag, rx in entries if tag != "tag:yaml.org,2002:timestamp"]
        for first, entries in base.yaml_implicit_resolvers.items()
    }
    return type("_SpecYamlLoader", (base,), {"yaml_implicit_resolvers": resolvers})


_YAML_LOADER = _make_yaml_loader()


def _string_keys(node: Any) -> Any:
    """Make every mapping key a string, in place; shared nodes are visited once. O(nodes)."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, dict):
            if any(type(k) is not str for k in cur):
                items = list(cur.items())
                cur.clear()
                for k, v in items:
                    key = k if isinstance(k, str) else ("true" if k is True else "false" if k is False
                                                        else "null" if k is None else str(k))
                    cur[key] = v
            stack.extend(v for v in cur.values() if isinstance(v, (dict, list)))
        elif isinstance(cur, list):
            stack.extend(v for v in cur if isinstance(v, (dict, list)))
    return node


def parse_document(text: str, source: str = "<input>") -> Any:
    """Parse JSON (fast path, orjson) or YAML text; raise `SpecError` with line and column.

    Cost: O(size); YAML is about 20 times slower than JSON even with libyaml.
    """
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # YAML flow style, comments, duplicate keys...: let the YAML parser judge
    try:
        doc = yaml.load(text, Loader=_YAML_LOADER)  # noqa: S506 - a safe loader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        line = mark.line + 1 if mark is not None else None
        col = mark.column + 1 if mark is not None else None
        raise SpecError(source, [Problem("", f"not valid YAML or JSON: {problem}")], line, col) from None
    except RecursionError:
        raise SpecError(source, [Problem("", "document nesting too deep to parse")]) from None
    return _string_keys(doc)


# --------------------------------------------------------------------------
# $ref resolution
# --------------------------------------------------------------------------


class Resolver:
    """Follows ``$ref`` strings from a `Spec`.

    A reference is resolved against the document it appears in (``base``: ``""`` for the root
    document, else the path of a file read for an earlier reference). Local pointers
    (``#/components/schemas/Pet``, percent-encoded or not) and relative files
    (``schemas/pet.yaml#/Pet``) are followed; URLs are refused (no network access at build time).
    Files are read only when the spec has a ``base_dir``, once each (cached on this object).
    Cost: O(pointer length) per reference after the first read of a file.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self._docs: dict[str, Any] = {"": spec.doc}

    def resolve(self, ref: str, base: str = "") -> tuple[Any, str, str]:
        """``(target, target_base, canonical)`` for ``ref`` seen in document ``base``.

        ``canonical`` identifies the target (``file#pointer``) for recursion detection.
        Raises LookupError with a reason when the reference cannot be followed.
        """
        if not isinstance(ref, str):
            raise LookupError(f"$ref must be a string, not {type(ref).__name__}")
        file_part, _, fragment = ref.partition("#")
        if file_part:
            if "://" in file_part or file_part.startswith("//"):
                raise LookupError(f"$ref {ref!r} points outside the document (URLs are not followed)")
            if self.spec.base_dir is None:
                raise LookupError(f"$ref {ref!r} names another file, and the document was not read "
                                  "from a file")
            base_dir = Path(base).parent if base else self.spec.base_dir
            target_file = str((base_dir / unquote(file_part)).resolve())
            doc = self._load(target_file, ref)
            base = target_file
        else:
            doc = self._docs[base]
        pointer = unquote(fragment)
        if pointer and not pointer.startswith("/"):
            raise LookupError(f"$ref {ref!r}: only JSON-pointer fragments are supported, not anchors")
        try:
            target = _walk_pointer(doc, pointer)
        except LookupError as e:
            raise LookupError(f"$ref {ref!r} does not resolve: {e}") from None
        return target, base, f"{base}#{pointer}"

    def _load(self, path: str, ref: str) -> Any:
        if path not in self._docs:
            try:
                data = Path(path).read_bytes()
            except OSError as e:
                raise LookupError(f"$ref {ref!r}: cannot read {path}: {e.strerror}") from None
            try:
                self._docs[path] = parse_document(decode_bytes(data, path), path)
            except SpecError as e:
                raise LookupError(f"$ref {ref!r}: {e}") from None
        return self._docs[path]

    def deref(self, node: Any, base: str = "", limit: int = 32) -> tuple[Any, str]:
        """Follow a chain of ``$ref`` objects (parameters, request bodies, path items...).

        Returns ``(node, base)``; raises LookupError for a broken or circular chain.
        """
        seen = []
        while isinstance(node, dict) and isinstance(node.get("$ref"), str):
            node, base, canonical = self.resolve(node["$ref"], base)
            if canonical in seen or len(seen) >= limit:
                raise LookupError(f"circular $ref chain through {canonical}")
            seen.append(canonical)
        return node, base


# --------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------


def iter_operations(spec: Spec, resolver: Resolver | None = None) -> Iterator[tuple[str, str, dict, dict, str]]:
    """Yield ``(path, method, operation, path_item, pointer)`` in document order.

    Path items given by ``$ref`` (3.1 ``components.pathItems``) are followed; a path item that
    cannot be resolved is skipped here (`validate_document` reports it). ``x-`` keys are skipped.
    """
    resolver = resolver or Resolver(spec)
    paths = spec.doc.get("paths")
    if not isinstance(paths, dict):
        return
    for path, item in paths.items():
        if not isinstance(path, str) or path.startswith("x-"):
            continue
        pointer = join_pointer("/paths", path)
        try:
            item, _ = resolver.deref(item)
        except LookupError:
            continue
        if not isinstance(item, dict):
            continue
        for method in HTTP_METHODS:
            op = item.get(method)
            if isinstance(op, dict):
                yield path, method, op, item, join_pointer(pointer, method)


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------


class _Checker:
    """Collects `Problem`s; one instance per `validate_document` call."""

    def __init__(self, doc: dict, version: str, base_dir: Path | None) -> None:
        self.doc = doc
        self.version = version
        self.problems: list[Problem] = []
        self.spec = Spec(doc, version, base_dir=base_dir)
        self.resolver = Resolver(self.spec)
        self._schemas_seen: set[int] = set()

    def add(self, pointer: str, message: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(Problem(pointer, message))

    def expect(self, node: Any, kind: type | tuple, pointer: str, what: str) -> bool:
        if isinstance(node, kind) and not (kind is int and isinstance(node, bool)):
            return True
        self.add(pointer, f"{what} must be {_kind_name(kind)}, not {_type_name(node)}")
        return False

    # -- document ----------------------------------------------------------

    def run(self) -> list[Problem]:
        doc, v = self.doc, self.version
        info = doc.get("info")
        if info is None:
            self.add("", "missing required field 'info'")
        elif self.expect(info, dict, "/info", "info"):
            for key in ("title", "version"):
                if key not in info:
                    self.add("/info", f"missing required field '{key}'")
                elif not isinstance(info[key], str):
                    self.add(f"/info/{key}", f"info.{key} must be a string, not {_type_name(info[key])}")
        paths = doc.get("paths")
        if paths is None:
            if v != "3.1":
                self.add("", "missing required field 'paths'")
            elif not any(k in doc for k in ("components", "webhooks")):
                self.add("", "an OpenAPI 3.1 document needs 'paths', 'components' or 'webhooks'")
        elif self.expect(paths, dict, "/paths", "paths"):
            self.check_paths(paths)
        self.check_components()
        self.check_refs()
        return self.problems

    def check_components(self) -> None:
        if self.version == "2.0":
            defs = self.doc.get("definitions")
            if defs is not None and self.expect(defs, dict, "/definitions", "definitions"):
                for name, schema in defs.items():
                    self.check_schema(schema, join_pointer("/definitions", name))
            return
        comps = self.doc.get("components")
        if comps is None or not self.expect(comps, dict, "/components", "components"):
            return
        schemas = comps.get("schemas")
        if schemas is not None and self.expect(schemas, dict, "/components/schemas", "components.schemas"):
            for name, schema in schemas.items():
                self.check_schema(schema, join_pointer("/components/schemas", name))

    def check_paths(self, paths: dict) -> None:
        op_ids: dict[str, str] = {}
        for path, item in paths.items():
            pointer = join_pointer("/paths", path)
            if path.startswith("x-"):
                continue
            if not path.startswith("/"):
                self.add(pointer, f"path {path!r} must start with '/'")
                continue
            if _TEMPLATE_RE.sub("", path).count("{") or _TEMPLATE_RE.sub("", path).count("}"):
                self.add(pointer, f"path {path!r} has unbalanced braces in its template")
                continue
            try:
                item, base = self.resolver.deref(item)
            except LookupError as e:
                self.add(join_pointer(pointer, "$ref"), str(e))
                continue
            if not self.expect(item, dict, pointer, "a path item"):
                continue
            item_params = self.check_parameters(item.get("parameters"), join_pointer(pointer, "parameters"), base)
            for method in HTTP_METHODS:
                if method not in item:
                    continue
                op_ptr = join_pointer(pointer, method)
                op = item[method]
                if not self.expect(op, dict, op_ptr, "an operation"):
                    continue
                self.check_operation(path, op, op_ptr, item_params, op_ids, base)

    def check_operation(self, path: str, op: dict, ptr: str, item_params: dict, op_ids: dict,
                        base: str = "") -> None:
        op_id = op.get("operationId")
        if op_id is not None:
            if not isinstance(op_id, str):
                self.add(f"{ptr}/operationId", f"operationId must be a string, not {_type_name(op_id)}")
            elif op_id in op_ids:
                self.add(f"{ptr}/operationId", f"operationId {op_id!r} is also used at #{op_ids[op_id]}; "
                         "operationIds must be unique")
            else:
                op_ids[op_id] = ptr
        for key in ("summary", "description"):
            if key in op and not isinstance(op[key], str):
                self.add(f"{ptr}/{key}", f"{key} must be a string, not {_type_name(op[key])}")
        if "responses" not in op:
            if self.version != "3.1":
                self.add(ptr, "missing required field 'responses'")
        elif self.expect(op["responses"], dict, f"{ptr}/responses", "responses"):
            for code, resp in op["responses"].items():
                rptr = join_pointer(f"{ptr}/responses", code)
                try:
                    resp, _ = self.resolver.deref(resp, base)
                except LookupError as e:
                    self.add(f"{rptr}/$ref", str(e))
                    continue
                if self.expect(resp, dict, rptr, "a response") and self.version != "2.0":
                    self.check_content(resp.get("content"), f"{rptr}/content")
        params = dict(item_params)
        params.update(self.check_parameters(op.get("parameters"), f"{ptr}/parameters", base))
        if "requestBody" in op:
            if self.version == "2.0":
                self.add(f"{ptr}/requestBody", "requestBody is OpenAPI 3; Swagger 2.0 uses an 'in: body' parameter")
            else:
                try:
                    body, _ = self.resolver.deref(op["requestBody"], base)
                except LookupError as e:
                    self.add(f"{ptr}/requestBody/$ref", str(e))
                else:
                    if self.expect(body, dict, f"{ptr}/requestBody", "requestBody"):
                        if "content" not in body:
                            self.add(f"{ptr}/requestBody", "missing required field 'content'")
                        else:
                            self.check_content(body["content"], f"{ptr}/requestBody/content")
        if "callbacks" in op:
            self.expect(op["callbacks"], dict, f"{ptr}/callbacks", "callbacks")
        declared = {name for (name, loc) in params if loc == "path"}
        templated = _TEMPLATE_RE.findall(path)
        for name in templated:
            if name not in declared:
                self.add(ptr, f"path template {path!r} uses {{{name}}} but the operation declares no "
                         f"path parameter {name!r}")
        for (name, loc), pptr in params.items():
            if loc == "path" and name not in templated:
                self.add(pptr, f"path parameter {name!r} does not appear in the path {path!r}")

    def check_parameters(self, params: Any, ptr: str, base: str = "") -> dict:
        """Check a parameter list; return {(name, in): pointer} of the well-formed ones."""
        out: dict = {}
        if params is None or not self.expect(params, list, ptr, "parameters"):
            return out
        locations = _PARAM_LOCATIONS_2 if self.version == "2.0" else _PARAM_LOCATIONS_3
        for i, p in enumerate(params):
            pptr = f"{ptr}/{i}"
            try:
                p, _ = self.resolver.deref(p, base)
            except LookupError as e:
                self.add(f"{pptr}/$ref", str(e))
                continue
            if not self.expect(p, dict, pptr, "a parameter"):
                continue
            name, loc = p.get("name"), p.get("in")
            if not isinstance(name, str):
                self.add(pptr, "parameter needs a string 'name'" if name is None
                         else f"parameter name must be a string, not {_type_name(name)}")
                continue
            if not isinstance(loc, str) or loc not in locations:  # a list or mapping is not hashable
                shown = repr(loc) if loc is None or isinstance(loc, str) else _type_name(loc)
                self.add(f"{pptr}/in", f"parameter 'in' must be one of {', '.join(sorted(locations))}, not {shown}")
                continue
            if loc == "path" and p.get("required") is not True:
                self.add(pptr, f"path parameter {name!r} must have 'required: true'")
            if (name, loc) in out:
                self.add(pptr, f"parameter {name!r} in {loc} is declared twice in this list")
            out[(name, loc)] = pptr
            if self.version == "2.0":
                if loc == "body":
                    if "schema" not in p:
                        self.add(pptr, "a body parameter needs 'schema'")
                    else:
                        self.check_schema(p["schema"], f"{pptr}/schema")
                else:
                    t = p.get("type")
                    if not isinstance(t, str) or t not in _SCHEMA_TYPES_2 - {"object", "null"}:  # (unhashable)
                        self.add(f"{pptr}/type", f"parameter type must be one of string, number, integer, "
                                 f"boolean, array, file, not {t!r}")
                    if "items" in p:
                        self.check_schema(p["items"], f"{pptr}/items")
            else:
                has_schema, has_content = "schema" in p, "content" in p
                if has_schema == has_content:
                    self.add(pptr, "a parameter needs exactly one of 'schema' and 'content'")
                elif has_schema:
                    self.check_schema(p["schema"], f"{pptr}/schema")
                else:
                    content = p["content"]
                    if self.check_content(content, f"{pptr}/content") and len(content) != 1:
                        self.add(f"{pptr}/content", "a parameter's content must have exactly one media type")
        return out

    def check_content(self, content: Any, ptr: str) -> bool:
        if content is None:
            return False
        if not self.expect(content, dict, ptr, "content"):
            return False
        for media, mt in content.items():
            mptr = join_pointer(ptr, media)
            if self.expect(mt, dict, mptr, "a media type object") and "schema" in mt:
                self.check_schema(mt["schema"], f"{mptr}/schema")
        return True

    # -- schemas -----------------------------------------------------------

    def check_schema(self, schema: Any, ptr: str, depth: int = 0) -> None:
        if isinstance(schema, bool) and self.version == "3.1":
            return
        if not isinstance(schema, dict):
            self.add(ptr, f"a schema must be an object, not {_type_name(schema)}")
            return
        if id(schema) in self._schemas_seen or depth > 200:
            return
        self._schemas_seen.add(id(schema))
        if isinstance(schema.get("$ref"), str):
            if self.version != "3.1":
                return  # siblings of $ref are ignored before 3.1
        allowed = _SCHEMA_TYPES_2 if self.version == "2.0" else _SCHEMA_TYPES
        if "type" in schema:
            t = schema["type"]
            types = t if isinstance(t, list) and self.version == "3.1" else [t]
            for x in types:
                if not isinstance(x, str):  # a list or mapping is not hashable
                    self.add(f"{ptr}/type", f"schema type must be a string, not {_type_name(x)}")
                elif x not in allowed or (x == "null" and self.version != "3.1"):
                    self.add(f"{ptr}/type", f"unknown schema type {x!r}" + (
                        " (use 'nullable: true' before OpenAPI 3.1)" if x == "null" else ""))
        if "properties" in schema and self.expect(schema["properties"], dict, f"{ptr}/properties", "properties"):
            for name, sub in schema["properties"].items():
                self.check_schema(sub, join_pointer(f"{ptr}/properties", name), depth + 1)
        if "required" in schema:
            req = schema["required"]
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                self.add(f"{ptr}/required", "required must be a list of property names")
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if key in schema and self.expect(schema[key], list, f"{ptr}/{key}", key):
                for i, sub in enumerate(schema[key]):
                    self.check_schema(sub, f"{ptr}/{key}/{i}", depth + 1)
        for key in ("items", "not", "additionalProperties", "contains", "propertyNames", "if", "then", "else"):
            if key not in schema:
                continue
            sub = schema[key]
            if key == "additionalProperties" and isinstance(sub, bool):
                continue
            if key == "items" and isinstance(sub, list) and self.version == "2.0":
                for i, s in enumerate(sub):
                    self.check_schema(s, f"{ptr}/items/{i}", depth + 1)
                continue
            self.check_schema(sub, f"{ptr}/{key}", depth + 1)
        if "enum" in schema and not isinstance(schema["enum"], list):
            self.add(f"{ptr}/enum", f"enum must be a list, not {_type_name(schema['enum'])}")
        for key in ("$defs", "patternProperties", "dependentSchemas"):
            if key in schema and self.expect(schema[key], dict, f"{ptr}/{key}", key):
                for name, sub in schema[key].items():
                    self.check_schema(sub, join_pointer(f"{ptr}/{key}", name), depth + 1)

    # -- references --------------------------------------------------------

    def check_refs(self) -> None:
        """Every local ``$ref`` (string value) resolves. Data values (examples...) are skipped."""
        seen: set[int] = set()
        stack: list[tuple[Any, str]] = [(self.doc, "")]
        while stack:
            node, ptr = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and (ref.startswith("#") or ref == ""):
                    try:
                        self.resolver.resolve(ref)
                    except LookupError as e:
                        self.add(f"{ptr}/$ref", str(e))
                for k, v in node.items():
                    if isinstance(v, (dict, list)) and k not in _DATA_KEYS and not k.startswith("x-"):
                        stack.append((v, join_pointer(ptr, k)))
            else:
                for i, v in enumerate(node):
                    if isinstance(v, (dict, list)):
                        stack.append((v, f"{ptr}/{i}"))


def _type_name(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(v), type(v).__name__)


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({dict: "an object", list: "an array", str: "a string", int: "an integer",
                        bool: "a boolean"}.get(k, k.__name__) for k in kinds)


def _version_of(doc: Any) -> tuple[str | None, list[Problem]]:
    if not isinstance(doc, dict):
        return None, [Problem("", f"an OpenAPI document must be an object, not {_type_name(doc)}")]
    if "openapi" in doc:
        v = doc["openapi"]
        if not isinstance(v, str):
            return None, [Problem("/openapi", f"openapi must be a version string such as \"3.1.0\", not "
                                  f"{_type_name(v)} (quote it in YAML)")]
        m = re.fullmatch(r"3\.([0-9]+)\.[0-9]+(-.+)?", v)
        if not m or m.group(1) not in ("0", "1"):
            return None, [Problem("/openapi", f"unsupported OpenAPI version {v!r}: expected 3.0.x or 3.1.x "
                                  "(or swagger: \"2.0\")")]
        return f"3.{m.group(1)}", []
    if "swagger" in doc:
        if doc["swagger"] != "2.0":
            return None, [Problem("/swagger", f"unsupported Swagger version {doc['swagger']!r}: expected \"2.0\"")]
        return "2.0", []
    return None, [Problem("", "neither 'openapi' nor 'swagger' field: this is not an OpenAPI document")]


def validate_document(doc: Any, base_dir: Path | None = None) -> tuple[str | None, list[Problem]]:
    """``(version, problems)`` for a parsed document; no problems means usable.

    ``base_dir`` is where relative ``$ref`` files are read from (None: they are reported).
    Cost: O(document size), one pass plus one pass per check family.
    """
    version, problems = _version_of(doc)
    if version is None:
        return None, problems
    return version, _Checker(doc, version, base_dir).run()


def parse_spec(doc: Any, source: str = "<input>", base_dir: Path | None = None) -> Spec:
    """A `Spec` from an already parsed document; raise `SpecError` listing every problem."""
    version, problems = validate_document(doc, base_dir)
    if problems:
        raise SpecError(source, problems)
    return Spec(doc, version, source, base_dir)


def load_spec(source: str | Path | bytes, *, encoding: str | None = None,
              max_bytes: int = MAX_SPEC_BYTES) -> Spec:
    """Read, decode, parse and check an OpenAPI document (a path, or the bytes themselves).

    Raises `SpecError` (unreadable, undecodable, unparsable, or invalid, each with where).
    Relative ``$ref`` files are read from the document's folder. Cost: see the module docstring.
    """
    if isinstance(source, (bytes, bytearray)):
        data, name, base_dir = bytes(source), "<input>", None
    else:
        path = Path(source)
        name = str(source)
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise SpecError(name, [Problem("", f"document is {size} bytes, over the {max_bytes}-byte limit")])
            data = path.read_bytes()
        except OSError as e:
            raise SpecError(name, [Problem("", f"cannot read: {e.strerror}")]) from None
        except SpecError:
            raise
        except ValueError:  # a NUL byte in the name
            raise SpecError(name, [Problem("", "cannot read: the file name has a NUL byte")]) from None
        base_dir = path.resolve().parent
    if len(data) > max_bytes:
        raise SpecError(name, [Problem("", f"document is {len(data)} bytes, over the {max_bytes}-byte limit")])
    doc = parse_document(decode_bytes(data, name, encoding), name)
    return parse_spec(doc, name, base_dir)
