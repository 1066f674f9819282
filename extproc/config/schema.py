"""The `AdapterGateway` config schema (apiVersion adapter.ai/v1): typed, strict, immutable.

What: pydantic models for the declarative YAML operators write. Unknown fields are refused
(`extra="forbid"`), every model is frozen, lists become tuples. Defaults for everything the brief's
minimal example leaves out are declared here, next to the field, and documented in
`docs/config.md`.
Why: one place states what a valid config is; the loader adds file/line and cross-reference checks,
and `compile.py` turns the validated tree into the runtime snapshot.
Cost: validation runs once per load or reload, never per request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+)\s*(|k|K|Ki|KiB|kB|KB|M|Mi|MiB|MB)\s*$")
_SIZE_UNITS = {"": 1, "k": 1000, "K": 1000, "kB": 1000, "KB": 1000, "Ki": 1024, "KiB": 1024,
               "M": 1000**2, "MB": 1000**2, "Mi": 1024**2, "MiB": 1024**2}
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
BUNDLE_REF = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(@[A-Za-z0-9._+-]+)?$"  # NAME or NAME@VERSION


def parse_duration(value: Any) -> float:
    """`"500ms"`, `"1.5s"`, `"2m"`, `"1h"` or a number of seconds, to seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '500ms', '2s' or '1m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"invalid duration {value!r}: expected a number with ms, s, m or h, e.g. '500ms'")
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {value!r}")
    return seconds


def parse_size(value: Any) -> int:
    """`65536`, `"64Ki"`, `"1MiB"`, `"10MB"` to bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 65536, '64Ki' or '1Mi'")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"invalid size {value!r}: expected bytes or a number with Ki, Mi, k or M")
        n = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


def parse_cpu(value: Any) -> float:
    """CPUs as a number (`0.5`) or millicores (`"500m"`), to CPUs."""
    if isinstance(value, bool):
        raise ValueError("expected CPUs (0.5) or millicores ('500m')")
    if isinstance(value, (int, float)):
        cpus = float(value)
    else:
        s = str(value).strip()
        try:
            cpus = float(s[:-1]) / 1000 if s.endswith("m") else float(s)
        except ValueError:
            raise ValueError(f"invalid CPU quantity {value!r}: expected CPUs (0.5) or millicores ('500m')") from None
    if not 0.001 <= cpus <= 1024:
        raise ValueError(f"CPU limit must be between 1m (0.001, the kernel's CFS floor) and 1024 CPUs, got {value!r}")
    return cpus


Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Cpu = Annotated[float, BeforeValidator(parse_cpu)]
Port = Annotated[int, Field(ge=1, le=65535)]


class FieldError(ValueError):
    """A model validator's error about one of the model's fields: the loader reports it at that
    field's path and line (`spec.routes`), not at the model's."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True,
        str_strip_whitespace=False,
    )


class Metadata(_Model):
    name: Annotated[str, Field(min_length=1, max_length=253)]
    labels: dict[str, str] = Field(default_factory=dict)


class ListenerLimits(_Model):
    """What Envoy allows one client (docs/limits.md): hostile or broken clients are cut off here,
    before they reach the processor."""
    request_headers_timeout: Duration = 10.0  # all request headers must arrive within this (slow headers)
    request_timeout: Duration = 60.0  # the whole request (headers and body) within this (slow bodies)
    stream_idle_timeout: Duration = 300.0  # a request with no bytes either way for this long is reset
    idle_timeout: Duration = 300.0  # a client connection with no request open for this long is closed
    max_request_headers_kb: Annotated[int, Field(ge=1, le=8192)] = 60  # request headers' total size (431 beyond)
    max_headers_count: Annotated[int, Field(ge=1, le=10000)] = 100  # request headers' count (431 beyond)
    max_concurrent_streams: Annotated[int, Field(ge=1, le=2147483647)] = 100  # per HTTP/2 connection
    max_connections: Annotated[int, Field(ge=1, le=10_000_000)] = 50000  # client connections, all listeners


class LowLatencySpec(_Model):
    """`lowLatency` on a backend (its Envoy cluster's upstream sockets) or on the listener: socket options
    applied where the kernel allows them, each one it refuses left out with a logged reason
    (extproc/socket_options.py, docs/low-latency.md). `lowLatency: true` is all of them, busy poll 50 us."""
    tcp_no_delay: bool = True
    busy_poll_us: Annotated[int, Field(ge=0, le=1_000_000)] = 50  # SO_BUSY_POLL microseconds; 0: off
    tcp_fast_open: bool = True  # upstream: TCP_FASTOPEN_CONNECT; listener: tcp_fast_open_queue_length


def _low_latency(v: Any) -> Any:
    """`lowLatency: true` is every option at its default, `false` none."""
    if v is True:
        return {}
    if v is False:
        return None
    return v


LowLatency = Annotated[LowLatencySpec | None, BeforeValidator(_low_latency)]


class ListenerSpec(_Model):
    """Where Envoy accepts client traffic."""
    address: str = "127.0.0.1"
    port: Port = 8080
    limits: ListenerLimits = ListenerLimits()
    low_latency: LowLatency = None


class AdminSpec(_Model):
    """Envoy's admin interface (stats, readiness)."""
    address: str = "127.0.0.1"
    port: Port = 9901


class ProcessorTlsSpec(_Model):
    """mTLS between Envoy and the processor workers (docs/limits.md): PEM files, absolute paths. The
    workers serve with `certFile`/`keyFile` and accept only clients whose certificate `caFile` signed;
    Envoy connects with `clientCertFile`/`clientKeyFile` and accepts only a worker certificate that
    `caFile` signed (and, with `serverName`, that names it: SNI and subject alt name)."""
    cert_file: Annotated[str, Field(pattern=r"^/")]
    key_file: Annotated[str, Field(pattern=r"^/")]
    ca_file: Annotated[str, Field(pattern=r"^/")]
    client_cert_file: Annotated[str, Field(pattern=r"^/")]
    client_key_file: Annotated[str, Field(pattern=r"^/")]
    server_name: Annotated[str, Field(min_length=1)] | None = None


