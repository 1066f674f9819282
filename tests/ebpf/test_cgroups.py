"""CgroupManager: limits, diff-apply, refusal of invalid quotas, repair of removed cgroups."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from ebpf.cgroups import CgroupLayout, CgroupManager, QuotaError, TenantSpec, quota_for, validate
from tests.ebpf.conftest import needs_root

pytestmark = pytest.mark.ebpf


@pytest.mark.parametrize("limit, want", [
    (None, (-1, 100_000)), (0.5, (50_000, 100_000)), (0.2, (20_000, 100_000)), (2, (200_000, 100_000)),
    (0.01, (1_000, 100_000)), (0.005, (1_000, 200_000)), (0.001, (1_000, 1_000_000)),
])
def test_quota_for(limit, want):
    assert quota_for(limit) == want


@pytest.mark.parametrize("spec, fragment", [
    (TenantSpec("a", -1), "between"), (TenantSpec("a", 0), "between"), (TenantSpec("a", 0.0001), "between"),
    (TenantSpec("a", 5000), "between"), (TenantSpec("a", math.nan), "finite"), (TenantSpec("a", math.inf), "finite"),
    (TenantSpec("a", "0.5"), "finite"), (TenantSpec("a", 0.5, burst=-1), "burst"),
    (TenantSpec("Bad/Id", 0.5), "id: String should match pattern"), (TenantSpec("a", 0.5, pids=(0,)), "pid"),
    # the config's id rule (a DNS label): '_' and '.' are refused as the processor's config refuses them
    (TenantSpec("a_b", 0.5), "id: String should match pattern"), (TenantSpec("a.b"), "id: String should match"),
])
def test_invalid_specs(spec, fragment):
    problems = validate([spec])
    assert problems and fragment in problems[0]


def test_duplicate_ids_refused():
    assert "duplicate" in validate([TenantSpec("a"), TenantSpec("a")])[0]


def _fake_layout(tmp_path, v2_cpu=False, v1=True) -> CgroupLayout:
    for d in ("unified", "cpu", "cpuacct"):
        (tmp_path / d).mkdir()
    return CgroupLayout(v2=tmp_path / "unified", cpu=(tmp_path / "cpu") if v1 else None,
                        cpuacct=(tmp_path / "cpuacct") if v1 else None, v2_cpu=v2_cpu)


def test_layout_detection_from_mounts(tmp_path):
    hybrid = tmp_path / "hybrid"
    hybrid.write_text("cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
                      "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
                      "cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n")
    lay = CgroupLayout.detect(str(hybrid))
    assert (lay.kind, lay.limit_via, str(lay.cpu), str(lay.cpuacct)) == (
        "hybrid", "v1", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpuacct")
    comounted = tmp_path / "co"
    comounted.write_text("cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n")
    lay = CgroupLayout.detect(str(comounted))
    assert lay.kind == "v1" and lay.cpu == lay.cpuacct


def test_fake_v1_tree_diff_apply(tmp_path):
    """No root needed: the same code against plain directories standing in for the hierarchies."""
    mgr = CgroupManager("gw", layout=_fake_layout(tmp_path))
    res = mgr.apply([TenantSpec("a", 0.5), TenantSpec("b")])
    assert res.created == ["a", "b"]
    cpu_a = tmp_path / "cpu" / "gw" / "a"
    assert (cpu_a / "cpu.cfs_quota_us").read_text() == "50000"
    assert (cpu_a / "cpu.cfs_period_us").read_text() == "100000"
    assert (tmp_path / "cpu" / "gw" / "b" / "cpu.cfs_quota_us").read_text() == "-1"
    assert (tmp_path / "unified" / "gw" / "a").is_dir() and (tmp_path / "cpuacct" / "gw" / "a").is_dir()
    assert mgr.cgroup_id("a") == os.stat(tmp_path / "unified" / "gw" / "a").st_ino
    res = mgr.apply([TenantSpec("a", 0.25), TenantSpec("b")])
    assert (res.updated, res.unchanged, res.created) == (["a"], ["b"], [])
    assert (cpu_a / "cpu.cfs_quota_us").read_text() == "25000"


def test_fake_v2_tree_uses_cpu_max(tmp_path):
    lay = _fake_layout(tmp_path, v2_cpu=True, v1=False)
    (lay.v2 / "cgroup.subtree_control").write_text("")
    mgr = CgroupManager("gw", layout=lay)
    mgr.apply([TenantSpec("a", 0.5), TenantSpec("b")])
    assert (lay.v2 / "gw" / "a" / "cpu.max").read_text() == "50000 100000"
    assert (lay.v2 / "gw" / "b" / "cpu.max").read_text() == "max 100000"
    assert (lay.v2 / "cgroup.subtree_control").read_text() == "+cpu"
    (lay.v2 / "gw" / "a" / "cpu.stat").write_text("usage_usec 1500\nnr_periods 4\nnr_throttled 2\nthrottled_usec 70\n")
    assert mgr.usage_ns("a") == 1_500_000
    t = mgr.throttle("a")
    assert (t.nr_periods, t.nr_throttled, t.throttled_ns) == (4, 2, 70_000)


def test_invalid_quota_refused_before_anything_is_written_fake(tmp_path):
    mgr = CgroupManager("gw", layout=_fake_layout(tmp_path))
    with pytest.raises(QuotaError) as e:
        mgr.apply([TenantSpec("ok", 0.5), TenantSpec("bad", -0.5)])
    assert "bad" in str(e.value)
    assert not (tmp_path / "cpu" / "gw").exists() and not (tmp_path / "unified" / "gw").exists()


# --- the real kernel -------------------------------------------------------------------------------

@needs_root
def test_real_limits_and_invalid_refused(cg_name):
    mgr = CgroupManager(cg_name)
    try:
        mgr.apply([TenantSpec("a", 0.5), TenantSpec("b")])
        assert mgr.read_limit("a") == (50_000, 100_000)
        assert mgr.read_limit("b")[0] == -1
        before = sorted(p.name for p in mgr.limit_dir("a").parent.iterdir() if p.is_dir())
        for bad in ([TenantSpec("a", 0.5), TenantSpec("c", math.nan)], [TenantSpec("a", -1)],
                    [TenantSpec("a", 0.0001)], [TenantSpec("a", 2000.0)]):
            with pytest.raises(QuotaError):
                mgr.apply(bad)
        assert mgr.read_limit("a") == (50_000, 100_000)  # untouched
        assert sorted(p.name for p in mgr.limit_dir("a").parent.iterdir() if p.is_dir()) == before  # no "c"
        # diff-apply without restart: change a's limit, make b limited, drop nothing
        res = mgr.apply([TenantSpec("a", 0.25), TenantSpec("b", 1.5)])
        assert sorted(res.updated) == ["a", "b"]
        assert mgr.read_limit("a") == (25_000, 100_000) and mgr.read_limit("b") == (150_000, 100_000)
    finally:
        mgr.close(remove=True)
    assert not mgr.limit_dir("a").parent.exists()


@needs_root
def test_real_recreate_removed_cgroup_and_remove_tenant(cg_name, burners):
    mgr = CgroupManager(cg_name)
    try:
        mgr.apply([TenantSpec("a", 0.3), TenantSpec("b")])
        (pid,) = burners.start(mgr, "a")
        mgr.apply([TenantSpec("a", 0.3, pids=(pid,)), TenantSpec("b")])  # a configured pid: placed again later
        assert pid in mgr.procs("a")
        old_id = mgr.cgroup_id("a")
        # someone removes the tenant's cgroups underneath us (processes must leave first)
        for d, mount in ((mgr.paths("a").v2, mgr.layout.v2), (mgr.paths("a").cpu, mgr.layout.cpu),
                         (mgr.paths("a").cpuacct, mgr.layout.cpuacct)):
            if d is not None:
                (mount / "cgroup.procs").write_text(str(pid))
                d.rmdir()
        assert mgr.check() == {"a": [str(d) for d in mgr.paths("a").dirs()]}
        assert mgr.recreated["a"] == 1
        assert mgr.read_limit("a") == (30_000, 100_000)
        assert pid in mgr.procs("a")
        assert mgr.cgroup_id("a") not in (0, old_id)
        assert mgr.check() == {}  # nothing more to repair
        # dropping a tenant moves its processes out and deletes its cgroups
        res = mgr.apply([TenantSpec("b")])
        assert res.removed == ["a"]
        assert not mgr.paths("a").v2.exists() and not mgr.paths("a").cpu.exists()
        assert "0::/\n" in Path(f"/proc/{pid}/cgroup").read_text()
    finally:
        mgr.close(remove=True)
