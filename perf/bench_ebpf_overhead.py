"""Cost of the tenant-isolation probes: context-switch and TCP ping-pong with and without them loaded.

What it measures, side by side in one run (alternating off/on rounds so drift hits both alike):
  1. pipe ping-pong: two processes pinned to one CPU bounce a byte over two pipes; every round trip
     is two context switches, so the round-trip time with cpu_account.bpf.c (sched:sched_switch)
     loaded minus without, halved, is the probe's cost per context switch.
  2. TCP ping-pong over loopback (1-byte echo, TCP_NODELAY): tcp_rtt.bpf.c (tcp:tcp_probe) off; on
     but watching another port (the in-kernel filter path every segment pays); on and watching the
     echo port (a histogram and a stats update per segment).
  3. the agent's own loop: CPU time of one Agent.step() (eBPF reads, cgroup files, snapshot write)
     for a few tenants, and the snapshot read a processor worker does per request.
The ping-pongs are C, built with the host's cc (gcc comes with the kernel-headers packages), else
Python. Each pipe mode runs both outside any tenant and inside a tenant's cgroups (the program does
more work for a tenant's task; the cgroups themselves also cost, hence an "off" run in them too).
Best round per mode is reported: load from other processes only ever adds time. With
kernel.bpf_stats_enabled switched on for one extra run, it also reads the time spent inside each
program per event (/proc/self/fdinfo run_time_ns / run_cnt): the steadiest number on a busy host.
It also samples the host's context-switch rate (/proc/stat ctxt) to turn ns/switch into CPU share.
Results are printed and appended to perf/RESULTS.md (a dated section; --no-write to skip).

Run as root with BCC set up (scripts/setup-ebpf.sh):
    .venv/bin/python perf/bench_ebpf_overhead.py [--duration 1] [--rounds 5] [--no-write]   (about 1 min)
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script\'s folder, on sys.path)
from extproc.stack import free_port  # noqa: E402

PIPE_PINGPONG = r"""
import os, sys, time
secs, cpu = float(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, {cpu})
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    while True:
        b = os.read(r1, 1)
        if not b or b == b"q":
            os._exit(0)
        os.write(w2, b)
n = 0
end = time.perf_counter() + secs
t0 = time.perf_counter()
while True:
    for _ in range(1000):
        os.write(w1, b"x"); os.read(r2, 1)
    n += 1000
    if time.perf_counter() >= end:
        break
dt = time.perf_counter() - t0
os.write(w1, b"q"); os.waitpid(pid, 0)
print(n, dt)
"""

PINGPONG_C = r"""
/* ping-pong: `pingpong pipe SECS CPU` or `pingpong tcp SECS CPU PORT`; prints "round_trips seconds" */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static void echo(int rfd, int wfd) {
    char c;
    for (;;) { if (read(rfd, &c, 1) != 1 || c == 'q') _exit(0); if (write(wfd, &c, 1) != 1) _exit(1); }
}
int main(int argc, char **argv) {
    int tcp = strcmp(argv[1], "tcp") == 0;
    double secs = atof(argv[2]); int cpu = atoi(argv[3]);
    cpu_set_t set; CPU_ZERO(&set); CPU_SET(cpu, &set); sched_setaffinity(0, sizeof set, &set);
    int wfd, rfd, one = 1; char c = 'x'; pid_t pid;
    if (tcp) {
        struct sockaddr_in a; memset(&a, 0, sizeof a);
        a.sin_family = AF_INET; a.sin_port = htons(atoi(argv[4])); a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int srv = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(srv, (struct sockaddr *)&a, sizeof a) || listen(srv, 1)) return 1;
        if ((pid = fork()) == 0) {
            int s = accept(srv, NULL, NULL);
            setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            echo(s, s);
        }
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s, (struct sockaddr *)&a, sizeof a)) return 1;
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        wfd = rfd = s;
    } else {
        int p1[2], p2[2];
        if (pipe(p1) || pipe(p2)) return 1;
        if ((pid = fork()) == 0) echo(p1[0], p2[1]);
        wfd = p1[1]; rfd = p2[0];
    }
    long n = 0; double t0 = now(), end = t0 + secs, t;
    do {
        for (int i = 0; i < 2000; i++) { c = 'x'; if (write(wfd, &c, 1) != 1 || read(rfd, &c, 1) != 1) return 1; }
        n += 2000;
    } while ((t = now()) < end);
    c = 'q'; if (write(wfd, &c, 1) != 1) return 1; waitpid(pid, NULL, 0);
    printf("%ld %.9f\n", n, t - t0);
    return 0;
}
"""

TCP_PINGPONG = r"""
import os, socket, sys, time
secs, cpu, port = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.sched_setaffinity(0, {cpu})
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(1)
pid = os.fork()
if pid == 0:
    c, _ = srv.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1)
        if not b or b == b"q":
            os._exit(0)
        c.sendall(b)
