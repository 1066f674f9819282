"""Generate the Envoy 1.40 bootstrap for an AdapterGateway snapshot (`adapterctl render-envoy`).

What the generated config does:
- one listener with the ext_proc filter and the router; processing is OFF at filter level and each
  route turns on exactly the phases its stage pipeline handles (`Pipeline.phases`, see
  `processing_mode`): a passthrough route sends only its request headers (one round trip), an llm
  route its buffered bodies with their headers (four), unknown paths none at all;
- the route's name travels to the processor as gRPC initial metadata (`x-adapter-route`), with the
  request id and the client's `x-adapter-debug` header, so the processor never re-matches paths;
- the processor picks the backend by setting `x-adapter-backend` and `x-adapter-route-target`
  with `clear_route_cache`; Envoy then matches one generated entry per (route, backend), which
  carries that route's timeout and ext_proc settings. Clients cannot pre-set these headers: an
  early header mutation removes them before route matching, and they are removed before the
  request goes upstream;
- the processor cluster lists every worker as its own endpoint (LEAST_REQUEST, gRPC health
  checks, circuit breakers raised from the default 1024 concurrent streams), one cluster per
  backend (HTTP/1.1 for `protocol: http`, HTTP/2 for `grpc`);
- backend clusters pick the endpoint the processor names (GIE endpoint-picker protocol: header
  `x-gateway-destination-endpoint`, else dynamic metadata `envoy.lb`, `ip:port[,ip:port...]`) with
  the override_host load-balancing policy, the backend's `lbPolicy` without a pick (least request
  by default); clients cannot send the header (stripped early);
- one gRPC access logger per worker sends each worker the log entries of the requests it served
  (dynamic metadata `adapter.worker`), to cluster `adapter_als_<i>` (that worker's gRPC server);
- a route with a canary rollout adds `x-adapter-variant: <rollout>/<arm>` to its responses from the
  dynamic metadata `adapter.variant` the processor sets at dispatch; with tenant budgets every route
  adds OpenAI's `x-ratelimit-*` headers from `adapter.ratelimit_*` (extproc/stages/token_budget.py);
- every route sends the config digest (`x-adapter-config-digest`) with its gRPC initial metadata,
  so a worker can tell which config Envoy routed a request by;
- `failureMode: closed` answers 503 when the processor is unreachable; `open` passes the request
  through to the route's backend unchanged;
- failure behaviour (docs/operations.md "Failure behaviour", tests/e2e/test_reliability.py): the
  ext_proc stream retries on another worker when its worker refuses it or dies before answering
  (`processor_retry_policy`), a worker failing twice in a row is ejected until a health check
  passes; every route entry that forwards retries on another host where the request never reached
  the backend, inference kinds also after a reset (`upstream_retry_policy`); backend connections
  close idle below each backend kind's keep-alive and retire after 500 requests
  (`UPSTREAM_IDLE_TIMEOUT`, `UPSTREAM_MAX_REQUESTS_PER_CONNECTION`); endpoints refusing
  connections are ejected from the balancer (not from the processor's picks: retries move those);
- `layered_runtime` only for the Envoy runtime values in `RUNTIME` (none today: why
  `ext_proc_graceful_grpc_close` is not set is written there);
- only websocket routes (`kind: websocket`, docs/websocket.md) accept upgrades (route-level
  `upgrade_configs`), with the route timeout off and the socket bounded by `websocket.idleTimeout`
  and `maxDuration`; their ext_proc sees the upgrade request's headers only;
- Envoy's own error replies (404 unknown route, 413 body too large, 503 backend down, 504) are
  JSON naming the reason and the backend; the processor's JSON errors pass through unchanged.
The pieces (listener, route configuration, clusters, load assignments) are public: `render` puts
them in one static bootstrap (`adapterctl render-envoy`), `extproc.xds` writes them as files that a
running Envoy reloads (LDS/RDS/CDS/EDS from the filesystem).
Cost: pure function of the snapshot.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from extproc.config.snapshot import (BACKEND_HEADER, DEBUG_METADATA_KEY, DESTINATION_HEADER, DIGEST_METADATA_KEY,
                                     HEALTH_ROUTE, LB_METADATA_NAMESPACE, is_ip, ROUTE_METADATA_KEY, ROUTE_TARGET_HEADER,
                                     TENANT_METADATA_KEY, VARIANT_HEADER, VARIANT_METADATA_KEY,
                                     VARIANT_METADATA_NAMESPACE, Backend, Route, Snapshot)
from extproc.attribution import TIMING_METADATA_KEY
from extproc.types import Phase

PROCESSOR_CLUSTER = "adapter_processor"
ALS_CLUSTER_PREFIX = "adapter_als_"  # + worker index: that worker's gRPC access-log service
EXT_PROC = "envoy.filters.http.ext_proc"
LISTENER_NAME = "adapter_listener"
ROUTE_CONFIG_NAME = "adapter_routes"
STAT_PREFIX = "adapter"
# The GIE endpoint-picker protocol: the processor names the endpoint (ip:port[,ip:port...], first
# the pick, then fallbacks) in DESTINATION_HEADER and in dynamic metadata envoy.lb/<the same key>;
# DIGEST_METADATA_KEY carries the config digest Envoy routes by (all defined in config/snapshot.py).
WORKER_METADATA_KEY = "worker"  # dynamic metadata adapter.worker: which worker served the request
_T = "type.googleapis.com/"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


# --- failure behaviour (docs/operations.md "Failure behaviour") ---------------------------------
# Retries where the request never reached the upstream: the connection could not be made, the
# stream was reset before any byte of the request was written, or an HTTP/2 server refused the
# stream (REFUSED_STREAM, and the streams past a GOAWAY's last id). Never `5xx` or
# `gateway-error`: an answer is passed on as it is.
NEVER_SENT_RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# Inference kinds also retry a request whose connection died before any answer (`reset`: the
# endpoint was killed with the request on it): an inference request changes nothing on the server
# but its caches and counters, so running it again elsewhere is safe; it costs the compute spent.
# The other kinds (passthrough, rest, tool: any HTTP API, POSTs that may create things) do not.
IDEMPOTENT_KINDS = frozenset({"llm", "openai", "kserve", "tensor"})
SENT_RETRY_ON = NEVER_SENT_RETRY_ON + ",reset"
UPSTREAM_RETRIES = 2  # also the bound on hosts a request that kills its server can reach (3)
# How often the balancer may pick again when it lands on a host the request already failed on:
# least request over two hosts picks the dead one (it has the fewest requests: they fail fast) 3
# times in 4, so 5 attempts left 1 retry in 4 on it; 20 leave 1 in 300 (CPU only, no connection).
HOST_SELECTION_ATTEMPTS = 20
_PREVIOUS_HOSTS = [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
    "@type": _T + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]
# Envoy closes an idle upstream connection before the backend would: a server closing an idle
# keep-alive connection races with Envoy reusing it (503 connection_termination on a request that
# never got an answer). Per backend kind, below the servers' own defaults:
#   vllm: uvicorn `timeout_keep_alive` 5 s (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
#   openai: OpenAI-API servers: our simulator (hypercorn `keep_alive_timeout` 5 s), llama.cpp
#     server (cpp-httplib keep-alive 5 s), SGLang (uvicorn 5 s);
#   onnxruntime: our server (uvicorn `timeout_keep_alive` 5 s, or hypercorn 5 s);
#   triton: KServe v2 servers: Triton (HTTP and gRPC: no idle close by default), MLServer and the
#     KServe Python server (uvicorn 5 s);
#   rest: any HTTP server: gunicorn's async workers close after 2 s (`keepalive`), Node.js 5 s.
UPSTREAM_IDLE_TIMEOUT = {"vllm": 4.0, "openai": 4.0, "onnxruntime": 4.0, "triton": 4.0, "rest": 1.5}
# Envoy retires a connection (drains it: no new streams, those in flight finish) after this many
# requests, before the backend closes it: hypercorn's `keep_alive_max_requests` (1000, HTTP/1.1
# and HTTP/2) ends an HTTP/2 connection with GOAWAY and cuts the streams still on it.
UPSTREAM_MAX_REQUESTS_PER_CONNECTION = 500


def upstream_retry_policy(route: Route) -> dict[str, Any]:
    """The retry policy of every route entry that forwards to a backend: never-sent failures, plus
    `reset` on inference kinds; always on another host (`previous_hosts`; with an endpoint pick,
    the fallbacks listed in `x-gateway-destination-endpoint` come first, then the backend's
    `lbPolicy`)."""
    return {"retry_on": SENT_RETRY_ON if route.kind in IDEMPOTENT_KINDS else NEVER_SENT_RETRY_ON,
            "num_retries": UPSTREAM_RETRIES,
            "retry_host_predicate": _PREVIOUS_HOSTS, "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
            "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.050s"}}


def processor_retry_policy() -> dict[str, Any]:
    """The ext_proc stream's retry policy (GrpcService.retry_policy, taken by the filter's Envoy
    gRPC stream, which buffers what it sent for a retry): a stream that cannot reach its worker
    (killed, restarting: connection refused) or whose worker died before answering anything opens
    on another worker with the same messages; a worker had done nothing outside itself by then. A
    stream that had an answer is not retried (Envoy cannot): it fails with its worker."""
    return {"retry_on": SENT_RETRY_ON, "num_retries": UPSTREAM_RETRIES,
            "retry_host_predicate": _PREVIOUS_HOSTS, "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
            "retry_back_off": {"base_interval": "0.002s", "max_interval": "0.020s"}}


def _outlier_detection(failures: int, ejection: float) -> dict[str, Any]:
    """Eject a host after `failures` local-origin failures in a row (connect failures, resets,
    timeouts: the host is gone), never for the answers it sends (a 503 of an overloaded engine is
    passed on, not held against it); a passing active health check lets it back at once."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": failures, "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0, "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0, "enforcing_local_origin_success_rate": 0,
        "interval": "1s", "base_ejection_time": _duration(ejection), "max_ejection_time": "30s",
        "max_ejection_percent": 50, "always_eject_one_host": True,
        "successful_active_health_check_uneject_host": True,
    }


