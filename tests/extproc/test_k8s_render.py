"""`adapterctl render-k8s` (extproc/k8s_render.py): every manifest valid against its schema
(Kubernetes 1.34 via kubernetes-validate, the vendored Istio and GIE CRDs via jsonschema), the
EnvoyFilter's ext_proc filter on the processor Service, probes answered by a real processor, the
privileged agent DaemonSet with its host mounts, the Envoy config from the one renderer, refusals."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config.loader import ConfigError, load_text
from extproc.envoy_render import EXT_PROC, PROCESSOR_CLUSTER, render_yaml
from extproc.k8s_render import AGENT_HOST_PATHS, CONFIG_KEY, ENVOY_KEY, MOUNT, K8sOptions, RenderError, render_k8s, \
    write_k8s
from extproc.server import HEALTH_NAMES
from extproc.stack import free_port, free_port_block
from tests.conftest import DATA, REPO

K8S_VERSION = "1.34.0"
SCHEMAS = Path(__file__).parent / "k8s_schemas"
CRDS = {
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): "envoyfilters.networking.istio.io-1.30.3.yaml",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools.inference.networking.k8s.io-v1.6.0.yaml",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateways.gateway.networking.k8s.io-v1.6.1.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes.gateway.networking.k8s.io-v1.6.1.yaml",
}
FINANCE = REPO / "examples" / "finance-llm-adapter.yaml"
EPP = REPO / "examples" / "k8s" / "epp-pool.yaml"
CONFIGS = [*sorted((REPO / "examples").glob("*.yaml")), EPP]  # every example config (docs/deploy-kubernetes.md)


def _strict(schema: dict) -> dict:
    """The API server's strict field validation: objects with properties refuse unknown fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    """The CRD's validator, built once per kind (parsing the Gateway API CRDs took seconds per manifest)."""
    crd = yaml.load((SCHEMAS / CRDS[(api_version, kind)]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    served = {v["name"]: v for v in crd["spec"]["versions"]}
    root = copy.deepcopy(served[version]["schema"]["openAPIV3Schema"])
    # the API server adds these to every CRD's schema (Istio's leave them out)
    for implied, schema in (("apiVersion", {"type": "string"}), ("kind", {"type": "string"}),
                            ("metadata", {"type": "object"})):
        root.setdefault("properties", {}).setdefault(implied, schema)
    return jsonschema.Draft7Validator(_strict(root))


def validate(doc: dict) -> None:
    """Raises on a manifest its schema refuses."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        crd_validator(*key).validate(doc)
        if doc["kind"] == "InferencePool":  # the CRD's one CEL rule that applies (x-kubernetes-validations)
            ref = doc["spec"]["endpointPickerRef"]
            assert ref.get("kind", "Service") != "Service" or "port" in ref
        if doc["kind"] == "HTTPRoute":  # the backendRef CEL rule: a core Service needs a port
            for rule in doc["spec"]["rules"]:
                for ref in rule.get("backendRefs", []):
                    assert ref.get("group", "") != "" or ref.get("kind", "Service") != "Service" or "port" in ref
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def docs_of(manifests: dict) -> list[dict]:
    return [d for docs in manifests.values() for d in docs]


