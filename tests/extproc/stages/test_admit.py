"""Tenant identity and admission control against a real snapshot file written by the agent's writer."""

from __future__ import annotations

import logging
import re
import time

import orjson
import pytest

from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample
from extproc.config.loader import load_text
from extproc.runtime import Runtime
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


def admit_once_read(snap, tenant, seen, stage=None):
    """`admit()` once the stage's decision comes from the newest publication, which `seen(verdict, state)`
    recognises (the reader re-stats the file at most every 5 ms, so the first calls may still see the
    one before); bounded."""
    deadline = time.monotonic() + 5
    while True:
        verdict, st = admit(snap, tenant, stage)
        if seen(verdict, st):
            return verdict, st
        assert time.monotonic() < deadline, "the stage never read the new publication"
        time.sleep(0.001)


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
    publish(writer, acme=0.29, globex=0.9)  # recovered
    v, st = admit_once_read(snap, "acme", lambda v, st: v is None, stage)
    assert not st.quota_stale  # admitted on its measurement, not for want of one


def test_a_tenant_throttled_at_its_cap_is_over_quota(writer):
    snap = load_text(config(writer.path))
    now = time.monotonic_ns()
    window = dict(window_start_mono_ns=now - 10**9, window_end_mono_ns=now)
    # globex (burst 0) at its cap of 1 CPU, throttled 30% of the window: wants more than its quota
    writer.write(SnapshotData(tenants=[TenantSample(id="globex", cpu_used=1.0, throttled_window_ns=3 * 10**8,
                                                    **window)]))
    v, _ = admit(load_text(config(writer.path)), "globex")
    assert v.status == 429 and orjson.loads(v.body)["error"]["throttled_share"] == 0.3
    # acme (burst 0.5) may be throttled up to half the window
    writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.2, throttled_window_ns=3 * 10**8,
                                                    **window)]))
    # the publication before has no acme (a stale reading, admitted by the policy): wait for this one
    v, st = admit_once_read(snap, "acme", lambda v, st: not st.quota_stale)
    assert v is None


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


def sample(writer, tenant: str, **fields):
    writer.write(SnapshotData(tenants=[TenantSample(id=tenant, **fields)], source="ebpf"))


def test_refusals_carry_their_codes_and_messages(writer, tmp_path):
    snap = load_text(config(writer.path))
    v, _ = admit(snap, None)
    assert (v.status, v.code, v.fields, v.retry_after) == (401, "tenant_required", {}, None)
    assert v.message == "this route serves tenants: the request carries no tenant (expected from x-tenant-id)"
    v, _ = admit(snap, "initech")
    assert (v.status, v.code, v.fields) == (403, "unknown_tenant", {})
    assert v.message == "tenant 'initech' is not configured on this gateway"
    v, st = admit(load_text(config(tmp_path / "missing.snap", stale_policy="reject")), "acme")
    assert (v.status, v.code, v.fields) == (503, "quota_data_stale", {"tenant": "acme"}) and st.quota_stale
    assert v.message == "tenant CPU measurements are unavailable and this gateway refuses requests without them"


def test_tenancy_off_admits_anyone():
    snap = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: t}
spec:
  backends: [{name: b, endpoints: ["127.0.0.1:9"]}]
  routes: [{path: /p}]
