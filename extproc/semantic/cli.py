"""`adapterctl tools` and `adapterctl align`: the semantic-mapping commands.

What:
  adapterctl tools SPEC [--format openai|anthropic|mcp] [--report] [-o OUT]
      One LLM tool per operation of an OpenAPI 3.0/3.1 or Swagger 2.0 document, printed as JSON.
      --report lists skipped operations, unsupported parts (callbacks) and warnings on stderr
      (stdout stays pure JSON).
  adapterctl align LEGACY ADAPTER_SCHEMA [--schema NAME | --operation ID] [-o MAPPING] [--report FILE]
      Matches the legacy contract's fields to the adapter schema's and writes a mapping file
      (YAML: forward/inverse templates plus conversions) and a report (Markdown, or JSON with
      --report-format json) of ambiguous and unmatched fields for a person to decide.
      LEGACY is an OpenAPI document (pick a schema with --schema, or the JSON request body of an
      operation with --operation) or a JSON Schema file; ADAPTER_SCHEMA a JSON Schema file (or an
      OpenAPI document with --adapter-schema NAME).

Examples:
  adapterctl tools tests/data/openapi/petstore.yaml --format anthropic
  adapterctl tools api.yaml --format mcp --report -o tools.json
  adapterctl align tests/data/openapi/stripe-excerpt.yaml payment.schema.json --schema charge \\
      -o charge.mapping.yaml --report charge.report.md

Also runnable without the main CLI: ``python -m extproc.semantic.cli tools SPEC ...``.
Exit codes: 0 done, 1 invalid input (the message says where), 2 usage error.

Why: a person turns contracts into tools and mappings at build time, reviews the report, and
then points the gateway at the result; nothing here runs per request.
Cost: see extproc.semantic.tools and extproc.semantic.align (seconds at most for large specs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from extproc.semantic.align import align_schemas
from extproc.semantic.openapi import (
    Resolver,
    Spec,
    SpecError,
    decode_bytes,
    iter_operations,
    parse_document,
    parse_spec,
)
from extproc.semantic.schemas import SchemaTooLarge, UnsupportedSchema, to_json_schema
from extproc.semantic.tools import FORMATS, build_tools, is_json_media_type

__all__ = ["build_parser", "cmd_align", "cmd_tools", "main", "register"]


class InputError(ValueError):
    """Bad command input (a file, a name): printed as one line, exit code 1."""


def _write(text: str, out: str | None) -> None:
    if out and out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def _read_doc(path: str, encoding: str | None) -> tuple[Any, Path]:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    return parse_document(decode_bytes(data, path, encoding), path), p.resolve().parent


def _is_openapi(doc: Any) -> bool:
    return isinstance(doc, dict) and ("openapi" in doc or "swagger" in doc)


def cmd_tools(args: argparse.Namespace) -> int:
    """``tools``: print the tools of a spec in the chosen format."""
    doc, base_dir = _read_doc(args.spec, args.encoding)
    spec = parse_spec(doc, args.spec, base_dir)
    toolset = build_tools(spec, max_schema_nodes=args.max_schema_nodes, max_description=args.max_description)
    payload = FORMATS[args.format](toolset)
    option = orjson.OPT_INDENT_2 if not args.compact else 0
    _write(orjson.dumps(payload, option=option).decode() + "\n", args.output)
    if args.report:
        print(toolset.report(), file=sys.stderr)
    elif toolset.skipped or toolset.warnings or toolset.unsupported:
        unsupported = f"{len(toolset.unsupported)} unsupported part(s) (callbacks), " if toolset.unsupported else ""
        print(f"{args.spec}: {len(toolset.tools)} tool(s); {len(toolset.skipped)} operation(s) skipped, "
              f"{unsupported}{len(toolset.warnings)} warning(s) (--report lists them)", file=sys.stderr)
    return 0


def _schema_by_name(spec: Spec, name: str) -> tuple[Any, str]:
    if spec.version == "2.0":
        holder, prefix = spec.doc.get("definitions") or {}, "/definitions/"
    else:
        holder, prefix = (spec.doc.get("components") or {}).get("schemas") or {}, "/components/schemas/"
    if name not in holder:
        known = ", ".join(sorted(holder)[:30]) or "(none)"
        raise InputError(f"{spec.source}: no schema named {name!r}; schemas: {known}")
    return holder[name], prefix + name.replace("~", "~0").replace("/", "~1")


def _operation_body(spec: Spec, resolver: Resolver, op_id: str) -> tuple[Any, str, str]:
    """``(schema, base, pointer)`` of the JSON request body of operation ``op_id``."""
    for path, method, op, item, pointer in iter_operations(spec, resolver):
        if op.get("operationId") != op_id:
            continue
        if spec.version == "2.0":
            for i, raw in enumerate([*(item.get("parameters") or ()), *(op.get("parameters") or ())]):
                p, base = resolver.deref(raw)
                if p.get("in") == "body":
                    return p.get("schema", {}), base, f"{pointer}/parameters/{i}/schema"
            raise InputError(f"{spec.source}: operation {op_id!r} ({method.upper()} {path}) has no body parameter")
        raw = op.get("requestBody")
        if raw is None:
            raise InputError(f"{spec.source}: operation {op_id!r} ({method.upper()} {path}) has no request body")
        body, base = resolver.deref(raw)
        for media, mt in (body.get("content") or {}).items():
            if is_json_media_type(media) and isinstance(mt, dict):
                return mt.get("schema", {}), base, f"{pointer}/requestBody/content/{media.replace('/', '~1')}/schema"
        raise InputError(f"{spec.source}: operation {op_id!r} has no JSON request body")
    raise InputError(f"{spec.source}: no operation with operationId {op_id!r}")


def _load_side(path: str, encoding: str | None, schema_name: str | None, operation: str | None,
               role: str) -> tuple[dict, str, str]:
    """``(JSON Schema, display name, context name)`` for one side of ``align``."""
    doc, base_dir = _read_doc(path, encoding)
    if _is_openapi(doc):
        spec = parse_spec(doc, path, base_dir)
        resolver = Resolver(spec)
        if operation:
            schema, base, pointer = _operation_body(spec, resolver, operation)
            direction, name, context = "request", f"{path}#operation={operation}", ""
        else:
            if not schema_name:
                holder = (spec.doc.get("definitions") if spec.version == "2.0"
                          else (spec.doc.get("components") or {}).get("schemas")) or {}
                if len(holder) != 1:
                    flag = "--schema" if role == "legacy" else "--adapter-schema"
                    raise InputError(f"{path}: an OpenAPI document: name the {role} schema with {flag} NAME "
                                     f"(or --operation ID); schemas: {', '.join(sorted(holder)[:30]) or '(none)'}")
                schema_name = next(iter(holder))
            schema, pointer = _schema_by_name(spec, schema_name)
            base, direction, name, context = "", "any", f"{path}#{pointer}", schema_name
        try:
            out = to_json_schema(resolver, schema, version=spec.version, base=base, pointer=pointer,
                                 direction=direction)
        except (UnsupportedSchema, SchemaTooLarge) as e:
            raise InputError(f"{path}: {e}") from None
        return out, name, context
    if schema_name or operation:
        raise InputError(f"{path}: --schema/--operation apply to OpenAPI documents; this is a JSON Schema")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: a JSON Schema must be an object")
    spec = Spec(doc, "3.1", path, base_dir)
    try:
        out = to_json_schema(Resolver(spec), doc, version="3.1", pointer="")
    except (UnsupportedSchema, SchemaTooLarge) as e:
        raise InputError(f"{path}: {e}") from None
    return out, path, str(doc.get("title", ""))


def cmd_align(args: argparse.Namespace) -> int:
    """``align``: write the mapping file and the report."""
    legacy, lname, lctx = _load_side(args.legacy, args.encoding, args.schema, args.operation, "legacy")
    adapter, aname, actx = _load_side(args.adapter, args.encoding, args.adapter_schema, None, "adapter")
    try:
        alignment = align_schemas(legacy, adapter, legacy_name=lname, adapter_name=aname, legacy_root=lctx,
                                  adapter_root=actx, min_score=args.min_score, margin=args.margin)
    except ValueError as e:
        raise InputError(str(e)) from None
    _write(alignment.mapping_yaml(), args.output)
    if args.report_format == "json":
        report = orjson.dumps(alignment.report_json(), option=orjson.OPT_INDENT_2).decode() + "\n"
    else:
        report = alignment.report_markdown()
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(report, encoding="utf-8")
    else:
        sys.stderr.write(report)
    s = alignment.report_json()["summary"]
    print(f"align: {s['matched']} matched ({s['ambiguous']} ambiguous), {s['unmatched_legacy']} legacy and "
          f"{s['unmatched_adapter']} adapter field(s) unmatched", file=sys.stderr)
    return 0


def _guard(fn):
    """Turn input errors into one message and exit code 1."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except SpecError as e:
            print(f"invalid OpenAPI document:\n{e}", file=sys.stderr)
            return 1
        except InputError as e:
            print(f"adapterctl {args.command}: {e}", file=sys.stderr)
            return 1
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``tools`` and ``align`` subcommands to an argparse subparsers object."""
    s = subparsers.add_parser("tools", help="OpenAPI document -> LLM tools (OpenAI, Anthropic, MCP) as JSON",
                              description="One tool per operation of an OpenAPI 3.0/3.1 or Swagger 2.0 "
                                          "document; see docs/semantic.md.")
    s.add_argument("spec", help="OpenAPI document (YAML or JSON)")
    s.add_argument("--format", choices=sorted(FORMATS), default="openai", help="output format (default openai)")
    s.add_argument("--report", action="store_true", help="list skipped operations and warnings on stderr")
    s.add_argument("-o", "--output", help="write the JSON here instead of stdout")
    s.add_argument("--encoding", help="text encoding of the document when it is not UTF-8 (e.g. latin-1)")
    s.add_argument("--compact", action="store_true", help="one-line JSON")
    s.add_argument("--max-schema-nodes", type=int, default=20_000,
                   help="skip tools whose expanded parameter schema is bigger (default 20000)")
    s.add_argument("--max-description", type=int, default=1024,
                   help="cut descriptions to this many characters, 0 for no limit (default 1024)")
    s.set_defaults(fn=_guard(cmd_tools))

    a = subparsers.add_parser("align", help="match a legacy contract's fields to an adapter schema; "
                                            "write a mapping file and a report",
                              description="See docs/semantic.md for how fields are matched and what the "
                                          "mapping file holds.")
    a.add_argument("legacy", help="legacy contract: OpenAPI document or JSON Schema file")
    a.add_argument("adapter", help="adapter schema: JSON Schema file (or OpenAPI with --adapter-schema)")
    which = a.add_mutually_exclusive_group()
    which.add_argument("--schema", help="legacy schema name in components.schemas (definitions for Swagger 2.0)")
    which.add_argument("--operation", help="use the JSON request body of this legacy operationId")
    a.add_argument("--adapter-schema", help="adapter schema name when ADAPTER is an OpenAPI document")
    a.add_argument("-o", "--output", help="write the mapping file here (default stdout)")
    a.add_argument("--report", help="write the report here (default stderr)")
    a.add_argument("--report-format", choices=("md", "json"), default="md", help="report format (default md)")
    a.add_argument("--min-score", type=float, default=0.5, help="lowest score proposed as a match (default 0.5)")
    a.add_argument("--margin", type=float, default=0.05,
                   help="candidates within this of the best make a match ambiguous (default 0.05)")
    a.add_argument("--encoding", help="text encoding of the inputs when not UTF-8")
    a.set_defaults(fn=_guard(cmd_align))


def build_parser() -> argparse.ArgumentParser:
    """A parser with just these two subcommands (for ``python -m extproc.semantic.cli``)."""
    p = argparse.ArgumentParser(prog="python -m extproc.semantic.cli", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
