"""extproc/attribution.py and extproc/attribution_cli.py: the Server-Timing value's syntax (W3C Server Timing,
RFC 8673's structured-field sibling: `name;dur=1.2;desc="..."`), who gets it, the config's errors, what the
stream records per phase (recorded Envoy sequences through ExtProcService), the metric, and the CLI's
quantiles; the whole path through Envoy is tests/e2e/test_attribution.py."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc import attribution
from extproc.attribution_cli import breakdown, delta, histograms, pretty, quantile
from extproc.config.loader import ConfigError, load_file
from extproc.envoy_render import processing_mode
from extproc.metrics import ProcessorMetrics
from extproc.stream import ConfigRef, ExtProcService
from tests.extproc.test_lifecycle import RECORDED, recorded
from tests.extproc.test_stream import LLM, _Context, run
from tests.promtext import collect

# W3C Server Timing: server-timing = #server-timing-metric; metric = metric-name *( OWS ";" OWS param );
# param = param-name OWS "=" OWS param-value; param-value = token / quoted-string (RFC 9110 tokens)
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_PARAM = re.compile(rf"[ \t]*;[ \t]*({_TOKEN})[ \t]*=[ \t]*({_TOKEN}|{_QUOTED})")
_NAME = re.compile(rf"[ \t]*({_TOKEN})")


def parse_server_timing(value: str) -> dict[str, dict[str, str]]:
    """{metric name: {param: value}} of a Server-Timing header value; AssertionError when it does not parse."""
    out: dict[str, dict[str, str]] = {}
    pos = 0
    while True:
        m = _NAME.match(value, pos)
        assert m, f"no metric name at {pos}: {value!r}"
        name, pos, params = m.group(1), m.end(), {}
        while (p := _PARAM.match(value, pos)) is not None:
            v = p.group(2)
            params[p.group(1)] = v[1:-1] if v.startswith('"') else v
            pos = p.end()
        if "dur" in params:
            assert re.fullmatch(r"\d+(\.\d+)?", params["dur"]), params
        assert name not in out, f"metric {name} twice: {value!r}"
        out[name] = params
        rest = value[pos:].lstrip(" \t")
        if not rest:
            return out
        assert rest.startswith(","), f"junk at {pos}: {value!r}"
        pos = len(value) - len(rest) + 1


def test_header_value_is_server_timing_syntax_in_component_order():
    value = attribution.header_value({"upstream_ttfb": 0.0123456, "queue": 0.0, "envoy": 0.0004,
                                      "network_rtt": 0.00005}, total=0.02)
    metrics = parse_server_timing(value)
    assert list(metrics) == ["envoy", "queue", "network_rtt", "upstream_ttfb", "total"]
    assert metrics["upstream_ttfb"] == {"dur": "12.346"} and metrics["envoy"] == {"dur": "0.400"}
    assert metrics["queue"]["desc"] == "no gateway queue" and metrics["network_rtt"]["dur"] == "0.050"
    assert "total" not in parse_server_timing(attribution.header_value({"queue": 0.0}, total=None))


def test_the_parser_refuses_what_is_not_server_timing():
    for bad in ("a;dur=1,", "a;dur=x", "a b", ";dur=1", 'a;desc="open'):
        with pytest.raises(AssertionError):
            parse_server_timing(bad)


def test_envoy_request_time_in_the_forms_envoy_may_send():
    stamp = datetime(2026, 12, 1, 19, 0, 0, 123456, tzinfo=timezone.utc).timestamp()
    assert attribution.envoy_time("2026-12-01T19:00:00.123456789Z") == pytest.approx(stamp + 0.000000789)
    assert attribution.envoy_time("2026-12-01T19:00:00Z") == pytest.approx(stamp - 0.123456)
    assert attribution.envoy_time(12.5) == 12.5
    assert attribution.envoy_time("yesterday") is None and attribution.envoy_time(None) is None


def write_config(tmp_path: Path, timing: str, tenants: str = "") -> Path:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  modelRef: qwen2.5-finance
  {tenants}
  backends: [{{name: fake, kind: vllm, endpoints: ["127.0.0.1:9"], models: [qwen2.5-finance]}}]
  routes:
    - {{path: /v1/analyze, transform: '{{"voucher": $.output}}', serverTiming: {timing}}}
    - {{path: /v1/chat/completions, kind: openai}}
    - {{path: /v1/completions, kind: openai, serverTiming: metrics}}
""")
    return cfg


