"""Fuzz target `config`: `extproc.config.loader.load_text` on mutated and random config documents.

What: the repo's valid configs (examples/*.yaml, tests/data/brief-example.yaml,
tests/data/recorded/config.yaml, perf/configs/bench-gateway.yaml, tests/fuzz/data/gateway.yaml)
are parsed and mutated as data (a field dropped, a list item duplicated, a value retyped: number to
string, string to list, mapping to scalar, null; an unknown field added; a value taken from another
field; numbers pushed to their edges) and written back as YAML or JSON, or mutated as text (a line
deleted, duplicated or re-indented, a character inserted, the text cut short); some documents are
random JSON values.
Properties, per case:
- `load_text` returns a `Snapshot` or raises `ConfigError`; nothing else;
- every problem a `ConfigError` lists names the file (`<file>:<line>` when a line is known), a
  field path and a non-empty reason (an `Issue`), or, for the few whole-file refusals (YAML syntax,
  an endpoint override), is a string starting with the file name and carrying a reason;
- the case ends within `CASE_LIMIT_S`.
Cost: about 2 to 10 ms per case (YAML parsing and the compile, OpenAPI documents included).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from extproc.config.loader import ConfigError, Issue, load_text
from tests.fuzz.harness import SUITE, Finding, pick, refusal_class, time_limit

REPO = Path(__file__).resolve().parents[2]
SEEDS = ["examples/finance-llm-adapter.yaml", "examples/inference-backends.yaml", "examples/compose.yaml",
         "examples/canary.yaml", "tests/data/brief-example.yaml", "tests/data/recorded/config.yaml",
         "perf/configs/bench-gateway.yaml", "tests/fuzz/data/gateway.yaml"]
# the file name every case is loaded as: relative names (openapi, mapping) resolve beside it
FILENAME = str(REPO / "tests" / "fuzz" / "data" / "fuzzed.yaml")


@cache
def seeds() -> tuple[tuple[str, object], ...]:
    """(text, parsed document) of each seed config that exists here (tool and rest routes' files
    are given as absolute paths, so they resolve from the fuzzed file's directory too)."""
    out = []
    for name in SEEDS:
        p = REPO / name
        if not p.exists():
            continue
        text = p.read_text()
        text = text.replace("../../data/", f"{REPO / 'tests' / 'data'}/")
        out.append((text, yaml.safe_load(text)))
    return tuple(out)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: the same text, 8x faster

# --- strategies ---------------------------------------------------------------------------------------

scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.sampled_from(
    [0, -1, 1, 65535, 65536, 2**31, 2**63, 1.5, -0.0, 1e308, "", " ", "0", "-1", "1Gi", "10MiB", "1.5s", "0s", "-5s",
     "10h", "abc", "ort", "llm", "127.0.0.1:0", "host:99999", "[::1]:80", "/v1/", "*", "prefix", "exact", "tool",
     "openai", "kserve", "tensor", "passthrough", "rest", "health", "llm", "grpc", "http", "$.output.x",
     "{\"a\": $.b}", "{", "$.", "\x00", "é", "a" * 300, "../../etc/passwd", "x.yaml"]), st.text(max_size=12))
value = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=6)