""")
    assert admit(snap, None)[0] is None and admit(snap, "anyone")[0] is None


def test_over_quota_names_every_number(writer):
    now = time.monotonic_ns()
    sample(writer, "acme", cpu_used=0.312345, throttled_window_ns=123456, window_start_mono_ns=now - 10**6,
           window_end_mono_ns=now)
    v, st = admit(load_text(config(writer.path)), "acme")
    assert isinstance(v, Reject) and (v.status, v.code, v.retry_after) == (429, "tenant_over_quota", 3)
    assert v.fields == {"tenant": "acme", "cpu_used": 0.3123, "throttled_share": 0.1235, "cpu_limit": 0.2,
                        "burst": 0.5}
    assert v.message == ("tenant acme used 0.312 CPU over the last window and was throttled 12% of it; "
                         "its quota is 0.2 CPU (+50% burst)")
    assert st.quota_stale is False


def test_use_at_the_allowance_and_throttling_at_the_burst_are_admitted(writer):
    now = time.monotonic_ns()
    sample(writer, "globex", cpu_used=1.0)  # limit 1, burst 0: exactly the allowance
    assert admit(load_text(config(writer.path)), "globex")[0] is None
    sample(writer, "acme", cpu_used=0.1, throttled_window_ns=5 * 10**8, window_start_mono_ns=now - 10**9,
           window_end_mono_ns=now)  # throttled exactly burst (50%) of the window
    assert admit(load_text(config(writer.path)), "acme")[0] is None


def test_an_empty_window_counts_throttling_against_one_nanosecond(writer):
    sample(writer, "acme", cpu_used=0.1, throttled_window_ns=1)  # window start == end == 0
    v, _ = admit(load_text(config(writer.path)), "acme")
    assert isinstance(v, Reject) and v.code == "tenant_over_quota" and v.fields["throttled_share"] == 1.0


def test_stale_after_comes_from_the_config(writer):
    # 1.5 s old: fresh for this config's staleAfter (2 s), though older than the reader's default
    writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=5.0)],
                              written_mono_ns=time.monotonic_ns() - 15 * 10**8))
    v, st = admit(load_text(config(writer.path)), "acme")
    assert isinstance(v, Reject) and v.code == "tenant_over_quota" and st.quota_stale is False


def test_a_tenant_missing_from_the_snapshot_is_treated_as_stale(writer):
    sample(writer, "globex", cpu_used=0.1)
    v, st = admit(load_text(config(writer.path, stale_policy="reject")), "acme")
    assert isinstance(v, Reject) and v.code == "quota_data_stale" and st.quota_stale


def test_each_snapshot_file_has_its_reader_kept_in_the_runtime(writer, tmp_path):
    runtime = Runtime()
    over = load_text(config(writer.path))
    sample(writer, "acme", cpu_used=5.0)
    other = SnapshotWriter(tmp_path / "other.snap")
    try:
        other.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.01)]))
        under = load_text(config(other.path))

        def run(snap, stage):
            st = RequestState(snapshot=snap, route=snap.routes["p"], started=0.0, tenant="acme", runtime=runtime)
            return stage.on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={}))

        stage = Admit()
        assert isinstance(run(over, stage), Reject)
        assert run(under, stage) is None  # another file: read with its own reader
        memo = runtime.cache("admit")
        readers = {k: r for k, r in memo.items() if isinstance(k, tuple)}
        assert set(readers) == {(str(writer.path), 2.0), (str(other.path), 2.0)}
        assert isinstance(run(over, Admit()), Reject)  # a new stage (a reload) reuses the worker's reader
        assert {k: r for k, r in memo.items() if isinstance(k, tuple)} == readers
        assert all(readers[k] is memo[k] for k in readers)
    finally:
        other.close(remove=True)


def test_a_stale_snapshot_is_logged_once_until_a_fresh_one_is_seen(writer, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.stages.admit")
    missing = tmp_path / "missing.snap"
    stale, fresh = load_text(config(missing)), load_text(config(writer.path))
    sample(writer, "acme", cpu_used=0.01)
    runtime = Runtime()

    def run(snap):
        st = RequestState(snapshot=snap, route=snap.routes["p"], started=0.0, tenant="acme", runtime=runtime)
        return Admit().on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={}))  # a stage per call

    def warnings():
        return [r.getMessage() for r in caplog.records]

    assert run(stale) is None and run(stale) is None
    expected = f"tenant agent snapshot {missing} is missing; applying stalePolicy=admit"
    assert warnings() == [expected] and runtime.cache("admit")["warned_stale"] is True
    assert run(fresh) is None and run(stale) is None  # a fresh reading in between: stale is news again
    assert warnings() == [expected, expected]
    own = Admit()  # without a runtime the stage keeps its own memo
    for _ in range(2):
        st = RequestState(snapshot=stale, route=stale.routes["p"], started=0.0, tenant="acme")
        assert own.on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={})) is None
    assert warnings() == [expected] * 3


def test_an_old_snapshot_is_logged_with_its_age(writer, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.stages.admit")
    writer.write(SnapshotData(tenants=[TenantSample(id="acme", cpu_used=0.01)],
                              written_mono_ns=time.monotonic_ns() - 10 * 10**9))
    assert admit(load_text(config(writer.path, stale_policy="admit")), "acme")[0] is None
    (message,) = [r.getMessage() for r in caplog.records]
    m = re.fullmatch(rf"tenant agent snapshot {re.escape(str(writer.path))} is (\d+\.\d)s old; "
                     r"applying stalePolicy=admit", message)
    assert m and float(m.group(1)) >= 10.0
