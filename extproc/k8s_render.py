"""Kubernetes, Istio and Gateway API manifests from one AdapterGateway config (`adapterctl render-k8s`).

What `render_k8s(path, options)` writes (file name -> YAML documents), all from one config file:
- `configmap.yaml`: ConfigMap `<name>-config` with the config as the pods run it (`gateway.yaml`),
  every file it names (tool routes' `openapi`, rest routes' `mapping`, bundles; binaryData when not
  UTF-8), and `envoy.yaml`, the bootstrap `extproc.envoy_render.render_yaml` makes from that same text;
- `processor.yaml`: Deployment and headless Service `<name>-processor` (one port per worker, the
  admin port; in EPP mode the health port), probes on the processor's own health endpoints:
  readiness = gRPC health of the ext_proc service on worker 0's port (what Envoy's health check
  asks), liveness and startup = the supervisor's `GET /healthz` (200 while every worker is alive);
- `envoy.yaml`: Deployment and Service `<name>-envoy` (Envoy 1.40 with the ConfigMap's envoy.yaml,
  readiness `GET /ready` on the admin port);
- `agent.yaml`: the tenant agent (`python -m ebpf.agent`, ebpf/README.md) as a privileged
  DaemonSet with hostPID and the host paths BCC and the cgroup writer need (/sys/fs/cgroup,
  tracefs, debugfs, /lib/modules, /usr/src) and the snapshot directory it shares with the
  processor pods on the same node (hostPath of `spec.tenancy.snapshot`'s folder);
- `istio-envoyfilter.yaml` (`envoy.yaml` too: only for a config with routes): an Istio `EnvoyFilter` (networking.istio.io/v1alpha3) for an ingress
  gateway: adds our processor cluster (the same `processor_cluster` our Envoy has, pointed at the
  processor Service), inserts our ext_proc filter (the same filter, from `http_connection_manager`)
  before the router, merges our access loggers into the gateway's HCM (with their per-worker clusters;
  when the config has them: access-log feedback or serverTiming routes), and merges each route's per-route ext_proc settings into the gateway's route of
  the same name (name the VirtualService's http routes after the config's routes);
- `inferencepool.yaml` (only with `spec.epp`): an `InferencePool` (inference.networking.k8s.io/v1)
  whose `endpointPickerRef` is our processor's EPP Service `<name>-epp` (extproc/epp.py);
- `inference-gateway.yaml` (only with `spec.epp`): a Gateway API `Gateway` (gateway.networking.k8s.io/v1,
  class `--gateway-class`, one HTTP listener) and an `HTTPRoute` on it whose backendRef is that
  InferencePool: the inference gateway that asks our EPP which endpoint serves.
The config is rewritten for the cluster before anything is rendered (`cluster_config_text`): Envoy
and the processor listen on 0.0.0.0, Envoy reaches the processor at its Service's DNS name, the
worker count is fixed (Envoy's cluster lists one port per worker) and the state directory is a
writable emptyDir; Envoy's routes carry the digest of exactly that text, which the pods load.
Refusals: an invalid config is the loader's `ConfigError` (file:line: field.path: reason); what
cannot be deployed this way (a referenced file outside the config's folder, several processor
replicas with access-log feedback) is a `RenderError` naming the field.
`render_compose` (extproc/compose_render.py) makes docker-compose.yml from a config the same way.
Cost: pure function of the files; no cluster is contacted.
"""

from __future__ import annotations

import copy
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from extproc.config.loader import ConfigError, load_file, load_text, parse_text, read_config, referenced_files, \
    relative_to
from extproc.config.snapshot import Snapshot
from extproc.envoy_render import EXT_PROC, PROCESSOR_CLUSTER, als_clusters, http_connection_manager, \
    processor_cluster, render_yaml, route_configuration, worker_count
from extproc.envoy_render import _represent_str as _envoy_represent_str

