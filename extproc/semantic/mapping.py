"""Mapping files: two templates plus value conversions, applied in either direction.

What: a mapping file (written by ``adapterctl align``, reviewed by a person) is YAML::

    apiVersion: adapter.ai/v1
    kind: FieldMapping
    legacy: stripe-excerpt.yaml#/components/schemas/charge     # informational
    adapter: payment.schema.json                              # informational
    forward: |            # template: legacy document -> adapter document (renames, nesting)
      {"amt": $.amount, "createdTs": $.created}
    inverse: |            # template: adapter document -> legacy document
      {"amount": $.amt, "created": $.createdTs}
    conversions:          # value conversions, applied after the template of each direction
      - field: $.createdTs       # path in the adapter document (forward output)
        source: $.created        # path in the legacy document (inverse output)
        kind: unix_to_iso8601
        params: {unit: s}

`compile_mapping(doc)` checks it once (templates compiled by `extproc.template`, conversions by
`extproc.semantic.conversions`, paths parsed with the template path syntax) and returns a
`CompiledMapping`: ``forward(legacy_doc)`` renders ``forward`` and then converts each ``field``
with the conversion's ``forward``; ``inverse(adapter_doc)`` renders ``inverse`` and converts each
``source`` with the conversion's ``inverse``. A path that is missing from the rendered document
is left alone (the field was optional); ``[*]`` in a path converts every element.

Why: the template language deliberately has no functions, so value conversions cannot live in
template text; this module is the runtime hook that applies them next to a template, on a
freshly rendered document (the template's output is never shared with the input, so converting in
place is safe).

Cost: one template render plus, per conversion, a path walk and the conversion itself; a
typical request/response pair is a few microseconds (perf/bench_mapping.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from backends.base import MappingError as _BackendMappingError
from extproc.semantic.conversions import Conversion, ConversionError, make_conversion
from extproc.template import WILDCARD, Template, TemplateError, compile_template, path_text

__all__ = ["CompiledMapping", "FieldConversion", "MappingError", "compile_mapping", "load_mapping", "parse_path"]


class MappingError(_BackendMappingError):
    """A mapping file is invalid (load time), or a value failed to convert (run time).

    ``field`` is the mapping-file key (``forward``, ``conversions[2].params``...) at load time,
    or the document path of the value at run time; ``conversion_error`` is the cause then.
    A `backends.base.MappingError`, which the `rest` adapter catches without importing this module.
    """

    def __init__(self, field: str, message: str, conversion_error: ConversionError | None = None) -> None:
        super().__init__(field, message)
        self.conversion_error = conversion_error


@dataclass(frozen=True)
class FieldConversion:
    """A conversion bound to its place: ``field`` (adapter side) and ``source`` (legacy side)."""

    field: tuple
    source: tuple
    conversion: Conversion

    def to_dict(self) -> dict:
        return {"field": path_text(self.field), "source": path_text(self.source), **self.conversion.to_dict()}


def parse_path(text: str) -> tuple:
    """The steps of a template path (``$.a.b[0]``, ``$['k']``, ``[*]``); ValueError if not one."""
    if not isinstance(text, str) or not text.strip().startswith("$"):
        raise ValueError(f"expected a path such as $.name, not {text!r}")
    try:
        tpl = compile_template(text.strip())
    except TemplateError as e:
        raise ValueError(f"bad path {text!r}: {e}") from None
    if len(tpl.paths) != 1 or tpl.paths[0].has_default:
        raise ValueError(f"expected a single path such as $.name, not {text!r}")
    steps = tpl.paths[0].steps
    if not steps:
        raise ValueError("the path must name a field, not the whole document ($)")
    return steps


def _apply(doc: Any, steps: tuple, fn, i: int = 0) -> None:
    """Replace the value(s) at ``steps`` in ``doc`` by ``fn(value)``, in place; missing: no-op."""
    cur = doc
    last = len(steps) - 1
    while i < last:
        s = steps[i]
        if s is WILDCARD:
            elems = cur.values() if isinstance(cur, dict) else cur if isinstance(cur, list) else ()
            for e in list(elems):
                _apply(e, steps, fn, i + 1)
            return
        if isinstance(s, str) and not isinstance(cur, dict):
            return
        if isinstance(s, int) and not isinstance(cur, list):
            return
        try:
            cur = cur[s]
        except (KeyError, IndexError):
            return
        i += 1
    s = steps[last]
    if s is WILDCARD:
        if isinstance(cur, dict):
            for k in list(cur):
                cur[k] = fn(cur[k])
        elif isinstance(cur, list):
            for j in range(len(cur)):
                cur[j] = fn(cur[j])
        return
    if isinstance(s, str):
        if isinstance(cur, dict) and s in cur:
            cur[s] = fn(cur[s])
    elif isinstance(cur, list) and -len(cur) <= s < len(cur):
        cur[s] = fn(cur[s])


class CompiledMapping:
    """A checked mapping: `forward` (legacy -> adapter) and `inverse` (adapter -> legacy).

    Immutable after construction and thread-safe. ``lossless`` is true when every conversion is.
    """

    __slots__ = ("forward_template", "inverse_template", "conversions", "legacy", "adapter")

    def __init__(self, forward_template: Template, inverse_template: Template | None,
                 conversions: tuple[FieldConversion, ...], legacy: str = "", adapter: str = "") -> None:
        self.forward_template = forward_template
        self.inverse_template = inverse_template
        self.conversions = conversions
        self.legacy = legacy
        self.adapter = adapter

    @property
    def lossless(self) -> bool:
        return all(c.conversion.lossless for c in self.conversions)

    def _convert(self, doc: Any, forward: bool) -> Any:
        for fc in self.conversions:
            fn = fc.conversion.forward if forward else fc.conversion.inverse
            steps = fc.field if forward else fc.source
            try:
                _apply(doc, steps, fn)
            except ConversionError as e:
                # always the adapter schema's path: the contract the gateway's clients see
                raise MappingError(path_text(fc.field), e.message, e) from None
        return doc

    def forward(self, legacy_doc: Any) -> Any:
        """The adapter document for ``legacy_doc``.

        Raises `extproc.template.MissingPathError` (a required path is missing) or
        `MappingError` (a value cannot be converted; ``field`` is its adapter path).
        """
        return self._convert(self.forward_template.render(legacy_doc), True)

    def inverse(self, adapter_doc: Any) -> Any:
        """The legacy document for ``adapter_doc`` (see `forward`); needs an ``inverse`` template."""
        if self.inverse_template is None:
            raise MappingError("inverse", "this mapping has no inverse template")
        return self._convert(self.inverse_template.render(adapter_doc), False)

    def to_dict(self) -> dict:
        """The mapping-file document (what `compile_mapping` reads)."""
        out: dict[str, Any] = {"apiVersion": "adapter.ai/v1", "kind": "FieldMapping"}
        if self.legacy:
            out["legacy"] = self.legacy
        if self.adapter:
            out["adapter"] = self.adapter
        out["forward"] = self.forward_template.source
        if self.inverse_template is not None:
            out["inverse"] = self.inverse_template.source
        out["conversions"] = [c.to_dict() for c in self.conversions]
        return out


def compile_mapping(doc: Mapping[str, Any]) -> CompiledMapping:
    """Check and compile a parsed mapping file; `MappingError` names the faulty key.

    Cost: one template compile per direction plus one path parse per conversion; load time only.
    """
    if not isinstance(doc, Mapping):
        raise MappingError("(document)", "a mapping file must be a YAML mapping with forward, inverse, conversions")
    unknown = set(doc) - {"apiVersion", "kind", "legacy", "adapter", "forward", "inverse", "conversions", "notes"}
    if unknown:
        raise MappingError(sorted(unknown)[0], "unknown key; expected forward, inverse, conversions "
                           "(and apiVersion, kind, legacy, adapter, notes)")
    if doc.get("kind", "FieldMapping") != "FieldMapping":
        raise MappingError("kind", f"expected FieldMapping, not {doc.get('kind')!r}")
    templates: dict[str, Template | None] = {}
    for key in ("forward", "inverse"):
        text = doc.get(key)
        if text is None:
            if key == "forward":
                raise MappingError("forward", "missing: the template that maps a legacy document to the adapter's")
            templates[key] = None
            continue
        if not isinstance(text, str):
            raise MappingError(key, f"must be template text (a YAML block string), not {type(text).__name__}")
        try:
            templates[key] = compile_template(text)
        except TemplateError as e:
            raise MappingError(key, str(e)) from None
    conversions = []
    raw = doc.get("conversions")
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise MappingError("conversions", "must be a list")
    for i, c in enumerate(raw):
        where = f"conversions[{i}]"
        if not isinstance(c, Mapping):
            raise MappingError(where, "must be a mapping with field, source, kind, params")
        extra = set(c) - {"field", "source", "kind", "params", "note"}
        if extra:
            raise MappingError(f"{where}.{sorted(extra)[0]}", "unknown key; expected field, source, kind, params")
        try:
            field = parse_path(c.get("field"))
        except ValueError as e:
            raise MappingError(f"{where}.field", str(e)) from None
        try:
            source = parse_path(c["source"]) if c.get("source") is not None else field
        except ValueError as e:
            raise MappingError(f"{where}.source", str(e)) from None
        try:
            conv = make_conversion(c.get("kind"), c.get("params"))
        except ConversionError as e:
            raise MappingError(f"{where}.kind" if "kind" in e.message else f"{where}.params", str(e)) from None
        conversions.append(FieldConversion(field, source, conv))
    return CompiledMapping(templates["forward"], templates["inverse"], tuple(conversions),
                           str(doc.get("legacy", "")), str(doc.get("adapter", "")))


def load_mapping(path: str | Path) -> CompiledMapping:
    """Read and compile a mapping file (YAML, UTF-8); `MappingError` on any fault."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise MappingError(str(p), f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise MappingError(str(p), f"not UTF-8 (byte {e.start})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise MappingError(str(p), f"not valid YAML: {e}") from None
    return compile_mapping(doc)