class ProcessorSpec(_Model):
    """The ext_proc processor: N worker processes, each its own Envoy endpoint."""
    address: str = "127.0.0.1"  # where Envoy reaches the workers (an IP, or a host name in compose)
    bind_address: str | None = None  # where workers listen; default: address (0.0.0.0 in containers)
    base_port: Port = 50051
    workers: Annotated[int, Field(ge=1, le=64)] | None = None  # None: CPU count
    admin_port: Port = 9902  # Prometheus /metrics and /healthz of the processor
    message_timeout: Duration = 1.0  # Envoy waits this long for each processor reply
    shutdown_grace: Duration = 5.0  # drain time after NOT_SERVING before streams are cancelled
    # How a request's end reaches the processor: `accessLog` (Envoy's gRPC access log, one logger
    # per worker, as `adapterctl render-envoy` and `up` configure it) or `stream` (only what the
    # ext_proc stream sees; for an Envoy configured by hand without those loggers).
    feedback: Literal["accessLog", "stream"] = "accessLog"
    # where canary rollout state (plans with `plan:`) is kept across restarts; relative paths are
    # relative to the config file's directory; default `.adapter-state` beside the config file
    state_dir: Annotated[str, Field(min_length=1)] | None = None
    tls: ProcessorTlsSpec | None = None  # mTLS between Envoy and the workers (default: plaintext h2c on loopback)


ENGINES = ("vllm", "sglang", "triton", "onnxruntime", "openai", "llamacpp")


def _endpoint_item(value: Any) -> Any:
    """A `"host:port"` string is the short form of `{address: "host:port"}` (checked here, so its
    error names the list item as written, `spec.backends[0].endpoints[1]`)."""
    if isinstance(value, str):
        split_host_port(value)
        return {"address": value}
    return value


class EndpointSpec(_Model):
    """One endpoint of a backend: where it is, and what the scheduler and the scrapers know of it.

    `labels` are free-form facts (`gpu: a100`, `zone: eu`, `model-version: "2.1"`) that filters
    such as `label-filter` select on; `engine` says which server runs there (default from the
    backend's `kind`; a pool may mix engines) and `metricsPath` where its Prometheus metrics are."""
    address: str
    labels: dict[Annotated[str, Field(min_length=1, max_length=253)], str] = Field(default_factory=dict)
    engine: Literal["vllm", "sglang", "triton", "onnxruntime", "openai", "llamacpp"] | None = None
    metrics_path: Annotated[str, Field(pattern=r"^/[^?#\s]*$")] = "/metrics"

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        split_host_port(v)
        return v


class BackendSpec(_Model):
    """A model server reachable through Envoy. `kind` names the wire API, `protocol` the transport."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    kind: Literal["openai", "vllm", "triton", "onnxruntime", "rest"] = "openai"
    protocol: Literal["http", "grpc"] | None = None  # default: spec.protocol
    # "host:port" strings, or {address, labels, engine, metricsPath} objects (EndpointSpec)
    endpoints: Annotated[tuple[Annotated[EndpointSpec, BeforeValidator(_endpoint_item)], ...], Field(min_length=1)]
    models: tuple[str, ...] = ()
    health_path: str | None = None  # default per kind (openai: /health)
    timeout: Duration = 60.0
    # Envoy's own balancing when the processor names no endpoint (no picker, or an unpickable request)
    lb_policy: Literal["leastRequest", "roundRobin", "random"] = "leastRequest"
    # openai/vllm backends: what the server accepts (backends/dialects.py, docs/dialects.md); learned
    # by probing unless `negotiate: false`; the parts given here win over what the probe learns
    dialect: "DialectSpec | None" = None
    low_latency: LowLatency = None  # socket options on the backend's upstream connections (docs/low-latency.md)


class DialectSpec(_Model):
    """`spec.backends[].dialect`: a preset and/or fixed parts of a backend's dialect (docs/dialects.md)."""
    negotiate: bool = True
    preset: Literal["openai", "vllm", "llamacpp", "sglang", "ollama"] | None = None
    structured_output: Literal["json_schema", "json_object_schema", "structured_outputs", "guided_json",
                               "sglang_json_schema", "ollama_format", "prompt"] | None = None
    # YAML 1.1 reads an unquoted yes/no as a boolean: taken as the word
    stream_usage: Annotated[Literal["yes", "no", "refused"],
                            BeforeValidator(lambda v: {True: "yes", False: "no"}.get(v, v) if isinstance(v, bool)
                                            else v)] | None = None
    priority: Literal["honoured", "ignored", "refused"] | None = None
    lora: Literal["runtime", "none"] | None = None


BackendSpec.model_rebuild()


class RoutePolicy(_Model):
    """Per-route policy: what happens on failure and how much a request may carry."""
    failure_mode: Literal["closed", "open"] = "closed"  # processor down: closed -> 503, open -> pass through
    # A client header this route trusts as the tenant id (for example on an internal route).
    # Without it the tenant comes only from `spec.tenancy` (set by Envoy or a proxy after authentication).
    tenant_header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] | None = None
    max_body_bytes: Size = 1024 * 1024  # larger request bodies get 413
    timeout: Duration = 60.0  # upstream request timeout (Envoy route timeout)
    # an output schema on a backend that cannot constrain output (dialect `prompt`): `prompt` asks for
    # the JSON in the prompt, validates it, one repair retry; `refuse` answers 501 instead
    structured_fallback: Literal["prompt", "refuse"] = "prompt"


RouteKind = Literal["llm", "passthrough", "openai", "kserve", "tensor", "tool", "rest", "erp", "anthropic-messages",
                    "openai-responses", "iot", "sql", "websocket"]


class WebSocketSpec(_Model):
    """`routes[].websocket`: how long an upgraded socket of a websocket route may live (docs/websocket.md).
    Envoy's route timeout is off for these routes (it would cut a live socket); these two bound it instead."""
    idle_timeout: Duration = 300.0  # no frame either way for this long: the socket is reset
    max_duration: Duration = 3600.0  # a socket's whole life at most (Envoy closes it; the request ends then)
    require_upgrade: bool = True  # a request without `Upgrade: websocket` gets 426; false: forwarded as plain HTTP


