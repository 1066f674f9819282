"""perf/bench_overhead.py and the floor it measures against (perf/floor/).

- The JSON rows: the row builder's shape (setup, route, concurrency, p50_ms, p99_ms, rps,
  processor_cpu_us) and the ratios to the floor, on synthetic points (no servers).
- The floor's minimal proto against the real ext_proc v3 descriptors of xds-protos: every message,
  field number, type, oneof and enum value it declares must be the real one (a wrong field number
  fails here), and the checker itself catches a planted wrong number.
- When Debian's libgrpc++-dev and protobuf-compiler-grpc are installed: the floor builds (never
  apt-installs here), answers every ProcessingRequest kind with the matching empty response and its
  health check SERVING over real gRPC, and behind a real Envoy with the bench's floor bootstrap a
  headers-only and an llm request (4 ext_proc messages) return 200. Otherwise skipped, saying why.
No timing thresholds.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tests.perf_scripts import load_perf


bo = load_perf("bench_overhead")
PROTO = REPO / "perf" / "floor" / "ext_proc.proto"
REQUIRED = {"setup", "route", "concurrency", "p50_ms", "p99_ms", "rps", "processor_cpu_us"}


# ------------------------------------------------------------------------------------------------
# rows
# ------------------------------------------------------------------------------------------------

def _point(setup: str, route: str, c: int, p50: float, rps: float) -> "bo.Point":
    wrk = bo.WrkResult(p50=p50, p90=p50 * 2, p99=p50 * 4, rps=rps, requests=int(rps * 3), non2xx=0, socket_errors=0)
    cpu = {"envoy": 0.3, "upstream": 0.1}
    if setup != "bare":
        cpu["processor"] = 0.2
    return bo.Point(setup, route, c, wrk, cpu, foreign=0.6, steal=0.0,
                    handler_s=0.05 if setup == "gateway" else None,
                    msgs_per_req=None if setup == "bare" else {"headers": 1.0, "llm": 4.0, "stream": 5.0}[route])


def test_rows_have_the_contract_fields_and_ratios_to_the_floor():
    points = [_point(s, r, c, p50={"bare": 0.1, "floor": 0.4, "gateway": 0.8}[s] * c,
                     rps={"bare": 8000.0, "floor": 2000.0, "gateway": 1000.0}[s] / c)
              for c in (1, 32) for r in bo.ROUTES for s in bo.SETUPS]
    rows = bo.build_rows(points, duration=3.0)
    doc = json.loads(json.dumps({"rows": rows}))  # what --out writes
    assert set(doc) == {"rows"} and len(doc["rows"]) == 18
    assert {(r["setup"], r["route"], r["concurrency"]) for r in doc["rows"]} == {
        (s, r, c) for s in ("bare", "floor", "gateway") for r in ("headers", "llm", "stream") for c in (1, 32)}
    for r in doc["rows"]:
        assert REQUIRED <= set(r)
        assert all(isinstance(r[k], (int, float)) for k in ("p50_ms", "p99_ms", "rps"))
        if r["setup"] == "bare":
            assert r["processor_cpu_us"] is None and r["msgs_per_req"] is None
        else:
            assert r["processor_cpu_us"] == pytest.approx(1e6 * 0.2 / r["requests"], abs=0.1)
        if r["setup"] == "floor":
            assert (r["p50_vs_floor"], r["rps_vs_floor"], r["added_p50_ms_vs_floor"]) == (1.0, 1.0, 0.0)
    gw = next(r for r in doc["rows"] if (r["setup"], r["route"], r["concurrency"]) == ("gateway", "headers", 1))
    assert (gw["p50_vs_floor"], gw["rps_vs_floor"], gw["added_p50_ms_vs_floor"]) == (2.0, 0.5, 0.4)
    text = bo.verdict(doc["rows"])
    assert "headers c=1: +0.400 ms" in text and "headers c=32: 50%" in text and "llm c=32: 50%" in text
    table = bo.fmt_table(doc["rows"])
    assert table.count("\n") == 19  # header, separator, 18 rows


def test_rows_without_a_floor_have_null_ratios():
    rows = bo.build_rows([_point("bare", "llm", 1, 0.1, 9000.0), _point("gateway", "llm", 1, 0.9, 900.0)], 3.0)
    assert all(r["p50_vs_floor"] is None and r["rps_vs_floor"] is None for r in rows)
    assert bo.verdict(rows).startswith("no floor rows")


def test_reps_merge_into_medians_and_per_request_cpu_over_all_runs():
    runs = [_point("gateway", "headers", 32, p50, rps) for p50, rps in ((1.0, 900.0), (3.0, 1000.0), (2.0, 300.0))]
    m = bo.merge(runs)
    assert (m.wrk.p50, m.wrk.rps, m.reps, m.wrk.requests) == (2.0, 900.0, 3, sum(r.wrk.requests for r in runs))
    assert m.cpu["processor"] == pytest.approx(0.6) and m.msgs_per_req == 1.0
    (row,) = bo.build_rows([m], duration=3.0)
    assert (row["reps"], row["rps_min"], row["rps_max"]) == (3, 300.0, 1000.0)
    assert row["processor_cpu_us"] == pytest.approx(1e6 * 0.6 / m.wrk.requests, abs=0.1)
    assert row["other_load_cores"] == pytest.approx(0.2)  # 3 x 0.6 core-seconds over 3 x 3 s
    assert "req/s range" in bo.fmt_table([row]) and "300–1,000" in bo.fmt_table([row])


def test_the_llm_body_is_1_kb_json_and_the_floor_gets_our_envoy_config(tmp_path):
    assert len(bo.LLM_BODY) == 1024 and set(json.loads(bo.LLM_BODY)) == {"query"} and bo.BODIES["llm"] == bo.LLM_BODY
    cfg = bo.bench_config(18080, 18081)
    assert {"path": "/v1/completions", "target": "sim", "kind": "openai"} in cfg["spec"]["routes"]
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    floor = bo.floor_bootstrap(path, 2, 10000, 10001, 20000)
    ours = bo.rendered_bootstrap(path, 2, 10000, 10001)
    # the floor's Envoy is ours but for the processor ports: the same filter and per-route modes
    hcm = lambda b: b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # noqa: E731
    assert hcm(floor) == hcm(ours)
    modes = {r["name"]: r["typed_per_filter_config"][bo.EXT_PROC]["overrides"]["processing_mode"]
             for vh in hcm(floor)["route_config"]["virtual_hosts"] for r in vh["routes"]
             if "overrides" in r.get("typed_per_filter_config", {}).get(bo.EXT_PROC, {})}
    assert modes["v1-chat-completions"]["request_body_mode"] == "NONE"
    assert modes["v1-analyze"]["request_body_mode"] == modes["v1-analyze"]["response_body_mode"] == "BUFFERED"
    assert modes["v1-completions"]["response_body_mode"] == "STREAMED"
    assert "ext_proc" not in json.dumps(bo.bare_bootstrap(path, 2, 10000, 10001))


# ------------------------------------------------------------------------------------------------
# the floor's proto against the real descriptors
# ------------------------------------------------------------------------------------------------

_SCALAR = {"bool": 8, "bytes": 12, "string": 9, "uint32": 13, "int32": 5, "uint64": 4, "int64": 3}


def parse_proto(text: str) -> dict:
    """The minimal proto's package, messages {name: {field: (number, type, oneof)}}, enums and rpcs
    (a small parser for the flat subset perf/floor/ext_proc.proto uses)."""
    text = re.sub(r"//[^\n]*", "", text)
    package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.M).group(1)
    rpcs = re.findall(r"rpc\s+(\w+)\s*\(\s*(stream\s+)?(\w+)\s*\)\s*returns\s*\(\s*(stream\s+)?(\w+)\s*\)", text)
    messages: dict[str, dict] = {}
    enums: dict[str, dict] = {}
    for m in re.finditer(r"^message\s+(\w+)\s*\{(.*?)^\}", text, re.M | re.S):
        name, body = m.group(1), m.group(2)
        for e in re.finditer(r"enum\s+(\w+)\s*\{(.*?)\}", body, re.S):
            enums[f"{name}.{e.group(1)}"] = {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)\s*;", e.group(2))}
        body = re.sub(r"enum\s+\w+\s*\{.*?\}", "", body, flags=re.S)
        fields = {}
        oneofs = {o.group(1): o.group(2) for o in re.finditer(r"oneof\s+(\w+)\s*\{(.*?)\}", body, re.S)}
        for oneof, inner in oneofs.items():
            for typ, fname, num in re.findall(r"([\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", inner):
                fields[fname] = (int(num), typ, oneof)
        rest = re.sub(r"oneof\s+\w+\s*\{.*?\}", "", body, flags=re.S)
        for typ, fname, num in re.findall(r"([\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", rest):
            fields[fname] = (int(num), typ, None)
        messages[name] = fields
    return {"package": package, "messages": messages, "enums": enums, "rpcs": rpcs}


def mismatches(parsed: dict) -> list[str]:
    """Every way the parsed proto differs from the real envoy.service.ext_proc.v3 descriptors."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as real

    fd = real.DESCRIPTOR
    out = []
    if parsed["package"] != fd.package:
        out.append(f"package {parsed['package']} != {fd.package}")
    for mname, fields in parsed["messages"].items():
        desc = fd.message_types_by_name.get(mname)
        if desc is None:
            out.append(f"message {mname} not in {fd.package}")
            continue
        for fname, (num, typ, oneof) in fields.items():
            f = desc.fields_by_name.get(fname)
            if f is None:
                out.append(f"{mname}.{fname}: no such field")
                continue
            if f.number != num:
                out.append(f"{mname}.{fname} = {num}, real {f.number}")
            if f.message_type is not None:
                if f.message_type.full_name != f"{fd.package}.{typ}":
                    out.append(f"{mname}.{fname}: type {typ}, real {f.message_type.full_name}")
            elif f.enum_type is not None:
                if f.enum_type.full_name != f"{fd.package}.{mname}.{typ}":
                    out.append(f"{mname}.{fname}: type {typ}, real {f.enum_type.full_name}")
            elif _SCALAR.get(typ) != f.type:
                out.append(f"{mname}.{fname}: type {typ}, real type code {f.type}")
            real_oneof = f.containing_oneof.name if f.containing_oneof is not None else None
            if real_oneof != oneof:
                out.append(f"{mname}.{fname}: oneof {oneof}, real {real_oneof}")
    for ename, values in parsed["enums"].items():
        mname, short = ename.split(".")
        enum = fd.message_types_by_name[mname].enum_types_by_name.get(short)
        real_values = {v.name: v.number for v in enum.values} if enum is not None else {}
        for k, v in values.items():
            if real_values.get(k) != v:
                out.append(f"{ename}.{k} = {v}, real {real_values.get(k)}")
    svc = fd.services_by_name["ExternalProcessor"]
    for name, cstream, req, sstream, resp in parsed["rpcs"]:
        m = svc.methods_by_name.get(name)
        if m is None:
            out.append(f"rpc {name}: not in ExternalProcessor")
            continue
        if (m.input_type.name, m.output_type.name) != (req, resp):
            out.append(f"rpc {name}: {req} -> {resp}, real {m.input_type.name} -> {m.output_type.name}")
        if (bool(cstream), bool(sstream)) != (m.client_streaming, m.server_streaming):
            out.append(f"rpc {name}: streaming {bool(cstream)}/{bool(sstream)}")
    return out


