"""Loading the BCC programs and reading their maps.

What: `CpuAccounting` (cpu_account.bpf.c, sched:sched_switch) and `TcpRtt` (tcp_rtt.bpf.c,
tcp:tcp_probe), each compiled by BCC at load time with its constants as `-D` cflags.
`ebpf_unavailable()` says why eBPF cannot load here (None when it can): the agent then polls cgroup
counters instead.
BCC: Debian's python3-bpfcc, imported from /usr/lib/python3/dist-packages (added to sys.path when
`bcc` is not importable otherwise). PyPI's `bcc` is an unrelated project: never install it.
Cost: compiling one program takes 1.5 to 2 s of CPU and tens of MB (clang, once at start); reading
a map is one syscall per entry (a few per tenant / upstream every interval).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
PROGRAMS = {"cpu_account": HERE / "cpu_account.bpf.c", "tcp_rtt": HERE / "tcp_rtt.bpf.c"}
HIST_SLOTS = 32


class EbpfUnavailable(RuntimeError):
    """eBPF cannot be loaded here; str(e) says why."""


def source(name: str) -> str:
    """The BPF C of program `name` ('cpu_account' or 'tcp_rtt'), as loaded."""
    return PROGRAMS[name].read_text()


def import_bcc():
    """Debian's bcc module, or EbpfUnavailable."""
    try:
        import bcc  # noqa: F401
    except ImportError:
        if DIST_PACKAGES not in sys.path and os.path.isdir(DIST_PACKAGES):
            sys.path.append(DIST_PACKAGES)
        try:
            import bcc  # noqa: F401
        except ImportError as e:
            raise EbpfUnavailable(f"BCC is not installed (Debian python3-bpfcc; run scripts/setup-ebpf.sh): {e}") from None
    if not hasattr(bcc, "BPF"):
        raise EbpfUnavailable(f"the importable `bcc` ({getattr(bcc, '__file__', '?')}) is not BCC "
                              "(PyPI's bcc is an unrelated project); install Debian python3-bpfcc")
    return bcc


def ebpf_unavailable() -> str | None:
    """Why the programs cannot load here (not root, no BCC, no kernel headers, no tracefs), or None."""
    if os.geteuid() != 0:
        return "not root"
    try:
        import_bcc()
    except EbpfUnavailable as e:
        return str(e)
    rel = os.uname().release
    if not (headers_present() or os.path.exists("/sys/kernel/kheaders.tar.xz")):
        return f"no kernel headers at /lib/modules/{rel}/build (run scripts/setup-ebpf.sh)"
    if not (os.path.isdir("/sys/kernel/tracing/events/sched") or os.path.isdir("/sys/kernel/debug/tracing/events/sched")):
        return "tracefs is not mounted at /sys/kernel/tracing (run scripts/setup-ebpf.sh)"
    return None


def headers_present(release: str | None = None) -> bool:
    """Kernel headers BCC can use at /lib/modules/<release>/{build,source} (Debian's split layout)."""
    mod = f"/lib/modules/{release or os.uname().release}"
    return os.path.exists(f"{mod}/build/include/generated/autoconf.h") and any(
        os.path.exists(f"{mod}/{d}/include/linux/kconfig.h") for d in ("build", "source"))


def _load(name: str, cflags: list[str]):
    bcc = import_bcc()
    try:
        return bcc.BPF(text=source(name).encode(), cflags=cflags)
    except Exception as e:  # BCC raises bare Exception for compile/load failures
        raise EbpfUnavailable(f"{name}: BCC could not compile/load the program: {e}") from e


def _possible_cpus() -> int:
    try:
        import bcc.utils as u  # type: ignore
        return len(u.get_possible_cpus())
    except Exception:
        return os.cpu_count() or 1


