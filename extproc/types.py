"""Core data types of the processor: what flows through the pipeline. Imports no sibling module.

What: `Phase` (the ext_proc message kinds, named once), `HttpMessage` (one decoded message),
`RequestState` (the one per-request object every stage reads and writes, like mitmproxy's flow),
and the verdicts a stage returns: `Continue`, `Mutate`, `Reject`.
Why: stages never see protobuf; only `extproc/codec.py` converts between these and ext_proc
messages, so the protocol can change without touching a stage (GIE #2082's lesson).
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


@dataclass(slots=True)
class HttpMessage:
    """One decoded ProcessingRequest: headers (lower-case names) or a body chunk."""

    phase: Phase
    headers: Mapping[str, str] | None = None
    body: bytes = b""
    end_of_stream: bool = False
    attributes: Mapping[str, Any] | None = None  # Envoy attributes, e.g. {"response.code": 200}


@dataclass(frozen=True, slots=True)
class Continue:
    """Let the message through unchanged."""


CONTINUE = Continue()


@dataclass(frozen=True, slots=True)
class Mutate:
    """Change headers and/or the body of the current message.

    `clear_route_cache` makes Envoy re-match the route after header changes (the processor picks the
    backend this way); `body=None` leaves the body alone; `skip_body` (in a headers reply) tells
    Envoy not to send this message's body, which then streams through untouched.
    """

    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    body: bytes | None = None
    clear_route_cache: bool = False
    skip_body: bool = False

    def merge(self, other: "Mutate") -> "Mutate":
        return Mutate(
            self.set_headers + other.set_headers,
            self.remove_headers + other.remove_headers,
            other.body if other.body is not None else self.body,
            self.clear_route_cache or other.clear_route_cache,
            self.skip_body or other.skip_body,
        )


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the client now with `status` and a JSON body; the request goes no further.

    `reason` is a short machine code (metrics label, `x-adapter-error` header, Envoy's
    %RESPONSE_CODE_DETAILS%)."""

    status: int
    body: bytes
    reason: str
    headers: tuple[tuple[str, str], ...] = ()


Verdict = Continue | Mutate | Reject


@dataclass(slots=True)
class RequestState:
    """Everything known about one HTTP request, carried across its ext_proc messages.

    The config snapshot is captured once when the stream opens, so one request sees one config
    even if a reload happens mid-flight.
    """

    snapshot: Any  # extproc.config.snapshot.Snapshot
    route: Any  # extproc.config.snapshot.Route | None
    started: float  # monotonic seconds
    request_id: str = ""
    debug: bool = False
    tenant: str | None = None
    backend: str | None = None
    input_doc: Any = None
    backend_request: bytes | None = None
    response_status: int | None = None
    outcome: str = "ok"
    marks: dict[str, float] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
