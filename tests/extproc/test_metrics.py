"""Buffered metric updates (`extproc.metrics.Pending`) write exactly what direct updates would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import LATENCY_BUCKETS, ProcessorMetrics, Pending


def samples(registry: CollectorRegistry) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_flushed_updates_equal_direct_updates():
    direct, buffered = CollectorRegistry(), CollectorRegistry()
    md, mb = ProcessorMetrics(direct), ProcessorMetrics(buffered)
    pending = Pending()
    rng = random.Random(7)
    values = [rng.choice(LATENCY_BUCKETS) for _ in range(50)] + [rng.uniform(0, 2) for _ in range(200)] + [5.0]
    for v in values:  # bucket bounds themselves, values between them and one beyond the last
        md.phase_duration.labels("r", "request_headers").observe(v)
        pending.observe(mb.phase_duration.labels("r", "request_headers"), v)
    for n in (1, 1, 3, 0.5):
        md.requests.labels("r", "ok").inc(n)
        pending.inc(mb.requests.labels("r", "ok"), n)
    assert samples(buffered) != samples(direct)  # nothing written before the flush
    pending.flush()
    assert samples(buffered) == samples(direct)
    pending.flush()  # a second flush writes nothing again
    assert samples(buffered) == samples(direct)


# --- every documented metric: declared as documented, and counted as the requests went -------------

import re  # noqa: E402

import pytest  # noqa: E402

from envoy.data.accesslog.v3 import accesslog_pb2  # noqa: E402
from envoy.service.accesslog.v3 import als_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from extproc.config.loader import load_file  # noqa: E402
from extproc.feedback import AccessLogFeedback  # noqa: E402
from extproc.runtime import Runtime  # noqa: E402
from extproc.stream import ConfigRef, ExtProcService  # noqa: E402
from tests.conftest import DATA, REPO  # noqa: E402
from tests.promtext import collect  # noqa: E402

RECORDED = DATA / "recorded"
SUPERVISOR_METRICS = {  # served by the supervisor's own collector: tests/extproc/test_supervisor.py
    "adapter_processor_worker_config_info": ("gauge", ("worker", "generation", "digest")),
    "adapter_processor_config_accepted_generation": ("gauge", ()),
    "adapter_processor_config_reloads_total": ("counter", ("result",)),
}


def declared() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{exposed name: (type, label names)} of every metric ProcessorMetrics declares."""
    out = {}
    for m in vars(ProcessorMetrics(CollectorRegistry())).values():
        name = m._name + ("_total" if m._type == "counter" else "")
        out[name] = (m._type, tuple(m._labelnames))
    return out


def documented_in_operations() -> dict[str, tuple[str, ...]]:
    section = (REPO / "docs" / "operations.md").read_text().split("## Metrics (Prometheus)")[1].split("\n## ")[0]
    return {name: tuple(labels.split(",")) if labels else ()
            for name, labels in re.findall(r"`((?:adapter_processor|gen_ai)_\w+)(?:\{([\w,]+)\})?`", section)}


def documented_in_module() -> dict[str, tuple[str, tuple[str, ...]]]:
    import extproc.metrics as mod

    out = {}
    for name, kind, labels in re.findall(r"^\| ((?:adapter_processor|gen_ai)_\w+) \| (\w+) \| ([^|]*)\|", mod.__doc__,
                                         re.M):
        names = labels.split("(")[0].strip()  # "route, outcome (ok, ...)": the label names come first
        out[name] = (kind, tuple(n.strip() for n in names.split(",")) if names else ())
    return out


def test_every_documented_processor_metric_is_declared_with_the_documented_type_and_labels():
    ops = documented_in_operations()
    have = declared()
    assert {n: labels for n, (_, labels) in have.items()} | {n: v[1] for n, v in SUPERVISOR_METRICS.items()} == ops
    assert documented_in_module() == have


def recorded(name: str) -> list[pb.ProcessingRequest]:
    chunks = (RECORDED / name).read_text().split("# message\n")[1:]
    return [text_format.Parse(c, pb.ProcessingRequest()) for c in chunks]


class _Md:
    def __init__(self, key: str, value: str):
        self.key, self.value = key, value


class _Context:
    def __init__(self, **md: str):
        self.md = [_Md(k, v) for k, v in md.items()]

    def invocation_metadata(self):
        return self.md


def service(config=RECORDED / "config.yaml", feedback: bool = False):
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(config)), ProcessorMetrics(registry), runtime=Runtime(feedback=feedback))
    return svc, registry


async def stream(svc, requests, on_reply=None, **md) -> list:
    async def source():
        for r in requests:
            yield r
    replies = []
    async for reply in svc.Process(source(), _Context(**md)):
        replies.append(reply)
        if on_reply is not None:
            on_reply(reply)
    return replies


