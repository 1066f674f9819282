"""Fixtures for the ONNX Runtime server tests: a test model repository and a running server.

The repository is the demo one plus fault models built here (never in the demo):
``broken-model`` (model.onnx is not ONNX), ``fallback-mlp`` (fraud-mlp whose int8 file is corrupt),
``runfail-mlp`` (an int8 variant that loads but fails every run; warm-up off so the failure happens
while serving) and ``bad-config`` (config.yaml with an unknown field).  The server runs as a
subprocess on free ports (HTTP and gRPC); every wait is bounded and it is stopped by PID.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends.onnxruntime.models import IR_VERSION, OPSET, build_mlp, write_demo_repository, write_fraud_mlp

REPO_ROOT = Path(__file__).resolve().parents[3]
READY_LINE = re.compile(r"^onnxruntime server listening on http://127\.0\.0\.1:(\d+)(?: \(grpc 127\.0\.0\.1:(\d+)\))?$")


def run_failing_mlp() -> onnx.ModelProto:
    """Same signature as fraud-mlp (features [-1, 8] -> scores [-1, 2]) but every run fails: it
    reshapes to [7, 7], a shape computed from the input so that no load-time check can see it."""
    nodes = [
        helper.make_node("ReduceSum", ["features"], ["total"], keepdims=0),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node("Add", ["nothing", "target"], ["shape_f"]),
        helper.make_node("Cast", ["shape_f"], ["shape"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["features", "shape"], ["reshaped"]),
        helper.make_node("Softmax", ["reshaped"], ["scores"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "runfail",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(np.array(0, np.float32), "zero"),
         numpy_helper.from_array(np.array([7, 7], np.float32), "target")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def write_test_repository(root: Path) -> Path:
    write_demo_repository(root)
    broken = root / "broken-model" / "1"
    broken.mkdir(parents=True)
    (broken / "model.onnx").write_bytes(b"this is not an ONNX model\x00\x01")

    fallback = write_fraud_mlp(root, name="fallback-mlp")
    (fallback / "model.int8.onnx").write_bytes(b"\x08\x07corrupt int8 variant" * 8)

    runfail = root / "runfail-mlp" / "1"
    runfail.mkdir(parents=True)
    onnx.save(build_mlp([8, 32, 16, 2], seed=3), runfail / "model.onnx")
    onnx.save(run_failing_mlp(), runfail / "model.int8.onnx")
    (root / "runfail-mlp" / "config.yaml").write_text(
        "precision_order: [int8, fp32]\nwarmup: false\nmax_batch_size: 1\n")

    bad_config = root / "bad-config" / "1"
    bad_config.mkdir(parents=True)
    shutil.copy(root / "risk-classifier" / "1" / "model.onnx", bad_config / "model.onnx")
    (root / "bad-config" / "config.yaml").write_text("max_batch_size: 8\nmax_batch_sise: 9\n")
    return root


@dataclass
class Server:
    process: subprocess.Popen
    http_port: int
    grpc_port: int | None
    repository: Path
    log: Path

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def start_server(repository: Path, log: Path, *args: str, timeout: float = 30.0) -> Server:
    """Start ``python -m backends.onnxruntime`` on free ports; wait (bounded) for its ready line."""
    log_file = log.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "backends.onnxruntime", "--repository", str(repository), "--port", "0",
         *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log_file, text=True)
    log_file.close()
    deadline = time.monotonic() + timeout
    line = ""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                line = process.stdout.readline().strip()
                break
            if process.poll() is not None:
                break
    match = READY_LINE.match(line)
    if not match:
        stop_server_process(process)
        raise AssertionError(f"no ready line (got {line!r}); stderr:\n{log.read_text()}")
    return Server(process, int(match.group(1)), int(match.group(2)) if match.group(2) else None,
                  repository, log)


def stop_server_process(process: subprocess.Popen) -> float:
    """SIGTERM by PID; returns seconds until exit (kills after 5 s)."""
    started = time.monotonic()
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    if process.stdout is not None:
        process.stdout.close()
    return time.monotonic() - started


@pytest.fixture(scope="session")
def test_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_repository(tmp_path_factory.mktemp("ort-repo"))


@pytest.fixture(scope="module")
def server(test_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(test_repository, tmp_path_factory.mktemp("ort-server") / "stderr.log",
                       "--grpc-port", "0", "--threads", "4")
    yield srv
    stop_server_process(srv.process)
