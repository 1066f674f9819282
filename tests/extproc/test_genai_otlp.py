"""The GenAI metrics over OTLP (extproc/genai_otlp.py), received by a real OTLP/gRPC receiver.

The real stream handler (`ExtProcService.Process`: real pipelines, an openai route whose scheduling
profile picks the endpoint) serves chat completions built as Envoy sends them (request headers and
body, response headers, an SSE response chunk by chunk); the worker's `GenAiOtlp` exports with the
real `OTLPMetricExporter` over gRPC to `tests/otlp_receiver.py` on a free port. Checked: the four
metrics' names, units, descriptions, bucket boundaries (the conventions' lists, written out here)
and attributes; every Prometheus series of the same requests has an OTLP point with the same
count, sum and buckets; token counts of a backend that reported no usage carry `estimated=true`; a
dead collector changes no answer and the totals arrive once a collector listens there; reloads
keep, replace and drop the meter provider; off, no OpenTelemetry module is even imported; the
config's errors. Through a real Envoy: tests/e2e/test_genai_otlp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.config.loader import ConfigError, load_file
from extproc.metrics import ProcessorMetrics
from extproc.stack import free_port
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import Outcome
from tests.conftest import REPO
from tests.extproc.test_stream import _Context
from tests.genai_metrics import histogram_points
from tests.promtext import collect

ENDPOINTS = ("127.0.0.1:18101", "127.0.0.1:18102")
BARE = "127.0.0.1:18103"  # a backend that sends no usage (its dialect refuses stream_options)
# the conventions' advised boundaries (open-telemetry/semantic-conventions docs/gen-ai/gen-ai-metrics.md)
CONVENTIONS = {
    "gen_ai.server.request.duration": ("s", (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                                             20.48, 40.96, 81.92)),
    "gen_ai.server.time_to_first_token": ("s", (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                                1.0, 2.5, 5.0, 7.5, 10.0)),
    "gen_ai.server.time_per_output_token": ("s", (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                                  1.0, 2.5)),
    "gen_ai.client.token.usage": ("{token}", (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576,
                                              4194304, 16777216, 67108864)),
}


def _receiver(**kw):
    from tests.otlp_receiver import OtlpReceiver  # here: the fresh interpreter of the "off" test imports this module

    return OtlpReceiver(**kw)


@pytest.fixture
def receiver():
    r = _receiver()
    yield r
    r.stop()


def config(tmp_path: Path, endpoint: str | None, interval: str = "60s", export_timeout: str = "2s",
           name: str = "gw.yaml") -> Path:
    """An openai route over a vllm pool (two endpoints, a scheduling profile picks) and a backend without usage."""
    otlp = (f"\n  otlpMetrics: {{endpoint: \"{endpoint}\", interval: {interval}, exportTimeout: {export_timeout}}}"
            if endpoint else "")
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""\
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {{name: otlp}}
        spec:
          processor: {{workers: 1}}
          backends:
            - {{name: pool, kind: vllm, models: [m], endpoints: {json.dumps(list(ENDPOINTS))}, dialect: {{preset: vllm}}}}
            - {{name: bare, models: [n], endpoints: ["{BARE}"], dialect: {{preset: openai, streamUsage: refused}}}}
          plugins:
            - {{type: in-flight-scorer}}
            - {{type: max-score-picker, parameters: {{fallbacks: 1}}}}
          schedulingProfiles:
            - {{name: spread, plugins: [{{pluginRef: in-flight-scorer}}, {{pluginRef: max-score-picker}}]}}
          routes:
            - {{path: "/v1/", match: prefix, kind: openai, targets: [pool, bare], plugins: [spread]}}""") + otlp + "\n")
    return path


def service(path: Path) -> tuple[ExtProcService, CollectorRegistry, list]:
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(path)), ProcessorMetrics(registry))
    done: list = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: done.append((state, outcome)))
    return svc, registry, done


def _headers(msg, pairs) -> None:
    for k, v in pairs:
        msg.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))