def route_md(route: str, **more: str) -> dict:
    return {"x-adapter-route": route, "x-request-id": "rid", **more}


async def test_a_served_request_counts_once_per_phase_and_the_stream_gauge_returns_to_zero():
    svc, registry = service()
    during = []
    replies = await stream(svc, recorded("v1-analyze-rec-llm-ok.txtpb"),
                           on_reply=lambda r: during.append(collect(registry).value("adapter_processor_streams_active")),
                           **route_md("v1-analyze"))
    assert len(replies) == 4 and during == [1.0] * 4  # open while Envoy exchanges messages
    s = collect(registry, [svc])
    assert s.series("adapter_processor_requests_total") == {(("outcome", "ok"), ("route", "v1-analyze")): 1.0}
    assert s.series("adapter_processor_errors_total") == {}
    assert s.series("adapter_processor_tokens_total") == {  # the recorded backend reported 3 and 5
        (("backend", "fake"), ("model", "qwen2.5-finance"), ("route", "v1-analyze"), ("tenant", "none"), ("type", k)): v
        for k, v in (("prompt", 3.0), ("completion", 5.0))}
    assert s.series("adapter_processor_batch_size_count") == {}  # not a tensor route
    assert s.series("adapter_processor_admission_total") == {}  # no tenants configured
    assert s.series("adapter_processor_phase_duration_seconds_count") == {
        (("phase", p), ("route", "v1-analyze")): 1.0
        for p in ("request_headers", "request_body", "response_headers", "response_body")}
    assert s.series("adapter_processor_request_duration_seconds_count") == {(("route", "v1-analyze"),): 1.0}
    busy = s.value("adapter_processor_request_duration_seconds_sum", route="v1-analyze")
    phases = sum(s.series("adapter_processor_phase_duration_seconds_sum").values())
    assert busy == pytest.approx(phases) and busy > 0  # the request's processor time is its phases' sum
    assert s.value("adapter_processor_request_duration_seconds_bucket", route="v1-analyze", le="+Inf") == 1
    assert s.value("adapter_processor_streams_active") == 0
    assert s.value("adapter_processor_config_mismatch_total") == 0

    await stream(svc, recorded("v1-analyze-rec-llm-malformed.txtpb"), **route_md("v1-analyze"))
    await stream(svc, recorded("v1-analyze-rec-llm-malformed.txtpb"), **route_md("v1-analyze"))
    s = collect(registry, [svc])
    assert s.series("adapter_processor_requests_total") == {
        (("outcome", "ok"), ("route", "v1-analyze")): 1.0, (("outcome", "rejected"), ("route", "v1-analyze")): 2.0}
    assert s.series("adapter_processor_errors_total") == {(("reason", "malformed_json"), ("route", "v1-analyze")): 2.0}
    assert s.value("adapter_processor_phase_duration_seconds_count", phase="request_body", route="v1-analyze") == 3
    assert s.value("adapter_processor_phase_duration_seconds_count", phase="response_body", route="v1-analyze") == 1
    assert s.series("adapter_processor_request_duration_seconds_count") == {(("route", "v1-analyze"),): 3.0}
    assert s.value("adapter_processor_streams_active") == 0


async def test_a_stream_with_an_unknown_digest_is_counted_as_a_mismatch_and_as_rejected():
    svc, registry = service()
    for _ in range(3):
        await stream(svc, recorded("v1-analyze-rec-llm-ok.txtpb")[:1],
                     **route_md("v1-analyze", **{"x-adapter-config-digest": "sha256:not-this-one"}))
    s = collect(registry, [svc])
    assert s.value("adapter_processor_config_mismatch_total") == 3
    # refused by the processor before any backend was asked: `rejected`, whatever the status (503)
    assert s.series("adapter_processor_requests_total") == {(("outcome", "rejected"), ("route", "unknown")): 3.0}
    # the error is labelled with the route Envoy named (a route of the current config), the request with
    # "unknown" (the stream served no route): as extproc/stream.py does today
    assert s.series("adapter_processor_errors_total") == {(("reason", "config_mismatch"), ("route", "v1-analyze")): 3.0}


def log_entry(token: str, ttfb_ns: int, status: int = 200) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.common_properties.metadata.filter_metadata["adapter"].update({"token": token})
    e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
    e.common_properties.upstream_remote_address.socket_address.port_value = 18101
    e.common_properties.time_to_first_upstream_rx_byte.nanos = ttfb_ns
    e.response.response_code.value = status
    return e


