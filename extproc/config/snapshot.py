"""The runtime config snapshot: validated, compiled, immutable, swapped atomically on reload.

What: `Snapshot` holds resolved backends (implicit ones from `host:port` targets included),
routes with compiled templates and their stage pipeline, and the listener/processor settings.
Why: the request path reads only this object, captured once per stream; a reload builds a complete
new snapshot off to the side and replaces one reference, so no request ever sees half a config.
Cost: built once per load; reading it is attribute access.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from extproc.config.schema import AdapterGateway, AdminSpec, ListenerSpec, ProcessorSpec, TenantSpec

HEALTH_ROUTE = "adapter-health"
HEALTH_PATH = "/health/adapter"
BACKEND_HEADER = "x-adapter-backend"  # set by the processor; Envoy routes on it
ROUTE_TARGET_HEADER = "x-adapter-route-target"  # set with it: which route entry carries the policy
ROUTE_METADATA_KEY = "x-adapter-route"  # gRPC initial metadata: which route a stream serves
DEBUG_METADATA_KEY = "x-adapter-debug"
TENANT_METADATA_KEY = "x-adapter-tenant"  # the request's tenant id, as Envoy resolved it for the route
DIGEST_METADATA_KEY = "x-adapter-config-digest"  # gRPC initial metadata: the digest Envoy's routes came from
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # endpoint-picker protocol: "ip:port[,ip:port...]"
LB_METADATA_NAMESPACE = "envoy.lb"  # dynamic metadata the override-host load balancer reads
VARIANT_HEADER = "x-adapter-variant"  # on every response of a route with a rollout: "<rollout>/<arm>"
VARIANT_METADATA_NAMESPACE = "adapter"  # dispatch sets adapter.variant; Envoy's route adds the header from it
VARIANT_METADATA_KEY = "variant"


# the engine an endpoint runs when the config does not say: from the backend's kind (rest: none)
ENGINE_OF_KIND = {"openai": "openai", "vllm": "vllm", "triton": "triton", "onnxruntime": "onnxruntime"}
_NO_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EndpointMeta:
    """What the config says about one endpoint besides its address (`backends[].endpoints[]` objects)."""

    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs (hashable; see Backend.endpoint_labels)
    engine: str | None = None  # None: the backend kind's (ENGINE_OF_KIND)
    metrics_path: str = "/metrics"


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    kind: str
    protocol: str  # "http" (HTTP/1.1) or "grpc" (HTTP/2, the transport gRPC runs on)
    endpoints: tuple[tuple[str, int], ...]
    models: tuple[str, ...]
    health_path: str
    timeout: float
    implicit: bool  # created from a route's host:port target
    adapter: Any  # backends.base.BackendAdapter
    # one per endpoint, in the same order; missing entries (an endpoint override with more endpoints
    # than the config listed, an implicit backend) are the defaults: no labels, the kind's engine
    endpoint_meta: tuple[EndpointMeta, ...] = ()
    lb_policy: str = "leastRequest"  # Envoy's balancing without a pick: leastRequest, roundRobin, random
    dialect: Any = None  # backends.dialects.DialectConfig (openai, vllm kinds; None: negotiate, kind's preset)
    socket_plan: Any = None  # extproc.socket_options.Plan: `lowLatency` options the kernel allows (None: Envoy's defaults)
    # derived from `endpoints` once (also by `replace`), never per request:
    endpoint_ids: tuple[str, ...] = field(init=False)  # as the endpoint-picker protocol names them: "ip:port"
    pickable: bool = field(init=False)  # all endpoints are IPs: the processor can name one (Envoy resolves names)
    # by endpoint id (read-only mappings; what filters and scrapers read):
    endpoint_labels: Mapping[str, Mapping[str, str]] = field(init=False, compare=False, hash=False, repr=False)
    endpoint_engines: Mapping[str, str | None] = field(init=False, compare=False, hash=False, repr=False)
    endpoint_metrics_paths: Mapping[str, str] = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        ids = tuple(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        object.__setattr__(self, "endpoint_ids", ids)
        object.__setattr__(self, "pickable", all(is_ip(h) for h, _ in self.endpoints))
        meta = self.endpoint_meta
        default = EndpointMeta()
        labels, engines, paths = {}, {}, {}
        for i, ep in enumerate(ids):
            m = meta[i] if i < len(meta) else default
            labels[ep] = MappingProxyType(dict(m.labels)) if m.labels else _NO_LABELS
            engines[ep] = m.engine or ENGINE_OF_KIND.get(self.kind)
            paths[ep] = m.metrics_path
        object.__setattr__(self, "endpoint_labels", MappingProxyType(labels))
        object.__setattr__(self, "endpoint_engines", MappingProxyType(engines))
        object.__setattr__(self, "endpoint_metrics_paths", MappingProxyType(paths))

    @property
    def cluster(self) -> str:
        """Envoy cluster name: the backend name (DNS labels cannot collide with `adapter_*`)."""
        return self.name


def is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class PluginRef:
    """A plugin declared in `spec.plugins`: name, type, slot and validated parameters."""

    name: str
    type: str
    slot: str
    params: Any  # the plugin type's Parameters model instance


@dataclass(frozen=True, slots=True)
class ProfileRef:
    """A scheduling profile of `spec.schedulingProfiles` (or the implicit one-picker profile of a
    route that names a scoring picker directly): its plugins by slot, in the order they run."""

    name: str
    filters: tuple[PluginRef, ...]
    scorers: tuple[tuple[PluginRef, float], ...]  # (scorer, weight > 0)
    picker: PluginRef
    explain: bool = False
    implicit: bool = False  # made for a route naming a picker such as max-score-picker alone

    @property
    def refs(self) -> tuple[PluginRef, ...]:
        return (*self.filters, *(s for s, _ in self.scorers), self.picker)


@dataclass(frozen=True, slots=True)
class RolloutRef:
    """A `spec.rollouts` entry, compiled: the assignment (`canary.assign.Rollout`: baseline, canaries
    in basis points, salt), where keys come from (`canary.assign.KeyPolicy`), each arm's backend, and
    the request headers the stream keeps for it at request headers (key sources and the forcing
    header, trusted or not: the policy decides). Immutable, stateless: assignment is a hash."""

    name: str
    rollout: Any  # canary.assign.Rollout
    policy: Any  # canary.assign.KeyPolicy
    arm_backends: Mapping[str, str] = field(hash=False)  # arm -> backend name (a target of each of its routes)
    headers: tuple[str, ...] = ()
    routes: tuple[str, ...] = ()  # the routes it splits
    control: Any = None  # canary.control.ControlConfig: its `plan:` block (None: manual weights)
    # endpoint arms: arm -> the ids ("ip:port") of its backend's endpoints it may use (others: the backend's all)
    arm_endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    @property
    def arms(self) -> tuple[str, ...]:
        return self.rollout.arm_names  # the baseline first

    @property
    def uses_claims(self) -> bool:
        """Whether a key source is a JWT claim (Envoy must forward jwt_authn's payload to the processor)."""
        from canary.assign import JwtClaim

        return any(isinstance(s, JwtClaim) for s in self.policy.sources)


@dataclass(frozen=True, slots=True)
class BundlePart:
    """One route's part of an adapter bundle, compiled: the templates and schema it replaces (None:
    the route's own stays)."""

    request: Any = None  # extproc.template.Template | None
    transform: Any = None
    output_schema: Mapping[str, Any] | None = None
    plugins: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)  # plugin -> parameters