def processing_mode(route: Route) -> dict[str, str]:
    """Exactly the phases the route's pipeline handles, plus the headers of any buffered body.

    Envoy releases headers to the router (request) or the client (response) as soon as a SKIPped
    header phase passes, so a buffered body's reply could no longer change them: re-routing,
    `:path`, content-type, or an error status. A buffered body therefore always brings its headers;
    a streamed response body (read, not reshaped) does not: one round trip less before the first byte.
    """
    phases = route.pipeline.phases if route.pipeline is not None else frozenset()
    streamed = route.pipeline.streamed if route.pipeline is not None else frozenset()

    def body(phase: Phase) -> str:
        if phase not in phases:
            return "NONE"
        return "STREAMED" if phase in streamed else "BUFFERED"

    buffered_response = Phase.RESPONSE_BODY in phases and Phase.RESPONSE_BODY not in streamed
    return {
        "request_header_mode": "SEND" if phases & {Phase.REQUEST_HEADERS, Phase.REQUEST_BODY} else "SKIP",
        # a streamed response body only reads the stream, so its headers need not wait for us
        "response_header_mode": "SEND" if Phase.RESPONSE_HEADERS in phases or buffered_response else "SKIP",
        "request_body_mode": body(Phase.REQUEST_BODY),
        "response_body_mode": body(Phase.RESPONSE_BODY),
    }


