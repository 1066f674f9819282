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


async def test_a_response_status_that_is_not_a_number_is_unknown_not_a_failed_stream():
    """Found by tests/fuzz/test_fuzz_stream.py: `int()` of a `:status` header or `response.code`
    attribute that is not a number raised out of `Process` (the stream failed, no reply)."""
    for status, code in ((b"\xff", None), (b"abc", None), (b"2\xc2\xb2", None), (b"99999", None),
                         (b"200", "x"), (b"200", 1e300), (b"200", float("inf"))):
        svc, _, states = service()
        seq = recorded(LLM)
        next(h for h in seq[2].response_headers.headers.headers if h.key == ":status").raw_value = status
        if code is not None:
            seq[2].attributes["envoy.filters.http.ext_proc"].update({"response.code": code})
        replies = await run(svc, [("x-adapter-route", "v1-analyze")], seq[:3])
        assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "response_headers"]
        expect = 200 if status == b"200" else 0
        assert states[0][0].response_status == expect, (status, code)


# --- RequestObserver: every series one request's end writes (issue 9, mutation survivors) -----------

from backends.base import Usage  # noqa: E402
from extproc.config.loader import load_text  # noqa: E402
from extproc.lifecycle import Completion  # noqa: E402
from extproc.request import InferenceRequest  # noqa: E402
from extproc.stream import RequestObserver  # noqa: E402
from extproc.types import RequestState  # noqa: E402

TENANTS = (RECORDED / "config.yaml").read_text().replace("  backends:", """\
  tenants:
    - {id: acme}
    - {id: beta}
    - {id: gamma}
  backends:""", 1)


def observed(*cases):
    """Feed (state fields, outcome) cases to a fresh RequestObserver; the parsed registry."""
    registry = CollectorRegistry()
    obs = RequestObserver(ProcessorMetrics(registry))
    snap = load_text(TENANTS)
    for kw, outcome in cases:
        route = kw.pop("route", "v1-analyze")
        obs(RequestState(snapshot=snap, route=snap.routes[route] if route else None, started=0.0, **kw), outcome)
    obs.pending.flush()
    return collect(registry)


def test_an_unknown_route_counts_only_the_request_whatever_else_the_state_has():
    s = observed(({"route": None, "tenant": "acme", "backend": "fake", "usage": Usage(3, 5, 2),
                   "completion": Completion(200, first_upstream_byte=0.1)}, Outcome.REJECTED))
    assert s.series("adapter_processor_requests_total") == {(("outcome", "rejected"), ("route", "unknown")): 1.0}
    for name in ("adapter_processor_admission_total", "adapter_processor_tokens_total",
                 "adapter_processor_batch_size_count", "adapter_processor_upstream_first_byte_seconds_count"):
        assert s.series(name) == {}, name


def test_admission_results_per_configured_tenant():
    s = observed(({"tenant": "acme"}, Outcome.OK),
                 ({"tenant": "acme", "reply_code": "tenant_over_quota"}, Outcome.REJECTED),
                 ({"tenant": "beta", "quota_stale": True}, Outcome.OK),
                 ({"tenant": "gamma", "quota_stale": True, "reply_code": "tenant_over_quota"}, Outcome.REJECTED),
                 ({"tenant": "gamma", "reply_code": "no_capacity"}, Outcome.REJECTED),
                 ({"tenant": "stranger"}, Outcome.OK), ({}, Outcome.OK))
    assert s.series("adapter_processor_admission_total") == {
        (("result", "admitted"), ("tenant", "acme")): 1.0, (("result", "rejected"), ("tenant", "acme")): 1.0,
        (("result", "stale"), ("tenant", "beta")): 1.0, (("result", "rejected"), ("tenant", "gamma")): 1.0,
        (("result", "admitted"), ("tenant", "gamma")): 1.0}
    assert s.series("adapter_processor_requests_total") == {
        (("outcome", "ok"), ("route", "v1-analyze")): 4.0, (("outcome", "rejected"), ("route", "v1-analyze")): 3.0}


