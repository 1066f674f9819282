"""Tenant identity and admission control against a real snapshot file written by the agent's writer."""

from __future__ import annotations

import time

import orjson
import pytest

from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample
from extproc.config.loader import load_text
from extproc.stages.admit import Admit
from extproc.types import HttpMessage, Phase, Reject, RequestState


def config(snapshot_path, stale_policy="admit") -> str:
    return f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  tenancy: {{snapshot: "{snapshot_path}", staleAfter: 2s, stalePolicy: {stale_policy}, retryAfter: 3}}
  tenants:
    - {{id: acme, cpu: {{limit: 0.2, burst: 0.5}}}}
    - {{id: globex, cpu: {{limit: 1}}}}
    - {{id: free}}
  backends: [{{name: b, endpoints: ["127.0.0.1:9"]}}]
  routes:
    - {{path: /p}}
    - {{path: /internal, policy: {{tenantHeader: x-team}}}}
"""


@pytest.fixture
def writer(tmp_path):
    w = SnapshotWriter(tmp_path / "agent.snap")
    yield w
    w.close(remove=True)


def publish(writer, **used):
    writer.write(SnapshotData(tenants=[TenantSample(id=t, cpu_used=u) for t, u in used.items()], source="ebpf"))


def admit(snap, tenant, stage=None, route="p"):
    st = RequestState(snapshot=snap, route=snap.routes[route], started=0.0, tenant=tenant, request_id="r")
    return (stage or Admit()).on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={})), st


def test_identity_is_required_and_must_be_known(writer):
    snap = load_text(config(writer.path))
    v, _ = admit(snap, None)
    assert isinstance(v, Reject) and v.status == 401 and b"x-tenant-id" in v.body
    v, _ = admit(snap, None, route="internal")
    assert b"x-team" in v.body  # the route's trusted header is named
    v, st = admit(snap, "initech")
    assert v.status == 403 and b"initech" in v.body and st.tenant is None
    assert admit(snap, "free")[0] is None  # a tenant without a quota is always admitted


def test_over_quota_is_429_naming_tenant_and_quota_and_others_are_unaffected(writer):
    snap = load_text(config(writer.path))
    stage = Admit()
    publish(writer, acme=0.31, globex=0.9)  # acme: 0.2 * 1.5 = 0.3 allowed
    v, _ = admit(snap, "acme", stage)
    assert isinstance(v, Reject) and v.status == 429 and v.retry_after == 3
    err = orjson.loads(v.body)["error"]
    assert err["tenant"] == "acme" and err["cpu_limit"] == 0.2 and err["cpu_used"] == 0.31
    assert admit(snap, "globex", stage)[0] is None
    time.sleep(0.01)  # past the reader's re-check interval
    publish(writer, acme=0.29, globex=0.9)  # recovered
    assert admit(snap, "acme", stage)[0] is None


def test_a_tenant_throttled_at_its_cap_is_over_quota(writer):
    snap = load_text(config(writer.path))
    now = time.monotonic_ns()
    window = dict(window_start_mono_ns=now - 10**9, window_end_mono_ns=now)
    # globex (burst 0) at its cap of 1 CPU, throttled 30% of the window: wants more than its quota
    writer.write(SnapshotData(tenants=[TenantSample(id="globex", cpu_used=1.0, throttled_window_ns=3 * 10**8,
                                                    **window)]))
    v, _ = admit(load_text(config(writer.path)), "globex")
    assert v.status == 429 and orjson.loads(v.body)["error"]["throttled_share"] == 0.3
    time.sleep(0.01)
    # acme (burst 0.5) may be throttled up to half the window
    writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.2, throttled_window_ns=3 * 10**8,
                                                    **window)]))
    assert admit(snap, "acme")[0] is None


def test_stale_or_missing_snapshot_follows_the_policy(writer, tmp_path):
    admit_snap = load_text(config(tmp_path / "never-written.snap"))
    v, st = admit(admit_snap, "acme")
    assert v is None and st.quota_stale
    reject_snap = load_text(config(tmp_path / "never-written.snap", stale_policy="reject"))
    v, _ = admit(reject_snap, "acme")
    assert v.status == 503 and v.reason == "quota_data_stale"
    # an old snapshot (agent dead for longer than staleAfter) counts as stale, even when over quota
    writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=5.0)],
                              written_mono_ns=time.monotonic_ns() - 10 * 10**9))
    v, st = admit(load_text(config(writer.path)), "acme")
    assert v is None and st.quota_stale


def test_config_checks_for_tenancy():
    base = config("/tmp/x.snap")
    jwt_without_block = base.replace("tenancy: {", "tenancy: {source: jwt, ")
    from extproc.config.loader import ConfigError

    with pytest.raises(ConfigError, match="source: jwt needs a jwt block"):
        load_text(jwt_without_block)
    with pytest.raises(ConfigError, match="CPU limit must be between 1m"):
        load_text(base.replace("limit: 0.2", "limit: -1"))