def _event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat(model: str = "m", stream: bool = True, tokens: int = 5, usage: bool = True, status: int = 200) -> list:
    """What Envoy sends the processor for one chat completion: request headers and body, the response's
    headers, then its body chunk by chunk (an SSE stream, or one JSON answer)."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 40}], "stream": stream})
    seq = []
    r = pb.ProcessingRequest()
    _headers(r.request_headers, ((":path", "/v1/chat/completions"), (":method", "POST"),
                                 ("content-type", "application/json")))
    seq.append(r)
    r = pb.ProcessingRequest()
    r.request_body.body, r.request_body.end_of_stream = body, True
    seq.append(r)
    r = pb.ProcessingRequest()
    _headers(r.response_headers, ((":status", str(status)),
                                  ("content-type", "text/event-stream" if stream else "application/json")))
    seq.append(r)
    counted = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
    if status >= 400:
        chunks = [orjson.dumps({"error": {"message": "engine died"}})]
    elif stream:
        chunks = [_event({"choices": [{"index": 0, "delta": {"content": "tok"}}]}) for _ in range(tokens)]
        chunks.append(_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        if usage:
            chunks.append(_event({"choices": [], "usage": counted}))
        chunks[-1] += b"data: [DONE]\n\n"
    else:
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "tok " * tokens}}]}
        chunks = [orjson.dumps({**answer, "usage": counted} if usage else answer)]
    for i, c in enumerate(chunks):
        r = pb.ProcessingRequest()
        r.response_body.body, r.response_body.end_of_stream = c, i == len(chunks) - 1
        seq.append(r)
    return seq


async def run(svc, sequence, request_id: str = "r"):
    async def source():
        for r in sequence:
            yield r
    return [reply async for reply in svc.Process(source(), _Context(("x-adapter-route", "v1"),
                                                                     ("x-request-id", request_id)))]


def prometheus_points(registry) -> dict:
    """{(otel name, attributes as the OTLP side has them): (count, sum, cumulative buckets)} of the
    Prometheus histograms."""
    return histogram_points(collect(registry))


def otlp_points(receiver) -> dict:
    out = {}
    for name in CONVENTIONS:
        for p in receiver.latest(name):
            cumulative, total = {}, 0
            for bound, n in zip(p.bounds + (float("inf"),), p.bucket_counts):
                total += n
                cumulative[float(bound)] = total
            out[(name, tuple(sorted(p.attributes.items())))] = {"count": p.count, "sum": p.sum,
                                                                  "buckets": cumulative}
    return out


async def test_the_four_metrics_arrive_by_convention_and_agree_with_prometheus(tmp_path, receiver):
    svc, registry, done = service(config(tmp_path, receiver.address))
    assert svc.runtime.genai_otlp is not None
    await run(svc, chat(tokens=5), "a")
    await run(svc, chat(tokens=30), "b")
    await run(svc, chat(model="n", tokens=9, usage=False), "c")  # the backend sent no usage: estimated
    await run(svc, chat(stream=False, tokens=3), "d")  # a JSON answer: no TTFT, no TPOT
    await run(svc, chat(status=500), "e")  # a backend error: the duration only, with error.type
    assert [o for _, o in done] == [Outcome.OK] * 4 + [Outcome.BACKEND_ERROR]
    assert svc.runtime.genai_otlp.flush()
    svc.flush_metrics()
    receiver.wait_metrics(lambda r: r.count("gen_ai.server.request.duration") == 5)
    points = receiver.points
    by_name = {p.name: p for p in points}
    assert set(by_name) == set(CONVENTIONS)
    for name, (unit, bounds) in CONVENTIONS.items():
        p = by_name[name]
        assert (p.unit, p.bounds) == (unit, tuple(float(b) for b in bounds)), name
        assert p.temporality == 2 and p.scope == "adapter-gateway.extproc"  # cumulative
        assert p.service == "adapter-gateway-processor" and p.resource["adapter.worker"] == 0
    assert by_name["gen_ai.server.time_to_first_token"].description == \
        "Time to generate first token for successful responses."

    # the same requests, the same numbers: every Prometheus series has its OTLP point
    prom, otlp = prometheus_points(registry), otlp_points(receiver)
    assert set(prom) == set(otlp)
    for key, want in prom.items():
        got = otlp[key]
        assert got["count"] == want["count"], key
        assert got["sum"] == pytest.approx(want["sum"]), key
        assert got["buckets"] == want["buckets"], key

    # the attributes, by convention
    endpoints = {st.endpoint for st, _ in done if st.backend == "pool"}
    assert endpoints and endpoints <= set(ENDPOINTS)
    usage = receiver.latest("gen_ai.client.token.usage")
    for p in usage:
        a = p.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.token.type"] in ("input", "output")
        assert "error.type" not in a
        if a["gen_ai.request.model"] == "m":
            assert a["gen_ai.provider.name"] == "vllm" and a["estimated"] is False
            assert f"{a['server.address']}:{a['server.port']}" in endpoints and isinstance(a["server.port"], int)
        else:
            assert a["gen_ai.request.model"] == "n" and a["gen_ai.provider.name"] == "openai"
            assert a["estimated"] is True and (a["server.address"], a["server.port"]) == ("127.0.0.1", 18103)
    assert receiver.count("gen_ai.client.token.usage", **{"gen_ai.request.model": "n", "estimated": True}) == 2
    assert receiver.count("gen_ai.client.token.usage", **{"gen_ai.token.type": "output", "estimated": False}) == 3
    [failed] = [p for p in receiver.latest("gen_ai.server.request.duration") if "error.type" in p.attributes]
    assert failed.attributes["error.type"] == "500" and failed.count == 1
    assert receiver.count("gen_ai.server.time_to_first_token") == 3  # the streamed OK ones
    assert receiver.count("gen_ai.server.time_per_output_token") == 3
    # the advised boundaries at work: the backend counted 3, 5 and 30 output tokens, in the buckets
    # (1, 4], (4, 16] and (16, 64] of the token histogram (summed over the two endpoints' points)
    counted = [p.bucket_counts for p in usage
               if p.attributes["gen_ai.token.type"] == "output" and p.attributes["estimated"] is False]
    assert [sum(c) for c in zip(*counted)] == [0, 1, 1, 1] + [0] * 11
    await svc.runtime.stop_genai_otlp()
    assert svc.runtime.genai_otlp is None


async def test_a_dead_collector_changes_no_answer_and_the_totals_arrive_once_one_listens(tmp_path):
    port = free_port()  # nothing listens here yet
    svc, registry, _ = service(config(tmp_path, f"127.0.0.1:{port}", interval="100ms", export_timeout="500ms"))
    off = tmp_path / "off"
    off.mkdir()
    plain, _, _ = service(config(off, None))
    assert plain.runtime.genai_otlp is None
    expected = await run(plain, chat())
    for i in range(20):
        got = await run(svc, chat(), f"r{i}")
        assert [r.WhichOneof("response") for r in got] == [r.WhichOneof("response") for r in expected]
        assert ([r.response_body.response.body_mutation.body for r in got if r.HasField("response_body")]
                == [r.response_body.response.body_mutation.body for r in expected if r.HasField("response_body")])
    svc.runtime.genai_otlp.flush(timeout=2.0)  # the export fails (and is dropped); nothing raises here
    late = _receiver(port=port)  # a collector comes up where the dead one was
    try:
        svc.runtime.genai_otlp.flush(timeout=5.0)
        # cumulative temporality: the first export that gets through carries all 20
        late.wait_metrics(lambda r: r.count("gen_ai.server.request.duration") == 20, timeout=30)
        svc.flush_metrics()
        assert collect(registry).total("gen_ai_server_request_duration_seconds_count") == 20
    finally:
        late.stop()
    await svc.runtime.stop_genai_otlp()  # bounded: returns although the collector is gone again


def test_reloads_keep_replace_and_drop_the_meter_provider(tmp_path):
    svc, _, _ = service(config(tmp_path, "127.0.0.1:4317"))
    first = svc.runtime.genai_otlp
    assert first is not None and first.spec.endpoint == "127.0.0.1:4317" and first.spec.interval == 60.0
    svc.config.swap(load_file(config(tmp_path, "127.0.0.1:4317"), generation=2))  # same spec: kept
    assert svc.runtime.genai_otlp is first
    svc.config.swap(load_file(config(tmp_path, "127.0.0.1:4317", interval="5s"), generation=3))  # changed: replaced
    second = svc.runtime.genai_otlp
    assert second is not first and second.spec.interval == 5.0
    svc.config.swap(load_file(config(tmp_path, None), generation=4))  # removed: off
    assert svc.runtime.genai_otlp is None
    # the replaced and the dropped providers were shut down (in the background: a reload never waits)
    assert first.stopped.wait(10) and second.stopped.wait(10)


def test_off_records_prometheus_only_and_imports_no_opentelemetry(tmp_path):
    """In a fresh interpreter: a config without spec.otlpMetrics (nor spec.tracing) serves a streamed
    chat, whose GenAI metrics reach Prometheus, without any OpenTelemetry module being imported."""
    path = config(tmp_path, None)
    code = textwrap.dedent(f"""
        import asyncio, sys
        from prometheus_client import CollectorRegistry
        from tests.extproc.test_genai_otlp import chat, run, service
        from tests.promtext import collect
        from pathlib import Path
        svc, registry, done = service(Path({str(path)!r}))
        asyncio.run(run(svc, chat()))
        svc.flush_metrics()
        assert svc.runtime.genai_otlp is None and len(done) == 1
        assert collect(registry).total("gen_ai_client_token_usage_count") == 2
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("fields, field, reason", [
    ('endpoint: "collector"', "spec.otlpMetrics.endpoint", "must be host:port"),
    ('endpoint: "127.0.0.1:4317", interval: 10ms', "spec.otlpMetrics.interval", "greater than or equal to 0.1"),
    ('endpoint: "127.0.0.1:4317", interval: soon', "spec.otlpMetrics.interval", "invalid duration 'soon'"),
    ('endpoint: "127.0.0.1:4317", exportTimeout: 0s', "spec.otlpMetrics.exportTimeout", "must be positive"),
    ('endpoint: "127.0.0.1:4317", intervall: 5s', "spec.otlpMetrics.intervall", "unknown field"),
    ("interval: 5s", "spec.otlpMetrics.endpoint", "required field is missing"),
])
def test_bad_otlp_metrics_config_names_the_file_field_and_reason(tmp_path, fields, field, reason):
    path = tmp_path / "gw.yaml"
    path.write_text(config(tmp_path, None).read_text() + f"  otlpMetrics: {{{fields}}}\n")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    text = str(e.value)
    assert f"{path}:" in text and field in text and reason.lower() in text.lower(), text