def test_config_errors_name_the_file_line_field_and_reason(tmp_path):
    cases = {
        "trusted": "spec.routes[0].serverTiming.mode: serverTiming: trusted needs a trusted source",
        "sometimes": "spec.routes[0].serverTiming.mode: Input should be 'trusted', 'always' or 'metrics'",
        "{tenants: [nobody]}": "spec.routes[0].serverTiming.tenants[0]: unknown tenant 'nobody'",
        "{header: X_Bad}": "spec.routes[0].serverTiming.header: String should match pattern",
    }
    for timing, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_file(write_config(tmp_path, timing))
        assert f"gw.yaml:10: {message}" in str(e.value), (timing, str(e.value))
    passthrough = tmp_path / "p.yaml"
    passthrough.write_text(write_config(tmp_path, "always").read_text().replace(
        "kind: openai}", "kind: passthrough, serverTiming: always}"))
    with pytest.raises(ConfigError) as e:
        load_file(passthrough)
    assert "spec.routes[1].serverTiming: a passthrough route's ext_proc stream ends at the request headers" \
        in str(e.value)


def test_only_routes_that_may_send_the_header_ask_envoy_for_more(tmp_path):
    snap = load_file(write_config(tmp_path, "always"))
    routes = snap.routes
    # openai streams skip their response headers; serverTiming (not metrics-only) asks for them
    assert processing_mode(routes["v1-chat-completions"])["response_header_mode"] == "SKIP"
    assert processing_mode(routes["v1-completions"])["response_header_mode"] == "SKIP"
    assert "server-timing" not in [s.name for s in routes["v1-completions"].pipeline.stages]
    assert [s.name for s in routes["v1-analyze"].pipeline.stages][-1] == "server-timing"
    assert routes["v1-chat-completions"].server_timing is None
    from extproc.envoy_render import http_connection_manager

    def request_attributes(snapshot):
        (ext_proc,) = [f for f in http_connection_manager(snapshot, 2)["http_filters"]
                       if f["name"] == "envoy.filters.http.ext_proc"]
        return ext_proc["typed_config"].get("request_attributes")

    # Envoy's first-byte time is asked for only when some route has serverTiming
    assert request_attributes(snap) == ["request.time"]
    assert request_attributes(load_file(RECORDED / "config.yaml")) is None


def service(cfg: Path):
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(cfg)), ProcessorMetrics(registry))
    states = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: states.append(state))
    return svc, registry, states


def header_of(reply) -> str | None:
    for which in ("response_headers", "response_body"):
        part = getattr(reply, which)
        for h in part.response.header_mutation.set_headers:
            if h.header.key == "server-timing":
                return h.header.raw_value.decode()
    return None


ROUTE = [("x-adapter-route", "v1-analyze")]


async def test_a_recorded_llm_request_gets_the_header_at_response_headers_and_every_phase_in_metrics(tmp_path):
    svc, registry, states = service(write_config(tmp_path, "always"))
    replies = await run(svc, ROUTE, recorded(LLM))
    value = header_of(replies[2])  # request headers, request body, response headers, response body
    assert value is not None and header_of(replies[3]) is None
    metrics = parse_server_timing(value)
    assert set(metrics) - {"envoy"} == {"processor_request_headers", "processor_request_body", "queue",
                                        "upstream_ttfb", "total"}
    svc.flush_metrics()
    counts = {dict(lab)["component"]: v
              for lab, v in collect(registry).series("adapter_processor_latency_seconds_count").items()}
    counts_known = {k: v for k, v in counts.items() if k != "envoy"}
    assert counts_known == {"processor_request_headers": 1, "processor_request_body": 1, "processor_response_headers": 1,
                      "processor_response_body": 1, "queue": 1, "upstream_ttfb": 1}
    # an unstreamed answer's first body chunk is the whole body, not a first token
    timing = states[0].attrs[attribution.TIMING_ATTR]
    assert all(v > 0 for v in timing.processor.values())
    # the recording has no request.time attribute (it predates serverTiming): Envoy's part is only the
    # gaps between the request phases, none before the processor
    assert timing.envoy is None and timing.started_wall is None
    assert counts.get("envoy", 0) == (1 if timing.gaps > 0 else 0)


