"""Benchmark: bare Envoy, Envoy + a compiled no-op ext_proc processor (the floor), Envoy + ours, side by side.

What: in one run, one load generator (wrk) and the same upstreams for all three setups:
  - `bare`: the gateway's own rendered bootstrap with the ext_proc filter stripped (Envoy only);
  - `floor`: the gateway's rendered bootstrap unchanged (same ext_proc filter, same processing mode per
    route, same processor cluster with health checks) with the processor cluster pointed at the
    compiled no-op server of perf/floor/ (C++, gRPC async API, `--threads` = processor workers, one
    port per worker) that answers every message with the matching empty CONTINUE response;
  - `gateway`: `extproc.stack.Stack` (our processor workers + Envoy) from perf/configs/bench-gateway.yaml
    plus a streaming route added here;
for three route kinds:
  - `headers`: POST /v1/chat/completions, our passthrough route: a headers-only decision (1 message);
  - `llm`: POST /v1/analyze with a 1 KB JSON body, JSON out through the route's transform (request
    headers + body, response headers + body: 4 messages);
  - `stream`: POST /v1/completions `"stream": true` on an `openai` route to an OpenAI API *simulator*
    (backends/simulator_openai.py, instant decode, 16 tokens): request body buffered, response body
    STREAMED (one message per chunk);
at each concurrency (wrk connections, default 1 and 32). Upstream of headers/llm: a separate Envoy
answering a canned chat completion with `direct_response` (not Python, so it does not dominate); of
stream: the simulator (Python: at c=32 it is most of the box, so that route's ratios say less).
Each point: warm-up (2 s, `--quick` 1 s) then `--duration` seconds measured (10 s, `--quick` 3 s);
p50/p90/p99 and req/s from `wrk --latency`; CPU seconds of every server process from /proc per
request (`processor_cpu_us`: our workers, or the floor's one process); Envoy's ext_proc messages per
stream (the floor must get the same phases as ours: a printed check); every row also as a ratio to the
floor's row of the same route and concurrency.
Output: a table, `--out FILE` (default perf/results/overhead.json) with
`{"rows": [{"setup", "route", "concurrency", "p50_ms", "p99_ms", "rps", "processor_cpu_us", ...}]}`
(extra keys: p90_ms, requests, msgs_per_req, other_load_cores, p50_vs_floor, rps_vs_floor,
added_p50_ms_vs_floor), and, unless --no-write, a dated section appended to perf/RESULTS.md (then
the default JSON is written too; `--no-write` writes only an explicit `--out`).
The floor is built on demand by perf/floor/build.sh (apt-installs libgrpc++-dev and
protobuf-compiler-grpc when missing and root); if it cannot be built, one line says why and the
floor rows are skipped (ratios then null).
`--reps N` measures each route and c N times, the setups taking turns (order reversed every other
turn), and reports medians (and each setup's req/s range): on a shared machine one run per point
moves by tens of percent.
Run: `.venv/bin/python perf/bench_overhead.py [--quick] [--duration 10] [--warmup 2] [--reps 1]
[--connections 1,32] [--workers N] [--routes headers,llm,stream] [--setups bare,floor,gateway]
[--out FILE] [--no-write]`.
Cost: 18 points x reps; `--quick` about 1.5 minutes here, the default about 4. Everything it starts is stopped by
PID (bounded waits) on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchenv, also when imported

import benchenv  # noqa: E402  (perf/ is this script\'s folder, on sys.path)

import httpx  # noqa: E402
import yaml  # noqa: E402

from extproc.config.loader import load_file  # noqa: E402
from extproc.envoy_bin import find_envoy  # noqa: E402
from extproc.envoy_render import EXT_PROC, PROCESSOR_CLUSTER, render  # noqa: E402
from extproc.stack import Stack, free_port, free_port_block, stop_process, wait_http  # noqa: E402
from extproc.supervisor import die_with_parent  # noqa: E402

CONFIG = REPO / "perf" / "configs" / "bench-gateway.yaml"
RESULTS = REPO / "perf" / "RESULTS.md"
RESULTS_JSON = REPO / "perf" / "results" / "overhead.json"
FLOOR_BUILD = REPO / "perf" / "floor" / "build.sh"
WARMUP_S = 2
MAX_SOCKET_ERRORS = 5  # "a handful": a connection reset at the very end of a run is not a failure
SETUPS = ("bare", "floor", "gateway")
ROUTES = ("headers", "llm", "stream")

# What the upstream answers on every path: an OpenAI chat completion whose content is the model's JSON.
MODEL_CONTENT = '{"amount": 12.5, "account": "6001"}'
UPSTREAM_BODY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000,
    "model": "qwen2.5-finance",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": MODEL_CONTENT}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 42, "completion_tokens": 12, "total_tokens": 54},
}, separators=(",", ":"))
EXPECTED_LLM = {"voucher": {"amount": 12.5, "account": "6001"}}

CHAT_BODY = json.dumps({"model": "qwen2.5-finance", "messages": [
    {"role": "user", "content": "Book 12.50 EUR of office supplies to account 6001."}]}, separators=(",", ":"))


def _analyze_body(size: int = 1024) -> str:
    """`{"query": "..."}` of exactly `size` bytes: the llm route's 1 KB JSON request."""
    base = "Book 12.50 EUR of office supplies to account 6001."
    empty = len(json.dumps({"query": ""}, separators=(",", ":")))
    text = (base + " ") * (size // len(base) + 1)
    return json.dumps({"query": text[: size - empty]}, separators=(",", ":"))


# The short `{"query": ...}` body (bench_feedback.py imports it: its runs stay comparable with its history).
ANALYZE_BODY = json.dumps({"query": "Book 12.50 EUR of office supplies to account 6001."}, separators=(",", ":"))
LLM_BODY = _analyze_body()  # this bench's llm route: 1 KB of JSON in
STREAM_MODEL = "bench-model"
STREAM_TOKENS = 16
STREAM_BODY = json.dumps({"model": STREAM_MODEL, "prompt": "Stream a short answer.", "max_tokens": STREAM_TOKENS,
                          "stream": True}, separators=(",", ":"))
PATHS = {"headers": "/v1/chat/completions", "llm": "/v1/analyze", "stream": "/v1/completions"}
BODIES = {"headers": CHAT_BODY, "llm": LLM_BODY, "stream": STREAM_BODY}

_T = "type.googleapis.com/"


def bench_config(upstream_port: int, simulator_port: int) -> dict[str, Any]:
    """perf/configs/bench-gateway.yaml pointed at our upstream, plus the streaming route's backend
    (the simulator) and its `openai` route on /v1/completions."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["spec"]["backends"][0]["endpoints"] = [f"127.0.0.1:{upstream_port}"]
    cfg["spec"]["backends"].append({"name": "sim", "kind": "vllm", "endpoints": [f"127.0.0.1:{simulator_port}"],
                                    "models": [STREAM_MODEL]})
    cfg["spec"]["routes"].append({"path": PATHS["stream"], "target": "sim", "kind": "openai"})
    return cfg


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------

def _start_envoy(config: dict[str, Any], path: Path, concurrency: int, admin_url: str, what: str) -> subprocess.Popen:
    path.write_text(yaml.safe_dump(config, sort_keys=False, width=120))
    proc = subprocess.Popen(
        [find_envoy(), "-c", str(path), "--disable-hot-restart", "--concurrency", str(concurrency),
         "-l", "warning", "--log-format", f"[{what} %l] %v"],
        preexec_fn=die_with_parent, start_new_session=True,
    )
    try:
        wait_http(f"{admin_url}/ready", 30, proc, what)
    except BaseException:
        stop_process(proc)
        raise
    return proc


def upstream_bootstrap(port: int, admin_port: int) -> dict[str, Any]:
    """A non-Python upstream: every path answers 200 with the canned chat completion."""
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "codec_type": "AUTO",
        "route_config": {"name": "upstream", "virtual_hosts": [{"name": "upstream", "domains": ["*"], "routes": [{
            "match": {"prefix": "/"},
            "direct_response": {"status": 200, "body": {"inline_string": UPSTREAM_BODY}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }]}]},
        # Read the whole request before answering: a direct_response sent while the request body is
        # still arriving makes Envoy close the HTTP/1.1 connection (one new connection per request).
        "http_filters": [
            {"name": "envoy.filters.http.buffer", "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 1048576}},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "node": {"id": "bench-upstream", "cluster": "bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [{
            "name": "upstream",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}],
        }]},
    }


def rendered_bootstrap(config_path: Path, workers: int, port: int, admin_port: int,
                       processor_base_port: int | None = None) -> dict[str, Any]:
    """`render(snapshot, workers)` of the bench config on our own ports: the static equivalent of the
    bootstrap plus xDS files `Stack` gives the gateway's Envoy. `processor_base_port` points the
    processor cluster (and the access-log clusters) at another server: the floor's ports."""
    snap = load_file(config_path)
    snap = dataclasses.replace(snap, listener=snap.listener.model_copy(update={"port": port}),
                               admin=snap.admin.model_copy(update={"port": admin_port}))
    if processor_base_port is not None:
        snap = dataclasses.replace(snap, processor=snap.processor.model_copy(update={"base_port": processor_base_port}))
    return copy.deepcopy(render(snap, workers))


def floor_bootstrap(config_path: Path, workers: int, port: int, admin_port: int, floor_base_port: int) -> dict[str, Any]:
    """The gateway's rendered bootstrap, unchanged but for its ports, with the processor cluster's
    `workers` endpoints on the floor's ports: the same ext_proc filter, per-route processing modes,
    health checks, retry policy and access loggers as ours. (The access loggers only fire for
    requests whose dynamic metadata names a worker, which the floor never sets: none are sent.)"""
    boot = rendered_bootstrap(config_path, workers, port, admin_port, floor_base_port)
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for c in boot["static_resources"]["clusters"] if c["name"] == PROCESSOR_CLUSTER
             for group in c["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    assert ports == list(range(floor_base_port, floor_base_port + workers)), ports
    return boot


def bare_bootstrap(config_path: Path, workers: int, port: int, admin_port: int) -> dict[str, Any]:
    """The gateway's own rendered bootstrap minus ext_proc: same listener, HCM (early header
    mutation, local replies), route table and backend cluster; no ext_proc filter, no per-route
    ext_proc config, no processor cluster. Every client route then goes straight to its backend."""
    boot = rendered_bootstrap(config_path, workers, port, admin_port)
    res = boot["static_resources"]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != PROCESSOR_CLUSTER]
    for listener in res["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f["typed_config"]
                hcm["http_filters"] = [h for h in hcm["http_filters"] if h["name"] != EXT_PROC]
                for vh in hcm["route_config"]["virtual_hosts"]:
                    for r in vh["routes"]:
                        tpfc = r.get("typed_per_filter_config", {})
                        tpfc.pop(EXT_PROC, None)
                        if not tpfc:
                            r.pop("typed_per_filter_config", None)
    text = json.dumps(boot)
    assert "ext_proc" not in text and PROCESSOR_CLUSTER not in text, "ext_proc left in the bare bootstrap"
    return boot


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    idle, steal = v[3] + v[4], v[7]
    tck = os.sysconf("SC_CLK_TCK")
    return (total - idle - steal) / tck, steal / tck


def children_cpu() -> float:
    """CPU seconds of reaped children (wrk, once subprocess.run has waited for it)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def processor_phase_time(admin_url: str) -> float:
    """Total seconds the processor workers spent handling ext_proc messages (all routes, phases)."""
    text = httpx.get(f"{admin_url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in
               re.finditer(r"^adapter_processor_phase_duration_seconds_sum\{[^}]*\} (\S+)$", text, re.M))


# --------------------------------------------------------------------------------------------
# wrk
# --------------------------------------------------------------------------------------------

def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    print("wrk not found: installing the Debian package", file=sys.stderr)
    cmd = ["apt-get", "install", "-y", "-q", "wrk"]
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], stdout=subprocess.DEVNULL, check=True)
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    found = shutil.which("wrk")
    if not found:
        raise SystemExit("wrk is not installed and could not be installed (apt-get install wrk)")
    return found


def lua_post(path: Path, body: str) -> Path:
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    return path


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass
class WrkResult:
    p50: float  # ms
    p90: float
    p99: float
    rps: float
    requests: int
    non2xx: int
    socket_errors: int
    raw: str = field(repr=False, default="")


def parse_wrk(out: str) -> WrkResult:
    pct = {int(k): _ms(v) for k, v in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.M)}
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    reqs = re.search(r"^\s+(\d+) requests in", out, re.M)
    if not (rps and reqs and {50, 90, 99} <= set(pct)):
        raise RuntimeError(f"cannot parse wrk output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return WrkResult(pct[50], pct[90], pct[99], float(rps.group(1)), int(reqs.group(1)),
                     int(non2xx.group(1)) if non2xx else 0, sum(int(x) for x in sock.groups()) if sock else 0, out)


def run_wrk(wrk: str, url: str, script: Path, connections: int, duration: float, threads: int | None = None,
            prefix: tuple[str, ...] = ()) -> WrkResult:
    """`threads` (default 1 at c=1, else 2) and `prefix` (e.g. `taskset -c 3`) for bench_scaling.py."""
    threads = threads or (1 if connections == 1 else min(2, connections))
    duration = max(1, round(duration))  # wrk takes whole seconds
    cmd = [*prefix, wrk, "--latency", "-t", str(threads), "-c", str(connections), "-d", f"{duration}s",
           "--timeout", "5s", "-s", str(script), url]
    # subprocess.run kills wrk if we are interrupted.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30)
    if p.returncode != 0:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stderr or p.stdout}")
    return parse_wrk(p.stdout)


# --------------------------------------------------------------------------------------------
# The floor
# --------------------------------------------------------------------------------------------

def tools(wanted: list[str]) -> tuple[str, Path | None, str]:
    """What a run needs before it starts anything: wrk (`ensure_wrk`) and, when the setups `wanted` name it,
    the floor (`build_floor`); a floor that cannot be built leaves `wanted`, saying why on stderr.
    (wrk, the floor's binary or None, why not)."""
    wrk = ensure_wrk()
    floor_bin, floor_why = None, ""
    if "floor" in wanted:
        floor_bin, floor_why = build_floor()
        if floor_bin is None:
            print(f"floor: skipped ({floor_why})", file=sys.stderr)
            wanted.remove("floor")
    return wrk, floor_bin, floor_why


def build_floor(install: bool = True) -> tuple[Path | None, str]:
    """(binary, "") once perf/floor/build.sh built it (or it was up to date), else (None, why).
    `install=False`: build only if the gRPC C++ packages are already installed (no apt-get)."""
    env = dict(os.environ, **({} if install else {"FLOOR_NO_INSTALL": "1"}))
    try:
        p = subprocess.run(["bash", str(FLOOR_BUILD)], capture_output=True, text=True, timeout=900, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"perf/floor/build.sh: {e}"
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        why = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
        return None, why
    return Path(lines[-1]), ""


def start_floor(binary: Path, base_port: int, ports: int, threads: int) -> subprocess.Popen:
    """The floor on `ports` consecutive ports from `base_port`; returns once it printed `ready`."""
    cmd = [str(binary), "--threads", str(threads)]
    for i in range(ports):
        cmd += ["--port", str(base_port + i)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent, start_new_session=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        stop_process(proc)
        raise RuntimeError(f"the floor did not start (exit code {proc.poll()}, printed {line!r})")
    return proc


def start_simulator(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1", "--port", str(port),
         "--models", STREAM_MODEL, "--log-level", "warning"],
        cwd=str(REPO), stdout=subprocess.DEVNULL, preexec_fn=die_with_parent, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 60, proc, "simulator")
    except BaseException:
        stop_process(proc)
        raise
    return proc


def wait_processor_healthy(admin_url: str, n: int, what: str, timeout: float = 15) -> None:
    """Envoy health-checks the processor endpoints every second; wait until all are in rotation."""
    deadline = time.monotonic() + timeout
    healthy = 0
    while time.monotonic() < deadline:
        text = httpx.get(f"{admin_url}/clusters", timeout=5).text
        healthy = sum(1 for line in text.splitlines()
                      if line.startswith(f"{PROCESSOR_CLUSTER}::") and "::health_flags::healthy" in line)
        if healthy >= n:
            return
        time.sleep(0.2)
    print(f"warning: only {healthy}/{n} {what} processor endpoints healthy in Envoy", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

@dataclass
class Point:
    setup: str  # "bare" | "floor" | "gateway"
    route: str  # "headers" | "llm" | "stream"
    connections: int
    wrk: WrkResult
    cpu: dict[str, float]  # process group -> CPU seconds during the measured run
    # CPU seconds used on the machine during the measured run by processes outside the benchmark
    # (other sessions' tests), and steal time: both make the numbers worse than on a quiet machine.
    foreign: float = 0.0
    steal: float = 0.0
    handler_s: float | None = None  # our processor's own handler time (its metrics); gateway only
    msgs_per_req: float | None = None  # ext_proc messages Envoy sent per stream; floor and gateway
    reps: int = 1  # measured runs merged into this point (`merge`)
    rps_all: list[float] = field(default_factory=list)  # each run's req/s


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def merge(runs: list[Point]) -> Point:
    """One point from `--reps` runs of the same setup, route and c: the median of each run's
    p50/p90/p99 and req/s; CPU, requests and other load summed (so per-request figures are over all
    runs' requests); messages per request averaged."""
    if len(runs) == 1:
        p = runs[0]
        return dataclasses.replace(p, rps_all=p.rps_all or [p.wrk.rps])
    w = [p.wrk for p in runs]
    wrk = WrkResult(_median([x.p50 for x in w]), _median([x.p90 for x in w]), _median([x.p99 for x in w]),
                    _median([x.rps for x in w]), sum(x.requests for x in w), sum(x.non2xx for x in w),
                    sum(x.socket_errors for x in w))
    cpu = {k: sum(p.cpu[k] for p in runs) for k in runs[0].cpu}
    handler = None if runs[0].handler_s is None else sum(p.handler_s or 0.0 for p in runs)
    msgs = None if runs[0].msgs_per_req is None else sum(p.msgs_per_req or 0.0 for p in runs) / len(runs)
    return Point(runs[0].setup, runs[0].route, runs[0].connections, wrk, cpu, sum(p.foreign for p in runs),
                 sum(p.steal for p in runs), handler, msgs, len(runs), [x.rps for x in w])


def _us(seconds: float | None, n: int) -> float | None:
    return None if seconds is None or not n else round(1e6 * seconds / n, 1)


def build_rows(points: list[Point], duration: float) -> list[dict[str, Any]]:
    """The JSON rows: one per point, with its ratios to the floor's point of the same route and
    concurrency (null when the floor was not measured)."""
    floor = {(p.route, p.connections): p for p in points if p.setup == "floor"}
    rows = []
    for p in points:
        n = p.wrk.requests
        f = floor.get((p.route, p.connections))
        rows.append({
            "setup": p.setup, "route": p.route, "concurrency": p.connections,
            "p50_ms": round(p.wrk.p50, 4), "p99_ms": round(p.wrk.p99, 4), "rps": round(p.wrk.rps, 1),
            "processor_cpu_us": _us(p.cpu.get("processor"), n),
            "p90_ms": round(p.wrk.p90, 4), "requests": n,
            "envoy_cpu_us": _us(p.cpu.get("envoy"), n), "upstream_cpu_us": _us(p.cpu.get("upstream"), n),
            "handler_us": _us(p.handler_s, n),
            "msgs_per_req": None if p.msgs_per_req is None else round(p.msgs_per_req, 2),
            "other_load_cores": round(p.foreign / (duration * p.reps), 2) if duration else None,
            "reps": p.reps, "rps_min": round(min(p.rps_all or [p.wrk.rps]), 1),
            "rps_max": round(max(p.rps_all or [p.wrk.rps]), 1),
            "p50_vs_floor": round(p.wrk.p50 / f.wrk.p50, 3) if f and f.wrk.p50 else None,
            "rps_vs_floor": round(p.wrk.rps / f.wrk.rps, 3) if f and f.wrk.rps else None,
            "added_p50_ms_vs_floor": round(p.wrk.p50 - f.wrk.p50, 4) if f else None,
        })
    return rows


def machine_info(workers: int) -> dict[str, str]:
    envoy_v = subprocess.run([find_envoy(), "--version"], capture_output=True, text=True).stdout.strip()
    m = re.search(r"/(\d+\.\d+\.\d+)/", envoy_v)
    wrk_v = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout.splitlines()
    return {
        "git": benchenv.git_revision(),
        "cpu": benchenv.cpu(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": m.group(1) if m else envoy_v,
        "wrk": wrk_v[0].split(" Copyright")[0] if wrk_v else "wrk",
        "workers": str(workers),
    }


def check_responses(urls: dict[str, str], routes: list[str]) -> None:
    """One request per route and setup before the run: 200s, the upstream's answer on headers, our
    transform on the gateway's llm route, a whole SSE stream on stream."""
    hdr = {"content-type": "application/json"}
    with httpx.Client(timeout=10) as c:
        for setup, base in urls.items():
            for route in routes:
                r = c.post(base + PATHS[route], content=BODIES[route], headers=hdr)
                ok = r.status_code == 200
                if ok and route == "headers":
                    ok = r.json()["choices"][0]["message"]["content"] == MODEL_CONTENT
                elif ok and route == "llm" and setup == "gateway":
                    ok = r.json() == EXPECTED_LLM
                elif ok and route == "stream":
                    ok = "data: [DONE]" in r.text and r.text.count("data: ") > STREAM_TOKENS // 2
                if not ok:
                    raise RuntimeError(f"{setup} {route} {PATHS[route]}: HTTP {r.status_code} {r.text[:300]}")
    print(f"check: {', '.join(urls)} answer {', '.join(routes)} (gateway /v1/analyze -> {json.dumps(EXPECTED_LLM)})")


def _check(res: WrkResult, what: str) -> None:
    if res.non2xx or res.socket_errors > MAX_SOCKET_ERRORS or res.requests == 0:
        raise RuntimeError(f"{what}: {res.requests} requests, {res.non2xx} non-2xx, "
                           f"{res.socket_errors} socket errors\n{res.raw}")


def envoy_counter(admin_url: str, name: str) -> int:
    text = httpx.get(f"{admin_url}/stats?filter=^{re.escape(name)}$", timeout=5).text
    m = re.search(r": (\d+)", text)
    return int(m.group(1)) if m else 0


SETUP_COLUMNS = [("c", "concurrency", "{}"), ("route", "route", None), ("setup", "setup", None)]


def rps_range(r: dict[str, Any]) -> str:
    """A row's range of req/s over its runs (`--reps` > 1)."""
    return f"{r['rps_min']:,.0f}–{r['rps_max']:,.0f}"


def fmt_table(rows: list[dict[str, Any]]) -> str:
    """One line per row; with `--reps` > 1 also each setup's range of req/s over its runs."""
    spread = any(r.get("reps", 1) > 1 for r in rows)
    return benchenv.md_table(rows, [
        *SETUP_COLUMNS, ("p50 ms", "p50_ms", "{:.3f}"), ("p90 ms", "p90_ms", "{:.3f}"), ("p99 ms", "p99_ms", "{:.3f}"),
        ("req/s", "rps", "{:,.0f}"), *([("req/s range", rps_range, "")] if spread else []),
        ("processor CPU µs/req", "processor_cpu_us", "{:.0f}"), ("ext_proc msgs/req", "msgs_per_req", "{:.2f}"),
        ("p50 − floor", "added_p50_ms_vs_floor", "{:+.3f}"), ("p50 / floor", "p50_vs_floor", "{:.2f}"),
        ("req/s / floor", "rps_vs_floor", "{:.0%}"), ("other load", "other_load_cores", "{:.2f}")])


def fmt_cpu(rows: list[dict[str, Any]]) -> str:
    return benchenv.md_table(rows, [
        *SETUP_COLUMNS, ("Envoy CPU µs/req", "envoy_cpu_us", "{:.0f}"), ("upstream CPU µs/req", "upstream_cpu_us", "{:.0f}"),
        ("processor CPU µs/req", "processor_cpu_us", "{:.0f}"), ("processor handler µs/req", "handler_us", "{:.0f}")])


def verdict(rows: list[dict[str, Any]]) -> str:
    """The gateway against issue 13's goals, as ratios to the floor in this run."""
    g = {(r["route"], r["concurrency"]): r for r in rows if r["setup"] == "gateway"}
    parts = []
    r = g.get(("headers", 1))
    if r and r["added_p50_ms_vs_floor"] is not None:
        v = r["added_p50_ms_vs_floor"]
        parts.append(f"headers c=1: {v:+.3f} ms p50 over the floor (goal <= +0.2 ms: {'met' if v <= 0.2 else 'not met'})")
    for route, goal in (("headers", 0.6), ("llm", 0.4)):
        for (rt, c), r in sorted(g.items()):
            if rt != route or r["rps_vs_floor"] is None or (route == "headers" and c == 1):
                continue
            v = r["rps_vs_floor"]
            parts.append(f"{route} c={c}: {v:.0%} of the floor's req/s (goal >= {goal:.0%}: "
                         f"{'met' if v >= goal else 'not met'})")
    if not parts:
        return "no floor rows in this run: no ratios."
    return "; ".join(parts) + "."


def _one(setup: str, s: dict[str, Any], route: str, c: int, wrk: str, script: Path, warmup: float, duration: float,
         all_pids: list[int], threads: int | None = None, prefix: tuple[str, ...] = ()) -> Point:
    """One measured wrk run of one setup on one route at c connections, after its warm-up
    (`threads`, `prefix`: run_wrk's, for bench_scaling.py)."""
    url = s["url"] + PATHS[route]
    _check(run_wrk(wrk, url, script, c, warmup, threads, prefix), f"warm-up {setup} {route} c={c}")
    handler0 = processor_phase_time(s["processor_admin"]) if s.get("processor_admin") else None
    if setup != "bare":
        msgs0 = envoy_counter(s["admin"], "http.adapter.ext_proc.stream_msgs_sent")
        streams0 = envoy_counter(s["admin"], "http.adapter.ext_proc.streams_started")
    before = {p: cpu_seconds(p) for p in all_pids}
    wrk0, (busy0, steal0) = children_cpu(), machine_cpu()
    res = run_wrk(wrk, url, script, c, duration, threads, prefix)
    busy1, steal1 = machine_cpu()
    used = {p: cpu_seconds(p) - before[p] for p in all_pids}
    cpu = {k: sum(used[p] for p in v) for k, v in s["procs"].items()}
    # everything else on the machine: neither wrk nor any process of this benchmark
    foreign = max(0.0, (busy1 - busy0) - sum(used.values()) - (children_cpu() - wrk0))
    handler = msgs = None
    if handler0 is not None:
        handler = processor_phase_time(s["processor_admin"]) - handler0
    if setup != "bare":
        streams = envoy_counter(s["admin"], "http.adapter.ext_proc.streams_started") - streams0
        msgs = (envoy_counter(s["admin"], "http.adapter.ext_proc.stream_msgs_sent") - msgs0) / max(streams, 1)
    _check(res, f"{setup} {route} c={c}")
    return Point(setup, route, c, res, cpu, foreign, steal1 - steal0, handler, msgs)


def _measure(setups: dict[str, dict[str, Any]], routes: list[str], conns: list[int], wrk: str, warmup: float,
             duration: float, run_dir: Path, all_pids: list[int], reps: int = 1) -> list[Point]:
    """Every (c, route), each setup back to back; with `reps` > 1 the setups take turns `reps` times
    (order reversed every other turn, so a drift in the machine's other load hits all alike) and each
    setup's runs are merged into one point."""
    scripts = {r: lua_post(run_dir / f"{r}.lua", BODIES[r]) for r in routes}
    merged: list[Point] = []
    done, total = 0, len(conns) * len(routes) * len(setups) * reps
    for c in conns:
        for route in routes:
            by_setup: dict[str, list[Point]] = {name: [] for name in setups}
            for turn in range(reps):
                names = list(setups) if turn % 2 == 0 else list(reversed(setups))
                for setup in names:
                    pt = _one(setup, setups[setup], route, c, wrk, scripts[route], warmup, duration, all_pids)
                    by_setup[setup].append(pt)
                    done += 1
                    print(f"[{done}/{total}] {setup:7} {route:7} c={c:<3} p50 {pt.wrk.p50:.3f} ms  "
                          f"p99 {pt.wrk.p99:.3f} ms  {pt.wrk.rps:,.0f} req/s"
                          + (f"  {pt.msgs_per_req:.2f} msgs/req" if pt.msgs_per_req is not None else "")
                          + f"  (other load {pt.foreign / duration:.2f} cores)", flush=True)
            merged += [merge(by_setup[name]) for name in setups]
    return merged


def _msgs_check(rows: list[dict[str, Any]]) -> str:
    """Whether the floor got the same ext_proc messages per request as ours, per route and c. On the
    stream route the count of response-body chunks depends on timing (how the simulator's SSE events
    coalesce into reads), so there it is only reported."""
    by = {(r["setup"], r["route"], r["concurrency"]): r["msgs_per_req"] for r in rows}
    pairs = [(rt, c, by[("floor", rt, c)], m) for (s, rt, c), m in by.items()
             if s == "gateway" and by.get(("floor", rt, c)) is not None and m is not None]
    diffs = [f"{rt} c={c}: floor {f} vs gateway {m}" for rt, c, f, m in pairs
             if rt != "stream" and abs(m - f) > 0.05 * max(m, 1)]
    stream = ", ".join(f"c={c}: floor {f} vs gateway {m}" for rt, c, f, m in pairs if rt == "stream")
    text = ("the floor got the same ext_proc messages per request as the gateway on headers and llm"
            if not diffs else "ext_proc messages per request differ: " + "; ".join(diffs))
    return text + (f" (stream, timing-dependent chunks: {stream})" if stream else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 s warm-up + 3 s per point (under 3 minutes)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per point, whole (default 10, --quick 3)")
    ap.add_argument("--warmup", type=float, default=None, help=f"warm-up seconds per point (default {WARMUP_S}, --quick 1)")
    ap.add_argument("--connections", default="1,32", help="comma-separated wrk connection counts (default 1,32)")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of headers,llm,stream")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of bare,floor,gateway")
    ap.add_argument("--workers", type=int, default=None,
                    help="processor workers, and the floor's threads and ports (default: the CPU count)")
    ap.add_argument("--reps", type=int, default=1,
                    help="measure each route and c this many times, setups taking turns; medians (default 1)")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON rows (default {RESULTS_JSON.relative_to(REPO)})")
    ap.add_argument("--no-write", action="store_true", help="leave perf/RESULTS.md and the default JSON alone")
    args = ap.parse_args(argv)
    # wrk takes whole seconds
    duration = float(max(1, round(args.duration if args.duration is not None else (3 if args.quick else 10))))
    warmup = float(max(1, round(args.warmup if args.warmup is not None else (1 if args.quick else WARMUP_S))))
    conns = [int(c) for c in args.connections.split(",") if c.strip()]
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not set(routes) <= set(ROUTES) or not set(wanted) <= set(SETUPS) or not routes or not wanted:
        ap.error(f"--routes from {','.join(ROUTES)}, --setups from {','.join(SETUPS)}")
    workers = args.workers or os.cpu_count() or 1
    envoy_concurrency = min(workers, 4)  # what Stack gives the gateway's Envoy; bare and floor get the same
    command = benchenv.command_line("perf/bench_overhead.py", argv)
    benchenv.sigterm_unwinds(argv)  # so the finally below stops everything

    wrk, floor_bin, floor_why = tools(wanted)
    if not wanted:
        print("nothing to measure", file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    idle_load = other_load()
    if idle_load > 0.2:
        print(f"warning: other processes are using {idle_load:.2f} of {os.cpu_count()} cores (load average "
              f"{load_start[0]:.2f}); the numbers will be worse than on a quiet machine", file=sys.stderr)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    procs_started: list[subprocess.Popen] = []  # stopped in reverse order
    stack: Stack | None = None
    try:
        # 1. the upstreams: Envoy direct_response (one worker thread), the simulator if streaming
        up_port, up_admin, sim_port = free_port(), free_port(), free_port()
        procs_started.append(_start_envoy(upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", 1,
                                          f"http://127.0.0.1:{up_admin}", "upstream"))
        upstream_pids = [procs_started[-1].pid]
        if "stream" in routes:
            procs_started.append(start_simulator(sim_port))
            upstream_pids.append(procs_started[-1].pid)

        # 2. the gateway config, pointed at them
        cfg_path = run_dir / "bench-gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(bench_config(up_port, sim_port), sort_keys=False, allow_unicode=True))

        setups: dict[str, dict[str, Any]] = {}
        for setup in wanted:
            port, admin = free_port(), free_port()
            admin_url = f"http://127.0.0.1:{admin}"
            if setup == "bare":  # 3. bare Envoy: the same rendered bootstrap without ext_proc
                env = _start_envoy(bare_bootstrap(cfg_path, workers, port, admin), run_dir / "bare-envoy.yaml",
                                   envoy_concurrency, admin_url, "bare-envoy")
                procs_started.append(env)
                setups[setup] = {"url": f"http://127.0.0.1:{port}", "admin": admin_url,
                                 "procs": {"envoy": [env.pid], "upstream": upstream_pids}}
            elif setup == "floor":  # 4. the floor: the compiled no-op behind the same bootstrap as ours
                base = free_port_block(workers)
                assert floor_bin is not None
                fl = start_floor(floor_bin, base, workers, workers)
                procs_started.append(fl)
                env = _start_envoy(floor_bootstrap(cfg_path, workers, port, admin, base), run_dir / "floor-envoy.yaml",
                                   envoy_concurrency, admin_url, "floor-envoy")
                procs_started.append(env)
                wait_processor_healthy(admin_url, workers, "floor")
                setups[setup] = {"url": f"http://127.0.0.1:{port}", "admin": admin_url,
                                 "procs": {"envoy": [env.pid], "upstream": upstream_pids, "processor": [fl.pid]}}
            else:  # 5. the gateway: our processor workers + Envoy
                stack = Stack(str(cfg_path), listen_port=port, admin_port=admin,
                              processor_base_port=free_port_block(workers), processor_admin_port=free_port(),
                              workers=workers, run_dir=str(run_dir / "gateway"), log_level="warning")
                stack.start()
                wait_processor_healthy(stack.admin_url, workers, "gateway")
                setups[setup] = {"url": stack.url, "admin": stack.admin_url,
                                 "processor_admin": stack.processor_admin_url,
                                 "procs": {"envoy": [stack.envoy.pid], "upstream": upstream_pids,
                                           "processor": [w.proc.pid for w in stack.supervisor.workers]}}

        check_responses({s: v["url"] for s, v in setups.items()}, routes)
        # this process (with the supervisor's threads) and every server process, idle ones included
        all_pids = sorted({os.getpid(), *(p for s in setups.values() for v in s["procs"].values() for p in v)})
        points = _measure(setups, routes, conns, wrk, warmup, duration, run_dir, all_pids, max(1, args.reps))
        restarts = sum(w.restarts for w in stack.supervisor.workers) if stack is not None else 0
    finally:
        if stack is not None:
            stack.stop()
        for p in reversed(procs_started):
            stop_process(p)
        shutil.rmtree(run_dir, ignore_errors=True)
    load_end = os.getloadavg()

    rows = build_rows(points, duration)
    info = machine_info(workers)
    table, cpu_table = fmt_table(rows), fmt_cpu(rows)
    msgs_text = _msgs_check(rows) if "floor" in wanted and stack is not None else ""
    load_text = benchenv.load_text(load_start, load_end, idle_load)
    print()
    print(table)
    print()
    print("CPU per request (µs), from /proc utime+stime during the measured seconds:")
    print(cpu_table)
    print()
    if msgs_text:
        print(msgs_text)
    if floor_why:
        print(f"floor rows skipped: {floor_why}")
    print(f"{load_text}; worker restarts: {restarts}")
    print(f"against the goals: {verdict(rows)}")

    benchenv.write_json(json.dumps({"rows": rows}, indent=1) + "\n", args.out, args.no_write, RESULTS_JSON)
    if not args.no_write:
        append_results(info, command, table, cpu_table, msgs_text, floor_why, load_text, restarts, rows,
                       warmup, duration)
        print(f"appended to {RESULTS.relative_to(REPO)}")
    return 0


def other_load(seconds: float = 1.0) -> float:
    """Cores used by processes other than this one over `seconds` (before anything is started)."""
    mine0, (busy0, _) = cpu_seconds(os.getpid()), machine_cpu()
    time.sleep(seconds)
    return max(0.0, machine_cpu()[0] - busy0 - (cpu_seconds(os.getpid()) - mine0)) / seconds


def append_results(info: dict[str, str], command: str, table: str, cpu_table: str, msgs_text: str, floor_why: str,
                   load_text: str, restarts: int, rows: list[dict[str, Any]], warmup: float, duration: float) -> None:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    workers = int(info["workers"])
    floor_line = (f"- Floor: perf/floor/ (C++, gRPC async API, `--threads {workers}`, {workers} ports = the processor "
                  "cluster's endpoints), behind the gateway's rendered bootstrap unchanged"
                  if not floor_why else f"- Floor: skipped ({floor_why})")
    reps = max((r.get("reps", 1) for r in rows), default=1)
    reps_text = (f"; {reps} runs per point, the setups taking turns (order reversed every other turn): "
                 "medians of p50/p90/p99 and req/s, CPU over all runs' requests" if reps > 1 else "")
    text = f"""
## {now}: bench_overhead (bare Envoy, Envoy + compiled no-op floor, Envoy + our processor)

- Machine: {info['cpu']}; kernel {info['kernel']}; Python {info['python']}; Envoy {info['envoy']}; {info['wrk']}
- Code: git {info['git']}
- Processor workers: {workers}; every Envoy `--concurrency {min(workers, 4)}`; upstream Envoy `--concurrency 1` (direct_response); stream route upstream: the OpenAI API simulator (Python, instant decode, {STREAM_TOKENS} tokens)
{floor_line}
- Command: `{command}` ({duration:g} s measured per run after a {warmup:g} s warm-up{reps_text}; wrk threads: 1 at c=1, 2 otherwise)
- Load: {load_text}. The machine is shared with other sessions' tests: the "other load" column is the CPU (in cores, of {os.cpu_count()}) they used during each point.

Routes: headers = POST /v1/chat/completions (passthrough, headers only); llm = POST /v1/analyze, {len(LLM_BODY)} B JSON in, JSON out (4 messages); stream = POST /v1/completions, `"stream": true` (openai route, response body STREAMED). Latency in ms (wrk `--latency`); ratios to the floor's row of the same route and c.

{table}

CPU per request in microseconds (utime+stime from /proc during the measured seconds; wrk not counted; processor handler = our stage code per request from its metrics, the rest of its CPU is gRPC and asyncio):

{cpu_table}

{msgs_text + '. ' if msgs_text else ''}Worker restarts: {restarts}.

Against issue 13's goals: {verdict(rows)}
"""
    with RESULTS.open("a") as f:
        f.write(text)


if __name__ == "__main__":
    benchenv.run(main)
