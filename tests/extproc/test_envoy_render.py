"""The generated Envoy bootstrap: phases per route, routing entries, and Envoy's own validation."""

from __future__ import annotations

import glob

import pytest
import yaml

from extproc.cli import envoy_validate, main
from extproc.config.loader import load_file, load_text
from extproc.envoy_render import PROCESSOR_CLUSTER, processing_mode, render, render_yaml
from tests.conftest import BRIEF_EXAMPLE, REPO

EXT_PROC_NAME = "envoy.filters.http.ext_proc"

EXAMPLES = sorted(glob.glob(str(REPO / "examples" / "*.yaml"))) + [str(BRIEF_EXAMPLE)]


def routes_of(bootstrap):
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm, hcm["route_config"]["virtual_hosts"][0]["routes"]


def test_each_route_gets_only_the_phases_its_pipeline_uses():
    snap = load_file(REPO / "examples" / "finance-llm-adapter.yaml")
    headers_only = {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                    "request_body_mode": "NONE", "response_body_mode": "NONE"}
    assert processing_mode(snap.routes["v2"]) == headers_only  # kserve: dispatch on the path only
    assert processing_mode(snap.routes["v1-analyze"]) == {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "BUFFERED", "response_body_mode": "BUFFERED"}
    assert processing_mode(snap.routes["v1"]) == {  # openai: SSE goes through chunk by chunk
        "request_header_mode": "SEND", "response_header_mode": "SKIP",
        "request_body_mode": "BUFFERED", "response_body_mode": "STREAMED"}
    assert processing_mode(snap.routes["adapter-health"])["response_header_mode"] == "SKIP"
    passthrough = load_text(BRIEF_EXAMPLE.read_text() + "    - {path: /p, target: finance-backend}\n")
    assert processing_mode(passthrough.routes["p"]) == headers_only


