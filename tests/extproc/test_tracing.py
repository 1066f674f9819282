"""Tracing (extproc/tracing.py): the processor's spans, received by a real OTLP/gRPC receiver.

The real stream handler (`ExtProcService.Process`, real pipelines and a real scheduling profile)
is driven with ProcessingRequest sequences recorded from Envoy 1.40 (tests/data/recorded); the
worker's `Tracing` exports with the real `OTLPSpanExporter` over gRPC to `tests/otlp_receiver.py`
on a free port. Checked: the tree (phase spans under the parent from the gRPC metadata or, without
one, from the request's `traceparent` header; stage spans under their phase; the scheduling
decision under the dispatch stage with the chosen endpoint and the candidates count), sampling
(an unsampled parent and ratio 0 record nothing), a dead collector (requests answered the same,
spans exported again once a collector listens there), reloads (the provider kept, replaced,
dropped), tracing off (no OpenTelemetry module even imported), the config's errors and Envoy's
rendered tracer. Through a real Envoy: tests/e2e/test_tracing.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from prometheus_client import CollectorRegistry

from extproc.config.loader import ConfigError, load_file
from extproc.envoy_render import render
from extproc.metrics import ProcessorMetrics
from extproc.pipeline import Pipeline
from extproc.stack import free_port
from extproc.stream import ConfigRef, ExtProcService
from extproc.tracing import TRACE_ATTR, Tracing
from extproc.types import CONTINUE, HttpMessage, Phase, RequestState
from tests.conftest import REPO
from tests.extproc.test_lifecycle import RECORDED, recorded
from tests.extproc.test_stream import _Context
from tests.otlp_receiver import OtlpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"  # the span Envoy (or the client) sent as the parent
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
LLM = "v1-analyze-rec-llm-ok.txtpb"
ENDPOINTS = ("127.0.0.1:18101", "127.0.0.1:18102")


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


def config(tmp_path: Path, endpoint: str | None, ratio: float = 1.0, export_timeout: str = "2s") -> Path:
    """The recorded config's routes, the llm route picking from two endpoints by a scheduling profile."""
    tracing = (f"\n  tracing: {{endpoint: \"{endpoint}\", samplingRatio: {ratio}, exportTimeout: {export_timeout}}}"
               if endpoint else "")
    path = tmp_path / "gw.yaml"
    path.write_text(textwrap.dedent(f"""\
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {{name: exp}}
        spec:
          modelRef: "qwen2.5-finance@registry.internal"
          processor: {{workers: 1}}
          backends:
            - {{name: fake, endpoints: {json.dumps(list(ENDPOINTS))}}}
          plugins:
            - {{type: in-flight-scorer}}
            - {{type: max-score-picker, parameters: {{fallbacks: 1}}}}
          schedulingProfiles:
            - {{name: spread, plugins: [{{pluginRef: in-flight-scorer}}, {{pluginRef: max-score-picker}}]}}
          routes:
            - path: "/v1/analyze"
              plugins: [spread]
              transform: |
                {{"voucher": {{"amount": $.output.amount, "account": $.output.account}}}}
            - path: "/v1/chat/completions"
              kind: passthrough""") + tracing + "\n")
    return path


def service(path: Path) -> tuple[ExtProcService, list]:
    svc = ExtProcService(ConfigRef(load_file(path)), ProcessorMetrics(CollectorRegistry()))
    done: list = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: done.append(state))
    return svc, done


async def run(svc, metadata, sequence):
    async def source():
        for r in sequence:
            yield r
    return [reply async for reply in svc.Process(source(), _Context(*metadata))]


def with_header(sequence, name: str, value: str):
    """The recorded sequence with one more request header (a client's `traceparent`)."""
    first = sequence[0]
    first.request_headers.headers.headers.append(base_pb2.HeaderValue(key=name, raw_value=value.encode()))
    return sequence


def tree(spans, trace_id: str):
    mine = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}
    return mine, by_id


