"""Benchmark: no-op ext_proc servers on different Python stacks behind the same real Envoy, side by side.

What (issue 13 item 3, "the cost of each grpc.aio stream ... other server stacks"): every setup is a
processor that does nothing — it answers each ProcessingRequest with the same minimal
ProcessingResponse the floor sends (the phase's response with an empty CommonResponse: CONTINUE;
perf/stacks/common.py) — behind its own Envoy running the gateway's rendered bootstrap with the
processor cluster pointed at it (bench_overhead.floor_bootstrap: same ext_proc filter, processing
modes per route, health checks), with one shared upstream (bench_overhead's `direct_response` Envoy):
  - `aio`: grpc.aio, generated servicer, the gateway's server options, stdlib event loop
    (perf/stacks/aio_generated.py);
  - `aio-uvloop`: the same with uvloop installed (what extproc/server.py's run_worker does today);
  - `aio-opts`: `aio` plus grpc.optimization_target=latency and grpc.http2.bdp_probe=0;
  - `aio-generic`: grpc.aio with a generic handler, raw bytes in (only the oneof's field number read),
    prebuilt bytes out (perf/stacks/aio_generic.py);
  - `sync`: grpc.server with a ThreadPoolExecutor (64 threads), generated servicer (sync_generated.py);
  - `grpclib`: grpclib (pure-Python h2 on asyncio), protobuf messages (grpclib_server.py);
  - `floor`: the compiled C++ no-op of perf/floor/ (bench_overhead.build_floor/start_floor), the reference.
Each Python stack runs `--workers` processes (default: the CPU count), one port each, as the gateway
runs one worker process per core; the floor runs one process with that many threads and ports.
Routes (bench_overhead's): `headers` = POST /v1/chat/completions, headers only (1 ext_proc message per
request); `llm` = POST /v1/analyze with 1 KB of JSON (request headers, request body, response headers,
response body: 4 messages). The processors change nothing, so every setup returns the upstream's body.
Measured per point with wrk (bench_overhead.run_wrk): p50/p99 and req/s at c=1 and c=32;
`processor_cpu_us` = utime+stime of the stack's processes (/proc) over the measured seconds / requests;
`processor_cpu_us_per_msg` = the same per ext_proc message (Envoy's stream_msgs_sent); other load =
cores used meanwhile by processes outside the benchmark (bench_overhead's accounting).
Shared machine: `--reps` (3) turns per route and c, setups taking turns, order reversed every other
turn; the warm-up (one per setup, route and c) only on the first turn; medians of p50/p99/req/s, CPU
over all turns' requests (bench_overhead.merge). Checks that abort the run: one request per route and
setup before measuring (200 and the upstream's body), non-2xx or more than 5 socket errors in a point.
Printed check: every stack got the floor's ext_proc messages per request.
Output: a table; `--out FILE` (default perf/results/stacks.json) with `{"rows": [...], "run": {...}}`
(rows as bench_overhead's: setup, route, concurrency, p50_ms, p99_ms, rps, processor_cpu_us, ...);
unless `--no-write`, a dated section appended to perf/RESULTS.md (machine, command, load average).
Run: `.venv/bin/python perf/bench_stacks.py [--quick] [--duration 10] [--warmup 2] [--reps 3]
[--connections 1,32] [--routes headers,llm] [--setups aio,aio-uvloop,...] [--workers N] [--out FILE]
[--no-write]`. Cost: 7 setups x 4 points x (warm-up + reps x duration): `--quick` (1 s + 3 x 2 s)
3 min 47 s here (load average 8.5), `--duration 5` 8.5 minutes, the default (2 s + 3 x 10 s) about 16.
Everything it starts is stopped by PID.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_overhead, benchenv

import bench_overhead as bo  # noqa: E402
import benchenv  # noqa: E402
import yaml  # noqa: E402

from extproc.stack import free_port, free_port_block, stop_process  # noqa: E402
from extproc.supervisor import die_with_parent  # noqa: E402

REPO = bo.REPO
STACKS_DIR = HERE / "stacks"
RESULTS_JSON = REPO / "perf" / "results" / "stacks.json"
ROUTES = ("headers", "llm")
# setup -> (script under perf/stacks, its arguments, what it is); `floor` is bench_overhead's binary
STACKS: dict[str, tuple[str, list[str], str]] = {
    "aio": ("aio_generated.py", [], "grpc.aio, generated servicer, stdlib loop"),
    "aio-uvloop": ("aio_generated.py", ["--loop", "uvloop"], "grpc.aio, generated servicer, uvloop (today's worker)"),
    "aio-opts": ("aio_generated.py", ["--options", "tuned"],
                 "grpc.aio, generated servicer, + optimization_target=latency, bdp_probe=0"),
    "aio-generic": ("aio_generic.py", [], "grpc.aio, generic handler, raw bytes in, prebuilt bytes out"),
    "sync": ("sync_generated.py", [], "grpc.server + ThreadPoolExecutor(64), generated servicer"),
    "grpclib": ("grpclib_server.py", [], "grpclib (pure-Python h2, asyncio), protobuf messages"),
    "floor": ("", [], "compiled C++ no-op (perf/floor/), gRPC async API"),
}
SETUPS = tuple(STACKS)


def stack_command(name: str, ports: list[int]) -> list[str]:
    """The command line of one process of a Python stack serving `ports`."""
    script, args, _ = STACKS[name]
    cmd = [sys.executable, str(STACKS_DIR / script), *args]
    for p in ports:
        cmd += ["--port", str(p)]
    return cmd


def spawn_stack(name: str, ports: list[int]) -> subprocess.Popen:
    """One process of a Python stack on `ports`, not waited for (wait_ready)."""
    return subprocess.Popen(stack_command(name, ports), stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                            preexec_fn=die_with_parent, start_new_session=True)


def wait_ready(name: str, proc: subprocess.Popen) -> subprocess.Popen:
    """Returns once the stack's process printed `ready`; stops it and raises if it did not."""
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        stop_process(proc)
        raise RuntimeError(f"stack {name} did not start (exit code {proc.poll()}, printed {line!r})")
    return proc


