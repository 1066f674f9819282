"""The agent against the real kernel: eBPF CPU accounting vs the kernel's counters, a CPU quota that
holds, the polling fallback, diff-applied reloads, recreated cgroups, metrics and the operator views."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pytest

from tests.ebpf.conftest import FLATBUFFERS_REASON, Burners, ebpf_reason, needs_ebpf, needs_root
from tests.promtext import parse

pytest.importorskip("flatbuffers", reason=FLATBUFFERS_REASON)

from ebpf import agent as agent_mod  # noqa: E402
from ebpf.agent import Agent  # noqa: E402
from ebpf.cgroups import CgroupLayout, CgroupManager, QuotaError, TenantSpec  # noqa: E402
from ebpf.snapshot import SnapshotReader  # noqa: E402
from extproc.stack import free_port  # noqa: E402

pytestmark = pytest.mark.ebpf
LIMIT = 0.2
RUN_S = 5.0


def _busy_cpu_s() -> float:
    """Seconds of CPU the host spent not idle (user, nice, system, irq, softirq, steal), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def burn_run(tmp_path_factory):
    """Two tenants, each with two busy loops, for RUN_S seconds under the eBPF agent:
    `lim` has a LIMIT CPU quota, `free` none. Returns the numbers the tests below check."""
    if (why := ebpf_reason()):
        pytest.skip(why)
    name = f"agw-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    agent = Agent([TenantSpec("lim", LIMIT), TenantSpec("free")], name=name, mode="ebpf",
                  snapshot=tmp_path_factory.mktemp("snap") / "a.snap", metrics_port=port)
    burners = Burners()
    stop = threading.Event()
    thread = None
    try:
        agent.start()
        mgr = agent.cgroups
        burners.start(mgr, "lim", 2)
        burners.start(mgr, "free", 2)
        thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
        thread.start()
        time.sleep(0.5)  # let the burners get going

        def read():
            agent.step()  # under the agent's lock: eBPF totals and kernel counters read back to back
            return (time.monotonic(), {t: agent.tenants[t].total_ns for t in ("lim", "free")},
                    {t: mgr.usage_ns(t) for t in ("lim", "free")}, {t: mgr.throttle(t) for t in ("lim", "free")},
                    _busy_cpu_s())

        t0, e0, k0, th0, b0 = read()
        time.sleep(RUN_S)
        t1, e1, k1, th1, b1 = read()
        dt = t1 - t0
        snap = SnapshotReader(agent.snapshot_path, recheck_s=0).current()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        yield {
            "dt": dt,
            "ebpf": {t: (e1[t] - e0[t]) / 1e9 for t in e0},
            "kernel": {t: (k1[t] - k0[t]) / 1e9 for t in k0},
            "throttled": {t: th1[t].nr_throttled - th0[t].nr_throttled for t in th0},
            "busy": (b1 - b0) / dt,  # CPUs busy (or stolen by the hypervisor) on the whole host
            "snap": {t.id: (t.cpu_used, t.cpu_limit, t.nr_throttled, t.nr_procs) for t in snap},
            "source": snap.source,
            "metrics": metrics,
        }
    finally:
        stop.set()
        if thread is not None:
            thread.join(5)
        burners.stop()
        agent.close(remove_cgroups=True, remove_snapshot=True)


@needs_ebpf
def test_ebpf_cpu_matches_the_cgroup_counter(burn_run):
    r = burn_run
    print(f"\nCPU seconds over {r['dt']:.2f} s: eBPF {r['ebpf']}, cpuacct {r['kernel']}")
    assert r["source"] == "ebpf"
    for tenant in ("lim", "free"):
        assert r["ebpf"][tenant] == pytest.approx(r["kernel"][tenant], rel=0.05), tenant


