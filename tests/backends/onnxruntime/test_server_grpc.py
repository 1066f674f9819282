"""The ONNX Runtime server over KServe v2 gRPC, driven by ``tritonclient.grpc``."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .conftest import Server
from .helpers import run_direct

pytestmark = pytest.mark.timeout(60)


def _client(server: Server) -> grpcclient.InferenceServerClient:
    assert server.grpc_port is not None
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")


def _input(array: np.ndarray, datatype: str = "FP32") -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("features", list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_grpc_health_metadata_config_index(server: Server) -> None:
    client = _client(server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("fraud-mlp") and not client.is_model_ready("broken-model")
    assert "binary_tensor_data" in client.get_server_metadata(as_json=True)["extensions"]
    meta = client.get_model_metadata("fraud-mlp", as_json=True)
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "8"]}]
    config = client.get_model_config("fraud-mlp", as_json=True)["config"]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["fraud-mlp"]["state"] == "READY"
    assert index["broken-model"]["state"] == "UNAVAILABLE" and index["broken-model"]["reason"]


def test_grpc_infer_matches_onnxruntime(server: Server) -> None:
    x = np.random.default_rng(9).standard_normal((3, 4)).astype(np.float32)
    result = _client(server).infer("risk-classifier", [_input(x)], request_id="g-1")
    probabilities, label = run_direct(server.repository / "risk-classifier" / "1" / "model.onnx", {"features": x})
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("label"), label)
    assert result.get_response().id == "g-1"
    only = _client(server).infer("risk-classifier", [_input(x)], outputs=[grpcclient.InferRequestedOutput("label")])
    assert only.as_numpy("probabilities") is None
    np.testing.assert_array_equal(only.as_numpy("label"), label)


def test_grpc_answer_names_its_precision(server: Server) -> None:
    x = np.zeros((1, 8), np.float32)
    preferred = _client(server).infer("fraud-mlp", [_input(x)]).get_response().parameters
    assert preferred["precision"].string_param == "int8" and "precision_fallback" not in preferred
    fallen = _client(server).infer("fallback-mlp", [_input(x)]).get_response().parameters
    assert fallen["precision"].string_param == "fp16"
    assert fallen["precision_fallback"].string_param == "int8:load_error"


@pytest.mark.parametrize("model, array, datatype, code, needle", [
    ("no-such-model", np.zeros((1, 8), np.float32), "FP32", "StatusCode.NOT_FOUND", "no-such-model"),
    ("fraud-mlp", np.zeros((1, 8), np.float64), "FP64", "StatusCode.INVALID_ARGUMENT", "'features'"),
    ("fraud-mlp", np.zeros((1, 9), np.float32), "FP32", "StatusCode.INVALID_ARGUMENT", "shape [1, 9]"),
    ("broken-model", np.zeros((1, 8), np.float32), "FP32", "StatusCode.UNAVAILABLE", "not ready"),
])
def test_grpc_errors(server: Server, model: str, array: np.ndarray, datatype: str, code: str, needle: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        _client(server).infer(model, [_input(array, datatype)])
    assert info.value.status() == code
    assert needle in info.value.message()
