"""quota: per-tenant CPU use against the limit, throttling, admitted/rejected requests.

Reads the tenant-isolation agent's shared-memory snapshot (ebpf/agent.py writes it every 100 ms):
no eBPF is loaded here, so it runs unprivileged and costs nothing on the traced host. Requests
admitted and rejected per tenant come from the snapshot when the processor fills them, or from the
processor's Prometheus metrics with --metrics-url (metric PROCESSOR_METRIC below).
Overhead: one mmap'd file read per interval.

USAGE: python -m ebpf.quota [-h] [--watch] [--json] [interval] [count]   (also `adapterctl quota`)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from ebpf.programs import source
from ebpf.snapshot import Snapshot, SnapshotReader, snapshot_path

# The processor's per-tenant admission counter this view reads with --metrics-url (extproc/metrics.py).
PROCESSOR_METRIC = "adapter_processor_admission_total"  # labels: tenant, result=admitted|rejected|stale

EXAMPLES = """examples:
    python -m ebpf.quota              # one table from the agent's snapshot
    python -m ebpf.quota 1 10         # a table every second, 10 times
    python -m ebpf.quota --watch 1    # refresh in place every second (Ctrl-C to stop)
    python -m ebpf.quota --json       # the snapshot's tenants as JSON
    python -m ebpf.quota --metrics-url http://127.0.0.1:9902/metrics   # admitted/rejected from the processor
    python -m ebpf.quota --ebpf       # print the BPF program behind the numbers and exit"""


def fetch_requests(url: str, timeout: float = 1.0) -> dict[str, dict[str, float]]:
    """{tenant: {result: count}} from the processor's Prometheus text at `url` ({} on any error)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == PROCESSOR_METRIC and "tenant" in s.labels:
                per = out.setdefault(s.labels["tenant"], {})
                result = s.labels.get("result", "")
                per[result] = per.get(result, 0) + s.value
    return out


def _fmt_count(v) -> str:
    return "-" if v is None else f"{int(v)}"


def render(snap: Snapshot, requests: dict[str, dict[str, float]] | None = None) -> str:
    """The table for one snapshot."""
    age = snap.age_s
    head = (f"{time.strftime('%H:%M:%S')}  source={snap.source}  generation={snap.generation}  "
            f"window={snap.window_s:.1f}s  agent pid={snap.agent_pid}  age={age:.2f}s")
    if snap.stale:
        head += "  STALE" + ("" if snap.agent_alive() else " (agent not running)")
    lines = [head]
    if snap.note:
        lines.append(f"note: {snap.note}")
    cols = f"{'TENANT':<16} {'CPU':>7} {'LIMIT':>7} {'BURST':>6} {'USE%':>7} {'THROTTLED/WIN':>13} " \
           f"{'THROTTLED':>10} {'THR/PERIODS':>13} {'PROCS':>5} {'ADMITTED':>9} {'REJECTED':>9}"
    lines.append(cols)
    for t in snap:
        lim = t.cpu_limit
        req = (requests or {}).get(t.id, {})
        admitted = req.get("admitted", t.admitted or None)
        rejected = req.get("rejected", t.rejected or None)
        flag = " !" if t.over_quota else ""
        lines.append(
            f"{t.id:<16} {t.cpu_used:7.3f} {f'{lim:.3f}' if lim else '-':>7} "
            f"{f'{t.burst:.0%}' if lim else '-':>6} {f'{t.cpu_used / lim:.0%}' if lim else '-':>7} "
            f"{t.throttled_window_ns / 1e9:12.3f}s {t.throttled_ns / 1e9:9.2f}s "
            f"{f'{t.nr_throttled}/{t.nr_periods}':>13} {t.nr_procs:>5} {_fmt_count(admitted):>9} "
            f"{_fmt_count(rejected):>9}{flag}")
    if not snap.tenants:
        lines.append("(no tenants configured)")
    return "\n".join(lines)


def as_json(snap: Snapshot) -> str:
    return json.dumps({"generation": snap.generation, "source": snap.source, "age_s": round(snap.age_s, 3),
                       "stale": snap.stale, "agent_pid": snap.agent_pid, "note": snap.note,
                       "tenants": [t.as_dict() for t in snap]}, default=str)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quota", description="Per-tenant CPU use vs limit, throttling, admitted/rejected "
                                "requests (from the tenant-isolation agent's snapshot).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("interval", nargs="?", type=float, help="seconds between tables (default: print once)")
    p.add_argument("count", nargs="?", type=int, help="number of tables (default: forever with an interval)")
    p.add_argument("--watch", action="store_true", help="redraw in place (default interval 1 s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--name", default="adapter-gateway", help="agent name (default %(default)s)")
    p.add_argument("--snapshot", help="snapshot file (default /dev/shm/adapter-gateway/<name>.snap)")
    p.add_argument("--stale-after", type=float, default=1.0, help="age in s that marks the snapshot stale")
    p.add_argument("--metrics-url", default="http://127.0.0.1:9902/metrics",
                   help="processor /metrics URL for admitted/rejected counts (default: the processor's "
                        "default admin port, %(default)s; '' to skip)")
    p.add_argument("--ebpf", action="store_true", help="print the BPF program and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ebpf:
        print(source("cpu_account"))
        return 0
    path = args.snapshot or snapshot_path(args.name)
    reader = SnapshotReader(path, stale_after_s=args.stale_after, recheck_s=0)
    interval = args.interval if args.interval is not None else (1.0 if args.watch else None)
    count = args.count if args.count is not None else (1 if interval is None else None)
    n = 0
    try:
        while True:
            snap = reader.current()
            if snap is None:
                print(f"quota: no snapshot at {path}; is the agent running? "
                      f"(python -m ebpf.agent --tenants CONFIG)", file=sys.stderr)
                return 1
            requests = fetch_requests(args.metrics_url) if args.metrics_url else None
            out = as_json(snap) if args.json else render(snap, requests)
            if args.watch and not args.json:
                sys.stdout.write("\033[H\033[2J")
            print(out, flush=True)
            n += 1
            if count is not None and n >= count:
                return 0
            if not args.watch and not args.json:
                print()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