async def test_phase_stage_and_decision_spans_form_a_tree_under_the_grpc_metadata_parent(tmp_path, receiver):
    svc, done = service(config(tmp_path, receiver.address))
    replies = await run(svc, [("x-adapter-route", "v1-analyze"), ("x-request-id", "rid-1"),
                              ("traceparent", SAMPLED), ("tracestate", "vendor=1")], recorded(LLM))
    assert len(replies) == 4 and done, "the request was answered and ended"
    assert svc.runtime.tracing.flush()
    spans = receiver.wait(lambda got: any(s.name == "scheduling decision" for s in got))
    mine, by_id = tree(spans, TRACE_ID)
    assert len(mine) == len(spans), "every span is in the client's trace"
    assert {s.service for s in mine} == {"adapter-gateway-processor"}
    phases = [s for s in mine if s.name.startswith("ext_proc ")]
    assert sorted(s.attributes["adapter.phase"] for s in phases) == sorted(
        ["request_headers", "request_body", "response_headers", "response_body"])
    for p in phases:
        assert p.parent_id == PARENT_ID and p.kind == 2  # SPAN_KIND_SERVER
        assert p.attributes["adapter.route"] == "v1-analyze" and p.attributes["adapter.request_id"] == "rid-1"
        assert p.attributes["adapter.trace_parent"] == "grpc-metadata"
        assert p.attributes["adapter.verdict"] in ("continue", "mutate")
    stages = [s for s in mine if s.name.startswith("stage ")]
    for s in stages:  # every stage span is a child of a phase span of its own phase
        parent = by_id[s.parent_id]
        assert parent.name.startswith("ext_proc ") and parent.attributes["adapter.phase"] == s.attributes["adapter.phase"]
        assert parent.start_ns <= s.start_ns and s.end_ns <= parent.end_ns
    body_stages = [s.attributes["adapter.stage"] for s in sorted(stages, key=lambda s: s.start_ns)
                   if s.attributes["adapter.phase"] == "request_body"]
    hooks = svc.config.current.routes["v1-analyze"].pipeline._hooks[Phase.REQUEST_BODY]
    assert body_stages == [name for name, _, _ in hooks] and "dispatch" in body_stages  # each hook, in order
    [decision] = [s for s in mine if s.name == "scheduling decision"]
    dispatch = by_id[decision.parent_id]
    assert dispatch.name == "stage dispatch"
    assert decision.attributes["adapter.scheduling.candidates"] == 2
    assert decision.attributes["adapter.scheduling.endpoint"] in ENDPOINTS
    assert decision.attributes["adapter.scheduling.profile"] == "spread"
    assert decision.attributes["adapter.backend"] == "fake"
    # the endpoint on the span is the one dispatch sent the request to
    assert decision.attributes["adapter.scheduling.endpoint"] == done[0].endpoint
    await svc.runtime.stop_tracing()


async def test_without_metadata_the_request_traceparent_header_is_the_parent(tmp_path, receiver):
    svc, _ = service(config(tmp_path, receiver.address))
    await run(svc, [("x-adapter-route", "v1-chat-completions")],
              with_header(recorded("v1-chat-completions-rec-passthrough.txtpb"), "traceparent", SAMPLED))
    svc.runtime.tracing.flush()
    spans = receiver.wait(lambda got: any(s.name == "ext_proc request_headers" for s in got))
    [phase] = [s for s in spans if s.name == "ext_proc request_headers"]
    assert (phase.trace_id, phase.parent_id) == (TRACE_ID, PARENT_ID)
    assert phase.attributes["adapter.trace_parent"] == "request-headers"
    assert {by for by in (s.parent_id for s in spans if s.name.startswith("stage "))} == {phase.span_id}
    await svc.runtime.stop_tracing()


async def test_an_unsampled_parent_and_ratio_zero_record_nothing(tmp_path, receiver):
    svc, done = service(config(tmp_path, receiver.address, ratio=0.0))
    unsampled = f"00-{'1' * 32}-{PARENT_ID}-00"
    await run(svc, [("x-adapter-route", "v1-analyze"), ("traceparent", unsampled)], recorded(LLM))
    await run(svc, [("x-adapter-route", "v1-analyze")], recorded(LLM))  # no parent: the ratio (0) decides
    assert all(TRACE_ATTR not in s.attrs for s in done) and len(done) == 2
    # a sampled parent is followed whatever the ratio (ParentBased): only this trace arrives
    await run(svc, [("x-adapter-route", "v1-analyze"), ("traceparent", SAMPLED)], recorded(LLM))
    svc.runtime.tracing.flush()
    spans = receiver.wait(lambda got: any(s.name == "scheduling decision" for s in got))
    assert {s.trace_id for s in spans} == {TRACE_ID}
    await svc.runtime.stop_tracing()