MOUNT = "/etc/adapter"  # the ConfigMap's mount in every pod
CONFIG_KEY = "gateway.yaml"
ENVOY_KEY = "envoy.yaml"
STATE_DIR = "/var/lib/adapter-gateway"  # spec.processor.stateDir in the cluster (an emptyDir)
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # its gRPC health name (extproc/server.py)
AGENT_METRICS_PORT = 9478
DEFAULT_WORKERS = 2  # when the config leaves workers to the CPU count: the render must fix one
_KEY_OK = re.compile(r"[^-._a-zA-Z0-9]")
_NAME_OK = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a Service name (RFC 1035 label)
_NAMESPACE_OK = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
MAX_NAME = 63 - len("-tenant-agent")  # the longest suffix we add
ISTIO_GATEWAY_MATCH = {"context": "GATEWAY"}


class RenderError(ValueError):
    """The config is valid but cannot be deployed as asked; the message names the field and why."""


@dataclass(frozen=True)
class K8sOptions:
    namespace: str = "default"
    name: str | None = None  # prefix of every object (default: the config's metadata.name)
    image: str = "adapter-gateway:dev"  # the processor image (Dockerfile); also runs the agent
    envoy_image: str = "envoyproxy/envoy:v1.40.0"
    envoy_replicas: int = 2
    processor_replicas: int = 1
    workers: int | None = None  # default: the config's, else DEFAULT_WORKERS
    service_type: str = "ClusterIP"  # of the Envoy Service (LoadBalancer for an external IP)
    istio_namespace: str = "istio-system"
    istio_selector: dict[str, str] = field(default_factory=lambda: {"istio": "ingressgateway"})
    pool_selector: dict[str, str] | None = None  # InferencePool's model-server pods (default app=<pool>)
    gateway_class: str = "istio"  # the inference Gateway's gatewayClassName (EPP mode)
    gateway_port: int = 80  # its HTTP listener's port


def processor_host(name: str, namespace: str) -> str:
    return f"{name}-processor.{namespace}.svc.cluster.local"


def cluster_config_text(path: str | Path, options: K8sOptions) -> tuple[str, str, int]:
    """The config as the pods run it: (text, object name prefix, workers). Validates the original
    first, so errors name the user's file and lines."""
    original = load_file(path)  # ConfigError: file:line: field.path: reason
    text = read_config(path)
    data = yaml.safe_load(text)
    name = options.name or original.name
    if not (_NAME_OK.match(name) and len(name) <= MAX_NAME):
        source = "--name" if options.name else f"{path}: metadata.name"
        raise RenderError(f"{source}: {name!r} cannot prefix Kubernetes object names (Service names are DNS "
                          f"labels: lower-case letters, digits and '-', starting with a letter, here at most "
                          f"{MAX_NAME} characters); pass --name")
    if not _NAMESPACE_OK.match(options.namespace):
        raise RenderError(f"--namespace: {options.namespace!r} is not a Kubernetes namespace name")
    workers = options.workers or original.processor.workers or DEFAULT_WORKERS
    if original.epp is not None:
        workers = 1  # EPP mode runs exactly one worker (docs/config.md)
    spec = data.setdefault("spec", {})
    spec.setdefault("listener", {})["address"] = "0.0.0.0"
    spec.setdefault("admin", {})["address"] = "0.0.0.0"  # the kubelet probes /ready on the pod IP
    proc = spec.setdefault("processor", {})
    proc.update({"address": processor_host(name, options.namespace), "bindAddress": "0.0.0.0", "workers": workers})
    proc.setdefault("stateDir", STATE_DIR)
    header = (f"# {PurePosixPath(Path(path).name)} for Kubernetes, from `adapterctl render-k8s` (addresses, "
              "workers and stateDir set for the cluster).\n")
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120), name, workers


