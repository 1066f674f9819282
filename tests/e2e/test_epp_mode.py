"""EPP mode through a real Envoy 1.40 configured the way an inference gateway configures it.

The bootstrap below is hand-written after what kgateway, Istio and Envoy AI Gateway generate for
an HTTPRoute whose backend is an InferencePool (docs/config.md "EPP mode"): one listener, the
ext_proc filter pointing at the EPP's gRPC service (request and response bodies
FULL_DUPLEX_STREAMED, trailers SEND, `failure_mode_allow: false`), the route to an ORIGINAL_DST
cluster that sends each request to the `ip:port` in `x-gateway-destination-endpoint`. Nothing of
ours is in it: no `x-adapter-route` metadata, no access loggers. A header-to-metadata filter in
front turns a test header into the subset hint (`envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset`), as a gateway that subsets would set it, and the
ext_proc filter forwards that namespace to the EPP.
The processor is started as an operator would, `python -m extproc serve FILE` (one worker on the
EPP port); two OpenAI-API simulators are the pool; each simulator's own request counter says
where requests went.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.envoy_bin import find_envoy
from extproc.stack import free_port, wait_http
from tests.conftest import REPO
from tests.e2e.test_scheduling_profiles import Simulator, counts_after
from tests.e2e.test_xds_live import procs  # noqa: F401  (a fixture: started processes, stopped by handle)

pytestmark = pytest.mark.e2e


def epp_config(path: Path, port: int, health_port: int, admin_port: int, labelled: Simulator,
               other: Simulator, dead: str | None = None, tls: tuple[str, str] | None = None) -> Path:
    """The pool: `other` (v100), `labelled` (a100); profile `on-a100`. With `dead` (an ip:port nothing
    listens on) first in the pool, the profile is `dead-first`: that endpoint, then the others as fallbacks."""
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "epp"},
        "spec": {
            "processor": {"address": "127.0.0.1", "basePort": port, "adminPort": admin_port, "feedback": "stream"},
            "backends": [{"name": "pool", "models": ["m"], "endpoints": [
                {"address": other.id, "labels": {"gpu": "v100"}},
                {"address": labelled.id, "labels": {"gpu": "a100"}},
            ]}],
            "plugins": [
                {"name": "a100", "type": "label-filter", "parameters": {"matchLabels": {"gpu": "a100"}}},
                {"type": "in-flight-scorer"},
                {"type": "max-score-picker", "parameters": {"fallbacks": 0}},
            ],
            "schedulingProfiles": [
                {"name": "on-a100", "plugins": [{"pluginRef": "a100"}, {"pluginRef": "in-flight-scorer"},
                                                {"pluginRef": "max-score-picker"}]},
            ],
            "epp": {"pool": "pool", "profile": "on-a100", "healthPort": health_port,
                    "modelRewrites": {"m-alias": "m"}},
        },
    }
    if tls is not None:
        doc["spec"]["epp"]["tls"] = {"certFile": tls[0], "keyFile": tls[1]}
    if dead is not None:
        doc["spec"]["backends"][0]["endpoints"].insert(0, dead)
        doc["spec"]["plugins"].append({"name": "dead-first", "type": "pinned-endpoint",
                                       "parameters": {"endpoint": dead, "fallback": True}})
        doc["spec"]["epp"]["profile"] = "dead-first"
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def gateway_bootstrap(path: Path, listen: int, admin: int, epp_port: int, body_mode: str,
                      pool: list[str] | None = None, tls: bool = False) -> Path:
    """The Envoy an inference gateway renders for one InferencePool: ORIGINAL_DST on the header; or,
    with `pool` (the InferencePool's endpoints), a cluster of them whose override-host load balancer
    reads the `envoy.lb` metadata (the list: the pick, then fallbacks), retrying on connect failure."""
    route: dict = {"cluster": "endpointpicker_pool_default_original_dst", "timeout": "60s"}
    if pool is not None:
        route["retry_policy"] = {"retry_on": "connect-failure", "num_retries": 2}
    doc = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                                 ".HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": [{
                            "match": {"prefix": "/"},
                            "route": route,
                        }]}]},
                        "http_filters": [
                            {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3"
                                         ".Config",
                                "request_rules": [{"header": "x-test-subset", "remove": True, "on_header_present": {
                                    "metadata_namespace": "envoy.lb.subset_hint",
                                    "key": "x-gateway-destination-endpoint-subset", "type": "STRING"}}]}},
                            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3"
                                         ".ExternalProcessor",
                                "grpc_service": {"envoy_grpc": {"cluster_name": "endpointpicker_pool_default_ext_proc",
                                                                "authority": f"pool-epp.default:{epp_port}"},
                                                 "timeout": "10s"},
                                "failure_mode_allow": False,
                                "processing_mode": {
                                    "request_header_mode": "SEND", "response_header_mode": "SEND",
                                    "request_body_mode": body_mode, "response_body_mode": body_mode,
                                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
                                "message_timeout": "5s",
                                "metadata_options": {
                                    "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
                                    "receiving_namespaces": {"untyped": ["envoy.lb"]}},
                            }},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                        ],
                    },
                }]}],
            }],
            "clusters": [
                {"name": "endpointpicker_pool_default_original_dst", "type": "ORIGINAL_DST",
                 "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "10s",
                 "original_dst_lb_config": {"use_http_header": True,
                                            "http_header_name": "x-gateway-destination-endpoint"}},
                {"name": "endpointpicker_pool_default_ext_proc", "type": "STATIC", "connect_timeout": "10s",
                 "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                     "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                     "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "endpointpicker_pool_default_ext_proc", "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                         "address": "127.0.0.1", "port_value": epp_port}}}}]}]}},
            ],
        },
    }
    if tls:  # kgateway's and Envoy AI Gateway's EPP cluster: TLS that validates nothing
        doc["static_resources"]["clusters"][1]["transport_socket"] = {
            "name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}}}}
    if pool is not None:
        doc["static_resources"]["clusters"][0] = {
            "name": "endpointpicker_pool_default_original_dst", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "endpointpicker_pool_default_original_dst", "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                    "address": ep.rpartition(":")[0], "port_value": int(ep.rpartition(":")[2])}}}} for ep in pool]}]},
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
                             ".OverrideHost",
                    "override_host_sources": [{"metadata": {
                        "key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                    "fallback_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.round_robin",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                                  ".round_robin.v3.RoundRobin"}}}]},
                }}}]},
        }
    path.write_text(json.dumps(doc, indent=1))
    return path


def self_signed(tmp: Path) -> tuple[str, str]:
    """A throwaway certificate for the EPP port (GIE's EPP serves a self-signed one by default)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp / "epp.crt", tmp / "epp.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=pool-epp.default", "-keyout", str(key), "-out", str(cert)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(cert), str(key)


class Gateway:
    def __init__(self, procs: list, tmp: Path, body_mode: str = "FULL_DUPLEX_STREAMED",
                 override_host: bool = False, tls: bool = False) -> None:
        self.a, self.b = Simulator(procs), Simulator(procs)  # a: labelled a100, the profile's choice
        self.port, self.health_port, admin = free_port(), free_port(), free_port()
        self.dead = f"127.0.0.1:{free_port()}" if override_host else None  # nothing listens there
        pem = self_signed(tmp) if tls else None
        self.config = epp_config(tmp / "epp.yaml", self.port, self.health_port, admin, labelled=self.a,
                                 other=self.b, dead=self.dead, tls=pem)
        self.epp = subprocess.Popen([sys.executable, "-m", "extproc", "serve", str(self.config)], cwd=REPO,
                                    stdout=subprocess.DEVNULL)
        procs.append(self.epp)
        wait_http(f"http://127.0.0.1:{admin}/metrics", 30, self.epp, "processor")
        listen, envoy_admin = free_port(), free_port()
        pool = [self.dead, self.b.id, self.a.id] if override_host else None
        boot = gateway_bootstrap(tmp / "envoy.yaml", listen, envoy_admin, self.port, body_mode, pool, tls)
        envoy = subprocess.Popen([find_envoy(), "-c", str(boot), "--disable-hot-restart", "--concurrency", "1",
                                  "-l", "warning"], stdout=subprocess.DEVNULL)
        procs.append(envoy)
        wait_http(f"http://127.0.0.1:{envoy_admin}/ready", 30, envoy, "envoy")
        self.url = f"http://127.0.0.1:{listen}"

    def counts(self) -> tuple[float, float]:
        return self.a.served(), self.b.served()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def test_envoy_in_inference_gateway_shape_sends_requests_where_the_epp_picks(tmp_path, procs):
    gw = Gateway(procs, tmp_path, tls=True)  # as kgateway: TLS to the EPP, FULL_DUPLEX_STREAMED, ORIGINAL_DST
    with httpx.Client(timeout=10) as client:
        before = gw.counts()
        for i in range(10):
            r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        assert counts_after((gw.a, gw.b), before, 10) == (10, 0)
        # streamed answers come back through FULL_DUPLEX_STREAMED response chunks, whole
        before = gw.counts()
        with client.stream("POST", f"{gw.url}/v1/completions",
                           json={"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 5
        # a model name the EPP rewrites (spec.epp.modelRewrites): the simulator only serves `m`
        r = client.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "m-alias"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "m"
        assert counts_after((gw.a, gw.b), before, 2) == (2, 0)


def test_the_subset_hint_restricts_the_candidates_and_503_when_none_is_left(tmp_path, procs):
    gw = Gateway(procs, tmp_path)
    with httpx.Client(timeout=10) as client:
        # the profile filters to the a100 endpoint; a hint naming only the other one leaves nothing
        before = gw.counts()
        r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"x-test-subset": gw.b.id})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_capacity"
        # a hint naming no endpoint of the pool: 503 as the protocol says
        r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={"x-test-subset": "10.255.0.1:1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        # sheddable (priority < 0) and nothing left: 429 with Retry-After
        r = client.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "priority": -1},
                        headers={"x-test-subset": gw.b.id})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        time.sleep(0.3)
        assert gw.counts() == before  # refused by the EPP: no simulator saw them
        # a hint that includes the preferred endpoint (comma list, as header-to-metadata writes it)
        for _ in range(4):
            r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT,
                            headers={"x-test-subset": f"{gw.b.id},{gw.a.id}"})
            assert r.status_code == 200, r.text
        assert counts_after((gw.a, gw.b), before, 4) == (4, 0)


