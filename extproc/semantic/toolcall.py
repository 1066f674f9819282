"""Execute an LLM tool call against the REST service it describes: validate, build, map back.

What, in the order a gateway stage uses it:

1. `parse_tool_call(doc)` takes one tool call as OpenAI (``{"id", "type": "function",
   "function": {"name", "arguments": "<JSON text>"}}``), Anthropic (``{"type": "tool_use", "id",
   "name", "input"}``) or MCP (``tools/call`` params ``{"name", "arguments"}``, or the whole
   JSON-RPC request) sends it, and returns a `ToolCall`.
2. `validate_arguments(tool, args)` checks the arguments against the tool's JSON Schema
   (draft 2020-12, with formats ``date-time``, ``date``, ``time``, ``email``, ``uuid``, ``uri``,
   ``ipv4``, ``ipv6``, ``int32``, ``int64`` checked) and returns `ArgumentError`s, each naming the
   field by JSON pointer (``/pet/tags/0``) and dotted path (``pet.tags[0]``): the body of a 400.
3. `build_request(tool, args, base_url)` returns the service request as an `HttpRequest`
   ``(method, target, headers, body)``: path parameters substituted and percent-encoded (``/``
   too: a value never adds a path segment), query string, headers, cookies and the body (JSON, or a
   urlencoded or multipart form written by `extproc.semantic.form_encoding`), all serialised with
   the parameter's OpenAPI ``style``/``explode`` (a form property's ``encoding``).
4. `tool_result(status, headers, body)` maps the service's response to the tool-result document
   the model reads back; `openai_tool_message`, `anthropic_tool_result` and `mcp_call_result` wrap
   it for each protocol.

Errors are `ToolCallError` (``status`` 400 or 404, ``code``, ``errors``), with `to_error()` giving
the JSON the gateway answers with.

Why: the gateway, not the model, owns the HTTP contract of the service; the model fills in a
schema and everything it sends is checked before a byte reaches the service. Header values with
CR, LF or NUL are refused (header injection), path values cannot traverse (``/`` and ``..`` are
encoded), and query reserved characters are encoded unless the spec says ``allowReserved``
(``&``, ``=`` and ``#`` are encoded even then).

Cost: validation is one jsonschema pass over the arguments (the validator is built once per tool
and kept on it); building is O(size of the arguments) plus one ``orjson.dumps``. Typical figures
are in perf/RESULTS.md (``perf/bench_mapping.py``).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple
from urllib.parse import quote, urlsplit

import orjson
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import ValidationError

from extproc.semantic.form_encoding import FormEncodingError, encode_form, scalar_text
from extproc.semantic.openapi import escape_token
from extproc.semantic.tools import ParamBinding, Tool, ToolSet

__all__ = [
    "ArgumentError",
    "HttpRequest",
    "ToolCall",
    "ToolCallError",
    "anthropic_tool_result",
    "build_request",
    "check_arguments",
    "mcp_call_result",
    "openai_tool_message",
    "parse_tool_call",
    "resolve_tool",
    "tool_result",
    "validate_arguments",
]

MAX_ERRORS = 20
"""At most this many argument errors are reported for one call."""

RESULT_BODY_LIMIT = 100_000
"""Response bodies longer than this many bytes are cut in the tool result (the model's context)."""

_RESULT_HEADERS = ("content-type", "location", "retry-after", "etag")
_HEADER_BAD = re.compile(r"[\r\n\x00]")
# RFC 3986 reserved characters a query value may keep with allowReserved, minus & = # (+ is
# kept: it is not special in a percent-encoded query).
_RESERVED_SAFE = ":/?[]@!$'()*+,;"
_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_TIME = re.compile(r"^\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})?$")
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+$")
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:\S*$")


# --------------------------------------------------------------------------
# Errors and values
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ArgumentError:
    """One problem with a tool call's arguments: where (pointer and dotted path) and what."""

    pointer: str
    path: str
    message: str

    def to_dict(self) -> dict:
        return {"pointer": self.pointer, "path": self.path, "message": self.message}

    def __str__(self) -> str:
        return f"{self.path or '(arguments)'}: {self.message}"


class ToolCallError(ValueError):
    """A tool call the gateway refuses: ``status`` (400, or 404 for an unknown tool), ``code``.

    ``code`` is ``malformed_tool_call``, ``unknown_tool``, ``invalid_tool_arguments`` or
    ``invalid_tool_schema`` (502: the document's schema cannot be checked);
    ``errors`` lists `ArgumentError`s for the last.
    """

    def __init__(self, code: str, message: str, errors: Iterable[ArgumentError] = (),
                 status: int = 400, tool: str | None = None) -> None:
        self.code = code
        self.errors = tuple(errors)
        self.status = status
        self.tool = tool
        detail = "; ".join(str(e) for e in self.errors[:3])
        super().__init__(f"{message}: {detail}" if detail else message)
        self.message = str(self)

    def to_error(self) -> dict:
        """The ``error`` object of the gateway's JSON error answer."""
        out: dict[str, Any] = {"status": self.status, "code": self.code, "message": self.message}
        if self.tool:
            out["tool"] = self.tool
        if self.errors:
            out["errors"] = [e.to_dict() for e in self.errors]
        return out


class HttpRequest(NamedTuple):
    """The service request for a tool call.

    ``target`` is the path plus query (``/v1/pets/12?limit=5``) including the base URL's path;
    ``headers`` are lower-case ``(name, value)`` pairs; ``body`` is None without a body.
    """

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


@dataclass(frozen=True)
class ToolCall:
    """One call as the model sent it: tool ``name``, ``arguments`` (a dict), the call ``id``."""

    name: str
    arguments: dict
    call_id: str | None = None
    protocol: str = "openai"


# --------------------------------------------------------------------------
# Parsing a call
# --------------------------------------------------------------------------


def _parse_arguments(raw: Any, pointer: str) -> dict:
    if isinstance(raw, (str, bytes, bytearray)):
        if not raw or (isinstance(raw, str) and not raw.strip()):
            return {}
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ToolCallError("malformed_tool_call", f"{pointer} is not valid JSON ({e})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ToolCallError("malformed_tool_call", f"{pointer} must be a JSON object, not {_json_type(raw)}")
    return raw


def parse_tool_call(doc: Any) -> ToolCall:
    """A `ToolCall` from an OpenAI, Anthropic or MCP tool call (see the module docstring).

    Raises `ToolCallError` (``malformed_tool_call``) naming what is missing. O(size of the call).
    """
    if isinstance(doc, (bytes, bytearray, str)):
        try:
            doc = orjson.loads(doc)
        except orjson.JSONDecodeError as e:
            raise ToolCallError("malformed_tool_call", f"tool call is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ToolCallError("malformed_tool_call", f"a tool call must be a JSON object, not {_json_type(doc)}")
    if doc.get("jsonrpc") is not None or doc.get("method") == "tools/call":
        if doc.get("method") != "tools/call" or not isinstance(doc.get("params"), dict):
            raise ToolCallError("malformed_tool_call", "a JSON-RPC tool call needs method 'tools/call' and params")
        params = doc["params"]
        name = params.get("name")
        if not isinstance(name, str):
            raise ToolCallError("malformed_tool_call", "/params/name must be a string")
        call_id = doc.get("id")
        return ToolCall(name, _parse_arguments(params.get("arguments"), "/params/arguments"),
                        None if call_id is None else str(call_id), "mcp")
    if isinstance(doc.get("function"), dict):
        fn = doc["function"]
        if not isinstance(fn.get("name"), str):
            raise ToolCallError("malformed_tool_call", "/function/name must be a string")
        return ToolCall(fn["name"], _parse_arguments(fn.get("arguments"), "/function/arguments"),
                        doc.get("id") if isinstance(doc.get("id"), str) else None, "openai")
    if doc.get("type") == "tool_use":
        if not isinstance(doc.get("name"), str):
            raise ToolCallError("malformed_tool_call", "/name must be a string")
        return ToolCall(doc["name"], _parse_arguments(doc.get("input"), "/input"),
                        doc.get("id") if isinstance(doc.get("id"), str) else None, "anthropic")
    if isinstance(doc.get("name"), str):
        return ToolCall(doc["name"], _parse_arguments(doc.get("arguments"), "/arguments"), None, "mcp")
    raise ToolCallError("malformed_tool_call", "not a tool call: expected OpenAI {function: {name, arguments}}, "
                        "Anthropic {type: tool_use, name, input} or MCP {name, arguments}")


def resolve_tool(tools: ToolSet | Mapping[str, Tool], name: str) -> Tool:
    """The tool called ``name``; `ToolCallError` 404 ``unknown_tool`` when there is none."""
    table = tools.by_name if isinstance(tools, ToolSet) else tools
    try:
        return table[name]
    except KeyError:
        raise ToolCallError("unknown_tool", f"no tool named {name[:80]!r}", status=404) from None


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


def _format_checker() -> FormatChecker:
    """A fresh checker with the formats tool schemas use (nothing registered globally)."""
    fc = FormatChecker(formats=())

    def check(name: str):
        return fc.checks(name, raises=(ValueError, TypeError))

    @check("date-time")
    def _date_time(v: object) -> bool:
        if not isinstance(v, str):
            return True
        if not _RFC3339.match(v):
            return False
        _dt.datetime.fromisoformat(v.replace("z", "Z").replace("Z", "+00:00").replace("t", "T"))
        return True

    @check("date")
    def _date(v: object) -> bool:
        return not isinstance(v, str) or (len(v) == 10 and bool(_dt.date.fromisoformat(v)))

    @check("time")
    def _time(v: object) -> bool:
        return not isinstance(v, str) or bool(_TIME.match(v))

    @check("email")
    def _email(v: object) -> bool:
        return not isinstance(v, str) or bool(_EMAIL.match(v))

    @check("uuid")
    def _uuid(v: object) -> bool:
        return not isinstance(v, str) or (len(v) == 36 and bool(uuid.UUID(v)))

    @check("uri")
    def _uri(v: object) -> bool:
        return not isinstance(v, str) or bool(_URI.match(v))

    @check("ipv4")
    def _ipv4(v: object) -> bool:
        return not isinstance(v, str) or bool(ipaddress.IPv4Address(v))

    @check("ipv6")
    def _ipv6(v: object) -> bool:
        return not isinstance(v, str) or bool(ipaddress.IPv6Address(v))

    @check("int32")
    def _int32(v: object) -> bool:
        return not isinstance(v, (int, float)) or isinstance(v, bool) or -(2**31) <= v < 2**31

    @check("int64")
    def _int64(v: object) -> bool:
        return not isinstance(v, (int, float)) or isinstance(v, bool) or -(2**63) <= v < 2**63

    return fc


def _make_validator(tool: Tool) -> Draft202012Validator:
    return Draft202012Validator(tool.parameters, format_checker=_format_checker())


def _dotted(parts: Iterable[Any]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", p):
            out += f".{p}" if out else p
        else:
            out += f"[{orjson.dumps(p).decode()}]"
    return out


def _pointer(parts: Iterable[Any]) -> str:
    return "".join("/" + escape_token(p) for p in parts)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array"
    return "an object" if isinstance(v, dict) else type(v).__name__


def _short(v: Any, limit: int = 60) -> str:
    try:
        text = orjson.dumps(v).decode()
    except TypeError:
        text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _explain(err: ValidationError) -> list[ArgumentError]:
    """One jsonschema error as `ArgumentError`s pointing at the field itself."""
    path = list(err.absolute_path)
    v, inst = err.validator, err.instance
    if v == "required" and isinstance(inst, dict):
        missing = [r for r in err.validator_value if r not in inst]
        return [ArgumentError(_pointer([*path, m]), _dotted([*path, m]), "is required") for m in missing]
    if v == "additionalProperties" and isinstance(inst, dict):
        known = set((err.schema.get("properties") or {}))
        patterns = [re.compile(p) for p in (err.schema.get("patternProperties") or {})]
        extra = [k for k in inst if k not in known and not any(p.search(k) for p in patterns)]
        if extra and err.validator_value is False:
            return [ArgumentError(_pointer([*path, k]), _dotted([*path, k]), "is not a known field") for k in extra]
    if v == "type":
        expected = err.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        msg = f"must be {expected}, not {_json_type(inst)}"
    elif v == "enum":
        msg = f"must be one of {_short(err.validator_value, 200)}, not {_short(inst)}"
    elif v == "format":
        msg = f"must be a valid {err.validator_value}, not {_short(inst)}"
    else:
        msg = err.message if len(err.message) <= 200 else err.message[:199] + "…"
    return [ArgumentError(_pointer(path), _dotted(path), msg)]


def validate_arguments(tool: Tool, args: Any) -> list[ArgumentError]:
    """Every problem with ``args`` for ``tool`` (at most `MAX_ERRORS`), sorted by location.

    An empty list means valid. ``args`` may be the JSON text of the arguments. Cost: one
    jsonschema pass; the validator is built on first use and kept on the tool.
    """
    if not isinstance(args, dict):
        try:
            args = _parse_arguments(args, "arguments")
        except ToolCallError as e:
            return [ArgumentError("", "", e.message)]
    validator = tool.cached("validator", _make_validator)
    out: list[ArgumentError] = []
    try:
        for err in validator.iter_errors(args):
            out.extend(_explain(err))
            if len(out) >= MAX_ERRORS:
                break
    except (TypeError, ValueError, re.error) as e:  # the document's schema is not JSON Schema (`format: [..]`)
        raise ToolCallError("invalid_tool_schema", f"tool {tool.name!r} cannot be called: its parameter schema "
                            f"in the OpenAPI document is not valid JSON Schema ({type(e).__name__}: {e})",
                            status=502, tool=tool.name) from None
    out.sort(key=lambda e: e.pointer)
    return out[:MAX_ERRORS]


def check_arguments(tool: Tool, args: Any) -> dict:
    """``args`` as a dict if valid for ``tool``, else raise `ToolCallError` 400 naming the fields."""
    if not isinstance(args, dict):
        args = _parse_arguments(args, "arguments")
    errors = validate_arguments(tool, args)
    if errors:
        raise ToolCallError("invalid_tool_arguments", f"invalid arguments for tool {tool.name!r}", errors,
                            tool=tool.name)
    return args


# --------------------------------------------------------------------------
# Building the request
# --------------------------------------------------------------------------


def _enc(text: str, safe: str = "") -> str:
    return quote(text, safe=safe, encoding="utf-8", errors="strict")


def _path_value(b: ParamBinding, v: Any) -> str:
    """RFC 6570-style expansion for the simple, label and matrix styles, values encoded."""
    if b.json:
        return _enc(orjson.dumps(v).decode())
    if isinstance(v, list):
        items = [_enc(scalar_text(x)) for x in v]
        if b.style == "label":
            return "." + ("." if b.explode else ",").join(items)
        if b.style == "matrix":
            if b.explode:
                return "".join(f";{_enc(b.name)}={x}" for x in items)
            return f";{_enc(b.name)}=" + ",".join(items)
        return ",".join(items)
    if isinstance(v, dict):
        pairs = [(_enc(str(k)), _enc(scalar_text(x))) for k, x in v.items()]
        if b.explode:
            body = [f"{k}={x}" for k, x in pairs]
        else:
            body = [f"{k},{x}" for k, x in pairs]
        if b.style == "label":
            return "." + ("." if b.explode else ",").join(body)
        if b.style == "matrix":
            if b.explode:
                return "".join(f";{p}" for p in body)
            return f";{_enc(b.name)}=" + ",".join(body)
        return ",".join(body)
    text = _enc(scalar_text(v))
    if b.style == "label":
        return "." + text
    if b.style == "matrix":
        return f";{_enc(b.name)}" + (f"={text}" if text else "")
    return text


def _query_pairs(b: ParamBinding, v: Any) -> list[str]:
    safe = _RESERVED_SAFE if b.allow_reserved else ""
    name = _enc(b.name)
    if b.json:
        return [f"{name}={_enc(orjson.dumps(v).decode(), safe)}"]
    if isinstance(v, list):
        items = [_enc(scalar_text(x), safe) for x in v]
        if b.style == "form" and b.explode:
            return [f"{name}={x}" for x in items]
        sep = {"spaceDelimited": "%20", "pipeDelimited": "|"}.get(b.style, ",")
        return [f"{name}={sep.join(items)}"]
    if isinstance(v, dict):
        if b.style == "deepObject":
            return [f"{name}%5B{_enc(str(k))}%5D={_enc(scalar_text(x), safe)}" for k, x in v.items()]
        if b.explode:
            return [f"{_enc(str(k))}={_enc(scalar_text(x), safe)}" for k, x in v.items()]
        sep = {"spaceDelimited": "%20", "pipeDelimited": "|"}.get(b.style, ",")
        return [f"{name}=" + sep.join(f"{_enc(str(k), safe)}{sep}{_enc(scalar_text(x), safe)}" for k, x in v.items())]
    return [f"{name}={_enc(scalar_text(v), safe)}"]


def _header_value(b: ParamBinding, v: Any) -> str:
    if b.json:
        return orjson.dumps(v).decode()
    if isinstance(v, list):
        return ",".join(scalar_text(x) for x in v)
    if isinstance(v, dict):
        if b.explode:
            return ",".join(f"{k}={scalar_text(x)}" for k, x in v.items())
        return ",".join(f"{k},{scalar_text(x)}" for k, x in v.items())
    return scalar_text(v)


_PATH_SAFE = "/%:@!$&'()*+,;=-._~"  # RFC 3986 pchar and "/", plus "%" (values are already encoded)


def _path_prefix(base_url: str | None) -> str:
    if not base_url:
        return ""
    parts = urlsplit(base_url)
    path = parts.path if parts.scheme or parts.netloc else base_url.split("?", 1)[0]
    return path.rstrip("/")


def build_request(tool: Tool, args: Mapping[str, Any], base_url: str | None = None) -> HttpRequest:
    """The service request for a call of ``tool`` with (already validated) ``args``.

    ``base_url`` (for example ``http://orders.internal:8080/api``) replaces the spec's servers:
    its path is prefixed to the operation's path; None uses the spec's first server URL. Raises
    `ToolCallError` for what the schema cannot express: a missing path parameter, a header value
    with CR/LF/NUL, text that is not valid Unicode. Cost: O(size of the arguments).
    """
    if not isinstance(args, Mapping):
        raise ToolCallError("malformed_tool_call", f"arguments must be a JSON object, not {_json_type(args)}")
    prefix = _path_prefix(base_url if base_url is not None else tool.server_url)
    path = tool.path
    query: list[str] = []
    headers: list[tuple[str, str]] = []
    cookies: list[str] = []
    used = set()
    try:
        for b in tool.params:
            used.add(b.arg)
            if b.arg not in args:
                if b.location == "path":
                    raise ToolCallError("invalid_tool_arguments", f"invalid arguments for tool {tool.name!r}",
                                        [ArgumentError(_pointer([b.arg]), _dotted([b.arg]), "is required")],
                                        tool=tool.name)
                continue
            v = args[b.arg]
            if b.location == "path":
                path = path.replace("{" + b.name + "}", _path_value(b, v))
            elif b.location == "query":
                query.extend(_query_pairs(b, v))
            elif b.location == "header":
                text = _header_value(b, v)
                if _HEADER_BAD.search(text):
                    raise ToolCallError("invalid_tool_arguments", f"invalid arguments for tool {tool.name!r}",
                                        [ArgumentError(_pointer([b.arg]), _dotted([b.arg]),
                                                       "a header value cannot contain CR, LF or NUL")],
                                        tool=tool.name)
                headers.append((b.name.lower(), text))
            else:  # cookie
                cookies.append(f"{_enc(b.name)}={_enc(_header_value(b, v), safe='')}")
    except UnicodeEncodeError:
        raise ToolCallError("invalid_tool_arguments", f"invalid arguments for tool {tool.name!r}: text is not "
                            "valid Unicode (lone surrogate)", tool=tool.name) from None
    body_bytes = None
    body = tool.body
    if body is not None:
        content_type = body.content_type
        if body.arg is not None:
            if body.arg in args:
                content_type, body_bytes = _encode_body(args[body.arg], tool, (body.arg,))
        else:
            doc = {k: args[k] for k in body.fields if k in args}
            if body.extra:
                for k, v in args.items():
                    if k not in used and k not in doc:
                        doc[k] = v
            if doc or body.required:
                content_type, body_bytes = _encode_body(doc, tool, ())
        if body_bytes is not None:
            headers.append(("content-type", content_type))
    if cookies:
        headers.append(("cookie", "; ".join(cookies)))
    headers.append(("accept", "application/json"))
    # what the document wrote (a server URL, a path key) percent-encoded where it is not a URL path
    # character: a space, a quote or a brace there would make an invalid request target
    # (and starting with "/", which a request path must)
    target = quote(prefix + path, safe=_PATH_SAFE)
    target = (target if target.startswith("/") else "/" + target) + ("?" + "&".join(query) if query else "")
    return HttpRequest(tool.method, target, tuple(headers), body_bytes)


def _encode_body(v: Any, tool: Tool, path: tuple) -> tuple[str, bytes]:
    """``(content-type, bytes)`` of the body: JSON, or the form `extproc.semantic.form_encoding` writes."""
    form = tool.body.form if tool.body is not None else None
    if form is None:
        return tool.body.content_type, _dumps(v, tool)
    try:
        return encode_form(v, form, path=path)
    except FormEncodingError as e:
        raise ToolCallError("invalid_tool_arguments", f"invalid arguments for tool {tool.name!r}",
                            [ArgumentError(_pointer(e.path), _dotted(e.path), e.message)], tool=tool.name) from None


def _dumps(v: Any, tool: Tool) -> bytes:
    try:
        return orjson.dumps(v)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise ToolCallError("invalid_tool_arguments", f"arguments for tool {tool.name!r} cannot be sent as "
                            f"JSON: {e}", tool=tool.name) from None


# --------------------------------------------------------------------------
# Mapping the response back
# --------------------------------------------------------------------------


def _header_items(headers: Any) -> Iterable[tuple[str, str]]:
    if headers is None:
        return ()
    if isinstance(headers, Mapping):
        return headers.items()
    return headers


def tool_result(status: int, headers: Any, body: bytes | str | None, *,
                max_bytes: int = RESULT_BODY_LIMIT) -> dict:
    """The tool-result document for a service response.

    ``{"status": 200, "ok": true, "content_type": "application/json", "body": <JSON value or
    text>}`` plus ``"headers"`` (``location``, ``retry-after``, ``etag`` when present),
    ``"truncated": true`` when the body was longer than ``max_bytes`` (then it is text, cut on a
    character boundary), and for binary content a one-line description instead of the bytes.
    ``ok`` is true for 2xx. ``headers`` is a mapping or ``(name, value)`` pairs. O(body size).
    """
    hdrs: dict[str, str] = {}
    for k, v in _header_items(headers):
        key = (k.decode("latin-1") if isinstance(k, bytes) else str(k)).lower()
        if key in _RESULT_HEADERS and key not in hdrs:
            hdrs[key] = v.decode("latin-1") if isinstance(v, bytes) else str(v)
    content_type = hdrs.pop("content-type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else (body or b"")
    out: dict[str, Any] = {"status": int(status), "ok": 200 <= int(status) < 300}
    if content_type:
        out["content_type"] = content_type
    if hdrs:
        out["headers"] = hdrs
    if not raw:
        out["body"] = None
        return out
    textual = (not media or media.startswith("text/") or media.endswith("json") or media.endswith("+xml")
               or media in ("application/xml", "application/javascript", "application/x-www-form-urlencoded"))
    if not textual:
        out["body"] = f"<{len(raw)} bytes of {media}, not shown>"
        return out
    if len(raw) > max_bytes:
        text = raw[:max_bytes].decode("utf-8", "ignore")
        out["body"] = text
        out["truncated"] = True
        out["size"] = len(raw)
        return out
    if media.endswith("json") or (not media and raw[:1] in (b"{", b"[")):
        try:
            out["body"] = orjson.loads(raw)
            return out
        except orjson.JSONDecodeError:
            out["parse_error"] = "the body is not valid JSON; given as text"
    out["body"] = raw.decode("utf-8", "replace")
    return out


def _result_text(result: dict) -> str:
    return orjson.dumps(result).decode()


def openai_tool_message(result: dict, call_id: str | None) -> dict:
    """An OpenAI chat message answering a tool call: ``{"role": "tool", ...}``."""
    return {"role": "tool", "tool_call_id": call_id or "", "content": _result_text(result)}


def anthropic_tool_result(result: dict, tool_use_id: str | None) -> dict:
    """An Anthropic ``tool_result`` content block (``is_error`` when the status is not 2xx)."""
    block = {"type": "tool_result", "tool_use_id": tool_use_id or "", "content": _result_text(result)}
    if not result.get("ok"):
        block["is_error"] = True
    return block


def mcp_call_result(result: dict) -> dict:
    """An MCP ``tools/call`` result: text content, ``structuredContent`` for object bodies, ``isError``."""
    out: dict[str, Any] = {"content": [{"type": "text", "text": _result_text(result)}],
                           "isError": not result.get("ok")}
    if isinstance(result.get("body"), dict):
        out["structuredContent"] = result["body"]
    return out