def _ext_proc_per_route(route: Route, tenant_header: str, digest: str) -> dict[str, Any]:
    return {
        EXT_PROC: {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {
                "processing_mode": processing_mode(route),
                "failure_mode_allow": route.failure_mode == "open",
                "grpc_initial_metadata": [
                    {"key": ROUTE_METADATA_KEY, "value": route.name},
                    {"key": "x-request-id", "value": "%REQ(x-request-id)%"},
                    {"key": DEBUG_METADATA_KEY, "value": "%REQ(x-adapter-debug)%"},
                    {"key": TENANT_METADATA_KEY, "value": f"%REQ({route.tenant_header or tenant_header})%"},
                    {"key": DIGEST_METADATA_KEY, "value": digest},
                ],
            },
        }
    }


def _backend_route(route: Route, backend: Backend, tenant_header: str, digest: str) -> dict[str, Any]:
    return {
        "name": f"{route.name}--{backend.name}",
        "match": {"prefix": "/", "headers": [
            {"name": ROUTE_TARGET_HEADER, "string_match": {"exact": route.name}},
            {"name": BACKEND_HEADER, "string_match": {"exact": backend.name}},
        ]},
        "route": _route_action(route, backend),
        "request_headers_to_remove": [BACKEND_HEADER, ROUTE_TARGET_HEADER],
        "typed_per_filter_config": _ext_proc_per_route(route, tenant_header, digest),
        **_variant_header(route),
    }


