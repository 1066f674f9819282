"""Every registered backend kind through the same golden request/response fixtures of its API.

Adding a backend file and listing it in `backends.adapter_kinds()` puts it under these tests.
"""

from __future__ import annotations

import json

import orjson
import pytest
import yaml

from backends import adapter_kinds
from backends.base import BackendError, InputError, Usage
from extproc.config.loader import load_text
from tests.conftest import DATA

KINDS = sorted(adapter_kinds())


def fixture_for(kind: str) -> dict:
    api = adapter_kinds()[kind].api
    return json.loads((DATA / "contract" / f"{api}.json").read_text())


def route_for(kind: str, fx: dict):
    if fx["route"].get("mapping"):
        fx = dict(fx, route=dict(fx["route"], mapping=str(DATA / fx["route"]["mapping"])))
    spec = {"apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "contract"},
            "spec": {"backends": [{"name": "b", "kind": kind, "endpoints": ["127.0.0.1:9"]}],
                     "routes": [dict(fx["route"], target="b")]}}
    return load_text(yaml.safe_dump(spec)).routes["r"]


@pytest.mark.parametrize("kind", KINDS)
def test_declares_its_api_health_and_metrics(kind):
    adapter = adapter_kinds()[kind]()
    fx = fixture_for(kind)
    assert adapter.kind == kind and adapter.api in ("openai", "kserve", "rest")
    assert adapter.default_health_path == fx["health_path"]
    for names in adapter.metric_names.values():
        assert names and all(isinstance(n, str) and n for n in names)


@pytest.mark.parametrize("kind", KINDS)
def test_encodes_the_golden_request(kind):
    fx = fixture_for(kind)
    route = route_for(kind, fx)
    enc = route.backend.adapter.encode(route, fx["client"], fx.get("metadata"))
    assert enc.path == fx["backend_request"]["path"]
    assert orjson.loads(enc.body) == fx["backend_request"]["body"]


@pytest.mark.parametrize("kind", KINDS)
def test_decodes_the_golden_response_and_its_usage(kind):
    fx = fixture_for(kind)
    route = route_for(kind, fx)
    adapter = route.backend.adapter
    doc = adapter.decode(route, 200, orjson.dumps(fx["backend_response"]))
    assert doc["output"] == fx["output"] and doc["response"] == fx["backend_response"]
    assert adapter.usage(fx["backend_response"]) == Usage(**fx["usage"])


@pytest.mark.parametrize("kind", KINDS)
def test_errors_are_typed(kind):
    fx = fixture_for(kind)
    route = route_for(kind, fx)
    adapter = route.backend.adapter
    if adapter.api != "rest":  # a REST service's errors are its answer (tool results carry them)
        with pytest.raises(BackendError) as e:
            adapter.decode(route, 503, b'{"error": "overloaded"}')
        assert e.value.status == 502 and "backend b" in e.value.message
    with pytest.raises(BackendError):
        adapter.decode(route, 200, b"not json")
    with pytest.raises(InputError):
        if adapter.api == "kserve":
            adapter.encode(route, {"unrelated": True}, fx["metadata"])
        elif adapter.api == "rest":
            adapter.encode(route, {"orderId": "A-1"})  # the mapping needs createdAt and status
        else:
            _missing_request_field(kind)


def _missing_request_field(kind: str):
    route = route_for(kind, {"route": {"path": "/r", "kind": "llm", "model": "m", "request": '{"q": $.needed}'}})
    return route.backend.adapter.encode(route, {"other": 1})


@pytest.mark.parametrize("bad, message", [
    ({"features": [[1, 2, 3]]}, "shape [1, 3] does not match the model's [-1, 8]"),
    ({"features": [["a"] * 8]}, "expects FP32 elements"),
    ({"features": [[1, 2], [3]]}, "ragged"),
    ({"feature": [[0] * 8]}, "has no input 'feature'"),
])
def test_kserve_tensor_errors_name_the_input(bad, message):
    fx = fixture_for("onnxruntime")
    route = route_for("onnxruntime", dict(fx, route=dict(fx["route"], request=None)))
    with pytest.raises(InputError) as e:
        route.backend.adapter.encode(route, bad, fx["metadata"])
    assert message in e.value.message


def test_kserve_without_metadata_infers_datatypes():
    fx = fixture_for("triton")
    route = route_for("triton", dict(fx, route=dict(fx["route"], request=None)))
    body = orjson.loads(route.backend.adapter.encode(route, {"ids": [[1, 2]], "text": ["a"], "on": [True]}).body)
    assert [(i["name"], i["datatype"], i["shape"]) for i in body["inputs"]] == [
        ("ids", "INT64", [1, 2]), ("text", "BYTES", [1]), ("on", "BOOL", [1])]


def test_openai_usage_that_is_not_a_number_counts_nothing():
    """Found by tests/fuzz/test_fuzz_stream.py: `int()` of a list or object in a backend's `usage`
    raised TypeError in decode-response and openai-usage (500 stage_error for an answer already made)."""
    adapter = adapter_kinds()["openai"]()
    for prompt, completion, expect in (([None], 3, Usage(0, 3)), ({"a": 1}, "x", Usage()), (2, [1], Usage(2, 0)),
                                       ("5", 1.0, Usage(5, 1))):
        assert adapter.usage({"usage": {"prompt_tokens": prompt, "completion_tokens": completion}}) == expect