def test_the_backends_first_byte_is_observed_only_with_a_time_and_a_backend():
    s = observed(({"backend": "fake", "completion": Completion(200, first_upstream_byte=0.004)}, Outcome.OK),
                 ({"backend": "fake", "completion": Completion(200, first_upstream_byte=0.0)}, Outcome.OK),
                 ({"backend": "fake", "completion": Completion(200)}, Outcome.OK),
                 ({"completion": Completion(200, first_upstream_byte=0.5)}, Outcome.OK),
                 ({"backend": "fake"}, Outcome.OK))
    first = {"route": "v1-analyze", "backend": "fake"}
    assert s.series("adapter_processor_upstream_first_byte_seconds_count") == {tuple(sorted(first.items())): 2.0}
    assert s.value("adapter_processor_upstream_first_byte_seconds_sum", **first) == 0.004


def test_tokens_and_batch_size_carry_route_backend_model_and_tenant():
    chat = InferenceRequest(api="openai.chat", model="qwen2.5-finance")
    s = observed(({"backend": "fake", "tenant": "acme", "request": chat, "usage": Usage(3, 5, 4)}, Outcome.OK),
                 ({"usage": Usage(7, 0, 0), "tenant": "stranger"}, Outcome.OK),  # no backend, no request
                 ({"usage": Usage(0, 2, 0), "request": InferenceRequest(api="openai.chat", model="made-up")}, Outcome.OK),
                 ({"usage": Usage(-1, -1, -1), "backend": "fake"}, Outcome.OK),
                 ({"usage": Usage(1, 0, 0), "route": "adapter-health"}, Outcome.OK),  # a route without a model
                 ({"usage": Usage(0, 0, 2), "backend": "fake", "request": InferenceRequest(api="document")},
                  Outcome.OK))
    lab = ("backend", "model", "route", "tenant", "type")
    assert s.series("adapter_processor_tokens_total") == {tuple(zip(lab, k)): v for k, v in {
        ("fake", "qwen2.5-finance", "v1-analyze", "acme", "prompt"): 3.0,
        ("fake", "qwen2.5-finance", "v1-analyze", "acme", "completion"): 5.0,
        ("none", "qwen2.5-finance", "v1-analyze", "none", "prompt"): 7.0,
        ("none", "other", "v1-analyze", "none", "completion"): 2.0,
        ("none", "unknown", "adapter-health", "none", "prompt"): 1.0}.items()}
    b = {"route": "v1-analyze", "backend": "fake", "model": "qwen2.5-finance"}
    assert s.series("adapter_processor_batch_size_count") == {tuple(sorted(b.items())): 2.0}
    assert s.value("adapter_processor_batch_size_sum", **b) == 6.0
    assert s.value("adapter_processor_batch_size_bucket", le="2.0", **b) == 1.0
    assert s.value("adapter_processor_batch_size_bucket", le="4.0", **b) == 2.0


def test_children_are_the_metrics_own_per_metric_and_labels():
    m = ProcessorMetrics(CollectorRegistry())
    obs = RequestObserver(m)
    assert obs.child(m.requests, "r", "ok") is m.requests.labels("r", "ok")
    assert obs.child(m.errors, "r", "ok") is m.errors.labels("r", "ok")  # same labels, another metric
    assert obs.child(m.config_mismatch) is m.config_mismatch


def test_config_ref_keeps_each_recent_snapshot_under_its_digest_oldest_dropped_first(write_config):
    from extproc.stream import KEEP_SNAPSHOTS

    base = (RECORDED / "config.yaml").read_text()
    snaps = [load_file(write_config(base.replace("name: exp", f"name: exp{i}")), generation=i + 1)
             for i in range(KEEP_SNAPSHOTS + 1)]
    ref = ConfigRef(snaps[0])
    seen = []
    ref.listeners.append(lambda s: seen.append((s.generation, ref.current.generation)))
    for s in snaps[1:]:
        ref.swap(s)
    assert seen == [(i + 1, i) for i in range(1, KEEP_SNAPSHOTS + 1)]  # told before the swap
    assert ref.current is snaps[-1]
    assert ref.digests == tuple(s.digest for s in reversed(snaps[1:]))
    for s in snaps[1:]:
        assert ref.resolve(s.digest) is s
    assert ref.resolve(snaps[0].digest) is None and ref.resolve("") is snaps[-1] and ref.resolve(None) is snaps[-1]
    ref.swap(snaps[2])  # a digest swapped in again becomes the newest, nothing is dropped
    assert ref.digests[0] == snaps[2].digest and len(ref.digests) == KEEP_SNAPSHOTS


