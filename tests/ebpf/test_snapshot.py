"""Snapshot writer/reader: round trip, agreement with flatc's generated code, staleness.

What a read costs is measured by perf/bench_snapshot.py, not asserted here."""

from __future__ import annotations

import mmap
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.ebpf.conftest import FLATBUFFERS_REASON

pytest.importorskip("flatbuffers", reason=FLATBUFFERS_REASON)

from ebpf.snapshot import (SnapshotData, SnapshotReader, SnapshotWriter, TenantSample,  # noqa: E402
                           UpstreamSample, encode, slot_bounds_us)
from ebpf.snapshot_fb.Snapshot import Snapshot as FbSnapshot  # noqa: E402

pytestmark = pytest.mark.ebpf
REPO = Path(__file__).resolve().parents[2]


def sample_data() -> SnapshotData:
    return SnapshotData(
        tenants=[
            TenantSample("zeta", cpu_used=0.9, usage_ns=9, cgroup_id=77, cgroup_v2="/sys/fs/cgroup/unified/x/zeta"),
            TenantSample("acme", cpu_used=0.25, cpu_limit=0.2, burst=0.1, usage_ns=123456789, throttled_ns=5_000_000,
                         nr_periods=50, nr_throttled=7, throttled_window_ns=1000, window_start_mono_ns=10,
                         window_end_mono_ns=20, cgroup_id=42, cgroup_v2="/v2/acme", cgroup_cpu="/cpu/acme",
                         nr_procs=3, recreated=1, admitted=100, rejected=5),
        ],
        upstreams=[UpstreamSample("10.0.0.5", 8000, 2, hist=[0, 0, 3, 9, 1], count=13, sum_us=70, last_srtt_us=4,
                                  window_count=2, window_mean_us=3.5),
                   UpstreamSample("::1", 8443, 10, hist=[1] * 32, count=32, sum_us=1 << 20)],
        source="ebpf", note="hello", interval_ns=100_000_000, window_ns=1_000_000_000, agent_pid=4242,
    )


def test_round_trip(tmp_path):
    path = tmp_path / "t.snap"
    w = SnapshotWriter(path)
    assert w.write(sample_data()) == 1
    snap = SnapshotReader(path).current()
    assert isinstance(snap._buf, mmap.mmap)  # read in place from the mapping, not a copy
    assert (snap.generation, snap.source, snap.note, snap.agent_pid) == (1, "ebpf", "hello", 4242)
    assert (snap.interval_s, snap.window_s) == (0.1, 1.0)
    assert list(snap.tenants) == ["acme", "zeta"]  # sorted by id (the schema's key)
    a = snap.tenant("acme")
    assert a.as_dict() == {
        "id": "acme", "cpu_used": 0.25, "cpu_limit": 0.2, "burst": 0.1, "allowance": pytest.approx(0.22),
        "over_quota": True, "usage_ns": 123456789, "throttled_ns": 5_000_000, "nr_periods": 50, "nr_throttled": 7,
        "throttled_window_ns": 1000, "window_start_mono_ns": 10, "window_end_mono_ns": 20, "cgroup_id": 42,
        "cgroup_v2": "/v2/acme", "cgroup_cpu": "/cpu/acme", "nr_procs": 3, "recreated": 1, "admitted": 100,
        "rejected": 5, "agent_pid": 4242, "generation": 1}
    z = snap.tenant("zeta")
    assert z.cpu_limit is None and z.allowance == float("inf") and not z.over_quota
    assert snap.tenant("nobody") is None
    u4, u6 = snap.upstreams
    assert (u4.endpoint, u4.hist, u4.count, u4.window_mean_us) == ("10.0.0.5:8000", (0, 0, 3, 9, 1), 13, 3.5)
    assert (u6.endpoint, u6.family, len(u6.hist), u6.sum_us) == ("[::1]:8443", 10, 32, 1 << 20)
    assert slot_bounds_us(0) == (0, 1) and slot_bounds_us(3) == (4, 8)


