"""Demo models, built with the ``onnx`` package at setup time (never downloaded).

What: :func:`build_mlp` makes a dense ReLU network ending in a softmax, as fp32 or fp16 (fp16
weights and arithmetic inside, FP32 at the boundary, so every variant has the same signature);
:func:`quantize_int8` derives the int8 variant with ``onnxruntime.quantization.quantize_dynamic``
(int8 weights, activations quantized per run: ``DynamicQuantizeLinear`` + ``MatMulInteger``).
:func:`write_demo_repository` writes the demo repository:

- ``fraud-mlp/1/``: ``features`` FP32 [-1, 8] -> ``scores`` FP32 [-1, 2] (softmax), 8-32-16-2,
  as ``model.onnx`` (fp32), ``model.fp16.onnx`` and ``model.int8.onnx``; config.yaml prefers
  int8, then fp16, then fp32, and batches up to 32 rows within 1 ms.
- ``risk-classifier/1/``: ``features`` FP32 [-1, 4] -> ``probabilities`` FP32 [-1, 3] and
  ``label`` INT64 [-1] (argmax): two outputs of different datatypes.

Weights are fixed pseudo-random numbers (seeded): the models compute, but predict nothing real.
``python -m backends.onnxruntime.models DIR`` writes the repository (overwriting those two models).

Why: tests, the demo stack and the benchmark need real ONNX graphs that onnxruntime executes,
without network access or large files.
Cost: well under a second and about 20 KB on disk.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["OPSET", "build_classifier", "build_mlp", "quantize_int8", "write_demo_repository"]

OPSET = 17
IR_VERSION = 10  # what onnxruntime 1.31 reads; onnx 1.23 would otherwise stamp a newer one

FRAUD_CONFIG = """\
# Serving settings of fraud-mlp (see backends/onnxruntime/config.py).
max_batch_size: 32
max_queue_delay_us: 1000
precision_order: [int8, fp16, fp32]
instances: 1
intra_op_threads: 1
"""


def _finish(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="adapter-gateway")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def build_mlp(widths: Sequence[int], *, precision: str = "fp32", seed: int = 0, input_name: str = "features",
              output_name: str = "scores", name: str = "mlp") -> onnx.ModelProto:
    """A ``widths[0] -> ... -> widths[-1]`` ReLU MLP with a softmax head; batch dimension dynamic.

    ``precision`` is ``fp32`` or ``fp16``; the fp16 model casts its FP32 input to fp16 and its
    softmax back to FP32, so both share one signature.
    """
    if precision not in ("fp32", "fp16"):
        raise ValueError(f"build_mlp makes fp32 or fp16 graphs, not {precision!r} (int8: quantize_int8)")
    if len(widths) < 2:
        raise ValueError("an MLP needs at least an input and an output width")
    rng = np.random.default_rng(seed)
    dtype = np.float16 if precision == "fp16" else np.float32
    nodes, initializers = [], []
    current = input_name
    if precision == "fp16":
        nodes.append(helper.make_node("Cast", [input_name], ["x_fp16"], to=TensorProto.FLOAT16))
        current = "x_fp16"
    layers = list(zip(widths[:-1], widths[1:]))
    for i, (fan_in, fan_out) in enumerate(layers):
        weight = rng.standard_normal((fan_in, fan_out)).astype(np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        bias = (rng.standard_normal(fan_out) * 0.1).astype(np.float32)
        initializers += [numpy_helper.from_array(weight.astype(dtype), f"W{i}"),
                         numpy_helper.from_array(bias.astype(dtype), f"B{i}")]
        nodes.append(helper.make_node("MatMul", [current, f"W{i}"], [f"mm{i}"]))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"B{i}"], [f"dense{i}"]))
        current = f"dense{i}"
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"relu{i}"]))
            current = f"relu{i}"
    if precision == "fp16":
        nodes.append(helper.make_node("Softmax", [current], ["softmax_fp16"], axis=-1))
        nodes.append(helper.make_node("Cast", ["softmax_fp16"], [output_name], to=TensorProto.FLOAT))
    else:
        nodes.append(helper.make_node("Softmax", [current], [output_name], axis=-1))
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", widths[0]])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", widths[-1]])],
        initializers)
    return _finish(graph)


def build_classifier(features: int = 4, classes: int = 3, *, seed: int = 1,
                     name: str = "risk-classifier") -> onnx.ModelProto:
    """A linear softmax classifier with two outputs: ``probabilities`` (FP32) and ``label`` (INT64)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((features, classes)).astype(np.float32)
    bias = rng.standard_normal(classes).astype(np.float32) * np.float32(0.1)
    nodes = [
        helper.make_node("Gemm", ["features", "W", "B"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", classes]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    return _finish(graph)


def quantize_int8(fp32_path: Path, int8_path: Path) -> None:
    """Write the dynamic-quantized int8 variant of an fp32 model file (int8 weights, QInt8)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()  # quantize_dynamic logs pre-processing advice on the root logger
    previous = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(fp32_path), str(int8_path), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(previous)


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a server scanning the folder never sees half a file.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
        handle.write(model.SerializeToString())
    Path(handle.name).chmod(0o644)  # NamedTemporaryFile creates 0600
    Path(handle.name).replace(path)


def write_fraud_mlp(root: Path, *, name: str = "fraud-mlp", version: str = "1", int8: bool = True) -> Path:
    """Write fraud-mlp (fp32, fp16 and, when ``int8``, int8 variants) and its config.yaml."""
    version_dir = Path(root) / name / version
    _save(build_mlp([8, 32, 16, 2], precision="fp32", seed=7, name=name), version_dir / "model.onnx")
    _save(build_mlp([8, 32, 16, 2], precision="fp16", seed=7, name=name), version_dir / "model.fp16.onnx")
    if int8:
        quantize_int8(version_dir / "model.onnx", version_dir / "model.int8.onnx")
    (Path(root) / name / "config.yaml").write_text(FRAUD_CONFIG, encoding="utf-8")
    return version_dir


def write_demo_repository(root: Path | str) -> list[Path]:
    """Write the demo models under ``root``; returns the version folders written."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    written = [write_fraud_mlp(root)]
    classifier_dir = root / "risk-classifier" / "1"
    _save(build_classifier(), classifier_dir / "model.onnx")
    written.append(classifier_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.onnxruntime.models",
                                     description="Build the demo ONNX model repository (fraud-mlp, risk-classifier).")
    parser.add_argument("repository", type=Path, help="folder to write (created when missing)")
    args = parser.parse_args(argv)
    for path in write_demo_repository(args.repository):
        files = ", ".join(sorted(p.name for p in path.iterdir()))
        print(f"{path}: {files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