class BrokerSpec(_Model):
    """`spec.brokers[]`: an MQTT broker iot routes publish to (docs/iot-adapter.md). Each worker keeps
    one MQTT v5 connection per broker in its runtime, across reloads while this entry is unchanged."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    address: str  # host:port
    client_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,40}$")] = "adapter-gateway"  # + worker pid
    keepalive: Duration = 30.0
    connect_timeout: Duration = 0.5  # a request waits this long for a connection, then 503
    username: str | None = None
    password_env: Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]*$")] | None = None  # the password's env var

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        split_host_port(v)
        return v


class IotCommandSpec(_Model):
    """One device command of an iot route: where it is published, what is sent, where the reply comes.
    Topics are topic templates (`plant/{$.device}/set`); `payload` and `response` are JSON templates
    (docs/templates.md) over {device, command, params, correlationId, requestId, tenant} (and, for
    `response`, `reply`: the device's JSON answer)."""
    topic: Annotated[str, Field(min_length=1)]
    payload: Annotated[str, Field(min_length=1)]
    reply_topic: str | None = None  # without it: 202 once the broker acknowledged (QoS 1), no reply awaited
    response: str | None = None  # default: {device, command, topic, correlationId, reply}
    params: dict[str, Any] | None = None  # JSON Schema the request's `params` must match
    qos: Literal[0, 1, 2] = 1
    retain: bool = False
    timeout: Duration | None = None  # default: the route's iot.timeout


class IotSpec(_Model):
    """`routes[].iot`: the commands of an iot route and how requests name them (docs/iot-adapter.md)."""
    broker: Annotated[str, Field(pattern=DNS_LABEL)] | None = None  # default: the only spec.brokers entry
    commands: Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], IotCommandSpec],
                        Field(min_length=1)]
    timeout: Duration = 0.5  # how long a reply is awaited (below spec.processor.messageTimeout)
    device_pattern: str = r"^[A-Za-z0-9_.:-]{1,128}$"  # what a device id may be
    # where a reply without MQTT v5 correlation data carries the correlation id
    correlation_path: str = "$.correlationId"

class SqlSpec(_Model):
    """`routes[].sql`: the database a sql route's model writes queries for (docs/sql-adapter.md). Its
    schema is introspected when the config is loaded (a schema change takes effect at the next reload)."""
    # a SQLite file (`path`, `sqlite:path`; relative to this file's directory) or a postgresql:// URL
    database: Annotated[str, Field(min_length=1)]
    pg_schema: Annotated[str, Field(min_length=1)] = "public"  # PostgreSQL: the schema whose tables are used
    tables: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # only these (default: every table and view)
    max_rows: Annotated[int, Field(ge=1, le=10000)] = 100  # the LIMIT the gateway enforces
    timeout: Duration = 0.5  # statement timeout; below spec.processor.messageTimeout
    max_schema_bytes: Annotated[Size, Field(ge=256)] = 8192  # the schema text given to the model, at most
    max_tokens: Annotated[int, Field(ge=16)] = 512  # the model's answer (the SQL), at most
    question_field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "question"  # the body's field


class ErpOperationSpec(_Model):
    """One BPMN service task of an erp route as a REST call on the ERP service (docs/erp-adapter.md): `path`
    takes `{instance}` (the client's instance id) and `{name}` placeholders filled from the arguments;
    `parameters` is the arguments' JSON Schema (an object), the tool's schema offered to the model."""
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    path: Annotated[str, Field(pattern=r"^/[^?#\s]*$")]
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    tool: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None  # default: from the task's name
    description: str | None = None  # default: the task's name and documentation


