"""The agent's Prometheus exposition (ebpf/metrics.py): every documented series, parsed, from one snapshot."""

from __future__ import annotations

import httpx
import pytest

from tests.ebpf.conftest import FLATBUFFERS_REASON
from tests.promtext import collect, parse

pytest.importorskip("flatbuffers", reason=FLATBUFFERS_REASON)

from ebpf.metrics import registry_for, serve  # noqa: E402
from ebpf.snapshot import SnapshotData, TenantSample, UpstreamSample  # noqa: E402
from extproc.stack import free_port  # noqa: E402

pytestmark = pytest.mark.ebpf


class Holder:
    """What the collector reads from the agent: its latest snapshot (`Agent.last`)."""

    def __init__(self, last):
        self.last = last


DATA = SnapshotData(
    tenants=[TenantSample("acme", cpu_used=0.25, cpu_limit=0.2, usage_ns=1_500_000_000, throttled_ns=250_000_000,
                          nr_throttled=7, recreated=1),
             TenantSample("free", cpu_used=0.9, usage_ns=3_000_000_000)],
    upstreams=[UpstreamSample("10.0.0.5", 8000, hist=[0, 2, 3], count=5, sum_us=12, window_count=2, window_mean_us=3.5),
               UpstreamSample("::1", 8443, 10, hist=[1], count=1, sum_us=0)],
    source="ebpf", generation=42)


def test_every_documented_agent_series_with_its_labels_and_value():
    s = collect(registry_for(Holder(DATA)))
    assert s.series("adapter_ebpf_tenant_cpu_used_cpus") == {(("tenant", "acme"),): 0.25, (("tenant", "free"),): 0.9}
    assert s.series("adapter_ebpf_tenant_cpu_limit_cpus") == {(("tenant", "acme"),): 0.2}  # unlimited: absent
    assert s.series("adapter_ebpf_tenant_cpu_seconds_total") == {(("tenant", "acme"),): 1.5, (("tenant", "free"),): 3.0}
    assert s.series("adapter_ebpf_tenant_throttled_seconds_total") == {
        (("tenant", "acme"),): 0.25, (("tenant", "free"),): 0.0}
    assert s.series("adapter_ebpf_tenant_throttled_periods_total") == {
        (("tenant", "acme"),): 7.0, (("tenant", "free"),): 0.0}
    assert s.series("adapter_ebpf_tenant_cgroup_recreated_total") == {
        (("tenant", "acme"),): 1.0, (("tenant", "free"),): 0.0}
    # log2 buckets: slot i holds srtt in [2^(i-1), 2^i) us, le = 2^i us, cumulative, up to the last non-empty slot
    assert s.series("adapter_ebpf_upstream_srtt_seconds_bucket") == {
        (("le", "1e-06"), ("upstream", "10.0.0.5:8000")): 0.0, (("le", "2e-06"), ("upstream", "10.0.0.5:8000")): 2.0,
        (("le", "4e-06"), ("upstream", "10.0.0.5:8000")): 5.0, (("le", "+Inf"), ("upstream", "10.0.0.5:8000")): 5.0,
        (("le", "1e-06"), ("upstream", "[::1]:8443")): 1.0, (("le", "+Inf"), ("upstream", "[::1]:8443")): 1.0}
    assert s.series("adapter_ebpf_upstream_srtt_seconds_count") == {
        (("upstream", "10.0.0.5:8000"),): 5.0, (("upstream", "[::1]:8443"),): 1.0}
    assert s.value("adapter_ebpf_upstream_srtt_seconds_sum", upstream="10.0.0.5:8000") == pytest.approx(12e-6)
    assert s.series("adapter_ebpf_upstream_srtt_window_mean_seconds") == {  # no window samples: absent
        (("upstream", "10.0.0.5:8000"),): pytest.approx(3.5e-6)}
    assert s.series("adapter_ebpf_agent_info") == {(("source", "ebpf"),): 1.0}
    assert s.value("adapter_ebpf_snapshot_generation") == 42
    assert {n for n in s.names()} == {  # nothing undocumented (ebpf/README.md, ebpf/metrics.py)
        "adapter_ebpf_tenant_cpu_used_cpus", "adapter_ebpf_tenant_cpu_limit_cpus", "adapter_ebpf_tenant_cpu_seconds_total",
        "adapter_ebpf_tenant_throttled_seconds_total", "adapter_ebpf_tenant_throttled_periods_total",
        "adapter_ebpf_tenant_cgroup_recreated_total", "adapter_ebpf_upstream_srtt_seconds_bucket",
        "adapter_ebpf_upstream_srtt_seconds_count", "adapter_ebpf_upstream_srtt_seconds_sum",
        "adapter_ebpf_upstream_srtt_window_mean_seconds", "adapter_ebpf_agent_info", "adapter_ebpf_snapshot_generation"}


def test_nothing_is_exposed_before_the_first_snapshot_and_the_http_server_serves_the_same():
    holder = Holder(None)
    assert collect(registry_for(holder)) == {}
    port = free_port()
    server = serve(holder, port)
    try:
        assert parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text) == {}
        holder.last = DATA
        assert parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text) == collect(registry_for(holder))
    finally:
        server.shutdown()
