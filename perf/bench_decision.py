"""Benchmark: what one scheduling decision costs (`SchedulingProfile.pick`), back to back and after idle.

What it measures, in one process, no Envoy, no simulators: the decision of the benchmark fleet's
profiles (perf/bench_routing.py: `gateway_config(policy, fleet)` for the 8-endpoint FLEET on fake
ports, compiled by `extproc.config.loader.load_text`), with the worker's own objects around it:
a `Runtime` whose in-flight table is an `InflightTable` on a temporary directory (mmap-backed, as in
the worker), an `ExtProcService` with `ProcessorMetrics` on a private `CollectorRegistry` (so the
framework's per-plugin and per-decision `perf_counter_ns` timing and its buffered histogram observes
are included, as in the worker), and an `EngineSignals` holding, for every endpoint, the sample a
scrape of the simulator's exposition text gives (tests/data/metrics/simulator.txt: queue 2, KV 0.054,
LoRA finance-lora running; its model renamed to bench_routing's, which the fleet serves) on the real monotonic clock, refreshed before every decision so it
never goes stale. Requests are bench_routing's `shared-prefix` workload (16 groups of 2048-token
system prompts, 256-token questions, 2 turns, 2 LoRA groups; fresh text per condition), each parsed
by `parse_openai` into its own `RequestState` before it is timed. After each pick its endpoint's
in-flight count is taken (`inflight.started`, as dispatch does); once 4 later picks have been made
the request ends: its first token is marked (`state.first_body`, and its pending prefill leaves the
in-flight table: `dispatch.prefilled`) and it is released (`dispatch.release`), so a few requests are
always in flight and no plugin's per-request state grows without bound.

Per policy (`--policies`, default epp-default, adapter-gateway, random; round-robin and
least-request have no picker, the oracle asks live simulators) it reports the decision's p50 and
p90 in microseconds (`perf_counter_ns` around `pick`) under each `--idle-ms` condition: 0 = back to
back, N = `time.sleep(N ms)` before every decision (default 0, 1, 30); and, back to back, each
plugin's own p50, timed call by call the way the profile runs them (context, each filter, each
scorer's `score`, the normalisation of all scorers together, the picker, each `picked` hook).

Why: on this 2-core VM the same decision costs about 45 us back to back but about 170-220 us when
the process slept ~30 ms before it, and the latter is what the processor's own
`adapter_processor_scheduler_decision_duration_seconds` shows inside perf/bench_routing.py, where
requests reach a worker ~70 ms apart. Nothing in the decision changes; the CPU does: while the
process sleeps the vCPU idles (this VM's cpuidle driver is haltpoll: the guest halts and the
hypervisor may run other work on the physical core, or idle it and lower its clock; the guest has
no cpufreq of its own), the interpreter's and the plugins' code and data leave the caches and the
branch predictors forget, so the first tens of microseconds of Python after waking run at a
fraction of their warm speed (even the random picker's 3 us decision costs ~50 us after 30 ms of
sleep). 1 ms of sleep costs much less than 30 ms. So a decision p50 from a paced
benchmark is the cold-CPU cost, an in-process loop's is the warm cost, and both are right for
their setting: compare policies only under the same condition, and expect a loaded gateway
(requests back to back) to see figures near the warm ones.

Run:
    .venv/bin/python perf/bench_decision.py                      # measure, write JSON and RESULTS.md
    .venv/bin/python perf/bench_decision.py --no-write           # print only
    .venv/bin/python perf/bench_decision.py --policies adapter-gateway --idle-ms 0,30 --requests 500
Options: `--requests N` decisions per condition (default 300), `--idle-ms` (default 0,1,30),
`--policies`, `--out FILE` (JSON; default perf/results/decision.json, not written with
--no-write unless --out is given), `--no-write` (RESULTS.md and the default JSON untouched).
Cost: about 35 s with the defaults (the 30 ms sleeps are 3 x 300 x 30 ms = 27 s of it), well
under 60 s; needs only the project venv. Run it on a quiet machine (it records the load average
and whether perf/bench_routing.py was running): other processes make the idle figures meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br  # noqa: E402
import benchenv  # noqa: E402

POLICIES = ("epp-default", "adapter-gateway", "random")  # bench_routing's policies that have a profile
RESULTS_JSON = REPO / "perf" / "results" / "decision.json"
SIMULATOR_METRICS = REPO / "tests" / "data" / "metrics" / "simulator.txt"
IN_FLIGHT = 4  # picks whose in-flight count is held until this many later picks (a few requests in flight)
WORKLOAD = "shared-prefix"


@dataclass
class Bench:
    policy: str
    snap: Any
    runtime: Any
    service: Any
    scheduler: Any  # extproc.scheduling.profile.SchedulingProfile
    backend: Any
    route: Any
    endpoints: tuple[str, ...]
    signals: Any
    held: deque

    def refresh(self) -> None:
        """What the scraper keeps doing in the worker: every endpoint's sample fresh."""
        now = time.monotonic()
        for st in self.signals._states.values():
            st.scraped_at = now

    def states(self, n: int, salt: str) -> list:
        from extproc.request import parse_openai
        from extproc.types import RequestState

        out = []
        for i, r in enumerate(br.make_requests(br.SHAPES[WORKLOAD], n, salt=salt)):
            st = RequestState(snapshot=self.snap, route=self.route, started=time.monotonic(),
                              request_id=f"{salt}-{i}", runtime=self.runtime)
            st.request = parse_openai("/v1/chat/completions", {"model": r.model, "messages": list(r.messages),
                                                               "max_tokens": r.max_tokens, "stream": True})
            out.append(st)
        return out

    def dispatched(self, picks: tuple[str, ...], state: Any = None) -> None:
        """Dispatch's in-flight count for the pick (`extproc.stages.dispatch.dispatched`: the request,
        its tokens and its pending prefill); the oldest held request ends."""
        from extproc.stages.dispatch import dispatched

        if not picks:
            return
        if state is not None:
            dispatched(state, picks[0])
        else:
            self.runtime.inflight.started(picks[0])
        self.held.append((picks[0], state))
        if len(self.held) > IN_FLIGHT:
            self.end(*self.held.popleft())

    def end(self, endpoint: str, state: Any) -> None:
        """A held request got its first token (its pending prefill leaves the in-flight table, as the
        stream's first response body does) and finished (the lifecycle's release)."""
        from extproc.stages.dispatch import prefilled, release
        from extproc.types import Outcome

        if state is None:
            self.runtime.inflight.finished(endpoint)
            return
        if state.first_body is None:
            state.first_body = time.monotonic()
            prefilled(state)
        release(state, Outcome.OK)

    def release_all(self) -> None:
        while self.held:
            self.end(*self.held.popleft())

    def close(self) -> None:
        self.release_all()
        for inst in list(self.runtime._plugins.values()):
            close = getattr(inst, "close", None)
            if close is not None:
                close()