class CpuAccounting:
    """On-CPU ns per tenant-level v2 cgroup id, from sched_switch (see cpu_account.bpf.c).

    totals(): {tenant cgroup id: committed ns} summed over CPUs (tasks outside tenants are not counted).
    running(): [(slice start ns (CLOCK_MONOTONIC), tid)] per CPU: slices not yet switched out, which
    the agent adds to the owner's tenant so long slices count before they end.
    """

    def __init__(self, tenant_level: int = 2, max_cgroups: int = 4096):
        self.tenant_level = tenant_level
        self.cflags = [f"-DTENANT_LEVEL={int(tenant_level)}", f"-DMAX_CGROUPS={int(max_cgroups)}"]
        self.bpf = _load("cpu_account", self.cflags)
        self._usage = self.bpf[b"usage"]
        self._cur = self.bpf[b"cur"]

    def totals(self) -> dict[int, int]:
        return {k.value: sum(v) for k, v in self._usage.items()}

    def running(self) -> list[tuple[int, int]]:
        vals = self._cur[ctypes.c_int(0)]
        return [(s.start_ns, s.tid) for s in vals if s.start_ns and s.tid]

    def close(self) -> None:
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


@dataclass
class RttStats:
    family: int
    addr: str
    port: int
    hist: list[int]
    count: int = 0
    sum_us: int = 0
    last_us: int = 0


def _addr(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    ip = ipaddress.IPv6Address(raw[:16])
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


class TcpRtt:
    """log2 histograms of srtt (us) per remote (address, port), from tcp:tcp_probe (tcp_rtt.bpf.c).

    ports: remote ports to keep (the upstreams'); None keeps every port (FILTER_PORTS=0).
    read(): {(addr, port): RttStats} with cumulative histograms (HIST_SLOTS slots). IPv4-mapped
    IPv6 remotes are folded into their IPv4 address.
    """

    def __init__(self, ports=None, max_remotes: int = 1024):
        self.filtered = ports is not None
        self.cflags = [f"-DFILTER_PORTS={1 if self.filtered else 0}", f"-DMAX_REMOTES={int(max_remotes)}"]
        self.bpf = _load("tcp_rtt", self.cflags)
        self.ports: set[int] = set()
        if self.filtered:
            self.set_ports(ports)

    def set_ports(self, ports) -> None:
        if not self.filtered:
            return
        table = self.bpf[b"ports"]
        new = {int(p) for p in ports}
        for p in self.ports - new:
            try:
                del table[table.Key(p)]
            except KeyError:
                pass
        for p in new - self.ports:
            table[table.Key(p)] = table.Leaf(1)
        self.ports = new

    def read(self) -> dict[tuple[str, int], RttStats]:
        out: dict[tuple[str, int], RttStats] = {}

        def entry(remote) -> RttStats:
            raw = bytes(bytearray(remote.addr))
            key = (_addr(remote.family, raw), remote.port)
            st = out.get(key)
            if st is None:
                fam = socket.AF_INET if "." in key[0] else socket.AF_INET6
                st = out[key] = RttStats(fam, key[0], key[1], [0] * HIST_SLOTS)
            return st

        for k, v in self.bpf[b"hist"].items():
            entry(k.remote).hist[min(int(k.slot), HIST_SLOTS - 1)] += v.value
        for k, v in self.bpf[b"stats"].items():
            st = entry(k)
            st.count += v.count
            st.sum_us += v.sum_us
            st.last_us = v.last_us
        return out

    def close(self) -> None:
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


def tenant_of_tid(tid: int, prefix: str) -> str | None:
    """The tenant whose v2 cgroup `<prefix>/<tenant>[/...]` holds thread `tid`, from /proc."""
    try:
        with open(f"/proc/{tid}/cgroup", "rb") as f:
            for line in f:
                if line.startswith(b"0::"):
                    path = line[3:].strip().decode()
                    if path.startswith(prefix):
                        rest = path[len(prefix):].lstrip("/")
                        return rest.split("/", 1)[0] or None
                    return None
    except OSError:
        return None
    return None


def monotonic_ns() -> int:
    """The clock bpf_ktime_get_ns() uses (CLOCK_MONOTONIC)."""
    return time.monotonic_ns()
