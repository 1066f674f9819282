"""What every no-op stack of perf/bench_stacks.py shares: the replies, the phase of a raw request, the CLI.

Every stack answers each ProcessingRequest with the same minimal ProcessingResponse the floor
(perf/floor/floor_server.cc) sends: the matching phase's response with an empty CommonResponse
(status CONTINUE, nothing mutated) for headers and bodies, an empty TrailersResponse for trailers,
nothing for a request without a phase. `REPLIES` are those messages (for the generated-servicer
stacks), `REPLY_BYTES` their serialized form, built once (for the raw-bytes stacks), so raw and
generated stacks put the same bytes on the wire (tests/test_bench_stacks.py checks it).
Health: the gateway's rendered processor cluster health-checks grpc.health.v1 with the service name
`envoy.service.ext_proc.v3.ExternalProcessor`; every stack answers SERVING (`HEALTH_SERVING`: a
HealthCheckResponse{status: SERVING} serialized) so Envoy keeps its endpoints in rotation.
Usage of a stack: `python perf/stacks/<stack>.py --port P [--port P2 ...]`; prints `ready` once serving;
SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = f"/{SERVICE}/Process"
HEALTH_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}

# ProcessingRequest's `request` oneof: field number -> phase (the field's name).
PHASE_BY_FIELD = {f.number: f.name for f in pb.ProcessingRequest.DESCRIPTOR.oneofs_by_name["request"].fields}


def _replies() -> dict[str, pb.ProcessingResponse]:
    common = pb.CommonResponse  # status CONTINUE is the default (0), so an empty one
    return {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common())),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common())),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse(response=common())),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse(response=common())),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
    }


REPLIES = _replies()
assert set(REPLIES) == set(PHASE_BY_FIELD.values()), "a phase without a reply"
REPLY_BYTES = {phase: msg.SerializeToString() for phase, msg in REPLIES.items()}
# the raw stacks look a request's reply up by the oneof's field number directly
REPLY_BY_FIELD = {n: REPLY_BYTES[phase] for n, phase in PHASE_BY_FIELD.items()}


def reply_for(req: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
    """The generated-servicer stacks' reply: by the parsed request's oneof."""
    phase = req.WhichOneof("request")
    return REPLIES[phase] if phase is not None else None


def phase_field(data: bytes) -> int | None:
    """The field number of the `request` oneof in a serialized ProcessingRequest, without parsing it:
    walk the top-level tags, skipping other fields (Envoy writes fields in number order, so the oneof,
    fields 2-7, is normally the first tag). None when there is none or the bytes are malformed."""
    i, n = 0, len(data)
    while i < n:
        tag = shift = 0
        while True:  # varint tag
            if i >= n:
                return None
            b = data[i]
            i += 1
            tag |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
        field, wire = tag >> 3, tag & 7
        if field in REPLY_BY_FIELD:
            return field
        if wire == 0:  # varint
            while i < n and data[i] & 0x80:
                i += 1
            i += 1
        elif wire == 2:  # length-delimited
            length = shift = 0
            while True:
                if i >= n:
                    return None
                b = data[i]
                i += 1
                length |= (b & 0x7F) << shift
                if b < 0x80:
                    break
                shift += 7
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:  # groups (3, 4) are not in this proto
            return None
    return None


def raw_reply(data: bytes) -> bytes | None:
    """The raw stacks' reply: prebuilt bytes by the oneof's field number (None: nothing to answer)."""
    field = phase_field(data)
    return REPLY_BY_FIELD[field] if field is not None else None


def parse_args(doc: str | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--port", type=int, action="append", required=True, help="listen on 127.0.0.1:PORT (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    return ap.parse_args()


def ready() -> None:
    print("ready", flush=True)