class ErpSpec(_Model):
    """`routes[].erp`: the BPMN process an erp route's model acts in and the ERP service that runs the actions
    (docs/erp-adapter.md). The process file is parsed and checked when the config is loaded."""
    process: Annotated[str, Field(min_length=1)]  # a BPMN 2.0 XML file, relative to this file's directory
    process_id: str | None = None  # default: the file's only executable process
    service: Annotated[str, Field(pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$")]  # the ERP service's base URL
    instance_path: Annotated[str, Field(pattern=r"^/[^?#\s]*\{instance\}[^?#\s]*$")] = "/instances/{instance}"
    operations: Annotated[dict[Annotated[str, Field(min_length=1)], ErpOperationSpec], Field(min_length=1)]
    timeout: Duration = 0.4  # each call to the ERP service; twice it stays below spec.processor.messageTimeout
    instance_field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "instance"
    message_field: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = "message"
    instance_pattern: str = r"^[A-Za-z0-9_.:-]{1,128}$"  # what an instance id may be
    max_tokens: Annotated[int, Field(ge=16)] = 256  # the model's answer (the tool call), at most


class ServerTimingSpec(_Model):
    """Latency attribution for a route (docs/attribution.md): per-request metrics split by component
    and, unless `mode: metrics`, a `Server-Timing` response header. `trusted` (the default) adds the header
    only for requests from a trusted source: a tenant in `tenants` (the verified tenant, spec.tenancy) or
    a request carrying `header` (one an authenticating proxy in front of Envoy sets); `always` adds it to
    every response. A string is short for `{mode: ...}`."""
    mode: Literal["trusted", "always", "metrics"] = "trusted"
    tenants: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] | None = None

    @model_validator(mode="before")
    @classmethod
    def _short(cls, value: Any) -> Any:
        return {"mode": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _source(self) -> "ServerTimingSpec":
        if self.mode == "trusted" and not self.tenants and self.header is None:
            raise FieldError("mode", "serverTiming: trusted needs a trusted source: `tenants` (verified tenant ids) "
                             "or `header` (set by an authenticating proxy); `always` sends it to every client, "
                             "`metrics` records the metrics without the header")
        return self


class RouteSpec(_Model):
    """One client-facing path (or path prefix) and what the processor does with its requests.

    Kinds: `llm` adapts JSON in and out of a chat model; `passthrough` forwards as is; `openai`
    serves the OpenAI API (model-based dispatch, streaming, token usage); `kserve` passes KServe v2
    paths through to the backend serving the model; `tensor` maps JSON to a model's input tensors;
    `tool` executes LLM tool calls against a REST service described by OpenAPI; `rest` forwards to a
    REST service with the body mapped by a field-mapping file (legacy-contract alignment).
    """
    path: Annotated[str, Field(pattern=r"^/[^?#\s]*$")]
    match: Literal["exact", "prefix"] = "exact"  # prefix: every path starting with `path`
    name: Annotated[str, Field(pattern=DNS_LABEL)] | None = None  # default: derived from path
    kind: RouteKind | None = None  # default: llm when request/transform given, else passthrough
    target: str | None = None  # backend name, or host:port (an implicit backend); default: the only backend
    targets: tuple[str, ...] = ()  # several backends (openai, kserve kinds: dispatch by model)
    model: str | None = None  # default: spec.modelRef
    request: str | None = None  # template: client JSON -> backend request body
    transform: str | None = None  # template: backend output document -> client response
    output_schema: dict[str, Any] | None = None  # JSON Schema asked of the model; default: derived from transform
    openapi: str | None = None  # tool routes: the service's OpenAPI document (path relative to this file)
    mapping: str | None = None  # rest routes: a field-mapping file from `adapterctl align` (relative path)
    sql: SqlSpec | None = None  # sql routes: the database the model writes SQL for
    erp: ErpSpec | None = None  # erp routes: the BPMN process and the ERP service (docs/erp-adapter.md)
    plugins: tuple[Annotated[str, Field(pattern=DNS_LABEL)], ...] = ()  # names from spec.plugins, by slot
    policy: RoutePolicy = RoutePolicy()
    # an adapter bundle (spec.bundles) whose part for this route replaces request, transform and
    # outputSchema: "NAME" (its active version: the last loaded, else the only declared one) or
    # "NAME@VERSION" (pinned). Without it, a loaded bundle naming this route in its bundle.yaml applies.
    bundle: Annotated[str, Field(pattern=BUNDLE_REF)] | None = None
    server_timing: ServerTimingSpec | None = None  # latency attribution (docs/attribution.md); off by default
    iot: "IotSpec | None" = None  # kind iot: device commands over MQTT (docs/iot-adapter.md)
    websocket: WebSocketSpec | None = None  # kind websocket: socket lifetime limits (docs/websocket.md)


class BundleRouteSpec(_Model):
    """One route's part of an adapter bundle (`bundle.yaml` in the ZIP, `canary/bundle.py`): the
    route-level fields of a config, versioned. Each template is inline text or a file in the bundle
    (`requestFile`, `transformFile`); `outputSchema` is inline or `outputSchemaFile` (JSON); `plugins`
    the parameters of the route's scheduling plugins."""
    request: str | None = None
    request_file: Annotated[str, Field(min_length=1)] | None = None
    transform: str | None = None
    transform_file: Annotated[str, Field(min_length=1)] | None = None
    output_schema: dict[str, Any] | None = None
    output_schema_file: Annotated[str, Field(min_length=1)] | None = None
    # parameters of plugins the route's scheduler uses (its picker, or its profile's filters, scorers and
    # picker), by plugin name: merged over the declared ones, validated against the plugin type
    plugins: dict[Annotated[str, Field(pattern=DNS_LABEL)], dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_each(self) -> "BundleRouteSpec":
        for f in ("request", "transform", "output_schema"):
            if getattr(self, f) is not None and getattr(self, f + "_file") is not None:
                raise FieldError(f + "_file", f"set {to_camel(f)} or {to_camel(f)}File, not both")
        return self


class BundleDocSpec(_Model):
    """`bundle.yaml`: per route name, that route's templates and schema; golden cases live in `golden/`."""
    routes: Annotated[dict[Annotated[str, Field(pattern=DNS_LABEL)], BundleRouteSpec], Field(min_length=1)]


class BundleSpec(_Model):
    """An adapter bundle the gateway may use (`spec.bundles`): `path` a bundle ZIP read with the config
    (relative to the config file), or no path: bundles of this `name` may be loaded at run time
    (`adapterctl bundle load`). `publicKey` (an ed25519 public key file): the bundle must be signed by it;
    `requireSignature` without a key refuses unsigned bundles (and every bundle: a key is needed)."""
    name: Annotated[str, Field(pattern=DNS_LABEL)] | None = None  # default (with a path): the manifest's name
    path: Annotated[str, Field(min_length=1)] | None = None
    public_key: Annotated[str, Field(min_length=1)] | None = None
    require_signature: bool = False

    @model_validator(mode="after")
    def _named(self) -> "BundleSpec":
        if self.name is None and self.path is None:
            raise FieldError("name", "a bundle entry needs a path (a bundle ZIP), a name (bundles of that name may be "
                             "loaded at run time), or both")
        return self


class TenantCpu(_Model):
    limit: Cpu
    burst: Annotated[float, Field(ge=0, le=10)] = 0.0  # extra share of limit tolerated before 429


class TenantBudget(_Model):
    """A tenant's request and token budget per UTC minute and day (extproc/qos/budget.py, docs/qos-budgets.md)."""
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    requests_per_day: Annotated[int, Field(ge=1)] | None = None
    tokens_per_day: Annotated[int, Field(ge=1)] | None = None
    # charged at admission for requests without max_tokens (reconciled from usage afterwards)
    estimated_completion_tokens: Annotated[int, Field(ge=0, le=10_000_000)] = 256

    @model_validator(mode="after")
    def _consistent(self) -> "TenantBudget":
        if None is self.requests_per_minute is self.tokens_per_minute is self.requests_per_day is self.tokens_per_day:
            raise ValueError("a budget needs at least one of requestsPerMinute, tokensPerMinute, requestsPerDay, "
                             "tokensPerDay")
        for unit in ("requests", "tokens"):
            minute, day = getattr(self, f"{unit}_per_minute"), getattr(self, f"{unit}_per_day")
            if minute is not None and day is not None and day < minute:
                raise FieldError(f"{unit}PerDay", f"{unit}PerDay ({day}) is below {unit}PerMinute ({minute}): "
                                 "the minute limit could never be reached")
        return self


class BudgetStoreSpec(_Model):
    """Where tenant budgets are counted: `memory` (this machine's workers share one table) or `redis`
    (every replica pointing at the same Redis shares one budget)."""
    kind: Literal["memory", "redis"] = "memory"
    url: str | None = None  # redis://host:port[/db], rediss://... or unix:///path (kind redis)
    key_prefix: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9:_.-]+$")] = "adapter-gateway:budget"
    timeout: Duration = 0.25  # per Redis operation; past it the store counts as down
    failure_mode: Literal["open", "closed"] = "open"  # store down: admit uncounted (open) or 503 (closed)

    @model_validator(mode="after")
    def _url(self) -> "BudgetStoreSpec":
        if self.kind == "redis":
            if not self.url:
                raise FieldError("url", "kind: redis needs a url, e.g. redis://127.0.0.1:6379/0")
            if not self.url.startswith(("redis://", "rediss://", "unix://")):
                raise FieldError("url", f"{self.url!r} is not a Redis URL (redis://, rediss:// or unix://)")
        elif self.url is not None:
            raise FieldError("url", "a url is only used with kind: redis (kind memory counts in this machine's "
                             "shared memory)")
        return self


class TenantSpec(_Model):
    id: Annotated[str, Field(pattern=DNS_LABEL)]
    cpu: TenantCpu | None = None
    budget: TenantBudget | None = None  # requests and tokens per minute and day (docs/qos-budgets.md)
    # Command-line glob patterns (fnmatch) of this tenant's workload processes, e.g. its own ONNX
    # Runtime server: the tenant agent places matching processes in the tenant's cgroups.
    processes: tuple[Annotated[str, Field(min_length=1)], ...] = ()


class JwtSpec(_Model):
    """Envoy verifies a JWT (jwt_authn) and the tenant is one of its claims."""
    issuer: str
    jwks: str  # inline JWKS JSON
    claim: str = "tenant"
    audiences: tuple[str, ...] = ()
    header: str = "authorization"  # where the token is (Bearer)


class TenancySpec(_Model):
    """Where a request's tenant id comes from, and what admission control does with stale data."""
    source: Literal["header", "jwt"] = "header"
    # source header: the header an authenticating proxy in front of Envoy sets (clients cannot reach
    # Envoy without it); source jwt: Envoy sets this header from the verified claim and strips any
    # client-sent copy first.
    header: Annotated[str, Field(pattern=r"^[a-z0-9-]+$")] = "x-tenant-id"
    jwt: JwtSpec | None = None
    snapshot: str = "/dev/shm/adapter-gateway/adapter-gateway.snap"  # the tenant agent's published numbers
    stale_after: Duration = 5.0  # snapshot older than this is stale
    stale_policy: Literal["admit", "reject"] = "admit"  # what admission does on a stale snapshot
    retry_after: Annotated[int, Field(ge=1, le=3600)] = 1  # Retry-After seconds on 429


class PluginSpec(_Model):
    """A named, parameterised plugin (the llm-d EndpointPickerConfig shape); routes refer to it by name.

    `type` is one of `extproc.scheduling.plugin_types()`; `parameters` are validated against that
    type's own schema when the config is compiled."""
    name: Annotated[str, Field(pattern=DNS_LABEL)] | None = None  # default: the type (as in GIE)
    type: Annotated[str, Field(min_length=1)]
    parameters: dict[str, Any] = Field(default_factory=dict)


class ProfilePluginRef(_Model):
    """One plugin of a scheduling profile: a name from `spec.plugins`, and a scorer's weight."""
    plugin_ref: Annotated[str, Field(min_length=1)]
    weight: Annotated[float, Field(gt=0)] | None = None  # scorers only; default 1


class SchedulingProfileSpec(_Model):
    """Filters (in order) -> weighted scorers -> one picker (last; default `max-score-picker`).

    Routes name a profile in `routes[].plugins` like a picker; `explain: true` logs each decision
    (candidates after each filter, every scorer's raw and normalised score, the pick)."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    plugins: tuple[ProfilePluginRef, ...] = ()
    explain: bool = False


def parse_percent(value: Any) -> float:
    """A share of traffic in percent (`10`, `2.5`, `"0.25"`): 0 to 100, in steps of 0.01 (one basis point)."""
    if isinstance(value, bool):
        raise ValueError("expected a percentage between 0 and 100, such as 10 or 2.5")
    try:
        pct = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid weight {value!r}: expected a percentage between 0 and 100, such as 10 or 2.5") \
            from None
    if not 0 <= pct <= 100:
        raise ValueError(f"weight must be a percentage between 0 and 100, got {value!r}")
    if abs(pct * 100 - round(pct * 100)) > 1e-6:
        raise ValueError(f"weight {value!r} has more than two decimals: weights are in steps of 0.01 % "
                         "(one basis point)")
    return pct


Percent = Annotated[float, BeforeValidator(parse_percent)]
HeaderName = Annotated[str, Field(pattern=r"^[a-z0-9-]+$")]  # lower-case, as Envoy passes header names


class ArmEndpoints(_Model):
    """An endpoint arm's endpoints: those of its backend whose labels match (the Kubernetes rule)."""
    match_labels: dict[str, str] = Field(alias="matchLabels", min_length=1)


class RolloutArmSpec(_Model):
    """One arm of a rollout and its share in percent: a backend that serves its requests (one of the
    route's targets), optionally only those of its endpoints whose labels match (`endpoints:
    {matchLabels: {...}}`: an endpoint variant, such as the nodes running a new model version or LoRA
    adapter), or an adapter bundle version whose templates its requests use (`bundle: NAME@VERSION`,
    from spec.bundles; the route's own backend serves them)."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    backend: Annotated[str, Field(min_length=1)] | None = None  # one of the route's targets
    endpoints: ArmEndpoints | None = None  # with backend: only its endpoints with these labels
    bundle: Annotated[str, Field(pattern=BUNDLE_REF)] | None = None  # or a bundle: NAME@VERSION
    weight: Percent | None = None  # the baseline (first arm): default the rest; canaries: required

    @model_validator(mode="after")
    def _one_kind(self) -> "RolloutArmSpec":
        if self.endpoints is not None and self.backend is None:
            raise FieldError("endpoints", "an endpoint arm names its backend too (backend: NAME, endpoints: "
                             "{matchLabels: ...}): the endpoints are that backend's")
        if (self.backend is None) == (self.bundle is None):
            raise FieldError("backend", "an arm is exactly one of backend: NAME (a route target) or bundle: "
                             "NAME@VERSION (an adapter bundle)" + (", not both" if self.backend else ""))
        if self.bundle is not None and "@" not in self.bundle:
            raise FieldError("bundle", f"{self.bundle!r} names no version: a bundle arm is NAME@VERSION (an arm is "
                             "one fixed version)")
        return self


class RolloutKeySource(_Model):
    """Where a request's assignment key comes from: exactly one of `header` (a header the route
    trusts, see `trustedHeaders`), `claim` (a verified JWT claim: not available yet) or `tenant: true`."""
    header: HeaderName | None = None
    claim: Annotated[str, Field(min_length=1)] | None = None
    tenant: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> "RolloutKeySource":
        given = [k for k in ("header", "claim", "tenant") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a key source is exactly one of {header: NAME}, {claim: PATH} or {tenant: true}"
                             + (f", not {' and '.join(given)}" if given else ""))
        if self.tenant is False:
            raise FieldError("tenant", "must be true (leave the source out to not key on the tenant)")
        return self


class RolloutForce(_Model):
    """The header that forces an arm (`true`: the first canary, `false`: the baseline, or an arm's name)."""
    header: HeaderName


class RolloutKeySpec(_Model):
    """How requests get their sticky key; the first source with a value wins, keyless requests are
    spread at random by the weights. A header is used only when listed in `trustedHeaders` (set by
    the gateway's edge, which strips the client's copy)."""
    sources: tuple[RolloutKeySource, ...] = ()
    trusted_headers: tuple[HeaderName, ...] = ()
    force: RolloutForce | None = None  # absent: no forcing


class RolloutLatencyRuleSpec(_Model):
    """A latency-like metric's rule (`canary.judge.LatencyRule`): it fails when a quantile of the
    canary exceeds the baseline's by more than max(marginMs, marginRatio x the baseline's) and the
    one-sided Mann-Whitney U test agrees. Absent fields take canary/judge.py's defaults."""
    margin_ms: Annotated[float, Field(ge=0)] | None = None
    quantiles: tuple[Annotated[float, Field(ge=0, le=1)], ...] | None = None
    margin_ratio: Annotated[float, Field(ge=0)] | None = None


class RolloutErrorRuleSpec(_Model):
    """The error rule (`canary.judge.ErrorRule`), in percent: the canary fails when its error rate is
    at least `maxRatePercent`, more than `marginPercent` points above the baseline's, and Fisher's
    exact test agrees. Absent fields take canary/judge.py's defaults."""
    max_rate_percent: Annotated[float, Field(ge=0, le=100)] | None = None
    margin_percent: Annotated[float, Field(ge=0, le=100)] | None = None


class RolloutJudgeSpec(_Model):
    """The judge's thresholds (`canary.judge.JudgeConfig`); absent fields take its defaults (the
    brief's thresholds), except `minSamples`: min(the judge's default, the plan's minSamples), >= 2."""
    alpha: Annotated[float, Field(gt=0, lt=1)] | None = None  # the U tests, per metric and judgement
    error_alpha: Annotated[float, Field(gt=0, lt=1)] | None = None  # the Fisher test
    min_samples: Annotated[int, Field(ge=2)] | None = None  # per arm
    latency: RolloutLatencyRuleSpec = RolloutLatencyRuleSpec()
    ttft: RolloutLatencyRuleSpec = RolloutLatencyRuleSpec()
    errors: RolloutErrorRuleSpec = RolloutErrorRuleSpec()
    metrics: tuple[Literal["latency_ms", "ttft_ms", "error"], ...] | None = None


class RolloutWindowSpec(_Model):
    """The per-arm windows (`canary.judge.WindowConfig`): the last `size` latencies and TTFTs and
    the last `errorSize` error flags per arm, optionally no older than `maxAge`."""
    size: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    error_size: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_age: Duration | None = None


class RolloutPlanSpec(_Model):
    """Automatic control of a rollout (`canary/control.py`): a step plan (`canary.plan.PlanConfig`;
    absent fields take its defaults) judged every `interval` on per-arm windows fed from every
    worker's finished requests. Without a `plan:` block a rollout stays at its configured weights."""
    steps: tuple[Percent, ...] | None = None  # percent of traffic on the ramped canary
    min_samples: Annotated[int, Field(ge=0)] | None = None  # per arm, for an automatic promotion
    dwell: Duration | None = None  # at least this long at a step before an automatic promotion
    # how often the controller judges: every judgement is a chance of a false rollback (perf/bench_canary.py
    # measured A/A at 60 s: 1 in 400); a short interval for tests and demos only
    interval: Duration = 60.0
    arm: Annotated[str, Field(pattern=DNS_LABEL)] | None = None  # the ramped canary; default the first
    rollback_while_paused: bool | None = None
    window: RolloutWindowSpec = RolloutWindowSpec()
    judge: RolloutJudgeSpec = RolloutJudgeSpec()


class RolloutSpec(_Model):
    """A canary rollout on one or more routes: the first arm is the baseline, the others canaries
    (backends among the route's targets), weights in percent; assignment is sticky per key."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    route: Annotated[str, Field(min_length=1)] | None = None  # a route's name
    routes: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # or several
    arms: tuple[RolloutArmSpec, ...]  # the baseline first, then at least one canary
    key: RolloutKeySpec = RolloutKeySpec()
    salt: Annotated[str, Field(min_length=1)] | None = None  # default: the rollout's name
    plan: RolloutPlanSpec | None = None  # automatic step plan; absent: manual (the weights above)

    @model_validator(mode="after")
    def _two_arms(self) -> "RolloutSpec":  # after the arms validated: one error, not one per bad arm as well
        if len(self.arms) < 2:
            raise FieldError("arms", f"a rollout needs a baseline and at least one canary: 2 arms or more, not "
                             f"{len(self.arms)}")
        return self


class EppTlsSpec(_Model):
    """TLS on the EPP port: what kgateway and Envoy AI Gateway connect with (any certificate: they
    validate none); PEM files, absolute paths (a mounted Kubernetes secret)."""
    cert_file: Annotated[str, Field(pattern=r"^/")]
    key_file: Annotated[str, Field(pattern=r"^/")]


class EppSpec(_Model):
    """EPP mode: the processor is the endpoint picker of a Gateway API InferencePool (docs/config.md).

    The gateway's Envoy sends no route metadata of ours: every ext_proc stream that carries none is
    served as an EPP stream of `pool` (the backend whose endpoints are the InferencePool's
    `ip:port`s), scheduled by `profile` (a scheduling profile or a picker of `spec.plugins`)."""
    pool: Annotated[str, Field(pattern=DNS_LABEL)]
    profile: Annotated[str, Field(pattern=DNS_LABEL)]
    max_body_bytes: Size = 1024 * 1024  # request bodies the EPP buffers to parse (413 beyond)
    health_port: Port | None = None  # also serve grpc.health.v1 on this port (GIE's probes use 9003)
    tls: EppTlsSpec | None = None  # serve the EPP port over TLS (default: plaintext h2c)
    model_rewrites: dict[Annotated[str, Field(min_length=1)], Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict)  # `model` in the body: client name -> the name the pool serves


class TracingSpec(_Model):
    """`spec.tracing`: OpenTelemetry traces of Envoy and the processor, exported over OTLP/gRPC to one
    collector (extproc/tracing.py, docs/tracing.md). Absent: no tracing at all (the default)."""
    endpoint: str  # the collector's OTLP/gRPC "host:port" (plaintext), for Envoy and every worker
    sampling_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0  # share of new traces recorded
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "adapter-gateway"  # + -envoy/-processor
    export_timeout: Duration = 5.0  # per OTLP export call (the processor's exports run off the event loop)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        split_host_port(v)
        return v


class OtlpMetricsSpec(_Model):
    """`spec.otlpMetrics`: the GenAI metrics (OpenTelemetry semantic conventions, extproc/genai.py) exported
    over OTLP/gRPC by every worker too (extproc/genai_otlp.py, docs/operations.md). Absent: Prometheus only."""
    endpoint: str  # the collector's OTLP/gRPC "host:port" (plaintext)
    interval: Annotated[Duration, Field(ge=0.1, le=3600)] = 15.0  # how often each worker exports
    export_timeout: Annotated[Duration, Field(gt=0, le=600)] = 5.0  # per OTLP export call (off the event loop)
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "adapter-gateway"  # + -processor

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        split_host_port(v)
        return v


CLASS_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$"  # a priority class: P0, P1, interactive, batch


class QosClassSpec(_Model):
    """A priority class (docs/qos.md): the first class is the most urgent. `critical` requests are
    never shed by the glitch breaker (default: the first class only); `enginePriority` is what an
    OpenAI-API engine that declares support gets as vLLM's `priority` (lower runs first; default the
    class's index), `tritonPriority` what a KServe v2 engine gets as the `priority` parameter
    (Triton's levels: 1 is the highest; default index + 1)."""
    name: Annotated[str, Field(pattern=CLASS_NAME)]
    critical: bool | None = None
    engine_priority: int | None = None
    triton_priority: Annotated[int, Field(ge=1)] | None = None


def _default_classes() -> tuple[QosClassSpec, ...]:
    return tuple(QosClassSpec(name=n) for n in ("P0", "P1", "P2"))


class QosSloSpec(_Model):
    """An SLO over the requests it selects (all given selectors must match; none: every request):
    TTFT, time per output token and end-to-end latency thresholds that `target` percent of the
    requests must meet (`p99: 2s` with the default target 99 is "p99 under 2 s"), and an error-rate
    ceiling in percent. Attainment is computed per window (`spec.qos.window`)."""
    name: Annotated[str, Field(pattern=DNS_LABEL)]
    route: Annotated[str, Field(min_length=1)] | None = None
    tenant: Annotated[str, Field(min_length=1)] | None = None
    priority_class: Annotated[str, Field(min_length=1)] | None = None
    ttft: Duration | None = None
    tpot: Duration | None = None
    p99: Duration | None = None
    error_rate: Annotated[float, Field(ge=0, lt=100)] | None = None  # percent
    target: Annotated[float, Field(gt=0, le=100)] = 99.0  # percent of requests within each latency threshold

    @model_validator(mode="after")
    def _some_objective(self) -> "QosSloSpec":
        if self.ttft is None and self.tpot is None and self.p99 is None and self.error_rate is None:
            raise FieldError("name", f"SLO {self.name!r} declares no objective: set ttft, tpot, p99 or errorRate")
        return self


class QosRouteSpec(_Model):
    """A route's QoS: its requests' priority class, whether its work is latency- or throughput-
    sensitive (the priority matrix), and a client header it trusts to name the class or an
    objective (`x-gateway-inference-objective`, the Gateway API inference extension's header):
    set it only where the gateway's edge strips the client's copy, like `policy.tenantHeader`."""
    route: Annotated[str, Field(min_length=1)]
    priority_class: Annotated[str, Field(min_length=1)] | None = None
    workload: Literal["latency", "throughput"] = "latency"
    objective_header: HeaderName | None = None


class QosTenantSpec(_Model):
    """A tenant's priority class and glitch threshold: its requests' P99 (per window) above
    `glitchThreshold` for `breaker.windows` windows in a row sheds its non-critical requests."""
    tenant: Annotated[str, Field(min_length=1)]
    priority_class: Annotated[str, Field(min_length=1)] | None = None
    glitch_threshold: Duration | None = None
    weight: Annotated[float, Field(gt=0, le=1000)] | None = None  # fair share in a pool's queue (default 1)


class QosMatrixSpec(_Model):
    """The brief's priority matrix: while an SLO a request falls under deviates below `below`
    (attainment minus target, in percentage points, over the last `horizon` windows), latency-
    sensitive requests of the `applyTo` classes run as the first class and throughput-sensitive
    ones as the last; back to their class once the deviation is at or above `recover`."""
    enabled: bool = True
    below: float = -5.0
    recover: float = -2.0
    horizon: Annotated[int, Field(ge=1, le=600)] = 10
    apply_to: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # default: the default class


class QosBreakerSpec(_Model):
    """The glitch breaker (docs/qos.md): trips after `windows` windows in a row whose P99 is over the
    tenant's threshold (windows with fewer than `minSamples` requests are skipped, up to `maxGap` in a
    row), recovers after `recoveryWindows` windows that are not; shed requests get 429 with
    `Retry-After: retryAfter`."""
    windows: Annotated[int, Field(ge=1, le=1000)] = 3
    recovery_windows: Annotated[int, Field(ge=1, le=1000)] = 3
    min_samples: Annotated[int, Field(ge=1, le=100000)] = 1
    max_gap: Annotated[int, Field(ge=0, le=100000)] = 10
    latency: Literal["e2e", "ttft"] = "e2e"
    retry_after: Annotated[int, Field(ge=1, le=3600)] = 1


class QosSheddingSpec(_Model):
    """How sheddable classes are shed (extproc/qos/shedding.py): `immediate` (default) refuses one at once
    when its estimated wait is over maxWait; `gradual` with a PIE-style probability per class, raised while
    the pool's queueing delay stays over `target` (default maxWait / 4), updated every `interval`."""
    mode: Literal["immediate", "gradual"] = "immediate"
    target: Duration | None = None
    interval: Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=10.0)] = 0.1
    alpha: Annotated[float, Field(ge=0, le=100.0)] = 0.125
    beta: Annotated[float, Field(ge=0, le=100.0)] = 1.25
    max_probability: Annotated[float, Field(gt=0, le=1.0)] = 1.0


class QosAdmissionSpec(_Model):
    """A backend pool's adaptive concurrency limit (TTFT gradient, extproc/qos/limiter.py) and gateway
    queue (extproc/qos/queue.py, docs/qos.md): requests over the limit wait, by priority class, tenant
    fair share and deadline, at most `maxWait` (below spec.processor.messageTimeout; default 80 % of
    it), `maxQueue` requests and `maxQueueBytes` of bodies; `sheddable` classes (default the last) get
    429 with `Retry-After: retryAfter`, the others 503. `reserve`: the fraction of the limit (at most
    half) that only `reserveClasses`' own requests (default the critical classes, P0) may use.
    `enabled: false` keeps the entry but turns it off."""
    backend: Annotated[str, Field(min_length=1)]
    enabled: bool = True
    initial_limit: Annotated[int, Field(ge=1, le=100000)] = 8
    min_limit: Annotated[int, Field(ge=1, le=100000)] = 1
    max_limit: Annotated[int, Field(ge=1, le=100000)] = 256
    tolerance: Annotated[float, Field(ge=1.0, le=10.0)] = 2.0
    smoothing: Annotated[float, Field(gt=0, le=1.0)] = 0.2
    samples: Annotated[int, Field(ge=1, le=10000)] = 8
    min_rtt_window: Duration = 30.0
    max_queue: Annotated[int, Field(ge=0, le=1000000)] = 256
    max_queue_bytes: Size = 16 * 1024 * 1024
    max_wait: Duration | None = None
    sheddable: tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    retry_after: Annotated[int, Field(ge=1, le=3600)] = 1
    poll: Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=1.0)] = 0.005
    fairness_window: Annotated[float, BeforeValidator(parse_duration), Field(gt=0, le=3600)] = 1.0
    shedding: QosSheddingSpec = QosSheddingSpec()
    reserve: Annotated[float, Field(ge=0, le=0.5)] = 0.0
    reserve_classes: tuple[Annotated[str, Field(min_length=1)], ...] | None = None