async def test_trusted_mode_by_tenant_and_by_header(tmp_path):
    tenants = "tenants: [{id: acme}, {id: globex}]"
    svc, _, _ = service(write_config(tmp_path, "{tenants: [acme], header: x-timing}", tenants))
    listed = await run(svc, ROUTE + [("x-adapter-tenant", "acme")], recorded(LLM))
    other = await run(svc, ROUTE + [("x-adapter-tenant", "globex")], recorded(LLM))
    assert header_of(listed[2]) is not None and header_of(other[2]) is None
    seq = recorded(LLM)
    h = seq[0].request_headers.headers.headers.add()
    h.key, h.raw_value = "x-timing", b"1"
    marked = await run(svc, ROUTE + [("x-adapter-tenant", "globex")], seq)
    assert header_of(marked[2]) is not None


async def test_metrics_mode_and_routes_without_server_timing_record_nothing_extra(tmp_path):
    svc, registry, states = service(write_config(tmp_path, "metrics"))
    replies = await run(svc, ROUTE, recorded(LLM))
    assert all(header_of(r) is None for r in replies)
    assert attribution.TIMING_ATTR in states[0].attrs
    svc2, registry2, states2 = service(RECORDED / "config.yaml")
    await run(svc2, ROUTE, recorded(LLM))
    svc2.flush_metrics()
    assert attribution.TIMING_ATTR not in states2[0].attrs
    assert collect(registry2).series("adapter_processor_latency_seconds_count") == {}


def test_quantiles_match_histogram_quantile():
    buckets = {0.001: 0.0, 0.002: 50.0, 0.004: 90.0, 0.008: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.002)
    assert quantile(0.25, buckets) == pytest.approx(0.0015)
    assert quantile(0.9, buckets) == pytest.approx(0.004)
    assert quantile(0.99, buckets) == pytest.approx(0.004 + 0.004 * 0.9)
    assert quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {1.0: 1.0, float("inf"): 10.0}) == 1.0  # the open bucket: its lower bound


def test_breakdown_and_window_from_real_exposition_text():
    registry = CollectorRegistry()
    m = ProcessorMetrics(registry)
    for v in (0.0001, 0.0002, 0.0003):
        m.latency.labels("r", "processor_request_body").observe(v)
        m.latency.labels("r", "queue").observe(0.0)
    m.latency.labels("other", "queue").observe(0.0)
    first = histograms(generate_latest(registry).decode())
    m.latency.labels("r", "upstream_ttfb").observe(0.2)
    m.latency.labels("r", "queue").observe(0.0)
    second = histograms(generate_latest(registry).decode())
    doc = breakdown(second, "r")
    assert doc["r"]["components"]["queue"]["p99_ms"] == 0.0  # all zeros: 0, not the middle of the first bucket
    assert list(doc) == ["r"] and doc["r"]["requests"] == 4
    rows = doc["r"]["components"]
    assert list(rows) == ["processor_request_body", "queue", "upstream_ttfb"]  # COMPONENTS order
    assert rows["processor_request_body"]["mean_ms"] == pytest.approx(0.2)
    recent = breakdown(delta(second, first))
    assert set(recent) == {"r"} and set(recent["r"]["components"]) == {"queue", "upstream_ttfb"}
    assert recent["r"]["components"]["upstream_ttfb"]["p50_ms"] == pytest.approx(150.0)  # in (0.1, 0.2]
    text = pretty({"admin": "http://x", "window_s": 5.0, "routes": recent})
    assert "route r: 1 requests" in text and "upstream_ttfb" in text
    assert "no latency attribution" in pretty({"admin": "http://x", "window_s": None, "routes": {}})


