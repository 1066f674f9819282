"""Default vs low-latency socket options on the same route, side by side, through Envoy to the ONNX Runtime server.

What: one ONNX Runtime server (demo `fraud-mlp`), one gateway (Envoy + one processor worker) with two
backends on that server, `ort-default` (Envoy's defaults) and `ort-fast` (`lowLatency: true`:
TCP_NODELAY, SO_BUSY_POLL 50 us, TCP_FASTOPEN_CONNECT, as far as the kernel allows), and two tensor
routes identical but for their target. Measured in alternating rounds (default, fast, default, ...)
so that the machine's drift hits both: c=1 latency (one keep-alive HTTP/1.1 connection, sequential
requests: p50, p99) and c=32 throughput (h2load, 32 connections, one request in flight each).
Writes perf/results/lowlatency.json and appends a section to perf/RESULTS.md with the machine, date,
command, load average, kernel probe result and what was rendered.
Run: `python perf/bench_lowlatency.py [--quick]` (--quick: under 3 minutes).
Reading it: on loopback SO_BUSY_POLL has no device queue to poll and TCP Fast Open only changes new
connections (Envoy keeps its upstream connections), so a difference here is expected to be within noise;
the options are for real NICs and connection churn. The numbers are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchenv import REPO, append_results, cpu, git_revision  # noqa: E402

from backends.onnxruntime.models import write_demo_repository  # noqa: E402
from extproc import socket_options as so  # noqa: E402
from tests.backends.onnxruntime.conftest import start_server, stop_server_process  # noqa: E402
from tests.e2e.conftest import make_stack  # noqa: E402

BODY = json.dumps({"features": [0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, -0.8]}).encode()
ROUTES = {"default": "/default/score", "low-latency": "/fast/score"}


def c1_latencies(host: str, port: int, path: str, n: int) -> list[float]:
    """Seconds per request, sequential on one keep-alive connection (after 20 warm-up requests)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    out = []
    try:
        for i in range(n + 20):
            t0 = time.perf_counter()
            conn.request("POST", path, BODY, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            dt = time.perf_counter() - t0
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status}")
            if i >= 20:
                out.append(dt)
    finally:
        conn.close()
    return out