class QosBriefBatchSpec(_Model):
    """The brief's updateBatchSize (docs/qos.md "Batch policies"): ratio r < low -> base * (1 - (low - r)
    * gain); r > high -> base * boost; else base; clamped to [minSize, maxSize]. Ratios are fractions."""
    base: Annotated[int, Field(ge=1, le=4096)] = 32
    low: Annotated[float, Field(gt=0, lt=1)] = 0.9
    high: Annotated[float, Field(gt=0, lt=1)] = 0.95
    gain: Annotated[float, Field(gt=0)] = 5.0
    boost: Annotated[float, Field(ge=1)] = 1.5
    min_size: Annotated[int, Field(ge=1, le=4096)] = 1
    max_size: Annotated[int, Field(ge=1, le=4096)] = 4096


class QosAimdBatchSpec(_Model):
    """AIMD of max_batch_size (docs/qos.md "Batch policies"): + step after `hold` windows with attainment
    >= target (a fraction), x factor on a violation (at most once per `cooldown` windows)."""
    target: Annotated[float, Field(gt=0, le=1)] = 0.95
    start: Annotated[int, Field(ge=1, le=4096)] | None = None  # default: maxSize
    step: Annotated[int, Field(ge=1, le=4096)] = 2
    factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    hold: Annotated[int, Field(ge=1, le=1000)] = 3
    cooldown: Annotated[int, Field(ge=0, le=1000)] = 3
    min_size: Annotated[int, Field(ge=1, le=4096)] = 1
    max_size: Annotated[int, Field(ge=1, le=4096)] = 48