@needs_ebpf
def test_quota_holds_and_unlimited_tenant_gets_the_rest(burn_run):
    r = burn_run
    lim = r["kernel"]["lim"] / r["dt"]
    free = r["kernel"]["free"] / r["dt"]
    lim_ebpf = r["ebpf"]["lim"] / r["dt"]
    ncpu = os.cpu_count() or 1
    other = max(0.0, r["busy"] - lim - free)
    print(f"\nover {r['dt']:.2f} s: lim {lim:.3f} CPU (eBPF {lim_ebpf:.3f}), free {free:.3f} CPU, other processes "
          f"{other:.3f} CPU of {ncpu}; periods throttled {r['throttled']}; snapshot {r['snap']}")
    assert lim == pytest.approx(LIMIT, abs=0.03)
    assert lim_ebpf == pytest.approx(LIMIT, abs=0.03)
    assert r["throttled"]["lim"] > 0 and r["throttled"]["free"] == 0
    # "the rest": the unlimited tenant is never throttled and, with whatever else runs on the host,
    # uses all the capacity the limited tenant leaves (no CPU idles while its burners want it).
    assert free + other >= 0.9 * (ncpu - LIMIT), "capacity left idle while the unlimited tenant wanted it"
    # same demand (two busy loops each); only the limited one is held back. Compared only when the host's
    # other processes left the unlimited tenant room to show it (under make test's parallel workers they
    # once took 1.53 of 2 CPUs, leaving it 0.27; the no-idle check above still held)
    left = ncpu - LIMIT - other
    if left >= 3 * LIMIT:
        assert free > 1.5 * lim, f"the unlimited tenant got {free:.3f} CPU with {left:.3f} left to it"
    used, limit, nr_throttled, nr_procs = r["snap"]["lim"]
    assert used == pytest.approx(LIMIT, abs=0.05) and limit == LIMIT and nr_throttled > 0 and nr_procs == 2
    assert r["snap"]["free"][1] is None


@needs_ebpf
def test_metrics_exposed(burn_run):
    m = parse(burn_run["metrics"])
    tenants = {(("tenant", "lim"),), (("tenant", "free"),)}
    assert set(m.series("adapter_ebpf_tenant_cpu_used_cpus")) == tenants
    assert m.value("adapter_ebpf_tenant_cpu_used_cpus", tenant="lim") == pytest.approx(LIMIT, abs=0.05)
    assert m.series("adapter_ebpf_tenant_cpu_limit_cpus") == {(("tenant", "lim"),): LIMIT}  # unlimited: absent
    for name in ("adapter_ebpf_tenant_cpu_seconds_total", "adapter_ebpf_tenant_throttled_seconds_total",
                 "adapter_ebpf_tenant_throttled_periods_total", "adapter_ebpf_tenant_cgroup_recreated_total"):
        assert set(m.series(name)) == tenants, name
    assert m.value("adapter_ebpf_tenant_cpu_seconds_total", tenant="free") > 0
    assert m.value("adapter_ebpf_tenant_throttled_periods_total", tenant="lim") > 0  # held at its quota
    assert m.value("adapter_ebpf_tenant_throttled_periods_total", tenant="free") == 0
    assert m.value("adapter_ebpf_tenant_throttled_seconds_total", tenant="free") == 0
    assert m.series("adapter_ebpf_agent_info") == {(("source", "ebpf"),): 1.0}
    assert m.value("adapter_ebpf_snapshot_generation") >= 1


# --- fallback ---------------------------------------------------------------------------------------

def _count_fallback_warnings(caplog) -> int:
    return sum(1 for r in caplog.records if r.name == "ebpf.agent" and r.levelno == logging.WARNING
               and "eBPF unavailable" in r.getMessage())


