"""The agent's snapshot in shared memory: FlatBuffers writer and zero-copy reader.

What: the tenant-isolation agent (`ebpf/agent.py`) publishes per-tenant CPU use against the limit,
throttling and per-upstream TCP RTT histograms as one FlatBuffers buffer (schema
`ebpf/snapshot.fbs`, generated accessors in `ebpf/snapshot_fb/`) at
`/dev/shm/adapter-gateway/<name>.snap`. Processor workers read it with `SnapshotReader`.

Why this shape: the writer writes a temp file in the same directory and renames it over the
published one, so a published file is never modified. A reader mmaps the file it finds and reads
fields in place (no copy, no parse step); it keeps that mapping, and so one consistent snapshot,
until the path names a new file. Nothing is shared that needs a lock, so a reader never waits for
the agent, and a dead agent leaves the last snapshot readable (its `age_s` then grows: stale).

Cost (measured by tests/ebpf/test_snapshot.py, see ebpf/README.md): `current()` is one `os.stat`
when nothing changed (about 1 us); after the agent publishes, the first call maps the new file
(tens of us). A field read is one FlatBuffers table lookup (sub-microsecond to about 1 us).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import flatbuffers

from ebpf.snapshot_fb import Snapshot as _fb_snapshot
from ebpf.snapshot_fb import Tenant as _fb_tenant
from ebpf.snapshot_fb import Upstream as _fb_upstream
from ebpf.snapshot_fb.Source import Source as _FbSource

SHM_DIR = Path("/dev/shm/adapter-gateway")
FILE_IDENTIFIER = b"AGSN"
SOURCES = {_FbSource.None_: "none", _FbSource.Ebpf: "ebpf", _FbSource.Poll: "poll"}
_SOURCE_CODES = {v: k for k, v in SOURCES.items()}
HIST_SLOTS = 32  # log2 srtt slots: slot 0 = 0 us, slot i = [2^(i-1), 2^i) us


def snapshot_path(name: str = "adapter-gateway", directory: Path | str = SHM_DIR) -> Path:
    """Where the agent called `name` publishes its snapshot."""
    return Path(directory) / f"{name}.snap"


def slot_bounds_us(slot: int) -> tuple[int, int]:
    """The srtt range [low, high) in microseconds that histogram slot `slot` counts."""
    return (0, 1) if slot == 0 else (1 << (slot - 1), 1 << slot)


# --------------------------------------------------------------------------------------------------
# What the agent writes
# --------------------------------------------------------------------------------------------------

@dataclass
class TenantSample:
    """One tenant's numbers for one snapshot (see snapshot.fbs `Tenant` for each field)."""

    id: str
    cpu_used: float = 0.0
    cpu_limit: float = 0.0  # 0 = unlimited
    burst: float = 0.0
    usage_ns: int = 0
    throttled_ns: int = 0
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_window_ns: int = 0
    window_start_mono_ns: int = 0
    window_end_mono_ns: int = 0
    cgroup_id: int = 0
    cgroup_v2: str = ""
    cgroup_cpu: str = ""
    nr_procs: int = 0
    recreated: int = 0
    admitted: int = 0
    rejected: int = 0


@dataclass
class UpstreamSample:
    """One remote (address, port) and its srtt histogram (see snapshot.fbs `Upstream`)."""

    addr: str
    port: int
    family: int = 2
    hist: list[int] = field(default_factory=list)
    count: int = 0
    sum_us: int = 0
    last_srtt_us: int = 0
    window_count: int = 0
    window_mean_us: float = 0.0


@dataclass
class SnapshotData:
    tenants: list[TenantSample] = field(default_factory=list)
    upstreams: list[UpstreamSample] = field(default_factory=list)
    source: str = "none"  # "ebpf" | "poll" | "none"
    note: str = ""
    interval_ns: int = 0
    window_ns: int = 0
    agent_pid: int = 0
    generation: int = 0  # set by SnapshotWriter.write
    written_mono_ns: int = 0  # set by SnapshotWriter.write when 0
    written_unix_ns: int = 0


