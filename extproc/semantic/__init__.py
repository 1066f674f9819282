"""Semantic mapping: service contracts to LLM tools, contract alignment, two-way field mapping.

One concept per module (import the one you need; this package imports nothing by itself):

* `openapi`     read and check OpenAPI 3.0/3.1 and Swagger 2.0 documents; errors carry JSON pointers;
                follow ``$ref``.
* `schemas`     OpenAPI schema objects -> self-contained JSON Schema (refs inlined, recursion cut).
* `tools`       operations -> LLM tools (OpenAI, Anthropic, MCP), with their HTTP bindings.
* `toolcall`    execute a tool call: parse, validate arguments (400 naming the field), build the
                service request, map the response back to a tool result.
* `conversions` value conversions with their inverses (ISO 8601 <-> Unix, string <-> number, enums).
* `mapping`     mapping files (forward/inverse templates + conversions), the runtime hook.
* `align`       match a legacy schema's fields to an adapter schema's; write a mapping and a report.
* `evaluate`    precision/recall of `align` on the labelled set in tests/data/openapi.
* `cli`         ``adapterctl tools`` and ``adapterctl align`` (``register(subparsers)``).

See docs/semantic.md. Everything here runs at build or load time except `toolcall`, `mapping` and
`conversions`, which run per request (costs in perf/RESULTS.md, ``perf/bench_mapping.py``).
"""