def build(policy: str, state_dir: str) -> Bench:
    from prometheus_client import CollectorRegistry

    from extproc.config.loader import load_text
    from extproc.datalayer.engine_metrics import parse_metrics
    from extproc.metrics import ProcessorMetrics
    from extproc.runtime import Runtime
    from extproc.scheduling.signals import EngineSignals
    from extproc.stream import ConfigRef, ExtProcService

    fleet = [(node, None, 9000 + i) for i, node in enumerate(br.FLEET)]
    snap = load_text(json.dumps(br.gateway_config(policy, fleet)), f"bench-{policy}.yaml")
    rt = Runtime(state_dir=state_dir)  # the worker's InflightTable, mmap'd under state_dir
    svc = ExtProcService(ConfigRef(snap), ProcessorMetrics(CollectorRegistry()), runtime=rt)
    route = next(iter(snap.routes.values()))
    backend = snap.backends["pool"]
    endpoints = tuple(backend.endpoint_ids)
    # tests/extproc/scheduling/signal_fleet.py's fleet(rt, {e: recorded(SIMULATOR)}), on the real clock
    # the recorded sample names the simulator's default model; bench_routing's fleet serves br.MODEL, so
    # a base-model request must find it there (else lora-affinity-scorer takes it for an adapter)
    sample = dataclasses.replace(parse_metrics("vllm", SIMULATOR_METRICS.read_text()), models=(br.MODEL,))
    sig = EngineSignals(clock=time.monotonic, inflight=rt.inflight.get)
    sig.update({e: (f"http://{e}/metrics", "vllm") for e in endpoints})
    for e in endpoints:
        st = sig._states[e]
        st.interval = 0.2
        st.sample, st.scraped_at = sample, time.monotonic()
    rt.signals = sig
    sched = rt.plugin(route.picker)
    b = Bench(policy, snap, rt, svc, sched, backend, route, endpoints, sig, deque())
    probe = b.states(1, "probe")[0]
    b.refresh()  # the samples are stale after 0.8 s (4 intervals): building the probe can take that long loaded
    picks = b.scheduler.pick(probe, backend, endpoints)  # a config that cannot decide fails here
    assert picks and picks[0] in endpoints, (policy, picks)
    b.dispatched(picks, probe)
    return b


