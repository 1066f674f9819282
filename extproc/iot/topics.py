"""MQTT topic templates: `plant/{$.device}/cmd/{$.params.zone ?? "all"}`.

What: a topic string whose `{...}` placeholders are template expressions of the project's safe
template engine (`extproc/template.py`: JSONPath with `??` defaults, compiled once, never executed).
Rules: the literal text must be a valid topic without wildcards (`+`, `#`), NUL or empty levels
at the ends; a rendered value must be a string, integer or boolean, non-empty, and contain no `/`,
`+`, `#` or NUL, so a client's document cannot add topic levels or subscribe-style wildcards
(`invalid_topic`, 400). `filter` is the subscription filter that matches every rendered topic: each
level holding a placeholder becomes `+`.
Cost: compile once per config load; render is one template render per placeholder and a join
(about 1 us for one placeholder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from extproc.template import Template, TemplateError, compile_template

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_BAD_VALUE = re.compile(r"[/+#\x00]")
_BAD_LITERAL = re.compile(r"[+#\x00]")
MAX_TOPIC_BYTES = 65535


class TopicError(ValueError):
    """A topic template that does not compile (config load) or a value that would break the topic
    (request time: `path` names the placeholder)."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class TopicTemplate:
    source: str
    parts: tuple[str | Template, ...]  # literal text and placeholders, in order
    filter: str  # subscription filter matching every topic it renders

    @property
    def is_literal(self) -> bool:
        return all(isinstance(p, str) for p in self.parts)

    def render(self, doc: Any) -> str:
        """The topic for `doc`; TopicError naming the placeholder for a value that is not a plain
        topic level; the template engine's MissingPathError for a missing path without a default."""
        out = []
        for p in self.parts:
            if isinstance(p, str):
                out.append(p)
                continue
            v = p.render(doc)
            where = p.paths[0].text if p.paths else p.source
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif isinstance(v, int):
                v = str(v)
            elif not isinstance(v, str):
                raise TopicError(f"{where} is {type(v).__name__}, not a string or integer", where)
            if not v or _BAD_VALUE.search(v):
                raise TopicError(f"{where} = {v!r} is not a topic level (empty, or contains / + # or NUL)", where)
            out.append(v)
        topic = "".join(out)
        if len(topic.encode()) > MAX_TOPIC_BYTES:
            raise TopicError(f"topic is over {MAX_TOPIC_BYTES} bytes")
        return topic


def compile_topic(source: str) -> TopicTemplate:
    """Compile a topic template; TopicError with the reason (and the placeholder) otherwise."""
    if not source:
        raise TopicError("a topic cannot be empty")
    parts: list[str | Template] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(source):
        if m.start() > pos:
            parts.append(source[pos:m.start()])
        expr = m.group(1).strip()
        if not expr.startswith("$"):
            raise TopicError(f"placeholder {{{m.group(1)}}} must be a path such as {{$.device}}", m.group(0))
        try:
            parts.append(compile_template(expr))
        except TemplateError as e:
            raise TopicError(f"placeholder {{{m.group(1)}}}: {e.message} (column {e.column})", m.group(0)) from None
        pos = m.end()
    if pos < len(source):
        parts.append(source[pos:])
    literal = "".join(p for p in parts if isinstance(p, str))
    if "{" in literal or "}" in literal:
        raise TopicError("unbalanced { or } (placeholders are {$.path}; nested braces are not allowed)")
    if _BAD_LITERAL.search(literal):
        raise TopicError("a topic template cannot contain the wildcards + or #, or NUL")
    # the filter: every level with a placeholder in it matches any value
    levels: list[str] = [""]
    wild = [False]
    for p in parts:
        if not isinstance(p, str):
            wild[-1] = True
            continue
        pieces = p.split("/")
        levels[-1] += pieces[0]
        for piece in pieces[1:]:
            levels.append(piece)
            wild.append(False)
    flt = "/".join("+" if w else lv for lv, w in zip(levels, wild))
    return TopicTemplate(source, tuple(parts), flt)


__all__ = ["TopicTemplate", "TopicError", "compile_topic"]