def test_routing_entries_policy_and_catch_all():
    snap = load_file(REPO / "examples" / "finance-llm-adapter.yaml")
    hcm, routes = routes_of(render(snap, workers=3))
    names = [r["name"] for r in routes]
    # processor-chosen entries first, then client paths, then the 404 catch-all without ext_proc
    assert names == ["v1-analyze--finance-backend", "v1-fraud-score--ort", "v1--finance-backend", "v2--ort",
                     "v1-analyze", "v1-fraud-score", "adapter-health", "v1", "v2", "not-found"]
    # exact paths first, then prefixes longest first
    assert [r["match"].get("path") or r["match"].get("prefix") for r in routes[4:9]] == [
        "/v1/analyze", "/v1/fraud-score", "/health/adapter", "/v1/", "/v2"]
    pick = routes[0]
    assert {h["name"] for h in pick["match"]["headers"]} == {"x-adapter-backend", "x-adapter-route-target"}
    assert pick["request_headers_to_remove"] == ["x-adapter-backend", "x-adapter-route-target"]
    meta = pick["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["grpc_initial_metadata"]
    assert {"key": "x-adapter-route", "value": "v1-analyze"} in meta
    listener = render(snap, workers=3)["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 1024 * 1024  # the largest route limit
    assert routes[-1]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    removed = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": "x-adapter-backend"} in removed  # clients cannot pick a backend themselves
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False and ext_proc["message_timeout"] == "1.000s"


def test_processor_cluster_lists_each_worker_and_lifts_the_circuit_breaker():
    snap = load_file(BRIEF_EXAMPLE)
    clusters = {c["name"]: c for c in render(snap, workers=4)["static_resources"]["clusters"]}
    proc = clusters[PROCESSOR_CLUSTER]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in proc["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [50051, 50052, 50053, 50054]
    assert proc["circuit_breakers"]["thresholds"][0]["max_requests"] > 1024
    backend = clusters["finance-backend"]
    assert backend["type"] == "STRICT_DNS"  # a host name
    http = backend["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in http["explicit_http_config"]  # protocol: grpc


def test_failure_mode_open_is_per_route(write_config):
    p = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: t}
        spec:
          backends: [{name: b, endpoints: ["127.0.0.1:9"]}]
          routes:
            - {path: /open, policy: {failureMode: open}}
            - {path: /closed}
        """)
    _, routes = routes_of(render(load_file(p), workers=1))
    by_name = {r["name"]: r for r in routes}
    flag = lambda n: by_name[n]["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["failure_mode_allow"]  # noqa: E731
    assert flag("open") is True and flag("closed") is False
    assert by_name["open"]["route"]["cluster"] == "b"  # where an open route lands unchanged


@pytest.mark.parametrize("path", EXAMPLES)
def test_every_example_config_passes_envoy_validate(path, tmp_path):
    out = tmp_path / "envoy.yaml"
    out.write_text(render_yaml(load_file(path), workers=2))
    ok, output = envoy_validate(str(out))
    assert ok, output


def test_render_envoy_check_fails_when_envoy_rejects(tmp_path, monkeypatch, capsys):
    import extproc.envoy_render as er

    original = er.render

    def broken(snap, workers=None):
        doc = original(snap, workers)
        doc["static_resources"]["clusters"][0]["lb_policy"] = "NOT_A_POLICY"
        return doc

    monkeypatch.setattr(er, "render", broken)
    rc = main(["render-envoy", str(BRIEF_EXAMPLE), "-o", str(tmp_path / "e.yaml"), "--check"])
    assert rc == 1 and "REJECTED" in capsys.readouterr().err


def test_checked_in_envoy_config_is_current():
    """envoy/finance-llm-adapter.yaml is what `make render` produces from the example."""
    snap = load_file(REPO / "examples" / "finance-llm-adapter.yaml")
    checked_in = yaml.safe_load((REPO / "envoy" / "finance-llm-adapter.yaml").read_text())
    assert checked_in == render(snap, workers=2), "stale: run `make render`"


def test_backend_clusters_pick_the_endpoint_the_processor_names():
    """GIE endpoint-picker protocol: override_host reads the header, then envoy.lb metadata;
    least request without a pick. Clients cannot send the header."""
    boot = render(load_file(REPO / "examples" / "finance-llm-adapter.yaml"), workers=2)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for name in ("ort", "finance-backend"):
        c = clusters[name]
        assert "lb_policy" not in c
        policy = c["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        assert policy["name"] == "envoy.load_balancing_policies.override_host"
        assert policy["typed_config"]["override_host_sources"] == [
            {"header": "x-gateway-destination-endpoint"},
            {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}]
        fallback = policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
        assert fallback["name"] == "envoy.load_balancing_policies.least_request"
    hcm, routes = routes_of(boot)
    removed = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": "x-gateway-destination-endpoint"} in removed
    # not removed on the way upstream: the balancer reads the header after route header removal
    assert all("x-gateway-destination-endpoint" not in r.get("request_headers_to_remove", []) for r in routes)
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["adapter", "envoy.lb"]


def test_each_worker_gets_its_own_access_logger_and_cluster():
    snap = load_file(BRIEF_EXAMPLE)
    boot = render(snap, workers=3)
    hcm, _ = routes_of(boot)
    loggers = hcm["access_log"]
    assert len(loggers) == 3
    for i, logger in enumerate(loggers):
        assert logger["name"] == "envoy.access_loggers.http_grpc"
        assert logger["filter"]["metadata_filter"] == {
            "matcher": {"filter": "adapter", "path": [{"key": "worker"}], "value": {"string_match": {"exact": str(i)}}},
            "match_if_key_not_found": False}
        cfg = logger["typed_config"]
        assert cfg["common_config"] == {
            "log_name": f"adapter-w{i}", "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": f"adapter_als_{i}"}},
            "buffer_flush_interval": "0.1s", "buffer_size_bytes": 65536}
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for i in range(3):
        als = clusters[f"adapter_als_{i}"]
        [ep] = als["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert ep["endpoint"]["address"]["socket_address"]["port_value"] == snap.processor.base_port + i
        http = als["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert "http2_protocol_options" in http["explicit_http_config"]


def test_every_route_sends_the_config_digest():
    snap = load_file(REPO / "examples" / "finance-llm-adapter.yaml")
    _, routes = routes_of(render(snap, workers=2))
    with_overrides = [r for r in routes if "overrides" in r["typed_per_filter_config"][EXT_PROC_NAME]]
    assert len(with_overrides) == len(routes) - 1  # all but the 404 catch-all, which has ext_proc off
    for r in with_overrides:
        meta = r["typed_per_filter_config"][EXT_PROC_NAME]["overrides"]["grpc_initial_metadata"]
        assert {"key": "x-adapter-config-digest", "value": snap.digest} in meta
        assert {"key": "x-adapter-route", "value": r["name"].split("--")[0]} in meta


def test_yaml_quotes_what_envoy_would_read_as_a_bool_or_number(write_config, tmp_path):
    """Envoy's YAML reader takes a plain `n` for false: a route named `n` broke the bootstrap."""
    p = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: t}
        spec:
          backends: [{name: b, endpoints: ["127.0.0.1:9"]}]
          routes: [{path: /n}, {path: /y}, {path: /1e3}]
        """)
    text = render_yaml(load_file(p), workers=1)
    assert 'name: "n"' in text and 'name: "1e3"' in text
    out = tmp_path / "envoy.yaml"
    out.write_text(text)
    ok, output = envoy_validate(str(out))
    assert ok, output


def test_feedback_stream_renders_no_access_loggers(write_config):
    text = BRIEF_EXAMPLE.read_text().replace("spec:\n", "spec:\n  processor: {feedback: stream}\n", 1)
    boot = render(load_file(write_config(text)), workers=2)
    hcm, _ = routes_of(boot)
    assert "access_log" not in hcm  # nothing would read them: on_done comes from the stream alone


def test_render_envoy_xds_dir_writes_a_live_bootstrap_and_its_files(tmp_path, capsys):
    out, xds = tmp_path / "envoy.yaml", tmp_path / "xds"
    assert main(["render-envoy", str(REPO / "examples" / "inference-backends.yaml"), "--workers", "2",
                 "--xds-dir", str(xds), "-o", str(out), "--check"]) == 0
    assert "OK" in capsys.readouterr().err
    boot = yaml.safe_load(out.read_text())
    dyn = boot["dynamic_resources"]
    assert dyn["lds_config"]["path_config_source"]["path"] == str(xds / "lds.yaml")
    assert dyn["cds_config"]["path_config_source"]["path"] == str(xds / "cds.yaml")
    assert {"lds.yaml", "rds.yaml", "cds.yaml"} <= {p.name for p in xds.iterdir()}
    assert "static_resources" in boot and "listeners" not in boot["static_resources"]


def test_retries_only_where_the_request_never_reached_the_backend_except_on_inference_kinds(write_config):
    """Every entry that forwards to a backend retries on another host; connection failures,
    refused streams and resets before the request was written always, `reset` (the connection
    died with the request on it) only on inference kinds, never an answer (5xx)."""
    p = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: retries}
        spec:
          modelRef: m
          backends: [{name: b, endpoints: ["10.0.0.1:80"]}]
          routes:
            - {path: /llm, target: b, transform: '{"a": $.output.a}'}
            - {path: /p, target: b}
            - {path: /v1/, match: prefix, kind: openai, target: b}
        """)
    _, routes = routes_of(render(load_file(p), workers=1))
    forwarding = {r["name"]: r["route"]["retry_policy"] for r in routes if "cluster" in r.get("route", {})}
    assert set(forwarding) == {"llm--b", "p--b", "v1--b", "llm", "p", "v1"}
    for name, policy in forwarding.items():
        conditions = set(policy["retry_on"].split(","))
        assert {"connect-failure", "refused-stream", "reset-before-request"} <= conditions
        assert not conditions & {"5xx", "gateway-error", "retriable-status-codes"}
        assert ("reset" in conditions) == (name.split("--")[0] in ("llm", "v1")), name  # passthrough: no
        assert policy["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
        assert policy["num_retries"] == 2


def test_the_processor_stream_retries_on_another_worker_and_dead_workers_are_ejected():
    hcm, _ = routes_of(render(load_file(BRIEF_EXAMPLE), workers=2))
    grpc = hcm["http_filters"][0]["typed_config"]["grpc_service"]
    assert grpc["envoy_grpc"] == {"cluster_name": PROCESSOR_CLUSTER}
    policy = grpc["retry_policy"]
    assert set(policy["retry_on"].split(",")) == {"connect-failure", "refused-stream", "reset-before-request", "reset"}
    assert policy["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    clusters = {c["name"]: c for c in render(load_file(BRIEF_EXAMPLE), workers=2)["static_resources"]["clusters"]}
    proc = clusters[PROCESSOR_CLUSTER]
    outlier = proc["outlier_detection"]
    assert outlier["split_external_local_origin_errors"] is True
    assert outlier["consecutive_local_origin_failure"] == 2
    assert outlier["enforcing_consecutive_local_origin_failure"] == 100
    assert outlier["enforcing_consecutive_5xx"] == 0 and outlier["enforcing_consecutive_gateway_failure"] == 0
    assert proc["circuit_breakers"]["thresholds"][0]["max_retries"] >= 1024  # as many as streams can fail at once
    assert proc["health_checks"][0]["interval"] == "1s"


def test_upstream_connections_close_before_the_backends_would(write_config):
    """Idle timeout below each backend kind's keep-alive (uvicorn, hypercorn: 5 s; gunicorn: 2 s),
    and connections retired below hypercorn's 1000 requests."""
    from extproc.envoy_render import UPSTREAM_IDLE_TIMEOUT

    p = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: idle}
        spec:
          backends:
            - {name: v, kind: vllm, endpoints: ["10.0.0.1:80"]}
            - {name: o, kind: openai, protocol: grpc, endpoints: ["10.0.0.2:80"]}
            - {name: t, kind: triton, endpoints: ["10.0.0.3:80"]}
            - {name: x, kind: onnxruntime, endpoints: ["10.0.0.4:80"]}
            - {name: r, kind: rest, endpoints: ["10.0.0.5:80"]}
          routes:
            - {path: /v, target: v}
            - {path: /o, target: o}
            - {path: /t, target: t}
            - {path: /x, target: x}
            - {path: /r, target: r}
        """)
    clusters = {c["name"]: c for c in render(load_file(p), workers=1)["static_resources"]["clusters"]}
    for name, kind, server_default in (("v", "vllm", 5), ("o", "openai", 5), ("t", "triton", 5),
                                       ("x", "onnxruntime", 5), ("r", "rest", 2)):
        opts = clusters[name]["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        common = opts["common_http_protocol_options"]
        assert float(common["idle_timeout"].rstrip("s")) == UPSTREAM_IDLE_TIMEOUT[kind] < server_default
        assert common["max_requests_per_connection"] < 1000
        assert clusters[name]["outlier_detection"]["enforcing_consecutive_5xx"] == 0  # answers never eject
        assert clusters[name]["circuit_breakers"]["thresholds"][0]["max_retries"] > 3
