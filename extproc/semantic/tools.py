"""OpenAPI operations to LLM tool specifications (OpenAI, Anthropic, MCP).

What: `build_tools(spec)` makes one `Tool` per operation of an OpenAPI 3.0/3.1 or Swagger 2.0
document, and `openai_tools` / `anthropic_tools` / `mcp_tool_list` write them in each vendor's
format. A `Tool` also keeps how its arguments map back onto the HTTP request (`ParamBinding`,
`BodyBinding`), which `extproc.semantic.toolcall` uses to execute a call.

**Names** are the ``operationId`` with every run of characters outside ``[A-Za-z0-9_-]`` made
one ``_`` (``find pet by id`` -> ``find_pet_by_id``); without one (or when nothing is left) the
name comes from method and path: ``GET /users/{id}/posts`` -> ``get_users_by_id_posts``,
``GET /`` -> ``get_root``. A name over 64 characters keeps its first 55 and gets ``_`` plus 8 hex
digits of its SHA-256. When two operations end up with the same name, the first in document order
keeps it and the later ones get ``_`` plus 8 hex digits of the SHA-256 of ``"METHOD /path"``. So
names are valid for OpenAI and Anthropic (``^[a-zA-Z0-9_-]{1,64}$``), unique, and the same for
the same document on every run.

**Description**: summary and description joined by a blank line (``METHOD /path`` when both are
missing), cut at ``max_description`` characters (default 1024) on a word boundary.

**Parameters** are one JSON Schema object: path, query, header and cookie parameters (in that
order, each in declaration order, operation-level overriding path-level ones), then the JSON
request body. Each parameter's schema is made self-contained by `extproc.semantic.schemas`
(``$ref`` inlined, recursion cut, ``required``/``enum``/``format``/``default``/
``additionalProperties`` kept); the parameter's description becomes the property's when the
schema has none. Clashes are settled deterministically:

* two parameters with one name in different places: the first in the order path, query, header,
  cookie keeps the name, the others become ``<in>_<name>`` (``query_id``);
* the request body is **merged** (its properties become top-level arguments) when it is an object
  schema with ``properties``, no ``anyOf``/``oneOf``/``allOf`` left after merging, and no property
  named like a parameter argument; its ``required`` list counts only when the body is required,
  and its ``additionalProperties`` becomes the tool's (unknown arguments then go to the body);
* otherwise the body is **wrapped**: one argument ``body`` (``request_body``, then ``body_2``...
  when taken) holds the whole body.

A tool without a merged body has ``additionalProperties: false``. Header parameters named
``Accept``, ``Content-Type`` or ``Authorization`` are ignored, as the specification says.

**Request bodies**: JSON is preferred (``application/json``, then ``*/*+json``, then ``*/*``),
else ``application/x-www-form-urlencoded``, else ``multipart/form-data``; form bodies become
arguments like JSON ones and are encoded on execution by `extproc.semantic.form_encoding` (binary
multipart properties are base64 arguments). **Callbacks** are not tools: the operation is one, and
each callback is listed in `ToolSet.unsupported` (the gateway never calls them).

**Skipped** operations (listed in `ToolSet.skipped` with the reason, never silently): request bodies
with neither a JSON nor a form media type (``application/octet-stream``, ``text/plain``...; an
optional one whose schema declares no fields is just not sent, with a warning) and Swagger
``formData`` parameters; ``type: file``; parameter serialisation styles this module cannot produce; ``$ref``
to URLs; schemas that expand past ``max_schema_nodes``. 3.1 ``webhooks`` are not operations of
the service and are not tools.

Why: an LLM calls an existing REST service through tools; the tool schema is the contract the
model fills in, and the bindings are how the gateway turns the filled-in arguments back into the
service's request without guessing.

Cost: O(size of the document plus the expanded schemas); a 5,000-operation spec takes about a
second. Building runs at load time, never per request.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, TypeVar

from extproc.semantic.form_encoding import FormEncoding, FormEncodingError, form_media_type, prepare_form
from extproc.semantic.openapi import Resolver, Spec, iter_operations, join_pointer
from extproc.semantic.schemas import SchemaTooLarge, UnsupportedSchema, to_json_schema

__all__ = [
    "FORMATS",
    "NAME_RE",
    "BodyBinding",
    "Notice",
    "ParamBinding",
    "Skipped",
    "Tool",
    "ToolSet",
    "anthropic_tools",
    "build_tools",
    "derive_name",
    "format_tools",
    "is_json_media_type",
    "mcp_tool_list",
    "openai_tools",
    "sanitize_name",
]

NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""Tool names valid for both OpenAI functions and Anthropic tools."""