# --- Process: what each message does to the state, the replies and the series (issue 9) ---------------

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from extproc.pipeline import Pipeline  # noqa: E402
from extproc.runtime import Runtime  # noqa: E402
from extproc.types import Mutate  # noqa: E402


class _NoMetadata:
    def invocation_metadata(self):
        return None


def adapter_md(reply) -> dict:
    fields = reply.dynamic_metadata.fields
    if "adapter" not in fields:
        return {}
    return {k: (v.string_value or v.bool_value) for k, v in fields["adapter"].struct_value.fields.items()}


def feedback_service(config=RECORDED / "config.yaml", feedback=True):
    registry = CollectorRegistry()
    runtime = Runtime(feedback=feedback)
    svc = ExtProcService(ConfigRef(config if not hasattr(config, "suffix") else load_file(config)),
                         ProcessorMetrics(registry), runtime=runtime)
    states = []
    runtime.lifecycle.observers.append(lambda state, outcome: states.append((state, outcome)))
    return svc, registry, states


def body_message(body: bytes, end: bool = True):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    r = pb.ProcessingRequest()
    r.request_body.body, r.request_body.end_of_stream = body, end
    return r


async def test_a_context_without_metadata_is_an_unknown_route():
    svc, _, states = service()
    replies = [r async for r in svc.Process(_aiter(recorded(PASSTHROUGH)), _NoMetadata())]
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert err["code"] == "unknown_route" and err["request_id"] == ""
    assert states[0][0].request_id == "" and states[0][1] is Outcome.REJECTED


async def _aiter(items):
    for i in items:
        yield i


async def test_the_unknown_route_and_mismatch_messages_are_exact():
    svc, registry, states = service()
    gen, digest = svc.config.current.generation, svc.config.current.digest
    replies = await run(svc, [("x-adapter-route", "nope")], recorded(PASSTHROUGH))
    assert orjson.loads(replies[0].immediate_response.body)["error"]["message"] == (
        f"processor has no route 'nope' in config generation {gen}; "
        "re-render the Envoy config from the same AdapterGateway file")
    replies = await run(svc, [("x-adapter-route", "v1-analyze"), ("x-adapter-config-digest", "feed")], recorded(LLM))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert err == {"status": 503, "code": "config_mismatch", "message": (
        f"Envoy's route 'v1-analyze' comes from config digest feed; this processor worker runs generation {gen} "
        f"(digest {digest}) and knows {digest}: Envoy and the processor were given different AdapterGateway "
        "configs (reload both from the same file)"), "envoy_digest": "feed", "processor_digest": digest,
        "route": "v1-analyze", "request_id": ""}
    (state, outcome), = states[1:]
    assert state.route is None and outcome is Outcome.REJECTED
    assert (state.reply_status, state.reply_code, state.complete) == (503, "config_mismatch", True)
    s = collect(registry, [svc])
    assert s.series("adapter_processor_errors_total") == {
        (("reason", "unknown_route"), ("route", "unknown")): 1.0,
        (("reason", "config_mismatch"), ("route", "v1-analyze")): 1.0}


async def test_a_mismatch_on_an_unknown_route_is_a_mismatch():
    svc, _, _ = service()
    replies = await run(svc, [("x-adapter-route", "nope"), ("x-adapter-config-digest", "feed")], recorded(PASSTHROUGH))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert err["code"] == "config_mismatch" and err["route"] == "unknown"


