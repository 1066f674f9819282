"""Benchmark: what a request's end reported back costs, policy against policy (a benchmark, never a test).

What: the gateway (`extproc.stack.Stack`, perf/configs/bench-gateway.yaml, 2 workers) in front of a
canned upstream (an Envoy `direct_response`, as in bench_overhead.py), under wrk, in arms run
interleaved `--reps` times each so drift on the machine hits every arm alike:
  - `stream`: `processor.feedback: stream`: no access loggers; `on_done` from what the stream saw;
  - `accessLog` (the default): one gRPC access logger per worker, `on_done` from Envoy's entry;
  - `baseline` (with `--baseline-tree DIR`, a checkout of an older revision, e.g. `git worktree
    add /tmp/base <rev>`): the same config on that revision's code, for before/after.
Per arm and route: req/s, processor CPU per request (utime+stime of the worker processes over the
measured seconds / requests) and Envoy CPU per request, as medians over the reps, plus the spread
(min-max). Two load shapes: closed loop (`--delay-ms 0`: as fast as it goes, so CPU per request
also moves with throughput) and paced (`--delay-ms N`: each of the connections waits N ms between
requests, so every arm serves about the same rate and CPU per request compares like with like).
Run: `.venv/bin/python perf/bench_feedback.py [--reps 3] [--duration 8] [--connections 32]
[--delay-ms 0,5] [--routes passthrough,llm] [--baseline-tree DIR] [--no-write]`.
Appends a dated section to perf/RESULTS.md unless --no-write. Everything it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402

from bench_overhead import ANALYZE_BODY, CHAT_BODY, _start_envoy, cpu_seconds, upstream_bootstrap  # noqa: E402
from extproc.stack import free_port, stop_process  # noqa: E402

CONFIG = REPO / "perf" / "configs" / "bench-gateway.yaml"
RESULTS = REPO / "perf" / "RESULTS.md"
ROUTES = {"passthrough": ("/v1/chat/completions", CHAT_BODY), "llm": ("/v1/analyze", ANALYZE_BODY)}

# Run inside the tree under test (its own extproc): start the stack, report pids, wait for stdin to close.
CHILD = r"""
import json, sys
sys.path.insert(0, ".")
from extproc.stack import Stack, free_port, free_port_block
st = Stack(sys.argv[1], listen_port=free_port(), admin_port=free_port(), processor_base_port=free_port_block(2),
           processor_admin_port=free_port(), workers=2)
st.start()
try:
    print(json.dumps({"url": st.url, "workers": [w.proc.pid for w in st.supervisor.workers], "envoy": st.envoy.pid}),
          flush=True)
    sys.stdin.read()
finally:
    st.stop()