def start_stack(name: str, ports: list[int]) -> subprocess.Popen:
    """One process of a Python stack on `ports`; returns once it printed `ready`."""
    return wait_ready(name, spawn_stack(name, ports))


def _point(setup: str, s: dict[str, Any], route: str, c: int, wrk: str, script: Path, warmup: float,
           duration: float, all_pids: list[int]) -> bo.Point:
    """One measured wrk run (after a warm-up when `warmup` > 0): bench_overhead's accounting."""
    url = s["url"] + bo.PATHS[route]
    if warmup > 0:
        bo._check(bo.run_wrk(wrk, url, script, c, warmup), f"warm-up {setup} {route} c={c}")
    msgs0 = bo.envoy_counter(s["admin"], "http.adapter.ext_proc.stream_msgs_sent")
    streams0 = bo.envoy_counter(s["admin"], "http.adapter.ext_proc.streams_started")
    before = {p: bo.cpu_seconds(p) for p in all_pids}
    wrk0, (busy0, steal0) = bo.children_cpu(), bo.machine_cpu()
    res = bo.run_wrk(wrk, url, script, c, duration)
    busy1, steal1 = bo.machine_cpu()
    used = {p: bo.cpu_seconds(p) - before[p] for p in all_pids}
    cpu = {k: sum(used[p] for p in v) for k, v in s["procs"].items()}
    foreign = max(0.0, (busy1 - busy0) - sum(used.values()) - (bo.children_cpu() - wrk0))
    streams = bo.envoy_counter(s["admin"], "http.adapter.ext_proc.streams_started") - streams0
    msgs = (bo.envoy_counter(s["admin"], "http.adapter.ext_proc.stream_msgs_sent") - msgs0) / max(streams, 1)
    bo._check(res, f"{setup} {route} c={c}")
    return bo.Point(setup, route, c, res, cpu, foreign, steal1 - steal0, None, msgs)


