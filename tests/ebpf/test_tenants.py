"""Tenant lists from a gateway config, a tenants file, or an inline string."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ebpf.cgroups import QuotaError, TenantSpec
from ebpf.tenants import config_snapshot_path, load_tenants, tenants_from
from extproc.config.schema import TenantSpec as ConfigTenantSpec

pytestmark = pytest.mark.ebpf


def test_gateway_config(write_config):
    path = write_config("""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {name: t}
        spec:
          routes: [{path: /v1/x, target: "b:80"}]
          tenants:
            - id: acme
              cpu: {limit: 500m, burst: 0.2}
            - id: free
    """)
    assert load_tenants(str(path)) == [TenantSpec("acme", 0.5, 0.2), TenantSpec("free", None, 0.0)]
    assert config_snapshot_path(str(path)) is None


def test_snapshot_path_from_the_gateway_config(write_config):
    path = write_config("""
        spec:
          tenancy: {snapshot: /dev/shm/x/y.snap}
          tenants: [{id: a}]
    """)
    assert config_snapshot_path(str(path)) == "/dev/shm/x/y.snap"
    assert config_snapshot_path("a=1") is None


def test_tenants_file_with_pids(write_config):
    path = write_config("""
        tenants:
          - {id: a, cpu: {limit: 0.25}, pids: [1]}
    """, "t.yaml")
    assert load_tenants(str(path)) == [TenantSpec("a", 0.25, 0.0, (1,))]


def test_inline():
    assert load_tenants("acme=0.5,beta=200m:0.1,free") == [
        TenantSpec("acme", 0.5), TenantSpec("beta", 0.2, 0.1), TenantSpec("free")]


def test_objects_from_a_parsed_config():
    objs = [SimpleNamespace(id="a", cpu=SimpleNamespace(limit=1.5, burst=0.0)), SimpleNamespace(id="b", cpu=None)]
    assert tenants_from(objs) == [TenantSpec("a", 1.5), TenantSpec("b")]


def test_config_tenant_objects_are_taken_as_they_are():
    cfg = ConfigTenantSpec.model_validate({"id": "acme", "cpu": {"limit": "250m", "burst": 0.5}, "processes": ["*ort*"]})
    assert tenants_from([cfg]) == [TenantSpec("acme", 0.25, 0.5, (), ("*ort*",))]


@pytest.mark.parametrize("text, fragment", [
    ("a=-1", "between"), ("a=abc", "invalid CPU"), ("a=0.5,a=1", "duplicate"), ("a=0m", "between"),
    ("a_b=0.5", "id: String should match pattern"), ("a.b", "id: String should match pattern"),
    ("a=0.5:11", "cpu.burst: Input should be less than or equal to 10"),
])
def test_invalid_refused_with_every_problem(text, fragment):
    with pytest.raises(QuotaError) as e:
        load_tenants(text)
    assert fragment in str(e.value)


def test_missing_file():
    with pytest.raises(QuotaError, match="no such file"):
        load_tenants("/nonexistent/tenants.yaml")


@pytest.mark.parametrize("tenant, fragment", [
    ("{id: acme_eu}", "spec.tenants[0] (acme_eu): id: String should match pattern"),
    ("{id: a, cpu: {burst: 0.2}}", "spec.tenants[0] (a): cpu.limit: required field is missing"),
    ("{id: a, pids: [1]}", "spec.tenants[0] (a): pids: unknown field (allowed: id, cpu, budget, processes)"),
    ("{id: a, cpu: {limit: 1, max: 2}}", "cpu.max: unknown field (allowed: limit, burst)"),
    ("{id: a, processes: ['']}", "processes[0]: String should have at least 1 character"),
])
def test_gateway_config_tenants_are_the_config_schema(write_config, tenant, fragment):
    """spec.tenants is parsed by the processor's own model: what the config refuses, the agent refuses."""
    path = write_config(f"""
        apiVersion: adapter.ai/v1
        kind: AdapterGateway
        metadata: {{name: t}}
        spec:
          routes: [{{path: /v1/x, target: "b:80"}}]
          tenants: [{tenant}]
    """)
    with pytest.raises(QuotaError) as e:
        load_tenants(str(path))
    assert fragment in str(e.value)


def test_tenants_file_refuses_unknown_fields_and_names_pids_as_allowed(write_config):
    path = write_config("tenants: [{id: a, pid: [1]}]", "t.yaml")
    with pytest.raises(QuotaError, match=r"pid: unknown field \(allowed: id, cpu, budget, processes, pids\)"):
        load_tenants(str(path))