def pct(ns: list[int], q: float) -> float:
    """The q-th percentile (nearest rank on the sorted sample) in microseconds."""
    s = sorted(ns)
    return round(s[min(len(s) - 1, int(len(s) * q / 100))] / 1000, 1)


def decisions(b: Bench, n: int, salt: str, idle_s: float) -> list[int]:
    """`n` timed picks, each after `idle_s` seconds of sleep (0: back to back)."""
    states = b.states(n, salt)
    gc.collect()
    sched, backend, endpoints = b.scheduler, b.backend, b.endpoints
    out = []
    for st in states:
        b.refresh()
        if idle_s:
            time.sleep(idle_s)
        t0 = perf_counter_ns()
        picks = sched.pick(st, backend, endpoints)
        out.append(perf_counter_ns() - t0)
        b.dispatched(picks, st)
    b.release_all()
    return out


def plugin_times(b: Bench, n: int, salt: str) -> dict[str, float]:
    """Each plugin's p50 (us), back to back, called as SchedulingProfile.pick calls it (no explain)."""
    from extproc.scheduling import SchedulingContext
    from extproc.scheduling import profile as prof

    sched, backend, rt = b.scheduler, b.backend, b.runtime
    acc: dict[str, list[int]] = {}

    def add(key: str, ns: int) -> None:
        acc.setdefault(key, []).append(ns)

    states = b.states(n, salt)
    gc.collect()
    for st in states:
        b.refresh()
        t0 = perf_counter_ns()
        ctx = SchedulingContext(st, backend, st.request, rt, backend.endpoint_labels, sched.name)
        add("context", perf_counter_ns() - t0)
        cands = tuple(b.endpoints)
        for name, f in sched.filters:
            t0 = perf_counter_ns()
            kept = f.filter(ctx, cands)
            add(name, perf_counter_ns() - t0)
            keep = kept if isinstance(kept, (set, frozenset, dict)) else set(kept)
            cands = tuple(e for e in cands if e in keep)
        if not cands:
            continue
        tot = [0.0] * len(cands)
        norm_ns = 0
        for name, scorer, weight, bounded in sched.scorers:
            t0 = perf_counter_ns()
            raw = scorer.score(ctx, cands)
            t1 = perf_counter_ns()
            if not prof.accumulate(tot, raw, cands, weight, bounded):
                norm = prof.normalise(raw, cands, bounded)
                for i, e in enumerate(cands):
                    tot[i] += weight * norm[e]
            norm_ns += perf_counter_ns() - t1
            add(name, t1 - t0)
        if sched.scorers:
            add("normalise", norm_ns)
        name, picker = sched.picker
        ranked = getattr(picker, "pick_ranked", None)
        t0 = perf_counter_ns()
        picks = tuple(ranked(ctx, cands, tot) if ranked is not None else picker.pick(ctx, dict(zip(cands, tot))))
        add(name, perf_counter_ns() - t0)
        if picks:
            for name, _slot, hook in sched.hooks:
                t0 = perf_counter_ns()
                hook(ctx, picks[0])
                add(f"{name}.picked", perf_counter_ns() - t0)
        b.dispatched(picks, st)
    b.release_all()
    return {k: pct(v, 50) for k, v in acc.items()}


