"""Config parsing, the HTTP tensor codec and repository loading, in process."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import onnx
import orjson
import pytest

from backends.onnxruntime.codec import (deserialize_bytes, encode_infer_response, parse_infer_request,
                                        serialize_bytes)
from backends.onnxruntime.config import BatchingSettings, ConfigError, ModelConfig, load_model_config
from backends.onnxruntime.models import build_classifier, build_mlp
from backends.onnxruntime.repository import ModelRepository, RunError, choose_providers
from backends.onnxruntime.tensors import TensorError, TensorSpec, check_input

# -- config -----------------------------------------------------------------------------------------


def test_config_defaults_and_parsing(tmp_path: Path) -> None:
    assert load_model_config(tmp_path) == ModelConfig()
    (tmp_path / "config.yaml").write_text("max_batch_size: 4\nmax_queue_delay_us: 0\nprecision_order: [fp16, fp32]\n"
                                          "instances: 2\nwarmup: false\n")
    config = load_model_config(tmp_path)
    assert config.batching == BatchingSettings(4, 0)
    assert config.precision_order == ("fp16", "fp32") and config.instances == 2 and config.warmup is False


@pytest.mark.parametrize("text, needle", [
    ("max_batch_size: 0", "max_batch_size: 0 is outside"),
    ("max_batch_size: true", "max_batch_size: expected an integer"),
    ("max_queue_delay_us: 5000000", "max_queue_delay_us"),
    ("precision_order: []", "precision_order"),
    ("precision_order: [fp16, fp16]", "duplicate"),
    ("precision_order: ['../x']", "precision_order"),
    ("colour: blue", "unknown field(s): colour"),
    ("- a list", "expected a mapping"),
    ("max_batch_size: [", "cannot read"),
])
def test_config_errors_name_the_field(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match="config.yaml") as info:
        load_model_config(tmp_path)
    assert needle in str(info.value)


def test_batching_settings_replace() -> None:
    settings = BatchingSettings(8, 500)
    assert settings.replace({"max_batch_size": 1}) == BatchingSettings(1, 500)
    assert not settings.replace({"max_batch_size": 1}).enabled
    with pytest.raises(ConfigError, match="unknown batching field"):
        settings.replace({"size": 3})
    with pytest.raises(ConfigError, match="max_queue_delay_us"):
        settings.replace({"max_queue_delay_us": -1})


# -- tensors and codec ----------------------------------------------------------------------------------


def test_check_input_messages_name_the_input() -> None:
    spec = TensorSpec("features", "FP32", (-1, 8))
    check_input(spec, "FP32", (3, 8))
    with pytest.raises(TensorError, match="input 'features': datatype INT32"):
        check_input(spec, "INT32", (3, 8))
    with pytest.raises(TensorError, match=r"input 'features': shape \[3\]"):
        check_input(spec, "FP32", (3,))


def test_bytes_roundtrip_and_errors() -> None:
    array = np.array([["héllo", ""], ["x", "yz"]], dtype=object)
    raw = serialize_bytes(array)
    assert raw[:4] == struct.pack("<I", len("héllo".encode()))
    assert list(deserialize_bytes(raw, 4, "s")) == ["héllo", "", "x", "yz"]
    with pytest.raises(TensorError, match="'s': 4 BYTES elements for a shape of 3"):
        deserialize_bytes(raw, 3, "s")
    with pytest.raises(TensorError, match="runs past"):
        deserialize_bytes(raw[:-1], 4, "s")


def test_parse_binary_and_json_inputs_together() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    strings = np.array(["a", "bc"], dtype=object)
    head = orjson.dumps({
        "inputs": [
            {"name": "a", "datatype": "INT32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
            {"name": "b", "datatype": "FP16", "shape": [2], "data": [0.5, 1.5]},
            {"name": "s", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": 11}},
            {"name": "t", "datatype": "BYTES", "shape": [1, 2], "data": [["x", "y"]]},
        ],
        "outputs": [{"name": "o", "parameters": {"binary_data": True}}, {"name": "p"}],
        "parameters": {"binary_data_output": False}})
    request = parse_infer_request(head + a.tobytes() + serialize_bytes(strings), len(head))
    by_name = {t.name: t for t in request.inputs}
    np.testing.assert_array_equal(by_name["a"].array, a)
    assert by_name["b"].array.dtype == np.float16 and by_name["b"].array.tolist() == [0.5, 1.5]
    assert by_name["s"].array.tolist() == ["a", "bc"] and by_name["t"].array.shape == (1, 2)
    assert [(o.name, o.binary) for o in request.outputs] == [("o", True), ("p", False)]


def test_encode_response_json_and_binary() -> None:
    f = np.array([[1.5, 2.0]], dtype=np.float32)
    s = np.array(["ok"], dtype=object)
    body, length = encode_infer_response("m", "1", None, [("f", f, False), ("s", s, False)])
    assert length is None
    assert orjson.loads(body)["outputs"] == [
        {"name": "f", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.0]},
        {"name": "s", "datatype": "BYTES", "shape": [1], "data": ["ok"]}]
    body, length = encode_infer_response("m", "1", "id", [("f", f, True), ("s", s, True)])
    head = orjson.loads(body[:length])
    assert head["id"] == "id"
    assert [o["parameters"]["binary_data_size"] for o in head["outputs"]] == [8, 6]
    assert body[length:length + 8] == f.tobytes()
    assert body[length + 8:] == serialize_bytes(s)


@pytest.mark.parametrize("doc, needle", [
    ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}, {"name": "a", "datatype": "FP32",
                                                                                 "shape": [1], "data": [1]}]},
     "given twice"),
    ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}], "outputs": [{"name": "o"}, {"name": "o"}]},
     "requested twice"),
    ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1]}]}, "neither 'data'"),
    ({"inputs": [{"name": "a", "datatype": "UINT8", "shape": [1], "data": [300]}]}, "'a': data does not convert"),
    ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1],
                  "parameters": {"shared_memory_region": "r"}}]}, "shared memory"),
    ({"inputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1]}],
      "outputs": [{"name": "o", "parameters": {"classification": 2}}]}, "classification"),
])
def test_parse_errors(doc: dict, needle: str) -> None:
    with pytest.raises(TensorError) as info:
        parse_infer_request(orjson.dumps(doc), None)
    assert needle in str(info.value)


# -- repository -------------------------------------------------------------------------------------------


def test_providers_prefer_cuda_then_cpu() -> None:
    assert choose_providers(["CPUExecutionProvider", "CUDAExecutionProvider", "AzureExecutionProvider"]) == [
        "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert "CPUExecutionProvider" in choose_providers()


def test_repository_loading_cases(tmp_path: Path) -> None:
    events = []
    (tmp_path / "no-versions").mkdir()
    (tmp_path / "no-file" / "1").mkdir(parents=True)
    (tmp_path / "two-versions" / "1").mkdir(parents=True)
    (tmp_path / "two-versions" / "2").mkdir(parents=True)
    (tmp_path / "two-versions" / "notes").mkdir(parents=True)
    onnx.save(build_classifier(), tmp_path / "two-versions" / "1" / "model.onnx")
    onnx.save(build_classifier(), tmp_path / "two-versions" / "2" / "model.onnx")
    (tmp_path / "mismatch" / "1").mkdir(parents=True)
    onnx.save(build_mlp([8, 4, 2], precision="fp16"), tmp_path / "mismatch" / "1" / "model.fp16.onnx")
    onnx.save(build_mlp([6, 4, 2]), tmp_path / "mismatch" / "1" / "model.onnx")
    (tmp_path / "mismatch" / "config.yaml").write_text("precision_order: [fp16, fp32]\nwarmup: false\n")
    repo = ModelRepository(tmp_path, ["CPUExecutionProvider"], on_fallback=events.append)
    assert repo.model_names() == ["mismatch", "no-file", "no-versions", "two-versions"]

    [entry] = repo.load_model("no-versions")
    assert not entry.ready and entry.version == "" and "no version folder" in entry.reason
    [entry] = repo.load_model("no-file")
    assert not entry.ready and "no model file" in entry.reason
    versions = repo.load_model("two-versions")
    assert [v.version for v in versions] == ["1", "2"] and all(v.ready for v in versions)
    assert versions[0].precision == "fp32" and versions[0].variants["int8"]["status"] == "missing"

    [mismatch] = repo.load_model("mismatch")
    assert mismatch.ready and mismatch.precision == "fp16"
    np.testing.assert_allclose(mismatch.run({"features": np.ones((2, 8), np.float32)})[0].sum(axis=1), 1, rtol=1e-3)
    with pytest.raises(RunError, match="failed to run"):  # a width the service would refuse with 400
        mismatch.run({"features": np.ones((1, 3), np.float32)})
    assert mismatch.precision == "fp16"  # fp32 cannot stand in: its signature differs
    assert [(e.from_precision, e.to_precision, e.reason) for e in events] == [("fp32", "none", "signature_mismatch")]
    assert mismatch.variants["fp32"]["status"] == "failed"

    for bad in ("..", "", "a/b", ".hidden", "missing"):
        with pytest.raises(KeyError):
            repo.model_dir(bad)