def _variant_header(route: Route) -> dict[str, Any]:
    """A route with a rollout names the arm on every response: `x-adapter-variant` from the dynamic
    metadata `adapter.variant` dispatch sets (so also on routes whose response the processor never
    sees); a backend's own copy is overwritten, and Envoy leaves the header out when the value is empty."""
    if route.rollout is None:
        return {}
    return {"response_headers_to_add": [{
        "header": {"key": VARIANT_HEADER,
                   "value": f"%DYNAMIC_METADATA({VARIANT_METADATA_NAMESPACE}:{VARIANT_METADATA_KEY})%"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
    }]}


def _ratelimit_headers() -> list[dict[str, Any]]:
    """With tenant budgets (`spec.tenants[].budget`), OpenAI's six `x-ratelimit-*` response headers from the
    dynamic metadata `adapter.ratelimit_*` the token-budget stage sets (extproc/stages/token_budget.py);
    Envoy leaves a header out when its value is empty (a tenant without a budget: the backend's own pass)."""
    from extproc.qos.budget import HEADER_NAMES, HEADER_PREFIX, METADATA_NAMESPACE, metadata_key

    return [{"header": {"key": HEADER_PREFIX + name,
                        "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{metadata_key(name)})%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} for name in HEADER_NAMES]


def _precision_headers() -> list[dict[str, Any]]:
    """kserve routes (the processor never sees their answers): `x-adapter-precision` and
    `x-adapter-precision-fallback` copied from the ONNX Runtime server's `x-inference-precision*`
    headers (extproc/precision.py); Envoy leaves a header out when the server sent none (Triton)."""
    from extproc.precision import FALLBACK_HEADER, PRECISION_HEADER, SERVER_FALLBACK_HEADER, SERVER_PRECISION_HEADER

    return [{"header": {"key": ours, "value": f"%RESP({theirs})%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for ours, theirs in ((PRECISION_HEADER, SERVER_PRECISION_HEADER),
                                 (FALLBACK_HEADER, SERVER_FALLBACK_HEADER))]


def _client_route(route: Route, tenant_header: str, digest: str) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": route.name,
        "match": {"prefix" if route.match == "prefix" else "path": route.path},
        "typed_per_filter_config": _ext_proc_per_route(route, tenant_header, digest),
    }
    if route.backend is None:  # answered by the processor; reached only if it is down
        entry["direct_response"] = {"status": 503, "body": {"inline_string": "the processor did not answer"}}
    else:  # failure_mode open lands here unchanged when the processor is down
        entry["route"] = _route_action(route, route.backend)
    return entry


def _route_action(route: Route, backend: Backend) -> dict[str, Any]:
    """The RouteAction to `backend`: the route's timeout and retries; a websocket route (docs/websocket.md)
    accepts upgrades (only its entries: every other route refuses them) with the route timeout off (it
    would cut a live socket), `websocket.idleTimeout` as the stream idle timeout and `maxDuration` as the
    socket's longest life."""
    action: dict[str, Any] = {"cluster": backend.cluster, "timeout": _duration(route.timeout),
                              "retry_policy": upstream_retry_policy(route)}
    ws = route.websocket
    if route.kind == "websocket" and ws is not None:
        action["timeout"] = "0s"
        action["idle_timeout"] = _duration(ws.idle_timeout)
        action["upgrade_configs"] = [{"upgrade_type": "websocket"}]
        action["max_stream_duration"] = {"max_stream_duration": _duration(ws.max_duration)}
    return action


def _local_reply_config() -> dict[str, Any]:
    """JSON bodies for Envoy's own error replies; the processor's replies (marked by dynamic
    metadata `adapter.processor_reply`) and the 404 catch-all keep their own JSON."""
    error = {
        "status": "%RESPONSE_CODE%",
        "code": "%RESPONSE_CODE_DETAILS%",
        "message": "%LOCAL_REPLY_BODY%",
        "backend": "%UPSTREAM_CLUSTER%",
        "route": "%ROUTE_NAME%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
    return {
        "mappers": [{
            "filter": {"metadata_filter": {"matcher": {
                "filter": "adapter", "path": [{"key": "processor_reply"}], "value": {"bool_match": True}},
                "match_if_key_not_found": False}},
            "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                                     "content_type": "application/json"},
        }, {
            "filter": {"status_code_filter": {"comparison": {"op": "EQ", "value": {
                "default_value": 404, "runtime_key": "adapter.local_reply.not_found"}}}},
            "body_format_override": {"json_format": {"error": {
                "status": 404, "code": "route_not_found", "message": "no route for %REQ(:PATH)%",
                "request_id": "%REQ(X-REQUEST-ID)%"}}},
        }],
        "body_format": {"json_format": {"error": error}},
    }


def _client_stripped_headers(snap: Snapshot) -> list[str]:
    """Headers only Envoy or the processor may set; removed from client requests before routing."""
    headers = [BACKEND_HEADER, ROUTE_TARGET_HEADER, DESTINATION_HEADER]
    if snap.tenancy.source == "jwt":
        headers.append(snap.tenancy.header)  # set from the verified JWT claim, never by the client
    return headers


def _jwt_filters(tenancy: Any) -> list[dict[str, Any]]:
    """jwt_authn verifying the token and copying the tenant claim into the tenancy header.

    A missing token is let through (the processor answers 401 naming what is missing, or the route
    has no tenants); an invalid token is refused by Envoy (401; 403 for a token of another audience)."""
    if tenancy.source != "jwt":
        return []
    jwt = tenancy.jwt
    provider = {
        "issuer": jwt.issuer,
        "local_jwks": {"inline_string": jwt.jwks},
        "from_headers": [{"name": jwt.header, "value_prefix": "Bearer "}],
        "claim_to_headers": [{"header_name": tenancy.header, "claim_name": jwt.claim}],
        # the verified payload as dynamic metadata, which the ext_proc filter forwards to the processor
        # on configs with a rollout keyed on a claim (envoy.filters.http.jwt_authn / jwt_payload)
        "payload_in_metadata": "jwt_payload",
    }
    if jwt.audiences:
        provider["audiences"] = list(jwt.audiences)
    return [{"name": "envoy.filters.http.jwt_authn", "typed_config": {
        "@type": _T + "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
        "providers": {"tenant": provider},
        "rules": [{"match": {"prefix": "/"}, "requires": {"requires_any": {"requirements": [
            {"provider_name": "tenant"}, {"allow_missing": {}}]}}}],
    }}]


def _http2_options(keepalive: bool = False) -> dict[str, Any]:
    h2: dict[str, Any] = {"connection_keepalive": {"interval": "30s", "timeout": "5s"}} if keepalive else {}
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": h2},
    }}


def worker_count(snap: Snapshot, workers: int | None = None) -> int:
    """`workers` if given, else the config's, else the CPU count."""
    return workers or snap.processor.workers or os.cpu_count() or 1


def processor_transport(snap: Snapshot) -> dict[str, Any]:
    """With `spec.processor.tls`: Envoy's side of mTLS to the workers (its client certificate; the
    workers' certificate checked against the CA and, with `serverName`, for that name). ALPN h2:
    gRPC servers expect it."""
    tls = snap.processor.tls
    if tls is None:
        return {}
    validation: dict[str, Any] = {"trusted_ca": {"filename": tls.ca_file}}
    if tls.server_name:
        validation["match_typed_subject_alt_names"] = [{"san_type": "DNS", "matcher": {"exact": tls.server_name}}]
    ctx: dict[str, Any] = {
        "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "tls_certificates": [{"certificate_chain": {"filename": tls.client_cert_file},
                                  "private_key": {"filename": tls.client_key_file}}],
            "validation_context": validation,
            "alpn_protocols": ["h2"],
        },
    }
    if tls.server_name:
        ctx["sni"] = tls.server_name
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": ctx}}


