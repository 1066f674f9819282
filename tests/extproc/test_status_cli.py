"""`adapterctl status`'s tenants part (extproc/status_cli.py): each configured tenant's CPU quota from the
config and the tenant agent's live numbers from a real published snapshot (ebpf/snapshot.py), pretty and
as JSON; "not running" without a snapshot."""

from __future__ import annotations

from extproc.config.loader import load_text
from extproc.status_cli import pretty, tenants_view


def _snap(tmp_path):
    return load_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  tenancy: {{source: header, header: x-tenant-id, snapshot: {tmp_path / "agent.snap"}}}
  tenants:
    - {{id: acme, cpu: {{limit: 1.5, burst: 0.2}}}}
    - {{id: globex}}
  backends: [{{name: llm, kind: vllm, endpoints: ["127.0.0.1:9"]}}]
  routes: [{{path: /v1/chat/completions, kind: openai}}]
""", str(tmp_path / "gw.yaml"))


def test_tenants_show_their_quota_and_the_agents_live_numbers(tmp_path):
    from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample

    snap = _snap(tmp_path)
    doc = tenants_view(snap)
    assert doc["agent"] == "not running (no snapshot)"
    assert [t["cpu_quota"] for t in doc["tenants"]] == [{"limit": 1.5, "burst": 0.2}, None]
    SnapshotWriter(tmp_path / "agent.snap").write(SnapshotData(source="ebpf", tenants=[
        TenantSample(id="acme", cpu_used=1.9, cpu_limit=1.5, burst=0.2, nr_throttled=3, admitted=7, rejected=2)]))
    doc = tenants_view(snap)
    assert doc["agent"]["source"] == "ebpf" and doc["agent"]["stale"] is False
    acme, globex = doc["tenants"]
    assert acme["live"]["cpu_used"] == 1.9 and acme["live"]["over_quota"] is True  # 1.9 > 1.5 * 1.2
    assert (acme["live"]["admitted"], acme["live"]["rejected"]) == (7, 2)
    assert globex["live"] is None  # configured, not (yet) seen by the agent
    text = pretty({"config": {"generation": 1, "digest": "d", "source": "f", "workers": []}, **doc})
    assert "acme: quota 1.5 CPU (+20% burst); cpu_used=1.900 cpu_limit=1.500 over_quota=True" in text
    assert "admitted=7 rejected=2" in text
    assert "globex: quota unlimited; no live numbers" in text
