"""Memory probe (issue 12 item 6; not in the suite): is a worker's growth per request or per reload?

What: starts perf/bench_reliability.py's `reliability_stack` (the soak's topology) with ONE worker
traced by extproc/memdebug.py (`ADAPTER_TRACEMALLOC`), warms it up, then runs one phase:
`--requests-for S`: S seconds of tests/e2e/loadgen.py's load on every reliability route, no reload;
`--reloads M`: M reloads cycling test_reliability's kinds of change (perf/soak.py's), a few requests
after each. Before and after the phase it records the worker's RSS (VmRSS) and a tracemalloc
snapshot (SIGUSR2), then prints the RSS change, the traced total and the `--top` allocation sites
that grew most (`--key lineno` or `traceback`; `--frames` deep).
Both phases can be given: requests first, then reloads, each with its own diff.
Run: `.venv/bin/python perf/memprobe.py --requests-for 60` or `--reloads 40` (prints only; writes nothing).
Tracing slows the worker about 2x: the request rate is lower than the soak's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

sys.path.insert(0, str(benchenv.REPO))

import httpx  # noqa: E402

import bench_reliability as br  # noqa: E402
from extproc import memdebug  # noqa: E402
from tests.e2e import test_reliability as rel  # noqa: E402
from tests.e2e.loadgen import Load  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def rss_parts(pid: int) -> str:
    """RssAnon / RssFile / RssShmem (KiB): heap and C allocations vs mapped files (the in-flight table,
    the metrics' and the canary feed's mmap files)."""
    parts = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
            k, v = line.split(":")
            parts[k[3:]] = int(v.split()[0])
    return " ".join(f"{k} {v}" for k, v in parts.items())


def dump(pid: int, out: Path, timeout: float = 60.0) -> Path:
    """SIGUSR2 the worker and wait for its new snapshot file."""
    before = set(out.glob(f"tracemalloc-*-{pid}-*.snap"))
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = set(out.glob(f"tracemalloc-*-{pid}-*.snap")) - before
        if new:
            return new.pop()
        time.sleep(0.1)
    raise TimeoutError(f"worker {pid} wrote no snapshot in {timeout:g} s (is {memdebug.ENV} set?)")


def report(name: str, pid: int, out: Path, snap0: Path, rss0: int, did: str, args) -> tuple[Path, int]:
    time.sleep(2.0)  # let the access-log feedback and the lifecycle sweep finish the last requests
    parts0 = args.parts
    snap1, rss1 = dump(pid, out), rss_kib(pid)
    args.parts = rss_parts(pid)
    import tracemalloc

    total = [sum(s.size for s in tracemalloc.Snapshot.load(str(p)).statistics("filename")) for p in (snap0, snap1)]
    print(f"\n== {name}: {did}\nworker RSS {rss0} KiB -> {rss1} KiB ({rss1 - rss0:+d} KiB); "
          f"traced {total[0] // 1024} KiB -> {total[1] // 1024} KiB ({(total[1] - total[0]) // 1024:+d} KiB)\n"
          f"  RSS parts (KiB) {parts0} -> {args.parts}")
    import json

    m0, m1 = (json.loads(Path(str(p) + ".json").read_text()) for p in (snap0, snap1))
    if m0["mallinfo"] and m1["mallinfo"]:
        print("  malloc (KiB): " + ", ".join(f"{k} {m0['mallinfo'][k] // 1024} -> {m1['mallinfo'][k] // 1024}"
                                             for k in ("arena", "hblkhd", "uordblks", "fordblks")))
    print(f"  Python blocks {m0['pyblocks']} -> {m1['pyblocks']}")
    for line in memdebug.compare(str(snap0), str(snap1), top=args.top, key=args.key):
        print("  " + line)
    return snap1, rss1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests-for", type=float, default=0.0, help="seconds of load without reloads")
    ap.add_argument("--reloads", type=int, default=0, help="reloads with a few requests after each")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the first snapshot")
    ap.add_argument("--only", action="append", default=[], metavar="PATH",
                    help="load only these of the reliability routes' paths (repeatable; default all)")
    ap.add_argument("--envoy-runtime", action="append", default=[], metavar="KEY=VALUE",
                    help="an Envoy runtime value for this run, over the rendered ones (extproc/envoy_render.py "
                         "RUNTIME; repeatable), e.g. envoy.reloadable_features.ext_proc_graceful_grpc_close=true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--key", default="lineno", choices=("lineno", "traceback", "filename"))
    ap.add_argument("--frames", type=int, default=1, help="frames kept per allocation (traceback needs more)")
    args = ap.parse_args(argv)
    if not args.requests_for and not args.reloads:
        ap.error("give --requests-for S and/or --reloads M")
    br.rel = rel
    if args.envoy_runtime:
        from extproc import xds
        from extproc.envoy_render import layered_runtime

        values = {k: {"true": True, "false": False}.get(v, v) for k, v in (a.split("=", 1) for a in args.envoy_runtime)}
        base_of = xds.bootstrap_base
        xds.bootstrap_base = lambda snap: {**base_of(snap), "layered_runtime": layered_runtime(values)}
    made = br.make_stack
    br.make_stack = lambda config, workers=2, **kw: made(config, workers=1, **kw)  # one worker to trace
    procs = br.Procs()
    with tempfile.TemporaryDirectory(prefix="memprobe-") as d:
        out = Path(d) / "snaps"
        os.environ[memdebug.ENV] = str(max(args.frames, 1))  # inherited by the supervisor's worker
        os.environ[memdebug.DIR_ENV] = str(out)
        try:
            st, sims, echoes, cfg, base = br.reliability_stack(Path(d), procs, llm=2)
            spare = rel.Simulator()
            procs.append(spare.proc)
            pid = st.supervisor.workers[0].pid
            with Load(st.url, rel.STEADY) as load:
                time.sleep(args.warmup)
            print(f"warm-up: {load.report.sent} requests in {args.warmup:g} s; worker pid {pid}")
            snap, rss = dump(pid, out), rss_kib(pid)
            args.parts = rss_parts(pid)
            if args.requests_for:
                only = [r for r in rel.STEADY if not args.only or r.path in args.only]
                with Load(st.url, only) as load:
                    time.sleep(args.requests_for)
                r = load.report
                snap, rss = report("requests", pid, out, snap, rss,
                                   f"{r.sent} requests ({r.failed} failed) in {args.requests_for:g} s on "
                                   f"{', '.join(q.path for q in only)}, no reload",
                                   args)
            if args.reloads:
                changes = rel.reload_changes(args.reloads, base, spare.id, echoes[1].id,
                                             tuple(k for k in rel.CHANGES if k != "listener changed"))
                refused = sent = 0
                for _kind, t in changes:
                    rel.write_config(cfg, t)
                    result = st.reload()
                    refused += not result.accepted or bool(result.errors)
                    for req in rel.STEADY:
                        try:
                            httpx.request(req.method, st.url + req.path, content=req.body, timeout=10)
                            sent += 1
                        except httpx.HTTPError:
                            pass
                assert st.supervisor.workers[0].pid == pid, "the worker restarted"
                report("reloads", pid, out, snap, rss, f"{args.reloads} reloads ({refused} refused), "
                       f"{sent} requests (one per route after each)", args)
        finally:
            procs.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