def processor_cluster(snap: Snapshot, workers: int) -> dict[str, Any]:
    """One endpoint per worker (each its own HTTP/2 connection), gRPC health checked."""
    address, base_port = snap.processor.address, snap.processor.base_port
    return {
        "name": PROCESSOR_CLUSTER,
        "type": "STATIC" if is_ip(address) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": _http2_options(keepalive=True),
        # One gRPC stream per in-flight HTTP request: the default 1024 would cap concurrency.
        # Retries (processor_retry_policy) only follow streams that never reached a worker, so as
        # many may run at once as streams fail when a worker dies (the default is 3).
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000, "max_retries": 100000}]},
        # a worker that refuses connections or resets streams is out at its second failure in a
        # row, before the next health check; the health check that passes lets it back
        "outlier_detection": _outlier_detection(2, 2.0),
        "health_checks": [{
            "timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
            "unhealthy_threshold": 1, "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
        }],
        "load_assignment": {"cluster_name": PROCESSOR_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(address, base_port + i)}} for i in range(workers)]}]},
        **processor_transport(snap),
    }


def als_clusters(snap: Snapshot, workers: int) -> list[dict[str, Any]]:
    """`adapter_als_<i>`: worker i alone (its gRPC server also serves the access-log service)."""
    address, base_port = snap.processor.address, snap.processor.base_port
    return [{
        "name": f"{ALS_CLUSTER_PREFIX}{i}",
        "type": "STATIC" if is_ip(address) else "STRICT_DNS",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http2_options(keepalive=True),
        "load_assignment": {"cluster_name": f"{ALS_CLUSTER_PREFIX}{i}", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(address, base_port + i)}}]}]},
        **processor_transport(snap),
    } for i in range(workers)]


# Envoy's load-balancing extension for each `backends[].lbPolicy` (the override-host fallback)
FALLBACK_POLICIES = {
    "leastRequest": ("envoy.load_balancing_policies.least_request", "least_request.v3.LeastRequest"),
    "roundRobin": ("envoy.load_balancing_policies.round_robin", "round_robin.v3.RoundRobin"),
    "random": ("envoy.load_balancing_policies.random", "random.v3.Random"),
}


def _override_host_policy(fallback: str = "leastRequest") -> dict[str, Any]:
    """Endpoint picks by the processor (GIE endpoint-picker protocol): the header, else the
    `envoy.lb` metadata, names `ip:port[,ip:port...]`; only endpoints of the cluster count, later
    entries are fallbacks; without a usable pick, the backend's `lbPolicy` (least request by default)."""
    name, typ = FALLBACK_POLICIES[fallback]
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": _T + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": DESTINATION_HEADER},
                {"metadata": {"key": LB_METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": name,
                "typed_config": {"@type": _T + "envoy.extensions.load_balancing_policies." + typ},
            }}]},
        },
    }}]}


def uses_eds(b: Backend) -> bool:
    """EDS needs IP endpoints; a backend with any host name stays STRICT_DNS with inline endpoints."""
    return all(is_ip(h) for h, _ in b.endpoints)


def load_assignment(b: Backend) -> dict[str, Any]:
    """The backend's endpoints as a ClusterLoadAssignment (inline, or the body of its EDS file)."""
    return {"cluster_name": b.cluster, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": _addr(h, p)}} for h, p in b.endpoints]}]}


def backend_cluster(b: Backend, eds_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The backend's cluster: inline endpoints, or `type: EDS` from `eds_config` (a ConfigSource)."""
    protocol = {"http2_protocol_options": {}} if b.protocol == "grpc" else {"http_protocol_options": {}}
    all_ips = all(is_ip(h) for h, _ in b.endpoints)
    cluster: dict[str, Any] = {
        "name": b.cluster,
        "type": "EDS" if eds_config is not None else ("STATIC" if all_ips else "STRICT_DNS"),
        "connect_timeout": "2s",
        "load_balancing_policy": _override_host_policy(b.lb_policy),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                # below the backend's own idle close and request limit (UPSTREAM_IDLE_TIMEOUT)
                "common_http_protocol_options": {
                    "idle_timeout": _duration(UPSTREAM_IDLE_TIMEOUT.get(b.kind, min(UPSTREAM_IDLE_TIMEOUT.values()))),
                    "max_requests_per_connection": UPSTREAM_MAX_REQUESTS_PER_CONNECTION,
                },
                "explicit_http_config": protocol,
            }
        },
        # upstream_retry_policy retries only never-sent requests; the default of 3 at once would
        # turn a dead endpoint's refused connections into 503 overflows under load
        "circuit_breakers": {"thresholds": [{"max_retries": 1024}]},
        # an endpoint that refuses connections is skipped by the lbPolicy (not by a pick: those the
        # retry policy moves on) for 5 s, longer each time it happens again
        "outlier_detection": _outlier_detection(3, 5.0),
    }
    if eds_config is not None:
        cluster["eds_cluster_config"] = {"service_name": b.cluster, "eds_config": eds_config}
    else:
        cluster["load_assignment"] = load_assignment(b)
    if b.socket_plan is not None:  # `lowLatency`: the socket options the kernel allows (extproc/socket_options.py)
        from extproc.socket_options import cluster_fields

        cluster.update(cluster_fields(b.socket_plan))
    return cluster


