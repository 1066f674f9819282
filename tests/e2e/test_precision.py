"""The precision an answer was computed in, through the real Envoy against the real ONNX Runtime server.

The server's repository: `fraud-mlp` (int8, fp16, fp32: int8 preferred and present), `fraud-noint8`
(the same model without its int8 file: fp16 answers, fallback `int8:missing`) and `runfail-mlp` (an int8
variant that loads but fails every run: the first request falls back to fp32 at run time,
`int8:run_error`). Tensor routes (the processor decodes the answer) and a kserve route (passthrough:
Envoy copies the server's `x-inference-precision*` headers) are both checked, and the processor's
`adapter_processor_precision_total` counts the tensor answers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from backends.onnxruntime.models import write_demo_repository, write_fraud_mlp
from tests.backends.onnxruntime.conftest import run_failing_mlp, start_server, stop_server_process
from tests.e2e.conftest import make_stack, wait_metric

pytestmark = pytest.mark.timeout(180)

FEATURES = [0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, -0.8]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    import onnx

    from backends.onnxruntime.models import build_mlp

    root = tmp_path_factory.mktemp("precision")
    repo = root / "models"
    write_demo_repository(repo)
    write_fraud_mlp(repo, name="fraud-noint8", int8=False)
    runfail = repo / "runfail-mlp" / "1"
    runfail.mkdir(parents=True)
    onnx.save(build_mlp([8, 32, 16, 2], seed=3), runfail / "model.onnx")
    onnx.save(run_failing_mlp(), runfail / "model.int8.onnx")
    (repo / "runfail-mlp" / "config.yaml").write_text("precision_order: [int8, fp32]\nwarmup: false\n")
    server = start_server(repo, root / "ort.log")
    stack = None
    try:
        cfg = root / "gateway.yaml"
        endpoint = f"127.0.0.1:{server.http_port}"
        cfg.write_text(json.dumps({
            "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "precision"},
            "spec": {
                "backends": [{"name": "ort", "kind": "onnxruntime", "endpoints": [endpoint],
                              "models": ["fraud-mlp", "fraud-noint8", "runfail-mlp"]}],
                "routes": [
                    {"path": f"/v1/score/{m}", "kind": "tensor", "target": "ort", "model": m,
                     "request": '{"features": [$.features]}'}
                    for m in ("fraud-mlp", "fraud-noint8", "runfail-mlp")
                ] + [{"path": "/v2", "match": "prefix", "kind": "kserve", "target": "ort"}],
            }}))
        stack = make_stack(str(cfg), workers=1, agent=False).start()
        yield stack
    finally:
        if stack is not None:
            stack.stop()
        stop_server_process(server.process)


def _score(stack, model: str) -> httpx.Response:
    r = httpx.post(f"{stack.url}/v1/score/{model}", json={"features": FEATURES}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_tensor_route_names_the_preferred_int8_variant(gateway) -> None:
    r = _score(gateway, "fraud-mlp")
    assert r.headers["x-adapter-precision"] == "int8"
    assert "x-adapter-precision-fallback" not in r.headers
    assert r.headers["x-inference-precision"] == "int8"  # the server's own header passes through as well
    assert len(r.json()["scores"][0]) == 2


def test_tensor_route_names_the_fallback_when_int8_is_missing(gateway) -> None:
    r = _score(gateway, "fraud-noint8")
    assert r.headers["x-adapter-precision"] == "fp16"
    assert r.headers["x-adapter-precision-fallback"] == "int8:missing"


def test_tensor_route_names_a_run_time_fallback(gateway) -> None:
    r = _score(gateway, "runfail-mlp")  # int8 fails on the first request, fp32 answers and stays active
    assert r.headers["x-adapter-precision"] == "fp32"
    assert r.headers["x-adapter-precision-fallback"] == "int8:run_error"
    again = _score(gateway, "runfail-mlp")
    assert again.headers["x-adapter-precision-fallback"] == "int8:run_error"


def test_precision_is_counted_per_route_backend_and_fallback(gateway) -> None:
    _score(gateway, "fraud-mlp")
    _score(gateway, "fraud-noint8")
    url = f"{gateway.processor_admin_url}/metrics"
    name = "adapter_processor_precision_total"
    assert wait_metric(url, name, 1, route="v1-score-fraud-mlp", backend="ort", precision="int8",
                       fallback="none") >= 1
    assert wait_metric(url, name, 1, route="v1-score-fraud-noint8", backend="ort", precision="fp16",
                       fallback="int8:missing") >= 1


def test_kserve_passthrough_gets_the_headers_from_envoy(gateway) -> None:
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": FEATURES}]}
    preferred = httpx.post(f"{gateway.url}/v2/models/fraud-mlp/infer", json=body, timeout=30)
    assert preferred.status_code == 200, preferred.text
    assert preferred.headers["x-adapter-precision"] == "int8"
    assert "x-adapter-precision-fallback" not in preferred.headers  # Envoy leaves an empty value out
    assert preferred.json()["parameters"]["precision"] == "int8"
    fallen = httpx.post(f"{gateway.url}/v2/models/fraud-noint8/infer", json=body, timeout=30)
    assert fallen.status_code == 200, fallen.text
    assert fallen.headers["x-adapter-precision"] == "fp16"
    assert fallen.headers["x-adapter-precision-fallback"] == "int8:missing"
    assert fallen.json()["parameters"] == {"precision": "fp16", "precision_fallback": "int8:missing"}