def _meta(name: str, options: K8sOptions, component: str, app: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": options.namespace, "labels": _labels(app, component), **extra}


def _labels(app: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "adapter-gateway", "app.kubernetes.io/instance": app,
            "app.kubernetes.io/component": component}


def _config_volume(name: str, files: dict[str, str]) -> dict[str, Any]:
    items = [{"key": key, "path": rel} for rel, key in files.items()]
    return {"name": "config", "configMap": {"name": f"{name}-config", "items": items}}


def configmap(name: str, options: K8sOptions, text: str, envoy_text: str, path: Path,
              referenced: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The ConfigMap, and the volume items that put each key back at its path under MOUNT."""
    data = {CONFIG_KEY: text, ENVOY_KEY: envoy_text}
    binary: dict[str, str] = {}
    items = {CONFIG_KEY: CONFIG_KEY}
    resolve = relative_to(str(path))
    for ref in referenced:
        rel = posixpath.normpath(ref)
        if PurePosixPath(ref).is_absolute() or rel.startswith(".."):
            raise RenderError(f"{path}: the config names {ref!r}, outside its folder: the ConfigMap can only ship "
                              "files at paths relative to the config file, inside its folder")
        key = "file." + _KEY_OK.sub("_", rel)
        raw = resolve(ref).read_bytes()
        try:
            data[key] = raw.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            binary[key] = base64.b64encode(raw).decode()
        items[rel] = key
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": _meta(f"{name}-config", options, "config", name), "data": data}
    if binary:
        cm["binaryData"] = binary
    return cm, items


def _processor_ports(snap: Snapshot, workers: int) -> list[dict[str, Any]]:
    base = snap.processor.base_port
    ports = [{"name": f"grpc-w{i}", "containerPort": base + i, "protocol": "TCP"} for i in range(workers)]
    ports.append({"name": "http-admin", "containerPort": snap.processor.admin_port, "protocol": "TCP"})
    if snap.epp is not None and snap.epp.health_port is not None:
        ports.append({"name": "grpc-health", "containerPort": snap.epp.health_port, "protocol": "TCP"})
    return ports


def _snapshot_dir(snap: Snapshot) -> str:
    return posixpath.dirname(snap.tenancy.snapshot) or "/dev/shm"


def processor(name: str, options: K8sOptions, snap: Snapshot, workers: int,
              items: dict[str, str]) -> list[dict[str, Any]]:
    app = f"{name}-processor"
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "processor"}
    ports = _processor_ports(snap, workers)
    admin = snap.processor.admin_port
    container = {
        "name": "processor",
        "image": options.image,
        "command": ["adapterctl", "--log-level", "info", "serve", f"{MOUNT}/{CONFIG_KEY}"],
        "ports": ports,
        # what Envoy's health check asks of every worker (envoy_render.processor_cluster)
        "readinessProbe": {"grpc": {"port": snap.processor.base_port, "service": EXT_PROC_SERVICE},
                           "periodSeconds": 2, "failureThreshold": 2},
        # the supervisor: 200 while every worker process is alive (it restarts one that dies)
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": admin}, "periodSeconds": 10,
                          "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/healthz", "port": admin}, "periodSeconds": 2,
                         "failureThreshold": 60},
        "volumeMounts": [{"name": "config", "mountPath": MOUNT, "readOnly": True},
                         {"name": "state", "mountPath": STATE_DIR},
                         {"name": "tenant-snapshot", "mountPath": _snapshot_dir(snap), "readOnly": True}],
        "resources": {"requests": {"cpu": str(workers), "memory": "512Mi"}},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(app, options, "processor", name),
        "spec": {
            "replicas": options.processor_replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": _labels(name, "processor"),
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(admin)}},
                "spec": {
                    # SIGTERM: NOT_SERVING, then shutdownGrace for open streams
                    "terminationGracePeriodSeconds": int(snap.processor.shutdown_grace) + 10,
                    "containers": [container],
                    "volumes": [_config_volume(name, items), {"name": "state", "emptyDir": {}},
                                {"name": "tenant-snapshot",
                                 "hostPath": {"path": _snapshot_dir(snap), "type": "DirectoryOrCreate"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(app, options, "processor", name),
        "spec": {
            # headless: Envoy's STRICT_DNS cluster sees every pod, each worker port its own endpoint
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"],
                       "protocol": "TCP", **({"appProtocol": "kubernetes.io/h2c"} if p["name"] != "http-admin"
                                             else {})} for p in ports],
        },
    }
    docs = [deployment, service]
    if snap.epp is not None:
        epp_ports = [{"name": "grpc-ext-proc", "port": snap.processor.base_port,
                      "targetPort": snap.processor.base_port, "protocol": "TCP"}]
        if snap.epp.health_port is not None:
            epp_ports.append({"name": "grpc-health", "port": snap.epp.health_port,
                              "targetPort": snap.epp.health_port, "protocol": "TCP"})
        docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _meta(f"{name}-epp", options, "epp", name),
                     "spec": {"selector": selector, "ports": epp_ports}})
    return docs


def envoy(name: str, options: K8sOptions, snap: Snapshot) -> list[dict[str, Any]]:
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "envoy"}
    listen, admin = snap.listener.port, snap.admin.port
    container = {
        "name": "envoy",
        "image": options.envoy_image,
        "command": ["envoy", "-c", f"{MOUNT}/{ENVOY_KEY}", "--disable-hot-restart", "-l", "warning"],
        "ports": [{"name": "http", "containerPort": listen, "protocol": "TCP"},
                  {"name": "http-admin", "containerPort": admin, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": admin}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/ready", "port": admin}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "config", "mountPath": MOUNT, "readOnly": True}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(f"{name}-envoy", options, "envoy", name),
        "spec": {
            "replicas": options.envoy_replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": _labels(name, "envoy")},
                "spec": {"containers": [container], "volumes": [
                    {"name": "config", "configMap": {"name": f"{name}-config",
                                                     "items": [{"key": ENVOY_KEY, "path": ENVOY_KEY}]}}]},
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(f"{name}-envoy", options, "envoy", name),
        "spec": {"type": options.service_type, "selector": selector,
                 "ports": [{"name": "http", "port": listen, "targetPort": listen, "protocol": "TCP"}]},
    }
    return [deployment, service]


# The host paths the tenant agent reads or writes (ebpf/README.md): cgroups it creates and limits,
# tracefs/debugfs for the BPF tracepoints, kernel headers BCC compiles against (/lib/modules/*/build
# links into /usr/src on Debian), and the snapshot folder the processor pods read.
AGENT_HOST_PATHS = (
    ("cgroup", "/sys/fs/cgroup", False, "Directory"),
    ("tracefs", "/sys/kernel/tracing", False, ""),  # "": no check (older kernels have only debugfs)
    ("debugfs", "/sys/kernel/debug", False, ""),
    ("modules", "/lib/modules", True, "Directory"),
    ("usr-src", "/usr/src", True, ""),
)


def agent(name: str, options: K8sOptions, snap: Snapshot, items: dict[str, str]) -> list[dict[str, Any]]:
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "tenant-agent"}
    ports = sorted({p for b in snap.backends.values() for _, p in b.endpoints})
    command = ["python", "-m", "ebpf.agent", "--tenants", f"{MOUNT}/{CONFIG_KEY}", "--snapshot",
               snap.tenancy.snapshot, "--metrics-port", str(AGENT_METRICS_PORT), "--metrics-addr", "0.0.0.0"]
    if ports:
        command += ["--rtt-ports", ",".join(map(str, ports))]
    mounts = [{"name": v, "mountPath": p, **({"readOnly": True} if ro else {})} for v, p, ro, _ in AGENT_HOST_PATHS]
    mounts += [{"name": "tenant-snapshot", "mountPath": _snapshot_dir(snap)},
               {"name": "config", "mountPath": MOUNT, "readOnly": True}]
    volumes = [{"name": v, "hostPath": {"path": p, "type": t}} for v, p, _, t in AGENT_HOST_PATHS]
    volumes += [{"name": "tenant-snapshot", "hostPath": {"path": _snapshot_dir(snap), "type": "DirectoryOrCreate"}},
                _config_volume(name, {CONFIG_KEY: CONFIG_KEY})]
    container = {
        "name": "tenant-agent",
        "image": options.image,
        "command": command,
        # root in the host's PID namespace: BPF programs, cgroup writes, placing processes by /proc
        "securityContext": {"privileged": True, "runAsUser": 0},
        "ports": [{"name": "http-metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"}],
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": AGENT_METRICS_PORT}, "periodSeconds": 10,
                          "initialDelaySeconds": 10},
        "volumeMounts": mounts,
    }
    return [{
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta(f"{name}-tenant-agent", options,
                                                                        "tenant-agent", name),
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": _labels(name, "tenant-agent")},
                "spec": {"hostPID": True, "containers": [container], "volumes": volumes,
                         "tolerations": [{"operator": "Exists"}]},
            },
        },
    }]


def istio_envoyfilter(name: str, options: K8sOptions, snap: Snapshot, workers: int) -> list[dict[str, Any]]:
    """Our processor cluster, ext_proc filter and per-route settings, as patches of an ingress gateway."""
    hcm = http_connection_manager(snap, workers)
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)
    patches: list[dict[str, Any]] = [
        {"applyTo": "CLUSTER", "match": dict(ISTIO_GATEWAY_MATCH),
         "patch": {"operation": "ADD", "value": processor_cluster(snap, workers)}},
        {"applyTo": "HTTP_FILTER",
         "match": {**ISTIO_GATEWAY_MATCH, "listener": {"filterChain": {"filter": {
             "name": "envoy.filters.network.http_connection_manager",
             "subFilter": {"name": "envoy.filters.http.router"}}}}},
         "patch": {"operation": "INSERT_BEFORE", "value": copy.deepcopy(ext_proc)}},
    ]
    if hcm.get("access_log"):  # our access loggers (end-of-request feedback, latency attribution) and their
        # clusters: merged into the gateway's HCM (repeated fields are appended by Istio's MERGE)
        patches += [{"applyTo": "CLUSTER", "match": dict(ISTIO_GATEWAY_MATCH),
                     "patch": {"operation": "ADD", "value": c}} for c in als_clusters(snap, workers)]
        patches.append({"applyTo": "NETWORK_FILTER",
                        "match": {**ISTIO_GATEWAY_MATCH, "listener": {"filterChain": {"filter": {
                            "name": "envoy.filters.network.http_connection_manager"}}}},
                        "patch": {"operation": "MERGE", "value": {"typed_config": {
                            "@type": hcm["@type"], "access_log": copy.deepcopy(hcm["access_log"])}}}})
    client_routes = {r["name"]: r for r in route_configuration(snap)["virtual_hosts"][0]["routes"]}
    for route in snap.routes.values():
        entry = client_routes[route.name]
        patches.append({"applyTo": "HTTP_ROUTE",
                        "match": {**ISTIO_GATEWAY_MATCH, "routeConfiguration": {"vhost": {"route": {
                            "name": route.name}}}},
                        "patch": {"operation": "MERGE",
                                  "value": {"typed_per_filter_config": entry["typed_per_filter_config"]}}})
    return [{
        "apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
        "metadata": {"name": f"{name}-ext-proc", "namespace": options.istio_namespace,
                     "labels": _labels(name, "istio")},
        "spec": {"workloadSelector": {"labels": dict(options.istio_selector)}, "configPatches": patches},
    }]


def inference_pool(name: str, options: K8sOptions, snap: Snapshot) -> list[dict[str, Any]]:
    if snap.epp is None:
        return []
    pool = snap.epp.pool
    ports = sorted({p for _, p in pool.endpoints})
    if len(ports) > 8:
        raise RenderError(f"spec.epp.pool: backend {pool.name} has {len(ports)} distinct endpoint ports; an "
                          "InferencePool has at most 8 targetPorts")
    spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(options.pool_selector or {"app": pool.name})},
        "targetPorts": [{"number": p} for p in ports],
        "endpointPickerRef": {"kind": "Service", "name": f"{name}-epp",
                              "port": {"number": snap.processor.base_port}, "failureMode": "FailClose"},
    }
    return [{"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
             "metadata": {"name": pool.name, "namespace": options.namespace, "labels": _labels(name, "epp")},
             "spec": spec}]


def inference_gateway(name: str, options: K8sOptions, snap: Snapshot) -> list[dict[str, Any]]:
    """A Gateway API `Gateway` (one HTTP listener, class `--gateway-class`) and an `HTTPRoute` on it whose
    one rule sends every path to the InferencePool (backendRef group inference.networking.k8s.io, kind
    InferencePool): what makes a Gateway API implementation call our EPP for the pool's requests."""
    if snap.epp is None:
        return []
    gateway = f"{name}-inference-gateway"
    return [
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
         "metadata": {"name": gateway, "namespace": options.namespace, "labels": _labels(name, "epp")},
         "spec": {"gatewayClassName": options.gateway_class,
                  "listeners": [{"name": "http", "protocol": "HTTP", "port": options.gateway_port,
                                 "allowedRoutes": {"namespaces": {"from": "Same"}}}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": f"{name}-{snap.epp.pool.name}", "namespace": options.namespace,
                      "labels": _labels(name, "epp")},
         "spec": {"parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway,
                                  "sectionName": "http"}],
                  "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                             "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                              "name": snap.epp.pool.name}]}]}},
    ]