def quiet() -> tuple[float, bool]:
    """(1-min load average, whether a perf/bench_routing.py process runs)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    try:
        routing = subprocess.run(["pgrep", "-f", "bench_routing"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        routing = False
    return load, routing


def fmt_us(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    ap.add_argument("--idle-ms", default="0,1,30", help="sleep before every decision, per condition (0: back to back)")
    ap.add_argument("--requests", type=int, default=300, help="decisions per condition")
    ap.add_argument("--out", help="write the JSON here (default perf/results/decision.json unless --no-write)")
    ap.add_argument("--no-write", action="store_true", help="print only: RESULTS.md and the default JSON untouched")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"policy {p!r}: one of {', '.join(POLICIES)}")
    idles = [float(x) for x in args.idle_ms.split(",") if x.strip()]
    if not idles or any(x < 0 for x in idles) or args.requests < 1:
        ap.error("need --idle-ms values >= 0 and --requests >= 1")

    started = time.monotonic()
    load_before, routing_before = quiet()
    rows: list[dict] = []
    plugins: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-decision-") as tmp:
        for policy in policies:
            b = build(policy, str(Path(tmp) / policy))
            try:
                decisions(b, min(args.requests, 100), f"{policy}/warmup", 0.0)
                for idle in idles:
                    ns = decisions(b, args.requests, f"{policy}/idle{idle:g}", idle / 1000)
                    rows.append({"policy": policy, "idle_ms": idle, "decision_p50_us": pct(ns, 50),
                                 "decision_p90_us": pct(ns, 90)})
                    print(f"{policy:16s} idle {idle:5g} ms  decision p50 {rows[-1]['decision_p50_us']:7.1f} us  "
                          f"p90 {rows[-1]['decision_p90_us']:7.1f} us", flush=True)
                plugins[policy] = plugin_times(b, args.requests, f"{policy}/plugins")
                print(f"{policy:16s} plugins (p50 us, back to back): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in plugins[policy].items()), flush=True)
            finally:
                b.close()
    load_after, routing_after = quiet()
    elapsed = time.monotonic() - started
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = benchenv.cpu()
    git = benchenv.git_revision()
    doc = {"rows": rows, "plugins": plugins, "machine": machine, "date": now, "git": git,
           "requests": args.requests, "workload": WORKLOAD, "in_flight_held": IN_FLIGHT,
           "load_average_1m": [round(load_before, 2), round(load_after, 2)],
           "bench_routing_running": routing_before or routing_after, "elapsed_s": round(elapsed, 1)}
    print(f"elapsed {elapsed:.1f} s; load average {load_before:.2f} -> {load_after:.2f}"
          + ("; perf/bench_routing.py was running" if doc["bench_routing_running"] else ""))
    out = Path(args.out) if args.out else (None if args.no_write else RESULTS_JSON)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
    if not args.no_write:
        benchenv.append_results(results_text(doc, idles, policies, argv, platform.python_version()))
    return 0


def results_text(doc: dict, idles: list[float], policies: list[str], argv: list[str] | None, python: str) -> str:
    by = {(r["policy"], r["idle_ms"]): r for r in doc["rows"]}
    cols = ["back to back" if i == 0 else f"after {i:g} ms sleep" for i in idles]
    lines = ["| policy | " + " | ".join(f"{c} p50 / p90 µs" for c in cols) + " |",
             "|---|" + "---:|" * len(idles)]
    for p in policies:
        lines.append(f"| {p} | " + " | ".join(f"{fmt_us(by[(p, i)]['decision_p50_us'])} / "
                                              f"{fmt_us(by[(p, i)]['decision_p90_us'])}" for i in idles) + " |")
    plug = ["| policy | plugin p50 µs, back to back (sum) |", "|---|---|"]
    for p in policies:
        items = doc["plugins"][p]
        plug.append(f"| {p} | " + ", ".join(f"{k} {v:.1f}" for k, v in items.items())
                    + f" ({sum(items.values()):.1f}) |")
    l0, l1 = doc["load_average_1m"]
    busy = l0 >= 0.5 or l1 >= 0.5 or doc["bench_routing_running"]
    cond = (f"load average (1 min) {l0:.2f} at the start, {l1:.2f} at the end"
            + ("; perf/bench_routing.py was running" if doc["bench_routing_running"] else "; no bench_routing running")
            + (": NOT a quiet machine, the idle figures are disturbed" if busy else ": quiet"))
    ratio = []
    if 0 in idles:
        for p in policies:
            warm = by[(p, 0)]["decision_p50_us"]
            cold = [(i, by[(p, i)]["decision_p50_us"]) for i in idles if i]
            if warm and cold:
                ratio.append(f"{p} " + ", ".join(f"x{v / warm:.1f} after {i:g} ms" for i, v in cold))
    cmd = "perf/bench_decision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return (f"\n## {doc['date']}: scheduling decision cost, back to back and after idle (perf/bench_decision.py)\n\n"
            f"- machine: {doc['machine']}; Python {python}; code {doc['git']}\n"
            f"- command: `.venv/bin/python {cmd.strip()}` ({doc['elapsed_s']:g} s); {doc['requests']} decisions per "
            f"condition on the {doc['workload']} workload, bench_routing's 8-endpoint fleet, recorded simulator "
            f"samples, {doc['in_flight_held']} requests held in flight; `SchedulingProfile.pick` timed in process "
            f"with the framework's metrics on\n"
            f"- {cond}\n\n" + "\n".join(lines) + "\n\n" + "\n".join(plug) + "\n\n"
            + (f"The decision's p50 after sleeping against back to back: {'; '.join(ratio)}. The code is the same; "
               f"after a sleep the vCPU has idled and the first microseconds of Python run on cold caches, branch "
               f"predictors and clock. perf/bench_routing.py's processor sees its requests ~70 ms apart, so its "
               f"decision p50 (from the processor's own histogram) is the after-sleep figure, not the back-to-back "
               f"one; compare policies only under the same condition.\n" if ratio else ""))


if __name__ == "__main__":
    sys.exit(main())
