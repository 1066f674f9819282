"""Tenant-isolation agent: per-tenant cgroups and CPU limits, CPU use and TCP RTT, one snapshot.

What: every `interval` (100 ms) the agent
  1. repairs tenant cgroups removed underneath it (CgroupManager.check),
  2. reads each tenant's cumulative CPU time: from the sched_switch eBPF program (on-CPU ns per v2
     cgroup, plus slices still running) or, when eBPF cannot load (not root, no BCC, no headers,
     no tracefs) or `mode="poll"`, from the kernel's cgroup counters (cpuacct.usage, else v2
     cpu.stat usage_usec), with ONE warning saying why,
  3. computes CPU use over a sliding `window` (1 s) and reads CFS throttling counters,
  4. reads the tcp_probe srtt histograms of the configured upstream ports (eBPF only),
  5. publishes a FlatBuffers snapshot to /dev/shm/adapter-gateway/<name>.snap for the processor
     workers (ebpf/snapshot.py) and updates its Prometheus collector (ebpf/metrics.py).
Tenant changes apply without restart: `reload(tenants)` (SIGHUP re-reads --tenants) diff-applies
cgroups and limits; an invalid set is refused (QuotaError) and the running one stays.
Cost: see ebpf/README.md (probe overhead per context switch; the agent's own loop is a few map
reads and cgroup file reads per tenant per interval).

Run:  python -m ebpf.agent --tenants CONFIG.yaml --rtt-ports 8000 --metrics-port 9478
(as root; `python -m ebpf.agent -h` for every option).
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ebpf.cgroups import ROOT_NAME, CgroupManager, QuotaError, TenantSpec
from ebpf.programs import (HIST_SLOTS, CpuAccounting, EbpfUnavailable, TcpRtt, ebpf_unavailable, source,
                           tenant_of_tid)
from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample, UpstreamSample, snapshot_path
from ebpf.tenants import config_snapshot_path, load_tenants

log = logging.getLogger("ebpf.agent")


@dataclass
class _Tenant:
    spec: TenantSpec
    cgroup_id: int = 0
    last_raw: int | None = None     # last cumulative counter read (eBPF or kernel), for deltas
    total_ns: int = 0               # sum of positive deltas: monotonic across counter resets
    samples: deque = field(default_factory=deque)  # (t_ns, total_ns, throttled_ns)


@dataclass
class _Remote:
    samples: deque = field(default_factory=deque)  # (t_ns, count, sum_us)


class Agent:
    """The agent loop; `start()`, then `run(stop_event)` or `step()` repeatedly; `close()`.

    tenants     TenantSpec list (ebpf.tenants.load_tenants / tenants_from build one)
    name        cgroup root name and snapshot name (default adapter-gateway)
    snapshot    snapshot file (default /dev/shm/adapter-gateway/<name>.snap)
    interval    seconds between samples (0.1); window: sliding window for cpu_used (1.0)
    mode        "auto" (eBPF, else poll with one warning), "ebpf" (EbpfUnavailable if it cannot),
                "poll" (cgroup counters only; warns once that eBPF is off)
    rtt_ports   None: no RTT program; "all": every remote port; else the upstream ports to watch
    metrics_port  serve Prometheus metrics (own registry) on metrics_addr:metrics_port; None: off
    """

    def __init__(self, tenants: Iterable[TenantSpec], *, name: str = ROOT_NAME, snapshot: str | Path | None = None,
                 interval: float = 0.1, window: float = 1.0, mode: str = "auto", rtt_ports=None,
                 cgroups: CgroupManager | None = None, metrics_port: int | None = None,
                 metrics_addr: str = "127.0.0.1"):
        if mode not in ("auto", "ebpf", "poll"):
            raise ValueError(f"mode must be auto, ebpf or poll, not {mode!r}")
        if interval <= 0 or window < interval:
            raise ValueError("interval must be > 0 and window >= interval")
        self.name = name
        self.interval = interval
        self.window = window
        self.mode = mode
        self.rtt_ports = rtt_ports
        self.snapshot_path = Path(snapshot) if snapshot else snapshot_path(name)
        self.cgroups = cgroups or CgroupManager(name)
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self._specs = list(tenants)
        self.tenants: dict[str, _Tenant] = {}
        self.remotes: dict[tuple[str, int], _Remote] = {}
        self.cpu: CpuAccounting | None = None
        self.rtt: TcpRtt | None = None
        self.source = "none"
        self.note = ""
        self.writer: SnapshotWriter | None = None
        self.last: SnapshotData | None = None
        self.recreated_events: list[dict[str, list[str]]] = []
        self._metrics_server = None
        self._warned = False
        self._last_scan = 0.0
        self._lock = threading.Lock()

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Agent":
        self.reload(self._specs)  # validates and creates the cgroups (QuotaError before any write)
        reason = "polling forced (mode=poll)" if self.mode == "poll" else ebpf_unavailable()
        if reason is None and self.cgroups.layout.v2 is None:
            reason = "no cgroup v2 hierarchy to attribute CPU time to tenants"
        if reason is None:
            try:
                self.cpu = CpuAccounting(tenant_level=self._tenant_level())
            except EbpfUnavailable as e:
                reason = str(e)
        if reason is not None:
            if self.mode == "ebpf":
                raise EbpfUnavailable(reason)
            self.source = "poll"
            self._warn_once(f"eBPF unavailable ({reason}): polling cgroup CPU counters every "
                            f"{self.interval * 1000:.0f} ms instead; no per-upstream RTT")
        else:
            self.source = "ebpf"
            if self.rtt_ports is not None:
                try:
                    ports = None if self.rtt_ports == "all" else list(self.rtt_ports)
                    self.rtt = TcpRtt(ports=ports)
                except EbpfUnavailable as e:
                    self.note = f"RTT off: {e}"
                    log.warning("%s", self.note)
        self.writer = SnapshotWriter(self.snapshot_path)
        if self.metrics_port is not None:
            from ebpf.metrics import serve
            self._metrics_server = serve(self, self.metrics_port, self.metrics_addr)
        self.step()
        log.info("agent ready: source=%s tenants=%s snapshot=%s%s", self.source, sorted(self.tenants),
                 self.snapshot_path, f" metrics=:{self.metrics_port}" if self.metrics_port is not None else "")
        return self

    def _tenant_level(self) -> int:
        # depth of <v2 root>/<name>/<tenant>: 2 for the default "adapter-gateway/<tenant>"
        return len(Path(self.name).parts) + 1

    def _warn_once(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            self.note = msg
            log.warning("%s", msg)

    def reload(self, tenants: Iterable[TenantSpec]) -> None:
        """Diff-apply a new tenant set (QuotaError, and no change, if any tenant is invalid)."""
        specs = list(tenants)
        with self._lock:
            self.cgroups.apply(specs)
            self._specs = specs
            keep = {}
            for spec in specs:
                st = self.tenants.get(spec.id) or _Tenant(spec)
                st.spec = spec
                cid = self.cgroups.cgroup_id(spec.id)
                if cid != st.cgroup_id:  # new or recreated cgroup: its counters start again
                    st.cgroup_id, st.last_raw = cid, None
                keep[spec.id] = st
            self.tenants = keep

    def close(self, remove_cgroups: bool = False, remove_snapshot: bool = False) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        for prog in (self.cpu, self.rtt):
            if prog is not None:
                prog.close()
        self.cpu = self.rtt = None
        if self.writer is not None:
            self.writer.close(remove=remove_snapshot)
        self.cgroups.close(remove=remove_cgroups)

    def run(self, stop: threading.Event | None = None, before_step=None) -> None:
        """Sample every `interval` (fixed rate; missed ticks are skipped) until `stop` is set.

        before_step: optional callable run in the loop before each sample (main() uses it to apply
        a SIGHUP reload between samples, never inside one).
        """
        stop = stop or threading.Event()
        nxt = time.monotonic()
        while not stop.is_set():
            try:
                if before_step is not None:
                    before_step()
                self.step()
            except Exception:  # one bad sample must not end the agent
                log.exception("agent step failed")
            nxt += self.interval
            delay = nxt - time.monotonic()
            if delay < 0:
                nxt, delay = time.monotonic(), 0
            stop.wait(delay)

    # --- one sample --------------------------------------------------------------------------------
    def _raw_usage(self) -> dict[str, int | None]:
        if self.cpu is None:
            return {tid: self.cgroups.usage_ns(tid) for tid in self.tenants}
        totals = self.cpu.totals()            # committed slices first, then the running ones:
        running = self.cpu.running()          # a slice ending in between is missed once, never
        now = time.monotonic_ns()             # counted twice (the next read has it)
        inflight: dict[str, int] = {}
        prefix = "/" + self.name
        for start, tid in running:
            t = tenant_of_tid(tid, prefix)
            if t is not None and now > start:
                inflight[t] = inflight.get(t, 0) + now - start
        return {tid: totals.get(st.cgroup_id, 0) + inflight.get(tid, 0) if st.cgroup_id else None
                for tid, st in self.tenants.items()}

    def step(self) -> SnapshotData:
        with self._lock:
            return self._step()

    def _place_named_processes(self) -> None:
        """Put processes whose command line matches a tenant's `processes` patterns in its cgroups.

        Scans /proc at most once a second (about a millisecond for a few hundred processes); a
        process already there is left alone, so a move happens once per new process."""
        now = time.monotonic()
        if now - self._last_scan < 1.0:
            return
        self._last_scan = now
        wanted = [(st.spec.id, st.spec.processes) for st in self.tenants.values() if st.spec.processes]
        if not wanted:
            return
        placed = {tid: set(self.cgroups.procs(tid)) for tid, _ in wanted}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            except OSError:
                continue
            if not cmdline:
                continue
            for tid, patterns in wanted:
                if pid not in placed[tid] and any(fnmatch.fnmatch(cmdline, p) for p in patterns):
                    if self.cgroups.place(tid, pid, missing_ok=True):
                        log.info("placed pid %d (%s) in tenant %s", pid, cmdline[:80], tid)
                    break

    def _step(self) -> SnapshotData:
        self._place_named_processes()
        recreated = self.cgroups.check()
        if recreated:
            self.recreated_events.append(recreated)
            for tid in recreated:
                st = self.tenants[tid]
                st.cgroup_id, st.last_raw = self.cgroups.cgroup_id(tid), None
        raw = self._raw_usage()
        now = time.monotonic_ns()
        win_ns = int(self.window * 1e9)
        samples = []
        for tid, st in self.tenants.items():
            r = raw.get(tid)
            if r is not None:
                if st.last_raw is not None and r > st.last_raw:
                    st.total_ns += r - st.last_raw
                st.last_raw = r if st.last_raw is None else max(st.last_raw, r)
            thr = self.cgroups.throttle(tid)
            st.samples.append((now, st.total_ns, thr.throttled_ns))
            while len(st.samples) > 2 and st.samples[1][0] <= now - win_ns:
                st.samples.popleft()
            t0, u0, th0 = st.samples[0]
            dt = now - t0
            spec = st.spec
            paths = self.cgroups.paths(tid)
            samples.append(TenantSample(
                id=tid,
                cpu_used=(st.total_ns - u0) / dt if dt > 0 else 0.0,
                cpu_limit=spec.cpu_limit or 0.0,
                burst=spec.burst,
                usage_ns=st.total_ns,
                throttled_ns=thr.throttled_ns,
                nr_periods=thr.nr_periods,
                nr_throttled=thr.nr_throttled,
                throttled_window_ns=max(0, thr.throttled_ns - th0),
                window_start_mono_ns=t0,
                window_end_mono_ns=now,
                cgroup_id=st.cgroup_id,
                cgroup_v2=str(paths.v2 or ""),
                cgroup_cpu=str(self.cgroups.limit_dir(tid) or ""),
                nr_procs=len(set(self.cgroups.procs(tid))),
                recreated=self.cgroups.recreated.get(tid, 0),
            ))
        data = SnapshotData(tenants=samples, upstreams=self._upstreams(now, win_ns), source=self.source,
                            note=self.note, interval_ns=int(self.interval * 1e9), window_ns=win_ns,
                            agent_pid=os.getpid(), written_mono_ns=now)
        if self.writer is not None:
            self.writer.write(data)
        self.last = data
        return data

    def _upstreams(self, now: int, win_ns: int) -> list[UpstreamSample]:
        if self.rtt is None:
            return []
        out = []
        for key, st in sorted(self.rtt.read().items()):
            rem = self.remotes.setdefault(key, _Remote())
            rem.samples.append((now, st.count, st.sum_us))
            while len(rem.samples) > 2 and rem.samples[1][0] <= now - win_ns:
                rem.samples.popleft()
            _, c0, s0 = rem.samples[0]
            wc = st.count - c0
            out.append(UpstreamSample(addr=st.addr, port=st.port, family=st.family, hist=st.hist[:HIST_SLOTS],
                                      count=st.count, sum_us=st.sum_us, last_srtt_us=st.last_us,
                                      window_count=wc, window_mean_us=(st.sum_us - s0) / wc if wc > 0 else 0.0))
        return out


# --------------------------------------------------------------------------------------------------

EXAMPLES = """examples:
    python -m ebpf.agent --tenants gateway.yaml          # spec.tenants of a gateway config
    python -m ebpf.agent --tenants 'acme=0.5,beta=200m:0.2,free'       # inline: id=limit[:burst]
    python -m ebpf.agent --tenants t.yaml --rtt-ports 8000,8001 --metrics-port 9478
    python -m ebpf.agent --tenants t.yaml --poll                     # no eBPF: cgroup counters only
    python -m ebpf.agent --ebpf                                      # print the BPF C and exit
