"""Benchmark: gateway throughput and processor CPU per request against the number of processor workers.

What: for each worker count N in `--workers` (default 1, 2, 4, ... up to os.cpu_count(), and the CPU
count itself), one `extproc.stack.Stack` (our processor workers + Envoy) from perf/configs/bench-gateway.yaml
in front of bench_overhead's upstream (a separate Envoy answering a canned chat completion with
`direct_response`), and wrk closed-loop at `--connections` (default 64, enough to keep every worker busy)
on two route kinds, as in bench_overhead.py:
  - `headers`: POST /v1/chat/completions, the passthrough route: a headers-only decision (1 message);
  - `llm`: POST /v1/analyze with a 1 KB JSON body, JSON out through the route's transform (4 messages).
Per point: req/s and p50/p99 from `wrk --latency`, CPU µs per request of the processor workers and of
Envoy (/proc utime+stime during the measured seconds), the processor's cores busy (its CPU seconds
over the measured seconds: near N when the workers are the bottleneck), the CPU used meanwhile by
processes outside the benchmark, and the scaling efficiency rps(N) / (N x rps(1)) per route (issue 13
item 4's goal: at least 0.8, i.e. 0.8x linear).

Envoy's `--concurrency` is N (`--envoy-concurrency match`, the default) or a fixed number
(`--envoy-concurrency 4`); Stack gives its Envoy min(N, 4), so where that differs the stack's Envoy
is restarted on the same bootstrap and xDS files with the wanted concurrency before measuring. The
upstream Envoy gets `--upstream-concurrency` (default: a quarter of the servers' cores, at least 1).

Pinning: with at least 4 usable cores, wrk runs under `taskset -c` on its own cores (`--wrk-cpus K`,
default a quarter of the cores, at least 1; the highest-numbered ones) with one wrk thread per core,
and this process sets its own affinity to the rest before starting anything, so Envoy, the upstream
and the workers (its children) run there. With fewer cores nothing is pinned (wrk: 2 threads), and
the load generator, both Envoys and the workers share every core: linear scaling cannot be judged
there. What was pinned is printed, recorded in the JSON and in RESULTS.md, with each server's
Cpus_allowed_list read back from /proc.

Output: a table, `--out FILE` (default perf/results/scaling.json) with `{"machine", "date", "command",
"load", "pinning", "rows": [{"workers", "route", "concurrency", "envoy_concurrency", "rps", "p50_ms",
"p99_ms", "processor_cpu_us", "envoy_cpu_us", "processor_cores_busy", "other_load_cores",
"efficiency", ...}]}`, and, unless --no-write, a dated section appended to perf/RESULTS.md (machine,
date, command, load average, pinning, `--label`).
Run: `.venv/bin/python perf/bench_scaling.py [--quick] [--workers 1,2,4,8,16] [--connections 64]
[--routes headers,llm] [--duration 10] [--warmup 2] [--envoy-concurrency match|K] [--wrk-cpus K]
[--upstream-concurrency K] [--label TEXT] [--out FILE] [--no-write]`.
Cost: per worker count a stack start (a few seconds) and per route warm-up + duration; `--quick`
(1 s + 3 s per point) with `--workers 1,2` takes about a minute here, the default on 16 cores (1, 2,
4, 8, 16) about 3 minutes. Everything it starts is stopped by PID (bounded waits) on exit, error or
Ctrl-C. Needs what bench_overhead.py needs (venv, Envoy, wrk), plus `taskset` (util-linux) to pin.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_overhead, benchenv

import bench_overhead as bo  # noqa: E402
import benchenv  # noqa: E402

import yaml  # noqa: E402

from extproc.envoy_bin import find_envoy  # noqa: E402
from extproc.stack import Stack, free_port, free_port_block, stop_process, wait_http  # noqa: E402
from extproc.supervisor import die_with_parent  # noqa: E402

REPO = bo.REPO
RESULTS_JSON = REPO / "perf" / "results" / "scaling.json"
ROUTES = ("headers", "llm")
GOAL = 0.8  # issue 13 item 4: at least 0.8x linear


def default_workers(cpus: int) -> list[int]:
    """1, 2, 4, ... below `cpus`, and `cpus` itself: 1..N without a stack per integer on a big machine."""
    out, n = [], 1
    while n < cpus:
        out.append(n)
        n *= 2
    return out + [max(1, cpus)]


def parse_workers(text: str | None, cpus: int) -> list[int]:
    """`--workers "1,2,4"` -> [1, 2, 4] (sorted, duplicates dropped); None or "" -> default_workers(cpus).
    Raises ValueError on anything but positive integers."""
    if not text or not text.strip():
        return default_workers(cpus)
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--workers: {part!r} is not a positive integer")
        out.add(int(part))
    if not out:
        raise ValueError("--workers: no worker counts")
    return sorted(out)


def envoy_concurrency(spec: str, workers: int) -> int:
    """`--envoy-concurrency`: "match" -> the worker count, else a fixed positive integer."""
    if spec == "match":
        return workers
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"--envoy-concurrency: {spec!r} is neither 'match' nor a positive integer")
    return int(spec)


def plan_cpus(cpus: list[int], wrk_cpus: int | None = None) -> tuple[list[int], list[int]]:
    """(servers' cores, wrk's cores) from the usable cores. With at least 4, wrk gets `wrk_cpus` (default a
    quarter, at least 1) of the highest-numbered ones and the servers the rest; with fewer, nothing is
    pinned: ([], [])."""
    cpus = sorted(cpus)
    if len(cpus) < 4:
        return [], []
    k = wrk_cpus if wrk_cpus else max(1, len(cpus) // 4)
    if not 1 <= k <= len(cpus) - 1:
        raise ValueError(f"--wrk-cpus {k}: must leave at least one of {len(cpus)} cores to the servers")
    return cpus[:-k], cpus[-k:]


def efficiency(rps: dict[int, float]) -> dict[int, float | None]:
    """rps(N) / (N x rps(1)) per worker count; None for all when N=1 was not measured (or gave 0 req/s)."""
    base = rps.get(1)
    return {n: (round(r / (n * base), 3) if base else None) for n, r in sorted(rps.items())}


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (taskset's and /proc's notation)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def allowed_cpus(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def build_rows(points: list[Any], duration: float, envoy_c: dict[int, int]) -> list[dict[str, Any]]:
    """One row per (workers, route) from bench_overhead Points whose `setup` is "w<N>", with the efficiency
    against the same route's 1-worker row."""
    rows = []
    for p in points:
        n = int(p.setup[1:])
        reqs = p.wrk.requests
        rows.append({
            "workers": n, "route": p.route, "concurrency": p.connections, "envoy_concurrency": envoy_c[n],
            "rps": round(p.wrk.rps, 1), "p50_ms": round(p.wrk.p50, 4), "p99_ms": round(p.wrk.p99, 4),
            "requests": reqs,
            "processor_cpu_us": bo._us(p.cpu.get("processor"), reqs),
            "envoy_cpu_us": bo._us(p.cpu.get("envoy"), reqs),
            "upstream_cpu_us": bo._us(p.cpu.get("upstream"), reqs),
            "handler_us": bo._us(p.handler_s, reqs),
            "processor_cores_busy": round(p.cpu.get("processor", 0.0) / duration, 2) if duration else None,
            "other_load_cores": round(p.foreign / duration, 2) if duration else None,
        })
    for route in {r["route"] for r in rows}:
        mine = [r for r in rows if r["route"] == route]
        eff = efficiency({r["workers"]: r["rps"] for r in mine})
        for r in mine:
            r["efficiency"] = eff[r["workers"]]
    return rows