cli = socket.create_connection(("127.0.0.1", port)); cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
n = 0
end = time.perf_counter() + secs
t0 = time.perf_counter()
while True:
    for _ in range(200):
        cli.sendall(b"x"); cli.recv(1)
    n += 200
    if time.perf_counter() >= end:
        break
dt = time.perf_counter() - t0
cli.sendall(b"q"); os.waitpid(pid, 0)
print(n, dt)
"""


def compile_c(tmp: Path) -> str | None:
    """Build the C ping-pongs with the host's cc (gcc comes with the kernel-headers packages); None if no cc."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src, exe = tmp / "pingpong.c", tmp / "pingpong"
    src.write_text(PINGPONG_C)
    p = subprocess.run([cc, "-O2", "-o", str(exe), str(src)], capture_output=True, text=True)
    return str(exe) if p.returncode == 0 else None


def run_child(code: str, *args, cgroup_dirs=()) -> float:
    """Microseconds per round trip. `code`: Python source, or the path of the C ping-pong binary.
    cgroup_dirs: cgroups the child joins before exec (to run it as a tenant's process)."""
    cmd = [code] if code.startswith("/") else [sys.executable, "-c", code]

    def join():
        for d in cgroup_dirs:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    out = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, check=True, timeout=120,
                         preexec_fn=join if cgroup_dirs else None).stdout.split()
    n, dt = int(out[0]), float(out[1])
    return dt / n * 1e6


def ctxt_rate(seconds: float = 2.0) -> float:
    def ctxt():
        for line in open("/proc/stat"):
            if line.startswith("ctxt "):
                return int(line.split()[1])
        return 0
    a, t0 = ctxt(), time.monotonic()
    time.sleep(seconds)
    return (ctxt() - a) / (time.monotonic() - t0)


def machine() -> str:
    bcc_ver = "?"
    try:
        bcc_ver = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-bpfcc"], capture_output=True,
                                 text=True).stdout.strip() or "?"
    except OSError:
        pass
    return (f"{benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; "
            f"BCC (python3-bpfcc) {bcc_ver}")


def prog_stats(bpf) -> tuple[int, int]:
    """(run_cnt, run_time_ns) summed over a BCC object's programs, from /proc/self/fdinfo."""
    cnt = ns = 0
    for fn in bpf.funcs.values():
        for line in open(f"/proc/self/fdinfo/{fn.fd}"):
            k, _, v = line.partition(":")
            if k == "run_cnt":
                cnt += int(v)
            elif k == "run_time_ns":
                ns += int(v)
    return cnt, ns


def in_program_ns(make, run) -> float | None:
    """Mean ns spent inside the BPF program per event, with kernel.bpf_stats_enabled on for one run."""
    knob = Path("/proc/sys/kernel/bpf_stats_enabled")
    try:
        old = knob.read_text().strip()
        knob.write_text("1")
    except OSError:
        return None
    prog = make()
    try:
        c0, n0 = prog_stats(prog.bpf)
        run()
        c1, n1 = prog_stats(prog.bpf)
    finally:
        prog.close()
        knob.write_text(old)
    return (n1 - n0) / (c1 - c0) if c1 > c0 else None


def _ns(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f} ns"