_MAX_NAME = 64
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]+")
_TEMPLATE_RE = re.compile(r"\{([^{}/]+)\}")
_LOCATION_ORDER = ("path", "query", "header", "cookie")
_IGNORED_HEADERS = frozenset({"accept", "content-type", "authorization"})
_STYLES = MappingProxyType({
    "path": frozenset({"simple", "label", "matrix"}),
    "query": frozenset({"form", "spaceDelimited", "pipeDelimited", "deepObject"}),
    "header": frozenset({"simple"}),
    "cookie": frozenset({"form"}),
})
_DEFAULT_STYLE = MappingProxyType({"path": "simple", "query": "form", "header": "simple", "cookie": "form"})
_COLLECTION_FORMATS = MappingProxyType({  # Swagger 2.0 -> (style, explode)
    "csv": ("form", False), "ssv": ("spaceDelimited", False), "pipes": ("pipeDelimited", False),
    "multi": ("form", True),
})
_SWAGGER_PARAM_SCHEMA_KEYS = frozenset({
    "type", "format", "items", "enum", "default", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "uniqueItems",
    "multipleOf", "x-nullable",
})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})

T = TypeVar("T")


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamBinding:
    """One argument that goes into the URL or a header.

    ``arg`` is the key in the tool's arguments, ``name`` the parameter's name on the wire,
    ``location`` one of path/query/header/cookie; ``style``/``explode``/``allow_reserved`` are the
    OpenAPI serialisation settings (defaults filled in); ``json`` means the value is sent as JSON
    text (a parameter described by ``content: application/json``).
    """

    arg: str
    name: str
    location: str
    style: str
    explode: bool
    allow_reserved: bool = False
    required: bool = False
    json: bool = False


@dataclass(frozen=True)
class BodyBinding:
    """How the request body is taken from the arguments.

    ``arg`` is set when the body is *wrapped* (one argument holds it); otherwise the body is
    *merged*: ``fields`` are the argument names that are body properties and, when ``extra`` is
    true, any other argument that is not a parameter goes into the body too. ``form`` is set for
    a form body (``content_type`` urlencoded or multipart): how `extproc.semantic.form_encoding`
    writes it; None for JSON.
    """

    arg: str | None
    fields: tuple[str, ...]
    extra: bool
    required: bool
    content_type: str
    form: FormEncoding | None = None


@dataclass(frozen=True)
class Tool:
    """One operation as an LLM tool, with what is needed to execute a call of it.

    ``parameters`` is the arguments' JSON Schema (read-only: parts may be shared between tools).
    ``method`` is upper case; ``path`` the path template as written (``/pets/{petId}``);
    ``server_url`` the spec's first server (variables at their defaults) or None; ``pointer`` the
    operation's JSON pointer in the document.
    """

    name: str
    description: str
    parameters: dict
    method: str
    path: str
    server_url: str | None
    params: tuple[ParamBinding, ...]
    body: BodyBinding | None
    operation_id: str | None
    pointer: str
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def cached(self, key: str, factory: Callable[[Tool], T]) -> T:
        """``factory(self)``, computed once per tool (for derived objects such as a validator).

        Thread-safe in the sense that matters: a race computes the value twice, both equal.
        """
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = factory(self)
            return value

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_memo"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)


@dataclass(frozen=True)
class Skipped:
    """An operation that did not become a tool, and why."""

    method: str
    path: str
    pointer: str
    reason: str

    def __str__(self) -> str:
        return f"{self.method} {self.path} (#{self.pointer}): {self.reason}"


@dataclass(frozen=True)
class Notice:
    """A warning about a tool that was built (something dropped, cut or renamed)."""

    pointer: str
    message: str

    def __str__(self) -> str:
        return f"#{self.pointer}: {self.message}"