_is_ip = is_ip  # the old private name


def route_configuration(snap: Snapshot) -> dict[str, Any]:
    """The one RouteConfiguration: processor-chosen entries per (route, backend), then client paths
    (exact first, then prefixes longest first: the most specific route wins), then a 404 catch-all."""
    routes = list(snap.routes.values())
    tenant_header = snap.tenancy.header
    entries: list[dict[str, Any]] = []
    budgets = any(getattr(t, "budget", None) is not None for t in snap.tenants)
    for r in routes:
        for b in r.backends:
            entry = _backend_route(r, b, tenant_header, snap.digest)
            if budgets:
                entry.setdefault("response_headers_to_add", []).extend(_ratelimit_headers())
            if r.kind == "kserve":
                entry.setdefault("response_headers_to_add", []).extend(_precision_headers())
            entries.append(entry)
    ordered = sorted(routes, key=lambda r: (r.match == "prefix", -len(r.path) if r.match == "prefix" else 0))
    for r in ordered:
        entry = _client_route(r, tenant_header, snap.digest)
        if r.kind == "kserve" and "route" in entry:
            entry.setdefault("response_headers_to_add", []).extend(_precision_headers())
        entries.append(entry)
    entries.append({
        "name": "not-found",
        "match": {"prefix": "/"},
        "direct_response": {"status": 404},
        "typed_per_filter_config": {EXT_PROC: {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}},
    })
    return {"name": ROUTE_CONFIG_NAME, "virtual_hosts": [{"name": snap.name, "domains": ["*"], "routes": entries}]}


def access_loggers(workers: int, feedback: bool = True, timing: bool = False) -> list[dict[str, Any]]:
    """One gRPC access logger per worker, each filtered to the requests that worker asked for:
    `feedback`, the dynamic metadata `adapter.worker` == "<i>" (set by the first reply of a request whose
    end only the access log reports, extproc/feedback.py); `timing`, `adapter.timing` starting with "<i>."
    (a serverTiming request's token, extproc/attribution.py: Envoy's own timings for its latency share)."""
    def matcher(key: str, match: dict[str, str]) -> dict[str, Any]:
        return {"metadata_filter": {
            "matcher": {"filter": "adapter", "path": [{"key": key}], "value": {"string_match": match}},
            "match_if_key_not_found": False,
        }}

    def log_filter(i: int) -> dict[str, Any]:
        filters = ([matcher(WORKER_METADATA_KEY, {"exact": str(i)})] if feedback else []) + \
            ([matcher(TIMING_METADATA_KEY, {"prefix": f"{i}."})] if timing else [])
        return filters[0] if len(filters) == 1 else {"or_filter": {"filters": filters}}

    return [{
        "name": "envoy.access_loggers.http_grpc",
        "filter": log_filter(i),
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": f"adapter-w{i}",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": f"{ALS_CLUSTER_PREFIX}{i}"}},
                "buffer_flush_interval": "0.1s",
                "buffer_size_bytes": 65536,
            },
        },
    } for i in range(workers)]


def _metadata_options(tenancy: Any) -> dict[str, Any]:
    """What dynamic metadata the ext_proc filter takes from the processor (adapter: our own; envoy.lb: the
    endpoint pick) and, with JWT tenancy, forwards to it: jwt_authn's verified payload, for rollouts
    keyed on a claim (always with JWT tenancy, so that adding such a rollout keeps the listener as it is)."""
    out: dict[str, Any] = {"receiving_namespaces": {"untyped": ["adapter", LB_METADATA_NAMESPACE]}}
    if tenancy.source == "jwt":
        out["forwarding_namespaces"] = {"untyped": ["envoy.filters.http.jwt_authn"]}
    return out


def _client_limits(limits: Any) -> dict[str, Any]:
    """The HCM's limits on what one client may hold or send (`spec.listener.limits`, docs/limits.md):
    slow headers and bodies are cut by the header and request timeouts, idle streams and connections
    by the idle timeouts, oversized headers get 431, and one HTTP/2 connection opens at most
    `maxConcurrentStreams` streams (Envoy's default is 2^31-1)."""
    return {
        "request_headers_timeout": _duration(limits.request_headers_timeout),
        "request_timeout": _duration(limits.request_timeout),
        "stream_idle_timeout": _duration(limits.stream_idle_timeout),
        "max_request_headers_kb": limits.max_request_headers_kb,
        "common_http_protocol_options": {"idle_timeout": _duration(limits.idle_timeout),
                                         "max_headers_count": limits.max_headers_count},
        "http2_protocol_options": {"max_concurrent_streams": limits.max_concurrent_streams},
    }