async def test_envoy_time_before_the_processor_comes_from_the_request_time_attribute(tmp_path):
    svc, _, states = service(write_config(tmp_path, "always"))
    for offset, expect in ((-0.25, True), (3600.0, False)):  # 250 ms ago; an hour ahead (a skewed clock)
        seq = recorded(LLM)
        stamp = datetime.fromtimestamp(time.time() + offset, tz=timezone.utc).isoformat()
        seq[0].attributes["envoy.filters.http.ext_proc"].fields["request.time"].string_value = stamp
        replies = await run(svc, ROUTE, seq)
        timing = states[-1].attrs[attribution.TIMING_ATTR]
        assert timing.started_wall == pytest.approx(time.time() + offset, abs=60)
        if expect:
            assert timing.envoy >= 0.25  # at least the 250 ms since that stamp
            d = {k: float(v["dur"]) for k, v in parse_server_timing(header_of(replies[2])).items()}
            assert d["envoy"] >= 250.0 and d["total"] >= d["envoy"]
        else:
            assert timing.envoy is None  # negative: Envoy's clock is ahead; not claimed


def _entry(token: str, start: float, **offsets: float):
    """An HTTPAccessLogEntry as Envoy's gRPC access logger sends it: adapter.timing, the start time and the
    offsets (seconds from the start) named as common_properties' fields."""
    from envoy.data.accesslog.v3 import accesslog_pb2
    from envoy.service.accesslog.v3 import als_pb2

    msg = als_pb2.StreamAccessLogsMessage()
    entry = msg.http_logs.log_entry.add()
    cp = entry.common_properties
    cp.metadata.filter_metadata["adapter"].fields["timing"].string_value = token
    cp.start_time.seconds, cp.start_time.nanos = int(start), int(round((start % 1) * 1e9))
    for name, value in offsets.items():
        d = getattr(cp, name)
        d.seconds, d.nanos = int(value), int(round((value % 1) * 1e9))
    entry.response.response_code.value = 200
    return msg


def timing_service(cfg: Path):
    from extproc.runtime import Runtime

    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(load_file(cfg)), ProcessorMetrics(registry), runtime=Runtime(feedback=True))
    states = []
    svc.runtime.lifecycle.observers.append(lambda state, outcome: states.append(state))
    return svc, registry, states


def _sums(registry, stat: str = "sum") -> dict[str, float]:
    return {dict(lab)["component"]: v
            for lab, v in collect(registry).series(f"adapter_processor_latency_seconds_{stat}").items()}


async def test_envoys_share_comes_from_its_access_log_entry_outside_the_processor_and_the_upstream(tmp_path):
    """The first reply asks Envoy's access log for the request's entry (adapter.timing = the token); the entry's
    timings, joined with the processor's spans, give `envoy` = Envoy's whole time minus the union of the
    processor's spans and the upstream's window, and `upstream_ttfb` from Envoy's upstream marks."""
    from extproc.feedback import AccessLogFeedback

    svc, registry, states = timing_service(write_config(tmp_path, "always"))
    replies = await run(svc, ROUTE, recorded(LLM))
    state = states[0]
    meta = replies[0].dynamic_metadata.fields["adapter"].struct_value.fields
    assert meta["timing"].string_value == state.token and state.token.startswith("0.")
    assert all(not r.HasField("dynamic_metadata") or "timing" not in
               r.dynamic_metadata.fields["adapter"].struct_value.fields for r in replies[1:])
    svc.flush_metrics()
    before = _sums(registry)
    assert "envoy" not in before and "upstream_ttfb" not in before  # waiting for Envoy's entry
    timing = state.attrs[attribution.TIMING_ATTR]
    spans = [*timing.spans, *timing.late]
    assert len(spans) == 4 and all(b >= a for a, b in spans)
    busy = sum(b - a for a, b in spans)
    assert busy == pytest.approx(sum(timing.processor.values()), abs=1e-6)
    # Envoy had the request 0.5 s before the processor's first span; its upstream window lies after every
    # span (1 s long, first byte after 0.2 s); the client got its last byte 0.4 s after the upstream's last
    start = spans[0][0] - 0.5
    tx = max(b for _, b in spans) - start + 0.3
    AccessLogFeedback(svc.runtime.lifecycle, svc.metrics).handle(_entry(
        state.token, start, time_to_first_upstream_tx_byte=tx, time_to_first_upstream_rx_byte=tx + 0.2,
        time_to_last_upstream_rx_byte=tx + 1.0, time_to_last_downstream_tx_byte=tx + 1.4))
    svc.flush_metrics()
    after = _sums(registry)
    total = tx + 1.4
    assert after["envoy"] == pytest.approx(total - busy - 1.0, abs=1e-5)
    assert after["upstream_ttfb"] == pytest.approx(0.2, abs=1e-5)
    assert _sums(registry, "count")["envoy"] == 1