def test_fast_reader_agrees_with_generated_code():
    """ebpf/snapshot.py reads with its own struct accessor; every field must match flatc's code."""
    buf = encode(sample_data())
    gen = FbSnapshot.GetRootAs(buf, 0)
    from ebpf.snapshot import Snapshot
    snap = Snapshot(buf)
    assert (snap.generation, snap.written_mono_ns, snap.interval_ns, snap.window_ns, snap.agent_pid, snap.note) == (
        gen.Generation(), gen.WrittenMonoNs(), gen.IntervalNs(), gen.WindowNs(), gen.AgentPid(), gen.Note().decode())
    camel = lambda n: "".join(p.title() for p in n.split("_"))  # noqa: E731
    for i, view in enumerate(snap.tenants.values()):
        g = gen.Tenants(i)
        for f in ("id", "cpu_used", "burst", "usage_ns", "throttled_ns", "nr_periods", "nr_throttled",
                  "throttled_window_ns", "window_start_mono_ns", "window_end_mono_ns", "cgroup_id", "cgroup_v2",
                  "cgroup_cpu", "nr_procs", "recreated", "admitted", "rejected"):
            want = getattr(g, camel(f))()
            assert getattr(view, f) == (want.decode() if isinstance(want, bytes) else want), f
        assert (view.cpu_limit or 0.0) == g.CpuLimit()
    for i, view in enumerate(snap.upstreams):
        g = gen.Upstreams(i)
        for f in ("addr", "port", "family", "count", "sum_us", "last_srtt_us", "window_count", "window_mean_us"):
            want = getattr(g, camel(f))()
            assert getattr(view, f) == (want.decode() if isinstance(want, bytes) else want), f
        assert view.hist == tuple(g.Hist(j) for j in range(g.HistLength()))


def test_generated_code_matches_schema(tmp_path):
    flatc = shutil.which("flatc")
    if flatc is None:
        pytest.skip("flatc not installed (Debian flatbuffers-compiler, installed by scripts/setup-ebpf.sh)")
    subprocess.run([flatc, "--python", "-o", str(tmp_path), str(REPO / "ebpf" / "snapshot.fbs")], check=True)
    out = tmp_path / "ebpf" / "snapshot_fb"
    for f in sorted(out.glob("*.py")):
        assert (REPO / "ebpf" / "snapshot_fb" / f.name).read_text() == f.read_text(), \
            f"ebpf/snapshot_fb/{f.name} is stale: regenerate it from ebpf/snapshot.fbs (see the schema's header)"


def test_new_generation_seen_and_old_view_stays_consistent(tmp_path):
    path = tmp_path / "t.snap"
    w = SnapshotWriter(path)
    w.write(sample_data())
    r = SnapshotReader(path, recheck_s=0)
    first = r.current()
    acme = first.tenant("acme")
    d = sample_data()
    d.tenants[1].cpu_used = 0.05
    w.write(d)
    second = r.current()
    assert second.generation == 2 and second.tenant("acme").cpu_used == 0.05
    assert first.generation == 1 and acme.cpu_used == 0.25  # the old mapping is untouched by the rewrite
    assert r.current() is second  # nothing new: the same object


def test_staleness_and_dead_agent(tmp_path):
    path = tmp_path / "t.snap"
    w = SnapshotWriter(path)
    d = sample_data()
    d.agent_pid = 0x7FFFFFF0  # no such process
    d.written_mono_ns = time.monotonic_ns() - 3_000_000_000  # written 3 s ago
    w.write(d)
    r = SnapshotReader(path, stale_after_s=1.0, recheck_s=0)
    snap = r.current()
    assert snap.age_s == pytest.approx(3.0, abs=0.5)
    assert snap.stale and not snap.agent_alive()
    path.unlink()  # agent gone and its file removed: the last snapshot is still served, still stale
    assert r.current() is snap and r.current().stale
    fresh = SnapshotReader(path)
    assert fresh.current() is None  # never saw one
    d = sample_data()
    d.agent_pid = 0  # the writer fills in its own pid
    w.write(d)
    assert not r.current().stale and r.current().generation == 2 and r.current().agent_alive()


def test_garbage_file_is_ignored(tmp_path):
    path = tmp_path / "t.snap"
    path.write_bytes(b"not a flatbuffer at all")
    assert SnapshotReader(path).current() is None
