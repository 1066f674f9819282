"""perf/stacks/ (the no-op ext_proc servers perf/bench_stacks.py measures): correctness, not timing.

- common.phase_field (the raw stacks' oneof lookup without a parse) against protobuf's WhichOneof on
  every recorded Envoy message and on requests with the other fields first, unknown fields and
  malformed bytes.
- Every stack, started as the bench starts it (its own process, real gRPC on a free port), answers each
  recorded Envoy sequence (tests/data/recorded/*.txtpb) with exactly the bytes the generated-servicer
  stack (`aio`) sends, and those parse as the phase's empty CONTINUE reply, one per message; the
  health check answers SERVING for the ext_proc service name (what Envoy's processor cluster checks).
- The floor (perf/floor/, when it is built here: needs Debian's gRPC C++ packages) gives the same bytes.
No timing thresholds.
"""

from __future__ import annotations

import importlib.util
import sys

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack import free_port, free_port_block, stop_process
from tests.conftest import DATA, REPO

RECORDED = sorted((DATA / "recorded").glob("*.txtpb"))


def _load(name: str, path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bs = _load("bench_stacks", REPO / "perf" / "bench_stacks.py")
common = _load("bench_stacks_common", REPO / "perf" / "stacks" / "common.py")
PY_STACKS = [n for n in bs.STACKS if n != "floor"]


def recorded(path) -> list[pb.ProcessingRequest]:
    chunks = path.read_text().split("# message\n")[1:]
    return [text_format.Parse(c, pb.ProcessingRequest()) for c in chunks]


def test_recordings_cover_every_body_phase():
    phases = {r.WhichOneof("request") for p in RECORDED for r in recorded(p)}
    assert {"request_headers", "request_body", "response_headers", "response_body"} <= phases


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
def test_phase_field_matches_protobuf_on_recordings(path):
    for req in recorded(path):
        field = common.phase_field(req.SerializeToString())
        assert common.PHASE_BY_FIELD[field] == req.WhichOneof("request")
        assert common.raw_reply(req.SerializeToString()) == common.reply_for(req).SerializeToString()


def test_phase_field_skips_other_fields_and_refuses_garbage():
    req = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x" * 300, end_of_stream=True))
    req.metadata_context.filter_metadata["a"].fields["b"].string_value = "c"
    req.observability_mode = True
    # the oneof written after fields 8 and 10 (Envoy writes it first; the parser must not rely on that)
    tail = pb.ProcessingRequest(metadata_context=req.metadata_context, observability_mode=True).SerializeToString()
    body = pb.ProcessingRequest(response_body=req.response_body).SerializeToString()
    assert common.phase_field(tail + body) == 5
    assert common.PHASE_BY_FIELD[5] == "response_body"
    unknown = (bytes([(12 << 3) | 0, 0x96, 0x01, (13 << 3) | 1]) + b"\0" * 8 + bytes([(14 << 3) | 5]) + b"\0" * 4
               + bytes([0xA0, 0x01, 0x00]))  # field 20 (a two-byte tag), varint 0
    assert common.phase_field(unknown + body) == 5
    assert common.phase_field(b"") is None
    assert common.phase_field(tail) is None  # no phase: nothing to answer
    assert common.phase_field(b"\x8a") is None  # truncated tag
    assert common.phase_field(bytes([(8 << 3) | 2, 0x80])) is None  # truncated length
    assert common.phase_field(bytes([(8 << 3) | 3])) is None  # a group: not in this proto


def _exchange(port: int, reqs: list[bytes]) -> list[bytes]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        call = ch.stream_stream(common.METHOD, request_serializer=None, response_deserializer=None)
        return list(call(iter(reqs), timeout=10))


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=common.SERVICE), timeout=10).status


def _answers(port: int) -> dict[str, list[bytes]]:
    return {p.stem: _exchange(port, [r.SerializeToString() for r in recorded(p)]) for p in RECORDED}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[bytes]]:
    """The generated-servicer stack's (`aio`) answers to every recording, checked against the phases."""
    port = free_port()
    proc = bs.start_stack("aio", [port])
    try:
        got = _answers(port)
    finally:
        stop_process(proc)
    for p in RECORDED:
        reqs = recorded(p)
        replies = [pb.ProcessingResponse.FromString(b) for b in got[p.stem]]
        assert len(replies) == len(reqs), p.stem
        for req, rep in zip(reqs, replies):
            phase = req.WhichOneof("request")
            assert rep.WhichOneof("response") == phase
            inner = getattr(rep, phase)
            if phase.endswith("trailers"):
                assert inner == pb.TrailersResponse()
            else:
                assert inner.HasField("response")
                assert inner.response == pb.CommonResponse()
                assert inner.response.status == pb.CommonResponse.CONTINUE
    return got


@pytest.mark.parametrize("name", PY_STACKS)
def test_stack_answers_like_the_generated_servicer(name, reference):
    if name == "grpclib" and importlib.util.find_spec("grpclib") is None:
        pytest.skip("grpclib is not installed (pip install '.[perf]')")
    base = free_port_block(2)
    proc = bs.start_stack(name, [base, base + 1])  # the bench's command line, two ports in one process
    try:
        for port in (base, base + 1):
            assert _answers(port) == reference
            assert _health(port) == health_pb2.HealthCheckResponse.SERVING
    finally:
        stop_process(proc)
    assert proc.returncode is not None


def test_floor_answers_like_the_generated_servicer(reference):
    bo = sys.modules.get("bench_overhead") or _load("bench_overhead", REPO / "perf" / "bench_overhead.py")
    binary, why = bo.build_floor(install=False)
    if binary is None:
        pytest.skip(f"the floor is not built here: {why}")
    port = free_port()
    proc = bo.start_floor(binary, port, 1, 1)
    try:
        assert _answers(port) == reference
    finally:
        stop_process(proc)