def measure(setups: dict[str, dict[str, Any]], routes: list[str], conns: list[int], wrk: str, warmup: float,
            duration: float, run_dir: Path, all_pids: list[int], reps: int) -> list[bo.Point]:
    scripts = {r: bo.lua_post(run_dir / f"{r}.lua", bo.BODIES[r]) for r in routes}
    merged: list[bo.Point] = []
    done, total = 0, len(conns) * len(routes) * len(setups) * reps
    for c in conns:
        for route in routes:
            by: dict[str, list[bo.Point]] = {n: [] for n in setups}
            for turn in range(reps):
                names = list(setups) if turn % 2 == 0 else list(reversed(setups))
                for name in names:
                    pt = _point(name, setups[name], route, c, wrk, scripts[route], warmup if turn == 0 else 0,
                                duration, all_pids)
                    by[name].append(pt)
                    done += 1
                    cpu = pt.cpu.get("processor", 0.0)
                    print(f"[{done}/{total}] {name:11} {route:7} c={c:<3} p50 {pt.wrk.p50:.3f} ms  p99 "
                          f"{pt.wrk.p99:.3f} ms  {pt.wrk.rps:,.0f} req/s  {1e6 * cpu / max(pt.wrk.requests, 1):.0f} "
                          f"µs CPU/req  {pt.msgs_per_req:.2f} msgs/req  (other load {pt.foreign / duration:.2f} "
                          "cores)", flush=True)
            merged += [bo.merge(by[n]) for n in setups]
    return merged


def build_rows(points: list[bo.Point], duration: float) -> list[dict[str, Any]]:
    """bench_overhead's rows, plus CPU per ext_proc message and what each stack is."""
    rows = bo.build_rows(points, duration)
    for r in rows:
        cpu, m = r["processor_cpu_us"], r["msgs_per_req"]
        r["processor_cpu_us_per_msg"] = round(cpu / m, 1) if cpu is not None and m else None
        r["stack"] = STACKS[r["setup"]][2]
    return rows


def fmt_table(rows: list[dict[str, Any]]) -> str:
    return benchenv.md_table(rows, [
        ("c", "concurrency", "{}"), ("route", "route", None), ("stack", "setup", None), ("p50 ms", "p50_ms", "{:.3f}"),
        ("p99 ms", "p99_ms", "{:.3f}"), ("req/s", "rps", "{:,.0f}"), ("req/s range", bo.rps_range, ""),
        ("processor CPU µs/req", "processor_cpu_us", "{:.0f}"), ("µs/msg", "processor_cpu_us_per_msg", "{:.0f}"),
        ("p50 − floor", "added_p50_ms_vs_floor", "{:+.3f}"), ("req/s / floor", "rps_vs_floor", "{:.0%}"),
        ("other load (cores)", "other_load_cores", "{:.2f}")])


