"""The one place that converts between ext_proc protobuf messages and the core types.

What: `decode(ProcessingRequest) -> HttpMessage` and `encode(phase, verdict) -> ProcessingResponse`,
on the upb protobuf classes from `xds-protos`.
Why: stages never see protobuf; the Envoy traps live here, once:
- header values go in `raw_value` (a `value` alone arrives as an empty header);
- `clear_route_cache` is ignored unless the same reply carries a `header_mutation`, so one is always
  present when it is set;
- an immediate response is how a stage's `Reject` (rendered here in the route's dialect by
  `extproc/errors.py`) or `Respond` reaches the client, with `x-adapter-error` and `details` naming
  the reason (Envoy's %RESPONSE_CODE_DETAILS%);
- dynamic metadata (a `Mutate`'s, and the lifecycle's `adapter.worker`/`adapter.token` on a
  stream's first reply) goes in `ProcessingResponse.dynamic_metadata`, which Envoy applies for the
  namespaces the filter's `metadata_options` lets in (`adapter`, `envoy.lb`).
Cost: about 2 to 4 us per message (parse plus build), under 1% of a stream's cost.
"""

from __future__ import annotations

from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import errors
from extproc.types import Continue, HttpMessage, Mutate, Phase, Reject, Respond, Verdict

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse

_PHASES = {p.value: p for p in Phase}
_ATTR_NS = "envoy.filters.http.ext_proc"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
ERROR_HEADER = "x-adapter-error"
# Dynamic metadata on every immediate response: Envoy's local-reply mapper keeps these bodies as
# they are (they are already JSON) instead of wrapping them like its own error replies.
METADATA_NAMESPACE = "adapter"
_NONE = processing_mode_pb2.ProcessingMode.NONE


def decode(req: Any) -> HttpMessage:
    which = req.WhichOneof("request")
    phase = _PHASES[which]
    part = getattr(req, which)
    attributes = _attributes(req) if len(req.attributes) else None
    if phase is Phase.REQUEST_HEADERS or phase is Phase.RESPONSE_HEADERS:
        headers = {h.key: h.raw_value.decode("utf-8", "replace") for h in part.headers.headers}
        claims = _claims(req) if phase is Phase.REQUEST_HEADERS and req.HasField("metadata_context") else None
        return HttpMessage(phase, headers=headers, end_of_stream=part.end_of_stream, attributes=attributes,
                           claims=claims)
    if phase is Phase.REQUEST_BODY or phase is Phase.RESPONSE_BODY:
        return HttpMessage(phase, body=part.body, end_of_stream=part.end_of_stream, attributes=attributes)
    trailers = {h.key: h.raw_value.decode("utf-8", "replace") for h in part.trailers.headers}
    return HttpMessage(phase, headers=trailers, end_of_stream=True, attributes=attributes)


JWT_NAMESPACE = "envoy.filters.http.jwt_authn"  # where jwt_authn's payload_in_metadata puts the payload
JWT_PAYLOAD_KEY = "jwt_payload"


def _claims(req: Any) -> Any:
    """The verified JWT payload Envoy forwarded in the message's metadata, as the protobuf Struct (read
    into a dict only by a rollout keyed on a claim: `claims_dict`); None when there is none."""
    ns = req.metadata_context.filter_metadata.get(JWT_NAMESPACE)
    if ns is None or JWT_PAYLOAD_KEY not in ns.fields:
        return None
    value = ns.fields[JWT_PAYLOAD_KEY]
    return value.struct_value if value.WhichOneof("kind") == "struct_value" else None


def claims_dict(struct: Any) -> dict[str, Any] | None:
    """A forwarded JWT payload (`HttpMessage.claims`) as plain JSON values."""
    if struct is None:
        return None
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(struct)


def _attributes(req: Any) -> dict[str, Any]:
    struct = req.attributes.get(_ATTR_NS)
    if struct is None:
        return {}
    out: dict[str, Any] = {}
    for key, value in struct.fields.items():
        kind = value.WhichOneof("kind")
        out[key] = None if kind == "null_value" else getattr(value, kind)
    return out


