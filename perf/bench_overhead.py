"""Benchmark: what the ext_proc processor adds on top of bare Envoy (a benchmark, never a test).

What: in one run, with one load generator (wrk) and one upstream (a separate Envoy answering a canned
OpenAI chat completion with `direct_response`), it measures side by side
  - bare Envoy: the gateway's own rendered bootstrap with the ext_proc filter stripped, and
  - the gateway: `extproc.stack.Stack` (processor workers + Envoy) from perf/configs/bench-gateway.yaml,
for the passthrough route (POST /v1/chat/completions: 1 ext_proc round trip) and the llm route
(POST /v1/analyze: request body + response headers + response body, JSON transform), against bare
Envoy forwarding the same request untouched, at each connection count (default 1 and 32).
Each point: 2 s warm-up, then `--duration` seconds measured; p50/p90/p99 and req/s from
`wrk --latency`; CPU seconds of every server process from /proc, per request.
Prints a table and, unless --no-write, appends a dated section to perf/RESULTS.md.
Run: `.venv/bin/python perf/bench_overhead.py [--duration 10] [--connections 1,32] [--workers N] [--no-write]`
or `make perf`. Everything it starts is stopped by PID (bounded waits) on exit, error or Ctrl-C.
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

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
WARMUP_S = 2
MAX_SOCKET_ERRORS = 5  # "a handful": a connection reset at the very end of a run is not a failure

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
ANALYZE_BODY = json.dumps({"query": "Book 12.50 EUR of office supplies to account 6001."}, separators=(",", ":"))

_T = "type.googleapis.com/"


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


def bare_bootstrap(config_path: Path, workers: int, port: int, admin_port: int) -> dict[str, Any]:
    """The gateway's own rendered bootstrap minus ext_proc: same listener, HCM (early header
    mutation, local replies), route table and backend cluster; no ext_proc filter, no per-route
    ext_proc config, no processor cluster. Both client routes then go straight to the upstream."""
    snap = load_file(config_path)
    snap = dataclasses.replace(snap, listener=snap.listener.model_copy(update={"port": port}),
                               admin=snap.admin.model_copy(update={"port": admin_port}))
    boot = copy.deepcopy(render(snap, workers))
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


def run_wrk(wrk: str, url: str, script: Path, connections: int, duration: float) -> WrkResult:
    threads = 1 if connections == 1 else min(2, connections)
    cmd = [wrk, "--latency", "-t", str(threads), "-c", str(connections), "-d", f"{duration:g}s",
           "--timeout", "5s", "-s", str(script), url]
    # subprocess.run kills wrk if we are interrupted.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30)
    if p.returncode != 0:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stderr or p.stdout}")
    return parse_wrk(p.stdout)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

@dataclass
class Point:
    connections: int
    route: str  # "passthrough" | "llm"
    bare: WrkResult
    gw: WrkResult
    cpu_bare: dict[str, float]  # process group -> CPU seconds during the measured run
    cpu_gw: dict[str, float]
    # CPU seconds used on the machine during the measured run by processes outside the benchmark
    # (other sessions' tests), and steal time: both make the numbers worse than on a quiet machine.
    foreign: dict[str, float] = field(default_factory=dict)
    steal: dict[str, float] = field(default_factory=dict)
    handler_s: float = 0.0  # processor's own handler time during the gateway run (its metrics)
    msgs_per_req: float = 0.0  # ext_proc messages Envoy sent per stream (phases that went to the processor)


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


def check_responses(bare_url: str, gw_url: str) -> None:
    """One request per route before the run: 200s, and the llm route's body really transformed."""
    hdr = {"content-type": "application/json"}
    with httpx.Client(timeout=10) as c:
        for base in (bare_url, gw_url):
            r = c.post(f"{base}/v1/chat/completions", content=CHAT_BODY, headers=hdr)
            if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != MODEL_CONTENT:
                raise RuntimeError(f"{base}/v1/chat/completions: HTTP {r.status_code} {r.text[:300]}")
        r = c.post(f"{bare_url}/v1/analyze", content=ANALYZE_BODY, headers=hdr)
        if r.status_code != 200:
            raise RuntimeError(f"bare /v1/analyze: HTTP {r.status_code} {r.text[:300]}")
        r = c.post(f"{gw_url}/v1/analyze", content=ANALYZE_BODY, headers=hdr)
        if r.status_code != 200 or r.json() != EXPECTED_LLM:
            raise RuntimeError(f"gateway /v1/analyze: expected 200 {EXPECTED_LLM}, got HTTP {r.status_code} "
                               f"{r.text[:300]}")
        print(f"check: gateway /v1/analyze -> 200 {r.text}")