async def test_the_state_gets_the_runtime_a_start_time_and_no_empty_tenant():
    svc, _, states = service()
    before = time.monotonic()
    await run(svc, [("x-adapter-route", "v1-chat-completions"), ("x-adapter-tenant", "")], recorded(PASSTHROUGH))
    state, _ = states[0]
    assert state.runtime is svc.runtime and before <= state.started <= time.monotonic()
    assert state.tenant is None and state.stream_end == "end"


async def test_the_stream_gauge_counts_the_open_stream_and_every_message_is_timed():
    seen = []
    svc, registry, states = service()
    svc.recorder = lambda route, rid, req: seen.append(collect(registry).value("adapter_processor_streams_active"))
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM))
    assert seen == [1.0] * 4
    s = collect(registry, [svc])
    assert s.value("adapter_processor_streams_active") == 0
    phases = sum(s.value("adapter_processor_phase_duration_seconds_sum", route="v1-analyze", phase=p)
                 for p in ("request_headers", "request_body", "response_headers", "response_body"))
    assert s.value("adapter_processor_request_duration_seconds_sum", route="v1-analyze") == pytest.approx(phases, rel=1e-9)


async def test_the_first_response_message_gives_first_byte_status_and_served_endpoint_once():
    svc, _, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    seq[2].attributes["envoy.filters.http.ext_proc"].update({"response.code": 200, "upstream.address": "10.0.0.9:80"})
    seq[3].attributes["envoy.filters.http.ext_proc"].update({"response.code": 500, "upstream.address": "10.0.0.8:80"})
    firsts = []
    lc = svc.runtime.lifecycle

    def rec(route, rid, req):
        (st,) = lc._open.values()
        firsts.append(st.first_byte)

    svc.recorder = rec
    await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    state, outcome = states[0]
    assert firsts[:3] == [None, None, None] and firsts[3] is not None and state.first_byte == firsts[3]
    assert (state.response_status, state.served, outcome) == (200, "10.0.0.9:80", Outcome.OK)


async def test_attributes_without_a_code_or_address_leave_status_from_headers_and_no_endpoint():
    svc, _, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    seq[2].attributes["envoy.filters.http.ext_proc"].update({"upstream.address": ""})
    await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    state, _ = states[0]
    assert state.response_status == 200 and state.served is None and state.first_byte is not None


async def test_the_response_code_attribute_is_the_status_when_response_headers_are_skipped(write_config):
    svc, _, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    del seq[2].response_headers.headers.headers[:]  # a headers message without headers: status from the attribute
    seq[2].attributes["envoy.filters.http.ext_proc"].update({"response.code": 201})
    await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    assert states[0][0].response_status == 201


async def test_only_the_last_phases_final_chunk_completes_the_request():
    svc, _, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    seq[3].response_body.end_of_stream = False
    await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    state, outcome = states[0]
    assert state.complete is False and outcome is Outcome.CANCELLED  # the stream closed before the end
    svc, _, states = feedback_service(feedback=False)
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM))
    assert states[0][0].complete is True and states[0][1] is Outcome.OK
    svc, _, states = feedback_service(feedback=False)
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM)[:2])  # no response seen
    assert states[0][0].complete is False and states[0][1] is Outcome.CANCELLED


async def test_a_backend_answer_the_route_cannot_map_is_a_backend_error_not_a_rejection():
    svc, registry, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    seq[3].response_body.body = b"not json"
    replies = await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    ir = replies[3].immediate_response
    state, outcome = states[0]
    assert ir.status.code == state.reply_status and state.reply_status >= 500
    assert state.observed is None and outcome is Outcome.BACKEND_ERROR
    assert collect(registry, [svc]).series("adapter_processor_errors_total") == {
        (("reason", state.reply_code), ("route", "v1-analyze")): 1.0}


