"""canary/bundle.py `adapter_contents`: what a route takes from a bundle (bundle.yaml, template and
schema files) and its golden cases; every refusal names the bundle's file (with the line), the field
and the reason. A request template from a file is checked by a golden case's `backendRequest`."""

from __future__ import annotations

import json

import pytest

from canary.bundle import BundleError, adapter_contents, build, load
from canary.preload import preload
from tests.canary.adapter_bundles import make_bundle
from tests.canary.test_preload import CONFIG


def contents(tmp_path, **kw):
    return adapter_contents(load(make_bundle(tmp_path, "1", **kw)))


def problems(e) -> list[str]:
    return [str(p) for p in e.value.problems]


def test_inline_and_file_parts_and_the_golden_cases(tmp_path):
    c = contents(tmp_path, doc="routes:\n  summarize:\n    requestFile: t/req.tmpl\n    outputSchemaFile: s.json\n",
                 extra={"t/req.tmpl": b'{"messages": [{"role": "user", "content": $.query}]}',
                        "s.json": b'{"type": "object", "properties": {"text": {"type": "string"}}}'})
    part = c.routes["summarize"]
    assert part.request.startswith('{"messages"') and part.transform is None
    assert part.output_schema["properties"]["text"] == {"type": "string"}
    assert part.where["request"] == ("t/req.tmpl", 1)
    (g,) = c.golden
    assert (g.name, g.route, g.request, g.status) == ("golden/basic.yaml", "summarize", {"query": "hello"}, 200)


@pytest.mark.parametrize("doc, extra, want", [
    (None, {}, "bundle.yaml: bundle.yaml: is missing"),
    ("routes: {}\n", {}, "bundle.yaml:1: routes:"),
    ("routes:\n  summarize:\n    requestFile: nope.tmpl\n", {}, "bundle.yaml:3: routes.summarize.requestFile: 'nope.tmpl' is "
     "not a file in the bundle"),
    ("routes:\n  summarize:\n    transform: x\n    transformFile: y\n", {"y": b"x"},
     "routes.summarize.transformFile: set transform or transformFile, not both"),
    ("routes:\n  Bad_Name:\n    transform: x\n", {}, "routes.Bad_Name"),
    ("routes:\n  summarize:\n    outputSchemaFile: s.json\n", {"s.json": b"[1]"}, "s.json: json: must be a JSON Schema object"),
    ("routes:\n  summarize: [\n", {}, "bundle.yaml: yaml:"),
])
def test_bundle_yaml_refusals_name_file_line_field_and_reason(tmp_path, doc, extra, want):
    if doc is None:  # a bundle without bundle.yaml
        src = tmp_path / "only"
        src.mkdir()
        (src / "readme.txt").write_text("x")
        build(src, tmp_path / "only.zip", name="summ", version="1")
        with pytest.raises(BundleError) as e:
            adapter_contents(load(tmp_path / "only.zip"))
    else:
        with pytest.raises(BundleError) as e:
            contents(tmp_path, doc=doc, golden=False, extra=extra)
    assert any(want in p for p in problems(e)), problems(e)


@pytest.mark.parametrize("case, want", [
    ({"route": "summarize", "request": {}, "response": {}}, "golden/basic.yaml: output: exactly one of output"),
    ({"route": "other", "request": {}, "output": {}, "response": {}}, "route: 'other' is not a route of bundle.yaml"),
    ({"route": "summarize", "request": {}, "output": {}, "response": {}, "extra": 1}, "extra: unknown field"),
    ({"request": {}, "output": {}}, "golden/basic.yaml: route: required field is missing"),
    ({"route": "summarize", "request": {}, "output": {}, "response": {}, "status": "ok"}, "status: must be an HTTP status"),
])
def test_golden_case_refusals(tmp_path, case, want):
    with pytest.raises(BundleError) as e:
        contents(tmp_path, golden=False, extra={"golden/basic.yaml": json.dumps(case).encode()})
    assert any(want in p for p in problems(e)), problems(e)


def test_a_request_template_from_the_bundle_is_checked_by_backend_request(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(CONFIG)
    req = b'{"messages": [{"role": "user", "content": $.query}], "max_tokens": 5}'
    case = {"route": "summarize", "request": {"query": "hello"}, "output": {"text": "hi"},
            "backendRequest": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "model": "m"},
            "response": {"summary": "hi"}}
    doc = "routes:\n  summarize:\n    requestFile: req.tmpl\n"
    good = make_bundle(tmp_path, "1", doc=doc, golden=False,
                       extra={"req.tmpl": req, "golden/basic.yaml": json.dumps(case).encode()})
    r = preload(str(cfg), str(good))
    assert r.ok, r.reason
    case["backendRequest"]["max_tokens"] = 7
    bad = make_bundle(tmp_path, "2", doc=doc, golden=False,
                      extra={"req.tmpl": req, "golden/basic.yaml": json.dumps(case).encode()})
    r = preload(str(cfg), str(bad))
    assert not r.ok and r.golden[0].stage == "backend-request"
    assert '-  "max_tokens": 7' in r.golden[0].diff and '+  "max_tokens": 5' in r.golden[0].diff


TENSOR = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: tensor}
spec:
  backends:
    - {name: ort, kind: onnxruntime, endpoints: ["127.0.0.1:9001"], models: [fraud]}
  routes:
    - {path: /score, name: score, kind: tensor, target: ort, model: fraud, request: '{"features": [$.features]}'}
  bundles: [{name: summ}]
"""


def test_a_tensor_routes_golden_case_gives_the_backends_raw_answer(tmp_path):
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(TENSOR)
    case = {"route": "score", "request": {"features": [1.0, 2.0]},
            "backendRequest": {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]},
            "backendResponse": {"model_name": "fraud", "outputs": [{"name": "scores", "datatype": "FP32", "shape": [1, 2],
                                                                    "data": [0.25, 0.75]}]},
            "response": {"fraud_probability": 0.75}}
    zip_ = make_bundle(tmp_path, "1", doc="routes:\n  score:\n    transform: '{\"fraud_probability\": $.output.scores[0][1]}'\n",
                       golden=False, extra={"golden/score.yaml": json.dumps(case).encode()})
    r = preload(str(cfg), str(zip_))
    assert r.ok, r.reason