def tracing(snap: Snapshot) -> dict[str, Any] | None:
    """The HCM's OpenTelemetry tracer (`spec.tracing`, docs/tracing.md), None when tracing is off.
    Envoy starts a server span per request (W3C `traceparent` from the client continues its trace),
    samples new traces at `samplingRatio`, spawns a client span for each upstream request and for
    the ext_proc stream (whose gRPC metadata then carries `traceparent`, the processor's parent),
    and exports OTLP/gRPC straight to the collector (google_grpc: no cluster to add)."""
    t = snap.spec.spec.tracing
    if t is None:
        return None
    return {
        "random_sampling": {"value": t.sampling_ratio * 100.0},
        "spawn_upstream_span": True,
        "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": _T + "envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"google_grpc": {"target_uri": t.endpoint, "stat_prefix": "otlp_tracing"},
                             "timeout": _duration(t.export_timeout)},
            "service_name": f"{t.service_name}-envoy",
        }},
    }


def http_connection_manager(snap: Snapshot, workers: int, rds: dict[str, Any] | None = None) -> dict[str, Any]:
    """The HCM: routes inline, or from RDS when `rds` (a ConfigSource) is given."""
    proc = snap.processor
    tenancy = snap.tenancy
    hcm: dict[str, Any] = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": STAT_PREFIX,
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": h} for h in _client_stripped_headers(snap)],
            },
        }],
        "local_reply_config": _local_reply_config(),
        **_client_limits(snap.listener.limits),
    }
    if rds is None:
        hcm["route_config"] = route_configuration(snap)
    else:
        hcm["rds"] = {"route_config_name": ROUTE_CONFIG_NAME, "config_source": rds}
    timing = any(r.server_timing is not None for r in snap.routes.values())
    if proc.feedback == "accessLog" or timing:  # how each request's end reaches its worker (extproc/feedback.py),
        # and Envoy's own timings of serverTiming requests (extproc/attribution.py)
        hcm["access_log"] = access_loggers(workers, feedback=proc.feedback == "accessLog", timing=timing)
    trace = tracing(snap)
    if trace is not None:
        hcm["tracing"] = trace
    hcm["http_filters"] = _jwt_filters(tenancy) + [
        {"name": EXT_PROC, "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PROCESSOR_CLUSTER},
                             "retry_policy": processor_retry_policy()},
            "failure_mode_allow": False,
            "status_on_error": {"code": 503},
            "message_timeout": _duration(proc.message_timeout),
            "max_message_timeout": "30s",
            "processing_mode": {"request_header_mode": "SKIP", "response_header_mode": "SKIP",
                                "request_body_mode": "NONE", "response_body_mode": "NONE"},
            # Only to turn a body phase off (error responses pass through untouched).
            "allow_mode_override": True,
            # Tool routes set :method (the operation's); the processor is trusted with routing headers.
            "mutation_rules": {"allow_all_routing": True},
            # adapter: our own (worker, processor_reply); envoy.lb: the endpoint pick (override_host)
            "metadata_options": _metadata_options(tenancy),
            # the endpoint that served, with the response headers (routes that read them learn their
            # request's end from the stream; the others from the access log); code details say whether
            # the answer came from the upstream ("via_upstream") or is Envoy's own (decode-response
            # sanitises only a backend's own error bodies)
            "response_attributes": ["upstream.address", "response.code", "response.code_details"],
            # latency attribution (extproc/attribution.py): Envoy's first-byte time with the request headers,
            # only when some route has serverTiming (Envoy 1.40 ignores request_attributes in per-route overrides)
            **({"request_attributes": ["request.time"]}
               if any(r.server_timing is not None for r in snap.routes.values()) else {}),
        }},
        {"name": "envoy.filters.http.router", "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.router.v3.Router"}},
    ]
    return hcm


def listener(snap: Snapshot, workers: int, rds: dict[str, Any] | None = None) -> dict[str, Any]:
    max_body = max(r.max_body_bytes for r in snap.routes.values())
    low_latency: dict[str, Any] = {}
    if snap.listener_socket_plan is not None:  # `spec.listener.lowLatency` (extproc/socket_options.py)
        from extproc.socket_options import listener_fields

        low_latency = listener_fields(snap.listener_socket_plan)
    return {
        **low_latency,
        "name": LISTENER_NAME,
        "address": _addr(snap.listener.address, snap.listener.port),
        # Envoy buffers bodies up to this (413 beyond it); each route's own smaller maxBodyBytes is
        # enforced by the processor's body-limit stage, since Envoy 1.40 applies a route's buffer
        # limit only after ext_proc has already buffered the body.
        "per_connection_buffer_limit_bytes": max(max_body, 64 * 1024),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": http_connection_manager(snap, workers, rds)}]}],
    }


