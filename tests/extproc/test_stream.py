"""extproc.stream.ExtProcService.Process: what it reads from Envoy's gRPC metadata, how it refuses,
what it records, and the per-request state it hands the pipeline (driven in process with recorded
Envoy sequences; the servicer over real gRPC is tests/integration/test_servicer.py)."""

from __future__ import annotations

import base64

import orjson
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.metrics import ProcessorMetrics
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import Outcome
from tests.extproc.test_lifecycle import RECORDED, recorded
from tests.promtext import collect


class _Md:
    def __init__(self, key: str, value: str):
        self.key, self.value = key, value


class _Context:
    def __init__(self, *pairs: tuple[str, str]):
        self.md = [_Md(k, v) for k, v in pairs]

    def invocation_metadata(self):
        return self.md


def service(config=RECORDED / "config.yaml", recorder=None):
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(config)), ProcessorMetrics(registry), recorder=recorder)
    states = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: states.append((state, outcome)))
    return svc, registry, states


async def run(svc, metadata, sequence):
    async def source():
        for r in sequence:
            yield r
    return [reply async for reply in svc.Process(source(), _Context(*metadata))]


LLM = "v1-analyze-rec-llm-ok.txtpb"
PASSTHROUGH = "v1-chat-completions-rec-passthrough.txtpb"


async def test_metadata_gives_the_request_id_tenant_and_debug_flag():
    svc, _, states = service()
    await run(svc, [("x-adapter-route", "v1-chat-completions"), ("x-request-id", "rid-42"),
                    ("x-adapter-tenant", "acme"), ("x-adapter-debug", "1")], recorded(PASSTHROUGH))
    state, outcome = states[0]
    assert (state.request_id, state.tenant, state.debug) == ("rid-42", "acme", True)
    assert state.route is not None and state.route.name == "v1-chat-completions" and outcome is Outcome.OK


async def test_metadata_absent_gives_empty_request_id_no_tenant_no_debug():
    svc, _, states = service()
    await run(svc, [("x-adapter-route", "v1-chat-completions"), ("x-adapter-debug", "yes")], recorded(PASSTHROUGH))
    state, _ = states[0]
    assert state.request_id == "" and state.tenant is None and state.debug is False


async def test_debug_true_adds_the_route_backend_and_backend_request_headers():
    for flag, expect in (("true", True), ("1", True), ("0", False), ("", False)):
        svc, _, _ = service()
        replies = await run(svc, [("x-adapter-route", "v1-analyze"), ("x-adapter-debug", flag)], recorded(LLM))
        sets = {h.header.key: h.header.raw_value.decode()
                for h in replies[3].response_body.response.header_mutation.set_headers}
        assert ("x-adapter-route" in sets) is expect, flag
        if expect:
            assert sets["x-adapter-route"] == "v1-analyze" and sets["x-adapter-backend"] == "fake"
            sent = orjson.loads(base64.b64decode(sets["x-adapter-backend-request"]))
            assert sent["model"] == "qwen2.5-finance"


async def test_unknown_route_is_refused_in_the_adapter_dialect_and_counted():
    svc, registry, states = service()
    replies = await run(svc, [("x-adapter-route", "no-such-route"), ("x-request-id", "rid-7")],
                        recorded(PASSTHROUGH))
    assert len(replies) == 1
    ir = replies[0].immediate_response
    err = orjson.loads(ir.body)["error"]
    assert ir.status.code == 503 and err["code"] == "unknown_route" and err["status"] == 503
    assert err["request_id"] == "rid-7" and err["route"] == "unknown"
    assert "'no-such-route'" in err["message"] and "generation 1" in err["message"]
    assert "re-render the Envoy config from the same AdapterGateway file" in err["message"]
    s = collect(registry, [svc])
    assert s.value("adapter_processor_errors_total", route="unknown", reason="unknown_route") == 1
    assert s.value("adapter_processor_requests_total", route="unknown", outcome="rejected") == 1
    state, outcome = states[0]
    assert state.route is None and outcome is Outcome.REJECTED and state.reply_status == 503


async def test_no_route_metadata_is_refused_too():
    svc, _, _ = service()
    replies = await run(svc, [("x-request-id", "r")], recorded(PASSTHROUGH))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert err["code"] == "unknown_route" and "None" in err["message"]


async def test_config_mismatch_names_every_known_digest():
    svc, registry, _ = service()
    replies = await run(svc, [("x-adapter-route", "v1-analyze"), ("x-adapter-config-digest", "feedbeef")],
                        recorded(LLM))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    digest = svc.config.current.digest
    assert err["code"] == "config_mismatch"
    assert f"and knows {digest}: Envoy and the processor were given different AdapterGateway configs" in err["message"]
    assert err["route"] == "v1-analyze"  # the route Envoy named (it exists in the current snapshot)
    assert collect(registry, [svc]).value("adapter_processor_config_mismatch_total") == 1


async def test_the_refusal_answers_the_first_message_and_ends_the_stream():
    svc, _, _ = service()
    seq = recorded(LLM)
    replies = await run(svc, [("x-adapter-route", "nope")], seq)
    assert len(replies) == 1 and replies[0].HasField("immediate_response")


async def test_recorder_gets_every_message_with_route_and_request_id():
    seen = []
    svc, _, _ = service(recorder=lambda route, rid, req: seen.append((route, rid, req)))
    seq = recorded(LLM)
    await run(svc, [("x-adapter-route", "v1-analyze"), ("x-request-id", "rid-9")], seq)
    assert [(r, i) for r, i, _ in seen] == [("v1-analyze", "rid-9")] * len(seq)
    assert [q for _, _, q in seen] == seq


async def test_phase_durations_and_request_duration_are_observed_per_route():
    svc, registry, _ = service()
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM))
    s = collect(registry, [svc])
    for phase in ("request_headers", "request_body", "response_headers", "response_body"):
        assert s.value("adapter_processor_phase_duration_seconds_count", route="v1-analyze", phase=phase) == 1
    assert s.value("adapter_processor_request_duration_seconds_count", route="v1-analyze") == 1
    assert s.value("adapter_processor_request_duration_seconds_sum", route="v1-analyze") > 0
    assert s.value("adapter_processor_streams_active") == 0


async def test_response_status_and_first_byte_come_from_the_response_headers():
    svc, _, states = service()
    seq = recorded(LLM)
    status = next(h for h in seq[2].response_headers.headers.headers if h.key == ":status")
    status.raw_value = b"503"
    await run(svc, [("x-adapter-route", "v1-analyze")], seq[:3])
    state, outcome = states[0]
    assert state.response_status == 503 and state.first_byte is not None and state.first_byte >= state.started
    assert outcome is Outcome.BACKEND_ERROR
