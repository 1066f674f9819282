"""Form request bodies: `application/x-www-form-urlencoded` and `multipart/form-data`.

What: at tool-build time `prepare_form(media_type, schema, encoding)` turns an OpenAPI form body
(its JSON Schema, already converted by `extproc.semantic.schemas`, and the media type's
``encoding`` map) into the tool's argument schema plus a `FormEncoding` that says how each
property goes on the wire; at call time `encode_form(doc, form)` returns the ``content-type``
header value and the body bytes for one call's body arguments.

Rules (OpenAPI 3.0/3.1 "Encoding Object" and "Special considerations for form bodies"):

* **urlencoded**: every property is serialised like a query parameter with the property's
  ``style`` (``form``, ``spaceDelimited``, ``pipeDelimited``, ``deepObject``; default ``form``) and
  ``explode`` (default true for ``form``), ``allowReserved`` keeping RFC 3986 reserved characters
  other than ``& = + #``. Spaces are ``+``, everything else percent-encoded as UTF-8 (WHATWG). Arrays
  with ``form``+explode are repeated pairs (``tag=a&tag=b``), otherwise one pair joined by ``,``,
  space or ``|``; objects with ``form``+explode become one pair per key (the property's name is not
  sent, as the specification says), ``deepObject`` gives ``name[key]=v`` (nested objects and
  arrays inside follow the common bracket convention: ``a[b][c]=v``, ``a[b][0]=v``).
* **multipart**: one part per property (``Content-Disposition: form-data; name="..."``), an array
  gives one part per item with the same name (``explode: false`` declared on an array of
  primitives: one part with the items joined by ``,``). Part content types: the encoding's
  ``contentType`` (the first of a list; a wildcard such as ``image/*`` becomes
  ``application/octet-stream``), else ``text/plain; charset=utf-8`` for primitives,
  ``application/json`` for objects and arrays, ``application/octet-stream`` for binary. A part whose
  type is JSON carries JSON text; other parts carry the value as text (containers as JSON text).
  The boundary is random (``secrets``) and checked not to occur in any part. Names and filenames
  escape ``"``, CR and LF as ``%22``, ``%0D``, ``%0A`` (the HTML standard's rule).
* **Binary properties** (``format: binary``, or 3.1 ``contentMediaType`` without
  ``contentEncoding``; also as array items) in a **multipart** body are arguments in **base64**
  (RFC 4648 standard alphabet, padding required): the tool schema says so (``contentEncoding:
  base64`` and a ``pattern``) and the part carries the decoded bytes, with the property name as
  the part's ``filename``. In a **urlencoded** body such a property is plain text (a form field
  cannot carry raw bytes); it is sent as given.
* Values: ``true``/``false`` for booleans, numbers as Python writes them (``1.5``, ``10``), strings
  as given; ``null`` properties are omitted (a form has no null), ``null`` items are empty strings.
* The encoding's ``headers`` (per-part headers) are not produced: a warning says so.

Why: many REST services (Stripe, Solr-style search APIs, upload endpoints) take form bodies; the
model fills in a JSON object and the gateway writes the form, so the model never sees the wire
format.

Cost: O(size of the arguments); a multipart body is built in one pass plus one search per part
for the boundary. No module state.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import quote_plus

import orjson

__all__ = [
    "FORM_MEDIA_TYPES",
    "MULTIPART",
    "URLENCODED",
    "FormEncoding",
    "FormEncodingError",
    "PartEncoding",
    "encode_form",
    "encode_multipart",
    "encode_urlencoded",
    "form_media_type",
    "prepare_form",
    "scalar_text",
]

URLENCODED = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
FORM_MEDIA_TYPES = (URLENCODED, MULTIPART)
"""Form media types, in the order a body with both is chosen (after JSON)."""

_STYLES = frozenset({"form", "spaceDelimited", "pipeDelimited", "deepObject"})
_RESERVED_SAFE = ":/?[]@!$'()*,;"  # RFC 3986 reserved minus & = + # (special in a form body)
_BASE64_PATTERN = r"^[A-Za-z0-9+/]*={0,2}$"
_BASE64_NOTE = "Binary content, given in base64 (RFC 4648, standard alphabet with padding)."
_TEXT_PLAIN = "text/plain; charset=utf-8"
_JSON = "application/json"
_OCTET = "application/octet-stream"


class FormEncodingError(ValueError):
    """A value that cannot be written into the form: ``path`` is the field (tuple of keys), ``message`` why."""

    def __init__(self, path: tuple, message: str) -> None:
        self.path = tuple(path)
        self.message = message
        super().__init__(f"{'.'.join(map(str, self.path)) or '(body)'}: {message}")


@dataclass(frozen=True)
class PartEncoding:
    """How one property is written: style/explode/allowReserved (urlencoded), content type (multipart)."""

    style: str = "form"
    explode: bool = True
    allow_reserved: bool = False
    content_type: str | None = None  # declared contentType (multipart), None: by the value's kind
    binary: bool = False             # the argument is base64 of the bytes to send (multipart only)
    explode_declared: bool = False   # explode was written in the document (multipart arrays)


_DEFAULT_PART = PartEncoding()


@dataclass(frozen=True)
class FormEncoding:
    """A form body's media type and the encodings of its properties (undeclared ones: defaults).

    ``properties`` is ``((name, PartEncoding), ...)`` for the properties that differ from the
    default: a tuple, so that a `Tool` holding it can be pickled (a mappingproxy cannot).
    """

    media_type: str
    properties: tuple[tuple[str, PartEncoding], ...] = ()
    _index: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._index.update(self.properties)

    def part(self, name: str) -> PartEncoding:
        """The encoding of property ``name`` (the default one when the document declares none)."""
        return self._index.get(name, _DEFAULT_PART)


def form_media_type(media: str) -> str | None:
    """`URLENCODED` or `MULTIPART` when ``media`` (a content key, parameters allowed) is one, else None."""
    m = media.split(";", 1)[0].strip().lower()
    return m if m in FORM_MEDIA_TYPES else None


# --------------------------------------------------------------------------
# Build time
# --------------------------------------------------------------------------


def _is_binary(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if schema.get("format") == "binary":
        return True
    return "contentMediaType" in schema and "contentEncoding" not in schema


def _base64_schema(schema: dict) -> dict:
    out = {k: v for k, v in schema.items() if k not in ("format", "contentMediaType", "type")}
    out["type"] = "string"
    out["contentEncoding"] = "base64"
    out["pattern"] = _BASE64_PATTERN
    if "contentMediaType" in schema:
        out["contentMediaType"] = schema["contentMediaType"]
    desc = schema.get("description")
    out["description"] = f"{desc} ({_BASE64_NOTE})" if isinstance(desc, str) and desc else _BASE64_NOTE
    return out


def _first_content_type(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    first = value.split(",", 1)[0].strip()
    return _OCTET if "*" in first else first


def prepare_form(media_type: str, schema: dict, encoding: Any) -> tuple[dict, FormEncoding, list[str]]:
    """``(tool schema for the body, FormEncoding, warnings)`` for a form body.

    ``media_type`` is `URLENCODED` or `MULTIPART`; ``schema`` the body's converted JSON Schema;
    ``encoding`` the media type object's ``encoding`` map as written (anything else: ignored, with a
    warning). Binary properties of a multipart body become base64 strings in the returned schema.
    Raises `FormEncodingError` (empty path) when the schema is not an object's (a form has fields).
    """
    kind = schema.get("type", "object") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or (kind != "object" and not (isinstance(kind, list) and "object" in kind)):
        raise FormEncodingError((), f"a {media_type} body must be an object schema (a form has fields), "
                                    f"not {kind!r}")
    warnings: list[str] = []
    if encoding is None:
        encoding = {}
    if not isinstance(encoding, dict):
        warnings.append("the media type's 'encoding' is not a mapping; ignored")
        encoding = {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    parts: dict[str, PartEncoding] = {}
    new_props = dict(props)
    multipart = media_type == MULTIPART
    for name in sorted(set(props) | {k for k in encoding if isinstance(k, str)}, key=str):
        enc = encoding.get(name) if isinstance(encoding.get(name), dict) else {}
        if name in encoding and not isinstance(encoding.get(name), dict):
            warnings.append(f"encoding of {name!r} is not a mapping; ignored")
        if name in encoding and name not in props:
            warnings.append(f"encoding names {name!r}, which is not a property of the body; ignored")
            continue
        style = enc.get("style", "form")
        if not isinstance(style, str) or style not in _STYLES:
            raise FormEncodingError((name,), f"encoding style {style!r} is not supported (form, spaceDelimited, "
                                             "pipeDelimited, deepObject)")
        explode_declared = isinstance(enc.get("explode"), bool)
        explode = enc["explode"] if explode_declared else style == "form"
        if enc.get("headers"):
            warnings.append(f"per-part headers of {name!r} ({', '.join(map(str, enc['headers']))}) are not sent")
        content_type = _first_content_type(enc.get("contentType"))
        prop = props.get(name)
        binary = False
        if multipart and isinstance(prop, dict):
            if _is_binary(prop):
                new_props[name] = _base64_schema(prop)
                binary = True
            elif prop.get("type") == "array" and _is_binary(prop.get("items")):
                new_props[name] = {**prop, "items": _base64_schema(prop["items"])}
                binary = True
        part = PartEncoding(style, bool(explode), enc.get("allowReserved") is True, content_type, binary,
                            explode_declared)
        if part != _DEFAULT_PART:
            parts[name] = part
    out = {**schema, "properties": new_props} if props else schema
    return out, FormEncoding(media_type, tuple(parts.items())), warnings


# --------------------------------------------------------------------------
# Call time
# --------------------------------------------------------------------------


def scalar_text(v: Any) -> str:
    """A primitive as URL/header/form text: JSON spelling for booleans and null, numbers as written
    (also toolcall's for path, query and header values)."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return ""
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return v
    return orjson.dumps(v).decode()  # nested containers: JSON text


def _q(text: str, path: tuple, safe: str = "") -> str:
    try:
        return quote_plus(text, safe=safe, encoding="utf-8", errors="strict")
    except UnicodeEncodeError:
        raise FormEncodingError(path, "text is not valid Unicode (lone surrogate)") from None


def _deep_pairs(prefix: str, v: Any, path: tuple, safe: str) -> list[str]:
    if isinstance(v, dict):
        out: list[str] = []
        for k, x in v.items():
            out.extend(_deep_pairs(f"{prefix}[{k}]", x, (*path, k), safe))
        return out
    if isinstance(v, list):
        out = []
        for i, x in enumerate(v):
            out.extend(_deep_pairs(f"{prefix}[{i}]", x, (*path, i), safe))
        return out
    return [f"{_q(prefix, path)}={_q(scalar_text(v), path, safe)}"]


def _urlencoded_pairs(name: str, v: Any, enc: PartEncoding, path: tuple) -> list[str]:
    safe = _RESERVED_SAFE if enc.allow_reserved else ""
    key = _q(name, path)
    sep = {"spaceDelimited": " ", "pipeDelimited": "|"}.get(enc.style, ",")
    if isinstance(v, list):
        if enc.style == "deepObject":
            return _deep_pairs(name, v, path, safe)
        if enc.style == "form" and enc.explode:
            return [f"{key}={_q(scalar_text(x), (*path, i), safe)}" for i, x in enumerate(v)]
        return [f"{key}={_q(sep.join(scalar_text(x) for x in v), path, safe)}"]
    if isinstance(v, dict):
        if enc.style == "deepObject":
            return _deep_pairs(name, v, path, safe)
        if enc.style == "form" and enc.explode:
            return [f"{_q(str(k), (*path, k))}={_q(scalar_text(x), (*path, k), safe)}" for k, x in v.items()]
        return [f"{key}={_q(sep.join(f'{k}{sep}{scalar_text(x)}' for k, x in v.items()), path, safe)}"]
    return [f"{key}={_q(scalar_text(v), path, safe)}"]


def encode_urlencoded(doc: Mapping[str, Any], form: FormEncoding, path: tuple = ()) -> bytes:
    """``doc`` (the body's fields) as an ``application/x-www-form-urlencoded`` body (ASCII bytes).

    ``path`` prefixes the field paths of errors (the wrapped body's argument name).
    Raises `FormEncodingError` for text that is not valid Unicode.
    """
    pairs: list[str] = []
    for name, v in doc.items():
        if v is None:
            continue
        pairs.extend(_urlencoded_pairs(str(name), v, form.part(str(name)), (*path, name)))
    return "&".join(pairs).encode("ascii")


def _disposition_value(text: str) -> str:
    return text.replace("\r", "%0D").replace("\n", "%0A").replace('"', "%22")


def _is_json_type(content_type: str) -> bool:
    m = content_type.split(";", 1)[0].strip().lower()
    return m == _JSON or m.endswith("+json")


def _utf8(text: str, path: tuple) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise FormEncodingError(path, "text is not valid Unicode (lone surrogate)") from None


def _part(name: str, v: Any, enc: PartEncoding, path: tuple, item_binary: bool) -> tuple[bytes, bytes]:
    """``(headers, content)`` of one part."""
    disposition = f'form-data; name="{_disposition_value(name)}"'
    if item_binary:
        if not isinstance(v, str):
            raise FormEncodingError(path, "binary content must be a base64 string")
        try:
            content = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise FormEncodingError(path, "is not valid base64 (RFC 4648, standard alphabet with padding)") from None
        disposition += f'; filename="{_disposition_value(name)}"'
        content_type = enc.content_type or _OCTET
    else:
        default = _JSON if isinstance(v, (dict, list)) else _TEXT_PLAIN
        content_type = enc.content_type or default
        if _is_json_type(content_type):
            content = orjson.dumps(v)
        else:
            content = _utf8(scalar_text(v), path)
    headers = f"Content-Disposition: {disposition}\r\nContent-Type: {content_type}\r\n"
    return _utf8(headers, path), content


def encode_multipart(doc: Mapping[str, Any], form: FormEncoding, *, boundary: str | None = None,
                     path: tuple = ()) -> tuple[str, bytes]:
    """``(content-type header value, body)`` of ``doc`` as ``multipart/form-data`` (RFC 7578).

    ``boundary`` is for tests (checked like a random one); ``path`` prefixes error paths. Raises
    `FormEncodingError` for invalid base64 in a binary property or invalid Unicode.
    """
    parts: list[tuple[bytes, bytes]] = []
    for name, v in doc.items():
        if v is None:
            continue
        name = str(name)
        enc = form.part(name)
        p = (*path, name)
        if isinstance(v, list) and (enc.binary or not (enc.explode_declared and not enc.explode)):
            for i, x in enumerate(v):
                parts.append(_part(name, x, enc if enc.binary else PartEncoding(content_type=enc.content_type),
                                   (*p, i), enc.binary))
        elif isinstance(v, list):  # explode: false declared: one part, items joined by ","
            parts.append(_part(name, ",".join(scalar_text(x) for x in v), enc, p, False))
        else:
            parts.append(_part(name, v, enc, p, enc.binary))
    for _ in range(8):
        b = boundary or f"adapter-gateway-{secrets.token_hex(16)}"
        marker = b"--" + b.encode("ascii")
        if not any(marker in h or marker in c for h, c in parts):
            break
        if boundary is not None:
            raise FormEncodingError(path, f"the boundary {boundary!r} occurs in the content")
    else:  # pragma: no cover (8 random 128-bit boundaries all inside the content)
        raise FormEncodingError(path, "no boundary found that does not occur in the content")
    chunks = []
    for headers, content in parts:
        chunks += [marker, b"\r\n", headers, b"\r\n", content, b"\r\n"]
    chunks += [marker, b"--\r\n"]
    return f"{MULTIPART}; boundary={b}", b"".join(chunks)


def encode_form(doc: Mapping[str, Any], form: FormEncoding, *, boundary: str | None = None,
                path: tuple = ()) -> tuple[str, bytes]:
    """``(content-type header value, body)`` for ``doc`` in ``form``'s media type."""
    if not isinstance(doc, Mapping):
        raise FormEncodingError(path, f"a {form.media_type} body must be an object")
    if form.media_type == MULTIPART:
        return encode_multipart(doc, form, boundary=boundary, path=path)
    return URLENCODED, encode_urlencoded(doc, form, path)
