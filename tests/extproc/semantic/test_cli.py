"""extproc.semantic.cli: `tools` and `align` subcommands (in-process, plus one real subprocess)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml

from extproc.semantic.cli import main, register
from extproc.semantic.mapping import compile_mapping

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data" / "openapi"


def test_tools_formats(capsys):
    for fmt, key in (("openai", "function"), ("anthropic", "input_schema"), ("mcp", "tools")):
        assert main(["tools", str(DATA / "petstore.yaml"), "--format", fmt]) == 0
        out = json.loads(capsys.readouterr().out)
        assert key in (out if isinstance(out, dict) else out[0])


def test_tools_report_goes_to_stderr(capsys):
    assert main(["tools", str(DATA / "callback-example.yaml"), "--report"]) == 0
    cap = capsys.readouterr()
    assert [t["function"]["name"] for t in json.loads(cap.out)] == ["post_streams"]
    assert "0 operation(s) skipped, 1 unsupported part(s)" in cap.err
    assert "#/paths/~1streams/post/callbacks: callback(s) 'onData'" in cap.err and "never invoked" in cap.err
    assert main(["tools", str(DATA / "callback-example.yaml")]) == 0
    assert "1 unsupported part(s) (callbacks), 0 warning(s) (--report lists them)" in capsys.readouterr().err
    assert main(["tools", str(DATA / "uspto.yaml"), "--compact"]) == 0
    cap = capsys.readouterr()
    assert cap.out.count("\n") == 1 and cap.err == ""  # nothing skipped (the form body is a tool): silent


def test_tools_output_file(tmp_path, capsys):
    out = tmp_path / "sub" / "tools.json"
    assert main(["tools", str(DATA / "petstore-3.1.yaml"), "-o", str(out), "--format", "mcp"]) == 0
    assert [t["name"] for t in orjson.loads(out.read_bytes())["tools"]] == ["listPets", "createPets", "showPetById"]
    assert capsys.readouterr().out == ""


def test_invalid_spec_exit_1_with_pointer(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("openapi: 3.0.0\ninfo: {title: t, version: '1'}\npaths:\n  /a:\n    get: {}\n")
    assert main(["tools", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "invalid OpenAPI document" in err and "#/paths/~1a/get: missing required field 'responses'" in err
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("openapi: '3.0.0'\ninfo: {title: caf\xe9, version: '1'}\npaths: {}\n".encode("latin-1"))
    assert main(["tools", str(latin)]) == 1
    assert "--encoding" in capsys.readouterr().err
    assert main(["tools", str(latin), "--encoding", "latin-1"]) == 0
    assert main(["tools", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


ADAPTER = {"type": "object", "title": "payment", "required": ["chargeId", "amt"], "properties": {
    "chargeId": {"type": "string"}, "amt": {"type": "integer"}, "createdTs": {"type": "string", "format": "date-time"},
    "paymentStatus": {"type": "string", "enum": ["FAILED", "PENDING", "SUCCEEDED"]}, "isPaid": {"type": "boolean"}}}


def test_align_writes_mapping_and_report(tmp_path, capsys):
    adapter = tmp_path / "payment.json"
    adapter.write_text(json.dumps(ADAPTER))
    mapping, report = tmp_path / "m.yaml", tmp_path / "r.md"
    rc = main(["align", str(DATA / "stripe-excerpt.yaml"), str(adapter), "--schema", "charge", "-o", str(mapping),
               "--report", str(report)])
    assert rc == 0
    m = compile_mapping(yaml.safe_load(mapping.read_text()))
    doc = {"amount": 100, "created": 0, "id": "ch_1", "paid": True, "status": "pending"}
    fwd = m.forward(doc)
    assert fwd == {"amt": 100, "createdTs": "1970-01-01T00:00:00Z", "chargeId": "ch_1", "isPaid": True,
                   "paymentStatus": "PENDING"}
    assert m.inverse(fwd) == doc
    text = report.read_text()
    assert "## Needs a decision" in text and "`amount_captured`" in text
    assert "5 matched" in capsys.readouterr().err


def test_align_json_report_operation_body_and_json_schema_legacy(tmp_path, capsys):
    legacy = tmp_path / "legacy.schema.json"
    legacy.write_text(json.dumps({"title": "pet", "type": "object", "$defs": {"T": {"type": "string"}},
                                  "properties": {"pet_name": {"$ref": "#/$defs/T"}, "tag": {"type": "string"}}}))
    adapter = tmp_path / "adapter.yaml"
    adapter.write_text(yaml.safe_dump({"type": "object", "title": "Pet", "properties": {"name": {"type": "string"},
                                                                        "tag": {"type": "string"}}}))
    report = tmp_path / "r.json"
    assert main(["align", str(legacy), str(adapter), "--report", str(report), "--report-format", "json"]) == 0
    j = orjson.loads(report.read_bytes())
    assert {(m["legacy"]["path"], m["adapter"]["path"]) for m in j["matches"]} == {("pet_name", "name"), ("tag", "tag")}
    assert "forward: |" in capsys.readouterr().out
    assert main(["align", str(DATA / "petstore-expanded.yaml"), str(adapter), "--operation", "addPet",
                 "--report", str(report)]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("args,text", [
    (["--schema", "nope"], "no schema named 'nope'"),
    (["--operation", "nope"], "no operation with operationId 'nope'"),
    (["--operation", "listPets"], "has no request body"),
    ([], "name the legacy schema with --schema"),
])
def test_align_input_errors(tmp_path, capsys, args, text):
    adapter = tmp_path / "a.json"
    adapter.write_text(json.dumps(ADAPTER))
    assert main(["align", str(DATA / "petstore.yaml"), str(adapter), *args]) == 1
    assert text in capsys.readouterr().err


def test_register_adds_both_subcommands():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    register(sub)
    args = p.parse_args(["tools", "x.yaml", "--format", "anthropic"])
    assert args.format == "anthropic" and callable(args.fn)
    assert p.parse_args(["align", "a", "b", "--schema", "S"]).schema == "S"
    with pytest.raises(SystemExit):
        p.parse_args(["align", "a", "b", "--schema", "S", "--operation", "o"])


def test_runs_standalone_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "extproc.semantic.cli", "tools",
                           str(DATA / "link-example.yaml"), "--format", "anthropic"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [t["name"] for t in json.loads(proc.stdout)][:2] == ["getUserByName", "getRepositoriesByOwner"]