signals: SIGHUP re-reads --tenants and diff-applies it; SIGINT/SIGTERM stop (cgroups are kept
unless --cleanup)."""


def _ports(text: str):
    if text == "all":
        return "all"
    try:
        ports = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ports like 8000,8001 or 'all', got {text!r}") from None
    if not all(0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be 1-65535: {text!r}")
    return ports


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ebpf.agent", description="Per-tenant CPU accounting and limits "
                                "(cgroups + eBPF sched_switch), per-upstream TCP RTT (eBPF tcp_probe), published "
                                "as a shared-memory snapshot and Prometheus metrics.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("--tenants", help="AdapterGateway config, tenants YAML, or inline 'id=limit[:burst],...'")
    p.add_argument("--name", default=ROOT_NAME, help="cgroup root and snapshot name (default %(default)s)")
    p.add_argument("--snapshot", help="snapshot file (default: the config's spec.tenancy.snapshot, else "
                   "/dev/shm/adapter-gateway/<name>.snap)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default %(default)s)")
    p.add_argument("--window", type=float, default=1.0, help="sliding window for CPU use, s (default %(default)s)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--poll", action="store_true", help="do not load eBPF; poll cgroup CPU counters")
    g.add_argument("--require-ebpf", action="store_true", help="exit with an error if eBPF cannot load")
    p.add_argument("--rtt-ports", type=_ports, help="upstream ports whose RTT to histogram ('all': every port)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="metrics listen address (default %(default)s)")
    p.add_argument("--cleanup", action="store_true", help="on exit, remove the tenant cgroups and the snapshot")
    p.add_argument("--ebpf", action="store_true", help="print the BPF programs and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.ebpf:
        print(source("cpu_account"))
        print(source("tcp_rtt"))
        return 0
    if not args.tenants:
        build_parser().error("--tenants is required")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s ebpf-agent %(levelname)s %(message)s")
    try:
        specs = load_tenants(args.tenants)
        snapshot = args.snapshot or config_snapshot_path(args.tenants)
        agent = Agent(specs, name=args.name, snapshot=snapshot, interval=args.interval, window=args.window,
                      mode="poll" if args.poll else ("ebpf" if args.require_ebpf else "auto"),
                      rtt_ports=args.rtt_ports, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr)
        agent.start()
    except QuotaError as e:
        for problem in e.problems:
            print(f"ebpf.agent: invalid tenants: {problem}", file=sys.stderr)
        return 2
    except (EbpfUnavailable, OSError, RuntimeError, ValueError) as e:
        print(f"ebpf.agent: {e}", file=sys.stderr)
        return 1
    stop, hup = threading.Event(), threading.Event()

    def reload_if_asked():
        if hup.is_set():
            hup.clear()
            try:
                agent.reload(load_tenants(args.tenants))
                log.info("tenants reloaded from %s", args.tenants)
            except QuotaError as e:
                log.error("reload refused, keeping the running tenants: %s", e)

    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    try:
        agent.run(stop, before_step=reload_if_asked)
    finally:
        agent.close(remove_cgroups=args.cleanup, remove_snapshot=args.cleanup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
