"""Benchmark: what semantic mapping costs per request, in microseconds.

What it measures, on one core of this machine, in-process (no Envoy, no network):

* A typical request/response pair through a mapping file made by `adapterctl align` (the
  `extproc.semantic.align` output for an order contract: 9 fields, one nested object, an array,
  5 value conversions: ISO 8601 -> Unix, Unix -> ISO 8601, string -> number, two enum maps):
  the template render alone (`extproc.template`), render plus conversions
  (`extproc.semantic.mapping`), and the whole hop with JSON parse and serialise (orjson), for the
  response (forward: legacy -> adapter) and the request (inverse: adapter -> legacy).
* Each conversion kind alone, forward and inverse.
* The tool-call path of a route that executes LLM tool calls: parse an OpenAI tool call,
  validate its arguments (jsonschema), build the service request, map the response to a tool
  result (`extproc.semantic.toolcall`), on the OAI petstore-expanded ``addPet`` tool.

Each figure is the median over 7 timeit repeats (each about 0.2 s) of the time per call; the
minimum is beside it, and the summary line uses the minima, which other processes on a shared
machine disturb least. Prints a table and, unless --no-write, appends a dated section to
perf/RESULTS.md (append only: other benchmarks write there too).

    .venv/bin/python perf/bench_mapping.py              # measure and append
    .venv/bin/python perf/bench_mapping.py --no-write   # measure and print only
    .venv/bin/python perf/bench_mapping.py --quick      # 3 shorter repeats (a look, not a record)

Cost: about 30 s (5 s with --quick).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script\'s folder, on sys.path)

import orjson  # noqa: E402
import yaml  # noqa: E402

from extproc.semantic.align import align_schemas  # noqa: E402
from extproc.semantic.conversions import make_conversion  # noqa: E402
from extproc.semantic.mapping import compile_mapping  # noqa: E402
from extproc.semantic.openapi import load_spec  # noqa: E402
from extproc.semantic.toolcall import build_request, parse_tool_call, tool_result, validate_arguments  # noqa: E402
from extproc.semantic.tools import build_tools  # noqa: E402
from extproc.template import compile_template  # noqa: E402


LEGACY = {"type": "object", "title": "order", "required": [
    "order_id", "created_at", "amount", "status", "is_gift", "updated", "customer", "tags"], "properties": {
    "order_id": {"type": "string"},
    "created_at": {"type": "string", "format": "date-time"},
    "amount": {"type": "string"},
    "status": {"type": "string", "enum": ["in_progress", "done", "cancelled"]},
    "is_gift": {"type": "boolean"},
    "updated": {"type": "integer"},
    "customer": {"type": "object", "required": ["name", "email"], "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}}},
    "tags": {"type": "array", "items": {"type": "string"}},
}}
ADAPTER = {"type": "object", "required": ["orderId", "createdTs", "amt", "orderStatus", "giftFlag", "updatedAt",
                                          "customerName", "customerEmail", "tags"], "properties": {
    "orderId": {"type": "string"},
    "createdTs": {"type": "integer"},
    "amt": {"type": "number"},
    "orderStatus": {"type": "string", "enum": ["InProgress", "Done", "Cancelled"]},
    "giftFlag": {"type": "string", "enum": ["Y", "N"]},
    "updatedAt": {"type": "string", "format": "date-time"},
    "customerName": {"type": "string"},
    "customerEmail": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
}}
RESPONSE = {"order_id": "ORD-2024-000123", "created_at": "2024-05-01T12:00:00Z", "amount": "1249.5",
            "status": "in_progress", "is_gift": False, "updated": 1714564800,
            "customer": {"name": "张三", "email": "zhang.san@example.com"}, "tags": ["priority", "export"]}


def measure(fn: Callable[[], Any], repeats: int, target_s: float) -> tuple[float, float]:
    """(median, min) microseconds per call of ``fn``."""
    timer = timeit.Timer(fn)
    number, elapsed = timer.autorange()
    number = max(1, int(number * target_s / max(elapsed, 1e-9)))
    runs = [t / number * 1e6 for t in timer.repeat(repeat=repeats, number=number)]
    return statistics.median(runs), min(runs)


def machine_info() -> dict[str, str]:
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {"cpu": benchenv.cpu(), "kernel": platform.release(),
            "python": platform.python_version(),
            "git": benchenv.git_revision(),
            "load": load}


def cases() -> list[tuple[str, str, Callable[[], Any]]]:
    """(group, label, function) for every measured figure."""
    mapping = compile_mapping(yaml.safe_load(align_schemas(LEGACY, ADAPTER).mapping_yaml()))
    assert len(mapping.conversions) == 5 and mapping.lossless
    fwd_plain = mapping.forward_template
    inv_plain = mapping.inverse_template
    response_bytes = orjson.dumps(RESPONSE)
    adapter_doc = mapping.forward(RESPONSE)
    request_bytes = orjson.dumps(adapter_doc)
    assert mapping.inverse(orjson.loads(request_bytes)) == RESPONSE
    brief = compile_template('{"voucher": {"amount": $.output.amount, "account": $.output.account}}')
    brief_doc = {"output": {"amount": 12.5, "account": "6001"}}

    out: list[tuple[str, str, Callable[[], Any]]] = [
        ("reference", "README example template render (2 paths)", lambda: brief.render(brief_doc)),
        ("response (legacy -> adapter)", "template render only", lambda: fwd_plain.render(RESPONSE)),
        ("response (legacy -> adapter)", "render + 5 conversions", lambda: mapping.forward(RESPONSE)),
        ("response (legacy -> adapter)", "parse + render + conversions + serialise",
         lambda: orjson.dumps(mapping.forward(orjson.loads(response_bytes)))),
        ("request (adapter -> legacy)", "template render only", lambda: inv_plain.render(adapter_doc)),
        ("request (adapter -> legacy)", "render + 5 conversions", lambda: mapping.inverse(adapter_doc)),
        ("request (adapter -> legacy)", "parse + render + conversions + serialise",
         lambda: orjson.dumps(mapping.inverse(orjson.loads(request_bytes)))),
    ]
    for kind, params, value in (("iso8601_to_unix", {}, "2024-05-01T12:00:00Z"),
                                ("unix_to_iso8601", {}, 1714564800),
                                ("string_to_number", {}, "1249.50"),
                                ("enum_map", {"pairs": [["in_progress", "InProgress"], ["done", "Done"]]},
                                 "in_progress")):
        c = make_conversion(kind, params)
        back = c.forward(value)
        out.append(("conversion", f"{kind} forward", lambda c=c, v=value: c.forward(v)))
        out.append(("conversion", f"{kind} inverse", lambda c=c, v=back: c.inverse(v)))

    tools = build_tools(load_spec(REPO / "tests" / "data" / "openapi" / "petstore-expanded.yaml"))
    add = tools.by_name["addPet"]
    call = orjson.dumps({"id": "call_1", "type": "function",
                         "function": {"name": "addPet", "arguments": '{"name": "Rex", "tag": "dog"}'}})
    args = {"name": "Rex", "tag": "dog"}
    body = b'{"id": 42, "name": "Rex", "tag": "dog"}'
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    validate_arguments(add, args)  # builds the validator once, as the first real call would
    out += [
        ("tool call (addPet)", "parse OpenAI tool call", lambda: parse_tool_call(call)),
        ("tool call (addPet)", "validate arguments", lambda: validate_arguments(add, args)),
        ("tool call (addPet)", "build request", lambda: build_request(add, args, "http://pets.internal:8080")),
        ("tool call (addPet)", "tool result from response", lambda: tool_result(200, headers, body)),
        ("tool call (addPet)", "all four", lambda: tool_result(200, headers, body) if not validate_arguments(
            add, parse_tool_call(call).arguments) and build_request(add, args, "http://pets.internal:8080") else None),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="3 repeats of about 0.05 s each")
    args = ap.parse_args(argv)
    repeats, target = (3, 0.05) if args.quick else (7, 0.2)
    info = machine_info()
    rows = []
    for group, label, fn in cases():
        med, best = measure(fn, repeats, target)
        rows.append((group, label, med, best))
        print(f"{group:30s} {label:45s} {med:8.2f} µs (min {best:.2f})", flush=True)
    by = {(g, label): b for g, label, _, b in rows}  # minima: the least disturbed by other load
    pair = (by[("response (legacy -> adapter)", "parse + render + conversions + serialise")]
            + by[("request (adapter -> legacy)", "parse + render + conversions + serialise")])
    conv_cost = (by[("response (legacy -> adapter)", "render + 5 conversions")]
                 - by[("response (legacy -> adapter)", "template render only")])
    table = ["| what | step | µs per call (median) | min |", "|---|---|---:|---:|"]
    table += [f"| {g} | {label} | {m:.2f} | {b:.2f} |" for g, label, m, b in rows]
    summary = (f"From the minima (the figures least disturbed by other processes): a mapped request and its "
               f"response together cost {pair:.1f} µs of CPU here (JSON parse, template, 5 conversions and "
               f"serialise, both directions); the 5 conversions are about {conv_cost:.1f} µs of the response's "
               f"{by[('response (legacy -> adapter)', 'render + 5 conversions')]:.1f} µs. Medians are higher "
               "when the machine is busy (see the load average above).")
    print("\n" + summary)
    if not args.no_write:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python perf/bench_mapping.py" + (" --quick" if args.quick else "")
        text = f"""
## {now}: bench_mapping (semantic mapping cost per request)

- Machine: {info['cpu']}; kernel {info['kernel']}; Python {info['python']}; load average {info['load']}
- Code: git {info['git']}
- Command: `{command}` (median of {repeats} timeit repeats of about {target:g} s each, one process, one core)
- Mapping: made by `extproc.semantic.align` for an order contract (9 fields, a nested object, an array,
  5 conversions); tool call: the OAI petstore-expanded `addPet` tool. See the script's docstring.

{chr(10).join(table)}

{summary}
"""
        benchenv.append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