async def test_a_rejection_mid_stream_ends_it_and_no_later_message_is_read():
    svc, _, states = feedback_service(feedback=False)
    seq = recorded("v1-analyze-rec-llm-malformed.txtpb") + recorded(LLM)[2:]
    read = []
    svc.recorder = lambda route, rid, req: read.append(req.WhichOneof("request"))
    replies = await run(svc, [("x-adapter-route", "v1-analyze")], seq)
    assert read == ["request_headers", "request_body"] and len(replies) == 2
    assert replies[1].immediate_response.status.code == 400
    state, outcome = states[0]
    assert (state.observed, outcome, state.reply_code, state.complete) == (
        Outcome.REJECTED, Outcome.REJECTED, "malformed_json", True)


def _with_route(svc_config, name, pipeline):
    snap = load_file(svc_config)
    base = snap.routes["v1-chat-completions"]
    routes = {**snap.routes, name: dataclasses.replace(base, name=name, pipeline=pipeline)}
    return dataclasses.replace(snap, routes=routes)


class _Boom:
    name = "boom"

    def on_request_headers(self, st, msg):
        raise RuntimeError("stage bug")


class _Skip:
    name = "skip"

    def on_request_headers(self, st, msg):
        return None

    def on_response_headers(self, st, msg):
        return Mutate(skip_body=True)

    def on_response_body(self, st, msg):
        return None


async def test_a_stage_error_before_the_backend_is_a_backend_error_counted_by_its_code():
    svc, registry, states = feedback_service(_with_route(RECORDED / "config.yaml", "boom", Pipeline([_Boom()])))
    replies = await run(svc, [("x-adapter-route", "boom")], recorded(PASSTHROUGH))
    assert replies[0].immediate_response.status.code == 500
    assert adapter_md(replies[0]) == {"processor_reply": True}  # no feedback token on an answered request
    state, outcome = states[0]
    assert state.observed is None and outcome is Outcome.BACKEND_ERROR and state.reply_code == "stage_error"
    assert collect(registry, [svc]).series("adapter_processor_errors_total") == {
        (("reason", "stage_error"), ("route", "boom")): 1.0}


async def test_a_skipped_response_body_completes_at_the_response_headers():
    svc, _, states = feedback_service(_with_route(RECORDED / "config.yaml", "skip", Pipeline([_Skip()])), feedback=False)
    replies = await run(svc, [("x-adapter-route", "skip")], recorded(LLM)[:1] + recorded(LLM)[2:3])
    assert replies[1].mode_override.response_body_mode == 0 and replies[1].HasField("mode_override")
    state, outcome = states[0]
    assert state.complete is True and outcome is Outcome.OK


async def test_the_feedback_token_goes_on_the_first_reply_only_of_a_headers_only_route():
    svc, _, states = feedback_service()
    seq = recorded(PASSTHROUGH) + [body_message(b"{}")]  # a message Envoy never sends (body mode NONE)...
    replies = await run(svc, [("x-adapter-route", "v1-chat-completions")], seq)
    token = svc.runtime.lifecycle.boot + "-1"
    assert [adapter_md(r) for r in replies] == [{"worker": "0", "token": token}]  # ...and is not read
    assert list(svc.runtime.lifecycle._open) == [token]  # waiting for Envoy's entry


async def test_no_feedback_token_when_the_worker_or_the_route_does_not_ask_for_one():
    for svc, route, seq in ((feedback_service(feedback=False)[0], "v1-chat-completions", recorded(PASSTHROUGH)),
                            (feedback_service()[0], "v1-analyze", recorded(LLM))):
        replies = await run(svc, [("x-adapter-route", route)], seq)
        assert all("worker" not in adapter_md(r) for r in replies), route
        assert svc.runtime.lifecycle.open_count == 0


async def test_a_rejected_headers_only_request_gets_no_feedback_token():
    svc, _, states = feedback_service(load_text(TENANTS))
    replies = await run(svc, [("x-adapter-route", "v1-chat-completions"), ("x-adapter-tenant", "stranger")],
                        recorded(PASSTHROUGH))
    assert replies[0].HasField("immediate_response") and adapter_md(replies[0]) == {"processor_reply": True}
    assert states[0][1] is Outcome.REJECTED and svc.runtime.lifecycle.open_count == 0