def msgs_check(rows: list[dict[str, Any]]) -> str:
    by = {(r["setup"], r["route"], r["concurrency"]): r["msgs_per_req"] for r in rows}
    diffs = [f"{s} {rt} c={c}: {m} vs floor {by[('floor', rt, c)]}" for (s, rt, c), m in by.items()
             if s != "floor" and by.get(("floor", rt, c)) is not None and abs(m - by[("floor", rt, c)]) > 0.05]
    if not any(s == "floor" for s, _, _ in by):
        return "no floor in this run: messages per request not compared"
    return ("every stack got the floor's ext_proc messages per request"
            + " (the floor's: " + ", ".join(f"{rt} c={c} {m:.2f}" for (s, rt, c), m in by.items() if s == "floor") + ")"
            if not diffs else "ext_proc messages per request differ from the floor's: " + "; ".join(diffs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 s warm-up + 3 turns x 2 s per point (under 4 minutes)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per turn, whole (default 10, --quick 2)")
    ap.add_argument("--warmup", type=float, default=None, help="warm-up seconds, first turn only (default 2, --quick 1)")
    ap.add_argument("--reps", type=int, default=3, help="turns per route and c, setups interleaved (default 3)")
    ap.add_argument("--connections", default="1,32")
    ap.add_argument("--routes", default=",".join(ROUTES), help="comma-separated, of headers,llm")
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {','.join(SETUPS)}")
    ap.add_argument("--workers", type=int, default=None, help="processes per Python stack, the floor's threads (default: CPUs)")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON (default {RESULTS_JSON.relative_to(REPO)})")
    ap.add_argument("--no-write", action="store_true", help="leave perf/RESULTS.md and the default JSON alone")
    args = ap.parse_args(argv)
    duration = float(max(1, round(args.duration if args.duration is not None else (2 if args.quick else 10))))
    warmup = float(max(1, round(args.warmup if args.warmup is not None else (1 if args.quick else 2))))
    conns = [int(c) for c in args.connections.split(",") if c.strip()]
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    wanted = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not routes or not wanted or not set(routes) <= set(ROUTES) or not set(wanted) <= set(SETUPS):
        ap.error(f"--routes from {','.join(ROUTES)}, --setups from {','.join(SETUPS)}")
    reps = max(1, args.reps)
    workers = args.workers or os.cpu_count() or 1
    envoy_concurrency = min(workers, 4)  # as bench_overhead (and Stack) give Envoy
    command = benchenv.command_line("perf/bench_stacks.py", argv)
    benchenv.sigterm_unwinds(argv)

    wrk, floor_bin, floor_why = bo.tools(wanted)
    if not wanted:
        print("nothing to measure", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    load_start = os.getloadavg()
    idle_load = bo.other_load()
    if idle_load > 0.2:
        print(f"warning: other processes are using {idle_load:.2f} of {os.cpu_count()} cores (load average "
              f"{load_start[0]:.2f}): a shared machine, numbers worse and noisier than on a quiet one", file=sys.stderr)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-stacks-"))
    procs: list[subprocess.Popen] = []  # stopped in reverse order
    try:
        up_port, up_admin = free_port(), free_port()
        procs.append(bo._start_envoy(bo.upstream_bootstrap(up_port, up_admin), run_dir / "upstream.yaml", 1,
                                     f"http://127.0.0.1:{up_admin}", "upstream"))
        upstream_pids = [procs[-1].pid]
        cfg_path = run_dir / "bench-gateway.yaml"  # the stream route's simulator is never started: no traffic there
        cfg_path.write_text(yaml.safe_dump(bo.bench_config(up_port, free_port()), sort_keys=False, allow_unicode=True))
        # every Python stack's processes spawned first (they start while the Envoys do), then one
        # Envoy per setup with the gateway's bootstrap pointed at that setup's ports
        bases: dict[str, int] = {}
        taken: set[int] = set()  # chosen but perhaps not bound yet: no other choice may take them
        for name in wanted:
            while not taken.isdisjoint(block := set(range(base := free_port_block(workers), base + workers))):
                pass
            bases[name] = base
            taken |= block
        servers: dict[str, list[subprocess.Popen]] = {}
        for name in wanted:
            if name == "floor":
                assert floor_bin is not None
                servers[name] = [bo.start_floor(floor_bin, bases[name], workers, workers)]
                procs.append(servers[name][0])
                continue
            servers[name] = []
            for i in range(workers):
                servers[name].append(spawn_stack(name, [bases[name] + i]))
                procs.append(servers[name][-1])
        setups: dict[str, dict[str, Any]] = {}
        for name in wanted:
            port = free_port(avoid=taken)
            admin = free_port(avoid=taken | {port})
            admin_url = f"http://127.0.0.1:{admin}"
            env = bo._start_envoy(bo.floor_bootstrap(cfg_path, workers, port, admin, bases[name]),
                                  run_dir / f"{name}-envoy.yaml", envoy_concurrency, admin_url, f"{name}-envoy")
            procs.append(env)
            setups[name] = {"url": f"http://127.0.0.1:{port}", "admin": admin_url,
                            "procs": {"envoy": [env.pid], "upstream": upstream_pids,
                                      "processor": [p.pid for p in servers[name]]}}
        for name in wanted:
            if name != "floor":
                for p in servers[name]:
                    wait_ready(name, p)
        for name in wanted:
            bo.wait_processor_healthy(setups[name]["admin"], workers, name)
        bo.check_responses({n: v["url"] for n, v in setups.items()}, routes)
        all_pids = sorted({os.getpid(), *(p for s in setups.values() for v in s["procs"].values() for p in v)})
        points = measure(setups, routes, conns, wrk, warmup, duration, run_dir, all_pids, reps)
    finally:
        for p in reversed(procs):
            stop_process(p)
        shutil.rmtree(run_dir, ignore_errors=True)
    load_end = os.getloadavg()

    rows = build_rows(points, duration)
    info = bo.machine_info(workers)
    table, check = fmt_table(rows), msgs_check(rows)
    load_text = benchenv.load_text(load_start, load_end, idle_load)
    print()
    print(table)
    print()
    print(check)
    if floor_why:
        print(f"floor rows skipped: {floor_why}")
    print(load_text)
    run = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "command": command, "machine": info,
           "shared_machine": True, "load_start": list(load_start), "load_end": list(load_end),
           "other_load_before_cores": round(idle_load, 2), "warmup_s": warmup, "duration_s": duration, "reps": reps,
           "workers": workers, "envoy_concurrency": envoy_concurrency,
           "stacks": {n: STACKS[n][2] for n in setups}, "msgs_check": check}
    benchenv.write_json(json.dumps({"rows": rows, "run": run}, indent=1, ensure_ascii=False) + "\n", args.out, args.no_write, RESULTS_JSON)
    if not args.no_write:
        stacks = "\n".join(f"  - `{n}`: {STACKS[n][2]}" for n in setups)
        benchenv.append_results(f"""
## {run['date']}: bench_stacks (no-op ext_proc servers on Python stacks vs the compiled floor, same Envoy)

- **Measured on a shared machine**: {info['cpu']}, which other engineers' jobs were using at the same time;
  {load_text}. The "other load" column is the CPU (cores, of {os.cpu_count()}) used by processes outside the
  benchmark during each point: compare stacks within this run, not with runs under other load.
- Kernel {info['kernel']}; Python {info['python']}; Envoy {info['envoy']}; {info['wrk']}; code: git {info['git']}
- Command: `{command}` ({reps} turns of {duration:g} s per point, setups interleaved, order reversed every other
  turn, warm-up {warmup:g} s on the first turn only; medians of p50/p99/req/s, CPU over all turns' requests)
- Every stack: {workers} processes, one port each (the floor: one process, {workers} threads and ports), behind its
  own Envoy `--concurrency {envoy_concurrency}` with the gateway's rendered bootstrap (bench_overhead.floor_bootstrap);
  one upstream Envoy (direct_response). Each answers every message with the empty CONTINUE reply of its phase.
{stacks}
- Routes: headers = POST /v1/chat/completions (1 ext_proc message); llm = POST /v1/analyze, 1 KB JSON (4 messages).
  CPU = utime+stime of the stack's processes from /proc during the measured seconds, per request and per message.

{table}

{check}. Comparison and levers: perf/stacks.md.
""")
    return 0


if __name__ == "__main__":
    benchenv.run(main)