def c32_throughput(url: str, seconds: int) -> dict:
    h2load = shutil.which("h2load")
    if h2load is None:
        raise SystemExit("h2load is not installed (Debian nghttp2-client; `make setup` installs it)")
    with tempfile.NamedTemporaryFile(suffix=".json") as body:
        body.write(BODY)
        body.flush()
        out = subprocess.run([h2load, "-c", "32", "-m", "1", "-t", "1", "-D", str(seconds), "-d", body.name,
                              "-H", "content-type: application/json", url], capture_output=True, text=True,
                             timeout=seconds + 60).stdout
    rps = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    ok = re.search(r"status codes: (\d+) 2xx", out)
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done", out)
    if rps is None:
        raise RuntimeError(f"h2load output not understood:\n{out}")
    return {"rps": float(rps.group(1)), "ok": int(ok.group(1)) if ok else 0, "done": int(done.group(1)) if done else 0}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def section(doc: dict) -> str:
    """The perf/RESULTS.md section for one run's JSON document."""
    results, command = doc["results"], doc["command"]
    rounds, n_c1, seconds = doc["rounds"], doc["c1_requests_per_round"], doc["c32_seconds_per_round"]
    rows = "\n".join(f"| {n} | {r['c1_p50_ms']} | {r['c1_p99_ms']} | {r['c32_rps_median']} | "
                     f"{', '.join(f'{x:.0f}' for x in r['c32_rps_rounds'])} | {r['c32_non_2xx']} |"
                     for n, r in results.items())
    load = doc["load_average_1m_before_after"]
    return f"""
## Low-latency socket options: default vs `lowLatency: true` on the same route (`perf/bench_lowlatency.py`)

- Date: {doc['date']}; machine: {doc['machine']}, kernel {doc['kernel']}; revision {doc['revision']}
- Command: `{command}`; {rounds} alternating rounds of {n_c1} sequential requests (c=1, one keep-alive
  HTTP/1.1 connection) and {seconds} s of h2load at c=32 (one request in flight per connection) per route
- Path: client -> Envoy -> processor (tensor route, one worker) -> Envoy -> ONNX Runtime server (`fraud-mlp`), loopback
- Rendered on `ort-fast`: {', '.join(doc['rendered_low_latency_options']) or 'nothing'}; left out: {'; '.join(doc['left_out']) or 'nothing'}
- Load average (1 min) before/after: {load[0]} / {load[1]} on {doc['machine'].rsplit(', ', 1)[-1]} shared with other
  engineers' jobs: the numbers are noisy

| route | c=1 p50 ms | c=1 p99 ms | c=32 req/s (median) | c=32 req/s per round | non-2xx |
|---|---:|---:|---:|---:|---:|
{rows}

Reading: both routes share the client connection, the processor and the server; only Envoy's upstream
sockets differ. On loopback SO_BUSY_POLL has no NIC queue to poll and Fast Open only changes new
connections (Envoy reuses its upstream connections), and Envoy sets TCP_NODELAY by default, so a
difference within the round-to-round spread is noise, not an effect; the options are meant for real
NICs (busy polling needs a NAPI driver and `net.core.busy_read`/`busy_poll` tuning) and connection churn.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds (under 3 minutes)")
    ap.add_argument("--no-append", action="store_true", help="do not append to perf/RESULTS.md")
    ap.add_argument("--report-only", action="store_true",
                    help="append the section for perf/results/lowlatency.json (the last run) without measuring")
    args = ap.parse_args(argv)
    if args.report_only:
        append_results(section(json.loads((REPO / "perf" / "results" / "lowlatency.json").read_text())))
        return 0
    rounds, n_c1, seconds = (3, 300, 5) if args.quick else (6, 1000, 15)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    support = so.KernelSupport.probe()

    root = Path(tempfile.mkdtemp(prefix="bench-lowlatency-"))
    write_demo_repository(root / "models")
    server = start_server(root / "models", root / "ort.log")
    stack = None
    try:
        endpoint = f"127.0.0.1:{server.http_port}"
        cfg = root / "gateway.yaml"
        cfg.write_text(json.dumps({
            "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "bench-lowlatency"},
            "spec": {
                "backends": [
                    {"name": "ort-default", "kind": "onnxruntime", "endpoints": [endpoint], "models": ["fraud-mlp"]},
                    {"name": "ort-fast", "kind": "onnxruntime", "endpoints": [endpoint], "models": ["fraud-mlp"],
                     "lowLatency": True},
                ],
                "routes": [{"path": ROUTES["default"], "kind": "tensor", "target": "ort-default", "model": "fraud-mlp",
                            "request": '{"features": [$.features]}'},
                           {"path": ROUTES["low-latency"], "kind": "tensor", "target": "ort-fast",
                            "model": "fraud-mlp", "request": '{"features": [$.features]}'}],
            }}))
        stack = make_stack(str(cfg), workers=1, agent=False).start()
        plan = stack.snapshot.backends["ort-fast"].socket_plan
        host, port = stack.snapshot.listener.address, stack.snapshot.listener.port
        lat: dict[str, list[float]] = {k: [] for k in ROUTES}
        tput: dict[str, list[dict]] = {k: [] for k in ROUTES}
        for r in range(rounds):
            order = list(ROUTES) if r % 2 == 0 else list(reversed(ROUTES))
            for name in order:
                lat[name] += c1_latencies(host, port, ROUTES[name], n_c1)
            for name in order:
                tput[name].append(c32_throughput(f"{stack.url}{ROUTES[name]}", seconds))
            print(f"round {r + 1}/{rounds} done", flush=True)
    finally:
        if stack is not None:
            stack.stop()
        stop_server_process(server.process)
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()

    results = {}
    for name in ROUTES:
        rps = [t["rps"] for t in tput[name]]
        results[name] = {
            "c1_requests": len(lat[name]),
            "c1_p50_ms": round(statistics.median(lat[name]) * 1000, 3),
            "c1_p99_ms": round(pct(lat[name], 0.99) * 1000, 3),
            "c32_rps_median": round(statistics.median(rps), 1),
            "c32_rps_rounds": rps,
            "c32_non_2xx": sum(t["done"] - t["ok"] for t in tput[name]),
        }
    command = "python perf/bench_lowlatency.py" + (" --quick" if args.quick else "")
    doc = {
        "date": started.isoformat(timespec="seconds"), "command": command, "machine": cpu(),
        "kernel": os.uname().release, "revision": git_revision(), "load_average_1m_before_after": [
            round(load_before[0], 2), round(load_after[0], 2)],
        "rounds": rounds, "c1_requests_per_round": n_c1, "c32_seconds_per_round": seconds,
        "kernel_support": {k: getattr(support, k) for k in support.__slots__},
        "rendered_low_latency_options": [o.description for o in plan.options] if plan else [],
        "left_out": [f"{o}: {why}" for o, why in plan.skipped] if plan else [],
        "results": results,
    }
    out = REPO / "perf" / "results" / "lowlatency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {out.relative_to(REPO)}")
    if not args.no_append:
        append_results(section(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
