"""RTT per upstream from tcp:tcp_probe: the histogram of a loopback connection moves when delay is added.

The kernel here has no netem qdisc, so the delay is queueing: a tbf rate limit on the loopback
device of a network namespace this test creates (and deletes), under a bulk transfer. Nothing on the
host's own lo is touched. IPv4 and IPv6.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.ebpf.conftest import FLATBUFFERS_REASON, ebpf_reason, needs_ebpf

pytest.importorskip("flatbuffers", reason=FLATBUFFERS_REASON)

from ebpf.agent import Agent  # noqa: E402
from ebpf.metrics import families  # noqa: E402
from ebpf.rtt import format_log2_hist  # noqa: E402
from ebpf.snapshot import SnapshotReader  # noqa: E402

pytestmark = pytest.mark.ebpf
BULK = Path(__file__).with_name("bulk_tcp.py")
PORT4, PORT6 = 5601, 5602


@pytest.fixture
def netns():
    if ebpf_reason():
        pytest.skip(ebpf_reason())
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            pytest.skip(f"needs iproute2 ({tool})")
    name = f"agwrtt-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        # MTU 1500 so a small tbf bucket passes whole packets (lo defaults to 64 KiB)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "mtu", "1500", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name])  # deletes its lo and the qdisc with it


def _bulk(ns: str, host: str, port: int, seconds: float):
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(BULK), host, str(port), str(seconds)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


def _median_slot(hist) -> int:
    total, acc = sum(hist), 0
    for i, v in enumerate(hist):
        acc += v
        if acc * 2 >= total:
            return i
    return -1


@needs_ebpf
def test_rtt_histogram_moves_when_delay_is_added(netns, tmp_path, capsys):
    agent = Agent([], name=f"agw-test-{os.getpid()}", mode="ebpf", rtt_ports=[PORT4, PORT6],
                  snapshot=tmp_path / "rtt.snap")
    try:
        agent.start()
        reader = SnapshotReader(tmp_path / "rtt.snap", recheck_s=0)

        def hists():
            agent.step()
            return {(u.addr, u.port): (u.hist, u.window_mean_us) for u in reader.current().upstreams}

        _bulk(netns, "127.0.0.1", PORT4, 0.7)
        _bulk(netns, "::1", PORT6, 0.7)
        before = hists()
        subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                        "rate", "20mbit", "burst", "16kb", "latency", "50ms"], check=True)
        _bulk(netns, "127.0.0.1", PORT4, 1.2)
        _bulk(netns, "::1", PORT6, 1.2)
        after = hists()
        snap_families = {f.name: f for f in families(agent.last)}
    finally:
        agent.close(remove_cgroups=True, remove_snapshot=True)
    report = []
    for key in (("127.0.0.1", PORT4), ("::1", PORT6)):
        assert key in before and key in after, (key, sorted(before), sorted(after))
        base = before[key][0]
        delta = [a - b for a, b in zip(after[key][0], base)]
        m0, m1 = _median_slot(base), _median_slot(delta)
        report.append(f"{key}: median slot {m0} (< {1 << m0} us) -> {m1} (< {1 << m1} us) with tbf\n"
                      f"without delay:\n{format_log2_hist(base)}\nwith tbf:\n{format_log2_hist(delta)}")
        assert m1 >= m0 + 5, "srtt should rise by > 32x under the rate limit's queue"
        assert (1 << m1) >= 4000, "queueing under 20 Mbit/s tbf should give milliseconds of srtt"
    with capsys.disabled():
        print("\n" + "\n".join(report))
    hist = snap_families["adapter_ebpf_upstream_srtt_seconds"]
    ups = {s.labels["upstream"] for s in hist.samples}
    assert {f"127.0.0.1:{PORT4}", f"[::1]:{PORT6}"} <= ups
