"""The ONNX Runtime server over KServe v2 HTTP, driven by the real ``tritonclient.http`` client.

One server subprocess (module scope) serves the test repository (see conftest): the demo models
plus a broken model, a corrupt int8 variant, a variant that fails at run time and a bad config.
Answers are checked against onnxruntime run directly on the same model file.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import threading

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .conftest import Server
from .helpers import metrics_text, run_direct, sample

pytestmark = pytest.mark.timeout(60)


def _client(server: Server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.url, connection_timeout=10, network_timeout=10)


def _input(name: str, array: np.ndarray, datatype: str = "FP32", binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _features(rows: int, width: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


# -- health, metadata, index --------------------------------------------------------------------


def test_health_and_server_metadata(server: Server) -> None:
    client = _client(server)
    assert client.is_server_live()
    assert client.is_server_ready()  # a broken model does not make the server unready (not strict)
    meta = client.get_server_metadata()
    assert meta["name"] == "adapter-gateway-onnxruntime"
    assert {"binary_tensor_data", "model_repository"} <= set(meta["extensions"])
    assert "CPUExecutionProvider" in meta["execution_providers"]


def test_model_metadata_shows_signature_precision_and_providers(server: Server) -> None:
    meta = _client(server).get_model_metadata("fraud-mlp")
    assert meta["name"] == "fraud-mlp"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 2]}]
    assert meta["precision"]["active"] == "int8"
    assert meta["precision"]["order"] == ["int8", "fp16", "fp32"]
    assert meta["precision"]["variants"]["fp32"]["status"] == "standby"
    assert meta["precision"]["fallbacks"] == []
    assert meta["execution_providers"] == ["CPUExecutionProvider"]
    assert meta["batching"]["batchable"] is True

    versioned = _client(server).get_model_metadata("risk-classifier", model_version="1")
    assert [o["name"] for o in versioned["outputs"]] == ["probabilities", "label"]
    assert versioned["outputs"][1] == {"name": "label", "datatype": "INT64", "shape": [-1]}

    config = _client(server).get_model_config("fraud-mlp")
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "features", "data_type": "TYPE_FP32", "dims": [8]}]


def test_repository_index_lists_ready_and_unavailable_models(server: Server) -> None:
    index = _client(server).get_model_repository_index()
    by_name = {entry["name"]: entry for entry in index}
    assert by_name["fraud-mlp"] == {"name": "fraud-mlp", "version": "1", "state": "READY"}
    assert by_name["risk-classifier"]["state"] == "READY"
    assert by_name["broken-model"]["state"] == "UNAVAILABLE"
    assert "load_error" in by_name["broken-model"]["reason"]
    assert by_name["bad-config"]["state"] == "UNAVAILABLE"
    assert "max_batch_sise" in by_name["bad-config"]["reason"]
    ready_only = httpx.post(f"{server.base}/v2/repository/index", json={"ready": True}, timeout=5).json()
    assert "broken-model" not in {e["name"] for e in ready_only}


# -- inference ------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_onnxruntime_directly(server: Server, binary: bool) -> None:
    x = _features(5, seed=1)
    result = _client(server).infer(
        "fraud-mlp", [_input("features", x, binary=binary)],
        outputs=[httpclient.InferRequestedOutput("scores", binary_data=binary)], request_id="req-1")
    scores = result.as_numpy("scores")
    [expected] = run_direct(server.repository / "fraud-mlp" / "1" / "model.int8.onnx", {"features": x})
    assert scores.shape == (5, 2) and scores.dtype == np.float32
    np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-7)
    response = result.get_response()
    assert response["model_name"] == "fraud-mlp" and response["model_version"] == "1"
    assert response["id"] == "req-1"
    assert ("parameters" in response["outputs"][0]) is binary


def test_infer_two_outputs_of_different_datatypes(server: Server) -> None:
    x = _features(4, width=4, seed=2)
    client = _client(server)
    result = client.infer("risk-classifier", [_input("features", x)])  # no outputs: all, binary
    probabilities, label = run_direct(server.repository / "risk-classifier" / "1" / "model.onnx", {"features": x})
    np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-6)
    assert result.as_numpy("label").dtype == np.int64
    np.testing.assert_array_equal(result.as_numpy("label"), label)

    only_label = client.infer("risk-classifier", [_input("features", x, binary=False)],
                              outputs=[httpclient.InferRequestedOutput("label", binary_data=False)])
    assert only_label.as_numpy("probabilities") is None
    np.testing.assert_array_equal(only_label.as_numpy("label"), label)


def test_infer_gzip_request_and_explicit_version(server: Server) -> None:
    x = _features(2, seed=3)
    result = _client(server).infer("fraud-mlp", [_input("features", x)], model_version="1",
                                   request_compression_algorithm="gzip")
    [expected] = run_direct(server.repository / "fraud-mlp" / "1" / "model.int8.onnx", {"features": x})
    np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-6, atol=1e-7)


# -- bad input ---------------------------------------------------------------------------------------


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def test_wrong_shape_and_datatype_are_400_naming_the_input(server: Server) -> None:
    client = _client(server)
    error = _error(lambda: client.infer("fraud-mlp", [_input("features", _features(2, width=7))]))
    assert error.status() == "400"
    assert "'features'" in error.message() and "shape [2, 7]" in error.message()

    error = _error(lambda: client.infer("fraud-mlp", [_input("features", np.zeros((2, 8)), "FP64")]))
    assert error.status() == "400"
    assert "'features'" in error.message() and "FP64" in error.message()

    error = _error(lambda: client.infer("fraud-mlp", [_input("x", _features(1))]))
    assert error.status() == "400" and "unknown input 'x'" in error.message()

    error = _error(lambda: client.infer("fraud-mlp", [_input("features", _features(1))],
                                        outputs=[httpclient.InferRequestedOutput("nope")]))
    assert error.status() == "400" and "unknown output 'nope'" in error.message()


_BINARY_HEAD = (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], '
                b'"parameters": {"binary_data_size": 32}}]}')
_BINARY_LENGTH = {"Inference-Header-Content-Length": str(len(_BINARY_HEAD))}


@pytest.mark.parametrize("body, headers, needle", [
    (b'{"inputs": [', {}, "not valid JSON"),
    (b'{"inputs": []}', {}, "non-empty list"),
    (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [1, 2]}]}', {},
     "'features': 2 data elements"),
    (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": ["a"]}]}', {},
     "'features': data does not convert"),
    (_BINARY_HEAD + b"\0" * 31, _BINARY_LENGTH, "'features': binary_data_size 32 runs past"),
    (_BINARY_HEAD + b"\0" * 36, _BINARY_LENGTH, "4 bytes of binary data are not claimed"),
    (_BINARY_HEAD + b"\0" * 32, {"Inference-Header-Content-Length": "9999"}, "outside the body"),
    (b'{"inputs": [{"name": "features", "datatype": "BF16", "shape": [1, 8], "data": [1]}]}', {},
     "'features': unsupported datatype"),
    (b'{"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, -8], "data": [1]}]}', {},
     "'features': shape must be"),
], ids=["json", "empty", "count", "convert", "short-binary", "extra-binary", "header-length", "bf16", "shape"])
def test_malformed_bodies_are_400(server: Server, body: bytes, headers: dict, needle: str) -> None:
    response = httpx.post(f"{server.base}/v2/models/fraud-mlp/infer", content=body, headers=headers, timeout=5)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]
    text = metrics_text(server.base)
    assert sample(text, "ort_requests_total", model="fraud-mlp", status="bad_request") >= 1


def test_unknown_model_version_and_path_are_404(server: Server) -> None:
    client = _client(server)
    error = _error(lambda: client.infer("no-such-model", [_input("features", _features(1))]))
    assert error.status() == "404" and "no-such-model" in error.message()
    error = _error(lambda: client.get_model_metadata("fraud-mlp", model_version="9"))
    assert error.status() == "404" and "version '9'" in error.message()
    assert httpx.get(f"{server.base}/v2/models/fraud-mlp/ready", timeout=5).status_code == 200
    assert httpx.get(f"{server.base}/v2/models/nope/ready", timeout=5).status_code == 404
    assert httpx.get(f"{server.base}/v2/nothing/here", timeout=5).status_code == 404
    assert httpx.get(f"{server.base}/v2/models/fraud-mlp/infer", timeout=5).status_code == 405


def test_broken_model_leaves_server_up_and_model_not_ready(server: Server) -> None:
    client = _client(server)
    assert client.is_server_live()
    assert not client.is_model_ready("broken-model")
    assert client.is_model_ready("fraud-mlp")
    response = httpx.post(f"{server.base}/v2/models/broken-model/infer",
                          json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}, timeout=5)
    assert response.status_code == 503
    assert "broken-model" in response.json()["error"] and "not ready" in response.json()["error"]
    assert httpx.get(f"{server.base}/v2/models/broken-model/ready", timeout=5).status_code == 503
    text = metrics_text(server.base)
    assert sample(text, "ort_model_ready", model="broken-model", version="1") == 0
    assert sample(text, "ort_requests_total", model="broken-model", status="unavailable") >= 1


# -- precision fallback ------------------------------------------------------------------------------


def test_corrupt_int8_variant_falls_back_to_fp16(server: Server) -> None:
    client = _client(server)
    meta = client.get_model_metadata("fallback-mlp")
    precision = meta["precision"]
    assert precision["active"] == "fp16"
    assert precision["variants"]["int8"]["status"] == "failed"
    assert precision["variants"]["int8"]["detail"].startswith("load_error")
    [event] = precision["fallbacks"]
    assert (event["from"], event["to"], event["reason"]) == ("int8", "fp16", "load_error")

    x = _features(3, seed=4)
    result = client.infer("fallback-mlp", [_input("features", x)])
    [expected] = run_direct(server.repository / "fallback-mlp" / "1" / "model.fp16.onnx", {"features": x})
    np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-6)
    assert result.get_response()["parameters"] == {"precision": "fp16", "precision_fallback": "int8:load_error"}

    text = metrics_text(server.base)
    assert sample(text, "ort_model_fallback_total", model="fallback-mlp", **{"from": "int8"}, to="fp16",
                  reason="load_error") == 1
    assert sample(text, "ort_model_active_precision", model="fallback-mlp", version="1", precision="fp16") == 1
    assert sample(text, "ort_model_active_precision", model="fallback-mlp", version="1", precision="int8") == 0


def test_variant_failing_at_run_time_falls_back_to_fp32(server: Server) -> None:
    client = _client(server)
    assert client.get_model_metadata("runfail-mlp")["precision"]["active"] == "int8"
    x = _features(2, seed=5)
    result = client.infer("runfail-mlp", [_input("features", x)])  # int8 fails, fp32 answers
    [expected] = run_direct(server.repository / "runfail-mlp" / "1" / "model.onnx", {"features": x})
    np.testing.assert_allclose(result.as_numpy("scores"), expected, rtol=1e-6)
    assert result.get_response()["parameters"] == {"precision": "fp32", "precision_fallback": "int8:run_error"}
    precision = client.get_model_metadata("runfail-mlp")["precision"]
    assert precision["active"] == "fp32"
    assert [(e["from"], e["to"], e["reason"]) for e in precision["fallbacks"]] == [("int8", "fp32", "run_error")]
    text = metrics_text(server.base)
    assert sample(text, "ort_model_fallback_total", model="runfail-mlp", **{"from": "int8"}, to="fp32",
                  reason="run_error") == 1
    assert sample(text, "ort_model_active_precision", model="runfail-mlp", version="1", precision="fp32") == 1


def test_answer_names_its_precision_in_parameters_and_headers(server: Server) -> None:
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0.5] * 8}]}
    preferred = httpx.post(f"{server.base}/v2/models/fraud-mlp/infer", json=body, timeout=10)
    assert preferred.status_code == 200, preferred.text
    assert preferred.json()["parameters"] == {"precision": "int8"}
    assert preferred.headers["x-inference-precision"] == "int8"
    assert "x-inference-precision-fallback" not in preferred.headers
    fallen = httpx.post(f"{server.base}/v2/models/fallback-mlp/infer", json=body, timeout=10)
    assert fallen.status_code == 200, fallen.text
    assert fallen.headers["x-inference-precision"] == "fp16"
    assert fallen.headers["x-inference-precision-fallback"] == "int8:load_error"


# -- dynamic batching ----------------------------------------------------------------------------------


def _set_batching(server: Server, model: str, **changes: int) -> dict:
    response = httpx.post(f"{server.base}/admin/models/{model}/batching", json=changes, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def _concurrent_infer(server: Server, model: str, inputs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """One request per array, from as many threads (each with its own connection), released together."""
    barrier = threading.Barrier(len(inputs))
    clients = [_client(server) for _ in inputs]

    def one(i: int) -> list[np.ndarray]:
        barrier.wait(timeout=10)
        result = clients[i].infer(model, [_input("features", inputs[i])])
        return [result.as_numpy("probabilities"), result.as_numpy("label")]

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        return list(pool.map(one, range(len(inputs))))


def _batch_counts(server: Server, model: str) -> tuple[float, float, float]:
    """(session.run calls, calls with more than one row, requests stacked) so far."""
    text = metrics_text(server.base)
    runs = sample(text, "ort_batch_size_count", 0.0, model=model)
    single = sample(text, "ort_batch_size_bucket", 0.0, model=model, le="1.0")
    requests = sample(text, "ort_batch_requests_sum", 0.0, model=model)
    return runs, runs - single, requests


def test_dynamic_batching_stacks_concurrent_requests_and_results_stay_per_request(server: Server) -> None:
    model = "risk-classifier"
    settings = _set_batching(server, model, max_batch_size=8, max_queue_delay_us=20_000)
    assert settings["1"]["max_batch_size"] == 8 and settings["1"]["max_queue_delay_us"] == 20_000
    inputs = [_features(1, width=4, seed=100 + i) for i in range(8)]
    runs0, multi0, requests0 = _batch_counts(server, model)
    results = _concurrent_infer(server, model, inputs)
    runs1, multi1, requests1 = _batch_counts(server, model)
    assert requests1 - requests0 == 8
    assert multi1 - multi0 >= 1, "no batch of more than one row"
    assert runs1 - runs0 < 8
    path = server.repository / model / "1" / "model.onnx"
    for x, (probabilities, label) in zip(inputs, results):
        expected_p, expected_l = run_direct(path, {"features": x})
        np.testing.assert_allclose(probabilities, expected_p, rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(label, expected_l)
    text = metrics_text(server.base)
    assert sample(text, "ort_queue_time_seconds_count", model=model) >= 8
    assert sample(text, "ort_inference_time_seconds_count", model=model) >= runs1


def test_batching_settings_change_at_run_time(server: Server) -> None:
    model = "risk-classifier"
    _set_batching(server, model, max_batch_size=1, max_queue_delay_us=20_000)  # batching off
    meta = _client(server).get_model_metadata(model)
    assert meta["batching"]["max_batch_size"] == 1 and meta["batching"]["enabled"] is False
    text = metrics_text(server.base)
    assert sample(text, "ort_batching_max_batch_size", model=model, version="1") == 1
    assert sample(text, "ort_batching_max_queue_delay_seconds", model=model, version="1") == pytest.approx(0.02)

    runs0, multi0, _ = _batch_counts(server, model)
    _concurrent_infer(server, model, [_features(1, width=4, seed=i) for i in range(8)])
    runs1, multi1, _ = _batch_counts(server, model)
    assert (runs1 - runs0, multi1 - multi0) == (8, 0)

    _set_batching(server, model, max_batch_size=8)  # on again, delay kept at 20 ms
    runs0, multi0, _ = _batch_counts(server, model)
    _concurrent_infer(server, model, [_features(1, width=4, seed=i) for i in range(8)])
    runs1, multi1, _ = _batch_counts(server, model)
    assert multi1 - multi0 >= 1

    current = httpx.get(f"{server.base}/admin/models/{model}/batching", timeout=5).json()
    assert current["1"]["max_batch_size"] == 8
    bad = httpx.post(f"{server.base}/admin/models/{model}/batching", json={"max_batch_size": 0}, timeout=5)
    assert bad.status_code == 400 and "max_batch_size" in bad.json()["error"]
    bad = httpx.post(f"{server.base}/admin/models/{model}/batching", json={"delay": 5}, timeout=5)
    assert bad.status_code == 400 and "delay" in bad.json()["error"]
    assert httpx.post(f"{server.base}/admin/models/nope/batching", json={}, timeout=5).status_code == 404
    _set_batching(server, model, max_batch_size=8, max_queue_delay_us=500)


# -- repository control and metrics ---------------------------------------------------------------------


def test_unload_and_load_a_model(server: Server) -> None:
    client = _client(server)
    client.unload_model("risk-classifier")
    assert not client.is_model_ready("risk-classifier")
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert index["risk-classifier"] == {"name": "risk-classifier", "state": "UNAVAILABLE", "reason": "unloaded"}
    assert _error(lambda: client.get_model_metadata("risk-classifier")).status() == "404"
    client.load_model("risk-classifier")
    assert client.is_model_ready("risk-classifier")
    error = _error(lambda: client.load_model("broken-model"))
    assert error.status() == "400" and "broken-model" in error.message()


def test_metrics_exposition_has_the_per_model_families(server: Server) -> None:
    _client(server).infer("fraud-mlp", [_input("features", _features(2))])
    httpx.post(f"{server.base}/v2/models/not-a-model/infer", json={}, timeout=5)
    text = metrics_text(server.base)
    assert sample(text, "ort_requests_total", model="fraud-mlp", status="success") >= 1
    assert sample(text, "ort_request_time_seconds_count", model="fraud-mlp") >= 1
    assert sample(text, "ort_queue_time_seconds_count", model="fraud-mlp") >= 1
    assert sample(text, "ort_inference_time_seconds_count", model="fraud-mlp") >= 1
    assert sample(text, "ort_batch_size_count", model="fraud-mlp") >= 1
    assert sample(text, "ort_model_active_precision", model="fraud-mlp", version="1", precision="int8") == 1
    assert sample(text, "ort_model_execution_provider", model="fraud-mlp", version="1",
                  provider="CPUExecutionProvider") == 1
    assert sample(text, "ort_execution_provider_available", provider="CPUExecutionProvider") == 1
    assert sample(text, "ort_queue_depth", model="fraud-mlp", version="1") == 0
    assert sample(text, "ort_requests_total", model="_unknown", status="not_found") >= 1


def test_plain_json_body_without_tritonclient(server: Server) -> None:
    body = {"id": "abc", "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4],
                                      "data": [[0.1, 0.2, 0.3, 0.4]]}],
            "outputs": [{"name": "label"}]}
    response = httpx.post(f"{server.base}/v2/models/risk-classifier/infer", content=orjson.dumps(body), timeout=5)
    assert response.status_code == 200
    doc = response.json()
    assert doc["id"] == "abc"
    assert doc["outputs"] == [{"name": "label", "datatype": "INT64", "shape": [1], "data": [doc["outputs"][0]["data"][0]]}]
    gz = httpx.post(f"{server.base}/v2/models/risk-classifier/infer", content=gzip.compress(orjson.dumps(body)),
                    headers={"content-encoding": "gzip"}, timeout=5)
    assert gz.status_code == 200 and gz.json()["outputs"] == doc["outputs"]