def fmt_table(rows: list[dict[str, Any]]) -> str:
    return benchenv.md_table(sorted(rows, key=lambda r: (r["route"], r["workers"])), [
        ("route", "route", None), ("workers", "workers", "{}"), ("Envoy conc.", "envoy_concurrency", "{}"),
        ("c", "concurrency", "{}"), ("req/s", "rps", "{:,.0f}"), ("efficiency", "efficiency", "{:.2f}"),
        ("p50 ms", "p50_ms", "{:.2f}"), ("p99 ms", "p99_ms", "{:.2f}"), ("processor CPU µs/req", "processor_cpu_us", "{:.0f}"),
        ("Envoy CPU µs/req", "envoy_cpu_us", "{:.0f}"), ("processor cores busy", "processor_cores_busy", "{:.2f}"),
        ("other load (cores)", "other_load_cores", "{:.2f}")])


def verdict(rows: list[dict[str, Any]], judged: bool = True) -> str:
    """Each N > 1 against the goal; `judged=False` (nothing pinned, < 4 cores) says the figures cannot decide it."""
    parts = []
    for r in sorted(rows, key=lambda r: (r["route"], r["workers"])):
        if r["workers"] > 1 and r["efficiency"] is not None:
            parts.append(f"{r['route']} N={r['workers']}: {r['efficiency']:.2f}x linear "
                         f"(goal >= {GOAL}: {'met' if r['efficiency'] >= GOAL else 'not met'})")
    if not parts:
        return "no N > 1 with an N=1 row: no efficiency."
    text = "; ".join(parts) + "."
    if not judged:
        text += (" Not a judgement of the processor: with fewer than 4 cores nothing is pinned and wrk, both Envoys"
                 " and the workers compete for the same cores (see processor cores busy).")
    return text