@needs_root
def test_polling_fallback_forced_warns_once(cg_name, burners, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    agent = Agent([TenantSpec("t", 0.3)], name=cg_name, mode="poll", snapshot=tmp_path / "p.snap")
    try:
        agent.start()
        burners.start(agent.cgroups, "t", 2)
        for _ in range(12):
            agent.step()
            time.sleep(0.1)
        snap = SnapshotReader(tmp_path / "p.snap").current()
        t = snap.tenant("t")
        assert snap.source == "poll" and "polling forced" in snap.note
        # two busy loops under a 0.3 CPU limit, as read from cpuacct.usage (less if the host is busy)
        assert 0.1 < t.cpu_used < 0.3 + 0.05
        assert t.usage_ns > 0 and (t.nr_throttled > 0 or t.cpu_used < 0.25)
        assert _count_fallback_warnings(caplog) == 1
    finally:
        agent.close(remove_cgroups=True)


@needs_root
def test_fallback_when_ebpf_cannot_load(cg_name, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(agent_mod, "ebpf_unavailable", lambda: "no BCC (simulated)")
    agent = Agent([TenantSpec("t")], name=cg_name, snapshot=tmp_path / "p.snap", rtt_ports=[8000])
    try:
        agent.start()
        for _ in range(3):
            agent.step()
        assert agent.source == "poll" and agent.rtt is None
        assert _count_fallback_warnings(caplog) == 1
        assert "no BCC (simulated)" in SnapshotReader(tmp_path / "p.snap").current().note
        with pytest.raises(Exception, match="simulated"):
            Agent([TenantSpec("t")], name=cg_name, mode="ebpf", snapshot=tmp_path / "q.snap").start()
    finally:
        agent.close(remove_cgroups=True)


def test_polling_window_math_without_root(tmp_path):
    """Fake cgroup dirs: the window arithmetic of the polling path, runnable anywhere."""
    for d in ("unified", "cpu", "cpuacct"):
        (tmp_path / d).mkdir()
    lay = CgroupLayout(v2=tmp_path / "unified", cpu=tmp_path / "cpu", cpuacct=tmp_path / "cpuacct")
    mgr = CgroupManager("gw", layout=lay)
    agent = Agent([TenantSpec("t", 1.0)], name="gw", mode="poll", cgroups=mgr, snapshot=tmp_path / "s.snap",
                  interval=0.05, window=10)
    usage = tmp_path / "cpuacct" / "gw" / "t" / "cpuacct.usage"
    try:
        agent.start()
        usage.write_text("0")
        agent.step()
        t0 = time.monotonic()
        time.sleep(0.2)
        usage.write_text(str(int((time.monotonic() - t0) * 0.5e9)))  # 0.5 CPU since the step
        d = agent.step()
        (t,) = d.tenants
        assert t.cpu_used == pytest.approx(0.5 * (time.monotonic() - t0) / ((t.window_end_mono_ns - t.window_start_mono_ns) / 1e9), rel=0.2)
        usage.write_text("0")  # counter reset (cgroup recreated by someone): no negative use
        assert agent.step().tenants[0].usage_ns == t.usage_ns
    finally:
        agent.close()


# --- reload and repair -----------------------------------------------------------------------------

@needs_root
def test_reload_diff_applies_and_refuses_invalid(cg_name, tmp_path):
    agent = Agent([TenantSpec("a", 0.5), TenantSpec("b")], name=cg_name, mode="poll", snapshot=tmp_path / "s.snap")
    try:
        agent.start()
        r = SnapshotReader(tmp_path / "s.snap", recheck_s=0)
        agent.reload([TenantSpec("a", 0.3), TenantSpec("c", 1.0)])
        agent.step()
        assert agent.cgroups.read_limit("a") == (30_000, 100_000)
        assert sorted(r.current().tenants) == ["a", "c"] and r.current().tenant("a").cpu_limit == 0.3
        assert not agent.cgroups.paths("b").v2.exists()
        with pytest.raises(QuotaError):
            agent.reload([TenantSpec("a", -2)])
        agent.step()
        assert agent.cgroups.read_limit("a") == (30_000, 100_000) and sorted(r.current().tenants) == ["a", "c"]
    finally:
        agent.close(remove_cgroups=True)


@needs_root
def test_removed_cgroup_is_recreated_and_reported(cg_name, tmp_path, caplog):
    agent = Agent([TenantSpec("a", 0.5)], name=cg_name, mode="poll", snapshot=tmp_path / "s.snap")
    try:
        agent.start()
        old = agent.tenants["a"].cgroup_id
        for d in agent.cgroups.paths("a").dirs():
            d.rmdir()
        agent.step()
        t = SnapshotReader(tmp_path / "s.snap", recheck_s=0).current().tenant("a")
        assert t.recreated == 1 and t.cgroup_id not in (0, old)
        assert agent.cgroups.read_limit("a") == (50_000, 100_000)
        assert any("recreated" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert agent.recreated_events and "a" in agent.recreated_events[0]
    finally:
        agent.close(remove_cgroups=True)


# --- command line ----------------------------------------------------------------------------------

def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("module, marker", [("ebpf.agent", "TRACEPOINT_PROBE(sched, sched_switch)"),
                                            ("ebpf.quota", "TRACEPOINT_PROBE(sched, sched_switch)"),
                                            ("ebpf.rtt", "TRACEPOINT_PROBE(tcp, tcp_probe)")])
def test_ebpf_flag_prints_the_program(module, marker):
    p = _run(module, "--ebpf")
    assert p.returncode == 0 and marker in p.stdout


@pytest.mark.parametrize("module", ["ebpf.agent", "ebpf.quota", "ebpf.rtt"])
def test_help_has_examples(module):
    p = _run(module, "-h")
    assert p.returncode == 0 and "examples:" in p.stdout


def test_agent_cli_refuses_invalid_quota():
    p = _run("ebpf.agent", "--tenants", "a=-1,b=abc", "--poll")
    assert p.returncode == 2
    assert "invalid tenants" in p.stderr and "a" in p.stderr and "b" in p.stderr


@needs_root
def test_agent_cli_runs_and_views_read_it(cg_name, tmp_path):
    snap = tmp_path / "cli.snap"
    proc = subprocess.Popen([sys.executable, "-m", "ebpf.agent", "--tenants", "acme=0.5:0.2,free", "--name", cg_name,
                             "--snapshot", str(snap), "--poll", "--cleanup"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not snap.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert snap.exists(), proc.stdout.read() if proc.poll() is not None else "no snapshot"
        q = _run("ebpf.quota", "--snapshot", str(snap))
        assert q.returncode == 0, q.stderr
        assert "acme" in q.stdout and "0.500" in q.stdout and "20%" in q.stdout and "source=poll" in q.stdout
        j = _run("ebpf.quota", "--snapshot", str(snap), "--json")
        assert '"id": "acme"' in j.stdout
        rt = _run("ebpf.rtt", "--snapshot", str(snap))
        assert rt.returncode == 0 and "no upstream RTT samples" in rt.stdout
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert out.count("eBPF unavailable") == 1
    assert not snap.exists()  # --cleanup
    assert not CgroupManager(cg_name).paths("acme").v2.exists()


def test_views_without_agent(tmp_path):
    p = _run("ebpf.quota", "--snapshot", str(tmp_path / "none.snap"))
    assert p.returncode == 1 and "is the agent running" in p.stderr


def test_quota_view_reads_admissions_from_processor_metrics(tmp_path):
    import http.server

    from ebpf.quota import fetch_requests, render
    from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample

    text = (b'# TYPE adapter_processor_admission_total counter\n'
            b'adapter_processor_admission_total{tenant="acme",result="admitted"} 12.0\n'
            b'adapter_processor_admission_total{tenant="acme",result="rejected"} 3.0\n')

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        req = fetch_requests(f"http://127.0.0.1:{srv.server_port}/metrics")
    finally:
        srv.shutdown()
        srv.server_close()
    assert req == {"acme": {"admitted": 12.0, "rejected": 3.0}}
    SnapshotWriter(tmp_path / "s.snap").write(SnapshotData(
        tenants=[TenantSample("acme", cpu_used=0.6, cpu_limit=0.5, burst=0.1)], source="ebpf"))
    out = render(SnapshotReader(tmp_path / "s.snap").current(), req)
    row = next(line for line in out.splitlines() if line.startswith("acme"))
    assert row.split()[-3:] == ["12", "3", "!"]  # admitted, rejected, over quota
    assert fetch_requests("http://127.0.0.1:9/metrics") == {}  # unreachable: no numbers, no error