def test_buffered_body_mode_also_picks(tmp_path, procs):
    """GIE's own example Envoy config and Envoy AI Gateway's `processing-body-mode: buffered`."""
    gw = Gateway(procs, tmp_path, body_mode="BUFFERED")
    with httpx.Client(timeout=10) as client:
        before = gw.counts()
        for _ in range(5):
            r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        r = client.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "m-alias"})
        assert r.status_code == 200 and r.json()["model"] == "m", r.text
        assert counts_after((gw.a, gw.b), before, 6) == (6, 0)


def test_grpc_health_on_the_epp_port_and_the_health_port(tmp_path, procs):
    gw = Gateway(procs, tmp_path)
    for port in (gw.port, gw.health_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                assert got == health_pb2.HealthCheckResponse.SERVING, (port, service)


def test_fallbacks_in_the_envoy_lb_metadata_are_tried_in_order(tmp_path, procs):
    """A gateway whose cluster holds the pool's endpoints and balances by override host on the
    `envoy.lb` metadata (the protocol's fallback list; ORIGINAL_DST reads one address only, so
    there the picker's `fallbacks` stays 0). The pick is an endpoint nothing listens on: Envoy's
    retry goes to the first fallback, never to the second."""
    gw = Gateway(procs, tmp_path, override_host=True)
    with httpx.Client(timeout=10) as client:
        before = gw.counts()
        for _ in range(5):
            r = client.post(f"{gw.url}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
        assert counts_after((gw.a, gw.b), before, 5) == (0, 5)