async def test_envoys_access_log_counts_entries_by_result_and_the_backends_first_byte():
    svc, registry = service(feedback=True)
    lc = svc.runtime.lifecycle
    fb = AccessLogFeedback(lc, svc.metrics)
    for _ in range(2):
        await stream(svc, recorded("v1-chat-completions-rec-passthrough.txtpb"), **route_md("v1-chat-completions"))
    tokens = list(lc._open)
    assert len(tokens) == 2 and collect(registry, [svc]).series("adapter_processor_requests_total") == {}
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend([log_entry(tokens[0], 12_000_000), log_entry(tokens[1], 3_000_000, 503)])
    fb.handle(message)
    fb.handle(message)  # the same entries again: late
    orphan = als_pb2.StreamAccessLogsMessage()
    orphan.http_logs.log_entry.extend([log_entry(tokens[0] + "9", 1)])
    fb.handle(orphan)
    s = collect(registry, [svc])
    assert s.series("adapter_processor_feedback_entries_total") == {
        (("result", "matched"),): 2.0, (("result", "late"),): 2.0, (("result", "orphan"),): 1.0}
    assert s.series("adapter_processor_requests_total") == {
        (("outcome", o), ("route", "v1-chat-completions")): 1.0 for o in ("ok", "backend_error")}
    (backend,) = {dict(lab)["backend"] for lab in s.series("adapter_processor_upstream_first_byte_seconds_count")}
    first = {"backend": backend, "route": "v1-chat-completions"}
    assert s.series("adapter_processor_upstream_first_byte_seconds_count") == {tuple(sorted(first.items())): 2.0}
    assert s.value("adapter_processor_upstream_first_byte_seconds_sum", **first) == pytest.approx(0.015)
    assert s.value("adapter_processor_upstream_first_byte_seconds_bucket", le="0.0025", **first) == 0
    assert s.value("adapter_processor_upstream_first_byte_seconds_bucket", le="0.005", **first) == 1
    assert s.value("adapter_processor_upstream_first_byte_seconds_bucket", le="0.025", **first) == 2


async def test_admissions_are_counted_per_configured_tenant_and_result_and_tokens_carry_the_tenant(tmp_path):
    from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample

    snap = tmp_path / "agent.snap"
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text((RECORDED / "config.yaml").read_text().replace("  backends:", f"""\
  tenancy: {{snapshot: {snap}, staleAfter: 60s}}
  tenants:
    - {{id: hot, cpu: {{limit: 0.2}}}}
    - {{id: cool, cpu: {{limit: 1}}}}
    - {{id: unmeasured, cpu: {{limit: 1}}}}
    - {{id: free}}
  backends:""", 1))
    writer = SnapshotWriter(snap)
    writer.write(SnapshotData(tenants=[
        TenantSample("hot", cpu_used=0.9, cpu_limit=0.2, window_start_mono_ns=0, window_end_mono_ns=10**9),
        TenantSample("cool", cpu_used=0.1, cpu_limit=1, window_start_mono_ns=0, window_end_mono_ns=10**9)],
        source="poll", interval_ns=100_000_000, window_ns=10**9))
    svc, registry = service(cfg)
    sent = {"hot": 2, "cool": 3, "unmeasured": 1, "free": 1, "stranger": 2}
    for tenant, n in sent.items():
        for _ in range(n):
            await stream(svc, recorded("v1-analyze-rec-llm-ok.txtpb"), **route_md("v1-analyze", **{"x-adapter-tenant": tenant}))
    writer.close(remove=True)
    s = collect(registry, [svc])
    assert s.series("adapter_processor_admission_total") == {  # unknown tenants are no label value
        (("result", "rejected"), ("tenant", "hot")): 2.0, (("result", "admitted"), ("tenant", "cool")): 3.0,
        (("result", "stale"), ("tenant", "unmeasured")): 1.0, (("result", "admitted"), ("tenant", "free")): 1.0}
    assert s.series("adapter_processor_errors_total") == {
        (("reason", "tenant_over_quota"), ("route", "v1-analyze")): 2.0,
        (("reason", "unknown_tenant"), ("route", "v1-analyze")): 2.0}
    assert s.series("adapter_processor_requests_total") == {
        (("outcome", "ok"), ("route", "v1-analyze")): 5.0, (("outcome", "rejected"), ("route", "v1-analyze")): 4.0}
    served = {"cool": 3, "unmeasured": 1, "free": 1}  # the recorded backend reports 3 prompt, 5 completion tokens
    assert s.series("adapter_processor_tokens_total") == {
        (("backend", "fake"), ("model", "qwen2.5-finance"), ("route", "v1-analyze"), ("tenant", t), ("type", k)): n * per
        for t, n in served.items() for k, per in (("prompt", 3), ("completion", 5))}