class QosBatchControlSpec(_Model):
    """A batch controller (docs/qos.md "Batch policies"): every `period` the supervisor reads the
    attainment of `slo` (server time, a bound of the server's latency histogram) for `model` on each
    endpoint of the onnxruntime `backend` and writes `policy`'s batch size through its admin endpoint,
    holding the model's lease (`lease`) so one controller acts per endpoint."""
    backend: Annotated[str, Field(min_length=1)]
    model: Annotated[str, Field(min_length=1)]
    policy: Literal["static", "brief", "aimd"] = "brief"
    slo: Duration
    period: Annotated[Duration, Field(ge=0.01, le=60)] = 0.1
    lease: Annotated[Duration, Field(ge=0.05, le=60)] = 1.0
    brief: QosBriefBatchSpec = QosBriefBatchSpec()
    aimd: QosAimdBatchSpec = QosAimdBatchSpec()


class QosSpec(_Model):
    """SLO-driven QoS (docs/qos.md): priority classes, SLOs and their attainment per window, the
    priority matrix, the glitch breaker. Absent: no route pays anything for it."""
    window: Duration = 0.1
    classes: tuple[QosClassSpec, ...] = Field(default_factory=_default_classes, min_length=1)
    default_class: Annotated[str, Field(min_length=1)] = "P1"
    # values of a trusted objective header -> class (a class's own name is always accepted)
    objectives: dict[Annotated[str, Field(min_length=1)], Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict)
    engine_priority: tuple[Annotated[str, Field(min_length=1)], ...] = ()  # backends whose engine takes a priority
    slos: tuple[QosSloSpec, ...] = ()
    routes: tuple[QosRouteSpec, ...] = ()
    tenants: tuple[QosTenantSpec, ...] = ()
    matrix: QosMatrixSpec = QosMatrixSpec()
    breaker: QosBreakerSpec = QosBreakerSpec()
    batch_control: tuple[QosBatchControlSpec, ...] = ()  # the supervisor's batch controllers (ONNX Runtime)
    admission: tuple[QosAdmissionSpec, ...] = ()  # pools with a concurrency limit and a gateway queue


