"""Tenant identity end to end: Envoy verifies a JWT and passes its tenant claim; forged headers are ignored."""

from __future__ import annotations

import json
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

pytestmark = pytest.mark.e2e


def SNAP_DIR(factory):  # noqa: N802 - one directory per session, shared by the stack and the writer
    return factory.getbasetemp() / "tenancy-shm"


@pytest.fixture(scope="module")
def keys():
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid="k1", alg="RS256", use="sig")
    return key, json.dumps({"keys": [jwk]})


def token(key, tenant: str, issuer: str = "https://idp.example") -> str:
    now = int(time.time())
    return jwt.encode({"iss": issuer, "sub": "user-1", "tenant": tenant, "iat": now, "exp": now + 600}, key,
                      algorithm="RS256", headers={"kid": "k1"})


@pytest.fixture(scope="module")
def stack(keys, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    _, jwks = keys
    cfg = tmp_path_factory.mktemp("tenancy") / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: tenancy}}
spec:
  modelRef: qwen2.5-finance
  tenancy:
    source: jwt
    header: x-tenant-id
    jwt: {{issuer: "https://idp.example", claim: tenant, jwks: {json.dumps(jwks)}}}
    snapshot: {SNAP_DIR(tmp_path_factory) / "agent.snap"}
  tenants: [{{id: acme}}, {{id: globex, cpu: {{limit: 0.5}}}}]
  backends: [{{name: llm, endpoints: ["llm.invalid:8000"]}}]
  routes:
    - {{path: /v1/chat/completions, kind: openai}}
    - {{path: /v1/completions, kind: openai, policy: {{tenantHeader: x-team}}}}
""")
    st = make_stack(cfg, simulate=True, agent=False)  # the tests publish the snapshot themselves
    st.start()
    yield st
    st.stop()


CHAT = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(stack, path="/v1/chat/completions", **headers):
    body = CHAT if "chat" in path else {"model": "qwen2.5-finance", "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{stack.url}{path}", json=body, headers=headers, timeout=10)


def test_tenant_comes_from_the_verified_claim(stack, keys):
    key, _ = keys
    assert post(stack, authorization=f"Bearer {token(key, 'acme')}").status_code == 200
    unknown = post(stack, authorization=f"Bearer {token(key, 'initech')}")
    assert unknown.status_code == 403 and unknown.json()["error"]["code"] == "unknown_tenant"


def test_a_forged_tenant_header_is_ignored(stack, keys):
    forged = post(stack, **{"x-tenant-id": "acme"})
    assert forged.status_code == 401 and forged.json()["error"]["code"] == "tenant_required"
    key, _ = keys
    # the claim wins over a client-sent copy of the header
    r = post(stack, authorization=f"Bearer {token(key, 'initech')}", **{"x-tenant-id": "acme"})
    assert r.status_code == 403


def test_an_invalid_token_is_refused_by_envoy(stack, keys):
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    r = post(stack, authorization=f"Bearer {token(other, 'acme')}")
    assert r.status_code == 401


def test_a_route_can_trust_a_client_header(stack):
    """/v1/completions trusts x-team (an internal route); the JWT route next to it does not."""
    assert post(stack, "/v1/completions", **{"x-team": "globex"}).status_code == 200
    assert post(stack, "/v1/completions", **{"x-team": "nobody"}).status_code == 403
    assert post(stack, **{"x-team": "globex"}).status_code == 401


def _until(stack, status: int, streak: int = 8, timeout: float = 20.0, **headers):
    """Post to /v1/completions until `streak` answers in a row have `status` (each worker re-reads the
    snapshot on its own, so one answer is not every worker's); the last response, or None."""
    deadline, run, r = time.monotonic() + timeout, 0, None
    while time.monotonic() < deadline:
        r = post(stack, "/v1/completions", **headers)
        run = run + 1 if r.status_code == status else 0
        if run >= streak:
            return r
        time.sleep(0.02)
    return None


def test_over_quota_tenant_gets_429_and_others_do_not(stack, tmp_path_factory):
    from ebpf.snapshot import SnapshotData, SnapshotWriter, TenantSample

    writer = SnapshotWriter(SNAP_DIR(tmp_path_factory) / "agent.snap")
    try:
        writer.write(SnapshotData(tenants=[TenantSample(id="globex", cpu_used=0.9, cpu_limit=0.5)], source="ebpf"))
        r = _until(stack, 429, **{"x-team": "globex"})
        assert r is not None and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["tenant"] == "globex" and err["cpu_limit"] == 0.5 and err["cpu_used"] == 0.9
        assert post(stack, "/v1/completions", **{"x-team": "acme"}).status_code == 200  # no quota: unaffected
    finally:
        # back under quota in every worker before the file goes, so no later test sees the 429
        writer.write(SnapshotData(tenants=[TenantSample(id="globex", cpu_used=0.1, cpu_limit=0.5)], source="ebpf"))
        recovered = _until(stack, 200, **{"x-team": "globex"})
        writer.close(remove=True)
    assert recovered is not None