async def test_a_dead_collector_changes_no_answer_and_export_resumes_when_one_listens(tmp_path):
    port = free_port()  # nothing listens here yet
    svc, _ = service(config(tmp_path, f"127.0.0.1:{port}", export_timeout="500ms"))
    off = tmp_path / "off"
    off.mkdir()
    plain, _ = service(config(off, None))
    expected = await run(plain, [("x-adapter-route", "v1-analyze")], recorded(LLM))
    for _ in range(20):
        got = await run(svc, [("x-adapter-route", "v1-analyze"), ("traceparent", SAMPLED)], recorded(LLM))
        assert [r.WhichOneof("response") for r in got] == [r.WhichOneof("response") for r in expected]
        assert (got[-1].response_body.response.body_mutation.body
                == expected[-1].response_body.response.body_mutation.body)
    svc.runtime.tracing.flush(timeout=2.0)  # the exports fail (and are dropped); nothing raises here
    late = OtlpReceiver(port=port)  # a collector comes up where the dead one was
    try:
        other = "0af7651916cd43dd8448eb211c80319c"
        await run(svc, [("x-adapter-route", "v1-analyze"), ("traceparent", f"00-{other}-{PARENT_ID}-01")],
                  recorded(LLM))
        svc.runtime.tracing.flush(timeout=5.0)
        spans = late.wait(lambda got: any(s.trace_id == other and s.name == "scheduling decision" for s in got),
                          timeout=30)
        assert {s.trace_id for s in spans} <= {other, TRACE_ID}
    finally:
        late.stop()
    await svc.runtime.stop_tracing()  # bounded: returns although earlier batches never went out
    assert svc.runtime.tracing is None


