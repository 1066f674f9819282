"""KServe v2 over gRPC through the gateway: tritonclient.grpc against our ONNX Runtime server behind Envoy."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack():
    from tests.e2e.conftest import make_stack

    st = make_stack(REPO / "examples" / "inference-backends.yaml", simulate=frozenset({"ort-grpc"}))
    st.start()
    yield st
    st.stop()


def test_tritonclient_grpc_through_envoy(stack):
    import tritonclient.grpc as tgrpc

    client = tgrpc.InferenceServerClient(stack.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_model_ready("fraud-mlp")
    meta = client.get_model_metadata("fraud-mlp")
    assert meta.inputs[0].name == "features" and list(meta.inputs[0].shape) == [-1, 8]
    x = np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8)
    inp = tgrpc.InferInput("features", [2, 8], "FP32")
    inp.set_data_from_numpy(x)
    scores = client.infer("fraud-mlp", [inp]).as_numpy("scores")
    assert scores.shape == (2, 2) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-3)


def test_grpc_backend_health_is_a_grpc_call(stack):
    doc = httpx.get(f"{stack.url}/health/adapter", timeout=10).json()
    ep = doc["backends"]["ort-grpc"]["endpoints"][0]
    assert ep["status"] == "ok" and ep["http_version"] == "HTTP/2", ep