def _check(res: WrkResult, what: str) -> None:
    if res.non2xx or res.socket_errors > MAX_SOCKET_ERRORS or res.requests == 0:
        raise RuntimeError(f"{what}: {res.requests} requests, {res.non2xx} non-2xx, "
                           f"{res.socket_errors} socket errors\n{res.raw}")


def envoy_cluster_stats(admin_url: str, cluster: str) -> dict[str, int]:
    """Per-host rq_total of one cluster (to see how the processor workers share the load)."""
    text = httpx.get(f"{admin_url}/clusters", timeout=5).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "rq_total":
            out[parts[1]] = int(parts[3])
    return out


def envoy_counter(admin_url: str, name: str) -> int:
    text = httpx.get(f"{admin_url}/stats?filter=^{re.escape(name)}$", timeout=5).text
    m = re.search(r": (\d+)", text)
    return int(m.group(1)) if m else 0


def fmt_table(points: list[Point]) -> str:
    head = ("| c | route | bare p50 | gw p50 | added p50 | bare p90 | gw p90 | bare p99 | gw p99 "
            "| bare req/s | gw req/s | kept |")
    sep = "|" + "|".join("---:" if i != 1 else "---" for i in range(12)) + "|"
    rows = [head, sep]
    for p in points:
        b, g = p.bare, p.gw
        rows.append(f"| {p.connections} | {p.route} | {b.p50:.3f} | {g.p50:.3f} | +{g.p50 - b.p50:.3f} "
                    f"| {b.p90:.3f} | {g.p90:.3f} | {b.p99:.3f} | {g.p99:.3f} "
                    f"| {b.rps:,.0f} | {g.rps:,.0f} | {100 * g.rps / b.rps:.0f}% |")
    return "\n".join(rows)


