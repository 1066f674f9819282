"""`backends[].endpoints[]` as "host:port" strings or {address, labels, engine, metricsPath} objects."""

from __future__ import annotations

import pytest

from extproc.config.loader import load_text
from tests.extproc.config.test_plugins import issues, line


def gw(backends: str) -> str:
    return ("apiVersion: adapter.ai/v1\nkind: AdapterGateway\nmetadata: {name: eps}\nspec:\n  backends:\n" + backends +
            "  routes:\n    - {path: /v1/, match: prefix, kind: openai, target: pool}\n")


MIXED = """\
    - name: pool
      kind: vllm
      endpoints:
        - "10.0.0.1:8000"
        - {address: "10.0.0.2:8000", labels: {gpu: a100, model-version: "2.1"}, engine: sglang}
        - address: "10.0.0.3:8000"
          labels: {gpu: v100}
          metricsPath: /engine/metrics
"""


def test_strings_and_objects_compile_with_labels_engines_and_metrics_paths():
    b = load_text(gw(MIXED)).backends["pool"]
    # the endpoints' tuple shape is what it always was (xds, envoy_render and probes read it)
    assert b.endpoints == (("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8000))
    assert b.endpoint_ids == ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
    assert b.endpoint_labels == {"10.0.0.1:8000": {}, "10.0.0.2:8000": {"gpu": "a100", "model-version": "2.1"},
                                 "10.0.0.3:8000": {"gpu": "v100"}}
    # engine: the endpoint's own, else from the backend's kind
    assert b.endpoint_engines == {"10.0.0.1:8000": "vllm", "10.0.0.2:8000": "sglang", "10.0.0.3:8000": "vllm"}
    assert b.endpoint_metrics_paths == {"10.0.0.1:8000": "/metrics", "10.0.0.2:8000": "/metrics",
                                        "10.0.0.3:8000": "/engine/metrics"}


def test_labels_are_read_only():
    b = load_text(gw(MIXED)).backends["pool"]
    with pytest.raises(TypeError):
        b.endpoint_labels["10.0.0.2:8000"]["gpu"] = "h100"  # type: ignore[index]
    with pytest.raises(TypeError):
        b.endpoint_labels["10.0.0.9:1"] = {}  # type: ignore[index]


@pytest.mark.parametrize("kind, engine", [("openai", "openai"), ("vllm", "vllm"), ("triton", "triton"),
                                          ("onnxruntime", "onnxruntime"), ("rest", None)])
def test_the_default_engine_comes_from_the_backend_kind(kind, engine):
    text = gw(f"    - {{name: pool, kind: {kind}, endpoints: ['10.0.0.1:8000']}}\n")
    if kind in ("triton", "onnxruntime"):
        text = text.replace("kind: openai, target: pool", "kind: kserve, target: pool")
    if kind == "rest":
        text = text.replace("    - {path: /v1/, match: prefix, kind: openai, target: pool}\n",
                            "    - {path: /v1/x, kind: passthrough, target: pool}\n")
    assert load_text(text).backends["pool"].endpoint_engines == {"10.0.0.1:8000": engine}


def test_implicit_backends_have_default_metadata():
    text = gw("").replace("  backends:\n", "").replace("target: pool", "target: '10.0.0.5:9000'")
    b = next(iter(load_text(text).backends.values()))
    assert b.endpoint_labels == {"10.0.0.5:9000": {}} and b.endpoint_engines == {"10.0.0.5:9000": "openai"}


def test_equal_configs_give_equal_hashable_backends():
    a, b = load_text(gw(MIXED)).backends["pool"], load_text(gw(MIXED)).backends["pool"]
    assert a.endpoint_meta == b.endpoint_meta and hash(a.endpoint_meta) == hash(b.endpoint_meta)
    other = load_text(gw(MIXED.replace("gpu: v100", "gpu: t4"))).backends["pool"]
    assert other.endpoint_meta != a.endpoint_meta


def test_endpoint_overrides_keep_metadata_by_position():
    snap = load_text(gw(MIXED))
    moved = snap.with_endpoints({"pool": (("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3), ("127.0.0.1", 4))})
    b = moved.backends["pool"]
    assert b.endpoint_labels["127.0.0.1:2"] == {"gpu": "a100", "model-version": "2.1"}
    assert b.endpoint_engines["127.0.0.1:2"] == "sglang" and b.endpoint_metrics_paths["127.0.0.1:3"] == "/engine/metrics"
    assert b.endpoint_labels["127.0.0.1:4"] == {} and b.endpoint_engines["127.0.0.1:4"] == "vllm"  # beyond the config's
    assert moved.routes["v1"].backend is b


@pytest.mark.parametrize("entry, path, reason", [
    ('"10.0.0.1"', "spec.backends[0].endpoints[1]", "endpoint '10.0.0.1' must be host:port"),
    ('{address: "10.0.0.1"}', "spec.backends[0].endpoints[1].address", "endpoint '10.0.0.1' must be host:port"),
    ('{labels: {a: b}}', "spec.backends[0].endpoints[1].address", "required field is missing"),
    ('{address: "10.0.0.9:1", engine: tgi}', "spec.backends[0].endpoints[1].engine",
     "Input should be 'vllm', 'sglang', 'triton', 'onnxruntime', 'openai' or 'llamacpp'"),
    ('{address: "10.0.0.9:1", metricsPath: metrics}', "spec.backends[0].endpoints[1].metricsPath",
     "String should match pattern '^/[^?#\\s]*$'"),
    ('{address: "10.0.0.9:1", labels: {gpu: 100}}', "spec.backends[0].endpoints[1].labels.gpu",
     "Input should be a valid string"),
    ('{address: "10.0.0.9:1", zone: eu}', "spec.backends[0].endpoints[1].zone",
     "unknown field (allowed: address, labels, engine, metricsPath)"),
])
def test_endpoint_errors_name_their_field(entry, path, reason):
    text = gw(f"    - name: pool\n      endpoints:\n        - '10.0.0.1:80'\n        - {entry}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, entry)}: {path}: {reason}"]


def test_duplicate_endpoints_are_refused():
    text = gw("    - name: pool\n      endpoints:\n        - '10.0.0.1:80'\n        - {address: '10.0.0.1:80', "
              "labels: {gpu: a100}}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'labels: {gpu')}: spec.backends[0].endpoints[1]: duplicate "
                            "endpoint '10.0.0.1:80'"]