"""


def wrk_script(path: Path, body: str, delay_ms: int) -> Path:
    lua = [f'wrk.method = "POST"', f"wrk.body = {json.dumps(body)}",
           'wrk.headers["content-type"] = "application/json"']
    if delay_ms:
        lua.append(f"function delay() return {delay_ms} end")
    path.write_text("\n".join(lua) + "\n")
    return path


def run_arm(tree: Path, config: Path, url_path: str, script: Path, connections: int, duration: float) -> dict:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(config)], cwd=tree, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        pids, envoy = info["workers"], info["envoy"]
        target = info["url"] + url_path
        subprocess.run(["wrk", "-t1", f"-c{connections}", "-d2s", "-s", str(script), target], capture_output=True)
        c0, e0 = sum(cpu_seconds(p) for p in pids), cpu_seconds(envoy)
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "-s", str(script), target],
                             capture_output=True, text=True).stdout
        c1, e1 = sum(cpu_seconds(p) for p in pids), cpu_seconds(envoy)
        n = int(re.search(r"(\d+) requests in", out).group(1))
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        return {"rps": n / duration, "proc_us": 1e6 * (c1 - c0) / n, "envoy_us": 1e6 * (e1 - e0) / n,
                "non2xx": int(bad.group(1)) if bad else 0}
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            stop_process(child)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--delay-ms", default="0,5", help="comma-separated: 0 closed loop, N paced (default 0,5)")
    ap.add_argument("--routes", default="passthrough,llm")
    ap.add_argument("--baseline-tree", help="a checkout of an older revision to run as the `baseline` arm")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="bench-feedback-"))
    up_port, up_admin = free_port(), free_port()
    upstream = _start_envoy(upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", 1,
                            f"http://127.0.0.1:{up_admin}", "upstream")
    base_text = CONFIG.read_text().replace("127.0.0.1:18080", f"127.0.0.1:{up_port}")
    arms: dict[str, tuple[Path, Path]] = {}
    for mode in ("stream", "accessLog"):
        cfg = run_dir / f"gw-{mode}.yaml"
        cfg.write_text(base_text.replace("  protocol: http\n", f"  protocol: http\n  processor: {{feedback: {mode}}}\n"))
        arms[mode] = (REPO, cfg)
    if args.baseline_tree:
        cfg = run_dir / "gw-baseline.yaml"
        cfg.write_text(base_text)
        arms["baseline"] = (Path(args.baseline_tree).resolve(), cfg)
    results: dict[tuple[str, str, int], list[dict]] = {}
    try:
        for delay in (int(d) for d in args.delay_ms.split(",")):
            for route in args.routes.split(","):
                url_path, body = ROUTES[route]
                script = wrk_script(run_dir / f"{route}-{delay}.lua", body, delay)
                for rep in range(args.reps):
                    for arm, (tree, cfg) in arms.items():
                        r = run_arm(tree, cfg, url_path, script, args.connections, args.duration)
                        results.setdefault((route, arm, delay), []).append(r)
                        print(f"[{rep + 1}/{args.reps}] {route:11s} delay={delay}ms {arm:9s} {r['rps']:7,.0f} req/s "
                              f"processor {r['proc_us']:5.0f} us/req  envoy {r['envoy_us']:5.0f} us/req"
                              + (f"  NON-2XX {r['non2xx']}" if r["non2xx"] else ""), flush=True)
    finally:
        stop_process(upstream)

    def cell(rs: list[dict], key: str, fmt: str) -> str:
        vals = [r[key] for r in rs]
        return f"{format(statistics.median(vals), fmt)} ({format(min(vals), fmt)}–{format(max(vals), fmt)})"

    lines = [f"| load | route | arm | req/s | processor CPU µs/req | Envoy CPU µs/req |", "|---|---|---|---:|---:|---:|"]
    for (route, arm, delay), rs in results.items():
        load = "closed loop" if delay == 0 else f"paced ({delay} ms between requests per connection)"
        lines.append(f"| {load} | {route} | {arm} | {cell(rs, 'rps', ',.0f')} | {cell(rs, 'proc_us', '.0f')} | "
                     f"{cell(rs, 'envoy_us', '.0f')} |")
    table = "\n".join(lines)
    print("\n" + table)
    if not args.no_write:
        base_rev = ""
        if args.baseline_tree:
            base_rev = subprocess.run(["git", "-C", args.baseline_tree, "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()
        env = (f"- machine: {benchenv.cpu()}; code {benchenv.git_revision()}"
               + (f"; baseline arm at {base_rev}" if base_rev else ""))
        with RESULTS.open("a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: request-end feedback, "
                    f"policy against policy (perf/bench_feedback.py)\n\n{env}\n"
                    f"- `.venv/bin/python perf/bench_feedback.py --reps {args.reps} --duration {args.duration:g} "
                    f"--connections {args.connections} --delay-ms {args.delay_ms}"
                    + (f" --baseline-tree {args.baseline_tree}" if args.baseline_tree else "") + "`; medians over "
                    f"the reps, (min–max); 2 workers, wrk -t1 -c{args.connections}.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
