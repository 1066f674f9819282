"""YAML source reading with line numbers, so config errors can name file, line and field path.

What: `load_yaml(text, filename)` parses YAML into plain Python values and returns a
`SourceMap` from field paths (tuples of keys and indices) to 1-based line numbers.
Why: operators fix configs from error messages; "spec.routes[0].transfrom: unknown field" is only
useful with "examples/x.yaml:12". Duplicate mapping keys are refused here (PyYAML silently keeps
the last one, which would lose config).
Cost: one compose pass over the document at load time; never on the request path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[str | int, ...]


def format_path(path: Path) -> str:
    """Render a field path as `spec.routes[0].transform` (what operators read in errors)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<document>"


@dataclass(frozen=True)
class SourceMap:
    """Where each field of a loaded document came from."""

    filename: str
    lines: dict[Path, int] = field(default_factory=dict)
    # 1-based line of the first content line of block scalars (`|`, `>`), for template errors.
    content_lines: dict[Path, int] = field(default_factory=dict)

    def line_of(self, path: Path) -> int | None:
        """Line of `path`, or of its nearest ancestor that has one."""
        p = tuple(path)
        while True:
            if p in self.lines:
                return self.lines[p]
            if not p:
                return None
            p = p[:-1]

    def where(self, path: Path) -> str:
        line = self.line_of(path)
        return f"{self.filename}:{line}" if line else self.filename


class YamlError(ValueError):
    """The file is not valid YAML (or has duplicate keys); message carries file and line."""


def load_yaml(text: str, filename: str) -> tuple[Any, SourceMap]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise YamlError(f"{filename}{line}: invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:  # pragma: no cover - non-marked errors are rare
        raise YamlError(f"{filename}: invalid YAML: {e}") from None
    smap = SourceMap(filename)
    if node is None:
        return None, smap
    constructor = yaml.SafeLoader("")

    def construct(n: yaml.Node) -> Any:
        """A scalar's value; an unknown tag (`!x`, `!!python/object`) or a bad `!!int`/`!!float`/
        `!!timestamp` value is a YamlError with the node's line, not an exception out of the loader."""
        try:
            return constructor.construct_object(n, deep=True)
        except yaml.YAMLError as e:
            raise YamlError(f"{filename}:{n.start_mark.line + 1}: invalid YAML: {getattr(e, 'problem', None) or e}") \
                from None
        except (ValueError, TypeError, OverflowError) as e:
            raise YamlError(f"{filename}:{n.start_mark.line + 1}: invalid YAML value for {n.tag}: {e}") from None

    def build(n: yaml.Node, path: Path) -> Any:
        smap.lines[path] = n.start_mark.line + 1
        if isinstance(n, yaml.MappingNode):
            out: dict[str, Any] = {}
            for k_node, v_node in n.value:
                key = construct(k_node)
                if not isinstance(key, str):
                    key = str(key)
                if key in out:
                    raise YamlError(
                        f"{filename}:{k_node.start_mark.line + 1}: {format_path(path + (key,))}: "
                        f"duplicate key (a later value would silently replace the earlier one)"
                    )
                smap.lines[path + (key,)] = k_node.start_mark.line + 1
                out[key] = build(v_node, path + (key,))
                smap.lines[path + (key,)] = k_node.start_mark.line + 1
            return out
        if isinstance(n, yaml.SequenceNode):
            return [build(item, path + (i,)) for i, item in enumerate(n.value)]
        if isinstance(n, yaml.ScalarNode) and n.style in ("|", ">"):
            smap.content_lines[path] = n.start_mark.line + 2
        elif isinstance(n, yaml.ScalarNode):
            smap.content_lines[path] = n.start_mark.line + 1
        return construct(n)

    return build(node, ()), smap