def fmt_cpu(points: list[Point], duration: float) -> str:
    rows = ["| c | route | ext_proc msgs/req | bare: Envoy | bare: upstream | gw: Envoy | gw: processor CPU "
            "| gw: processor handler time | gw: upstream | other load bare / gw (cores) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        nb, ng = p.bare.requests, p.gw.requests
        us = lambda s, n: f"{1e6 * s / n:.0f}" if n else "-"  # noqa: E731
        rows.append(f"| {p.connections} | {p.route} | {p.msgs_per_req:.2f} | {us(p.cpu_bare['envoy'], nb)} | {us(p.cpu_bare['upstream'], nb)} "
                    f"| {us(p.cpu_gw['envoy'], ng)} | {us(p.cpu_gw['processor'], ng)} | {us(p.handler_s, ng)} "
                    f"| {us(p.cpu_gw['upstream'], ng)} "
                    f"| {p.foreign.get('bare', 0) / duration:.2f} / {p.foreign.get('gw', 0) / duration:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per point (default 10)")
    ap.add_argument("--connections", default="1,32", help="comma-separated wrk connection counts (default 1,32)")
    ap.add_argument("--workers", type=int, default=None, help="processor workers (default: the CPU count)")
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    args = ap.parse_args(argv)
    conns = [int(c) for c in args.connections.split(",") if c.strip()]
    workers = args.workers or os.cpu_count() or 1
    envoy_concurrency = min(workers, 4)  # what Stack gives the gateway's Envoy; the bare one gets the same
    command = " ".join([".venv/bin/python perf/bench_overhead.py",
                        *(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))])

    # SIGTERM unwinds like Ctrl-C, so the finally below stops everything.
    def _on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)

    wrk = ensure_wrk()
    idle_load = other_load()
    if idle_load > 0.2:
        print(f"warning: other processes are using {idle_load:.2f} of {os.cpu_count()} cores; "
              "the numbers will be worse than on a quiet machine", file=sys.stderr)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    upstream: subprocess.Popen | None = None
    bare: subprocess.Popen | None = None
    stack: Stack | None = None
    try:
        # 1. the upstream: Envoy direct_response, one worker thread
        up_port, up_admin = free_port(), free_port()
        upstream = _start_envoy(upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", 1,
                                f"http://127.0.0.1:{up_admin}", "upstream")

        # 2. the gateway config, pointed at the upstream
        cfg = yaml.safe_load(CONFIG.read_text())
        cfg["spec"]["backends"][0]["endpoints"] = [f"127.0.0.1:{up_port}"]
        cfg_path = run_dir / "bench-gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))

        # 3. bare Envoy: the same rendered bootstrap without ext_proc
        bare_port, bare_admin = free_port(), free_port()
        bare_admin_url = f"http://127.0.0.1:{bare_admin}"
        bare = _start_envoy(bare_bootstrap(cfg_path, workers, bare_port, bare_admin), run_dir / "bare-envoy.yaml",
                            envoy_concurrency, bare_admin_url, "bare-envoy")
        bare_url = f"http://127.0.0.1:{bare_port}"

        # 4. the gateway: processor workers + Envoy
        stack = Stack(str(cfg_path), listen_port=free_port(), admin_port=free_port(),
                      processor_base_port=free_port_block(workers), processor_admin_port=free_port(),
                      workers=workers, run_dir=str(run_dir / "gateway"), log_level="warning")
        stack.start()
        gw_url = stack.url
        # Envoy health-checks the processor workers every second; wait until all are in rotation.
        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(f"{stack.admin_url}/clusters", timeout=5).text
            healthy = sum(1 for line in text.splitlines()
                          if line.startswith(f"{PROCESSOR_CLUSTER}::") and "::health_flags::healthy" in line)
            if healthy >= workers or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if healthy < workers:
            print(f"warning: only {healthy}/{workers} processor workers healthy in Envoy", file=sys.stderr)

        check_responses(bare_url, gw_url)

        procs = {
            "bare": {"envoy": [bare.pid], "upstream": [upstream.pid]},
            "gw": {"envoy": [stack.envoy.pid], "upstream": [upstream.pid],
                   "processor": [w.proc.pid for w in stack.supervisor.workers]},
        }
        # this process (with the supervisor's threads) and every server process, idle side included
        all_pids = sorted({os.getpid(), *(p for side in procs.values() for v in side.values() for p in v)})
        scripts = {"passthrough": lua_post(run_dir / "chat.lua", CHAT_BODY),
                   "llm": lua_post(run_dir / "analyze.lua", ANALYZE_BODY)}
        paths = {"passthrough": "/v1/chat/completions", "llm": "/v1/analyze"}  # same path on both sides
        proc_rq_before = envoy_cluster_stats(stack.admin_url, PROCESSOR_CLUSTER)
        up_cx_before = {u: envoy_counter(u, "cluster.upstream.upstream_cx_total") for u in (stack.admin_url, bare_admin_url)}

        points: list[Point] = []
        total = len(conns) * 2
        for c in conns:
            for route in ("passthrough", "llm"):
                results: dict[str, tuple[WrkResult, dict[str, float], float, float]] = {}
                handler = 0.0
                for side, base in (("bare", bare_url), ("gw", gw_url)):
                    url = base + paths[route]
                    _check(run_wrk(wrk, url, scripts[route], c, WARMUP_S), f"warm-up {side} {route} c={c}")
                    if side == "gw":
                        handler = processor_phase_time(stack.processor_admin_url)
                        msgs0 = envoy_counter(stack.admin_url, "http.adapter.ext_proc.stream_msgs_sent")
                        streams0 = envoy_counter(stack.admin_url, "http.adapter.ext_proc.streams_started")
                    before = {p: cpu_seconds(p) for p in all_pids}
                    wrk0, (busy0, steal0) = children_cpu(), machine_cpu()
                    res = run_wrk(wrk, url, scripts[route], c, args.duration)
                    busy1, steal1 = machine_cpu()
                    used = {p: cpu_seconds(p) - before[p] for p in all_pids}
                    cpu = {k: sum(used[p] for p in v) for k, v in procs[side].items()}
                    # everything else on the machine: neither wrk nor any process of this benchmark
                    foreign = max(0.0, (busy1 - busy0) - sum(used.values()) - (children_cpu() - wrk0))
                    if side == "gw":
                        handler = processor_phase_time(stack.processor_admin_url) - handler
                        streams = envoy_counter(stack.admin_url, "http.adapter.ext_proc.streams_started") - streams0
                        msgs = (envoy_counter(stack.admin_url, "http.adapter.ext_proc.stream_msgs_sent") - msgs0) \
                            / max(streams, 1)
                    _check(res, f"{side} {route} c={c}")
                    results[side] = (res, cpu, foreign, steal1 - steal0)
                    print(f"[{len(points) + 1}/{total}] {side:4} {route:11} c={c:<3} p50 {res.p50:.3f} ms  "
                          f"p99 {res.p99:.3f} ms  {res.rps:,.0f} req/s  (other load {foreign / args.duration:.2f} "
                          f"cores, steal {(steal1 - steal0) / args.duration:.2f})", flush=True)
                points.append(Point(c, route, results["bare"][0], results["gw"][0], results["bare"][1],
                                    results["gw"][1], {k: v[2] for k, v in results.items()},
                                    {k: v[3] for k, v in results.items()}, handler, msgs))

        proc_rq = envoy_cluster_stats(stack.admin_url, PROCESSOR_CLUSTER)
        share = {h: proc_rq.get(h, 0) - proc_rq_before.get(h, 0) for h in sorted(proc_rq)}
        up_cx = {u: envoy_counter(u, "cluster.upstream.upstream_cx_total") - n for u, n in up_cx_before.items()}
        up_cx_text = f"gateway {up_cx[stack.admin_url]}, bare {up_cx[bare_admin_url]}"
        restarts = sum(w.restarts for w in stack.supervisor.workers)
    finally:
        if stack is not None:
            stack.stop()
        stop_process(bare)
        stop_process(upstream)
        shutil.rmtree(run_dir, ignore_errors=True)

    info = machine_info(workers)
    table, cpu_table = fmt_table(points), fmt_cpu(points, args.duration)
    total_streams = sum(share.values()) or 1
    share_text = ", ".join(f"{h} {n} ({100 * n / total_streams:.0f}%)" for h, n in share.items())
    print()
    print(table)
    print()
    print("CPU per request (us), from /proc utime+stime during the measured seconds; processor handler time "
          "from its own metrics; other load = CPU used by processes outside the benchmark:")
    print(cpu_table)
    print()
    print(f"ext_proc streams per processor worker (Envoy rq_total, all points incl. warm-up): {share_text}")
    print(f"connections to the upstream opened during the run: {up_cx_text}; worker restarts: {restarts}")

    if not args.no_write:
        append_results(info, command, table, cpu_table, share_text, up_cx_text, restarts, points, args.duration)
        print(f"\nappended to {RESULTS.relative_to(REPO)}")
    return 0