def test_floor_proto_matches_the_real_ext_proc_descriptors():
    parsed = parse_proto(PROTO.read_text())
    # what a no-op needs is there: the six request kinds and their six replies, and the bidi rpc
    kinds = {"request_headers", "response_headers", "request_body", "response_body", "request_trailers",
             "response_trailers"}
    assert kinds <= set(parsed["messages"]["ProcessingRequest"])
    assert kinds <= set(parsed["messages"]["ProcessingResponse"])
    assert parsed["rpcs"] == [("Process", "stream ", "ProcessingRequest", "stream ", "ProcessingResponse")]
    # the parser saw every field line of the file (so none escapes the check below)
    field_lines = re.findall(r"^\s+[\w.]+\s+\w+\s*=\s*\d+\s*;", PROTO.read_text(), re.M)
    assert sum(len(f) for f in parsed["messages"].values()) == len(field_lines) == 19
    assert mismatches(parsed) == []


def test_the_proto_check_catches_a_wrong_field_number():
    text = PROTO.read_text().replace("HttpBody request_body = 4;", "HttpBody request_body = 5;")
    assert text != PROTO.read_text()
    assert "ProcessingRequest.request_body = 5, real 4" in mismatches(parse_proto(text))
    text = PROTO.read_text().replace("CONTINUE_AND_REPLACE = 1;", "CONTINUE_AND_REPLACE = 2;")
    assert any("CONTINUE_AND_REPLACE" in m for m in mismatches(parse_proto(text)))