def encode(phase: Phase, verdict: Verdict, dialect: str = "adapter", route: str | None = None,
           request_id: str = "", metadata: dict[str, dict[str, Any]] | None = None) -> Any:
    """The reply to a message of `phase`. `metadata` ({namespace: {key: value}}) is added to the
    reply's dynamic metadata; errors are rendered in `dialect` naming `route` and `request_id`."""
    resp = pb.ProcessingResponse()
    if isinstance(verdict, (Reject, Respond)):
        _immediate(resp, verdict, dialect, route, request_id, metadata)
        return resp
    if metadata:
        _set_metadata(resp.dynamic_metadata, metadata)
    if isinstance(verdict, Mutate) and verdict.dynamic_metadata:
        for ns, fields in verdict.dynamic_metadata:
            _set_metadata(resp.dynamic_metadata, {ns: fields})
    part = getattr(resp, phase.value)
    if phase is Phase.REQUEST_TRAILERS or phase is Phase.RESPONSE_TRAILERS:
        part.SetInParent()
        if isinstance(verdict, Mutate):
            _header_mutation(part.header_mutation, verdict)
        return resp
    common = part.response
    part.SetInParent()
    if isinstance(verdict, Continue):
        return resp
    if verdict.set_headers or verdict.remove_headers or verdict.clear_route_cache:
        _header_mutation(common.header_mutation, verdict)
        common.header_mutation.SetInParent()  # presence is what makes clear_route_cache count
    if verdict.body is not None:
        common.body_mutation.body = verdict.body
    if verdict.clear_route_cache:
        common.clear_route_cache = True
    if verdict.skip_body:
        # Body modes in an override are literal: both NONE; header modes stay as configured.
        resp.mode_override.request_body_mode = _NONE
        resp.mode_override.response_body_mode = _NONE
    return resp


def _set_metadata(struct: Any, metadata: dict[str, Any]) -> None:
    """{namespace: {key: str | bool | number}} into a Struct, field by field (no dict conversion)."""
    for ns, fields in metadata.items():
        target = struct.fields[ns].struct_value.fields
        for key, value in fields.items():
            if isinstance(value, str):
                target[key].string_value = value
            elif isinstance(value, bool):
                target[key].bool_value = value
            elif isinstance(value, (int, float)):
                target[key].number_value = value
            else:
                target[key].string_value = str(value)


def _header_mutation(hm: Any, verdict: Mutate) -> None:
    for key, value in verdict.set_headers:
        opt = hm.set_headers.add()
        opt.header.key = key
        opt.header.raw_value = value.encode()
        opt.append_action = _OVERWRITE
    if verdict.remove_headers:
        hm.remove_headers.extend(verdict.remove_headers)


def _immediate(resp: Any, verdict: Reject | Respond, dialect: str, route: str | None, request_id: str,
               metadata: dict[str, dict[str, Any]] | None) -> None:
    if metadata:
        _set_metadata(resp.dynamic_metadata, metadata)
    _set_metadata(resp.dynamic_metadata, {METADATA_NAMESPACE: {"processor_reply": True}})
    ir = resp.immediate_response
    ir.status.code = verdict.status
    ir.details = verdict.reason
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    if isinstance(verdict, Reject):
        ir.body = errors.render(dialect, verdict, route, request_id)
        headers += ((ERROR_HEADER, verdict.code),)
        if verdict.retry_after is not None:
            headers += (("retry-after", str(verdict.retry_after)),)
    else:
        ir.body = verdict.body
    for key, value in headers + verdict.headers:
        opt = ir.headers.set_headers.add()
        opt.header.key = key
        opt.header.raw_value = value.encode()
        opt.append_action = _OVERWRITE


# --- EPP mode (extproc/epp.py): what a Gateway API inference gateway's Envoy sends and expects ---

_BODY_MODES = processing_mode_pb2.ProcessingMode.BodySendMode


def body_modes(req: Any) -> tuple[str, str] | None:
    """(request, response) body modes Envoy announces in the stream's first message
    (`protocol_config`: "FULL_DUPLEX_STREAMED", "BUFFERED", "STREAMED", "NONE", ...); None when absent."""
    if not req.HasField("protocol_config"):
        return None
    pc = req.protocol_config
    return _BODY_MODES.Name(pc.request_body_mode), _BODY_MODES.Name(pc.response_body_mode)


def filter_metadata(req: Any, namespace: str, key: str) -> Any:
    """`metadata_context.filter_metadata[namespace][key]` of a message (the namespaces the filter's
    `metadata_options.forwarding_namespaces` sends): a str, a list of str, another scalar, or None."""
    if not req.HasField("metadata_context"):
        return None
    struct = req.metadata_context.filter_metadata.get(namespace)
    if struct is None or key not in struct.fields:
        return None
    return _plain(struct.fields[key])


def _plain(value: Any) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [_plain(v) for v in value.list_value.values]
    if kind == "struct_value" or kind == "null_value" or kind is None:
        return None
    return getattr(value, kind)


def streamed_body(phase: Phase, body: bytes, end_of_stream: bool) -> Any:
    """A FULL_DUPLEX_STREAMED body reply: the bytes Envoy forwards for this body (the processor owns
    the body in that mode: what is not sent back is not forwarded)."""
    resp = pb.ProcessingResponse()
    streamed = getattr(resp, phase.value).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return resp