def encode(data: SnapshotData) -> bytes:
    """Serialize one snapshot (tenants sorted by id, as the schema's `(key)` promises)."""
    b = flatbuffers.Builder(1024)
    tenant_offs = []
    for t in sorted(data.tenants, key=lambda t: t.id):
        tid, v2, cpu = b.CreateString(t.id), b.CreateString(t.cgroup_v2), b.CreateString(t.cgroup_cpu)
        _fb_tenant.Start(b)
        _fb_tenant.AddId(b, tid)
        _fb_tenant.AddCpuUsed(b, float(t.cpu_used))
        _fb_tenant.AddCpuLimit(b, float(t.cpu_limit))
        _fb_tenant.AddBurst(b, float(t.burst))
        _fb_tenant.AddUsageNs(b, int(t.usage_ns))
        _fb_tenant.AddThrottledNs(b, int(t.throttled_ns))
        _fb_tenant.AddNrPeriods(b, int(t.nr_periods))
        _fb_tenant.AddNrThrottled(b, int(t.nr_throttled))
        _fb_tenant.AddThrottledWindowNs(b, int(t.throttled_window_ns))
        _fb_tenant.AddWindowStartMonoNs(b, int(t.window_start_mono_ns))
        _fb_tenant.AddWindowEndMonoNs(b, int(t.window_end_mono_ns))
        _fb_tenant.AddCgroupId(b, int(t.cgroup_id))
        _fb_tenant.AddCgroupV2(b, v2)
        _fb_tenant.AddCgroupCpu(b, cpu)
        _fb_tenant.AddNrProcs(b, int(t.nr_procs))
        _fb_tenant.AddRecreated(b, int(t.recreated))
        _fb_tenant.AddAdmitted(b, int(t.admitted))
        _fb_tenant.AddRejected(b, int(t.rejected))
        tenant_offs.append(_fb_tenant.End(b))
    up_offs = []
    for u in data.upstreams:
        addr = b.CreateString(u.addr)
        _fb_upstream.StartHistVector(b, len(u.hist))
        for v in reversed(u.hist):
            b.PrependUint64(int(v))
        hist = b.EndVector()
        _fb_upstream.Start(b)
        _fb_upstream.AddAddr(b, addr)
        _fb_upstream.AddPort(b, int(u.port))
        _fb_upstream.AddFamily(b, int(u.family))
        _fb_upstream.AddHist(b, hist)
        _fb_upstream.AddCount(b, int(u.count))
        _fb_upstream.AddSumUs(b, int(u.sum_us))
        _fb_upstream.AddLastSrttUs(b, int(u.last_srtt_us))
        _fb_upstream.AddWindowCount(b, int(u.window_count))
        _fb_upstream.AddWindowMeanUs(b, float(u.window_mean_us))
        up_offs.append(_fb_upstream.End(b))
    note = b.CreateString(data.note)
    _fb_snapshot.StartTenantsVector(b, len(tenant_offs))
    for off in reversed(tenant_offs):
        b.PrependUOffsetTRelative(off)
    tenants = b.EndVector()
    _fb_snapshot.StartUpstreamsVector(b, len(up_offs))
    for off in reversed(up_offs):
        b.PrependUOffsetTRelative(off)
    upstreams = b.EndVector()
    _fb_snapshot.Start(b)
    _fb_snapshot.AddGeneration(b, int(data.generation))
    _fb_snapshot.AddWrittenMonoNs(b, int(data.written_mono_ns))
    _fb_snapshot.AddWrittenUnixNs(b, int(data.written_unix_ns))
    _fb_snapshot.AddIntervalNs(b, int(data.interval_ns))
    _fb_snapshot.AddWindowNs(b, int(data.window_ns))
    _fb_snapshot.AddAgentPid(b, int(data.agent_pid))
    _fb_snapshot.AddSource(b, _SOURCE_CODES.get(data.source, _FbSource.None_))
    _fb_snapshot.AddNote(b, note)
    _fb_snapshot.AddTenants(b, tenants)
    _fb_snapshot.AddUpstreams(b, upstreams)
    b.Finish(_fb_snapshot.End(b), file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


class SnapshotWriter:
    """Publishes snapshots at `path`: write a temp file beside it, then rename over it.

    The generation counter starts at 1 for each writer; readers tell a new publication by the file
    (inode) changing, and a restarted agent by `agent_pid` and the generation starting again.
    Files are 0644 in a 0755 directory, so unprivileged workers can read what a root agent writes.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.generation = 0
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")

    def write(self, data: SnapshotData) -> int:
        self.generation += 1
        data.generation = self.generation
        if not data.written_mono_ns:
            data.written_mono_ns = time.monotonic_ns()
        if not data.written_unix_ns:
            data.written_unix_ns = time.time_ns()
        if not data.agent_pid:
            data.agent_pid = os.getpid()
        buf = encode(data)
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        os.replace(self._tmp, self.path)
        return self.generation

    def close(self, remove: bool = False) -> None:
        for p in ([self._tmp, self.path] if remove else [self._tmp]):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------------------------------
# What the processor reads
# --------------------------------------------------------------------------------------------------
#
# Reading goes through `_Table`, a struct-based accessor over the same FlatBuffers layout, instead of
# the generated accessors: those are correct but slow in pure Python (flatbuffers' Table.Get checks
# every value it reads: 3 to 5 us a field, 150 us to index two tenants). Field slots below are the
# schema's field order (vtable offset 4 + 2 * slot); tests/ebpf/test_snapshot.py checks every field
# against the generated accessors, so a schema change that is not mirrored here fails the tests.

_U8 = struct.Struct("<B").unpack_from
_I8 = struct.Struct("<b").unpack_from
_U16 = struct.Struct("<H").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct("<d").unpack_from


class _Table:
    """A FlatBuffers table at `pos` of `buf` (read in place; nothing is copied but the values read)."""

    __slots__ = ("buf", "pos", "vt", "vtlen")

    def __init__(self, buf, pos: int):
        self.buf, self.pos = buf, pos
        self.vt = pos - _I32(buf, pos)[0]
        self.vtlen = _U16(buf, self.vt)[0]

    def _off(self, slot: int) -> int:
        vo = 4 + 2 * slot
        return _U16(self.buf, self.vt + vo)[0] if vo < self.vtlen else 0

    def scalar(self, slot: int, unpack, default=0):
        o = self._off(slot)
        return unpack(self.buf, self.pos + o)[0] if o else default

    def string(self, slot: int) -> str:
        o = self._off(slot)
        if not o:
            return ""
        p = self.pos + o
        p += _U32(self.buf, p)[0]
        n = _U32(self.buf, p)[0]
        return self.buf[p + 4:p + 4 + n].decode()

    def vector(self, slot: int) -> tuple[int, int]:
        """(start of the elements, element count); (0, 0) when absent."""
        o = self._off(slot)
        if not o:
            return 0, 0
        p = self.pos + o
        p += _U32(self.buf, p)[0]
        return p + 4, _U32(self.buf, p)[0]

    def tables(self, slot: int) -> list["_Table"]:
        start, n = self.vector(slot)
        buf = self.buf
        return [_Table(buf, q + _U32(buf, q)[0]) for q in range(start, start + 4 * n, 4)]


class _Memo:
    """A read-only field of an immutable buffer: read once, then cached on the view.

    The published file never changes, so caching what was read is exact.
    """

    __slots__ = ("name", "fn")

    def __init__(self, fn):
        self.fn = fn
        self.name = fn.__name__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        c = obj._c
        try:
            return c[self.name]
        except KeyError:
            v = c[self.name] = self.fn(obj)
            return v


def _scalar(slot: int, unpack, default=0):
    return _Memo(lambda s: s._t.scalar(slot, unpack, default))


def _string(slot: int):
    return _Memo(lambda s: s._t.string(slot))


class TenantView:
    """One tenant in a mapped snapshot (fields as in snapshot.fbs `Tenant`), read in place.

    cpu_used      CPUs, mean over the agent's sliding window ending at window_end_mono_ns
    cpu_limit     CPUs from the config, None when unlimited
    burst         the config's cpu.burst: extra share of the limit tolerated (0.2 = +20 %)
    allowance     cpu_limit * (1 + burst), inf when unlimited; over_quota: cpu_used > allowance
    throttled_ns  the kernel's cumulative CFS throttled time for the tenant's cgroup
    window_end    window end, CLOCK_MONOTONIC seconds (compare with time.monotonic())
    agent_pid, generation: of the snapshot this view belongs to
    """

    __slots__ = ("_t", "_snap", "_c")

    def __init__(self, t: _Table, snap: "Snapshot"):
        self._t, self._snap, self._c = t, snap, {}

    id = _string(0)
    cpu_used = _scalar(1, _F64, 0.0)
    burst = _scalar(3, _F64, 0.0)
    usage_ns = _scalar(4, _U64)
    throttled_ns = _scalar(5, _U64)
    nr_periods = _scalar(6, _U64)
    nr_throttled = _scalar(7, _U64)
    throttled_window_ns = _scalar(8, _U64)
    window_start_mono_ns = _scalar(9, _U64)
    window_end_mono_ns = _scalar(10, _U64)
    cgroup_id = _scalar(11, _U64)
    cgroup_v2 = _string(12)
    cgroup_cpu = _string(13)
    nr_procs = _scalar(14, _U32)
    recreated = _scalar(15, _U32)
    admitted = _scalar(16, _U64)
    rejected = _scalar(17, _U64)

    @_Memo
    def cpu_limit(self) -> float | None:
        v = self._t.scalar(2, _F64, 0.0)
        return v if v > 0 else None

    @_Memo
    def allowance(self) -> float:
        lim = self.cpu_limit
        return lim * (1.0 + self.burst) if lim else float("inf")

    @_Memo
    def over_quota(self) -> bool:
        return self.cpu_used > self.allowance

    @property
    def window_end(self) -> float:
        return self.window_end_mono_ns / 1e9

    @property
    def agent_pid(self) -> int:
        return self._snap.agent_pid

    @property
    def generation(self) -> int:
        return self._snap.generation

    FIELDS = ("id", "cpu_used", "cpu_limit", "burst", "allowance", "over_quota", "usage_ns", "throttled_ns",
              "nr_periods", "nr_throttled", "throttled_window_ns", "window_start_mono_ns", "window_end_mono_ns",
              "cgroup_id", "cgroup_v2", "cgroup_cpu", "nr_procs", "recreated", "admitted", "rejected",
              "agent_pid", "generation")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def __repr__(self) -> str:
        return f"TenantView({self.id!r}, cpu_used={self.cpu_used:.3f}, cpu_limit={self.cpu_limit})"


class UpstreamView:
    """One upstream's srtt numbers (fields as in snapshot.fbs `Upstream`)."""

    __slots__ = ("_t", "_c")

    def __init__(self, t: _Table):
        self._t, self._c = t, {}

    addr = _string(0)
    port = _scalar(1, _U16)
    family = _scalar(2, _U16)
    count = _scalar(4, _U64)
    sum_us = _scalar(5, _U64)
    last_srtt_us = _scalar(6, _U32)
    window_count = _scalar(7, _U64)
    window_mean_us = _scalar(8, _F64, 0.0)

    @_Memo
    def hist(self) -> tuple[int, ...]:
        start, n = self._t.vector(3)
        buf = self._t.buf
        return tuple(_U64(buf, start + 8 * i)[0] for i in range(n))

    @_Memo
    def endpoint(self) -> str:
        a = self.addr
        return f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}"

    @property
    def mean_us(self) -> float:
        c = self.count
        return self.sum_us / c if c else 0.0

    FIELDS = ("addr", "port", "family", "endpoint", "hist", "count", "sum_us", "mean_us", "last_srtt_us",
              "window_count", "window_mean_us")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def __repr__(self) -> str:
        return f"UpstreamView({self.endpoint}, count={self.count}, window_mean_us={self.window_mean_us:.0f})"