@dataclass(frozen=True)
class ToolSet:
    """The result of `build_tools`: tools in document order, skipped operations, warnings.

    ``unsupported`` lists parts of operations that became tools but are not handled (callbacks:
    requests the service sends to a URL it was given; the gateway never makes or receives them).
    """

    tools: tuple[Tool, ...]
    skipped: tuple[Skipped, ...] = ()
    warnings: tuple[Notice, ...] = ()
    by_name: Mapping[str, Tool] = field(default_factory=dict, compare=False)
    unsupported: tuple[Notice, ...] = ()

    def report(self) -> str:
        """A human-readable summary: counts, skipped operations, unsupported parts, warnings."""
        lines = [f"{len(self.tools)} tool(s), {len(self.skipped)} operation(s) skipped, "
                 + (f"{len(self.unsupported)} unsupported part(s), " if self.unsupported else "")
                 + f"{len(self.warnings)} warning(s)"]
        if self.skipped:
            lines.append("skipped:")
            lines.extend(f"  {s}" for s in self.skipped)
        if self.unsupported:
            lines.append("unsupported (the tool exists; these parts are not handled):")
            lines.extend(f"  {u}" for u in self.unsupported)
        if self.warnings:
            lines.append("warnings:")
            lines.extend(f"  {w}" for w in self.warnings)
        return "\n".join(lines)


class _Skip(Exception):
    """Internal: the operation cannot become a tool."""


# --------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------


