"""docker-compose.yml (no Docker engine runs here): its services, ports and mounts against the repo."""

from __future__ import annotations

import re

import yaml

from extproc.config.loader import load_file
from extproc.envoy_render import render
from tests.conftest import REPO

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def mounts(service: str) -> dict[str, str]:
    return dict(v.rsplit(":", 2)[:2] if v.endswith(":ro") else v.split(":", 1) for v in SERVICES[service].get("volumes", []))


def test_services_and_profiles():
    assert set(SERVICES) == {"envoy", "processor", "ort", "vllm", "triton", "vllm-simulator"}
    assert re.fullmatch(r"envoyproxy/envoy:v1\.40\.\d+", SERVICES["envoy"]["image"])
    assert SERVICES["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert SERVICES["triton"]["image"].startswith("nvcr.io/nvidia/tritonserver:")
    for gpu in ("vllm", "triton"):
        assert SERVICES[gpu]["profiles"] == ["gpu"]
        device = SERVICES[gpu]["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    sim = SERVICES["vllm-simulator"]
    assert sim["profiles"] == ["cpu"] and "backends.simulator_openai" in sim["command"]
    assert "vllm" in sim["networks"]["default"]["aliases"]  # stands in for the vllm host, CPU profile only


def test_envoy_mounts_the_rendered_config_of_the_mounted_gateway_config():
    envoy_src = mounts("envoy")["./envoy/compose.yaml"]
    gateway_src = [k for k, v in mounts("processor").items() if v == "/etc/adapter/gateway.yaml"][0]
    assert envoy_src == "/etc/envoy/envoy.yaml" and "/etc/envoy/envoy.yaml" in SERVICES["envoy"]["command"]
    snap = load_file(REPO / gateway_src)
    checked_in = yaml.safe_load((REPO / "envoy" / "compose.yaml").read_text())
    assert checked_in == render(snap, workers=snap.processor.workers), "stale: run `make render`"
    assert f"{snap.listener.port}:{snap.listener.port}" in SERVICES["envoy"]["ports"]
    assert f"{snap.processor.admin_port}:{snap.processor.admin_port}" in SERVICES["processor"]["ports"]
    assert snap.processor.address == "processor" and snap.processor.bind_address == "0.0.0.0"


def test_every_backend_host_is_a_compose_service():
    snap = load_file(REPO / "examples" / "compose.yaml")
    hosts = set(SERVICES) | {a for s in SERVICES.values() for a in s.get("networks", {}).get("default", {}).get("aliases", [])}
    for backend in snap.backends.values():
        for host, port in backend.endpoints:
            assert host in hosts, f"backend {backend.name} points at {host}, which no service provides"


def test_image_build_copies_what_exists():
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), src
