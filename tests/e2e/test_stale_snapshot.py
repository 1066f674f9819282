"""`spec.tenancy.stalePolicy: reject` end to end: without fresh tenant CPU data, quota tenants get 503.

The tenant agent's snapshot (docs/config.md `spec.tenancy`) is published by the test itself with the
agent's own writer (`ebpf.snapshot.SnapshotWriter`), as a running agent would, then left to age the
way it does when the agent dies: a snapshot older than `staleAfter`, or none at all, is stale.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import wait_metric

pytestmark = pytest.mark.e2e

CHAT = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _config(tmp_path, snapshot) -> str:
    path = tmp_path / "stale.yaml"
    path.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: stale}}
spec:
  modelRef: qwen2.5-finance
  tenancy: {{snapshot: {snapshot}, staleAfter: 1s, stalePolicy: reject}}
  tenants: [{{id: acme, cpu: {{limit: 1}}}}, {{id: globex}}]
  backends: [{{name: llm, endpoints: ["llm.invalid:8000"]}}]
  routes:
    - {{path: /v1/chat/completions, kind: openai}}
""")
    return str(path)


def post(st, tenant: str) -> httpx.Response:
    return httpx.post(f"{st.url}/v1/chat/completions", json=CHAT, headers={"x-tenant-id": tenant}, timeout=10)


def until(st, tenant: str, status: int, within: float = 10.0) -> httpx.Response:
    """Send requests until one gets `status` (the workers see a new snapshot file within milliseconds,
    an aged one as soon as it is older than staleAfter); the last response."""
    deadline = time.monotonic() + within
    while (r := post(st, tenant)).status_code != status and time.monotonic() < deadline:
        time.sleep(0.05)
    return r


def assert_stale_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]  # the openai route's dialect
    assert err["code"] == "quota_data_stale" and err["type"] == "server_error" and err["status"] == 503
    assert err["tenant"] == "acme" and err["route"] == "v1-chat-completions"


def test_reject_policy_refuses_quota_tenants_without_fresh_data(stack_factory, tmp_path):
    from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample

    snapshot = tmp_path / "shm" / "agent.snap"
    st = stack_factory(_config(tmp_path, snapshot), workers=1, simulate=True, agent=False)
    metrics = f"{st.processor_admin_url}/metrics"

    assert_stale_503(post(st, "acme"))  # no snapshot published yet: missing counts as stale
    assert post(st, "globex").status_code == 200  # a tenant without a CPU quota needs no measurements
    assert wait_metric(metrics, "adapter_processor_admission_total", 1, tenant="acme", result="stale") == 1

    writer = SnapshotWriter(snapshot)
    try:
        writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.2, cpu_limit=1.0)], source="ebpf"))
        fresh = until(st, "acme", 200)  # the agent published: admitted
        assert fresh.status_code == 200 and fresh.json()["object"] == "chat.completion"
        assert wait_metric(metrics, "adapter_processor_admission_total", 1, tenant="acme", result="admitted") >= 1

        # the agent stops publishing: once the file is older than staleAfter, acme is refused again
        stale = until(st, "acme", 503)
        assert_stale_503(stale)
        assert post(st, "globex").status_code == 200
        assert wait_metric(metrics, "adapter_processor_admission_total", 2, tenant="acme", result="stale") >= 2

        writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.2, cpu_limit=1.0)], source="ebpf"))
        assert until(st, "acme", 200).status_code == 200  # the agent is back
    finally:
        writer.close(remove=True)