def other_load(seconds: float = 1.0) -> float:
    """Cores used by processes other than this one over `seconds` (before anything is started)."""
    mine0, (busy0, _) = cpu_seconds(os.getpid()), machine_cpu()
    time.sleep(seconds)
    return max(0.0, machine_cpu()[0] - busy0 - (cpu_seconds(os.getpid()) - mine0)) / seconds


def _verdict(points: list[Point], duration: float) -> str:
    """The honest paragraph: numbers against the targets (<= +0.5 ms p50 at c=1, >= 50% throughput)."""
    parts = []
    for p in points:
        added = p.gw.p50 - p.bare.p50
        kept = 100 * p.gw.rps / p.bare.rps
        if p.connections == 1:
            parts.append(f"at c=1 the {p.route} route adds {added:.2f} ms p50 "
                         f"({'within' if added <= 0.5 else 'over'} the 0.5 ms target)")
        else:
            parts.append(f"at c={p.connections} the {p.route} route keeps {kept:.0f}% of bare throughput "
                         f"({'meets' if kept >= 50 else 'below'} the 50% target)")
    loads = [v for p in points for v in p.foreign.values()]
    mean = sum(loads) / len(loads) / duration if loads else 0.0
    note = (f" Other processes used {mean:.2f} of the {os.cpu_count()} cores on average while measuring,"
            " so every figure here is worse than on a quiet machine." if mean > 0.1 else "")
    return "; ".join(parts) + "." + note


def append_results(info: dict[str, str], command: str, table: str, cpu_table: str, share_text: str,
                   up_cx: str, restarts: int, points: list[Point], duration: float) -> None:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = "" if RESULTS.exists() else (
        "# Benchmark results\n\nAppended by `perf/bench_overhead.py` (one section per run; newest last). "
        "See perf/README.md for what is measured.\n")
    text = f"""{header}
## {now}: bench_overhead (bare Envoy vs Envoy + processor)

- Machine: {info['cpu']}; kernel {info['kernel']}; Python {info['python']}; Envoy {info['envoy']}; {info['wrk']}
- Code: git {info['git']}
- Processor workers: {info['workers']}; gateway and bare Envoy `--concurrency {min(int(info['workers']), 4)}`; upstream Envoy `--concurrency 1` (direct_response)
- Command: `{command}` ({duration:g} s measured per point after a {WARMUP_S} s warm-up; wrk threads: 1 at c=1, 2 otherwise)
- Load generator, both Envoys, upstream and processor workers all share these {os.cpu_count()} cores over loopback.

Latency in ms (wrk `--latency`), throughput in req/s; added p50 = gateway - bare; kept = gateway / bare.

{table}

CPU per request in microseconds (utime+stime from /proc during the measured seconds; wrk not counted).
"Processor handler time" is the processor's own time in its stage code per request (its phase-duration
metric), the rest of its CPU is gRPC and asyncio. "Other load" is CPU used during the measured seconds
by processes that are not part of the benchmark (in cores, out of {os.cpu_count()}):

{cpu_table}

ext_proc streams per processor worker: {share_text}. Connections to the upstream opened: {up_cx}. Worker restarts: {restarts}.

Against the targets: {_verdict(points, duration)}
"""
    with RESULTS.open("a") as f:
        f.write(text)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: everything started was stopped", file=sys.stderr)
        sys.exit(130)
