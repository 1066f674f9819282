"""Prometheus exposition of the agent's numbers (its own registry and port).

What: a collector that turns the agent's latest snapshot (`Agent.last`) into metrics at scrape time:
  adapter_ebpf_tenant_cpu_used_cpus{tenant}             gauge: mean CPUs over the sliding window
  adapter_ebpf_tenant_cpu_limit_cpus{tenant}            gauge: configured limit (unlimited tenants: absent)
  adapter_ebpf_tenant_cpu_seconds_total{tenant}         counter: CPU time the agent counted
  adapter_ebpf_tenant_throttled_seconds_total{tenant}   counter: kernel CFS throttled time
  adapter_ebpf_tenant_throttled_periods_total{tenant}   counter: CFS periods in which it was throttled
  adapter_ebpf_tenant_cgroup_recreated_total{tenant}    counter: cgroup found removed and recreated
  adapter_ebpf_upstream_srtt_seconds{upstream}          histogram: TCP smoothed RTT per remote addr:port
                                                        (log2 buckets: le = 2^i microseconds)
  adapter_ebpf_upstream_srtt_window_mean_seconds{upstream}  gauge: mean srtt over the window
  adapter_ebpf_agent_info{source}                       1; source = ebpf or poll
  adapter_ebpf_snapshot_generation                      gauge
Label values are bounded: tenants come from the config, upstreams from the watched ports.
Why a collector: values come from the agent's snapshot; nothing is double-booked in client objects.
Cost: only at scrape time, proportional to tenants + upstreams x 32 buckets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ebpf.snapshot import SnapshotData


def _endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def families(data: SnapshotData | None) -> list:
    """Metric families for one snapshot (empty list before the first sample)."""
    if data is None:
        return []
    used = GaugeMetricFamily("adapter_ebpf_tenant_cpu_used_cpus", "Mean CPUs used over the window", labels=["tenant"])
    limit = GaugeMetricFamily("adapter_ebpf_tenant_cpu_limit_cpus", "Configured CPU limit", labels=["tenant"])
    secs = CounterMetricFamily("adapter_ebpf_tenant_cpu_seconds", "CPU time counted by the agent", labels=["tenant"])
    thr = CounterMetricFamily("adapter_ebpf_tenant_throttled_seconds", "CFS throttled time", labels=["tenant"])
    thp = CounterMetricFamily("adapter_ebpf_tenant_throttled_periods", "CFS periods throttled", labels=["tenant"])
    rec = CounterMetricFamily("adapter_ebpf_tenant_cgroup_recreated", "Tenant cgroup found removed and recreated",
                              labels=["tenant"])
    for t in data.tenants:
        used.add_metric([t.id], t.cpu_used)
        if t.cpu_limit > 0:
            limit.add_metric([t.id], t.cpu_limit)
        secs.add_metric([t.id], t.usage_ns / 1e9)
        thr.add_metric([t.id], t.throttled_ns / 1e9)
        thp.add_metric([t.id], t.nr_throttled)
        rec.add_metric([t.id], t.recreated)
    hist = HistogramMetricFamily("adapter_ebpf_upstream_srtt_seconds", "TCP smoothed RTT per upstream (tcp_probe)",
                                 labels=["upstream"])
    wmean = GaugeMetricFamily("adapter_ebpf_upstream_srtt_window_mean_seconds", "Mean srtt over the window",
                              labels=["upstream"])
    for u in data.upstreams:
        ep = _endpoint(u.addr, u.port)
        last = max((i for i, v in enumerate(u.hist) if v), default=0)
        cum, buckets = 0, []
        for i in range(last + 1):
            cum += u.hist[i]
            buckets.append((repr((1 << i) / 1e6), cum))
        buckets.append(("+Inf", sum(u.hist)))  # the histogram's own count (stats may lag a sample)
        hist.add_metric([ep], buckets, u.sum_us / 1e6)
        if u.window_count:
            wmean.add_metric([ep], u.window_mean_us / 1e6)
    info = GaugeMetricFamily("adapter_ebpf_agent_info", "Agent state", labels=["source"])
    info.add_metric([data.source], 1)
    gen = GaugeMetricFamily("adapter_ebpf_snapshot_generation", "Snapshot generation last published")
    gen.add_metric([], data.generation)
    return [used, limit, secs, thr, thp, rec, hist, wmean, info, gen]


class AgentCollector:
    def __init__(self, agent):
        self.agent = agent

    def collect(self):
        yield from families(self.agent.last)


def registry_for(agent) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    return reg


def serve(agent, port: int, addr: str = "127.0.0.1"):
    """Start the metrics HTTP server in a daemon thread; returns the server (call .shutdown())."""
    server, _thread = start_http_server(port, addr=addr, registry=registry_for(agent))
    return server
