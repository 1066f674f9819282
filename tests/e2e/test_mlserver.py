"""The Triton (KServe v2) adapter against MLServer, an independent KServe v2 implementation.

MLServer lives in its own venv (`.tools/mlserver-venv`, made by `make`): it needs protobuf<7 while
the project pins protobuf 7. The model is a scikit-learn classifier trained here at test time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from extproc.stack import free_port, wait_http
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
MLSERVER = REPO / ".tools" / "mlserver-venv" / "bin"

if not (MLSERVER / "mlserver").exists():
    pytest.skip("MLServer is not installed (make setup installs it into .tools/mlserver-venv)",
                allow_module_level=True)

TRAIN = """
import json, sys, joblib, numpy as np
from sklearn.linear_model import LogisticRegression
rng = np.random.default_rng(0); X = rng.random((200, 4)); y = (X[:, 0] > 0.5).astype(int)
joblib.dump(LogisticRegression().fit(X, y), sys.argv[1])
"""


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlserver")
    model = root / "clf"
    model.mkdir()
    subprocess.run([str(MLSERVER / "python"), "-c", TRAIN, str(model / "model.joblib")], check=True, timeout=120)
    (model / "model-settings.json").write_text(json.dumps({
        "name": "clf", "implementation": "mlserver_sklearn.SKLearnModel",
        "parameters": {"uri": "./model.joblib", "version": "v1"},
        "inputs": [{"name": "input-0", "datatype": "FP64", "shape": [-1, 4]}]}))
    port = free_port()
    (root / "settings.json").write_text(json.dumps({
        "http_port": port, "grpc_port": free_port(), "metrics_port": free_port(), "parallel_workers": 0,
        "host": "127.0.0.1"}))
    proc = subprocess.Popen([str(MLSERVER / "mlserver"), "start", str(root)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v2/models/clf/ready", 120, proc, "mlserver")
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own process group: mlserver and any child it made
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def stack(mlserver, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    cfg = tmp_path_factory.mktemp("mlgw") / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: mlserver}}
spec:
  backends: [{{name: mlserver, kind: triton, endpoints: ["127.0.0.1:{mlserver}"], models: [clf]}}]
  routes:
    - path: /v1/classify
      kind: tensor
      target: mlserver
      model: clf
      request: '{{"input-0": [$.x]}}'
      transform: '{{"label": $.output.predict[0][0], "batch": $.usage.batch_size}}'
    - {{path: /v2, match: prefix, kind: kserve, targets: [mlserver]}}
""")
    st = make_stack(cfg)
    st.start()
    yield st
    st.stop()


def test_tensor_route_against_mlserver(stack):
    hi = httpx.post(f"{stack.url}/v1/classify", json={"x": [0.9, 0.1, 0.2, 0.3]}, timeout=30)
    lo = httpx.post(f"{stack.url}/v1/classify", json={"x": [0.1, 0.9, 0.8, 0.7]}, timeout=30)
    assert hi.status_code == 200, hi.text
    assert hi.json() == {"label": 1, "batch": 1} and lo.json()["label"] == 0
    bad = httpx.post(f"{stack.url}/v1/classify", json={"x": [0.9, 0.1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["path"] == "input-0"  # from MLServer's metadata


def test_tritonclient_through_the_gateway_to_mlserver(stack):
    import numpy as np
    import tritonclient.http as triton

    client = triton.InferenceServerClient(stack.url.removeprefix("http://"))
    assert client.is_model_ready("clf")
    inp = triton.InferInput("input-0", [2, 4], "FP64")
    inp.set_data_from_numpy(np.array([[0.9, 0.1, 0.2, 0.3], [0.1, 0.9, 0.8, 0.7]]), binary_data=False)
    assert client.infer("clf", [inp]).as_numpy("predict").ravel().tolist() == [1, 0]
