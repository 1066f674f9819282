"""The servicer over real gRPC, fed ProcessingRequest sequences recorded from Envoy 1.40.

The recordings in tests/data/recorded/ were captured with `adapterctl serve --record-dir` behind a
real Envoy (config: tests/data/recorded/config.yaml). Each test replays one through a grpc.aio
channel with the route metadata Envoy sends, and checks every reply and the metrics.
"""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import text_format
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.metrics import ProcessorMetrics
from extproc.stream import ConfigRef, ExtProcService
from tests.conftest import DATA
from tests.promtext import collect

pytestmark = pytest.mark.integration
RECORDED = DATA / "recorded"


def recorded(name: str) -> list[pb.ProcessingRequest]:
    chunks = (RECORDED / name).read_text().split("# message\n")[1:]
    return [text_format.Parse(c, pb.ProcessingRequest()) for c in chunks]


@pytest.fixture
async def service():
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(RECORDED / "config.yaml")), ProcessorMetrics(registry))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalProcessorStub(channel)
    yield stub, _Flushed(registry, svc), svc
    await channel.close()
    await server.stop(0)


async def replay(stub, route: str, requests, debug: str = "") -> list[pb.ProcessingResponse]:
    """Send one request at a time and wait for its reply, as Envoy does."""
    call = stub.Process(metadata=(("x-adapter-route", route), ("x-request-id", "rid-1"), ("x-adapter-debug", debug)))
    replies = []
    for req in requests:
        await call.write(req)
        reply = await call.read()
        if reply is grpc.aio.EOF:
            break
        replies.append(reply)
        if reply.HasField("immediate_response"):
            break
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:  # the handler has returned (and counted) after EOF
        pass
    return replies


class _Flushed:
    """The registry as a scrape sees it: the service's buffered updates written first."""

    def __init__(self, registry, svc):
        self.registry, self.svc = registry, svc

    def samples(self):
        return collect(self.registry, [self.svc])


def sample(registry, name, **labels) -> float:
    """The one series with exactly these labels, from the parsed exposition (absent: AssertionError)."""
    return registry.samples().value(name, **labels)


async def test_llm_route_full_exchange(service):
    stub, registry, _ = service
    replies = await replay(stub, "v1-analyze", recorded("v1-analyze-rec-llm-ok.txtpb"))
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers", "request_body", "response_headers", "response_body"]
    body_reply = replies[1].request_body.response
    sets = {h.header.key: h.header.raw_value.decode() for h in body_reply.header_mutation.set_headers}
    assert sets[":path"] == "/v1/chat/completions" and sets["x-adapter-backend"] == "fake"
    assert body_reply.clear_route_cache
    sent = orjson.loads(body_reply.body_mutation.body)
    assert sent["messages"][-1]["content"] == "计算Q3营收" and sent["model"] == "qwen2.5-finance"
    assert not replies[2].HasField("mode_override")  # a 200: the body will be transformed
    out = orjson.loads(replies[3].response_body.response.body_mutation.body)
    assert out == {"voucher": {"amount": 123.5, "account": "6001"}}
    assert sample(registry, "adapter_processor_requests_total", route="v1-analyze", outcome="ok") == 1
    assert sample(registry, "adapter_processor_phase_duration_seconds_count", route="v1-analyze",
                  phase="response_body") == 1


async def test_backend_error_status_skips_the_body(service):
    stub, _, _ = service
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    status = next(h for h in reqs[2].response_headers.headers.headers if h.key == ":status")
    status.raw_value = b"500"
    replies = await replay(stub, "v1-analyze", reqs[:3])
    assert replies[2].mode_override.response_body_mode == 0  # NONE: the error passes through as is


async def test_transform_path_missing_is_a_502(service):
    stub, registry, _ = service
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    reqs[3].response_body.body = orjson.dumps({"choices": [{"message": {"content": '{"amount": 1}'}}]})
    replies = await replay(stub, "v1-analyze", reqs)
    ir = replies[3].immediate_response
    assert ir.status.code == 502 and orjson.loads(ir.body)["error"]["path"] == "$.output.account"
    assert sample(registry, "adapter_processor_errors_total", route="v1-analyze", reason="transform_path_missing") == 1


async def test_malformed_json_is_answered_at_the_body(service):
    stub, registry, _ = service
    replies = await replay(stub, "v1-analyze", recorded("v1-analyze-rec-llm-malformed.txtpb"))
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "immediate_response"]
    assert replies[1].immediate_response.status.code == 400
    assert sample(registry, "adapter_processor_requests_total", route="v1-analyze", outcome="rejected") == 1


async def test_passthrough_route_is_one_header_reply(service):
    stub, _, _ = service
    replies = await replay(stub, "v1-chat-completions", recorded("v1-chat-completions-rec-passthrough.txtpb"))
    assert len(replies) == 1
    sets = {h.header.key: h.header.raw_value for h in replies[0].request_headers.response.header_mutation.set_headers}
    assert sets == {"x-adapter-backend": b"fake", "x-adapter-route-target": b"v1-chat-completions"}


async def test_health_route_answers_immediately(service):
    stub, _, _ = service
    replies = await replay(stub, "adapter-health", recorded("adapter-health-rec-health.txtpb"))
    ir = replies[0].immediate_response
    assert ir.status.code == 200 and orjson.loads(ir.body)["processor"]["status"] == "serving"


async def test_unknown_route_metadata_is_a_503_naming_it(service):
    stub, _, _ = service
    replies = await replay(stub, "no-such-route", recorded("v1-chat-completions-rec-passthrough.txtpb"))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert replies[0].immediate_response.status.code == 503 and "no-such-route" in err["message"]


async def test_reload_swaps_the_snapshot_for_new_streams_only(service, write_config):
    stub, _, svc = service
    old = svc.config.current
    call = stub.Process(metadata=(("x-adapter-route", "v1-analyze"),))
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    await call.write(reqs[0])
    await call.read()
    text = (RECORDED / "config.yaml").read_text().replace('"account": $.output.account', '"acct": $.output.account')
    svc.config.swap(load_file(write_config(text), generation=2))
    for req in reqs[1:]:
        await call.write(req)
        reply = await call.read()
    await call.done_writing()
    # the open stream finished on the snapshot it started with
    assert orjson.loads(reply.response_body.response.body_mutation.body)["voucher"].keys() == {"amount", "account"}
    replies = await replay(stub, "v1-analyze", recorded("v1-analyze-rec-llm-ok.txtpb"))
    assert orjson.loads(replies[3].response_body.response.body_mutation.body)["voucher"].keys() == {"amount", "acct"}
    assert old.generation == 1 and svc.config.current.generation == 2


async def test_envoy_reset_mid_stream_is_a_normal_end(service):
    stub, registry, _ = service
    call = stub.Process(metadata=(("x-adapter-route", "v1-analyze"),))
    await call.write(recorded("v1-analyze-rec-llm-ok.txtpb")[0])
    await call.read()
    assert sample(registry, "adapter_processor_streams_active") == 1  # counted while open
    call.cancel()  # what Envoy does once it needs nothing more
    for _ in range(100):
        if sample(registry, "adapter_processor_streams_active") == 0:
            break
        await asyncio.sleep(0.01)
    assert sample(registry, "adapter_processor_streams_active") == 0