# Envoy runtime values every bootstrap sets (`layered_runtime`: this static layer, then an admin layer,
# so `/runtime_modify` still works); none today, and then no `layered_runtime` is rendered (Envoy's
# defaults). Not set, on purpose: `envoy.reloadable_features.ext_proc_graceful_grpc_close` (opt-in
# since Envoy 1.34, upstream's FALSE_RUNTIME_GUARD; off in the 1.40 binary, tests/e2e/
# test_envoy_runtime.py). With it Envoy half-closes an ext_proc stream and waits (up to
# envoy.filters.http.ext_proc.remote_close_timeout_milliseconds, 1 s) for the processor's status
# instead of resetting it, which avoids grpc.aio's leak on a reset during a read (grpc/grpc#43360,
# issue 12 item 6). But a half-close does not cancel a worker that is not reading: a request waiting
# in the admission queue (extproc/qos) when its client goes away stays queued until that timer
# resets the stream, up to 1 s instead of at once, and can be admitted meanwhile (with the flag
# on, tests/e2e/test_qos_queue.py, whose disconnect case counts that request "cancelled", failed in
# 1 of 3 runs on the shared machine; its failing assertion was not captured). Rendering it needs the worker to notice Envoy's
# half-close while a stage awaits (a read ahead in extproc/stream.py); issue 12 item 6 keeps it open.
RUNTIME: dict[str, Any] = {}


def layered_runtime(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """A bootstrap's `layered_runtime`: RUNTIME (with `values` over it) as a static layer, then admin
    (perf/memprobe.py `--envoy-runtime`, tests/e2e/test_envoy_runtime.py)."""
    return {"layers": [{"name": "adapter-gateway", "static_layer": {**RUNTIME, **(values or {})}},
                       {"name": "admin", "admin_layer": {}}]}


def bootstrap_base(snap: Snapshot) -> dict[str, Any]:
    """What every bootstrap has: node, admin, the runtime values (RUNTIME, when there are any), the
    overload manager's connection limit."""
    return {
        "node": {"id": f"adapter-gateway-{snap.name}", "cluster": "adapter-gateway"},
        "admin": {"address": _addr(snap.admin.address, snap.admin.port)},
        **({"layered_runtime": layered_runtime()} if RUNTIME else {}),
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _T + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": snap.listener.limits.max_connections,
            },
        }]},
    }


def render(snap: Snapshot, workers: int | None = None) -> dict[str, Any]:
    """The static bootstrap as a dict (everything inline; a change needs an Envoy restart).
    `workers` defaults to the config's, else the CPU count. `extproc.xds` renders the same pieces
    as files Envoy reloads live."""
    n = worker_count(snap, workers)
    clusters = [processor_cluster(snap, n), *als_clusters(snap, n)]
    clusters += [backend_cluster(b) for b in snap.backends.values()]
    return {**bootstrap_base(snap), "static_resources": {"listeners": [listener(snap, n)], "clusters": clusters}}


class _EnvoyYamlDumper(yaml.SafeDumper):
    """Quotes every string Envoy's YAML reader (yaml-cpp, YAML 1.1) would take for a bool or a
    number: PyYAML leaves `n`, `y` and `1e3` plain, and Envoy then reads a route named `n` as
    `false` and rejects the config (seen on 1.40)."""


_YAML_BOOLS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    plain_is_not_a_string = value.lower() in _YAML_BOOLS
    if not plain_is_not_a_string:
        try:
            float(value.replace("_", ""))
            plain_is_not_a_string = True
        except ValueError:
            pass
    style = '"' if plain_is_not_a_string else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_EnvoyYamlDumper.add_representer(str, _represent_str)


def dump_yaml(doc: Any) -> str:
    """YAML for Envoy: key order kept, strings Envoy could misread quoted."""
    return yaml.dump(doc, Dumper=_EnvoyYamlDumper, sort_keys=False, allow_unicode=True, width=120)


def render_yaml(snap: Snapshot, workers: int | None = None) -> str:
    header = (f"# Generated by `adapterctl render-envoy` from {snap.source} ({snap.name}, digest {snap.digest}).\n"
              "# Do not edit: change the AdapterGateway file and render again.\n")
    return header + dump_yaml(render(snap, workers))


__all__ = ["render", "render_yaml", "dump_yaml", "processing_mode", "route_configuration", "listener",
           "http_connection_manager", "backend_cluster", "load_assignment", "processor_cluster", "als_clusters",
           "access_loggers", "tracing", "bootstrap_base", "layered_runtime", "RUNTIME", "worker_count", "processor_transport", "uses_eds", "is_ip", "PROCESSOR_CLUSTER",
           "ALS_CLUSTER_PREFIX", "HEALTH_ROUTE", "DESTINATION_HEADER", "LB_METADATA_NAMESPACE", "DIGEST_METADATA_KEY",
           "ROUTE_CONFIG_NAME", "LISTENER_NAME", "STAT_PREFIX", "upstream_retry_policy", "processor_retry_policy",
           "NEVER_SENT_RETRY_ON", "SENT_RETRY_ON", "IDEMPOTENT_KINDS", "UPSTREAM_IDLE_TIMEOUT",
           "UPSTREAM_MAX_REQUESTS_PER_CONNECTION", "HOST_SELECTION_ATTEMPTS"]