def _hex8(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _with_suffix(base: str, suffix: str) -> str:
    keep = _MAX_NAME - len(suffix) - 1
    return (base[:keep].rstrip("_-") or "op") + "_" + suffix


def _fit(name: str) -> str:
    return name if len(name) <= _MAX_NAME else _with_suffix(name, _hex8(name))


def sanitize_name(text: str) -> str:
    """``text`` with runs of characters outside ``[A-Za-z0-9_-]`` made ``_`` and trimmed.

    May return ``""`` (for example for an all-Chinese operationId). Not length-limited.
    """
    return _BAD_NAME_CHARS.sub("_", text).strip("_")


def derive_name(method: str, path: str) -> str:
    """The tool name for an operation without a usable operationId, before length fitting.

    ``GET /users/{id}`` -> ``get_users_by_id``; ``GET /`` -> ``get_root``.
    """
    parts = [method.lower()]
    for segment in path.split("/"):
        if not segment:
            continue
        segment = _TEMPLATE_RE.sub(lambda m: f"_by_{m.group(1)}_", segment)
        cleaned = sanitize_name(segment)
        if cleaned:
            parts.append(cleaned)
    if len(parts) == 1:
        parts.append("root")
    return re.sub(r"__+", "_", "_".join(parts))


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------


def is_json_media_type(media: str) -> bool:
    """``application/json``, ``*/*+json`` (``application/problem+json``...), ``*/*``."""
    m = media.split(";", 1)[0].strip().lower()
    return m == "application/json" or m.endswith("+json") or m == "*/*" or m == "application/*"


def _pick_json_media(content: dict) -> str | None:
    keys = [k for k in content if isinstance(k, str)]
    for k in keys:
        if k.split(";", 1)[0].strip().lower() == "application/json":
            return k
    for k in keys:
        if is_json_media_type(k) and "*" not in k:
            return k
    for k in keys:
        if is_json_media_type(k):
            return k
    return None


def _server_url(spec: Spec, op: dict, item: dict) -> str | None:
    if spec.version == "2.0":
        doc = spec.doc
        base = doc.get("basePath")
        base = base if isinstance(base, str) else ""
        host = doc.get("host")
        if host and isinstance(host, str):
            schemes = doc.get("schemes")  # a list of strings; anything else (a mapping: KeyError 0) is https
            scheme = schemes[0] if isinstance(schemes, list) and schemes and isinstance(schemes[0], str) else "https"
            return f"{scheme}://{host}{base}"
        return base or None
    for holder in (op, item, spec.doc):
        servers = holder.get("servers")
        if isinstance(servers, list) and servers and isinstance(servers[0], dict):
            url = servers[0].get("url")
            if not isinstance(url, str):
                continue
            variables = servers[0].get("variables")
            if not isinstance(variables, dict):  # a string or list here: no variables (was AttributeError)
                variables = {}

            def default(m: re.Match) -> str:
                var = variables.get(m.group(1))
                return str(var.get("default", "")) if isinstance(var, dict) else m.group(0)

            return re.sub(r"\{([^{}]+)\}", default, url)
    return None


def _describe(op: dict, method: str, path: str, limit: int) -> tuple[str, bool]:
    summary = (op.get("summary") or "").strip() if isinstance(op.get("summary"), str) else ""
    desc = (op.get("description") or "").strip() if isinstance(op.get("description"), str) else ""
    if summary and desc and not desc.startswith(summary):
        text = f"{summary}\n\n{desc}"
    else:
        text = desc or summary or f"{method.upper()} {path}"
    if limit and len(text) > limit:
        cut = text[: limit - 1]
        space = cut.rfind(" ")
        if space > limit // 2:
            cut = cut[:space]
        return cut.rstrip() + "…", True
    return text, False


class _Builder:
    """Builds the tools of one spec; holds the resolver and the options."""

    def __init__(self, spec: Spec, max_schema_nodes: int, max_description: int) -> None:
        self.spec = spec
        self.resolver = Resolver(spec)
        self.max_schema_nodes = max_schema_nodes
        self.max_description = max_description
        self.warnings: list[Notice] = []
        self.unsupported: list[Notice] = []

    def schema(self, schema: Any, pointer: str, base: str = "") -> dict:
        return to_json_schema(self.resolver, schema, version=self.spec.version, base=base,
                              pointer=pointer, direction="request", max_nodes=self.max_schema_nodes)

    def operation(self, path: str, method: str, op: dict, item: dict, pointer: str) -> dict:
        """Everything of a tool but its final name; raises `_Skip`."""
        params, swagger_body = self.parameters(op, item, pointer)
        body_schema, body_required, content_type, body_desc, form = self.request_body(op, pointer, swagger_body)
        callbacks = op.get("callbacks")
        if callbacks:
            names = ", ".join(map(repr, callbacks)) if isinstance(callbacks, dict) else repr(callbacks)
            self.unsupported.append(Notice(f"{pointer}/callbacks", f"callback(s) {names}: requests the service "
                                           "sends to a URL it is given are not supported (never invoked); the "
                                           "operation itself is a tool"))
        # argument names for parameters
        bindings: list[ParamBinding] = []
        props: dict[str, Any] = {}
        required: list[str] = []
        ordered = sorted(params, key=lambda p: _LOCATION_ORDER.index(p[0].location))
        for binding, schema in ordered:
            arg = binding.name
            if arg in props:
                arg = f"{binding.location}_{binding.name}"
                n = 2
                while arg in props:
                    arg = f"{binding.location}_{binding.name}_{n}"
                    n += 1
                self.warnings.append(Notice(pointer, f"{binding.location} parameter {binding.name!r} "
                                            f"clashes with another parameter; its argument is {arg!r}"))
                binding = ParamBinding(arg, binding.name, binding.location, binding.style, binding.explode,
                                       binding.allow_reserved, binding.required, binding.json)
            props[arg] = schema
            if binding.required:
                required.append(arg)
            bindings.append(binding)
        additional: Any = False
        body: BodyBinding | None = None
        if body_schema is not None:
            if _mergeable(body_schema, props):
                fields = tuple(body_schema["properties"])
                props.update(body_schema["properties"])
                if body_required:
                    required.extend(r for r in body_schema.get("required", ()) if r in body_schema["properties"])
                additional = body_schema.get("additionalProperties", None)
                extra = additional is not False
                body = BodyBinding(None, fields, extra, body_required, content_type, form)
            else:
                arg = "body"
                for candidate in ("body", "request_body", *(f"body_{n}" for n in range(2, 100))):
                    if candidate not in props:
                        arg = candidate
                        break
                if arg != "body":
                    self.warnings.append(Notice(pointer, f"a parameter is named 'body'; the request body "
                                                f"argument is {arg!r}"))
                if body_desc and "description" not in body_schema:
                    body_schema = {**body_schema, "description": body_desc}
                props[arg] = body_schema
                if body_required:
                    required.append(arg)
                body = BodyBinding(arg, (), False, body_required, content_type, form)
        parameters: dict[str, Any] = {"type": "object", "properties": props}
        if required:
            parameters["required"] = required
        if additional is not None:
            parameters["additionalProperties"] = additional
        description, cut = _describe(op, method, path, self.max_description)
        if cut:
            self.warnings.append(Notice(pointer, f"description cut to {self.max_description} characters"))
        return {
            "description": description,
            "parameters": parameters,
            "method": method.upper(),
            "path": path,
            "server_url": _server_url(self.spec, op, item),
            "params": tuple(bindings),
            "body": body,
            "operation_id": op.get("operationId") if isinstance(op.get("operationId"), str) else None,
            "pointer": pointer,
        }

    def parameters(self, op: dict, item: dict, pointer: str) -> tuple[list[tuple[ParamBinding, dict]], Any]:
        """``([(binding, schema)], swagger_body)``: swagger_body is ``(param, base, pointer)`` or None."""
        merged: dict[tuple[str, str], tuple[Any, str, str]] = {}
        for holder, hptr in ((item, pointer.rsplit("/", 1)[0]), (op, pointer)):
            for i, raw in enumerate(holder.get("parameters") or ()):
                pptr = f"{hptr}/parameters/{i}"
                try:
                    p, base = self.resolver.deref(raw)
                except LookupError as e:
                    raise _Skip(f"parameter #{pptr}: {e}") from None
                merged[(p["name"], p["in"])] = (p, base, pptr)
        out = []
        swagger_body = None
        for (name, loc), (p, base, pptr) in merged.items():
            if loc == "body":
                swagger_body = (p, base, pptr)  # Swagger 2.0 body: handled by request_body
                continue
            if loc == "formData":
                raise _Skip(f"parameter {name!r} is form data (#{pptr}); Swagger 2.0 formData parameters are "
                            "not supported (OpenAPI 3 form request bodies are)")
            if loc == "header" and name.lower() in _IGNORED_HEADERS:
                self.warnings.append(Notice(pptr, f"header parameter {name!r} is ignored (OpenAPI: Accept, "
                                            "Content-Type and Authorization are set by other means)"))
                continue
            required = loc == "path" or p.get("required") is True
            is_json = False
            if self.spec.version == "2.0":
                schema_src = {k: v for k, v in p.items() if k in _SWAGGER_PARAM_SCHEMA_KEYS}
                if p.get("type") == "file":
                    raise _Skip(f"parameter {name!r} is a file upload (#{pptr}); not supported")
                fmt = p.get("collectionFormat", "csv")
                if p.get("type") == "array":
                    if not isinstance(fmt, str) or fmt not in _COLLECTION_FORMATS or (  # (unhashable)
                            fmt == "multi" and loc != "query") or (fmt in ("ssv", "pipes") and loc != "query"):
                        raise _Skip(f"parameter {name!r} uses collectionFormat {fmt!r} in {loc} (#{pptr}); "
                                    "not supported")
                    style, explode = _COLLECTION_FORMATS[fmt]
                    if loc != "query":
                        style = _DEFAULT_STYLE[loc]
                else:
                    style, explode = _DEFAULT_STYLE[loc], _DEFAULT_STYLE[loc] == "form"
                allow_reserved = False
                schema_ptr = pptr
            else:
                style = p.get("style", _DEFAULT_STYLE[loc])
                if not isinstance(style, str) or style not in _STYLES[loc]:  # a list or mapping is not hashable
                    raise _Skip(f"parameter {name!r} uses style {style!r} in {loc} (#{pptr}); not supported")
                explode = p.get("explode", style == "form")
                allow_reserved = p.get("allowReserved") is True
                if "schema" in p:
                    schema_src, schema_ptr = p["schema"], f"{pptr}/schema"
                else:
                    content = p.get("content") or {}
                    media = _pick_json_media(content)
                    if media is None:
                        raise _Skip(f"parameter {name!r} is described by content {', '.join(content)} "
                                    f"(#{pptr}); only JSON is supported")
                    schema_src = content[media].get("schema", {})
                    schema_ptr = join_pointer(f"{pptr}/content", media, "schema")
                    is_json = True
            try:
                schema = self.schema(schema_src, schema_ptr, base)
            except UnsupportedSchema as e:
                raise _Skip(f"parameter {name!r}: {e}") from None
            extra = {}
            if isinstance(p.get("description"), str) and "description" not in schema:
                extra["description"] = p["description"]
            if p.get("deprecated") is True:
                extra["deprecated"] = True
            if "example" in p and "examples" not in schema:
                extra["examples"] = [p["example"]]
            if extra:
                schema = {**schema, **extra}
            out.append((ParamBinding(name, name, loc, style, bool(explode), allow_reserved, required, is_json),
                        schema))
        return out, swagger_body

    def request_body(self, op: dict, pointer: str, swagger_body: Any
                     ) -> tuple[dict | None, bool, str, str | None, FormEncoding | None]:
        """``(schema, required, content type, description, form)``; schema None without a body."""
        if self.spec.version == "2.0":
            if swagger_body is None:
                return None, False, "", None, None
            p, base, pptr = swagger_body
            consumes = op.get("consumes") or self.spec.doc.get("consumes") or ["application/json"]
            media = next((m for m in consumes if isinstance(m, str) and is_json_media_type(m)), None)
            if media is None:
                raise _Skip(f"the body is sent as {', '.join(map(str, consumes))}; only JSON request "
                            "bodies are supported")
            try:
                schema = self.schema(p.get("schema", {}), f"{pptr}/schema", base)
            except UnsupportedSchema as e:
                raise _Skip(f"request body: {e}") from None
            desc = p.get("description") if isinstance(p.get("description"), str) else None
            return schema, p.get("required") is True, media.split(";")[0].strip(), desc, None
        raw = op.get("requestBody")
        if raw is None:
            return None, False, "", None, None
        try:
            body, base = self.resolver.deref(raw)
        except LookupError as e:
            raise _Skip(f"request body: {e}") from None
        content = body.get("content") or {}
        media = _pick_json_media(content)
        form_media = None
        if media is None:
            if body.get("required") is not True and all(_empty_body(mt, self.resolver) for mt in content.values()):
                self.warnings.append(Notice(f"{pointer}/requestBody", "an optional request body with no fields "
                                            f"({', '.join(map(str, content))}) is not sent"))
                return None, False, "", None, None
            media, form_media = _pick_form_media(content)
            if media is None:
                raise _Skip(f"the request body is {', '.join(map(str, content)) or 'empty'}; only JSON request "
                            "bodies and forms (application/x-www-form-urlencoded, multipart/form-data) are "
                            "supported")
        mt = content[media] if isinstance(content[media], dict) else {}
        schema_ptr = join_pointer(f"{pointer}/requestBody/content", media, "schema")
        try:
            schema = self.schema(mt.get("schema", {}), schema_ptr, base)
        except UnsupportedSchema as e:
            raise _Skip(f"request body: {e}") from None
        desc = body.get("description") if isinstance(body.get("description"), str) else None
        if form_media is not None:
            try:
                schema, form, notes = prepare_form(form_media, schema, mt.get("encoding"))
            except FormEncodingError as e:
                raise _Skip(f"request body ({form_media}): {e}") from None
            others = [str(k) for k in content if k != media]
            if others:
                notes.append(f"the body is sent as {form_media} (also declared: {', '.join(others)})")
            self.warnings.extend(Notice(join_pointer(f"{pointer}/requestBody/content", media), n) for n in notes)
            return schema, body.get("required") is True, form_media, desc, form
        content_type = "application/json" if "*" in media else media.split(";")[0].strip()
        return schema, body.get("required") is True, content_type, desc, None


def _pick_form_media(content: dict) -> tuple[str | None, str | None]:
    """``(content key, form media type)``: urlencoded before multipart; ``(None, None)`` without a form."""
    keys = [k for k in content if isinstance(k, str)]
    for wanted in ("application/x-www-form-urlencoded", "multipart/form-data"):
        for k in keys:
            if form_media_type(k) == wanted:
                return k, wanted
    return None, None


def _empty_body(media_type: Any, resolver: Resolver) -> bool:
    """Whether a (non-JSON) media type's schema declares no fields (Stripe's GETs carry such bodies)."""
    if not isinstance(media_type, dict):
        return True
    try:
        schema, _ = resolver.deref(media_type.get("schema") or {})
    except LookupError:
        return False
    return isinstance(schema, dict) and not schema.get("properties") and not schema.get("required") and not any(
        k in schema for k in ("allOf", "anyOf", "oneOf", "items", "patternProperties")) and schema.get(
        "additionalProperties") in (None, False)


def _mergeable(body: dict, taken: dict) -> bool:
    props = body.get("properties")
    if not isinstance(props, dict) or not props:
        return False
    if body.get("type", "object") != "object":
        return False
    if any(k in body for k in ("allOf", "anyOf", "oneOf", "not", "if", "patternProperties",
                               "dependentSchemas", "unevaluatedProperties", "propertyNames")):
        return False
    return not any(name in taken for name in props)


def build_tools(spec: Spec, *, max_schema_nodes: int = 20_000, max_description: int = 1024) -> ToolSet:
    """One `Tool` per operation of ``spec`` (see the module docstring for every rule).

    ``max_schema_nodes`` bounds one tool's expanded parameter schema (bigger: skipped);
    ``max_description`` bounds descriptions (0: no limit). Never raises for a checked `Spec`:
    what cannot be a tool is in `ToolSet.skipped`.
    """
    b = _Builder(spec, max_schema_nodes, max_description)
    built: list[tuple[str | None, dict]] = []
    skipped: list[Skipped] = []
    for path, method, op, item, pointer in iter_operations(spec, b.resolver):
        try:
            fields = b.operation(path, method, op, item, pointer)
        except _Skip as e:
            skipped.append(Skipped(method.upper(), path, pointer, str(e)))
            continue
        except SchemaTooLarge as e:
            skipped.append(Skipped(method.upper(), path, pointer, str(e)))
            continue
        except RecursionError:
            skipped.append(Skipped(method.upper(), path, pointer, "schema nesting too deep"))
            continue
        built.append((fields.pop("operation_id"), fields))
    if spec.version == "3.1" and spec.doc.get("webhooks"):
        b.warnings.append(Notice("/webhooks", "webhooks are requests the service sends, not operations; "
                                 "no tools are made for them"))
    tools: list[Tool] = []
    names: dict[str, str] = {}
    for op_id, fields in built:
        name = sanitize_name(op_id) if op_id else ""
        if op_id and not name:
            b.warnings.append(Notice(fields["pointer"], f"operationId {op_id!r} has no usable characters for "
                                     "a tool name; the name comes from method and path"))
        if not name:
            name = derive_name(fields["method"], fields["path"])
        name = _fit(name)
        if name in names:
            renamed = _with_suffix(name, _hex8(f"{fields['method']} {fields['path']}"))
            n = 2
            while renamed in names:
                renamed = _with_suffix(name, f"{_hex8(fields['method'] + ' ' + fields['path'])}{n}")
                n += 1
            b.warnings.append(Notice(fields["pointer"], f"tool name {name!r} is already used by "
                                     f"#{names[name]}; this one is {renamed!r}"))
            name = renamed
        if op_id and name != op_id:
            b.warnings.append(Notice(fields["pointer"], f"operationId {op_id!r} became tool name {name!r}"))
        names[name] = fields["pointer"]
        tools.append(Tool(name=name, operation_id=op_id, **fields))
    return ToolSet(tuple(tools), tuple(skipped), tuple(b.warnings), MappingProxyType({t.name: t for t in tools}),
                   tuple(b.unsupported))


# --------------------------------------------------------------------------
# Output formats
# --------------------------------------------------------------------------


def openai_tools(tools: Iterable[Tool] | ToolSet) -> list[dict]:
    """OpenAI Chat Completions ``tools``: ``[{"type": "function", "function": {...}}]``."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in _tools(tools)]


def anthropic_tools(tools: Iterable[Tool] | ToolSet) -> list[dict]:
    """Anthropic Messages ``tools``: ``[{"name", "description", "input_schema"}]``."""
    return [{"name": t.name, "description": t.description, "input_schema": t.parameters}
            for t in _tools(tools)]


def mcp_tool_list(tools: Iterable[Tool] | ToolSet) -> dict:
    """An MCP ``tools/list`` result: ``{"tools": [{"name", "description", "inputSchema", ...}]}``.

    ``annotations`` carry the HTTP method's semantics: ``readOnlyHint`` for GET/HEAD/OPTIONS,
    ``idempotentHint`` for those and PUT/DELETE.
    """
    return {"tools": [{"name": t.name, "description": t.description, "inputSchema": t.parameters,
                       "annotations": {"readOnlyHint": t.method in _SAFE_METHODS,
                                       "idempotentHint": t.method in _IDEMPOTENT_METHODS}}
                      for t in _tools(tools)]}


FORMATS: Mapping[str, Callable[[Any], Any]] = MappingProxyType({
    "openai": openai_tools, "anthropic": anthropic_tools, "mcp": mcp_tool_list,
})
"""Format name -> writer, for the CLI."""


def format_tools(tools: Iterable[Tool] | ToolSet, fmt: str) -> Any:
    """The tools in format ``fmt`` (``openai``, ``anthropic`` or ``mcp``)."""
    try:
        return FORMATS[fmt](tools)
    except KeyError:
        raise ValueError(f"unknown tool format {fmt!r}: expected one of {', '.join(FORMATS)}") from None


def _tools(tools: Iterable[Tool] | ToolSet) -> Iterable[Tool]:
    return tools.tools if isinstance(tools, ToolSet) else tools