# ------------------------------------------------------------------------------------------------
# the floor, built and serving (only when the gRPC C++ packages are installed)
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def floor_bin():
    missing = [t for t in ("protoc", "grpc_cpp_plugin", "g++", "pkg-config") if shutil.which(t) is None]
    if not missing and subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"]).returncode != 0:
        missing.append("pkg-config grpc++ protobuf")
    if missing:
        reason = (f"floor not built: {', '.join(missing)} missing (apt-get install libgrpc++-dev "
                  "protobuf-compiler-grpc, or `make floor`)")
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    binary, why = bo.build_floor(install=False)
    assert binary is not None, f"perf/floor/build.sh failed with the packages installed: {why}"
    return binary


@pytest.fixture
def floor_server(floor_bin):
    from extproc.stack import free_port_block, stop_process

    base = free_port_block(2)
    proc = bo.start_floor(floor_bin, base, 2, 2)
    try:
        yield base
    finally:
        stop_process(proc)
        assert proc.returncode == 0


def test_floor_answers_every_request_kind_with_its_empty_reply(floor_server):
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as m
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as g
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    reqs = [m.ProcessingRequest(request_headers=m.HttpHeaders(end_of_stream=False)),
            m.ProcessingRequest(request_body=m.HttpBody(body=b"x" * 1024, end_of_stream=True)),
            m.ProcessingRequest(request_trailers=m.HttpTrailers()),
            m.ProcessingRequest(response_headers=m.HttpHeaders()),
            m.ProcessingRequest(response_body=m.HttpBody(body=b"{}", end_of_stream=False)),
            m.ProcessingRequest(response_body=m.HttpBody(body=b"", end_of_stream=True)),
            m.ProcessingRequest(response_trailers=m.HttpTrailers())]
    for port in (floor_server, floor_server + 1):  # one port per processor-cluster endpoint
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING
            replies = list(g.ExternalProcessorStub(ch).Process(iter(reqs), timeout=10))
    assert [r.WhichOneof("response") for r in replies] == [q.WhichOneof("request") for q in reqs]
    for r in replies:
        kind = r.WhichOneof("response")
        sub = getattr(r, kind)
        if "trailers" in kind:
            assert sub == m.TrailersResponse()
        else:
            assert sub.HasField("response") and sub.response == m.CommonResponse()  # CONTINUE, nothing changed