async def test_a_stage_that_raises_ends_its_span_with_an_error_and_the_request_gets_500(tmp_path, receiver):
    snap = load_file(config(tmp_path, receiver.address))
    tracing = Tracing(snap.spec.spec.tracing)

    class Ok:
        name = "ok"

        def on_request_headers(self, state, msg):
            return CONTINUE

    class Broken:
        name = "broken"

        def on_request_headers(self, state, msg):
            raise KeyError("boom")

    pipeline = Pipeline([Ok(), Broken()])
    state = RequestState(snapshot=snap, route=snap.routes["v1-analyze"], started=0.0, request_id="r")
    trace = tracing.stream([_Context(("traceparent", SAMPLED)).md[0]], state)
    verdict = await trace.phase(pipeline, state, HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/"}))
    assert (verdict.status, verdict.code) == (500, "stage_error")
    assert tracing.flush()
    spans = receiver.wait(lambda got: len(got) == 3)
    by_name = {s.name: s for s in spans}
    assert by_name["stage ok"].status_code == 0 and by_name["stage ok"].attributes["adapter.verdict"] == "continue"
    assert by_name["stage broken"].status_code == 2  # STATUS_CODE_ERROR
    phase = by_name["ext_proc request_headers"]
    assert phase.status_code == 2 and phase.attributes["error.type"] == "stage_error"
    assert phase.attributes["http.response.status_code"] == 500
    tracing.shutdown()


async def test_a_streamed_body_gets_spans_for_its_first_and_last_chunk_only(tmp_path, receiver):
    snap = load_file(config(tmp_path, receiver.address))
    tracing = Tracing(snap.spec.spec.tracing)

    class Chunks:
        name = "chunks"
        streams = (Phase.RESPONSE_BODY,)
        seen = 0

        def on_response_body(self, state, msg):
            Chunks.seen += 1
            return CONTINUE

    pipeline = Pipeline([Chunks()])
    state = RequestState(snapshot=snap, route=snap.routes["v1-analyze"], started=0.0, request_id="r")
    trace = tracing.stream([_Context(("traceparent", SAMPLED)).md[0]], state)
    for i in range(10):
        await trace.phase(pipeline, state, HttpMessage(Phase.RESPONSE_BODY, body=b"data: {}\n\n", end_of_stream=i == 9))
    assert Chunks.seen == 10  # every chunk ran its stages
    assert tracing.flush()
    spans = receiver.wait(lambda got: len(got) >= 4)
    phases = sorted((s for s in spans if s.name == "ext_proc response_body"), key=lambda s: s.start_ns)
    assert len(phases) == 2 and len([s for s in spans if s.name == "stage chunks"]) == 2
    assert "adapter.chunks_untraced" not in phases[0].attributes
    assert phases[1].attributes["adapter.chunks_untraced"] == 8
    tracing.shutdown()


def test_reloads_keep_replace_and_drop_the_provider(tmp_path):
    svc, _ = service(config(tmp_path, "127.0.0.1:4317"))
    first = svc.runtime.tracing
    assert first is not None and first.spec.endpoint == "127.0.0.1:4317"
    svc.config.swap(load_file(config(tmp_path, "127.0.0.1:4317"), generation=2))  # same spec: kept
    assert svc.runtime.tracing is first
    svc.config.swap(load_file(config(tmp_path, "127.0.0.1:4317", ratio=0.5), generation=3))  # changed: replaced
    second = svc.runtime.tracing
    assert second is not first and second.spec.sampling_ratio == 0.5
    svc.config.swap(load_file(config(tmp_path, None), generation=4))  # removed: off
    assert svc.runtime.tracing is None
    # the replaced and the dropped providers were shut down (in the background: a reload never waits)
    assert first.stopped.wait(10) and second.stopped.wait(10)


def test_tracing_off_creates_no_span_and_imports_no_opentelemetry(tmp_path):
    """In a fresh interpreter: a config without spec.tracing serves the recorded llm request (a
    scheduling decision included) without any OpenTelemetry module being imported."""
    path = config(tmp_path, None)
    code = textwrap.dedent(f"""
        import asyncio, sys
        from prometheus_client import CollectorRegistry
        from extproc.config.loader import load_file
        from extproc.metrics import ProcessorMetrics
        from extproc.stream import ConfigRef, ExtProcService
        from tests.extproc.test_lifecycle import recorded
        from tests.extproc.test_stream import _Context
        svc = ExtProcService(ConfigRef(load_file({str(path)!r})), ProcessorMetrics(CollectorRegistry()))
        done = []
        svc.runtime.lifecycle.observers.append(lambda state, outcome: done.append(state))
        async def run():
            async def source():
                for r in recorded({LLM!r}):
                    yield r
            ctx = _Context(("x-adapter-route", "v1-analyze"), ("traceparent", {SAMPLED!r}))
            return [reply async for reply in svc.Process(source(), ctx)]
        replies = asyncio.run(run())
        assert len(replies) == 4 and done and done[0].endpoint, (replies, done)
        assert svc.runtime.tracing is None and "trace" not in done[0].attrs
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bad_tracing_config_names_the_file_field_and_reason(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(config(tmp_path, "127.0.0.1:4317").read_text().replace(
        'endpoint: "127.0.0.1:4317", samplingRatio: 1.0', 'endpoint: "collector", samplingRatio: 1.5'))
    with pytest.raises(ConfigError) as e:
        load_file(path)
    text = str(e.value)
    assert f"{path}:" in text and "spec.tracing.endpoint" in text and "must be host:port" in text
    assert "spec.tracing.samplingRatio" in text and "less than or equal to 1" in text


def test_envoy_gets_the_opentelemetry_tracer_only_when_tracing_is_on(tmp_path):
    on = render(load_file(config(tmp_path, "10.0.0.9:4317", ratio=0.25)), 1)
    hcm = on["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    t = hcm["tracing"]
    assert t["random_sampling"] == {"value": 25.0} and t["spawn_upstream_span"] is True
    assert t["provider"]["name"] == "envoy.tracers.opentelemetry"
    cfg = t["provider"]["typed_config"]
    assert cfg["grpc_service"]["google_grpc"]["target_uri"] == "10.0.0.9:4317"
    assert cfg["service_name"] == "adapter-gateway-envoy"
    off = render(load_file(config(tmp_path, None)), 1)
    assert "tracing" not in off["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