def by_kind(manifests: dict, kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs_of(manifests) if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (kind, name_suffix, [d["metadata"]["name"] for d in found])
    return found[0]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_manifest_validates_against_its_schema(config):
    manifests = render_k8s(config)
    kinds = {d["kind"] for d in docs_of(manifests)}
    assert {"ConfigMap", "Deployment", "Service", "DaemonSet"} <= kinds
    for doc in docs_of(manifests):
        validate(doc)


def test_the_written_files_are_what_render_returns(tmp_path):
    written = write_k8s(FINANCE, tmp_path, K8sOptions(namespace="gw"))
    assert sorted(p.name for p in written) == ["agent.yaml", "configmap.yaml", "envoy.yaml",
                                                "istio-envoyfilter.yaml", "processor.yaml"]
    for p in written:
        for doc in yaml.safe_load_all(p.read_text()):
            validate(doc)
            assert doc["metadata"]["namespace"] == ("istio-system" if doc["kind"] == "EnvoyFilter" else "gw")


@pytest.mark.parametrize("breakage", [
    ("Deployment", lambda d: d["spec"].update(replicas="two")),
    ("Deployment", lambda d: d["spec"]["template"]["spec"].update(hostNetwrk=True)),  # unknown field (strict)
    ("Service", lambda d: d["spec"]["ports"][0].update(port="http")),  # port is an integer
    ("DaemonSet", lambda d: d["spec"].pop("selector")),
    ("ConfigMap", lambda d: d.update(data={"gateway.yaml": 1})),
    ("EnvoyFilter", lambda d: d["spec"]["configPatches"][0].update(applyTo="HTTP_FILTERS")),
    ("EnvoyFilter", lambda d: d["spec"]["configPatches"][0]["patch"].update(operation="APPEND")),
    ("EnvoyFilter", lambda d: d["spec"].update(workloadSelectors={})),  # unknown field (strictified CRD)
    ("InferencePool", lambda d: d["spec"].pop("targetPorts")),
    ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].update(failureMode="FailSometimes")),
    ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),  # the CEL rule
    ("InferencePool", lambda d: d["spec"].update(extensionRef={"name": "x"})),  # the v1alpha2 field name
    ("Gateway", lambda d: d["spec"].pop("gatewayClassName")),
    ("Gateway", lambda d: d["spec"]["listeners"][0].update(port=0)),  # minimum 1
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(weight="1")),
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")),
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(endpointPickerRef={})),  # unknown
    ("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(group="", kind="Service")),  # CEL
], ids=lambda b: b[0] if isinstance(b, tuple) else None)
def test_a_broken_manifest_fails_the_validator(breakage):
    kind, breaks = breakage
    manifests = render_k8s(EPP if kind in ("InferencePool", "Gateway", "HTTPRoute") else FINANCE)
    doc = copy.deepcopy(next(d for d in docs_of(manifests) if d["kind"] == kind))
    validate(doc)  # valid as rendered
    breaks(doc)
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        validate(doc)


def _processor_service(manifests: dict) -> dict:
    return by_kind(manifests, "Service", "-processor")


def test_the_envoyfilter_inserts_our_ext_proc_filter_pointed_at_the_processor_service():
    opts = K8sOptions(namespace="inference", istio_namespace="istio-ingress", istio_selector={"app": "gw"})
    manifests = render_k8s(FINANCE, opts)
    ef = by_kind(manifests, "EnvoyFilter")
    assert ef["metadata"]["namespace"] == "istio-ingress" and ef["spec"]["workloadSelector"]["labels"] == {"app": "gw"}
    patches = ef["spec"]["configPatches"]
    cluster = next(p for p in patches if p["applyTo"] == "CLUSTER")["patch"]["value"]
    insert = next(p for p in patches if p["applyTo"] == "HTTP_FILTER")
    assert insert["patch"]["operation"] == "INSERT_BEFORE"
    assert insert["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    ext_proc = insert["patch"]["value"]
    assert ext_proc["name"] == EXT_PROC
    assert ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == cluster["name"] == PROCESSOR_CLUSTER
    svc = _processor_service(manifests)
    fqdn = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    endpoints = [e["endpoint"]["address"]["socket_address"] for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    service_ports = {p["port"] for p in svc["spec"]["ports"]}
    assert endpoints and {e["address"] for e in endpoints} == {fqdn}
    assert {e["port_value"] for e in endpoints} <= service_ports
    assert svc["spec"]["clusterIP"] == "None"  # headless: STRICT_DNS sees every pod
    # the same filter and cluster as our own Envoy's (one renderer), from the ConfigMap's envoy.yaml
    envoy = yaml.safe_load(by_kind(manifests, "ConfigMap")["data"][ENVOY_KEY])
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert ext_proc == next(f for f in hcm["http_filters"] if f["name"] == EXT_PROC)
    assert cluster == next(c for c in envoy["static_resources"]["clusters"] if c["name"] == PROCESSOR_CLUSTER)
    # each route's per-route settings merged into the gateway's route of the same name
    routes = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"]: p["patch"]
              for p in patches if p["applyTo"] == "HTTP_ROUTE"}
    client = {r["name"]: r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]}
    assert {"v1-analyze", "v1-fraud-score", "v1", "v2"} <= set(routes)
    for name, patch in routes.items():
        assert patch["operation"] == "MERGE"
        assert patch["value"]["typed_per_filter_config"] == client[name]["typed_per_filter_config"]


