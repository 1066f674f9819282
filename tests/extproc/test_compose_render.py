"""`adapterctl render-compose` (extproc/compose_render.py): the committed docker-compose.yml is the
renderer's output for examples/compose.yaml, byte for byte; services per backend kind; refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.compose_render import ComposeOptions, render_compose, skipped_backends
from extproc.config.loader import load_file, load_text
from extproc.k8s_render import RenderError
from tests.conftest import REPO

DEFAULT = REPO / "examples" / "compose.yaml"
OPTIONS = ComposeOptions(config_path="./examples/compose.yaml", envoy_config="./envoy/compose.yaml")


def test_the_committed_docker_compose_is_the_rendered_default_config():
    assert render_compose(load_file(DEFAULT), OPTIONS) == (REPO / "docker-compose.yml").read_text(), \
        "docker-compose.yml is stale: run `make render` (adapterctl render-compose examples/compose.yaml)"


def test_adapterctl_render_compose_writes_the_same_files(tmp_path):
    (tmp_path / "examples").mkdir()
    cfg = tmp_path / "examples" / "compose.yaml"
    cfg.write_text(DEFAULT.read_text())
    out = subprocess.run([sys.executable, "-m", "extproc", "render-compose", "examples/compose.yaml", "-o",
                          "docker-compose.yml"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "docker-compose.yml").read_text() == (REPO / "docker-compose.yml").read_text()
    assert (tmp_path / "envoy" / "compose.yaml").read_text() == (REPO / "envoy" / "compose.yaml").read_text()


def test_a_change_in_the_config_changes_the_compose_file():
    text = DEFAULT.read_text().replace("port: 8080", "port: 8088").replace("adminPort: 9902", "adminPort: 9912")
    rendered = yaml.safe_load(render_compose(load_text(text, str(DEFAULT)), OPTIONS))
    assert rendered["services"]["envoy"]["ports"] == ["8088:8088", "9901:9901"]
    assert rendered["services"]["processor"]["ports"] == ["9912:9912"]


def test_services_follow_the_backends_kinds():
    text = DEFAULT.read_text().replace('{name: ort, kind: onnxruntime, endpoints: ["ort:8000"]',
                                       '{name: ort, kind: onnxruntime, endpoints: ["onnx:9000"]')
    snap = load_text(text + "    - {path: /x, kind: passthrough, target: \"10.0.0.9:80\"}\n", str(DEFAULT))
    services = yaml.safe_load(render_compose(snap, OPTIONS))["services"]
    assert set(services) == {"envoy", "processor", "onnx", "vllm", "triton", "vllm-simulator"}
    assert services["onnx"]["ports"] == ["9000:9000"] and services["onnx"]["command"][-1] == "9000"
    assert any("10.0.0.9:80" in line for line in skipped_backends(snap))


@pytest.mark.parametrize("edit, field", [
    (("address: processor,", "address: 10.0.0.5,"), "spec.processor.address"),
    (("bindAddress: 0.0.0.0", "bindAddress: 127.0.0.1"), "spec.processor.bindAddress"),
    (("listener: {address: 0.0.0.0", "listener: {address: 127.0.0.1"), "spec.listener.address"),
])
def test_a_config_containers_cannot_run_is_refused_naming_the_field(edit, field):
    text = DEFAULT.read_text()
    assert edit[0] in text
    with pytest.raises(RenderError, match=field.replace(".", r"\.")):
        render_compose(load_text(text.replace(*edit), str(DEFAULT)), OPTIONS)