async def test_a_cancelled_stream_ends_cancelled_and_a_broken_one_in_error(caplog):
    svc, registry, states = feedback_service(feedback=False)
    gate = asyncio.Event()

    async def held():
        for r in recorded(LLM)[:2]:
            yield r
        await gate.wait()

    async def consume(source):
        return [r async for r in svc.Process(source, _Context(("x-adapter-route", "v1-analyze")))]

    task = asyncio.create_task(consume(held()))
    while svc.runtime.lifecycle.open_count == 0 or collect(registry).value("adapter_processor_phase_duration_seconds_count", 0.0, route="v1-analyze", phase="request_body") == 0:
        svc.flush_metrics()
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert states[0][0].stream_end == "cancelled" and states[0][1] is Outcome.CANCELLED

    async def broken():
        yield recorded(LLM)[0]
        raise RuntimeError("transport broke")

    caplog.set_level(logging.ERROR, logger="extproc.stream")
    with pytest.raises(RuntimeError, match="transport broke"):
        await consume(broken())
    assert states[1][0].stream_end == "error" and states[1][1] is Outcome.BACKEND_ERROR
    assert [r.getMessage() for r in caplog.records] == ["stream for route v1-analyze failed"]
    s = collect(registry, [svc])
    assert s.value("adapter_processor_streams_active") == 0
    assert s.value("adapter_processor_request_duration_seconds_count", route="v1-analyze") == 2


async def test_a_refusal_on_an_openai_route_speaks_the_openai_dialect():
    text = TENANTS + '    - {path: "/v1/", match: prefix, kind: openai, name: api}\n'
    svc, _, states = feedback_service(load_text(text))
    replies = await run(svc, [("x-adapter-route", "api"), ("x-adapter-tenant", "stranger"), ("x-request-id", "r9")],
                        recorded(PASSTHROUGH))
    err = orjson.loads(replies[0].immediate_response.body)["error"]
    assert list(err)[:5] == ["message", "type", "param", "code", "status"]
    assert (err["code"], err["route"], err["request_id"]) == (states[0][0].reply_code, "api", "r9")


async def test_a_mismatch_lists_every_digest_the_worker_knows_newest_first(write_config):
    svc, _, _ = service()
    old = svc.config.current
    new = load_file(write_config((RECORDED / "config.yaml").read_text().replace("name: exp", "name: exp2")),
                    generation=2)
    svc.config.swap(new)
    replies = await run(svc, [("x-adapter-route", "v1-analyze"), ("x-adapter-config-digest", "feed")], recorded(LLM))
    msg = orjson.loads(replies[0].immediate_response.body)["error"]["message"]
    assert f"runs generation 2 (digest {new.digest}) and knows {new.digest}, {old.digest}: Envoy" in msg


async def test_response_headers_without_a_status_give_status_0():
    for value in (None, ""):
        svc, _, states = feedback_service(feedback=False)
        seq = recorded(LLM)[:3]
        headers = seq[2].response_headers.headers.headers
        status = next(h for h in headers if h.key == ":status")
        if value is None:
            headers.remove(status)
        else:
            status.raw_value = b""
        await run(svc, [("x-adapter-route", "v1-analyze")], seq)
        assert states[0][0].response_status == 0, value


def test_the_service_installs_the_snapshot_on_a_fresh_runtime_only_and_is_its_metrics_sink(write_config):
    first = load_file(RECORDED / "config.yaml")
    svc = ExtProcService(ConfigRef(first), ProcessorMetrics(CollectorRegistry()))
    assert svc.runtime.installed is first and svc.runtime.metrics_sink is svc.observer
    other = load_file(write_config((RECORDED / "config.yaml").read_text().replace("name: exp", "name: other")))
    runtime = Runtime()
    runtime.install(other)
    svc = ExtProcService(ConfigRef(first), ProcessorMetrics(CollectorRegistry()), runtime=runtime)
    assert runtime.installed is other  # a runtime that has a snapshot keeps it until the next swap
    svc.config.swap(first)
    assert runtime.installed is first


