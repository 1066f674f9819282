"""Benchmark: what reading the tenant agent's snapshot costs the processor, in microseconds.

What it measures, in one process on one core (no agent, no kernel programs: a snapshot written
by `ebpf.snapshot.SnapshotWriter` into a temporary folder, /dev/shm when there is one, as the
agent does):

* the admission check's read: `reader.current().tenant(id)` and the four fields `Admit` looks
  at (over_quota, cpu_used, cpu_limit, stale), on a snapshot already mapped (the reader re-stats
  the file at most every 5 ms, so almost every request costs this);
* `current()` when it re-stats the file every call (`recheck_s=0`): the upper bound per request;
* the first read of a new snapshot (open, mmap and index of a fresh reader), what a request pays
  once per agent publication;
* the agent's side: encode and publish one snapshot (`SnapshotWriter.write`), for 2 and 100 tenants.

Each figure is the median over timeit repeats of the time per call, the minimum beside it (the
figure least disturbed by other processes). Prints a table and, unless --no-write, appends a dated
section to perf/RESULTS.md (append only: other benchmarks write there too). These numbers used to
be a unit test's threshold (tests/ebpf/test_snapshot.py: "under 50 µs"); a benchmark reports them
instead of passing or failing on them.

    .venv/bin/python perf/bench_snapshot.py              # measure and append
    .venv/bin/python perf/bench_snapshot.py --no-write   # measure and print only
    .venv/bin/python perf/bench_snapshot.py --quick      # 3 short repeats (a look, not a record)

Cost: about 15 s (2 s with --quick). Needs the `flatbuffers` package (a project dependency).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import timeit
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

from ebpf.snapshot import SnapshotData, SnapshotReader, SnapshotWriter, TenantSample, UpstreamSample  # noqa: E402



def snapshot_data(tenants: int) -> SnapshotData:
    """`tenants` tenants (the first is "acme", over its quota) and two upstreams, as the agent writes."""
    samples = [TenantSample("acme", cpu_used=0.25, cpu_limit=0.2, burst=0.1, usage_ns=123456789,
                            throttled_ns=5_000_000, nr_periods=50, nr_throttled=7, throttled_window_ns=1000,
                            window_start_mono_ns=10, window_end_mono_ns=20, cgroup_id=42, cgroup_v2="/v2/acme",
                            cgroup_cpu="/cpu/acme", nr_procs=3)]
    samples += [TenantSample(f"tenant-{i:03d}", cpu_used=0.1, cpu_limit=1.0, usage_ns=i, cgroup_id=100 + i,
                             cgroup_v2=f"/v2/tenant-{i:03d}") for i in range(tenants - 1)]
    upstreams = [UpstreamSample("10.0.0.5", 8000, 2, hist=[0, 0, 3, 9, 1], count=13, sum_us=70, last_srtt_us=4,
                                window_count=2, window_mean_us=3.5),
                 UpstreamSample("::1", 8443, 10, hist=[1] * 32, count=32, sum_us=1 << 20)]
    return SnapshotData(tenants=samples, upstreams=upstreams, source="ebpf", note="bench",
                        interval_ns=100_000_000, window_ns=1_000_000_000)


def measure(fn: Callable[[], Any], repeats: int, target_s: float) -> tuple[float, float]:
    """(median, min) microseconds per call of ``fn``, with the garbage collector on as in the
    processor (timeit turns it off; each new reader's mapping is freed by the collector)."""
    timer = timeit.Timer(fn, setup="import gc; gc.enable()")
    number, elapsed = timer.autorange()
    number = max(1, int(number * target_s / max(elapsed, 1e-9)))
    runs = [t / number * 1e6 for t in timer.repeat(repeat=repeats, number=number)]
    return statistics.median(runs), min(runs)


def cases(folder: Path) -> list[tuple[str, Callable[[], Any]]]:
    path = folder / "bench.snap"
    writer = SnapshotWriter(path)
    writer.write(snapshot_data(2))
    reader = SnapshotReader(path)
    reader.current().tenant("acme").cpu_used  # mapped and indexed once, as after the first request

    def admission_read():
        t = reader.current().tenant("acme")
        return t.over_quota, t.cpu_used, t.cpu_limit, reader.current().stale

    restat = SnapshotReader(path, recheck_s=0)
    restat.current()

    def first_read():
        t = SnapshotReader(path).current().tenant("acme")
        return t.cpu_used, t.cpu_limit, t.burst

    small, large = snapshot_data(2), snapshot_data(100)
    writer_small = SnapshotWriter(folder / "small.snap")
    writer_large = SnapshotWriter(folder / "large.snap")
    return [
        ("admission read (current, tenant, 4 fields)", admission_read),
        ("current() re-statting the file every call", restat.current),
        ("first read of a new snapshot (open + mmap + index)", first_read),
        ("agent: encode and publish, 2 tenants", lambda: writer_small.write(small)),
        ("agent: encode and publish, 100 tenants", lambda: writer_large.write(large)),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="3 repeats of about 0.05 s each")
    args = ap.parse_args(argv)
    repeats, target = (3, 0.05) if args.quick else (7, 0.3)
    shm = Path("/dev/shm")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-", dir=shm if shm.is_dir() else None) as tmp:
        for label, fn in cases(Path(tmp)):
            med, best = measure(fn, repeats, target)
            rows.append((label, med, best))
            print(f"{label:55s} {med:9.2f} µs (min {best:.2f})", flush=True)
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    table = ["| what | µs per call (median) | min |", "|---|---:|---:|"]
    table += [f"| {label} | {m:.2f} | {b:.2f} |" for label, m, b in rows]
    if not args.no_write:
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python perf/bench_snapshot.py" + (" --quick" if args.quick else "")
        text = f"""
## {now}: bench_snapshot (reading the tenant agent's snapshot)

- Machine: {benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; load average {load}
- Code: git {benchenv.git_revision()}
- Command: `{command}` (median of {repeats} timeit repeats of about {target:g} s each, one process, one core)

{chr(10).join(table)}
"""
        benchenv.append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