def test_envoy_in_the_configmap_is_the_renderers_output_for_the_configs_text(tmp_path):
    """What the processor pods load (gateway.yaml and the files it names, from the ConfigMap) has
    the digest Envoy's routes carry, and envoy.yaml is render_yaml of exactly that text."""
    cfg_dir = tmp_path / "src"
    cfg_dir.mkdir()
    (cfg_dir / "specs").mkdir()
    shutil.copy(DATA / "openapi" / "petstore.yaml", cfg_dir / "specs" / "pets.yaml")
    cfg = cfg_dir / "gw.yaml"
    cfg.write_text("""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: tools}
spec:
  backends:
    - {name: petstore, kind: rest, endpoints: ["petstore:8080"]}
  routes:
    - {path: /tools/petstore, kind: tool, target: petstore, openapi: specs/pets.yaml}
""")
    manifests = render_k8s(cfg)
    cm = by_kind(manifests, "ConfigMap")
    deployment = by_kind(manifests, "Deployment", "-processor")
    items = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")["configMap"]["items"]
    pod = tmp_path / "pod"
    for item in items:  # lay the ConfigMap out as the kubelet does
        (pod / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (pod / item["path"]).write_text(cm["data"][item["key"]])
    assert (pod / "specs" / "pets.yaml").read_bytes() == (cfg_dir / "specs" / "pets.yaml").read_bytes()
    snap = load_text((pod / CONFIG_KEY).read_text(), str(pod / CONFIG_KEY))
    envoy_text = cm["data"][ENVOY_KEY]
    assert f"value: {snap.digest}" in envoy_text
    assert envoy_text == render_yaml(load_text(cm["data"][CONFIG_KEY], str(cfg)), snap.processor.workers)
    assert snap.processor.address == "tools-processor.default.svc.cluster.local"
    assert snap.listener.address == snap.admin.address == snap.processor.bind_address == "0.0.0.0"


def test_envoy_accepts_the_configmaps_bootstrap(tmp_path):
    """Envoy 1.40 itself (`envoy --mode validate`, as `make render` runs it) on the cluster's envoy.yaml,
    whose processor cluster is the Service's DNS name; the EnvoyFilter's cluster and filter are its own."""
    from extproc.cli import envoy_validate

    out = tmp_path / ENVOY_KEY
    out.write_text(by_kind(render_k8s(FINANCE), "ConfigMap")["data"][ENVOY_KEY])
    ok, output = envoy_validate(str(out))
    assert ok, output


def test_a_named_file_that_is_not_utf8_travels_as_binary_data(tmp_path):
    """Bundles (ZIPs) are binary: binaryData, base64, put back at their path by the volume's items."""
    import base64

    from extproc.k8s_render import configmap

    (tmp_path / "bundles").mkdir()
    raw = bytes(range(256))
    (tmp_path / "bundles" / "finance-1.2.zip").write_bytes(raw)
    cm, items = configmap("gw", K8sOptions(), "text", "envoy", tmp_path / "gw.yaml", ["bundles/finance-1.2.zip"])
    key = items["bundles/finance-1.2.zip"]
    assert key not in cm["data"] and base64.b64decode(cm["binaryData"][key]) == raw
    validate(cm)


def test_probes_are_answered_by_a_real_processor(tmp_path):
    manifests = render_k8s(FINANCE, K8sOptions(workers=2))
    container = by_kind(manifests, "Deployment", "-processor")["spec"]["template"]["spec"]["containers"][0]
    text = by_kind(manifests, "ConfigMap")["data"][CONFIG_KEY]
    snap = load_text(text, str(FINANCE))
    container_ports = {p["containerPort"] for p in container["ports"]}
    ready, live, startup = container["readinessProbe"], container["livenessProbe"], container["startupProbe"]
    assert ready["grpc"]["port"] == snap.processor.base_port and ready["grpc"]["service"] in HEALTH_NAMES
    assert live["httpGet"]["port"] == startup["httpGet"]["port"] == snap.processor.admin_port
    assert {ready["grpc"]["port"], live["httpGet"]["port"]} <= container_ports
    # run the processor on that config (free ports instead of the pod's, a temp state dir)
    cfg = tmp_path / CONFIG_KEY
    cfg.write_text(text.replace("stateDir: /var/lib/adapter-gateway", f"stateDir: {tmp_path / 'state'}"))
    base, admin = free_port_block(2), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "serve", str(cfg), "--base-port", str(base),
                             "--admin-port", str(admin)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"http://127.0.0.1:{admin}{live['httpGet']['path']}", timeout=1).status_code
                if status == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert status == 200
        assert httpx.get(f"http://127.0.0.1:{admin}{startup['httpGet']['path']}").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{admin}/no-such-probe").status_code == 404  # a wrong path would fail
        with grpc.insecure_channel(f"127.0.0.1:{base}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=ready["grpc"]["service"]), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:  # an unknown service name is refused: the check can fail
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_envoy_probes_its_admin_ready_endpoint():
    manifests = render_k8s(FINANCE)
    container = by_kind(manifests, "Deployment", "-envoy")["spec"]["template"]["spec"]["containers"][0]
    snap = load_text(by_kind(manifests, "ConfigMap")["data"][CONFIG_KEY], str(FINANCE))
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": snap.admin.port}
    assert container["command"][:3] == ["envoy", "-c", f"{MOUNT}/{ENVOY_KEY}"]
    svc = by_kind(manifests, "Service", "-envoy")
    assert svc["spec"]["ports"][0]["targetPort"] == snap.listener.port


def test_the_tenant_agent_is_a_privileged_daemonset_with_the_host_mounts_ebpf_needs():
    manifests = render_k8s(FINANCE)
    ds = by_kind(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["hostPID"] is True  # places tenants' processes found in /proc
    assert container["securityContext"]["privileged"] is True
    assert container["command"][:3] == ["python", "-m", "ebpf.agent"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for needed, writable in (("/sys/fs/cgroup", True), ("/sys/kernel/tracing", True), ("/sys/kernel/debug", True),
                             ("/lib/modules", False), ("/usr/src", False)):
        m = mounts[needed]
        assert volumes[m["name"]]["hostPath"]["path"] == needed
        assert m.get("readOnly", False) is (not writable)
    assert {p for _, p, _, _ in AGENT_HOST_PATHS} <= set(mounts)
    # the snapshot: the agent writes the config's tenancy.snapshot in a host folder the processor reads
    snap = load_text(by_kind(manifests, "ConfigMap")["data"][CONFIG_KEY], str(FINANCE))
    args = container["command"]
    assert args[args.index("--snapshot") + 1] == snap.tenancy.snapshot
    folder = str(Path(snap.tenancy.snapshot).parent)
    assert volumes[mounts[folder]["name"]]["hostPath"]["path"] == folder and not mounts[folder].get("readOnly")
    proc_pod = by_kind(manifests, "Deployment", "-processor")["spec"]["template"]["spec"]
    proc_mount = next(m for m in proc_pod["containers"][0]["volumeMounts"] if m["mountPath"] == folder)
    assert proc_mount["readOnly"] is True
    assert next(v for v in proc_pod["volumes"] if v["name"] == proc_mount["name"])["hostPath"]["path"] == folder
    # RTT measured for the backends' ports
    assert args[args.index("--rtt-ports") + 1] == "8000,8080"


def test_the_inferencepool_names_our_epp_service_as_its_endpoint_picker():
    manifests = render_k8s(EPP, K8sOptions(pool_selector={"app": "vllm", "model": "llama"}))
    assert "envoy.yaml" not in manifests and "istio-envoyfilter.yaml" not in manifests  # EPP only
    pool = by_kind(manifests, "InferencePool")
    snap = load_text(by_kind(manifests, "ConfigMap")["data"][CONFIG_KEY], str(EPP))
    ref = pool["spec"]["endpointPickerRef"]
    svc = by_kind(manifests, "Service", "-epp")
    assert ref["name"] == svc["metadata"]["name"] and ref["kind"] == "Service"
    assert ref["port"]["number"] == snap.processor.base_port in {p["port"] for p in svc["spec"]["ports"]}
    assert svc["spec"]["selector"] == by_kind(manifests, "Deployment", "-processor")["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm", "model": "llama"}
    assert snap.processor.workers == 1


def test_an_httproute_on_a_gateway_sends_requests_to_the_inferencepool():
    """The inference gateway: a Gateway of the chosen class, and an HTTPRoute attached to its listener
    whose one rule's backendRef is the InferencePool (group, kind and name), in the pool's namespace."""
    manifests = render_k8s(EPP, K8sOptions(namespace="llm", gateway_class="kgateway", gateway_port=8080))
    assert [d["kind"] for d in manifests["inference-gateway.yaml"]] == ["Gateway", "HTTPRoute"]
    pool, gateway, route = (by_kind(manifests, k) for k in ("InferencePool", "Gateway", "HTTPRoute"))
    for doc in (pool, gateway, route):
        validate(doc)
        assert doc["metadata"]["namespace"] == "llm"
    assert gateway["spec"]["gatewayClassName"] == "kgateway"
    (listener,) = gateway["spec"]["listeners"]
    assert (listener["protocol"], listener["port"]) == ("HTTP", 8080)
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["group"], parent["kind"], parent["name"], parent["sectionName"]) == \
        ("gateway.networking.k8s.io", "Gateway", gateway["metadata"]["name"], listener["name"])
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == \
        ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert "inference-gateway.yaml" not in render_k8s(FINANCE)  # no spec.epp, no pool to route to


def _apply_envoyfilter(bootstrap: dict, envoyfilter: dict) -> dict:
    """What Istio does with the EnvoyFilter's patches on a gateway's listener, clusters and routes (only the
    operations and matches our EnvoyFilter uses; anything else fails the test)."""
    out = copy.deepcopy(bootstrap)
    static = out["static_resources"]
    for patch in envoyfilter["spec"]["configPatches"]:
        assert patch["match"]["context"] == "GATEWAY"
        op, value = patch["patch"]["operation"], copy.deepcopy(patch["patch"]["value"])
        if patch["applyTo"] == "CLUSTER":
            assert op == "ADD"
            static["clusters"].append(value)
        elif patch["applyTo"] == "HTTP_FILTER":
            assert op == "INSERT_BEFORE"
            want = patch["match"]["listener"]["filterChain"]["filter"]
            hits = 0
            for lst in static["listeners"]:
                for chain in lst["filter_chains"]:
                    for f in chain["filters"]:
                        if f["name"] != want["name"]:
                            continue
                        filters = f["typed_config"]["http_filters"]
                        at = [i for i, h in enumerate(filters) if h["name"] == want["subFilter"]["name"]]
                        assert len(at) == 1
                        filters.insert(at[0], value)
                        hits += 1
            assert hits == 1
        elif patch["applyTo"] == "NETWORK_FILTER":  # MERGE into the HCM: repeated fields appended (proto merge)
            assert op == "MERGE"
            want = patch["match"]["listener"]["filterChain"]["filter"]["name"]
            (hcm,) = [f["typed_config"] for lst in static["listeners"] for chain in lst["filter_chains"]
                      for f in chain["filters"] if f["name"] == want]
            for k, v in value["typed_config"].items():
                if k == "@type":
                    assert v == hcm[k]
                elif isinstance(v, list):
                    hcm.setdefault(k, []).extend(v)
                else:
                    hcm[k] = v
        elif patch["applyTo"] == "HTTP_ROUTE":
            assert op == "MERGE"
            name = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
            hcm = static["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"] if r["name"] == name]
            assert len(routes) == 1, name
            for k, v in value.items():
                routes[0].setdefault(k, {}).update(v)
        else:
            raise AssertionError(patch["applyTo"])
    return out


def test_the_envoyfilter_patched_into_an_istio_like_gateway_is_accepted_by_envoy(tmp_path):
    """An ingress gateway's shape (a listener whose HCM ends in the router, a route per VirtualService http
    route, the route's own upstream cluster) with the EnvoyFilter's patches applied as Istio applies them:
    the ext_proc filter lands right before the router, its cluster exists, and Envoy 1.40 accepts the result
    (`envoy --mode validate`); a malformed filter is refused by the same check."""
    from extproc.cli import envoy_validate

    manifests = render_k8s(FINANCE)
    ef = by_kind(manifests, "EnvoyFilter")
    route_names = [p["match"]["routeConfiguration"]["vhost"]["route"]["name"]
                   for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_ROUTE"]
    upstream = "outbound|8080||finance.default.svc.cluster.local"
    gateway = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [{"name": "0.0.0.0_8080",
                           "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": {
                                   "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                            "http_connection_manager.v3.HttpConnectionManager",
                                   "stat_prefix": "outbound_0.0.0.0_8080",
                                   "route_config": {"name": "http.8080", "virtual_hosts": [{
                                       "name": "*:80", "domains": ["*"],
                                       "routes": [{"name": n, "match": {"prefix": "/"}, "route": {"cluster": upstream}}
                                                  for n in route_names]}]},
                                   "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                                       "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                               }}]}]}],
            "clusters": [{"name": upstream, "type": "STRICT_DNS", "connect_timeout": "1s",
                          "load_assignment": {"cluster_name": upstream, "endpoints": [{"lb_endpoints": [{"endpoint": {
                              "address": {"socket_address": {"address": "finance.default.svc.cluster.local",
                                                             "port_value": 8080}}}}]}]}}],
        },
    }
    patched = _apply_envoyfilter(gateway, ef)
    hcm = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in hcm["http_filters"]] == [EXT_PROC, "envoy.filters.http.router"]
    cluster_name = hcm["http_filters"][0]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    clusters = {c["name"] for c in patched["static_resources"]["clusters"]}
    assert cluster_name in clusters
    # our access loggers (the finance config has access-log feedback), each with its worker's cluster
    loggers = [a["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
               for a in hcm["access_log"]]
    assert len(loggers) == 2 and set(loggers) <= clusters
    out = tmp_path / "istio-gateway.yaml"
    out.write_text(yaml.safe_dump(patched, sort_keys=False))
    ok, output = envoy_validate(str(out))
    assert ok, output
    # Envoy parses the inserted filter (an unknown field in it is refused); it resolves the gRPC cluster only
    # when a stream opens, so the cluster's existence is the structural assertion above
    ef_bad = copy.deepcopy(ef)
    next(p for p in ef_bad["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")["patch"]["value"][
        "typed_config"]["processing_mode"]["request_header_mod"] = "SEND"
    out.write_text(yaml.safe_dump(_apply_envoyfilter(gateway, ef_bad), sort_keys=False))
    ok, output = envoy_validate(str(out))
    assert not ok and "request_header_mod" in output


def test_an_invalid_config_is_refused_with_file_field_and_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(FINANCE.read_text().replace("kind: tensor", "kind: tensr"))
    with pytest.raises(ConfigError) as e:
        render_k8s(bad)
    assert f"{bad}:" in str(e.value) and "spec.routes[1].kind" in str(e.value)
    out = subprocess.run([sys.executable, "-m", "extproc", "render-k8s", str(bad), "-o", str(tmp_path / "k8s")],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1 and "spec.routes[1].kind" in out.stderr and not (tmp_path / "k8s").exists()


def test_what_cannot_deploy_is_refused_naming_the_field(tmp_path):
    with pytest.raises(RenderError, match="spec.processor.feedback"):
        render_k8s(FINANCE, K8sOptions(processor_replicas=3))
    outside = tmp_path / "cfg"
    outside.mkdir()
    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    (outside / "gw.yaml").write_text("""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: t}
spec:
  backends: [{name: petstore, kind: rest, endpoints: ["petstore:8080"]}]
  routes: [{path: /t, kind: tool, target: petstore, openapi: ../pets.yaml}]
""")
    with pytest.raises(RenderError, match="outside its folder"):
        render_k8s(outside / "gw.yaml")


@pytest.mark.parametrize("options, field", [
    (K8sOptions(name="Finance_GW"), "--name"),
    (K8sOptions(name="9gw"), "--name"),  # a Service name starts with a letter
    (K8sOptions(name="g" * 51), "--name"),
    (K8sOptions(namespace="AI"), "--namespace"),
])
def test_names_kubernetes_would_refuse_are_refused_here(options, field):
    with pytest.raises(RenderError, match=field):
        render_k8s(FINANCE, options)
    render_k8s(FINANCE, K8sOptions(name="g" * 50))  # the longest accepted


def test_adapterctl_render_k8s_writes_the_directory(tmp_path):
    out = subprocess.run([sys.executable, "-m", "extproc", "render-k8s", str(EPP), "-o", str(tmp_path),
                          "--namespace", "llm", "--pool-selector", "app=vllm"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.yaml", "configmap.yaml", "inference-gateway.yaml",
                                                          "inferencepool.yaml", "processor.yaml"]
    pool = yaml.safe_load((tmp_path / "inferencepool.yaml").read_text())
    assert pool["metadata"]["namespace"] == "llm" and pool["spec"]["selector"]["matchLabels"] == {"app": "vllm"}