def test_floor_behind_envoy_with_the_bench_bootstrap_returns_200(floor_bin, tmp_path):
    import httpx

    from extproc.stack import free_port, free_port_block, stop_process

    started = []
    try:
        up_port, up_admin = free_port(), free_port()
        started.append(bo._start_envoy(bo.upstream_bootstrap(up_port, up_admin), tmp_path / "up.yaml", 1,
                                       f"http://127.0.0.1:{up_admin}", "upstream"))
        cfg = tmp_path / "bench.yaml"
        cfg.write_text(yaml.safe_dump(bo.bench_config(up_port, free_port())))
        base = free_port_block(2)
        started.append(bo.start_floor(floor_bin, base, 2, 2))
        port, admin = free_port(), free_port()
        admin_url = f"http://127.0.0.1:{admin}"
        started.append(bo._start_envoy(bo.floor_bootstrap(cfg, 2, port, admin, base), tmp_path / "floor.yaml", 1,
                                       admin_url, "floor-envoy"))
        bo.wait_processor_healthy(admin_url, 2, "floor")
        hdr = {"content-type": "application/json"}
        with httpx.Client(timeout=10) as c:
            r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=bo.CHAT_BODY, headers=hdr)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == bo.MODEL_CONTENT
            assert bo.envoy_counter(admin_url, "http.adapter.ext_proc.stream_msgs_sent") == 1  # headers only
            r = c.post(f"http://127.0.0.1:{port}/v1/analyze", content=bo.LLM_BODY, headers=hdr)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == bo.MODEL_CONTENT
            # request headers + body, response headers + body: the llm route's four phases reached the floor
            assert bo.envoy_counter(admin_url, "http.adapter.ext_proc.stream_msgs_sent") == 5
            assert bo.envoy_counter(admin_url, "http.adapter.ext_proc.streams_started") == 2
    finally:
        for p in reversed(started):
            stop_process(p)
