"""The command lines: ``python -m backends.onnxruntime`` (ready line, SIGTERM) and ``.models``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import REPO_ROOT, start_server, stop_server_process

pytestmark = pytest.mark.timeout(60)


def stop_and_wait(process: subprocess.Popen, sig: signal.Signals = signal.SIGTERM) -> int:
    """One signal, by PID; the exit code once the process is gone (no deadline of our own: a server
    that does not stop fails on the test's timeout, and a second signal would exit 1, not 0)."""
    process.send_signal(sig)
    return process.wait()


def test_build_demo_models_cli(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "backends.onnxruntime.models", str(tmp_path / "repo")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    files = sorted(p.relative_to(tmp_path / "repo").as_posix() for p in (tmp_path / "repo").rglob("*") if p.is_file())
    assert files == ["fraud-mlp/1/model.fp16.onnx", "fraud-mlp/1/model.int8.onnx", "fraud-mlp/1/model.onnx",
                     "fraud-mlp/config.yaml", "risk-classifier/1/model.onnx"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_server_builds_demo_models_serves_and_stops_on_one_signal(tmp_path: Path, sig: signal.Signals) -> None:
    server = start_server(tmp_path / "models", tmp_path / "stderr.log", "--build-demo-models")
    try:
        assert server.grpc_port is None
        index = httpx.post(f"{server.base}/v2/repository/index", timeout=5).json()
        assert [(e["name"], e["state"]) for e in index] == [("fraud-mlp", "READY"), ("risk-classifier", "READY")]
        with httpx.Client(timeout=5) as keep_alive:  # an idle keep-alive connection must not hold the stop
            assert keep_alive.get(f"{server.base}/v2/health/ready").status_code == 200
            assert stop_and_wait(server.process, sig) == 0  # while the client still holds its connection
    finally:
        stop_server_process(server.process)


def test_missing_repository_folder_serves_nothing_but_stays_up(tmp_path: Path) -> None:
    server = start_server(tmp_path / "absent", tmp_path / "stderr.log")
    try:
        assert httpx.get(f"{server.base}/v2/health/live", timeout=5).status_code == 200
        assert httpx.post(f"{server.base}/v2/repository/index", timeout=5).json() == []
        assert stop_and_wait(server.process) == 0
    finally:
        stop_server_process(server.process)


def test_hypercorn_front_end_serves_h2c_and_strict_readiness(tmp_path: Path, test_repository: Path) -> None:
    server = start_server(test_repository, tmp_path / "stderr.log", "--http-server", "hypercorn",
                          "--strict-readiness")
    try:
        # strict: the test repository holds broken models, so the server is live but not ready
        assert httpx.get(f"{server.base}/v2/health/live", timeout=5).status_code == 200
        assert httpx.get(f"{server.base}/v2/health/ready", timeout=5).json() == {"ready": False}
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        with httpx.Client(http1=False, http2=True, timeout=5) as h2:  # prior knowledge: cleartext HTTP/2
            response = h2.post(f"{server.base}/v2/models/risk-classifier/infer", json=body)
        assert response.http_version == "HTTP/2"
        assert response.status_code == 200
        assert [o["name"] for o in response.json()["outputs"]] == ["probabilities", "label"]
        assert stop_and_wait(server.process) == 0
    finally:
        stop_server_process(server.process)
