"""Tenant isolation: per-tenant cgroups and CPU limits, eBPF CPU accounting and TCP RTT, and the
shared-memory snapshot the processor reads. See ebpf/README.md.

Modules: agent (the loop, `python -m ebpf.agent`), cgroups (CgroupManager), programs (the BCC
programs), snapshot (FlatBuffers writer and zero-copy SnapshotReader), tenants (tenant lists),
metrics (Prometheus), quota and rtt (operator views, `python -m ebpf.quota` / `python -m ebpf.rtt`).
"""
