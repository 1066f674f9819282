"""Benchmark: what loading an OpenAPI document and making its tools costs, by size.

What it measures, in one process on one core: `extproc.semantic.openapi.load_spec` (parse, check,
`$ref` walk) and `extproc.semantic.tools.build_tools` (one tool per operation, parameters and body
schemas resolved) on generated specs of 50, 500 and 5000 operations (each pair of operations shares
a path parameter, a query parameter by `$ref`, and a recursive `Thing` schema), once as JSON and
once as YAML; and the YAML "billion laughs" document (24 levels of four aliases each: 4**24 leaves
if it were expanded) that `load_spec` must read without expanding. This is config-load time (at
start and on reload), not per request. The figures used to be unit-test thresholds
(tests/extproc/semantic: "5000 operations in under 20 s", "the alias bomb in under 2 s"); the
tests now check what is built, and this reports how long it takes, including how it grows with
the number of operations (linear is the expectation: the per-operation cost should stay flat).

Each figure is the median of the repeats (minimum beside it). Prints a table and, unless
--no-write, appends a dated section to perf/RESULTS.md (append only).

    .venv/bin/python perf/bench_openapi.py              # measure and append
    .venv/bin/python perf/bench_openapi.py --no-write   # print only
    .venv/bin/python perf/bench_openapi.py --quick      # 1 repeat, no 5000-operation YAML point

Cost: about 15 s (3 s with --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

import orjson  # noqa: E402
import yaml  # noqa: E402

from extproc.semantic.openapi import load_spec  # noqa: E402
from extproc.semantic.tools import build_tools  # noqa: E402



def big_spec(operations: int) -> dict:
    """The spec of tests/extproc/semantic/test_tools.py's scale test: `operations` operations."""
    paths = {}
    for i in range(operations // 2):
        paths[f"/things{i}/{{id}}"] = {
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "get": {"operationId": f"getThing{i}", "summary": f"Get thing {i}", "parameters": [
                {"name": "q", "in": "query", "schema": {"$ref": "#/components/schemas/Q"}}],
                "responses": {"200": {"description": "ok", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Thing"}}}}}},
            "post": {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Thing"}}}}, "responses": {"201": {"description": "made"}}}}
    return {"openapi": "3.0.3", "info": {"title": "big", "version": "1"}, "paths": paths, "components": {"schemas": {
        "Q": {"type": "string", "enum": ["a", "b"]},
        "Thing": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/components/schemas/Thing"}}}}}}}


def alias_bomb() -> bytes:
    lines = ["openapi: 3.0.0", "info: {title: t, version: '1'}", "paths: {}", "tags:", "  - a0: &a0 [1, 2]"]
    lines += [f"    a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 25)]
    return "\n".join(lines).encode()


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(median, min) seconds of one call of ``fn``."""
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs), min(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="one repeat; no 5000-operation YAML point")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else 5
    rows = []
    for operations in (50, 500, 5000):
        spec = big_spec(operations)
        for form, data in (("JSON", orjson.dumps(spec)), ("YAML", yaml.safe_dump(spec).encode())):
            if args.quick and form == "YAML" and operations == 5000:
                continue
            load_med, load_min = timed(lambda: load_spec(data), repeats)
            loaded = load_spec(data)
            tools = build_tools(loaded)
            assert len(tools.tools) == operations and not tools.skipped
            build_med, build_min = timed(lambda: build_tools(loaded), repeats)
            rows.append((f"{operations} operations, {form} ({len(data) // 1024} KiB)", load_med, load_min,
                         build_med, build_min, operations))
            print(f"{rows[-1][0]:38s} load {load_med * 1e3:9.1f} ms  build_tools {build_med * 1e3:9.1f} ms  "
                  f"({(load_med + build_med) / operations * 1e6:.0f} µs per operation)", flush=True)
    bomb = alias_bomb()
    bomb_med, bomb_min = timed(lambda: load_spec(bomb), repeats)
    print(f"{'alias bomb (4**24 leaves unexpanded)':38s} load {bomb_med * 1e3:9.1f} ms", flush=True)
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    table = ["| document | load_spec ms (median / min) | build_tools ms (median / min) | µs per operation |",
             "|---|---:|---:|---:|"]
    table += [f"| {label} | {lm * 1e3:.1f} / {ln * 1e3:.1f} | {bm * 1e3:.1f} / {bn * 1e3:.1f} | "
              f"{(lm + bm) / ops * 1e6:.0f} |" for label, lm, ln, bm, bn, ops in rows]
    table.append(f"| alias bomb, YAML (4**24 leaves if expanded) | {bomb_med * 1e3:.1f} / {bomb_min * 1e3:.1f} | | |")
    if not args.no_write:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python perf/bench_openapi.py" + (" --quick" if args.quick else "")
        text = f"""
## {now}: bench_openapi (loading an OpenAPI document and making its tools)

- Machine: {benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; load average {load}
- Code: git {benchenv.git_revision()}
- Command: `{command}` ({repeats} repeat(s) per figure, one process, one core)

{chr(10).join(table)}
"""
        benchenv.append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