@dataclass(frozen=True, slots=True)
class AdapterBundle:
    """An adapter bundle the snapshot can use (`spec.bundles`, or loaded at run time): verified
    (canary/bundle.py `load`), its bundle.yaml compiled. `ref` is "<name>@<version>"."""

    name: str
    version: str
    digest: str  # sha256 of its manifest.json (names this exact content)
    source: str  # the ZIP as the config (or the state directory) names it
    signed: bool
    loaded: bool  # loaded at run time (adapterctl bundle load), not named by the config
    parts: Mapping[str, BundlePart] = field(hash=False)  # route name -> its part
    golden: int = 0  # golden cases the bundle carries

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    path: str
    kind: str  # "llm" | "passthrough" | "openai" | "kserve" | "tensor" | "health"
    backend: Backend | None  # the default (first) target
    model: str | None
    request: Any  # extproc.template.Template | None
    transform: Any  # extproc.template.Template | None
    response_schema: Mapping[str, Any] | None
    failure_mode: str
    max_body_bytes: int
    timeout: float
    pipeline: Any = None  # extproc.pipeline.Pipeline
    match: str = "exact"  # or "prefix"
    tenant_header: str | None = None  # a client header this route trusts as the tenant id
    tools: Any = None  # tool routes: extproc.semantic.tools.ToolSet
    mapping: Any = None  # rest routes: extproc.semantic.mapping.CompiledMapping
    sql: Any = None  # sql routes: extproc.semantic.sql.SqlConfig (the schema read at load)
    erp: Any = None  # erp routes: extproc.semantic.bpmn.ErpRoute (the BPMN process compiled at load, its actions)
    backends: tuple[Backend, ...] = ()  # every target; backend is backends[0]
    dialect: str = "adapter"  # how errors are rendered (extproc/errors.py), from the route kind
    # the dispatch slot's scheduler: a picker that picks alone, or a scheduling profile (None: Envoy balances)
    picker: PluginRef | ProfileRef | None = None
    rollout: RolloutRef | None = None  # the variant slot's canary rollout (spec.rollouts), if any
    bundle: str | None = None  # "<name>@<version>" of the adapter bundle whose part this route uses
    # bundle arms of its rollout: arm -> this route with that bundle's part (encode/decode use it)
    variants: Mapping[str, "Route"] = field(default_factory=dict, hash=False, compare=False)
    structured_fallback: str = "prompt"  # policy.structuredFallback: "prompt" or "refuse" (docs/dialects.md)
    server_timing: Any = None  # schema.ServerTimingSpec: latency attribution (extproc/attribution.py), None: off
    iot: Any = None  # iot routes: extproc.iot.commands.IotRoute (broker, commands)
    websocket: Any = None  # websocket routes: schema.WebSocketSpec (idle timeout, max duration, upgrade required)

    def backend_for_model(self, model: str | None) -> Backend | None:
        """The first target serving `model` (a backend with no models listed serves any)."""
        for b in self.backends:
            if not b.models or model in b.models:
                return b
        return None

    def backends_for_model(self, model: str | None) -> tuple[Backend, ...]:
        """Targets that can serve `model`, in order; every target when no model is named."""
        if model is None:
            return self.backends
        return tuple(b for b in self.backends if not b.models or model in b.models)

    @property
    def models(self) -> tuple[str, ...]:
        """Models reachable through this route, in target order, without duplicates."""
        seen: dict[str, None] = {}
        for b in self.backends:
            for m in b.models:
                seen.setdefault(m, None)
        if self.model:
            seen.setdefault(self.model, None)
        return tuple(seen)