def test_one_token_and_a_batch_of_one_are_counted():
    s = observed(({"backend": "fake", "usage": Usage(1, 1, 1)}, Outcome.OK))
    assert s.total("adapter_processor_tokens_total", type="prompt") == 1
    assert s.total("adapter_processor_tokens_total", type="completion") == 1
    assert s.total("adapter_processor_batch_size_count") == 1


async def test_processor_time_is_at_most_the_time_the_stream_took():
    svc, registry, _ = service()
    t0 = time.perf_counter()
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM))
    elapsed = time.perf_counter() - t0
    s = collect(registry, [svc])
    assert 0 < s.value("adapter_processor_request_duration_seconds_sum", route="v1-analyze") <= elapsed


async def test_routing_hint_headers_of_the_request_are_kept_for_the_plugins():
    from extproc.types import HINT_HEADERS

    assert HINT_HEADERS == ("x-task-intent", "x-slo-ttft-ms")
    svc, _, states = feedback_service(feedback=False)
    seq = recorded(LLM)
    seq[0].request_headers.headers.headers.add(key="x-task-intent", raw_value=b"summarize")
    seq[0].request_headers.headers.headers.add(key="x-slo-ttft-ms", raw_value=b"")
    seq[2].response_headers.headers.headers.add(key="x-task-intent", raw_value=b"from-the-backend")
    trailers = type(seq[0])()
    trailers.response_trailers.trailers.headers.add(key="x-slo-ttft-ms", raw_value=b"9")
    await run(svc, [("x-adapter-route", "v1-analyze")], seq + [trailers])
    attrs = states[0][0].attrs
    assert (attrs["x-task-intent"], attrs["x-slo-ttft-ms"]) == ("summarize", "")
    svc, _, states = feedback_service(feedback=False)
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM)[:2] + [trailers])
    assert not set(HINT_HEADERS) & set(states[0][0].attrs)  # trailers are not request headers


async def test_an_epp_stream_carries_the_request_id_from_the_metadata():
    from tests.extproc.test_epp import body, request_headers, snapshot

    svc = ExtProcService(ConfigRef(snapshot("on-a100")), ProcessorMetrics(CollectorRegistry()))
    states = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: states.append(state))
    replies = await run(svc, [("x-request-id", "rid-epp")],
                        [request_headers("10.0.0.2:8000"), body(orjson.dumps({"model": "m", "prompt": "hi"}), True)])
    assert orjson.loads(replies[0].immediate_response.body)["error"]["request_id"] == "rid-epp"
    assert states[0].request_id == "rid-epp"


async def _asks_after(sequence, asked: list):
    """Envoy's messages; appends to `asked` if the processor reads on after the last one."""
    for r in sequence:
        yield r
    asked.append(True)


async def test_the_stream_ends_after_the_last_phase_the_route_reads_without_another_read():
    # Envoy resets the side stream once it needs nothing more; a read still pending then fails, and
    # grpc.aio leaks that batch's grpc_op array (about 100 B a stream: the soak's steady worker growth)
    for route, name in (("v1-analyze", LLM), ("v1-chat-completions", PASSTHROUGH)):
        svc, _, states = service()
        seq, asked = recorded(name), []
        replies = [r async for r in svc.Process(_asks_after(seq, asked), _Context(("x-adapter-route", route)))]
        assert len(replies) == len(seq) and asked == [], route
        assert states[0][1] is Outcome.OK and states[0][0].stream_end == "end", route


async def test_a_last_body_chunk_that_does_not_end_the_body_keeps_the_stream_reading():
    svc, _, states = service()
    seq = recorded(LLM)
    seq[-1].response_body.end_of_stream = False  # the answer in two chunks: the first does not end it
    last = type(seq[-1])()
    last.response_body.end_of_stream = True
    replies = await run(svc, [("x-adapter-route", "v1-analyze")], [*seq, last])
    assert len(replies) == len(seq) + 1 and states[0][0].complete