def _paths(doc, prefix=()):
    """Every path (tuple of keys and indices) into `doc`."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _copy(doc):
    return json.loads(json.dumps(doc))


@st.composite
def mutate_doc(draw, doc):
    doc = _copy(doc)
    for _ in range(draw(st.integers(1, 4))):
        paths = list(_paths(doc))
        path = draw(st.sampled_from(paths))
        how = draw(pick(["drop", "dup", "retype", "null", "extra", "swap", "edge"]))
        if not path:
            if how == "retype":
                doc = draw(value)
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        current = parent[key]
        if how == "drop":
            del parent[key]
        elif how == "dup" and isinstance(parent, list):
            parent.insert(key, _copy(current))
        elif how == "dup" and isinstance(current, list) and current:
            current.append(_copy(current[draw(st.integers(0, len(current) - 1))]))
        elif how == "retype":
            if isinstance(current, (int, float)) and not isinstance(current, bool):
                parent[key] = draw(st.sampled_from([str(current), [current], {"v": current}, True]))
            elif isinstance(current, str):
                parent[key] = draw(st.sampled_from([[current], {current: current}, 7, False, current * 3]))
            elif isinstance(current, (dict, list)):
                parent[key] = draw(scalar)
            else:
                parent[key] = draw(value)
        elif how == "null":
            parent[key] = None
        elif how == "extra" and isinstance(current, dict):
            current[draw(pick(["extra", "Name", "kind", "routes", "port", "x-y"]) | st.text(max_size=6))] \
                = draw(value)
        elif how == "swap":
            other = _get(doc, draw(st.sampled_from(paths)))
            parent[key] = _copy(other) if other is not doc else draw(value)
        elif how == "edge":
            parent[key] = draw(scalar)
    return doc


@st.composite
def mutate_text(draw, text: str) -> str:
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, max(len(lines) - 1, 0)))
        how = draw(pick(["delete", "dup", "indent", "dedent", "insert", "cut", "tab"]))
        if how == "delete" and lines:
            del lines[i]
        elif how == "dup" and lines:
            lines.insert(i, lines[i])
        elif how == "indent" and lines:
            lines[i] = "  " + lines[i]
        elif how == "dedent" and lines:
            lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i]
        elif how == "insert" and lines:
            j = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:j] + draw(pick(list(":-{}[]&*!|>'\"#%@`,?\t") + ["\x00", "é", "\ufeff"])) \
                + lines[i][j:]
        elif how == "cut":
            lines = lines[:i]
        elif how == "tab" and lines:
            lines[i] = "\t" + lines[i]
    return "\n".join(lines)


@dataclass(frozen=True)
class ConfigCase:
    text: str

    def __repr__(self) -> str:
        return f"ConfigCase(text=<<<\n{self.text}\n>>>)"


@st.composite
def config_cases(draw) -> ConfigCase:
    how = draw(pick(["doc", "doc", "doc", "text", "text", "random", "as-is"]))
    text, doc = seeds()[draw(pick(range(len(seeds()))))]
    if how == "as-is":
        return ConfigCase(text)
    if how == "text":
        return ConfigCase(draw(mutate_text(text)))
    if how == "random":
        doc = draw(value | st.fixed_dictionaries({"apiVersion": st.just("adapter.ai/v1"),
                                                  "kind": st.just("AdapterGateway"), "spec": value}))
    else:
        doc = draw(mutate_doc(doc))
    if draw(st.booleans()):
        return ConfigCase(json.dumps(doc, ensure_ascii=draw(st.booleans())))
    return ConfigCase(yaml.dump(doc, Dumper=_DUMPER, allow_unicode=True, sort_keys=False))


CASES = config_cases()


# --- the properties -----------------------------------------------------------------------------------

_WHERE = re.compile(re.escape(FILENAME) + r"(:\d+)?")


def check(case: ConfigCase) -> str | None:
    with time_limit():
        try:
            load_text(case.text, FILENAME)
        except ConfigError as e:
            if not e.issues:
                raise Finding("ConfigError with no problem listed") from None
            classes = []
            for issue in e.issues:
                if isinstance(issue, Issue):
                    if not _WHERE.fullmatch(issue.where):
                        raise Finding(f"problem without its file:line: {issue!s}") from None
                    if not issue.path or not issue.reason.strip():
                        raise Finding(f"problem without a field path or a reason: {issue!r}") from None
                    classes.append(refusal_class(issue.reason, 80))
                else:
                    text = str(issue)
                    if not text.startswith(FILENAME) or not text[len(FILENAME):].lstrip(":0123456789 ").strip():
                        raise Finding(f"problem without its file or a reason: {text!r}") from None
                    classes.append(refusal_class(text[len(FILENAME):].lstrip(":0123456789 "), 80))
            return classes[0]
    return None


@SUITE
@given(CASES)
def test_configs_load_or_are_refused_with_file_line_path_and_reason(case):
    check(case)