def _restart_envoy(stack: Stack, concurrency: int) -> None:
    """Stack starts Envoy with --concurrency min(N, 4): replace it by one on the same bootstrap and xDS
    files with `concurrency`, so stack.stop() stops the new one."""
    stop_process(stack.envoy)
    stack.envoy = subprocess.Popen(
        [find_envoy(), "-c", stack.envoy_config, "--disable-hot-restart", "--concurrency", str(concurrency),
         "-l", "warning", "--log-format", "[envoy %l] %v"], preexec_fn=die_with_parent, start_new_session=True)
    wait_http(f"{stack.admin_url}/ready", 30, stack.envoy, "envoy")
    wait_http(f"{stack.url}/__adapter_not_a_route__", 10, stack.envoy, "envoy listener")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 s warm-up + 3 s per point")
    ap.add_argument("--workers", default=None,
                    help="comma-separated worker counts (default 1,2,4,.. and the CPU count)")
    ap.add_argument("--connections", type=int, default=64, help="wrk connections (default 64)")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of headers,llm")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per point (default 10, --quick 3)")
    ap.add_argument("--warmup", type=float, default=None, help="warm-up seconds per point (default 2, --quick 1)")
    ap.add_argument("--envoy-concurrency", default="match", help="'match' (= workers, default) or a fixed number")
    ap.add_argument("--wrk-cpus", type=int, default=None,
                    help="cores pinned to wrk when >= 4 usable (default a quarter)")
    ap.add_argument("--upstream-concurrency", type=int, default=None,
                    help="the upstream Envoy's --concurrency (default a quarter of the servers' cores, at least 1)")
    ap.add_argument("--label", default="", help="a line for RESULTS.md, e.g. where and under what load it ran")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON (default {RESULTS_JSON.relative_to(REPO)})")
    ap.add_argument("--no-write", action="store_true", help="leave perf/RESULTS.md and the default JSON alone")
    args = ap.parse_args(argv)
    duration = float(max(1, round(args.duration if args.duration is not None else (3 if args.quick else 10))))
    warmup = float(max(1, round(args.warmup if args.warmup is not None else (1 if args.quick else 2))))
    usable = sorted(os.sched_getaffinity(0))
    try:
        counts = parse_workers(args.workers, len(usable))
        econc = {n: envoy_concurrency(args.envoy_concurrency, n) for n in counts}
        server_cpus, wrk_cpus = plan_cpus(usable, args.wrk_cpus)
    except ValueError as e:
        ap.error(str(e))
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if not routes or not set(routes) <= set(ROUTES):
        ap.error(f"--routes from {','.join(ROUTES)}")
    upstream_c = args.upstream_concurrency or max(1, len(server_cpus or usable) // 4)
    command = benchenv.command_line("perf/bench_scaling.py", argv)
    benchenv.sigterm_unwinds(argv)

    wrk = bo.ensure_wrk()
    prefix: tuple[str, ...] = ()
    threads = None  # bench_overhead's default: 2 at c > 1
    if wrk_cpus:
        taskset = shutil.which("taskset")
        if not taskset:
            raise SystemExit("taskset (util-linux) is needed to pin wrk away from the servers")
        prefix, threads = (taskset, "-c", cpu_list(wrk_cpus)), len(wrk_cpus)
        os.sched_setaffinity(0, server_cpus)  # inherited by everything started below
        pinning = (f"wrk pinned to cores {cpu_list(wrk_cpus)} ({threads} threads); Envoy, the upstream and the "
                   f"processor workers to cores {cpu_list(server_cpus)}")
    else:
        pinning = (f"nothing pinned: {len(usable)} usable cores (< 4), wrk (2 threads), both Envoys and the workers "
                   "share them all, so linear scaling cannot be judged here")
    print(pinning)
    load_start = os.getloadavg()
    idle_load = bo.other_load()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    upstream: subprocess.Popen | None = None
    points: list[Any] = []
    affinity: dict[str, str] = {}
    restarts = 0
    try:
        up_port, up_admin = free_port(), free_port()
        upstream = bo._start_envoy(bo.upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", upstream_c,
                                   f"http://127.0.0.1:{up_admin}", "upstream")
        cfg = yaml.safe_load(bo.CONFIG.read_text())  # bench_overhead's config without its stream route
        cfg["spec"]["backends"][0]["endpoints"] = [f"127.0.0.1:{up_port}"]
        cfg_path = run_dir / "bench-gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
        scripts = {r: bo.lua_post(run_dir / f"{r}.lua", bo.BODIES[r]) for r in routes}
        total, done = len(counts) * len(routes), 0
        for n in counts:
            stack = Stack(str(cfg_path), listen_port=free_port(), admin_port=free_port(),
                          processor_base_port=free_port_block(n), processor_admin_port=free_port(),
                          workers=n, run_dir=str(run_dir / f"gateway-{n}"), log_level="warning")
            try:
                stack.start()
                if econc[n] != min(n, 4):
                    _restart_envoy(stack, econc[n])
                bo.wait_processor_healthy(stack.admin_url, n, f"{n}-worker")
                bo.check_responses({"gateway": stack.url}, routes)
                workers = [w.proc.pid for w in stack.supervisor.workers]
                s = {"url": stack.url, "admin": stack.admin_url, "processor_admin": stack.processor_admin_url,
                     "procs": {"envoy": [stack.envoy.pid], "upstream": [upstream.pid], "processor": workers}}
                if not affinity:
                    affinity = {"wrk": cpu_list(wrk_cpus) if wrk_cpus else "all",
                                "envoy": allowed_cpus(stack.envoy.pid), "upstream": allowed_cpus(upstream.pid),
                                "worker": allowed_cpus(workers[0])}
                all_pids = sorted({os.getpid(), upstream.pid, stack.envoy.pid, *workers})
                for route in routes:
                    pt = bo._one(f"w{n}", s, route, args.connections, wrk, scripts[route], warmup, duration, all_pids,
                                 threads, prefix)
                    points.append(pt)
                    done += 1
                    print(f"[{done}/{total}] workers={n:<3} envoy={econc[n]:<3} {route:7} c={args.connections} "
                          f"{pt.wrk.rps:,.0f} req/s  p50 {pt.wrk.p50:.2f} ms  processor "
                          f"{pt.cpu.get('processor', 0) / duration:.2f} cores  (other load "
                          f"{pt.foreign / duration:.2f} cores)", flush=True)
                restarts += sum(w.restarts for w in stack.supervisor.workers)
            finally:
                stack.stop()
    finally:
        stop_process(upstream)
        shutil.rmtree(run_dir, ignore_errors=True)
    load_end = os.getloadavg()

    rows = build_rows(points, duration, econc)
    info = bo.machine_info(max(counts))
    table = fmt_table(rows)
    load_text = benchenv.load_text(load_start, load_end, idle_load)
    print()
    print(table)
    print()
    print(f"{pinning}; Cpus_allowed_list read back: {affinity}")
    print(f"{load_text}; worker restarts: {restarts}")
    print(f"against the goal: {verdict(rows, bool(wrk_cpus))}")
    now = dt.datetime.now(dt.timezone.utc)
    doc = {"machine": {"cpu": info["cpu"], "cores": len(usable), "kernel": info["kernel"], "python": info["python"],
                       "envoy": info["envoy"], "wrk": info["wrk"]},
           "date": now.isoformat(timespec="seconds"), "git": info["git"], "command": command, "label": args.label,
           "load": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in load_end],
                    "other_cores_before": round(idle_load, 2)},
           "pinning": {"text": pinning, "cpus_allowed": affinity}, "upstream_concurrency": upstream_c,
           "warmup_s": warmup, "duration_s": duration, "worker_restarts": restarts, "rows": rows}
    benchenv.write_json(json.dumps(doc, indent=1) + "\n", args.out, args.no_write, RESULTS_JSON)
    if not args.no_write:
        label = f"- **{args.label}**\n" if args.label else ""
        benchenv.append_results(f"""
## {now.strftime('%Y-%m-%d %H:%M UTC')}: bench_scaling (throughput against processor workers)

{label}- Machine: {info['cpu']} ({len(usable)} usable); kernel {info['kernel']}; Python {info['python']}; Envoy {info['envoy']}; {info['wrk']}
- Code: git {info['git']}
- Command: `{command}` ({duration:g} s measured per point after a {warmup:g} s warm-up; wrk closed loop, c={args.connections})
- Pinning: {pinning}. Upstream Envoy (direct_response) `--concurrency {upstream_c}`.
- Load: {load_text}; worker restarts: {restarts}.

Routes as in bench_overhead: headers = POST /v1/chat/completions (passthrough, headers only); llm = POST /v1/analyze, {len(bo.LLM_BODY)} B JSON in, JSON out. Efficiency = rps(N) / (N x rps(1)); processor cores busy = the workers' CPU seconds over the measured seconds.

{table}

Against issue 13 item 4 (>= {GOAL}x linear): {verdict(rows, bool(wrk_cpus))}
""")
    return 0


if __name__ == "__main__":
    benchenv.run(main)
