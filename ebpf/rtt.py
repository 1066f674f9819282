"""rtt: per-upstream TCP smoothed-RTT histograms, bcc tcprtt style.

By default reads the tenant-isolation agent's shared-memory snapshot (the agent runs the
tcp:tcp_probe program, ebpf/tcp_rtt.bpf.c, for the configured upstream ports): unprivileged, no
extra probe. With --direct it loads tcp_rtt.bpf.c itself (root, BCC) for the given --ports, as
bcc's tcprtt does. With an interval, each histogram is the samples of that interval; without,
everything since the agent (or --direct) started.
Overhead: snapshot mode, one file read per interval. --direct: one hash lookup per received TCP
segment on the host, plus two map updates for segments of watched ports (see ebpf/README.md).

USAGE: python -m ebpf.rtt [-h] [--direct --ports P,..] [interval] [count]   (also `adapterctl rtt`)
"""

from __future__ import annotations

import argparse
import sys
import time

from ebpf.programs import source
from ebpf.snapshot import SnapshotReader, snapshot_path

EXAMPLES = """examples:
    python -m ebpf.rtt                    # histograms since the agent started
    python -m ebpf.rtt 1 5                # per-second histograms, 5 times
    python -m ebpf.rtt -u 10.0.0.5:8000   # only that upstream
    python -m ebpf.rtt --direct --ports 8000,8001 1 5   # load the probe here (root), no agent needed
    python -m ebpf.rtt --ebpf             # print the BPF program and exit"""


def format_log2_hist(hist, val_type: str = "usecs") -> str:
    """bcc's print_log2_hist layout: slot i counts [2^(i-1), 2^i) (slot 0: zero)."""
    last = max((i for i, v in enumerate(hist) if v), default=-1)
    if last < 0:
        return f"     {val_type:<19} : count     distribution\n     (no samples)"
    vmax = max(hist)
    lines = [f"     {val_type:<19} : count     distribution"]
    first = min(i for i, v in enumerate(hist) if v)
    for i in range(min(first, 1), last + 1):
        low, high = (0, 0) if i == 0 else ((1 << i) >> 1, (1 << i) - 1)
        stars = int(hist[i] * 40 / vmax) if vmax else 0
        lines.append(f"{low:>10} -> {high:<10} : {hist[i]:<8} |{'*' * stars:<40}|")
    return "\n".join(lines)


def _snapshot_hists(reader: SnapshotReader) -> dict[str, dict] | None:
    snap = reader.current()
    if snap is None:
        return None
    return {u.endpoint: {"hist": list(u.hist), "count": u.count, "sum_us": u.sum_us, "last": u.last_srtt_us}
            for u in snap.upstreams}


def _direct_hists(prog) -> dict[str, dict]:
    out = {}
    for (addr, port), st in prog.read().items():
        ep = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        out[ep] = {"hist": list(st.hist), "count": st.count, "sum_us": st.sum_us, "last": st.last_us}
    return out


def _delta(cur: dict, prev: dict | None) -> dict:
    if not prev:
        return cur
    out = {}
    for ep, c in cur.items():
        p = prev.get(ep)
        if p is None:
            out[ep] = c
            continue
        out[ep] = {"hist": [a - b for a, b in zip(c["hist"], p["hist"])], "count": c["count"] - p["count"],
                   "sum_us": c["sum_us"] - p["sum_us"], "last": c["last"]}
    return out


def render(hists: dict[str, dict], only: str | None = None) -> str:
    blocks = []
    for ep in sorted(hists):
        if only and ep != only:
            continue
        h = hists[ep]
        n = sum(h["hist"])
        avg = h["sum_us"] / h["count"] if h["count"] else 0
        blocks.append(f"Remote Address:Port = {ep}  (samples {n}, avg {avg:.0f} us, last {h['last']} us)\n"
                      + format_log2_hist(h["hist"]))
    return "\n\n".join(blocks) if blocks else "(no upstream RTT samples)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtt", description="Per-upstream TCP smoothed RTT histograms (tcp:tcp_probe).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("interval", nargs="?", type=float, help="seconds per histogram (default: since start, once)")
    p.add_argument("count", nargs="?", type=int, help="number of intervals (default: forever with an interval)")
    p.add_argument("-u", "--upstream", help="only this ADDR:PORT ([v6]:port for IPv6)")
    p.add_argument("--name", default="adapter-gateway", help="agent name (default %(default)s)")
    p.add_argument("--snapshot", help="snapshot file (default /dev/shm/adapter-gateway/<name>.snap)")
    p.add_argument("--direct", action="store_true", help="load the probe here instead of reading the agent")
    p.add_argument("--ports", help="with --direct: remote ports to watch, e.g. 8000,8001 (default: all)")
    p.add_argument("--ebpf", action="store_true", help="print the BPF program and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ebpf:
        print(source("tcp_rtt"))
        return 0
    prog = None
    if args.direct:
        from ebpf.programs import EbpfUnavailable, TcpRtt, ebpf_unavailable

        why = ebpf_unavailable()
        if why:
            print(f"rtt: cannot load eBPF: {why}", file=sys.stderr)
            return 1
        try:
            prog = TcpRtt(ports=[int(p) for p in args.ports.split(",")] if args.ports else None)
        except (EbpfUnavailable, ValueError) as e:
            print(f"rtt: {e}", file=sys.stderr)
            return 1
        read = lambda: _direct_hists(prog)  # noqa: E731
        if args.interval is None:
            print("Tracing TCP RTT... Hit Ctrl-C to end.", file=sys.stderr)
    else:
        path = args.snapshot or snapshot_path(args.name)
        reader = SnapshotReader(path, recheck_s=0)
        read = lambda: _snapshot_hists(reader)  # noqa: E731
    try:
        prev = None
        if args.interval is None:
            if prog is not None:
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
            cur = read()
            if cur is None:
                print(f"rtt: no snapshot at {path}; is the agent running with --rtt-ports?", file=sys.stderr)
                return 1
            print(render(cur, args.upstream))
            return 0
        prev = read()
        if prev is None:
            print(f"rtt: no snapshot at {path}; is the agent running with --rtt-ports?", file=sys.stderr)
            return 1
        n = 0
        while args.count is None or n < args.count:
            time.sleep(args.interval)
            cur = read() or prev
            print(time.strftime("%H:%M:%S"))
            print(render(_delta(cur, prev), args.upstream), flush=True)
            print()
            prev, n = cur, n + 1
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if prog is not None:
            prog.close()


if __name__ == "__main__":
    sys.exit(main())
