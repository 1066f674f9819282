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
