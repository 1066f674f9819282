"""Core data types of the processor: what flows through the pipeline. Imports no sibling module.

What: `Phase` (the ext_proc message kinds, named once), `HttpMessage` (one decoded message),
`RequestState` (the one per-request object every stage reads and writes, like mitmproxy's flow),
the verdicts a stage returns (`Continue`, `Mutate`, `Reject` for errors, `Respond` for answers the
processor makes itself), and `Outcome`, how a request ended (given to `on_done` exactly once).
Why: stages never see protobuf; only `extproc/codec.py` converts between these and ext_proc
messages, so the protocol can change without touching a stage (GIE #2082's lesson). Errors are
structured (status, code, message, fields, retry-after): the route's dialect renders them, so a
stage never needs to know whether the client speaks OpenAI, KServe or our own JSON.
Cost: plain slotted dataclasses; creating a state is a few hundred nanoseconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping


class Phase(enum.Enum):
    """The six ext_proc message kinds; the value is the protobuf oneof field name."""

    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    REQUEST_TRAILERS = "request_trailers"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE_BODY = "response_body"
    RESPONSE_TRAILERS = "response_trailers"


class Outcome(enum.Enum):
    """How one request ended; the value is the `outcome` label of `adapter_processor_requests_total`.

    ok: answered (2xx/3xx, by the backend or the processor); rejected: refused by the processor before
    any backend was asked, whatever the status (400/401/404/413/429, and the 503s unknown_route,
    config_mismatch, quota_data_stale, no_capacity), or a 4xx from the backend; backend_error: a 5xx
    from the backend or on its behalf (Envoy's 503 for a backend that is down, the processor's 502 for output it cannot map);
    truncated: the backend ended a stream before it was complete; cancelled: the client went away
    (reset, disconnect) before the answer was complete; timeout: the upstream or stream timed out (504).
    """

    OK = "ok"
    REJECTED = "rejected"
    BACKEND_ERROR = "backend_error"
    TRUNCATED = "truncated"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"


@dataclass(slots=True)
class HttpMessage:
    """One decoded ProcessingRequest: headers (lower-case names) or a body chunk."""

    phase: Phase
    headers: Mapping[str, str] | None = None
    body: bytes = b""
    end_of_stream: bool = False
    attributes: Mapping[str, Any] | None = None  # Envoy attributes, e.g. {"response.code": 200}
    # the verified JWT payload Envoy's jwt_authn forwarded (request headers; a protobuf Struct: codec.claims_dict)
    claims: Any = None


@dataclass(frozen=True, slots=True)
class Continue:
    """Let the message through unchanged."""


CONTINUE = Continue()


@dataclass(frozen=True, slots=True)
class Mutate:
    """Change headers and/or the body of the current message.

    `clear_route_cache` makes Envoy re-match the route after header changes (the processor picks the
    backend this way); `body=None` leaves the body alone; `skip_body` (in a headers reply) tells
    Envoy not to send this message's body, which then streams through untouched;
    `dynamic_metadata` is `((namespace, {key: value}), ...)` for Envoy's later filters, the load
    balancer (`envoy.lb`) and the access log (`adapter`).
    """

    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    clear_route_cache: bool = False
    skip_body: bool = False
    dynamic_metadata: tuple[tuple[str, Mapping[str, Any]], ...] = ()

    def merge(self, other: "Mutate") -> "Mutate":
        return Mutate(
            self.set_headers + other.set_headers,
            self.remove_headers + other.remove_headers,
            other.body if other.body is not None else self.body,
            self.clear_route_cache or other.clear_route_cache,
            self.skip_body or other.skip_body,
            self.dynamic_metadata + other.dynamic_metadata,
        )


@dataclass(frozen=True, slots=True)
class Reject:
    """Refuse the request now with an error (status >= 400); it goes no further.

    Structured, not pre-rendered: the route's dialect (`extproc/errors.py`) turns it into the
    body its clients parse (the OpenAI error object, KServe's `{"error": ...}`, ours). `code` is a
    short machine code (metrics label, `x-adapter-error` header, Envoy's %RESPONSE_CODE_DETAILS%);
    `fields` are extra facts for the body (`limit`, `tenant`, `param`, ...); `retry_after` (seconds)
    becomes a `Retry-After` header.
    """

    status: int
    code: str
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    retry_after: int | None = None
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def reason(self) -> str:
        return self.code

    @property
    def body(self) -> bytes:
        """The error in our own dialect (the codec renders the route's; this is for logs and tests)."""
        from extproc.errors import render

        return render("adapter", self)


@dataclass(frozen=True, slots=True)
class Respond:
    """Answer the client now with a body the processor made (health, `GET /models`): not an error."""

    status: int
    body: bytes
    reason: str
    headers: tuple[tuple[str, str], ...] = ()


Verdict = Continue | Mutate | Reject | Respond


# Client headers kept at request headers for the scheduling plugins that decide at the body (the
# headers are not kept otherwise): `state.attrs[name]` = the value, when the client sent one.
# x-task-intent: intent-filter's routing hint; x-slo-ttft-ms: ttft-headroom-scorer's per-request SLO.
HINT_HEADERS = ("x-task-intent", "x-slo-ttft-ms")


@dataclass(slots=True)
class RequestState:
    """Everything known about one HTTP request, carried across its ext_proc messages.

    The config snapshot is captured once when the stream opens, so one request sees one config
    even if a reload happens mid-flight. `runtime` is the worker's long-lived state (it outlives
    snapshots); `request` the one parsed view of the body (`extproc/request.py`). The fields from
    `token` on belong to the lifecycle (`extproc/lifecycle.py`): stages read them, only it writes.
    """

    snapshot: Any  # extproc.config.snapshot.Snapshot
    route: Any  # extproc.config.snapshot.Route | None
    started: float  # monotonic seconds
    request_id: str = ""
    debug: bool = False
    tenant: str | None = None
    backend: str | None = None  # the name of the backend chosen by dispatch
    target: Any = None  # that backend (extproc.config.snapshot.Backend)
    endpoint: str | None = None  # "ip:port" the processor picked (None: Envoy balances)
    # what the pick counts in the in-flight table until the request ends: (tokens, prefill tokens still
    # pending: the prefill is done at the first response body, extproc/stages/dispatch.dispatched)
    inflight: tuple[int, int] | None = None
    variant: str | None = None  # the variant chosen by dispatch (canary), if any
    variant_unit: int | None = None  # its assignment key's id (canary.assign.unit), keyed requests only
    request: Any = None  # extproc.request.InferenceRequest
    input_doc: Any = None
    backend_request: bytes | None = None
    response_status: int | None = None
    usage: Any = None  # backends.base.Usage, when the backend reported it
    quota_stale: bool = False  # admission ran on stale tenant data
    observed: Outcome | None = None  # what a stage saw that status codes do not show (truncated)
    first_byte: float | None = None  # monotonic time of the first response message the stream saw
    # monotonic time of the first response body bytes the stream saw (streamed bodies: an SSE stream's
    # first event, which engines send with the first token, so first_body - started is the TTFT seen here)
    first_body: float | None = None
    served: str | None = None  # "ip:port" of the endpoint that answered (Envoy's `upstream.address`)
    # Envoy's `response.code_details` of the response: "via_upstream" when the upstream answered, else
    # why Envoy answered itself (e.g. "upstream_reset_before_response_started{connection_failure}")
    response_details: str | None = None
    runtime: Any = None  # extproc.runtime.Runtime
    attrs: dict[str, Any] = field(default_factory=dict)  # stage-private values (one stage writes and reads)
    # lifecycle
    token: str = ""  # unique per worker; Envoy's access log carries it back
    token_sent: bool = False  # Envoy has it (a reply with the metadata went out)
    reply_status: int | None = None  # the processor answered the client itself (Reject/Respond)
    reply_code: str | None = None
    stream_end: str | None = None  # "end" | "cancelled" | "error", once the ext_proc stream is over
    complete: bool = False  # the stream saw every phase the route reads (or the processor answered)
    # the answer's in-band end went to the client (an SSE stream's `[DONE]`, or the client API's closing
    # events): a client that closes right after it (the openai SDK does, at `[DONE]`) got the whole answer
    delivered: bool = False
    completion: Any = None  # extproc.lifecycle.Completion from Envoy's access log
    outcome: Outcome | None = None  # set once, when on_done fires