class GatewaySpec(_Model):
    model_ref: str | None = None  # "name[@registry]": default model for llm routes
    protocol: Literal["http", "grpc"] = "http"  # default backend transport
    listener: ListenerSpec = ListenerSpec()
    admin: AdminSpec = AdminSpec()
    processor: ProcessorSpec = ProcessorSpec()
    backends: tuple[BackendSpec, ...] = ()
    routes: tuple[RouteSpec, ...] = ()  # at least one, unless `epp` is set
    tenants: tuple[TenantSpec, ...] = ()
    tenancy: TenancySpec = TenancySpec()
    budget_store: BudgetStoreSpec = BudgetStoreSpec()  # where tenants' budgets are counted
    plugins: tuple[PluginSpec, ...] = ()
    scheduling_profiles: tuple[SchedulingProfileSpec, ...] = ()
    epp: EppSpec | None = None  # EPP mode (a Gateway API InferencePool's endpoint picker)
    rollouts: tuple[RolloutSpec, ...] = ()  # canary rollouts of routes' backends (docs/config.md)
    bundles: tuple[BundleSpec, ...] = ()  # adapter bundles routes and rollout arms use (docs/canary.md)
    qos: QosSpec | None = None  # SLOs, priority classes, the glitch breaker (docs/qos.md)
    tracing: TracingSpec | None = None  # OpenTelemetry traces (docs/tracing.md); off when absent
    otlp_metrics: OtlpMetricsSpec | None = None  # the GenAI metrics over OTLP too (docs/operations.md); off when absent
    brokers: tuple[BrokerSpec, ...] = ()  # MQTT brokers of iot routes (docs/iot-adapter.md)

    @model_validator(mode="after")
    def _some_route(self) -> "GatewaySpec":
        if not self.routes and self.epp is None:
            raise FieldError("routes", "at least one route is needed (or an `epp` section: EPP mode)")
        return self


class AdapterGateway(_Model):
    api_version: Literal["adapter.ai/v1"]
    kind: Literal["AdapterGateway"]
    metadata: Metadata
    spec: GatewaySpec


def split_host_port(endpoint: str) -> tuple[str, int]:
    """`"10.0.0.7:8000"`, `"finance-backend:8080"`, `"[::1]:80"` to (host, port); ValueError otherwise."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r} must be host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not re.match(r"^[A-Za-z0-9.\-:]+$", host):
        raise ValueError(f"endpoint {endpoint!r} has an invalid host")
    return host, int(port)