def cpu_time() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: .venv/bin/python perf/bench_ebpf_overhead.py --duration 1 --rounds 5")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per measurement (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="off/on alternations per mode (default %(default)s)")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin ping-pongs to (default: the last one)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave perf/RESULTS.md alone")
    args = ap.parse_args(argv)

    from ebpf.cgroups import CgroupManager, TenantSpec
    from ebpf.programs import CpuAccounting, TcpRtt, ebpf_unavailable
    why = ebpf_unavailable()
    if why:
        print(f"bench_ebpf_overhead: eBPF cannot load here ({why}); nothing measured", file=sys.stderr)
        return 2
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    print(f"machine: {machine()}; ping-pongs pinned to CPU {cpu}", flush=True)

    t0 = time.monotonic()
    prog = CpuAccounting()
    compile_cpu_s = time.monotonic() - t0
    prog.close()
    build = Path(tempfile.mkdtemp(prefix="agw-bench-"))
    exe = compile_c(build)
    pingpong, tcp_pingpong = (exe, exe) if exe else (PIPE_PINGPONG, TCP_PINGPONG)
    kind = "C" if exe else "Python (no cc found: the fixed per-round-trip cost is mostly the interpreter)"

    try:
        # 1. pipe ping-pong: sched_switch probe off / on, ping-pong outside any tenant and inside one
        mgr = CgroupManager(f"agw-bench-{uuid.uuid4().hex[:6]}")
        pipe = {"off": [], "on": [], "tenant_off": [], "tenant": []}
        try:
            mgr.apply([TenantSpec("bench")])
            tenant_dirs = [str(d) for d in mgr.paths("bench").dirs()]
            for _ in range(args.rounds):
                pipe["off"].append(run_child(pingpong, "pipe", args.duration, cpu))
                pipe["tenant_off"].append(run_child(pingpong, "pipe", args.duration, cpu, cgroup_dirs=tenant_dirs))
                prog = CpuAccounting()
                try:
                    pipe["on"].append(run_child(pingpong, "pipe", args.duration, cpu))
                    pipe["tenant"].append(run_child(pingpong, "pipe", args.duration, cpu, cgroup_dirs=tenant_dirs))
                finally:
                    prog.close()
                print(f"  pipe round trip us: off {pipe['off'][-1]:.2f}  on {pipe['on'][-1]:.2f}  in a tenant: "
                      f"off {pipe['tenant_off'][-1]:.2f}  on {pipe['tenant'][-1]:.2f}", flush=True)
            short = min(args.duration, 1.0)
            switch_prog_ns = in_program_ns(CpuAccounting, lambda: run_child(pingpong, "pipe", short, cpu))
            switch_prog_tenant_ns = in_program_ns(
                CpuAccounting, lambda: run_child(pingpong, "pipe", short, cpu, cgroup_dirs=tenant_dirs))
        finally:
            mgr.close(remove=True)

        # 2. TCP ping-pong: tcp_probe off / on (other port) / on (this port)
        tcp = {"off": [], "filtered": [], "watched": []}
        t0 = time.monotonic()
        rtt = TcpRtt(ports=[1])
        compile_rtt_s = time.monotonic() - t0
        rtt.close()
        for _ in range(args.rounds):
            port = free_port()
            tcp["off"].append(run_child(tcp_pingpong, "tcp", args.duration, cpu, port))
            rtt = TcpRtt(ports=[1])
            try:
                tcp["filtered"].append(run_child(tcp_pingpong, "tcp", args.duration, cpu, free_port()))
                port = free_port()
                rtt.set_ports([port])
                tcp["watched"].append(run_child(tcp_pingpong, "tcp", args.duration, cpu, port))
            finally:
                rtt.close()
            print(f"  tcp round trip us: off {tcp['off'][-1]:.2f}  filtered {tcp['filtered'][-1]:.2f}  "
                  f"watched {tcp['watched'][-1]:.2f}", flush=True)

        tcp_port = free_port()
        probe_prog_ns = in_program_ns(lambda: TcpRtt(ports=[tcp_port]),
                                      lambda: run_child(tcp_pingpong, "tcp", min(args.duration, 1.0), cpu, tcp_port))
    finally:
        shutil.rmtree(build, ignore_errors=True)

    # 3. the agent's loop and the worker's snapshot read
    from ebpf.agent import Agent
    from ebpf.snapshot import SnapshotReader
    name = f"agw-bench-{uuid.uuid4().hex[:6]}"
    tmp = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    agent = Agent([TenantSpec(f"t{i}", 0.5) for i in range(4)], name=name, mode="ebpf", rtt_ports=[8000],
                  snapshot=tmp / "b.snap")
    try:
        agent.start()
        steps = 200
        c0 = cpu_time()
        for _ in range(steps):
            agent.step()
        step_us = (cpu_time() - c0) / steps * 1e6
        reader = SnapshotReader(tmp / "b.snap")
        n = 50000
        reader.current().tenant("t0").cpu_used
        t = time.perf_counter()
        for _ in range(n):
            v = reader.current().tenant("t0")
            v.over_quota, v.cpu_used, v.cpu_limit
        read_us = (time.perf_counter() - t) / n * 1e6
    finally:
        agent.close(remove_cgroups=True, remove_snapshot=True)
        tmp.rmdir()
    rate = ctxt_rate()

    # best of the rounds: other load on the host only ever adds time, so the minimum is the cleanest estimate
    med = {k: min(v) for k, v in pipe.items()}
    tmed = {k: min(v) for k, v in tcp.items()}
    per_switch_ns = (med["on"] - med["off"]) / 2 * 1000
    per_switch_tenant_ns = (med["tenant"] - med["tenant_off"]) / 2 * 1000
    pct = lambda a, b: (a - b) / b * 100  # noqa: E731
    share = rate * per_switch_ns / 1e9 * 100
    lines = [
        f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: bench_ebpf_overhead (eBPF probes loaded vs not)",
        "",
        f"- Machine: {machine()}",
        f"- Code: git {benchenv.git_revision('ebpf', 'perf')}",
        f"- Command: `{' '.join(['python perf/bench_ebpf_overhead.py', *(argv if argv is not None else sys.argv[1:])])}` "
        f"({args.rounds} alternating off/on rounds of {args.duration:g} s per mode; best round shown; ping-pong pairs "
        f"pinned to CPU {cpu}; ping-pongs in {kind})",
        f"- Compile + load: cpu_account.bpf.c {compile_cpu_s:.2f} s, tcp_rtt.bpf.c {compile_rtt_s:.2f} s (clang, once at agent start)",
        "",
        "| benchmark | probes | us per round trip | vs off | round trips/s |",
        "|---|---|---:|---:|---:|",
        f"| pipe ping-pong (2 context switches / round trip) | off | {med['off']:.2f} | | {1e6 / med['off']:,.0f} |",
        f"| pipe ping-pong | sched_switch accounting on | {med['on']:.2f} | {pct(med['on'], med['off']):+.1f}% | {1e6 / med['on']:,.0f} |",
        f"| pipe ping-pong in a tenant's cgroups | off | {med['tenant_off']:.2f} | | {1e6 / med['tenant_off']:,.0f} |",
        f"| pipe ping-pong in a tenant's cgroups | sched_switch accounting on | {med['tenant']:.2f} | {pct(med['tenant'], med['tenant_off']):+.1f}% | {1e6 / med['tenant']:,.0f} |",
        f"| TCP 1-byte echo on loopback | off | {tmed['off']:.2f} | | {1e6 / tmed['off']:,.0f} |",
        f"| TCP 1-byte echo | tcp_probe on, port not watched | {tmed['filtered']:.2f} | {pct(tmed['filtered'], tmed['off']):+.1f}% | {1e6 / tmed['filtered']:,.0f} |",
        f"| TCP 1-byte echo | tcp_probe on, port watched | {tmed['watched']:.2f} | {pct(tmed['watched'], tmed['off']):+.1f}% | {1e6 / tmed['watched']:,.0f} |",
        "",
        f"Per context switch the sched_switch program costs about **{per_switch_ns:.0f} ns** end to end "
        f"((on - off) / 2) for tasks outside tenants and **{per_switch_tenant_ns:.0f} ns** for a tenant's tasks; "
        f"inside the program (kernel.bpf_stats_enabled, which itself adds two clock reads) {_ns(switch_prog_ns)} "
        f"and {_ns(switch_prog_tenant_ns)}. tcp_probe on a watched port: {_ns(probe_prog_ns)} in the program per "
        f"received segment. This host switched {rate:,.0f} times/s while idle-ish, which at that cost is "
        f"{share:.2f}% of one CPU; at 100,000 switches/s it would be {100_000 * per_switch_ns / 1e7:.1f}% "
        f"({100_000 * per_switch_tenant_ns / 1e7:.1f}% if all were a tenant's).",
        f"The agent's loop costs {step_us:.0f} us of CPU per 100 ms step with 4 tenants and RTT on "
        f"({step_us / 1e3:.1f}% of one CPU at 10 steps/s); a worker's admission read of the snapshot "
        f"(`current().tenant(id)`, three fields) costs {read_us:.2f} us.",
        "End-to-end differences are small against the noise of a shared host (compare the raw rounds); "
        "the in-program times are the steadier figure, and an upper bound on the program's own work.",
        f"Raw rounds (us): pipe off {[round(x, 2) for x in pipe['off']]}, on {[round(x, 2) for x in pipe['on']]}, "
        f"in a tenant off {[round(x, 2) for x in pipe['tenant_off']]}, on {[round(x, 2) for x in pipe['tenant']]}; "
        f"tcp off {[round(x, 2) for x in tcp['off']]}, filtered {[round(x, 2) for x in tcp['filtered']]}, "
        f"watched {[round(x, 2) for x in tcp['watched']]}.",
    ]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if not args.no_write:
        results = REPO / "perf" / "RESULTS.md"
        with open(results, "a") as f:
            f.write("\n" + text)
        print(f"appended to {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