def test_envoy_share_is_what_neither_the_processor_nor_the_upstream_covers():
    t = attribution.Timing(spec=None)
    t.spans[:] = [(100.0, 100.1), (100.3, 100.35)]  # request headers, request body
    t.late.extend([(100.9, 101.0), (101.5, 101.6)])  # a response message inside the upstream window, one after
    marks = attribution.EnvoyMarks(start=99.9, end=1.9, upstream_tx=0.6, upstream_rx=0.8, upstream_end=1.4)
    share = attribution.envoy_share(t, marks, first_body=100.95, streamed=True)
    # covered: 0.1 + 0.05 + [100.5, 101.3] 0.8 + 0.1 = 1.05 of 1.9
    assert share["envoy"] == pytest.approx(1.9 - 1.05)
    assert share["upstream_ttfb"] == pytest.approx(0.2)
    assert share["upstream_first_token"] == pytest.approx(100.95 - 100.5)
    assert "upstream_first_token" not in attribution.envoy_share(t, marks, 100.95, streamed=False)
    # no upstream (the processor answered, or Envoy's own reply): everything but the processor's spans
    local = attribution.EnvoyMarks(start=99.9, end=1.9, upstream_tx=None, upstream_rx=None, upstream_end=None)
    assert attribution.envoy_share(t, local, None, False) == {"envoy": pytest.approx(1.9 - 0.35)}
    # the upstream never finished (a timeout): its window runs to the end
    cut = marks._replace(upstream_end=None)
    assert attribution.envoy_share(t, cut, None, False)["envoy"] == pytest.approx(0.6 - 0.15)


async def test_an_entry_that_never_comes_leaves_the_processors_view(tmp_path):
    svc, registry, states = timing_service(write_config(tmp_path, "always"))
    await run(svc, ROUTE, recorded(LLM))
    observer = next(o for o in svc.runtime.lifecycle.observers if isinstance(o, attribution.AttributionObserver))
    observer._sweep(now=time.monotonic() + attribution.JOIN_TTL + 1)
    svc.flush_metrics()
    counts = _sums(registry, "count")
    assert counts["upstream_ttfb"] == 1 and observer.expired == 1 and observer.joined == 0


def test_access_loggers_send_serverTiming_entries_to_the_worker_in_the_token(tmp_path):
    from extproc.envoy_render import access_loggers

    (both,) = access_loggers(1, feedback=True, timing=True)
    filters = both["filter"]["or_filter"]["filters"]
    assert [f["metadata_filter"]["matcher"]["path"][0]["key"] for f in filters] == ["worker", "timing"]
    assert filters[1]["metadata_filter"]["matcher"]["value"]["string_match"] == {"prefix": "0."}
    (only,) = access_loggers(1, feedback=False, timing=True)
    assert only["filter"]["metadata_filter"]["matcher"]["path"][0]["key"] == "timing"
    assert access_loggers(2) == access_loggers(2, feedback=True, timing=False)  # unchanged without serverTiming


async def test_an_entry_that_comes_before_the_requests_end_is_joined_when_it_ends(tmp_path):
    from extproc.feedback import AccessLogFeedback

    svc, registry, states = timing_service(write_config(tmp_path, "always"))
    lc = svc.runtime.lifecycle
    token = f"{lc.boot}-{lc._next}"  # the next request's token
    start = time.time() - 5.0  # Envoy had the request 5 s before now; no upstream (its window is absent)
    AccessLogFeedback(lc, svc.metrics).handle(_entry(token, start, time_to_last_downstream_tx_byte=10.0))
    await run(svc, ROUTE, recorded(LLM))
    assert states[0].token == token
    svc.flush_metrics()
    timing = states[0].attrs[attribution.TIMING_ATTR]
    busy = sum(b - a for a, b in [*timing.spans, *timing.late])
    assert _sums(registry)["envoy"] == pytest.approx(10.0 - busy, abs=1e-5)
    assert "upstream_ttfb" not in _sums(registry)  # Envoy sent nothing upstream
    observer = next(o for o in lc.observers if isinstance(o, attribution.AttributionObserver))
    assert observer.joined == 1 and not observer._entries and not observer._requests