def render_k8s(path: str | Path, options: K8sOptions = K8sOptions()) -> dict[str, list[dict[str, Any]]]:
    """{file name: documents}; ConfigError for an invalid config, RenderError for one that cannot deploy."""
    path = Path(path)
    text, name, workers = cluster_config_text(path, options)
    snap = load_text(text, str(path))  # the digest the pods compute from the ConfigMap's copy
    if options.processor_replicas > 1 and snap.processor.feedback == "accessLog" and snap.epp is None:
        raise RenderError(f"{path}: spec.processor.feedback: accessLog needs one processor replica (Envoy's "
                          "access-log entry must reach the worker that served the request, and worker i of every "
                          "replica shares one cluster); set feedback: stream, or --processor-replicas 1")
    model, _ = parse_text(text, str(path))
    envoy_text = render_yaml(snap, workers)
    cm, items = configmap(name, options, text, envoy_text, path, referenced_files(model))
    out = {"configmap.yaml": [cm], "processor.yaml": processor(name, options, snap, workers, items)}
    if any(r.kind != "health" for r in snap.routes.values()):  # an EPP-only config has no Envoy of ours
        out["envoy.yaml"] = envoy(name, options, snap)
        out["istio-envoyfilter.yaml"] = istio_envoyfilter(name, options, snap, workers)
    out["agent.yaml"] = agent(name, options, snap, items)
    pool = inference_pool(name, options, snap)
    if pool:
        out["inferencepool.yaml"] = pool
        out["inference-gateway.yaml"] = inference_gateway(name, options, snap)
    return out


