"""docker-compose.yml from an AdapterGateway config (`adapterctl render-compose`).

What: the same deployment as `extproc.k8s_render` for one Docker host: Envoy 1.40 with the config's
rendered bootstrap (`adapterctl render-envoy FILE -o ENVOY`, mounted read-only), the processor
(`adapterctl serve`, the config file mounted read-only) and one service per backend the config
names by host name, chosen by the backend's kind:
- `onnxruntime`: our ONNX Runtime KServe v2 server with its demo models (always on);
- `vllm`: vLLM's OpenAI server on an NVIDIA GPU (profile `gpu`), and in profile `cpu` the OpenAI API
  simulator under the same host name (a network alias): not a real model;
- `triton`: Triton Inference Server on a GPU (profile `gpu`), serving `--triton-models`.
Backends of other kinds, or at IP addresses, get no service (the CLI says which): they are servers
the stack reaches as they are. The text is written by hand-rolled formatting, not a YAML dumper,
so the committed docker-compose.yml stays readable (flow lists, comments) and a test can require
`render_compose(examples/compose.yaml)` to equal it byte for byte.
Refusals: an invalid config is the loader's `ConfigError` (file:line: field.path: reason); a config
the containers cannot run as written (the processor's address not a service name, addresses not
0.0.0.0) is a `RenderError` naming the field.
Cost: pure function of the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from extproc.config.snapshot import Snapshot, is_ip
from extproc.k8s_render import RenderError

ENVOY_IMAGE = "envoyproxy/envoy:v1.40.0"
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.09-py3"
WIDTH = 112  # flow lists wrap before this column
GPU_DEPLOY = ["deploy:", "  resources:", "    reservations:", "      devices:", "        - driver: nvidia",
              "          count: 1", "          capabilities: [gpu]"]


@dataclass(frozen=True)
class ComposeOptions:
    config_path: str  # the config file as the compose file's folder sees it, e.g. ./examples/compose.yaml
    envoy_config: str  # the rendered Envoy bootstrap, e.g. ./envoy/compose.yaml
    vllm_model: str = "Qwen/Qwen2.5-7B-Instruct"  # the Hugging Face model vLLM serves as the backend's models
    triton_models: str = "./examples/triton-models"
    simulator_tokens_per_s: int = 50


def _flow(key: str, items: list[str], indent: int) -> list[str]:
    """`key: ["a", "b", ...]`, wrapped greedily before WIDTH, continuation under the first item."""
    head = " " * indent + f"{key}: ["
    lines, line = [], head
    for i, item in enumerate(items):
        piece = json.dumps(item) + ("]" if i == len(items) - 1 else ",")
        if line not in (head,) and len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = " " * len(head) + piece
        else:
            line += ("" if line == head else " ") + piece
    lines.append(line)
    return lines


def _check(snap: Snapshot) -> None:
    where = snap.source
    proc = snap.processor
    if is_ip(proc.address):
        raise RenderError(f"{where}: spec.processor.address: {proc.address!r} is an IP address; in compose it must "
                          "be the processor's service name (e.g. processor), which Envoy resolves")
    for field, value in (("spec.processor.bindAddress", proc.bind_address), ("spec.listener.address",
                                                                             snap.listener.address),
                         ("spec.admin.address", snap.admin.address)):
        if value != "0.0.0.0":
            raise RenderError(f"{where}: {field}: {value!r} is unreachable from other containers; set 0.0.0.0")


def _service_hosts(snap: Snapshot) -> list[tuple[str, Any, int]]:
    """(host, backend, port) for each backend endpoint named by host name, first use of a host wins."""
    seen: dict[str, tuple[str, Any, int]] = {}
    for b in snap.backends.values():
        for host, port in b.endpoints:
            if not is_ip(host) and host not in seen:
                seen[host] = (host, b, port)
    return list(seen.values())


def skipped_backends(snap: Snapshot) -> list[str]:
    """Backends the compose file gives no service, with why (the CLI prints them)."""
    out = []
    for b in snap.backends.values():
        for host, port in b.endpoints:
            if is_ip(host):
                out.append(f"backend {b.name}: {host}:{port} is an IP address (reached as it is)")
            elif b.kind not in ("onnxruntime", "vllm", "triton"):
                out.append(f"backend {b.name}: kind {b.kind} has no compose service; {host}:{port} must be "
                           "reachable as it is")
    return out


def render_compose(snap: Snapshot, options: ComposeOptions) -> str:
    _check(snap)
    proc = snap.processor
    listen, admin = snap.listener.port, snap.admin.port
    lines = [
        "# adapter-gateway with real model servers. Profiles:",
        "#   docker compose --profile gpu up    vLLM and Triton on NVIDIA GPUs (needs the NVIDIA container toolkit)",
        "#   docker compose --profile cpu up    the OpenAI API simulator stands in for vLLM (no GPU; not a real model)",
        f"# Both run Envoy 1.40, the processor and our ONNX Runtime server. The gateway answers on :{listen}.",
        f"# Rendered from {options.config_path.removeprefix('./')} by `adapterctl render-compose`, as is "
        f"{options.envoy_config.removeprefix('./')} by",
        "# `adapterctl render-envoy` (`make render` does both); a test keeps them in step. Do not edit: render again.",
        "name: adapter-gateway",
        "",
        "x-app: &app",
        "  build: .",
        "  image: adapter-gateway:dev",
        "  restart: unless-stopped",
        "",
        "services:",
        "  envoy:",
        f"    image: {ENVOY_IMAGE}",
        *_flow("command", ["envoy", "-c", "/etc/envoy/envoy.yaml", "--disable-hot-restart", "-l", "warning"], 4),
        "    volumes:",
        f"      - {options.envoy_config}:/etc/envoy/envoy.yaml:ro",
        "    ports:",
        f'      - "{listen}:{listen}"',
        f'      - "{admin}:{admin}"',
        f"    depends_on: [{proc.address}]",
        "",
        f"  {proc.address}:",
        "    <<: *app",
        *_flow("command", ["adapterctl", "--log-level", "info", "serve", "/etc/adapter/gateway.yaml"], 4),
        "    volumes:",
        f"      - {options.config_path}:/etc/adapter/gateway.yaml:ro",
        "    ports:",
        f'      - "{proc.admin_port}:{proc.admin_port}"   # Prometheus metrics of the processor',
    ]
    always: list[list[str]] = []
    gpu: list[list[str]] = []
    cpu: list[list[str]] = []
    volumes: dict[str, list[str]] = {"always": [], "gpu": []}
    for host, b, port in _service_hosts(snap):
        if b.kind == "onnxruntime":
            vol = f"{host}-models"
            volumes["always"].append(vol)
            always.append([
                f"  {host}:", "    <<: *app",
                *_flow("command", ["python", "-m", "backends.onnxruntime", "--repository", "/models",
                                   "--build-demo-models", "--host", "0.0.0.0", "--port", str(port)], 4),
                "    volumes:", f"      - {vol}:/models", "    ports:", f'      - "{port}:{port}"'])
        elif b.kind == "vllm":
            if "hf-cache" not in volumes["gpu"]:
                volumes["gpu"].append("hf-cache")
            gpu.append([
                f"  {host}:", f"    image: {VLLM_IMAGE}", "    profiles: [gpu]",
                *_flow("command", ["--model", options.vllm_model, "--served-model-name", *b.models,
                                   "--port", str(port)], 4),
                "    ipc: host", "    volumes:", "      - hf-cache:/root/.cache/huggingface",
                *("    " + g for g in GPU_DEPLOY)])
            cpu.append([
                f"  {host}-simulator:", "    <<: *app", "    profiles: [cpu]",
                *_flow("command", ["python", "-m", "backends.simulator_openai", "--host", "0.0.0.0", "--port",
                                   str(port), "--models", ",".join(b.models), "--decode-tokens-per-s",
                                   str(options.simulator_tokens_per_s)], 4),
                "    networks:", "      default:",
                f"        aliases: [{host}]   # the config's backend host"])
        elif b.kind == "triton":
            gpu.append([
                f"  {host}:", f"    image: {TRITON_IMAGE}", "    profiles: [gpu]",
                *_flow("command", ["tritonserver", "--model-repository=/models", f"--http-port={port}",
                                   f"--grpc-port={port + 1}", f"--metrics-port={port + 2}"], 4),
                "    volumes:", f"      - {options.triton_models}:/models:ro",
                *("    " + g for g in GPU_DEPLOY)])
    for block in always + gpu + cpu:
        lines += ["", *block]
    named = volumes["always"] + volumes["gpu"]  # in the order of the services that use them
    if named:
        lines += ["", "volumes:", *(f"  {v}:" for v in named)]
    return "\n".join(lines) + "\n"


__all__ = ["ComposeOptions", "render_compose", "skipped_backends", "RenderError"]
