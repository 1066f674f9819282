"""Benchmark: batch policies side by side on our ONNX Runtime server under a load that changes (a tool, not a test).

What: one server process (``python -m backends.onnxruntime``, the demo ``fraud-mlp``, int8 active,
real ONNX Runtime inference) and, per policy in turn (static = the model's config.yaml, 32 rows /
1000 us; ``brief`` = the brief's updateBatchSize; ``aimd``), a `ControlLoop`
(extproc/qos/batch_control.py: every 100 ms, attainment from the server's histogram, a write through
the admin endpoint with a lease) while an open-loop Poisson load runs three phases: low, high, low
(``--low``/``--high`` req/s, ``--phase`` seconds each). Static runs a controller too (it reads the
histogram every 100 ms and writes nothing new), so every policy pays the same control cost.
Before each policy the model is reset to its configured setting and 1 s of low load warms it.
Requests are what ``tritonclient.http`` sends with ``binary_data=True`` (one row), over keep-alive
HTTP/1.1 connections (``perf/bench_ort_batching.py``'s client: latency from the scheduled arrival,
so waiting in the client counts).
Per policy and phase: p50/p99 latency (client side), throughput (200 answers per second of the
phase), SLO attainment client side (latency <= ``--slo-ms``) and server side (the histogram the
policy reads), mean ``max_batch_size`` the policy chose, mean rows per ``session.run``.
Writes perf/results/batch_policy.json and appends a section to perf/RESULTS.md (unless
``--no-write``). ``--quick``: 5 s phases (about 1.5 minutes in all).

Run: ``.venv/bin/python perf/bench_batch_policy.py [--quick] [--slo-ms 2.5] [--low 300] [--high 1500]``.
The load generator, the controller thread and the server share the machine's cores; the other
load on the machine during the run is measured and reported.
Cost: none at serving time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402
import numpy as np  # noqa: E402
from bench_ort_batching import (Pool, batch_totals, cpu_seconds, machine_busy_seconds, request_bytes,  # noqa: E402
                                start_server, stop)

import httpx  # noqa: E402

from backends.onnxruntime.models import write_fraud_mlp  # noqa: E402
from extproc.qos.batch_control import BatchController, ControlLoop, OrtBatchingClient  # noqa: E402
from extproc.qos.batch_policy import POLICIES, BatchSetting, make_policy  # noqa: E402

MODEL, WIDTH = "fraud-mlp", 8
CONFIGURED = BatchSetting(32, 1000)  # the demo model's config.yaml
RESULTS_JSON = REPO / "perf" / "results" / "batch_policy.json"


async def _one(pool: Pool, payload: bytes, scheduled: float, out: list) -> None:
    conn = None
    try:
        conn = await pool.acquire()
        ok = await conn.call(payload) == 200
    except (OSError, asyncio.IncompleteReadError, ValueError):
        ok = False
        if conn is not None:
            conn.close()
        conn = None
    finally:
        pool.release(conn)
    out.append((scheduled, time.perf_counter(), ok))


async def run_load(port: int, payloads: list[bytes], phases: list[tuple[str, float, float]], seed: int,
                   t0: float) -> list[tuple[float, float, bool]]:
    """Open-loop Poisson arrivals, piecewise-constant rate; returns (scheduled, done, ok) per request."""
    pool = Pool(port, 256)
    rng = random.Random(seed)
    out: list[tuple[float, float, bool]] = []
    tasks: set[asyncio.Task] = set()
    start, i = t0, 0
    for _name, rate, seconds in phases:
        end = start + seconds
        next_at = start
        while True:
            next_at += rng.expovariate(rate)
            if next_at >= end:
                break
            now = time.perf_counter()
            if next_at > now:
                await asyncio.sleep(next_at - now)
            task = asyncio.ensure_future(_one(pool, payloads[i % len(payloads)], next_at, out))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        start = end
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    pool.close()
    return out


def measure_policy(name: str, base: str, port: int, pid: int, payloads: list[bytes], args) -> dict:
    httpx.post(f"{base}/admin/models/{MODEL}/batching", json=CONFIGURED.as_body(), timeout=5).raise_for_status()
    warm = [("warm", args.low, 1.0)]
    asyncio.run(run_load(port, payloads, warm, 7, time.perf_counter()))
    client = OrtBatchingClient(base, MODEL)
    ctl = BatchController(make_policy(name, CONFIGURED), client, args.slo_ms / 1000, owner=f"bench-{name}")
    loop = ControlLoop(ctl, 0.1).start()
    phases = [("low", args.low, args.phase), ("high", args.high, args.phase), ("low again", args.low, args.phase)]
    rows0, runs0 = batch_totals(base, MODEL)
    srv0, busy0, own0 = cpu_seconds(pid), machine_busy_seconds(), time.process_time()
    t0 = time.perf_counter()
    mono0 = time.monotonic()
    results = asyncio.run(run_load(port, payloads, phases, 1, t0))
    wall = time.perf_counter() - t0
    srv1, busy1, own1 = cpu_seconds(pid), machine_busy_seconds(), time.process_time()
    rows1, runs1 = batch_totals(base, MODEL)
    loop.stop()
    client.close()
    history = [(r.at - mono0, r.requests, r.attainment, r.wanted.max_batch_size) for r in ctl.history]
    other = max(0.0, (busy1 - busy0) - (srv1 - srv0) - (own1 - own0)) / wall
    rows = []
    bounds, start = [], 0.0
    for phase, rate, seconds in phases:
        bounds.append((phase, rate, start, start + seconds))
        start += seconds
    bounds.append(("all", None, 0.0, start))
    slo = args.slo_ms / 1000
    for phase, rate, lo, hi in bounds:
        sel = [(s - t0, d - s, ok) for s, d, ok in results if lo <= s - t0 < hi]
        lat = np.array([d for _, d, ok in sel if ok])
        answered = sum(1 for s, d, ok in results if ok and lo <= d - t0 < hi)
        ticks = [h for h in history if lo <= h[0] < hi]
        served = sum(h[1] for h in ticks)
        met = sum(h[1] * h[2] for h in ticks if h[2] is not None)
        rows.append({
            "policy": name, "phase": phase, "offered_rps": rate, "requests": len(sel),
            "errors": sum(1 for _, _, ok in sel if not ok),
            "p50_ms": round(float(np.percentile(lat, 50)) * 1000, 3) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)) * 1000, 3) if len(lat) else None,
            "throughput_rps": round(answered / (hi - lo), 1),
            "slo_attainment": round(float((lat <= slo).sum()) / len(sel), 4) if sel else None,
            "server_slo_attainment": round(met / served, 4) if served else None,
            "mean_max_batch_size": round(float(np.mean([h[3] for h in ticks])), 2) if ticks else None,
        })
    rows[-1]["rows_per_run"] = round((rows1 - rows0) / (runs1 - runs0), 2) if runs1 > runs0 else None
    rows[-1]["other_load_cores"] = round(other, 2)
    rows[-1]["server_cpu_us_per_request"] = round((srv1 - srv0) / max(1, len(results)) * 1e6, 1)
    rows[-1]["controller_late_ticks"] = loop.late
    rows[-1]["controller_errors"] = loop.errors
    timeline = [[round(t, 2), n, None if a is None else round(a, 3), size] for t, n, a, size in history[::5]]
    return {"rows": rows, "timeline": timeline}


def report(doc: dict) -> str:
    a = doc["args"]
    lines = [
        f"\n## {doc['date']}: batch policies under a changing load (perf/bench_batch_policy.py)\n",
        f"- Machine: {doc['machine']}",
        f"- Code: git {doc['git']}",
        f"- Command: `{doc['command']}`",
        f"- Server: `python -m backends.onnxruntime`, `{MODEL}` (int8 active), configured {CONFIGURED.max_batch_size} rows / "
        f"{CONFIGURED.max_queue_delay_us} us; one ControlLoop per policy (100 ms period, lease 1 s) in the "
        "load generator's process; policies run one after another on the same server process, each after a "
        "reset to the configured setting and 1 s of warm-up.",
        f"- Load: open-loop Poisson, {a['low']:g} -> {a['high']:g} -> {a['low']:g} req/s, {a['phase']:g} s per "
        f"phase, one row per request, binary tensors, HTTP/1.1 keep-alive; SLO: {a['slo_ms']:g} ms (server "
        "time for the policy's input; the client-side attainment counts the loopback hop and client waits).",
        "- Shared machine: other engineers' jobs ran during the measurement; 'other load' is the CPU used "
        "by everything but the server and this process, in cores, per policy.",
        "",
        "| policy | phase | offered/s | req/s | p50 ms | p99 ms | SLO att. (client) | SLO att. (server) | mean max_batch_size | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        offered = "-" if r["offered_rps"] is None else f"{r['offered_rps']:g}"
        att = "-" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f}%"
        satt = "-" if r["server_slo_attainment"] is None else f"{100 * r['server_slo_attainment']:.1f}%"
        lines.append(f"| {r['policy']} | {r['phase']} | {offered} | {r['throughput_rps']:g} | {r['p50_ms']} | "
                     f"{r['p99_ms']} | {att} | {satt} | {r['mean_max_batch_size']} | {r['errors']} |")
    lines.append("")
    for r in doc["rows"]:
        if r["phase"] == "all":
            lines.append(f"- {r['policy']}: rows per session.run {r['rows_per_run']}, server CPU "
                         f"{r['server_cpu_us_per_request']} us/request, other load {r['other_load_cores']} cores, "
                         f"controller late ticks {r['controller_late_ticks']}, errors {r['controller_errors']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 s phases")
    p.add_argument("--phase", type=float, default=15.0, help="seconds per load phase")
    p.add_argument("--low", type=float, default=300.0)
    p.add_argument("--high", type=float, default=1500.0)
    p.add_argument("--slo-ms", type=float, default=2.5, help="latency SLO (a bucket bound of the server's histogram)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.phase = 5.0
    policies = args.policies.split(",")
    for name in policies:
        make_policy(name, CONFIGURED)  # an unknown name fails before anything starts
    with tempfile.TemporaryDirectory(prefix="bench-batch-policy-") as tmp:
        write_fraud_mlp(Path(tmp))
        process, port = start_server(Path(tmp), args.threads)
        base = f"http://127.0.0.1:{port}"
        try:
            payloads = [request_bytes(MODEL, WIDTH, port, seed) for seed in range(64)]
            started = dt.datetime.now(dt.timezone.utc)
            out = [measure_policy(name, base, port, process.pid, payloads, args) for name in policies]
        finally:
            stop(process)
    import onnxruntime

    doc = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; "
                   f"onnxruntime {onnxruntime.__version__}; load average at the end {os.getloadavg()[0]:.1f}",
        "git": benchenv.git_revision(),
        "command": "python perf/bench_batch_policy.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {"phase": args.phase, "low": args.low, "high": args.high, "slo_ms": args.slo_ms},
        "rows": [r for o in out for r in o["rows"]],
        "timeline": {name: o["timeline"] for name, o in zip(policies, out)},
    }
    text = report(doc)
    print(text)
    if not args.no_write:
        RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_JSON.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {RESULTS_JSON.relative_to(REPO)}")
        benchenv.append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
