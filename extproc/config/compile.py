"""Turn a schema-valid `AdapterGateway` into a runtime `Snapshot`: defaults, references, templates.

What: resolves route targets (declared backend names, or `host:port` which defines an implicit
backend named after the host), applies documented defaults (model from `modelRef`, protocol from
`spec.protocol`, health path per backend kind), compiles request/response templates, derives the
JSON Schema asked of the model from the transform's paths, builds each route's stage pipeline,
and checks cross-references (duplicates, dangling targets, port clashes). Adapter bundles
(`spec.bundles` and those loaded at run time): each ZIP verified (canary/bundle.py), its bundle.yaml
compiled; a route takes the part of its bundle (`bundle:`, else the active bundle naming it:
`apply_bundle_part`, plugin parameters as instances of its own: `_bundle_scheduler`), a rollout's
bundle arms become `Route.variants`. All problems are collected and raised together as one
`ConfigError`.
Why: everything that can be wrong is found at load time, never on a request.
Cost: milliseconds; once per load (plus a SHA256 pass over each bundle ZIP, twice for loaded ones).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from backends import adapter_kinds
from backends.dialects import DialectConfig
from extproc.config.loader import ConfigError, Issue
from extproc.config.schema import AdapterGateway, split_host_port
from extproc.config.snapshot import (HEALTH_PATH, HEALTH_ROUTE, Backend, BundlePart, EndpointMeta, EppConfig, PluginRef,
                                     ProfileRef, RolloutRef, Route, Snapshot)
from extproc.kinds import kind_specs
from extproc.config.yamlsource import SourceMap, format_path
from extproc.template import WILDCARD, TemplateError, compile_template


def model_name(model_ref: str | None) -> str | None:
    """`"qwen2.5-finance@registry.internal"` -> `"qwen2.5-finance"` (the registry is provenance)."""
    if not model_ref:
        return None
    return model_ref.split("@", 1)[0] or None


def route_name_from_path(path: str) -> str:
    name = "".join(c if c.isalnum() else "-" for c in path.strip("/").lower())
    name = "-".join(p for p in name.split("-") if p)
    return name[:63].strip("-") or "root"


def compile_snapshot(gw: AdapterGateway, smap: SourceMap, generation: int = 1, digest: str = "",
                     resolve: Callable[[str], Path] | None = None, loaded: tuple[str, ...] = ()) -> Snapshot:
    """`resolve(name)` says where a file the config names (`openapi`, `mapping`, a bundle) is read from;
    default: relative to the config file (a config bundle passes its own copies). `loaded`: adapter
    bundle ZIPs loaded at run time, oldest first (names for `resolve`)."""
    from extproc.attribution import pipeline_builder as timed_pipeline
    from extproc.stages import build_pipeline

    issues = _Issues(smap, resolve)
    issue = issues.add
    spec = gw.spec
    kinds = adapter_kinds()

    sockets = _SocketPlanner(spec)  # `lowLatency`: what the kernel allows (extproc/socket_options.py)
    backends: dict[str, Backend] = {}
    for i, b in enumerate(spec.backends):
        if b.name in backends:
            issue(("spec", "backends", i, "name"), f"duplicate backend name {b.name!r}")
            continue
        adapter = kinds[b.kind]()
        protocol = b.protocol or spec.protocol
        default_health = adapter.default_health_path
        if adapter.api == "kserve" and protocol == "grpc":
            default_health = "/inference.GRPCInferenceService/ServerReady"
        seen_eps: set[str] = set()
        for j, e in enumerate(b.endpoints):
            if e.address in seen_eps:
                issue(("spec", "backends", i, "endpoints", j), f"duplicate endpoint {e.address!r}")
            seen_eps.add(e.address)
        dialect = None
        if b.dialect is not None:
            if b.kind not in ("openai", "vllm"):
                issue(("spec", "backends", i, "dialect"), f"applies to backends of kind openai or vllm, not {b.kind}")
            d = b.dialect
            dialect = DialectConfig(d.negotiate, d.preset, d.structured_output, d.stream_usage, d.priority, d.lora)
        backends[b.name] = Backend(
            name=b.name, kind=b.kind, protocol=protocol,
            endpoints=tuple(split_host_port(e.address) for e in b.endpoints), models=b.models,
            health_path=b.health_path or default_health, timeout=b.timeout,
            implicit=False, adapter=adapter, lb_policy=b.lb_policy, dialect=dialect,
            socket_plan=sockets.plan(b.low_latency, "upstream", f"backend {b.name}"),
            endpoint_meta=tuple(EndpointMeta(tuple(sorted(e.labels.items())), e.engine, e.metrics_path)
                                for e in b.endpoints),
        )

    bundles, active = _compile_bundles(spec.bundles, loaded, issues)
    armed = {n for ro in spec.rollouts if any(a.bundle for a in ro.arms)
             for n in ((ro.route,) if ro.route else ro.routes)}  # routes whose bundles are their rollout's arms
    plugins = _compile_plugins(spec.plugins, issue)
    profiles, refused = _compile_profiles(spec.scheduling_profiles, plugins, issue)
    qos = _compile_qos(spec, backends, issue)  # spec.qos: None without it (no QoS stage on any route)
    if qos is not None:  # every inference route's pipeline gets the QoS stages (docs/qos.md)
        from functools import partial

        from extproc.qos.queue import compile_admission

        admission = compile_admission(spec.qos, backends, spec.processor.message_timeout, qos, issue)
        build_pipeline = partial(build_pipeline, qos=qos, admission=admission)
    default_model = model_name(spec.model_ref)
    brokers = _compile_brokers(spec.brokers, issue)  # MQTT brokers of iot routes (extproc/iot/)
    routes: dict[str, Route] = {}
    paths: dict[tuple[str, str], int] = {}
    for i, r in enumerate(spec.routes):
        base = ("spec", "routes", i)
        name = r.name or route_name_from_path(r.path)
        if name in routes or name == HEALTH_ROUTE:
            issue(base + ("name",), f"duplicate route name {name!r} (set a distinct `name`)")
            continue
        key = (r.path, r.match)
        if key in paths or r.path == HEALTH_PATH:
            other = f"routes[{paths[key]}]" if key in paths else "the built-in health route"
            issue(base + ("path",), f"path {r.path!r} is already used by {other}")
            continue
        paths[key] = i
        kind = r.kind or ("llm" if (r.request or r.transform) else "passthrough")
        ks = kind_specs()[kind]
        if r.target and r.targets:
            issue(base + ("targets",), "set target or targets, not both")
            continue
        if not ks.needs_target and r.targets:
            issue(base + ("targets",), f"a {kind} route has at most one target (the model of its optional LLM step)")
            continue
        targets = (r.targets or (r.target,)) if (ks.needs_target or r.target) else ()
        resolved = [_resolve_target(t, base + (("targets", j) if r.targets else ("target",)), backends,
                                    spec.protocol, kinds, issue, r.policy.timeout)
                    for j, t in enumerate(targets)]
        if any(b is None for b in resolved):
            continue
        backend = resolved[0] if resolved else None
        iot = None
        if kind == "iot":
            from extproc.iot.commands import compile_iot

            iot, problems = compile_iot(r.iot, brokers, spec.processor.message_timeout)
            for where, why in problems:
                issue(base + ("iot",) + where, why)
            if iot is None:
                continue
            if backend is not None and backend.adapter.api != "openai":  # the LLM step asks a chat model
                issue(base + ("target",), f"the LLM step of an iot route needs an openai backend; {backend.name} "
                      f"speaks {backend.adapter.api}")
                continue
        elif r.iot is not None:
            issue(base + ("iot",), "only iot routes (kind: iot) have an iot block")
            continue
        websocket = None
        if kind == "websocket":
            from extproc.config.schema import WebSocketSpec

            websocket = r.websocket or WebSocketSpec()
            if "timeout" in r.policy.model_fields_set:
                issue(base + ("policy", "timeout"), "a websocket route's sockets are bounded by websocket.idleTimeout "
                      "and websocket.maxDuration, not policy.timeout")
                continue
        elif r.websocket is not None:
            issue(base + ("websocket",), "only websocket routes (kind: websocket) have a websocket block")
            continue
        if not ks.templates and (r.request or r.transform or r.output_schema):
            issue(base + ("kind",), f"a {kind} route forwards bodies as they are: request, transform and "
                  "outputSchema need kind: llm or tensor")
            continue
        wrong = [b.name for b in resolved if ks.api and b.adapter.api != ks.api]
        if wrong:
            issue(base + ("kind",), f"a {kind} route needs {ks.api} backends; {', '.join(wrong)} "
                  f"speak{'s' if len(wrong) == 1 else ''} another API (see backends[].kind)")
            continue
        tools = mapping = None
        if ks.openapi:
            tools = _load_tools(r.openapi, base, issues)
            if tools is None:
                continue
        elif r.openapi:
            issue(base + ("openapi",), "only tool routes read an OpenAPI document")
            continue
        if r.mapping:
            if not ks.mapping:
                issue(base + ("mapping",), "only rest routes apply a field-mapping file")
                continue
            mapping = _load_mapping(r.mapping, base, issues)
            if mapping is None:
                continue
        sql = None
        if ks.sql:
            sql = _load_sql(r, base, issues, spec.processor.message_timeout)
            if sql is None:
                continue
        elif r.sql is not None:
            issue(base + ("sql",), "only sql routes (kind: sql) have a sql block")
            continue
        erp = None
        if ks.erp:
            erp = _load_erp(r, base, issues, spec.processor.message_timeout)
            if erp is None:
                continue
        elif r.erp is not None:
            issue(base + ("erp",), "only erp routes (kind: erp) have an erp block")
            continue
        if not ks.multi_target and len(resolved) > 1:
            issue(base + ("targets",), f"a {kind} route has one target")
            continue
        if r.match == "prefix" and not ks.prefix:
            issue(base + ("match",), f"a {kind} route maps one endpoint: use match: exact")
            continue
        model = r.model or default_model or (backend.models[0] if backend is not None and backend.models else None)
        if ks.needs_model and model is None:
            issue(base + ("model",), f"an {kind} route needs a model: set route.model, spec.modelRef or the "
                  "backend's models")
            continue
        picker = _route_plugins(r.plugins, base, plugins, profiles, refused, resolved, issue)
        if picker is False:
            continue
        request = _compile(r.request, base + ("request",), issues)
        transform = _compile(r.transform, base + ("transform",), issues)
        if (r.request and request is None) or (r.transform and transform is None):
            continue
        schema = r.output_schema
        if schema is not None and schema.get("type", "object") != "object":
            issue(base + ("outputSchema",), "must be a JSON Schema of type object")
            continue
        if schema is None and transform is not None:
            schema = derive_output_schema(transform)
        if iot is not None and backend is not None:  # the LLM step: the model answers with a command
            schema = iot.command_schema
        route = Route(
            name=name, path=r.path, kind=kind, backend=backend, model=model, request=request,
            transform=transform, response_schema=schema, failure_mode=r.policy.failure_mode,
            max_body_bytes=r.policy.max_body_bytes, match=r.match,
            # a websocket route's request lasts as long as its socket (lifecycle waits that long for its end)
            timeout=websocket.max_duration if websocket is not None else r.policy.timeout,
            tenant_header=r.policy.tenant_header, tools=tools, mapping=mapping, sql=sql, erp=erp,
            backends=tuple(dict.fromkeys(resolved)), dialect=ks.dialect, picker=picker,
            structured_fallback=r.policy.structured_fallback,
            server_timing=r.server_timing, iot=iot, websocket=websocket,
        )
        if r.server_timing is not None:
            from extproc.attribution import check_route

            timing_problems = check_route(r.server_timing, kind, kind not in ("passthrough", "kserve", "websocket"),
                                          {t.id for t in spec.tenants})
            for where, why in timing_problems:
                issue(base + where, why)
            if timing_problems:
                continue
        ref = _route_bundle(r.bundle, name, base, bundles, {} if name in armed and r.bundle is None else active,
                            issue)
        if ref is False:
            continue
        if ref is not None:
            if not ks.templates:
                issue(base + ("bundle",), f"a {kind} route forwards bodies as they are: a bundle's templates need "
                      "kind: llm or tensor")
                continue
            route = apply_bundle_part(route, bundles[ref])
            if bundles[ref].parts[name].plugins:
                sched = _bundle_scheduler(route, bundles[ref], plugins, profiles, base + ("bundle",), issue)
                if sched is False:
                    continue
                route = replace(route, picker=sched)
        routes[name] = _with_pipeline(route, timed_pipeline(build_pipeline), base, issue)

    arm_bundles: dict[str, dict[str, str]] = {}  # rollout -> arm -> bundle ref
    rollouts = _compile_rollouts(spec.rollouts, routes, {i: r.name or route_name_from_path(r.path)
                                                         for i, r in enumerate(spec.routes)}, issue,
                                 bundles, arm_bundles, jwt=spec.tenancy.source == "jwt")
    for ref in rollouts.values():
        for name in ref.routes:
            rt = routes[name]
            variants = {arm: apply_bundle_part(rt, bundles[b]) for arm, b in arm_bundles.get(ref.name, {}).items()}
            routes[name] = replace(rt, rollout=ref, variants=MappingProxyType(variants))

    health = Route(
        name=HEALTH_ROUTE, path=HEALTH_PATH, kind="health", backend=None, model=None, request=None,
        transform=None, response_schema=None, failure_mode="closed", max_body_bytes=4096, timeout=5.0,
    )
    routes[HEALTH_ROUTE] = _with_pipeline(health, build_pipeline, ("spec",), issue)

    tenant_ids: set[str] = set()
    for i, t in enumerate(spec.tenants):
        if t.id in tenant_ids:
            issue(("spec", "tenants", i, "id"), f"duplicate tenant id {t.id!r}")
        tenant_ids.add(t.id)

    tenancy = spec.tenancy
    if (tenancy.source == "jwt") != (tenancy.jwt is not None):
        issue(("spec", "tenancy", "jwt"), "source: jwt needs a jwt block, and a jwt block needs source: jwt")
    for i, r in enumerate(spec.routes):
        if tenancy.source == "jwt" and r.policy.tenant_header == tenancy.header:
            issue(("spec", "routes", i, "policy", "tenantHeader"),
                  f"{tenancy.header} is set by Envoy from the JWT claim (clients' copies are removed); "
                  "a route can only trust another header")
    epp = _compile_epp(spec.epp, backends, plugins, profiles, refused, issue) if spec.epp is not None else None
    _check_ports(gw, issue)
    _check_processor_tls(gw, issue)
    if issues.found:
        raise ConfigError(issues.found)
    return Snapshot(
        generation=generation, digest=digest, source=smap.filename, spec=gw, model_ref=spec.model_ref,
        listener=spec.listener, admin=spec.admin, processor=spec.processor, backends=backends,
        routes=routes, tenants=spec.tenants, tenancy=spec.tenancy, plugins=plugins, profiles=profiles, epp=epp,
        rollouts=rollouts, bundles=bundles, active_bundles=active,
        listener_socket_plan=sockets.plan(spec.listener.low_latency, "listener", "the listener"),
    )


class _SocketPlanner:
    """Probes the kernel once per compile, only when some `lowLatency` asks; logs each option left out."""

    def __init__(self, spec: Any) -> None:
        from extproc.socket_options import KernelSupport

        wanted = spec.listener.low_latency is not None or any(b.low_latency is not None for b in spec.backends)
        self.support = KernelSupport.probe() if wanted else None

    def plan(self, ll: Any, where: str, label: str) -> Any:
        if ll is None or self.support is None:
            return None
        import logging

        from extproc.socket_options import LowLatency, plan

        p = plan(LowLatency(ll.tcp_no_delay, ll.busy_poll_us, ll.tcp_fast_open), self.support, where)
        for option, reason in p.skipped:
            logging.getLogger(__name__).warning("lowLatency of %s: %s left out: %s", label, option, reason)
        return p


def _compile_rollouts(specs: Any, routes: dict[str, Route], declared: dict[int, str], issue: Any,
                      bundles: Mapping[str, Any] | None = None,
                      arm_bundles: dict[str, dict[str, str]] | None = None,
                      jwt: bool = False) -> dict[str, RolloutRef]:
    """`spec.rollouts`: each names its routes (declared and accepted), its arms (the first is the
    baseline; every arm's backend a target of each route; weights in percent, canaries adding up to
    at most 100, the baseline the rest) and its key policy (header sources only from trusted headers,
    as `canary.assign.KeyPolicy.untrusted()` finds them; JWT claims only with `spec.tenancy.source: jwt`,
    whose jwt_authn verifies the token and forwards its payload to the processor). A route has at most
    one rollout. Refused rollouts are left out, reported."""
    from canary.assign import (BUCKETS, Arm, JwtClaim, KeyPolicy, Rollout, RolloutError, TenantKey, TrustedHeader,
                               untrusted_reason)

    out: dict[str, RolloutRef] = {}
    owner: dict[str, str] = {}  # route -> the rollout that splits it
    known = set(declared.values())
    names: set[str] = set()
    for i, ro in enumerate(specs):
        base = ("spec", "rollouts", i)
        if ro.name in names:
            issue(base + ("name",), f"duplicate rollout name {ro.name!r}")
            continue
        names.add(ro.name)
        ok = True
        if ro.route is not None and ro.routes:
            issue(base + ("routes",), "set route or routes, not both")
            continue
        named = [(base + ("route",), ro.route)] if ro.route is not None else \
            [(base + ("routes", j), n) for j, n in enumerate(ro.routes)]
        if not named:
            issue(base + ("route",), "required: the route (or routes: [...]) this rollout splits")
            continue
        targets: list[Route] = []
        for path, name in named:
            route = routes.get(name)
            if route is None:
                if name not in known:  # a declared route that was refused has its own errors
                    issue(path, f"no route named {name!r} (routes: {', '.join(r for r in declared.values()) or 'none'})")
                ok = False
                continue
            if name in owner:
                issue(path, f"route {name!r} already has rollout {owner[name]!r}; a route has one rollout")
                ok = False
                continue
            if any(t.name == name for t in targets):
                issue(path, f"route {name!r} is listed twice")
                ok = False
                continue
            targets.append(route)
            owner[name] = ro.name  # claimed even if this rollout is refused: one rollout per route
        seen: dict[str, int] = {}
        canaries: list[Arm] = []
        backends: dict[str, str] = {}
        arm_endpoints: dict[str, tuple[str, ...]] = {}
        for j, arm in enumerate(ro.arms):
            where = base + ("arms", j)
            if arm.name in seen:
                issue(where + ("name",), f"arm {arm.name!r} is already arms[{seen[arm.name]}]; arm names are unique")
                ok = False
                continue
            seen[arm.name] = j
            backend = arm.backend
            if arm.bundle is not None:  # a bundle arm: the routes' own backend, that bundle's templates
                b = (bundles or {}).get(arm.bundle)
                if b is None:
                    issue(where + ("bundle",), f"no adapter bundle {arm.bundle!r} (bundles: "
                          f"{', '.join(sorted(bundles or {})) or 'none'}; spec.bundles, or adapterctl bundle load)")
                    ok = False
                    continue
                tuned = [t.name for t in targets if t.name in b.parts and b.parts[t.name].plugins]
                if tuned:
                    issue(where + ("bundle",), f"bundle {arm.bundle!r} sets plugin parameters for route(s) "
                          f"{', '.join(tuned)}: a bundle arm cannot (the route's scheduler picks the endpoint in the "
                          "dispatch that picks the arm); make it the route's bundle instead")
                    ok = False
                    continue
                missing = [t.name for t in targets if t.name not in b.parts]
                if missing:
                    issue(where + ("bundle",), f"bundle {arm.bundle!r} has no part for route(s) {', '.join(missing)} "
                          f"(its bundle.yaml names {', '.join(b.parts)})")
                    ok = False
                    continue
                firsts = sorted({t.backend.name for t in targets if t.backend is not None})
                if len(firsts) > 1:
                    issue(where + ("bundle",), f"a bundle arm is served by its routes' first target, and these routes "
                          f"have different ones ({', '.join(firsts)}): split the rollout per backend")
                    ok = False
                    continue
                backend = firsts[0] if firsts else ""
                if arm_bundles is not None:
                    arm_bundles.setdefault(ro.name, {})[arm.name] = arm.bundle
            for route in targets:
                served = [b.name for b in route.backends]
                if backend not in served:
                    issue(where + ("backend",), f"backend {backend!r} is not a target of route {route.name!r} "
                          f"(targets: {', '.join(served)})")
                    ok = False
            backends[arm.name] = backend
            if arm.endpoints is not None:
                chosen = _arm_endpoints(arm, backend, targets, where, issue)
                if chosen is None:
                    ok = False
                else:
                    arm_endpoints[arm.name] = chosen
            if j == 0:
                continue
            if arm.weight is None:
                issue(where + ("weight",), "a canary arm needs a weight in percent (0 keeps it dark; only the "
                      "baseline, the first arm, defaults to the rest)")
                ok = False
                continue
            canaries.append(Arm(arm.name, round(arm.weight * 100)))
        total = sum(a.weight for a in canaries)
        if total > BUCKETS:
            issue(base + ("arms",), f"the canary weights add up to {total / 100:g} %, more than 100")
            ok = False
        baseline = ro.arms[0]
        if baseline.weight is not None and total <= BUCKETS and round(baseline.weight * 100) != BUCKETS - total:
            issue(base + ("arms", 0, "weight"), f"the baseline (the first arm) gets what the canaries leave, "
                  f"{(BUCKETS - total) / 100:g} %, not {baseline.weight:g} %: leave its weight out or make it match")
            ok = False
        key = ro.key
        sources: list[Any] = []
        source_at: list[int] = []  # each compiled source's index in key.sources
        for k, src in enumerate(key.sources):
            where = base + ("key", "sources", k)
            if src.claim is not None:
                if not jwt:
                    issue(where + ("claim",), "a JWT claim is a key only where Envoy verifies the token: set "
                          "spec.tenancy.source: jwt (its jwt_authn forwards the verified payload to the "
                          "processor), or key on a trusted header or {tenant: true}")
                    ok = False
                    continue
                try:
                    sources.append(JwtClaim(src.claim))
                except RolloutError as e:
                    issue(where + ("claim",), e.reason)
                    ok = False
                    continue
            else:
                sources.append(TrustedHeader(src.header) if src.header is not None else TenantKey())
            source_at.append(k)
        force = TrustedHeader(key.force.header) if key.force is not None else None
        if force is not None and force.header not in key.trusted_headers:
            issue(base + ("key", "force", "header"), f"header {force.header!r} is not in key.trustedHeaders: a client "
                  "could choose it, so it would never be honoured (list it there, or leave force out)")
            ok = False
        policy = KeyPolicy(tuple(sources), frozenset(key.trusted_headers), force=force)
        for i in policy.untrusted():
            issue(base + ("key", "sources", source_at[i], "header"),
                  untrusted_reason(sources[i].header, "key.trustedHeaders"))
            ok = False
        if not ok:
            continue
        try:
            rollout = Rollout(ro.name, canaries=tuple(canaries), baseline=baseline.name, salt=ro.salt)
        except RolloutError as e:  # every case is checked above; this names what slipped through
            issue(base, str(e))
            continue
        headers = tuple(dict.fromkeys([s.header for s in sources if isinstance(s, TrustedHeader)]
                                      + ([force.header] if force is not None else [])))
        control = None
        if ro.plan is not None:
            control = _compile_plan(ro.plan, rollout, base + ("plan",), issue)
            if control is None:
                continue
        out[ro.name] = RolloutRef(ro.name, rollout, policy, MappingProxyType(backends), headers,
                                  tuple(t.name for t in targets), control, MappingProxyType(arm_endpoints))
    return out


def _arm_endpoints(arm: Any, backend: str, targets: list[Route], where: tuple, issue: Any) -> tuple[str, ...] | None:
    """An endpoint arm's endpoints: its backend's whose labels match `endpoints.matchLabels`; None (and
    an issue) when none do, or when the backend's endpoints are host names (the processor names the
    endpoint it sends to, and Envoy only takes IPs it knows: the endpoint-picker protocol)."""
    b = next((b for t in targets for b in t.backends if b.name == backend), None)
    if b is None:
        return None  # reported above: not a target of its routes
    if not b.pickable:
        issue(where + ("endpoints",), f"backend {backend!r} has host-name endpoints; an endpoint arm needs IP "
              "endpoints (the processor names the one to use, which Envoy takes only as an IP)")
        return None
    want = arm.endpoints.match_labels
    chosen = tuple(e for e in b.endpoint_ids
                   if all((b.endpoint_labels.get(e) or {}).get(k) == v for k, v in want.items()))
    if not chosen:
        labels = {e: dict(b.endpoint_labels.get(e) or {}) for e in b.endpoint_ids}
        issue(where + ("endpoints", "matchLabels"), f"no endpoint of backend {backend!r} has labels {want} "
              f"(its endpoints' labels: {labels})")
        return None
    return chosen


def _compile_bundles(specs: Any, loaded: tuple[str, ...], issues: "_Issues") -> tuple[dict[str, Any], dict[str, str]]:
    """`spec.bundles` and the bundles loaded at run time: each ZIP verified (`canary.bundle.load`, with
    the entry's publicKey / requireSignature; a loaded bundle with those of the `spec.bundles` entry of
    its name, which must exist), its bundle.yaml compiled (templates, schemas). Returns the bundles by
    "<name>@<version>" and the active version per name: the last loaded, else the last declared."""
    from canary.bundle import BundleError, adapter_contents, load

    issue = issues.add
    out: dict[str, Any] = {}
    active: dict[str, str] = {}
    policy: dict[str, Any] = {}  # name -> the entry whose publicKey / requireSignature applies

    def one(path_name: str, where: tuple, entry: Any, is_loaded: bool) -> Any:
        from extproc.config.snapshot import AdapterBundle

        key = _relative(issues, entry.public_key) if entry is not None and entry.public_key else None
        try:
            b = load(_relative(issues, path_name), public_key=key,
                     require_signature=bool(entry is not None and entry.require_signature))
            contents = adapter_contents(b)
        except BundleError as e:
            for p in e.problems:
                issue(where, f"bundle {path_name}: {p}")
            return None
        parts: dict[str, Any] = {}
        ok = True
        for route, part in contents.routes.items():
            compiled: dict[str, Any] = {}
            for f in ("request", "transform"):
                text = getattr(part, f)
                if text is None:
                    continue
                try:
                    compiled[f] = compile_template(text)
                except TemplateError as e:
                    file, first = part.where.get(f, ("bundle.yaml", 1))
                    issue(where, f"bundle {path_name}: {file}:{first + e.line - 1}: routes.{route}.{f}: template error "
                          f"at line {e.line}, column {e.column}: {e.message}")
                    ok = False
            if part.output_schema is not None and part.output_schema.get("type", "object") != "object":
                issue(where, f"bundle {path_name}: bundle.yaml: routes.{route}.outputSchema: must be a JSON Schema "
                      "of type object")
                ok = False
            parts[route] = BundlePart(compiled.get("request"), compiled.get("transform"),
                                      MappingProxyType(dict(part.output_schema)) if part.output_schema else None,
                                      MappingProxyType({n: MappingProxyType(dict(v)) for n, v in part.plugins.items()}))
        if not ok:
            return None
        m = b.manifest
        return AdapterBundle(m.name, m.version, b.digest, path_name, b.signed, is_loaded, MappingProxyType(parts),
                             len(contents.golden))

    for i, e in enumerate(specs):
        base = ("spec", "bundles", i)
        if e.path is None:
            if e.name in policy:
                issue(base + ("name",), f"bundle {e.name!r} is already declared")
                continue
            policy[e.name] = e
            continue
        b = one(e.path, base + ("path",), e, False)
        if b is None:
            continue
        if e.name is not None and e.name != b.name:
            issue(base + ("name",), f"the bundle at {e.path} is named {b.name!r} in its manifest, not {e.name!r}")
            continue
        if b.ref in out:
            issue(base + ("path",), f"bundle {b.ref} is already declared (from {out[b.ref].source})")
            continue
        prior = policy.get(b.name)
        if prior is not None and (prior.public_key, prior.require_signature) != (e.public_key, e.require_signature):
            issue(base + ("publicKey",), f"bundle {b.name!r} is declared with another publicKey / requireSignature; "
                  "every entry of one name has the same")
            continue
        policy.setdefault(b.name, e)
        out[b.ref] = b
        active[b.name] = b.ref
    for path_name in loaded:
        # a bundle loaded at run time: the manifest's name picks its policy (read first, unchecked)
        try:
            name = load(_relative(issues, path_name)).manifest.name
        except BundleError as e:
            issue(("spec", "bundles"), f"loaded bundle {path_name}: {e.problems[0]}")
            continue
        entry = policy.get(name)
        if entry is None:
            issue(("spec", "bundles"), f"loaded bundle {path_name} is named {name!r}, which spec.bundles does not "
                  f"declare (add {{name: {name}}}, with publicKey to require its signature; or drop it from "
                  f"bundles/loaded.json in the state directory)")
            continue
        b = one(path_name, ("spec", "bundles"), entry, True)
        if b is None:
            continue
        out[b.ref] = b  # a version loaded again replaces the older copy
        active[b.name] = b.ref
    return out, active


def _route_bundle(ref: str | None, route: str, base: tuple, bundles: Mapping[str, Any], active: Mapping[str, str],
                  issue: Any) -> str | None | bool:
    """The bundle a route uses: `bundle: NAME@VERSION` (that one), `bundle: NAME` (its active version), or
    no `bundle:` (the active bundle whose bundle.yaml names the route, if one does). False: reported."""
    if ref is None:
        claiming = sorted(r for r in active.values() if route in bundles[r].parts)
        if len(claiming) > 1:
            issue(base, f"bundles {', '.join(claiming)} all name route {route!r}: set `bundle:` on the route")
            return False
        return claiming[0] if claiming else None
    name, _, version = ref.partition("@")
    chosen = ref if version else active.get(name)
    if chosen is None or chosen not in bundles:
        issue(base + ("bundle",), f"no adapter bundle {ref!r} (bundles: {', '.join(sorted(bundles)) or 'none'}; "
              "spec.bundles, or adapterctl bundle load)")
        return False
    if route not in bundles[chosen].parts:
        issue(base + ("bundle",), f"bundle {chosen!r} has no part for route {route!r} (its bundle.yaml names "
              f"{', '.join(bundles[chosen].parts)})")
        return False
    return chosen


def _bundle_scheduler(route: Route, bundle: Any, plugins: dict[str, PluginRef], profiles: dict[str, ProfileRef],
                      where: tuple, issue: Any) -> Any:
    """The route's scheduler with the bundle's plugin parameters: each named plugin (one the route's
    picker or profile uses) becomes its own instance `<plugin>@<bundle ref>` with the declared parameters
    and the bundle's merged over them, validated against its type; a profile using one becomes
    `<profile>@<bundle ref>` (registered in `profiles`, a standalone picker in `plugins`, so every worker
    keeps one instance of each). False, reported, when refused."""
    from pydantic import ValidationError

    from extproc.scheduling import plugin_types

    overrides = bundle.parts[route.name].plugins
    sched = route.picker
    refs = sched.refs if isinstance(sched, ProfileRef) else ((sched,) if sched is not None else ())
    used = {r.name: r for r in refs}
    prefix = f"bundle {bundle.source}: bundle.yaml: routes.{route.name}.plugins"
    ok = True
    tuned: dict[str, PluginRef] = {}
    for name, params in overrides.items():
        ref = used.get(name)
        if ref is None:
            issue(where, f"{prefix}.{name}: the route's scheduler uses no plugin {name!r} (it uses: "
                  f"{', '.join(used) or 'none: the route names no plugin'})")
            ok = False
            continue
        cls = plugin_types()[ref.type]
        merged = {**ref.params.model_dump(by_alias=True, exclude_unset=True), **params}
        try:
            tuned[name] = PluginRef(f"{name}@{bundle.ref}", ref.type, ref.slot, cls.Parameters.model_validate(merged))
        except ValidationError as e:
            for err in e.errors(include_url=False):
                loc = ".".join(str(x) for x in err["loc"])
                msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
                issue(where, f"{prefix}.{name}.{loc}: {msg}")
            ok = False
    if not ok:
        return False
    if isinstance(sched, PluginRef):
        plugins[tuned[sched.name].name] = tuned[sched.name]
        return tuned[sched.name]
    swap = lambda r: tuned.get(r.name, r)  # noqa: E731
    new = ProfileRef(f"{sched.name}@{bundle.ref}", tuple(swap(f) for f in sched.filters),
                     tuple((swap(r), w) for r, w in sched.scorers), swap(sched.picker), explain=sched.explain,
                     implicit=sched.implicit)
    profiles[new.name] = new
    return new


def apply_bundle_part(route: Route, bundle: Any) -> Route:
    """`route` with the templates and schema of `bundle`'s part for it (the parts it leaves out stay);
    the schema asked of the model is derived again from the transform unless one is given."""
    part = bundle.parts[route.name]
    request = part.request if part.request is not None else route.request
    transform = part.transform if part.transform is not None else route.transform
    schema = part.output_schema if part.output_schema is not None else (
        route.response_schema if part.transform is None else derive_output_schema(transform))
    return replace(route, request=request, transform=transform, response_schema=schema, bundle=bundle.ref,
                   variants=MappingProxyType({}))


def _compile_plan(spec: Any, rollout: Any, base: tuple, issue: Any) -> Any:
    """A rollout's `plan:` block: a `canary.control.ControlConfig` (the step plan, the judge's
    thresholds, the windows, the interval), checked as the controller will use it (the ramped arm
    is a canary, every step and a rollback from it monotone). None, reported, when refused."""
    from canary.control import ControlConfig
    from canary.judge import JudgeConfig, JudgeError, WindowConfig
    from canary.plan import Plan, PlanConfig, PlanError

    fields = {"min_samples": "minSamples", "dwell_s": "dwell", "rollback_while_paused": "rollbackWhilePaused",
              "margin_ms": "marginMs", "margin_ratio": "marginRatio", "max_rate": "maxRatePercent",
              "margin": "marginPercent", "error_alpha": "errorAlpha", "size": "size", "error_size": "errorSize",
              "max_age_s": "maxAge"}

    def where(prefix: tuple, field: str) -> tuple:
        name, _, index = field.partition("[")
        path = prefix + (fields.get(name, name),)
        return path + (int(index.rstrip("]")),) if index.rstrip("]").isdigit() else path

    def given(**kw: Any) -> dict[str, Any]:
        return {k: v for k, v in kw.items() if v is not None}

    try:  # absent fields: canary/plan.py's and canary/judge.py's defaults (one source of truth)
        plan = replace(PlanConfig(), arm=spec.arm, **given(
            steps=tuple(spec.steps) if spec.steps is not None else None, min_samples=spec.min_samples,
            dwell_s=spec.dwell, rollback_while_paused=spec.rollback_while_paused))
    except PlanError as e:
        issue(where(base, e.field), e.reason)
        return None
    j = spec.judge
    judge_path = base + ("judge",)
    d = JudgeConfig()
    try:
        def rule(default: Any, r: Any) -> Any:
            return replace(default, **given(margin_ms=r.margin_ms, margin_ratio=r.margin_ratio,
                                            quantiles=tuple(r.quantiles) if r.quantiles is not None else None))

        e_ = j.errors
        errors = replace(d.errors, **given(
            max_rate=e_.max_rate_percent / 100 if e_.max_rate_percent is not None else None,
            margin=e_.margin_percent / 100 if e_.margin_percent is not None else None))
        min_samples = j.min_samples if j.min_samples is not None else max(2, min(d.min_samples, plan.min_samples))
        judge = replace(d, min_samples=min_samples, latency=rule(d.latency, j.latency), ttft=rule(d.ttft, j.ttft),
                        errors=errors, **given(alpha=j.alpha, error_alpha=j.error_alpha,
                                               metrics=tuple(dict.fromkeys(j.metrics)) if j.metrics is not None
                                               else None))
    except JudgeError as e:
        issue(where(judge_path, e.field), e.reason)
        return None
    w = spec.window
    try:
        window = replace(WindowConfig(), max_age_s=w.max_age, **given(size=w.size, error_size=w.error_size))
    except JudgeError as e:
        issue(where(base + ("window",), e.field), e.reason)
        return None
    if window.size < judge.min_samples or window.error_size < judge.min_samples:
        issue(base + ("window",), f"windows of {window.size} latencies and {window.error_size} error flags per arm "
              f"can never hold the judge's {judge.min_samples} samples: every verdict would be inconclusive")
        return None
    try:
        Plan.start(rollout, plan)  # the arm is a canary; every step, and a rollback from it, is monotone
    except PlanError as e:
        issue(where(base, e.field), e.reason)
        return None
    return ControlConfig(plan=plan, judge=judge, window=window, interval=spec.interval)


def with_rollout_overrides(snap: Snapshot, overrides: Mapping[str, Mapping[str, Any]] | None) -> Snapshot:
    """A copy of `snap` serving other weights for some rollouts (what `canary/control.py` applies:
    a step plan's current weights over the file's). `overrides`: rollout -> {"weights": {canary arm:
    basis points}, "allow_force": bool}; the digest covers them (`override_digest`). A rollout or arm
    the snapshot does not have is a `ConfigError` (the file changed under the controller)."""
    if not overrides:
        return snap
    from canary.assign import RolloutError

    rollouts = dict(snap.rollouts)
    for name, o in sorted(overrides.items()):
        ref = rollouts.get(name)
        if ref is None:
            raise ConfigError(f"{snap.source}: rollout weights for {name!r}, which the config does not declare")
        r = ref.rollout
        try:
            for arm, bp in sorted(dict(o.get("weights") or {}).items()):
                r = r.with_weight(arm, int(bp))
            r = replace(r, allow_force=bool(o.get("allow_force", r.allow_force)))
        except (RolloutError, TypeError, ValueError) as e:
            raise ConfigError(f"{snap.source}: rollout weights for {name!r} do not fit it: {e}") from None
        rollouts[name] = replace(ref, rollout=r)
    routes = {n: (replace(rt, rollout=rollouts[rt.rollout.name]) if rt.rollout is not None else rt)
              for n, rt in snap.routes.items()}
    return replace(snap, rollouts=rollouts, routes=routes, digest=override_digest(snap.digest, overrides))


def override_digest(digest: str, overrides: Mapping[str, Mapping[str, Any]] | None) -> str:
    """The digest of a config with rollout weight overrides (the file's digest when there are none)."""
    if not overrides:
        return digest
    import hashlib
    import json

    blob = json.dumps({n: {"weights": {a: int(bp) for a, bp in sorted(dict(o.get("weights") or {}).items())},
                           "allow_force": bool(o.get("allow_force", True))} for n, o in sorted(overrides.items())},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{digest}\0rollouts\0{blob}".encode()).hexdigest()[:16]


def _compile_epp(e: Any, backends: dict[str, Backend], plugins: dict[str, PluginRef],
                 profiles: dict[str, ProfileRef], refused: set, issue: Any) -> EppConfig | None:
    """`spec.epp`: the pool (a declared OpenAI-API backend with IP endpoints: the endpoint-picker
    protocol names endpoints `ip:port`) and its profile, as the route `epp` (extproc/epp.py)."""
    base = ("spec", "epp")
    pool = backends.get(e.pool)
    if pool is None:
        issue(base + ("pool",), f"no backend named {e.pool!r} (backends: {', '.join(backends) or 'none'})")
        return None
    if pool.adapter.api != "openai":
        issue(base + ("pool",), f"EPP mode parses OpenAI-API bodies: backend {pool.name!r} is kind {pool.kind}")
        return None
    if not pool.pickable:
        issue(base + ("pool",), f"the endpoint-picker protocol names endpoints as ip:port: backend {pool.name!r} "
              "lists host names (give the InferencePool's pod IPs)")
        return None
    picker = _route_plugins((e.profile,), base, plugins, profiles, refused, [pool],
                            lambda path, reason: issue(base + ("profile",), reason))
    if not picker:
        return None
    route = Route(name="epp", path="/", kind="openai", backend=pool, model=None, request=None, transform=None,
                  response_schema=None, failure_mode="closed", max_body_bytes=e.max_body_bytes, timeout=pool.timeout,
                  match="prefix", backends=(pool,), dialect=kind_specs()["openai"].dialect, picker=picker)
    tls = None
    if e.tls is not None:
        tls = (e.tls.cert_file, e.tls.key_file)
        for field_name, name in zip(("certFile", "keyFile"), tls):
            if not os.access(name, os.R_OK):
                issue(base + ("tls", field_name), f"cannot read {name}")
                return None
    return EppConfig(route=route, health_port=e.health_port, model_rewrites=MappingProxyType(dict(e.model_rewrites)),
                     tls=tls)


def _compile_plugins(specs: Any, issue: Any) -> dict[str, PluginRef]:
    """`spec.plugins`: known types, parameters valid for the type (field paths into `parameters`);
    a plugin without a `name` is named after its type."""
    from pydantic import ValidationError

    from extproc.scheduling import plugin_types

    types = plugin_types()
    out: dict[str, PluginRef] = {}
    for i, p in enumerate(specs):
        base = ("spec", "plugins", i)
        name = p.name or p.type
        if name in out:
            issue(base + ("name" if p.name else "type",), f"duplicate plugin name {name!r}" + (
                "" if p.name else " (a plugin without a name is named after its type: set distinct names)"))
            continue
        cls = types.get(p.type)
        if cls is None:
            issue(base + ("type",), f"unknown plugin type {p.type!r} (known: {', '.join(sorted(types))})")
            continue
        try:
            params = cls.Parameters.model_validate(p.parameters)
        except ValidationError as e:
            for err in e.errors(include_url=False):
                loc = tuple(x for x in err["loc"] if isinstance(x, (str, int)))
                msg = "unknown parameter" if err["type"] == "extra_forbidden" else (
                    "required parameter is missing" if err["type"] == "missing" else err["msg"])
                issue(base + ("parameters",) + loc, msg.removeprefix("Value error, "))
            continue
        out[name] = PluginRef(name, p.type, cls.slot, params)
    return out


DEFAULT_PICKER = "max-score-picker"


def _default_picker(plugins: dict[str, PluginRef]) -> PluginRef:
    """A profile without a picker gets `max-score-picker`: the declared plugin of that name and type
    when there is one, else one with default parameters."""
    from extproc.scheduling import plugin_types

    declared = plugins.get(DEFAULT_PICKER)
    if declared is not None and declared.type == DEFAULT_PICKER:
        return declared
    cls = plugin_types()[DEFAULT_PICKER]
    return PluginRef(DEFAULT_PICKER, DEFAULT_PICKER, cls.slot, cls.Parameters())


def _standalone(ref: PluginRef) -> bool:
    from extproc.scheduling import plugin_types

    return bool(getattr(plugin_types().get(ref.type), "standalone", False))


def _compile_profiles(specs: Any, plugins: dict[str, PluginRef], issue: Any) -> tuple[dict[str, ProfileRef], set]:
    """`spec.schedulingProfiles`: filters (in order) -> scorers (weight > 0, default 1) -> one picker,
    listed anywhere (default max-score-picker); names shared with plugins are refused (routes use both).
    Returns the profiles and the names of refused ones (routes naming those add no second error)."""
    out: dict[str, ProfileRef] = {}
    refused: set[str] = set()
    declared = ", ".join(plugins) or "none"
    for i, prof in enumerate(specs):
        base = ("spec", "schedulingProfiles", i)
        if prof.name in plugins:
            issue(base + ("name",), f"profile name {prof.name!r} is also a plugin's name in spec.plugins; "
                  "routes refer to both by name: rename one")
            continue
        if prof.name in out:
            issue(base + ("name",), f"duplicate scheduling profile name {prof.name!r}")
            continue
        filters: list[PluginRef] = []
        scorers: list[tuple[PluginRef, float]] = []
        picker: PluginRef | None = None
        seen: set[str] = set()
        ok = True
        for j, entry in enumerate(prof.plugins):
            where = base + ("plugins", j)
            ref = plugins.get(entry.plugin_ref)
            if ref is None:
                issue(where + ("pluginRef",), f"no plugin named {entry.plugin_ref!r} in spec.plugins "
                      f"(declared: {declared})")
                ok = False
                continue
            if ref.name in seen:
                issue(where + ("pluginRef",), f"plugin {ref.name!r} is already in this profile")
                ok = False
                continue
            seen.add(ref.name)
            if entry.weight is not None and ref.slot != "scorer":
                issue(where + ("weight",), f"only scorers have a weight; {ref.name!r} is a {ref.slot} ({ref.type})")
                ok = False
                continue
            if ref.slot == "filter":
                filters.append(ref)
            elif ref.slot == "scorer":
                scorers.append((ref, 1.0 if entry.weight is None else float(entry.weight)))
            elif _standalone(ref):
                issue(where + ("pluginRef",), f"{ref.name!r} ({ref.type}) orders endpoints by itself and cannot be "
                      "a profile's picker: name it on the route instead, or use max-score-picker, "
                      "weighted-random-picker or random-picker here")
                ok = False
            elif picker is not None:
                issue(where + ("pluginRef",), f"profile already has picker {picker.name!r}; a profile has one picker")
                ok = False
            else:
                picker = ref  # anywhere in the list (GIE accepts it anywhere; llm-d's samples list it first)
        if ok:
            out[prof.name] = ProfileRef(prof.name, tuple(filters), tuple(scorers), picker or _default_picker(plugins),
                                        explain=prof.explain)
        else:
            refused.add(prof.name)
    return out, refused


def _route_plugins(names: Any, base: tuple, plugins: dict[str, PluginRef], profiles: dict[str, ProfileRef],
                   refused: set, targets: list, issue: Any):
    """The route's scheduler: a standalone picker or a profile (a scoring picker named alone runs as
    an implicit profile of its own, added to `profiles`); None; or False after reporting a problem."""
    chosen = None
    for j, name in enumerate(names):
        where = base + ("plugins", j)
        ref = profiles.get(name)
        if ref is None or ref.implicit:
            ref = plugins.get(name)
        if ref is None and name in refused:
            return False  # the profile's own errors were reported
        if ref is None:
            issue(where, f"no plugin or scheduling profile named {name!r} (plugins: {', '.join(plugins) or 'none'}; "
                  f"schedulingProfiles: {', '.join(p for p, r in profiles.items() if not r.implicit) or 'none'})")
            return False
        if chosen is not None:
            issue(where, f"route already has {_what(chosen)} {chosen.name!r}; a route names one scheduling "
                  "profile or one picker")
            return False
        if isinstance(ref, PluginRef) and ref.slot != "picker":
            issue(where, f"{name!r} is a {ref.slot}: list it in a spec.schedulingProfiles entry and name that "
                  "profile here")
            return False
        if isinstance(ref, PluginRef) and not _standalone(ref):
            ref = profiles.setdefault(name, ProfileRef(name, (), (), ref, implicit=True))
        pinned = getattr(getattr(ref, "params", None), "endpoint", None)
        if pinned is not None and not any(pinned in b.endpoint_ids for b in targets):
            issue(where, f"plugin {name!r} pins endpoint {pinned}, which is not an endpoint of this route's "
                  f"backends ({', '.join(e for b in targets for e in b.endpoint_ids)})")
            return False
        chosen = ref
    return chosen


def _what(ref: Any) -> str:
    return "picker" if isinstance(ref, PluginRef) else "scheduling profile"


def _compile_qos(spec: Any, backends: Mapping[str, Backend], issue: Any) -> Any:
    if spec.qos is None:
        return None
    from extproc.qos.engine import compile_qos

    names = {r.name or route_name_from_path(r.path): i for i, r in enumerate(spec.routes)}
    return compile_qos(spec.qos, names, {t.id for t in spec.tenants}, backends, issue)


def _compile_brokers(specs: Any, issue: Any) -> dict[str, Any]:
    from extproc.iot.commands import compile_broker

    brokers: dict[str, Any] = {}
    for i, b in enumerate(specs):
        if b.name in brokers:
            issue(("spec", "brokers", i, "name"), f"duplicate broker name {b.name!r}")
            continue
        if b.password_env and b.password_env not in os.environ:
            issue(("spec", "brokers", i, "passwordEnv"), f"environment variable {b.password_env} is not set")
        brokers[b.name] = compile_broker(b)
    return brokers


def _with_pipeline(route: Route, build_pipeline: Any, path: tuple, issue: Any) -> Route:
    from dataclasses import replace

    try:
        return replace(route, pipeline=build_pipeline(route))
    except ValueError as e:  # PipelineError: a malformed stage
        issue(path, str(e))
        return route


def _resolve_target(target: str | None, path: tuple, backends: dict[str, Backend], protocol: str, kinds: Any,
                    issue: Any, timeout: float):
    if target is None:
        declared = [b for b in backends.values() if not b.implicit]
        if len(declared) == 1:
            return declared[0]
        issue(path, "required when spec.backends does not declare exactly one backend")
        return None
    if target in backends:
        return backends[target]
    try:
        host, port = split_host_port(target)
    except ValueError:
        names = ", ".join(sorted(backends)) or "none declared"
        issue(path, f"{target!r} is neither a declared backend ({names}) nor host:port")
        return None
    name = route_name_from_path(host.replace(".", "-"))
    existing = backends.get(name)
    if existing is not None:
        if existing.implicit and existing.endpoints == ((host, port),):
            return existing
        issue(path, f"target {target!r} would define implicit backend {name!r}, which already exists with "
              "other endpoints; refer to the backend by name instead")
        return None
    adapter = kinds["openai"]()
    backend = Backend(
        name=name, kind="openai", protocol=protocol, endpoints=((host, port),), models=(),
        health_path=adapter.default_health_path, timeout=timeout, implicit=True, adapter=adapter,
    )
    backends[name] = backend
    return backend


def _compile(text: str | None, path: tuple, issues: "_Issues"):
    if text is None:
        return None
    try:
        return compile_template(text)
    except TemplateError as e:
        first = issues.smap.content_lines.get(path)
        where = f"{issues.smap.filename}:{first + e.line - 1}" if first else issues.smap.where(path)
        issues.found.append(Issue(where, format_path(path), f"template error at line {e.line}, column {e.column}: {e.message}"))
        return None


def _relative(issues: "_Issues", name: str) -> Path:
    if issues.resolve is not None:
        return issues.resolve(name)
    p = Path(name)
    return p if p.is_absolute() else Path(issues.smap.filename).resolve().parent / p


def _load_tools(name: str | None, path: tuple, issues: "_Issues"):
    """The tools of a tool route's OpenAPI document; load-time errors name the document's pointer."""
    from extproc.semantic.openapi import SpecError, load_spec
    from extproc.semantic.tools import build_tools

    if not name:
        issues.add(path + ("openapi",), "a tool route needs `openapi`: the service's OpenAPI document")
        return None
    try:
        toolset = build_tools(load_spec(_relative(issues, name)))
    except SpecError as e:
        issues.add(path + ("openapi",), f"{name}: {e}")
        return None
    if not toolset.tools:
        issues.add(path + ("openapi",), f"{name}: no operation could be turned into a tool")
        return None
    return toolset


def _load_sql(r: Any, path: tuple, issues: "_Issues", message_timeout: float):
    """A sql route's database introspected (extproc/semantic/sql.py); errors name `routes[i].sql.*`."""
    from extproc.semantic.sql import SqlConfigError, compile_sql

    if r.sql is None:
        issues.add(path + ("sql",), "a sql route needs a `sql` block: at least `database` (a SQLite file or a "
                   "postgresql:// URL)")
        return None
    if r.request or r.output_schema:
        issues.add(path + ("request" if r.request else "outputSchema",), "a sql route builds the model's request "
                   "from the database schema; only `transform` (over {sql, columns, rows, row_count, truncated, "
                   "input}) applies")
        return None
    s = r.sql
    if not 0 < s.timeout < message_timeout:
        issues.add(path + ("sql", "timeout"), f"{s.timeout:g}s must be above 0 and below "
                   f"spec.processor.messageTimeout ({message_timeout:g}s): Envoy waits that long for the rows")
        return None
    try:
        return compile_sql(s.database, base=Path(issues.smap.filename).resolve().parent, tables=s.tables,
                           schema_name=s.pg_schema, max_rows=s.max_rows, timeout=s.timeout,
                           max_schema_bytes=s.max_schema_bytes, max_tokens=s.max_tokens,
                           question_field=s.question_field)
    except SqlConfigError as e:
        issues.add(path + ("sql", "database"), str(e))
        return None

def _load_erp(r: Any, path: tuple, issues: "_Issues", message_timeout: float):
    """An erp route's BPMN process parsed and its service tasks mapped to REST calls
    (extproc/semantic/bpmn.py); errors name `routes[i].erp.*` and the BPMN file's element."""
    from extproc.semantic.bpmn import compile_erp

    if r.erp is None:
        issues.add(path + ("erp",), "an erp route needs an `erp` block: `process` (a BPMN file), `service` (the "
                   "ERP service's URL) and `operations` (service task id -> method, path, parameters)")
        return None
    if r.request or r.output_schema:
        issues.add(path + ("request" if r.request else "outputSchema",), "an erp route builds the model's request "
                   "from the process state; only `transform` (over the action's result document) applies")
        return None
    erp, problems = compile_erp(r.erp, _relative(issues, r.erp.process), message_timeout)
    for where, why in problems:
        issues.add(path + ("erp",) + where, why)
    return erp


def _load_mapping(name: str, path: tuple, issues: "_Issues"):
    from extproc.semantic.mapping import MappingError, load_mapping

    try:
        return load_mapping(_relative(issues, name))
    except (MappingError, OSError, ValueError) as e:
        issues.add(path + ("mapping",), f"{name}: {e}")
        return None


class _Issues:
    """Collects every problem so one load reports them all."""

    def __init__(self, smap: SourceMap, resolve: Callable[[str], Path] | None = None):
        self.smap = smap
        self.resolve = resolve
        self.found: list[Issue] = []

    def add(self, path: tuple, reason: str) -> None:
        self.found.append(Issue(self.smap.where(path), format_path(path), reason))


def derive_output_schema(transform: Any) -> dict[str, Any] | None:
    """JSON Schema for `$.output...` paths the transform reads, so the model is asked for them.

    Leaves are untyped (`{}`); declare `outputSchema` on the route for typed fields. Paths with a
    default are optional, the others required.
    """
    root: dict[str, Any] = {}
    required_any = False
    for ref in transform.paths:
        steps = ref.steps
        if not steps or steps[0] != "output" or len(steps) < 2:
            continue
        required_any = True
        node = root
        for j, step in enumerate(steps[1:]):
            last = j == len(steps) - 2
            if isinstance(step, str):
                node.setdefault("type", "object")
                props = node.setdefault("properties", {})
                if not ref.has_default:
                    req = node.setdefault("required", [])
                    if step not in req:
                        req.append(step)
                node = props.setdefault(step, {})
            else:  # index or wildcard
                node.setdefault("type", "array")
                node = node.setdefault("items", {})
            if last:
                break
    if not required_any:
        return None
    _close_objects(root)
    return root


def _close_objects(node: dict[str, Any]) -> None:
    if node.get("type") == "object":
        node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            _close_objects(child)
    elif node.get("type") == "array":
        _close_objects(node.get("items", {}))


def _check_processor_tls(gw: AdapterGateway, issue: Any) -> None:
    """`spec.processor.tls`: every PEM file readable (the workers and Envoy read them at start)."""
    tls = gw.spec.processor.tls
    if tls is None:
        return
    for field_name, name in (("certFile", tls.cert_file), ("keyFile", tls.key_file), ("caFile", tls.ca_file),
                             ("clientCertFile", tls.client_cert_file), ("clientKeyFile", tls.client_key_file)):
        if not os.access(name, os.R_OK):
            issue(("spec", "processor", "tls", field_name), f"cannot read {name}")


def _check_ports(gw: AdapterGateway, issue: Any) -> None:
    spec = gw.spec
    workers = spec.processor.workers or (1 if spec.epp is not None else os.cpu_count() or 1)
    if spec.epp is not None and workers != 1:
        issue(("spec", "processor", "workers"), "EPP mode serves one port (the InferencePool's endpointPickerRef "
              "port, basePort): workers must be 1; scale with replicas")
    used = {
        ("spec", "listener", "port"): {spec.listener.port},
        ("spec", "admin", "port"): {spec.admin.port},
        ("spec", "processor", "adminPort"): {spec.processor.admin_port},
        ("spec", "processor", "basePort"): set(range(spec.processor.base_port, spec.processor.base_port + workers)),
    }
    if spec.epp is not None and spec.epp.health_port is not None:
        used[("spec", "epp", "healthPort")] = {spec.epp.health_port}
    seen: dict[int, tuple] = {}
    for path, ports in used.items():
        for p in sorted(ports):
            if p in seen:
                issue(path, f"port {p} is also used by {format_path(seen[p])}")
                break
            seen[p] = path


__all__ = ["apply_bundle_part", "compile_snapshot", "derive_output_schema", "model_name", "WILDCARD"]
