"""Benchmark: QoS under overload on the simulated fleet, QoS off and on side by side (a benchmark, never a test).

Issue 14 item 7. Every number this prints is a SIMULATOR result (backends/simulator_openai.py
`--latency-model vllm`), never a measurement of vLLM.

Fleet, capacity, load generation and stack: perf/bench_routing.py's, imported (its 8 heterogeneous
simulators, 64 running slots in all, time scale 5: latencies are simulated ms x 5; its `low-sharing`
workload: a 128-token preamble, a unique 1024-token question, 32 output tokens, streamed with usage;
Poisson arrivals through the real Envoy and processor, 1 worker; endpoints picked by `--routing`: by default
bench_routing's `adapter-gateway` scheduling profile (predicted TTFT), or Envoy's least-request balancing).
Capacity is measured first in the same run as bench_routing does for its 50/80/95% loads: a closed loop
of 1.25 x 64 clients through least-request, completed requests per second. Then each policy runs
every load step (default 100%, 110%, 120%, 130%, 140%, 150% of that capacity; 150% is the goal point,
the steps between show whether P2's shed rate rises gradually) on its own stack, with the same arrival
times, tenants and classes (fresh prompt text per cell: no cell finds another's cache).

Traffic: four well-behaved tenants (`tenant-1`..`tenant-4`) with one share each and one noisy tenant
(`noisy`) at 10 shares, so `noisy` sends 10/14 of the requests. Each well-behaved request names its
class in `x-gateway-inference-objective` (P0 20 %, P1 40 %, P2 40 %); the noisy tenant sends no header
and is P1 by its tenant entry. Classes' TTFT SLOs (simulated-and-scaled ms, fixed before any run from
the latency model: the slowest node's unloaded TTFT is about 0.5 s): P0 1 s, P1 2 s, P2 5 s.

Policies (one config each, `qos_config`):
  - `none`: bench_routing's config of `--routing` plus the tenants (`x-tenant-id`): no `spec.qos`, no
    budgets;
  - `qos`: the same plus `spec.qos`: classes from the trusted header and the tenant, the classes'
    SLOs, the class passed to the simulators as vLLM's `priority` (`enginePriority`), the admission
    pool on `pool` (adaptive limit starting at the fleet's 64 slots, queue by class then fair share
    then deadline, P2 sheddable with `--shedding` (default `gradual`: the PIE-style controller of
    extproc/qos/shedding.py, its default parameters; `immediate`: the estimated-wait rule, the
    gateway's default); maxLimit the fleet's running slots (64: `--max-limit`; above them the engines
    queue internally, where no gateway order helps), a reserve of 25 % of the limit for P0's own
    requests (`--reserve`; extproc/qos/queue.py "Reserve"; sized to P0's concurrency: at 150 % P0 holds
    about 17 of the 64 slots, and 12.5 % gave 92-96 % P0 attainment, RESULTS.md 2026-12-02 15:06 and
    after); other settings the defaults: maxWait
    800 ms), the glitch breaker for every tenant (threshold 6 s end to end, about 2x the slowest node's unloaded full-batch
    request), and a token budget for every tenant (per day, large: it counts, it does not refuse here).

Reported per policy, load and class: requests sent, ttft_slo_attainment (requests whose first content
chunk came within their class's TTFT SLO / requests sent: a shed request missed its SLO;
`attainment_served` is over answered ones), shed_rate (429 or 503 answered by the gateway / sent),
goodput_tokens_per_s (output tokens of requests that met their SLO / the measured window's length).
Jain's index: over the well-behaved tenants of x = tenant's goodput tokens / its offered output tokens
(sent x max_tokens): (sum x)^2 / (n sum x^2). Budgets: after a policy's cells, each tenant's day count
in the budget store (`MemoryStore` on the stack's state dir) against the sum of prompt + completion
tokens of the usage chunks its 200 answers carried, over every request the stack served (warm-ups
included: every request is awaited).
Run: `.venv/bin/python perf/bench_qos.py [--quick] [--duration 30] [--warmup 10] [--loads 1,1.1,1.2,1.3,1.4,1.5]
[--capacity R] [--seed N] [--shedding gradual|immediate] [--routing adapter-gateway|least-request] [--reserve F]
[--max-limit N] [--dump FILE] [--out FILE] [--no-write]`. Writes perf/results/qos.json
(and `--out FILE`),
appends a section to perf/RESULTS.md unless --no-write. `--quick`: 2 s warm-up + 6 s measured per cell (the capacity's closed
loop 2 s + 8 s: with 4 s measured it once gave 11.25 req/s where the pool then served 18.5 at 150 %).
Everything it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_routing as br  # noqa: E402

POLICIES = ("none", "qos")
CLASSES = ("P0", "P1", "P2")
LOADS = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)  # 150 % the goal point; the steps between show whether P2 sheds gradually
WELL_BEHAVED = ("tenant-1", "tenant-2", "tenant-3", "tenant-4")
NOISY = "noisy"
SHEDDING = ("gradual", "immediate")  # spec.qos.admission[].shedding.mode of the `qos` policy
SHARES = {**{t: 1.0 for t in WELL_BEHAVED}, NOISY: 10.0}  # the noisy tenant at 10x its share
CLASS_MIX = (("P0", 0.2), ("P1", 0.4), ("P2", 0.4))  # the well-behaved tenants' requests, by header
NOISY_CLASS = "P1"  # by its tenant entry (it sends no header)
TTFT_SLO_S = {"P0": 1.0, "P1": 2.0, "P2": 5.0}  # simulated-and-scaled seconds (time scale 5)
GLITCH_THRESHOLD = "6s"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
TENANT_HEADER = "x-tenant-id"
DAY_BUDGET_TOKENS = 1_000_000_000
WORKLOAD = "low-sharing"
ROW_KEYS = ("policy", "class", "ttft_slo_attainment", "shed_rate", "goodput_tokens_per_s")
RESULTS_JSON = REPO / "perf" / "results" / "qos.json"


# --------------------------------------------------------------------------------------------------
# Configs (pure)
# --------------------------------------------------------------------------------------------------


def qos_config(policy: str, fleet: Sequence[tuple[Any, Any, int]], shedding: str = "gradual",
               reserve: float | None = 0.25, routing: str = "adapter-gateway",
               max_limit: int | None = None) -> dict:
    """The gateway config of `policy` over `fleet`: bench_routing's config of `routing`, the tenants, and
    for `qos` the QoS section (admission: `reserve` for P0, `max_limit` None: the fleet's slots, 0: the
    config's default) and the tenants' budgets."""
    if policy not in POLICIES or shedding not in SHEDDING:
        raise ValueError(f"{policy}/{shedding}")
    doc = copy.deepcopy(br.gateway_config(routing, fleet))
    doc["metadata"]["name"] = f"bench-qos-{policy}"
    spec = doc["spec"]
    spec["routes"][0]["name"] = "api"
    spec["tenants"] = [{"id": t} for t in SHARES]
    if policy == "none":
        return doc
    for t in spec["tenants"]:
        t["budget"] = {"tokensPerDay": DAY_BUDGET_TOKENS}
    spec["qos"] = {
        "defaultClass": "P1",
        "enginePriority": ["pool"],
        "routes": [{"route": "api", "objectiveHeader": OBJECTIVE_HEADER}],
        "tenants": [{"tenant": t, "glitchThreshold": GLITCH_THRESHOLD,
                     **({"priorityClass": NOISY_CLASS} if t == NOISY else {})} for t in SHARES],
        "slos": [{"name": f"ttft-{c.lower()}", "priorityClass": c, "ttft": f"{int(TTFT_SLO_S[c] * 1000)}ms"}
                 for c in CLASSES],
        "admission": [{"backend": "pool", "initialLimit": sum(n.max_num_seqs for n, _, _ in fleet),
                       "sheddable": ["P2"], "shedding": {"mode": shedding},
                       **({"reserve": reserve} if reserve is not None else {}),
                       **({"maxLimit": max_limit} if max_limit else {}),
                       **({} if max_limit is not None else {"maxLimit": sum(n.max_num_seqs for n, _, _ in fleet)})}],
    }
    return doc


# --------------------------------------------------------------------------------------------------
# Traffic (pure)
# --------------------------------------------------------------------------------------------------


def assign(n: int, seed: int) -> list[tuple[str, str, bool]]:
    """(tenant, class, by_header) for n arrivals: tenants by their shares, the well-behaved ones' classes by
    CLASS_MIX (named in the header), the noisy tenant's by its tenant entry."""
    rng = random.Random(seed)
    tenants, weights = list(SHARES), list(SHARES.values())
    out = []
    for _ in range(n):
        t = rng.choices(tenants, weights)[0]
        if t == NOISY:
            out.append((t, NOISY_CLASS, False))
        else:
            out.append((t, rng.choices([c for c, _ in CLASS_MIX], [w for _, w in CLASS_MIX])[0], True))
    return out


def with_headers(reqs: Sequence[br.Req], who: Sequence[tuple[str, str, bool]]) -> list[br.Req]:
    out = []
    for r, (tenant, cls, by_header) in zip(reqs, who):
        h = ((TENANT_HEADER, tenant),) + (((OBJECTIVE_HEADER, cls),) if by_header else ())
        out.append(dataclasses.replace(r, headers=h))
    return out


# --------------------------------------------------------------------------------------------------
# Arithmetic (pure)
# --------------------------------------------------------------------------------------------------


def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one has everything."""
    xs = list(values)
    sq = sum(x * x for x in xs)
    if not xs:
        return None
    if sq == 0:
        return 1.0  # all zero: equal
    return sum(xs) ** 2 / (len(xs) * sq)


@dataclasses.dataclass
class Record:
    """One measured request, as the benchmark judges it."""
    tenant: str
    cls: str
    status: int
    ok: bool
    ttft: float | None  # seconds
    tokens: int  # output tokens (usage)
    max_tokens: int
    usage_total: int | None = None  # prompt + completion tokens of the usage chunk, if one came


def met_slo(r: Record) -> bool:
    return r.ok and r.ttft is not None and r.ttft <= TTFT_SLO_S[r.cls]


def is_shed(r: Record) -> bool:
    return not r.ok and r.status in (429, 503)


def class_rows(policy: str, load: float, records: Sequence[Record], window_s: float) -> list[dict]:
    rows = []
    for c in CLASSES:
        rs = [r for r in records if r.cls == c]
        ok = [r for r in rs if r.ok]
        met = [r for r in rs if met_slo(r)]
        ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
        p99 = br.percentile(ttfts, 99)
        rows.append({"policy": policy, "class": c, "load": load,
                     "ttft_slo_attainment": round(len(met) / len(rs), 4) if rs else None,
                     "shed_rate": round(sum(is_shed(r) for r in rs) / len(rs), 4) if rs else None,
                     "goodput_tokens_per_s": round(sum(r.tokens for r in met) / window_s, 2),
                     "requests": len(rs), "answered": len(ok),
                     "errors": sum(1 for r in rs if not r.ok and not is_shed(r)),
                     "attainment_served": round(len(met) / len(ok), 4) if ok else None,
                     "ttft_slo_ms": int(TTFT_SLO_S[c] * 1000),
                     "ttft_p50_ms": None if not ttfts else round(br.percentile(ttfts, 50), 1),
                     "ttft_p99_ms": None if p99 is None else round(p99, 1)})
    return rows


def tenant_stats(records: Sequence[Record], window_s: float) -> dict[str, dict]:
    out = {}
    for t in SHARES:
        rs = [r for r in records if r.tenant == t]
        good = sum(r.tokens for r in rs if met_slo(r))
        offered = sum(r.max_tokens for r in rs)
        out[t] = {"requests": len(rs), "shed": sum(is_shed(r) for r in rs),
                  "goodput_tokens_per_s": round(good / window_s, 2),
                  "goodput_of_offered": round(good / offered, 4) if offered else None}
    return out


def jain_well_behaved(records: Sequence[Record], cls: str | None = None) -> float | None:
    """Jain's index over the well-behaved tenants of goodput tokens / offered output tokens (of class `cls`
    only when given: the per-class figure separates fairness from each tenant's chance class mix)."""
    xs = []
    for t in WELL_BEHAVED:
        rs = [r for r in records if r.tenant == t and (cls is None or r.cls == cls)]
        offered = sum(r.max_tokens for r in rs)
        if offered:
            xs.append(sum(r.tokens for r in rs if met_slo(r)) / offered)
    return None if not xs else round(jain(xs), 4)


def budget_check(records: Sequence[Record], store_tokens: dict[str, int]) -> dict[str, dict]:
    """Per tenant: the store's count against the sum of usage its answered requests reported."""
    out = {}
    for t, stored in store_tokens.items():
        rs = [r for r in records if r.tenant == t]
        used = sum(r.usage_total or 0 for r in rs if r.ok)
        out[t] = {"store_tokens": stored, "usage_tokens": used, "exact": stored == used,
                  "answered_without_usage": sum(1 for r in rs if r.ok and r.usage_total is None)}
    return out


def document(rows: Sequence[dict], jains: dict[str, dict[float, float | None]], loads: Sequence[float],
             **extra: Any) -> dict:
    """The --out document: `rows` at the highest load (the required ones, with "load" added), every load
    step in `load_steps`, `jain_index` at the highest load per policy, `jain_by_load` beside it."""
    top = max(loads)
    main_rows = [r for r in rows if r["load"] == top]
    return {"rows": main_rows, "jain_index": {p: jains.get(p, {}).get(top) for p in POLICIES},
            "load_steps": list(rows),
            "jain_by_load": {p: {str(k): v for k, v in d.items()} for p, d in jains.items()}, **extra}


def strict_order_p2_shed(load: float) -> float:
    """The least P2 shed rate any policy that serves P0 and P1 before P2 must reach at `load` (x capacity), in
    the fluid limit (no variance, the closed-loop capacity): (load - 1) / (load x P2's share of requests)."""
    total = sum(SHARES.values())
    p2 = sum(v for t, v in SHARES.items() if t in WELL_BEHAVED) / total * dict(CLASS_MIX)["P2"]
    return min(1.0, max(0.0, (load - 1.0) / (load * p2)))


def goals(doc: dict) -> list[str]:
    def mark(ok):
        return "MET" if ok else "NOT MET"

    rows = doc["load_steps"]
    top = max(r["load"] for r in rows)

    def get(p, c, load=top):
        return next((r for r in rows if r["policy"] == p and r["class"] == c and r["load"] == load), None)

    out = []
    p0 = get("qos", "P0")
    if p0 and p0["ttft_slo_attainment"] is not None:
        n0 = get("none", "P0")
        off = "–" if not n0 or n0["ttft_slo_attainment"] is None else f"{n0['ttft_slo_attainment']:.1%}"
        out.append(f"P0 TTFT SLO attainment at {top:.0%} (QoS on): {p0['ttft_slo_attainment']:.1%} of "
                   f"{p0['requests']} (QoS off: {off}); goal >= 95%: "
                   f"{mark(p0['ttft_slo_attainment'] >= 0.95)}")
    steps = sorted({r["load"] for r in rows})
    p2 = [(s, get("qos", "P2", s)) for s in steps]
    rates = [(s, r["shed_rate"]) for s, r in p2 if r and r["shed_rate"] is not None]
    if len(rates) >= 2:
        jumps = [b[1] - a[1] for a, b in zip(rates, rates[1:])]
        txt = ", ".join(f"{s:.0%} {v:.0%}" for s, v in rates)
        floor = ", ".join(f"{s:.0%} {strict_order_p2_shed(s):.0%}" for s, _ in rates)
        big = max(range(len(jumps)), key=lambda i: jumps[i])
        a, b = rates[big][0], rates[big + 1][0]
        forced = strict_order_p2_shed(b) - strict_order_p2_shed(a)
        out.append(f"P2 shed rate over load steps (QoS on): {txt}; goal gradual (criterion: no step up by more than "
                   f"50 points): {mark(max(jumps) <= 0.5)} (the least any P0/P1-first policy must shed, fluid limit: "
                   f"{floor}; the largest step, {a:.0%} -> {b:.0%}: {jumps[big] * 100:+.0f} points measured, "
                   f"{forced * 100:+.0f} of them forced by the workload's floor; shed above the floor per step: "
                   + ", ".join(f"{s:.0%} {(v - strict_order_p2_shed(s)) * 100:+.0f}" for s, v in rates) + ")")
    g = {p: sum(r["goodput_tokens_per_s"] for r in rows if r["policy"] == p and r["load"] == top) for p in POLICIES}
    if all(any(r["policy"] == p for r in rows) for p in POLICIES):
        out.append(f"goodput at {top:.0%} (output tokens/s of requests within their TTFT SLO): QoS on {g['qos']:.1f}, "
                   f"off {g['none']:.1f}; goal not lower: {mark(g['qos'] >= g['none'])}")
    j = doc["jain_index"]
    if j.get("qos") is not None:
        out.append(f"Jain's index across the well-behaved tenants at {top:.0%}: QoS on {j['qos']:.3f}, off "
                   f"{j['none']}; goal >= 0.95: {mark(j['qos'] >= 0.95)}")
    b = doc.get("budgets") or {}
    if b:
        exact = all(v["exact"] for v in b.values())
        detail = ", ".join(f"{t} {v['store_tokens']}/{v['usage_tokens']}" for t, v in b.items())
        out.append(f"budgets (store count / sum of reported usage, per tenant): {detail}: exact to the token: "
                   f"{mark(exact)}")
    return out


def table(rows: Sequence[dict]) -> str:
    lines = ["| load | policy | class | sent | TTFT SLO | attainment (of sent) | of answered | shed | errors | "
             "TTFT p50 | p99 ms | goodput tok/s |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt="g"):
        return "–" if v is None else format(v, fmt)

    for r in sorted(rows, key=lambda r: (r["load"], r["policy"], r["class"])):
        lines.append(f"| {r['load']:.0%} | {r['policy']} | {r['class']} | {r['requests']} | {r['ttft_slo_ms']} ms | "
                     f"{f(r['ttft_slo_attainment'], '.1%')} | {f(r['attainment_served'], '.1%')} | "
                     f"{f(r['shed_rate'], '.1%')} | {r['errors']} | {f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | "
                     f"{r['goodput_tokens_per_s']:g} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------------


def _tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) of `root` and its descendants now, from /proc."""
    parent, cpu = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        parent[int(d)] = int(f[1])
        cpu[int(d)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    mine, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in mine:
                mine.add(c)
                frontier.append(c)
    return sum(cpu.get(p, 0.0) for p in mine)


def _busy_seconds() -> float:
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def other_processes() -> list[str]:
    """The busiest processes outside this benchmark (ps, %CPU over their lifetime), as text."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,ppid,pcpu,etime,comm", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=5).stdout.splitlines()[1:]
    except (OSError, subprocess.TimeoutExpired):
        return []
    me = os.getpid()
    return [" ".join(line.split()) for line in out if int(line.split()[0]) != me][:6]


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------


def _metrics(client, stack) -> dict[str, list[tuple[dict, float]]]:
    try:
        return br._families(client.get(f"{stack.processor_admin_url}/metrics", timeout=5).text)
    except Exception:
        return {}


def _qos_counts(fam: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in fam.get("adapter_qos_queue_requests_total", ()):
        k = f"queue/{labels.get('class')}/{labels.get('result')}"
        out[k] = out.get(k, 0.0) + v
    for labels, v in fam.get("adapter_qos_breaker_trips_total", ()):
        k = f"breaker_trips/{labels.get('tenant')}"
        out[k] = out.get(k, 0.0) + v
    for labels, v in fam.get("adapter_qos_shed_total", ()):
        k = f"breaker_shed/{labels.get('tenant')}"
        out[k] = out.get(k, 0.0) + v
    return out


def _admission_limit(fam: dict) -> float | None:
    """The pool's adaptive concurrency limit as the worker last set it (adapter_qos_admission_limit; QoS on only)."""
    vals = [v for labels, v in fam.get("adapter_qos_admission_limit", ()) if labels.get("pool") == "pool"]
    return max(vals) if vals else None


def run_cell(st, sync, fleet, policy: str, load: float, capacity: float, args, seed: int) -> tuple[list, list]:
    """One load step on `st`: (measured records, every record sent)."""
    rate = load * capacity
    total = args.warmup + args.duration
    arrivals = br.poisson_arrivals(rate, total, seed=zlib.crc32(f"qos/{seed}/{load}".encode()))
    who = assign(len(arrivals), seed=zlib.crc32(f"qos-tenants/{seed}/{load}".encode()))
    reqs = with_headers(br.make_requests(br.SHAPES[WORKLOAD], len(arrivals), salt=f"qos/{policy}/{load}/{seed}",
                                         seed=seed), who)
    br.wait_idle(sync, fleet)
    # measured_from 0: every request is awaited (the budget check needs each one's end); the warm-up
    # requests are dropped below by their send time
    results, t0 = asyncio.run(br.open_loop(st.url + "/v1/chat/completions", reqs, arrivals, 0.0, total,
                                           args.timeout))
    records, measured = [], []
    dump = open(args.dump, "a") if args.dump else None
    for res, (tenant, cls, _) in zip(results, who):
        usage = res.prompt_tokens + res.tokens if res.ok and res.prompt_tokens is not None else None
        rec = Record(tenant, cls, res.status, res.ok, res.ttft, res.tokens if res.ok else 0, res.req.max_tokens,
                     usage)
        records.append(rec)
        if res.start - t0 >= args.warmup:
            measured.append(rec)
            if dump is not None:
                dump.write(json.dumps({
                    "policy": policy, "load": load, "at_s": round(res.start - t0 - args.warmup, 3), "tenant": tenant,
                    "class": cls, "status": res.status, "ok": res.ok,
                    "ttft_ms": round(res.ttft * 1e3, 1) if res.ttft is not None else None,
                    # the node's speed shows in its inter-token latency (step time / speed)
                    "itl_p50_ms": round(br.percentile([x * 1e3 for x in res.itls], 50), 1) if res.itls else None})
                    + "\n")
    if dump is not None:
        dump.close()
    return measured, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 s warm-up + 6 s measured per cell (under 5 min)")
    ap.add_argument("--duration", type=float, default=30.0, help="measured seconds per cell")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--capacity-duration", type=float, default=20.0)
    ap.add_argument("--capacity", type=float, help="skip the capacity measurement: req/s from an earlier run")
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--loads", default=",".join(map(str, LOADS)))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shedding", choices=SHEDDING, default="gradual", help="the qos policy's P2 shedding mode")
    ap.add_argument("--dump", help="append one JSON line per measured request (policy, load, at_s, tenant, class, "
                    "status, ok, ttft_ms, itl_p50_ms) to this file")
    ap.add_argument("--routing", choices=("least-request", "adapter-gateway"), default="adapter-gateway",
                    help="both policies' endpoint picking: Envoy's least-request, or bench_routing's adapter-gateway "
                    "scheduling profile")
    ap.add_argument("--max-limit", type=int, default=None,
                    help="the qos policy's admission maxLimit (default: the fleet's running slots, 64; 0: the config's)")
    ap.add_argument("--reserve", type=float, default=0.25,
                    help="the qos policy's admission reserve for P0 (a fraction of the limit; default: the config's)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--no-write", action="store_true", help="print only: RESULTS.md and results/qos.json untouched")
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.capacity_duration = 6.0, 2.0, 8.0
    loads = [float(x) for x in args.loads.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        assert p in POLICIES, p

    import httpx

    import benchenv
    from extproc.qos.budget_store import MemoryStore
    from extproc.qos.limiter import LimiterParams

    started = time.monotonic()
    load_before = os.getloadavg()
    others_before = other_processes()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-qos-"))
    fleet = br.start_fleet(args.time_scale)
    sync = httpx.Client()
    rows: list[dict] = []
    jains: dict[str, dict[float, float | None]] = {}
    tenants: dict[str, dict] = {}
    jain_classes: dict[str, dict] = {}
    qos_metrics: dict[str, dict] = {}
    budgets: dict[str, dict] = {}
    other_cores: dict[str, float] = {}
    served: dict[str, dict] = {}
    capacity = args.capacity
    try:
        if capacity is None:
            st = br.start_stack("least-request", fleet, run_dir)
            try:
                clients = int(1.25 * sum(n.max_num_seqs for n in br.FLEET))
                reqs = br.make_requests(br.SHAPES[WORKLOAD], 4000, salt="qos-capacity", seed=args.seed)
                capacity = asyncio.run(br.closed_loop(st.url + "/v1/chat/completions", reqs, clients,
                                                      2.0 if args.quick else max(3.0, args.warmup),
                                                      args.capacity_duration, args.timeout))
                print(f"capacity {WORKLOAD}: {capacity:.2f} req/s ({clients} closed-loop clients, least-request)",
                      flush=True)
                br.wait_idle(sync, fleet)
            finally:
                st.stop()
        for policy in policies:
            cfg = qos_config(policy, fleet, args.shedding, args.reserve, args.routing, args.max_limit)
            st = br.start_stack_config(f"qos-{policy}", cfg, run_dir)
            every: list[Record] = []
            try:
                day_before = time.gmtime().tm_yday
                for load in loads:
                    m0 = _qos_counts(_metrics(sync, st))
                    b0, c0, t0 = _busy_seconds(), _tree_cpu_seconds(os.getpid()), time.monotonic()
                    measured, sent = run_cell(st, sync, fleet, policy, load, capacity, args, args.seed)
                    b1, c1, t1 = _busy_seconds(), _tree_cpu_seconds(os.getpid()), time.monotonic()
                    fam1 = _metrics(sync, st)
                    m1 = _qos_counts(fam1)
                    every.extend(sent)
                    key = f"{policy}/{load:g}"
                    other_cores[key] = round(max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0), 2)
                    qos_metrics[key] = {k: v - m0.get(k, 0.0) for k, v in m1.items() if v - m0.get(k, 0.0)}
                    # what the pool served (answered requests of the measured window) against the closed-loop
                    # capacity, and the adaptive limit at the cell's end: an under-admitting limit shows here
                    answered = sum(1 for r in measured if r.ok)
                    served[key] = {"answered_rps": round(answered / args.duration, 3),
                                   "of_capacity": round(answered / args.duration / capacity, 4),
                                   "admission_limit_at_end": _admission_limit(fam1)}
                    cr = class_rows(policy, load, measured, args.duration)
                    rows.extend(cr)
                    jains.setdefault(policy, {})[load] = jain_well_behaved(measured)
                    jain_classes[key] = {c: jain_well_behaved(measured, c) for c in CLASSES}
                    tenants[key] = tenant_stats(measured, args.duration)
                    for r in cr:
                        print(f"{load:5.0%} {policy:4s} {r['class']} n={r['requests']:4d} attain {r['ttft_slo_attainment']} "
                              f"(served {r['attainment_served']}) shed {r['shed_rate']} err {r['errors']} "
                              f"TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms goodput "
                              f"{r['goodput_tokens_per_s']} tok/s", flush=True)
                    print(f"      jain {jains[policy][load]} by class {jain_classes[key]}  other load {other_cores[key]} cores  "
                          f"served {served[key]}  qos {qos_metrics[key]}", flush=True)
                if policy == "qos":
                    time.sleep(1.0)  # reconciliations happen at each request's on_done, after its last byte
                    store = MemoryStore(st.supervisor.feed_dir)
                    try:
                        counts = {t: store.read_sync(t, time.time())[1].tokens for t in SHARES}
                    finally:
                        store.close()
                    budgets = budget_check(every, counts)
                    if time.gmtime().tm_yday != day_before:
                        for v in budgets.values():
                            v["note"] = "the UTC day changed during the run: the store's day window is partial"
                    print(f"budgets: {budgets}", flush=True)
            finally:
                st.stop()
    finally:
        br.stop_fleet(sync, fleet)
    elapsed = time.monotonic() - started
    doc = document(rows, jains, loads, budgets=budgets, tenants=tenants, jain_by_class=jain_classes, qos_metrics=qos_metrics,
                   served=served, shedding=args.shedding, routing=args.routing, reserve=args.reserve,
                   max_limit=(sum(n.max_num_seqs for n, _, _ in fleet) if args.max_limit is None
                              else args.max_limit or None),  # None: the config's default
                   capacity_rps=round(capacity, 3), time_scale=args.time_scale, quick=args.quick,
                   duration_s=args.duration, warmup_s=args.warmup, seed=args.seed, elapsed_s=round(elapsed),
                   shares=SHARES, class_mix=dict(CLASS_MIX), ttft_slo_ms={c: int(s * 1000) for c, s in TTFT_SLO_S.items()},
                   other_load_cores=other_cores, load_average_at_start=[round(x, 2) for x in load_before],
                   note="simulator results (backends/simulator_openai.py --latency-model vllm, time scale "
                        f"{args.time_scale:g}), not measurements of vLLM; measured on a shared machine")
    tbl = table(rows)
    checked = goals(doc)
    benchenv.report(tbl, checked, elapsed, json.dumps(doc, indent=1), args.out, args.no_write, RESULTS_JSON)
    if not args.no_write:
        cmd = "perf/bench_qos.py " + " ".join(argv if argv is not None else sys.argv[1:])
        # per cell, while its stack ran: over the whole run the CPU of stacks already stopped (no longer in
        # this process tree) would count as other processes'
        other_avg = sum(other_cores.values()) / len(other_cores) if other_cores else 0.0
        benchenv.append_results(
            f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: QoS under overload, off and on "
            f"(perf/bench_qos.py)\n\n"
            f"- machine: {benchenv.cpu()}, SHARED with other engineers' jobs; code {benchenv.git_revision()}; "
            f"`.venv/bin/python {cmd.strip()}` ({elapsed:.0f} s)\n"
            f"- load average at the start: {' / '.join(f'{x:.1f}' for x in load_before)} (1/5/15 min); other "
            f"processes' CPU: {other_avg:.2f} cores, the mean over the cells (machine busy time minus this "
            f"benchmark's process tree while each cell ran), per cell {other_cores}; busiest other processes at the start (ps: pid "
            f"ppid %cpu elapsed command): {'; '.join(others_before)}\n"
            f"- SIMULATOR results (backends/simulator_openai.py `--latency-model vllm`, time scale "
            f"{args.time_scale:g}: latencies are simulated ms x {args.time_scale:g}), not measurements of vLLM.\n"
            f"- fleet and workload: perf/bench_routing.py's 8 simulators and `{WORKLOAD}`; capacity "
            + ("(given with --capacity) " if args.capacity else "(closed loop, least-request, this run) ")
            + f"{capacity:.2f} req/s; loads {', '.join(f'{x:.0%}' for x in loads)} of it, Poisson, per cell "
            f"{args.warmup:g} s warm-up + {args.duration:g} s measured"
            + (" (`--quick`: few P0 requests per cell, NOT final numbers)" if args.quick else "") + ".\n"
            f"- tenants: 4 well-behaved at 1 share (P0/P1/P2 20/40/40 % by header), `noisy` at 10 shares (P1 by "
            f"tenant); TTFT SLOs P0 1 s, P1 2 s, P2 5 s (scaled). Both policies' routing: `{args.routing}`. "
            f"QoS off: no spec.qos, no budgets; on: classes, "
            f"enginePriority, admission pool (initialLimit 64, shedding `{args.shedding}`, reserve {args.reserve}, "
            f"maxLimit {'the default' if args.max_limit == 0 else args.max_limit or 'the fleet slots (64)'}, defaults otherwise: "
            f"tolerance {LimiterParams().tolerance:g}, samples {LimiterParams().samples}), "
            f"glitch breaker {GLITCH_THRESHOLD} "
            f"per tenant, day token budgets.\n"
            f"- attainment = requests within their class's TTFT SLO / requests sent (shed = missed); goodput = output "
            f"tokens of those / window length; Jain over the well-behaved tenants of goodput / offered tokens.\n"
            f"- served (requests of the measured window answered, however late, / s and % of capacity: for `none` the "
            f"offered rate; QoS on: those not shed, and the pool's adaptive limit at the cell's end): " + "; ".join(
                f"{k} {v['answered_rps']:.2f} req/s {v['of_capacity']:.0%}"
                + (f" limit {v['admission_limit_at_end']:g}" if v["admission_limit_at_end"] is not None else "")
                for k, v in served.items()) + "\n\n"
            f"{tbl}\n\nGoals of issue 14 item 7 (this run):\n\n" + "\n".join("- " + g for g in checked) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