class Snapshot:
    """One published snapshot, mapped read-only. Cheap to keep; fields are read in place.

    age_s: seconds since the agent wrote it (CLOCK_MONOTONIC, computed on each access);
    stale: age_s > the reader's stale_after_s. What to do with a stale snapshot is the caller's
    policy (the processor's: keep using it, then after its own limit apply its configured default).
    """

    __slots__ = ("_buf", "_t", "_c", "stale_after_s", "inode")

    def __init__(self, buf, stale_after_s: float = 1.0, inode: int = 0):
        self._buf = buf  # the mmap (or bytes); views keep it alive through this object
        self._t = _Table(buf, _U32(buf, 0)[0])
        self._c: dict = {}
        self.stale_after_s = stale_after_s
        self.inode = inode

    generation = _scalar(0, _U64)
    written_mono_ns = _scalar(1, _U64)
    written_unix_ns = _scalar(2, _U64)
    interval_ns = _scalar(3, _U64)
    window_ns = _scalar(4, _U64)
    agent_pid = _scalar(5, _U32)
    note = _string(7)

    @_Memo
    def source(self) -> str:
        return SOURCES.get(self._t.scalar(6, _I8), "none")

    @property
    def interval_s(self) -> float:
        return self.interval_ns / 1e9

    @property
    def window_s(self) -> float:
        return self.window_ns / 1e9

    @property
    def age_s(self) -> float:
        return (time.monotonic_ns() - self.written_mono_ns) / 1e9

    @property
    def stale(self) -> bool:
        return self.age_s > self.stale_after_s

    @_Memo
    def tenants(self) -> dict[str, TenantView]:
        """tenant id -> view (built once per snapshot, on first use)."""
        views = (TenantView(t, self) for t in self._t.tables(8))
        return {v.id: v for v in views}

    def tenant(self, tenant_id: str) -> TenantView | None:
        return self.tenants.get(tenant_id)

    @_Memo
    def upstreams(self) -> tuple[UpstreamView, ...]:
        return tuple(UpstreamView(t) for t in self._t.tables(9))

    def agent_alive(self) -> bool:
        """Whether the writing agent's pid exists (a syscall: not for every request)."""
        try:
            os.kill(self.agent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def __iter__(self) -> Iterator[TenantView]:
        return iter(self.tenants.values())

class SnapshotReader:
    """`SnapshotReader(path).current()` -> the newest published Snapshot, or None if none yet.

    Never blocks on the agent: at most every `recheck_s` seconds (default 5 ms, i.e. well under the
    agent's 100 ms interval) it stats the path; when the path names a new file it mmaps that file
    (the old mapping is released once no view refers to it). Between checks it returns the snapshot
    it has. If the file disappears (agent stopped and cleaned up) or a new one is unreadable, the
    last good snapshot is returned, and its `age_s` keeps growing so it reads as stale.
    One reader per process (or per thread); it is not locked.
    """

    def __init__(self, path: Path | str | None = None, stale_after_s: float = 1.0, recheck_s: float = 0.005):
        self.path = os.fspath(path if path is not None else snapshot_path())
        self.stale_after_s = stale_after_s
        self.recheck_ns = int(recheck_s * 1e9)
        self._next_check = 0
        self._key: tuple[int, int, int] | None = None
        self._snap: Snapshot | None = None

    def current(self) -> Snapshot | None:
        now = time.monotonic_ns()
        if now < self._next_check:
            return self._snap
        self._next_check = now + self.recheck_ns
        try:
            st = os.stat(self.path)
        except OSError:
            return self._snap
        key = (st.st_ino, st.st_dev, st.st_mtime_ns)
        if key != self._key:
            snap = self._map(st.st_ino)
            if snap is not None:
                self._key, self._snap = key, snap
        return self._snap

    def _map(self, inode: int) -> Snapshot | None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                return None
            buf = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if buf[4:8] != FILE_IDENTIFIER:
            buf.close()
            return None
        return Snapshot(buf, self.stale_after_s, inode)