class _ManifestDumper(yaml.SafeDumper):
    """Envoy's quoting (envoy_render.dump_yaml) plus literal blocks for multi-line strings (the
    config and envoy.yaml in the ConfigMap stay readable)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return _envoy_represent_str(dumper, value)


_ManifestDumper.add_representer(str, _represent_str)


def dump_documents(docs: list[dict[str, Any]]) -> str:
    return "---\n".join(yaml.dump(d, Dumper=_ManifestDumper, sort_keys=False, allow_unicode=True, width=120)
                         for d in docs)


def write_k8s(path: str | Path, out_dir: str | Path, options: K8sOptions = K8sOptions()) -> list[Path]:
    manifests = render_k8s(path, options)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, docs in manifests.items():
        target = out / fname
        target.write_text(f"# Generated by `adapterctl render-k8s` from {path}. Do not edit: render again.\n"
                          + dump_documents(docs))
        written.append(target)
    return written




# -- adapterctl render-k8s / render-compose ------------------------------------------------------

def _labels_arg(value: str) -> dict[str, str]:
    import argparse

    out = {}
    for pair in value.split(","):
        k, sep, v = pair.partition("=")
        if not sep or not k:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE[,KEY=VALUE], got {value!r}")
        out[k] = v
    return out


def cmd_render_k8s(args: Any) -> int:
    import sys

    opts = K8sOptions(namespace=args.namespace, name=args.name, image=args.image, envoy_image=args.envoy_image,
                      envoy_replicas=args.envoy_replicas, processor_replicas=args.processor_replicas,
                      workers=args.workers, service_type=args.service_type, istio_namespace=args.istio_namespace,
                      istio_selector=args.istio_selector, pool_selector=args.pool_selector,
                      gateway_class=args.gateway_class, gateway_port=args.gateway_port)
    try:
        written = write_k8s(args.file, args.output, opts)
    except RenderError as e:
        print(f"adapterctl render-k8s: {e}", file=sys.stderr)
        return 1
    for p in written:
        print(p)
    if not any(p.name == "inferencepool.yaml" for p in written):
        print("no inferencepool.yaml: the config has no spec.epp (EPP mode, docs/config.md)", file=sys.stderr)
    return 0


def cmd_render_compose(args: Any) -> int:
    import os
    import sys

    from extproc.compose_render import ComposeOptions, render_compose, skipped_backends

    out = Path(args.output)
    base = out.parent
    envoy_out = Path(args.envoy_config) if args.envoy_config else base / "envoy" / f"{Path(args.file).stem}.yaml"
    snap = load_file(args.file)

    def rel(p: Path) -> str:
        return "./" + Path(os.path.relpath(p, base)).as_posix()

    opts = ComposeOptions(config_path=rel(Path(args.file)), envoy_config=rel(envoy_out))
    try:
        text = render_compose(snap, opts)
    except RenderError as e:
        print(f"adapterctl render-compose: {e}", file=sys.stderr)
        return 1
    envoy_out.parent.mkdir(parents=True, exist_ok=True)
    envoy_out.write_text(render_yaml(snap))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"{out}\n{envoy_out}")
    for line in skipped_backends(snap):
        print(line, file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    """`adapterctl render-k8s` and `adapterctl render-compose` (extproc/cli.py calls this)."""
    s = sub.add_parser("render-k8s", help="write Kubernetes, Istio and Gateway API manifests from a config",
                       description="Writes configmap.yaml, processor.yaml, envoy.yaml, agent.yaml, "
                       "istio-envoyfilter.yaml and, with spec.epp, inferencepool.yaml and inference-gateway.yaml "
                       "(a Gateway and an HTTPRoute to the pool) into DIR "
                       "(docs/deploy-kubernetes.md). Exit 1: invalid config, or one that cannot be deployed.")
    s.add_argument("file")
    s.add_argument("-o", "--output", required=True, metavar="DIR")
    s.add_argument("--namespace", default="default")
    s.add_argument("--name", help="prefix of every object (default: the config's metadata.name)")
    s.add_argument("--image", default=K8sOptions.image, help="processor and agent image (default %(default)s)")
    s.add_argument("--envoy-image", default=K8sOptions.envoy_image)
    s.add_argument("--envoy-replicas", type=int, default=K8sOptions.envoy_replicas)
    s.add_argument("--processor-replicas", type=int, default=K8sOptions.processor_replicas,
                   help="more than 1 needs spec.processor.feedback: stream")
    s.add_argument("--workers", type=int, help=f"processor workers (default: the config's, else {DEFAULT_WORKERS})")
    s.add_argument("--service-type", default="ClusterIP", choices=["ClusterIP", "NodePort", "LoadBalancer"])
    s.add_argument("--istio-namespace", default="istio-system", help="where the ingress gateway runs")
    s.add_argument("--istio-selector", type=_labels_arg, default={"istio": "ingressgateway"}, metavar="K=V[,K=V]",
                   help="the ingress gateway pods' labels (default istio=ingressgateway)")
    s.add_argument("--pool-selector", type=_labels_arg, metavar="K=V[,K=V]",
                   help="the InferencePool's model-server pods (default app=<spec.epp.pool>)")
    s.add_argument("--gateway-class", default=K8sOptions.gateway_class,
                   help="gatewayClassName of the inference Gateway (EPP mode; default %(default)s)")
    s.add_argument("--gateway-port", type=int, default=K8sOptions.gateway_port,
                   help="the inference Gateway's HTTP listener port (default %(default)s)")
    s.set_defaults(fn=cmd_render_k8s)

    s = sub.add_parser("render-compose", help="write docker-compose.yml (and its Envoy bootstrap) from a config",
                       description="Writes OUTPUT and the Envoy bootstrap it mounts (default envoy/<FILE stem>.yaml "
                       "beside OUTPUT). `make render` renders the repo's docker-compose.yml from examples/compose.yaml.")
    s.add_argument("file")
    s.add_argument("-o", "--output", required=True, metavar="docker-compose.yml")
    s.add_argument("--envoy-config", metavar="FILE", help="where to write the Envoy bootstrap")
    s.set_defaults(fn=cmd_render_compose)

__all__ = ["K8sOptions", "RenderError", "register", "cmd_render_k8s", "cmd_render_compose", "ConfigError", "render_k8s", "write_k8s", "cluster_config_text",
           "dump_documents", "processor_host", "AGENT_HOST_PATHS", "EXT_PROC_SERVICE", "PROCESSOR_CLUSTER",
           "worker_count"]