@dataclass(frozen=True, slots=True)
class EppConfig:
    """`spec.epp`, compiled: the pool and profile as a route of kind openai named `epp` (never
    matched by path: the gateway's Envoy routes; the processor only picks), plus the EPP settings."""

    route: Route  # backends == (pool,), picker = the profile or picker, max_body_bytes, dialect openai
    health_port: int | None = None
    model_rewrites: Mapping[str, str] = field(default_factory=dict)
    tls: tuple[str, str] | None = None  # (certificate file, key file), PEM

    @property
    def pool(self) -> Backend:
        return self.route.backends[0]


@dataclass(frozen=True)
class Snapshot:
    generation: int
    digest: str
    source: str
    spec: AdapterGateway
    model_ref: str | None
    listener: ListenerSpec
    admin: AdminSpec
    processor: ProcessorSpec
    backends: Mapping[str, Backend]
    routes: Mapping[str, Route]  # by name, in config order; the health route last
    tenants: tuple[TenantSpec, ...] = field(default=())
    tenancy: Any = None  # extproc.config.schema.TenancySpec
    plugins: Mapping[str, PluginRef] = field(default_factory=dict)
    profiles: Mapping[str, ProfileRef] = field(default_factory=dict)  # declared and implicit, by name
    epp: EppConfig | None = None  # EPP mode (`spec.epp`): streams without route metadata pick from its pool
    rollouts: Mapping[str, RolloutRef] = field(default_factory=dict)  # by name; each also on its routes
    bundles: Mapping[str, AdapterBundle] = field(default_factory=dict)  # by "<name>@<version>"
    active_bundles: Mapping[str, str] = field(default_factory=dict)  # bundle name -> its active "<name>@<version>"
    listener_socket_plan: Any = None  # extproc.socket_options.Plan for `spec.listener.lowLatency` (None: off)

    @property
    def tenants_by_id(self) -> Mapping[str, TenantSpec]:
        return self._tenants_by_id  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", MappingProxyType(dict(self.backends)))
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))
        object.__setattr__(self, "plugins", MappingProxyType(dict(self.plugins)))
        object.__setattr__(self, "profiles", MappingProxyType(dict(self.profiles)))
        object.__setattr__(self, "rollouts", MappingProxyType(dict(self.rollouts)))
        object.__setattr__(self, "bundles", MappingProxyType(dict(self.bundles)))
        object.__setattr__(self, "active_bundles", MappingProxyType(dict(self.active_bundles)))
        object.__setattr__(self, "_tenants_by_id", MappingProxyType({t.id: t for t in self.tenants}))

    @property
    def name(self) -> str:
        return self.spec.metadata.name

    def with_endpoints(self, overrides: Mapping[str, tuple[tuple[str, int], ...]]) -> "Snapshot":
        """A copy whose named backends use other endpoints (the demo stack points them at simulators);
        the configured labels, engines and metrics paths stay with the endpoints' positions."""
        from dataclasses import replace

        backends = {n: replace(b, endpoints=overrides.get(n, b.endpoints)) for n, b in self.backends.items()}
        def moved(r: Route) -> Route:
            return replace(r, backend=backends[r.backend.name] if r.backend else None,
                           backends=tuple(backends[b.name] for b in r.backends),
                           variants={a: moved(v) for a, v in r.variants.items()})

        routes = {n: moved(r) for n, r in self.routes.items()}
        epp = self.epp
        if epp is not None:
            pool = backends[epp.pool.name]
            epp = replace(epp, route=replace(epp.route, backend=pool, backends=(pool,)))
        return replace(self, backends=backends, routes=routes, epp=epp)
