"""JWT tenant extraction end to end (`spec.tenancy.source: jwt`): what each bad token gets through Envoy.

docs/config.md, `spec.tenancy.jwt`: Envoy verifies the token (issuer, signature, expiry, `audiences`)
and copies the tenant claim into the tenancy header. An invalid token is refused by Envoy (401; a
token for another audience 403), with Envoy's JSON error naming the reason; a valid token without
the tenant claim is like no token: the processor answers 401 `tenant_required` in the route's
dialect (here OpenAI's), and a client-sent tenant header never stands in for the claim.
"""

from __future__ import annotations

import json
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

pytestmark = pytest.mark.e2e

ISSUER = "https://idp.example"
AUDIENCE = "adapter-gateway"
CHAT = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def stack(key, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid="k1", alg="RS256", use="sig")
    cfg = tmp_path_factory.mktemp("jwt") / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: jwt}}
spec:
  modelRef: qwen2.5-finance
  tenancy:
    source: jwt
    jwt: {{issuer: "{ISSUER}", claim: tenant, audiences: [{AUDIENCE}], jwks: {json.dumps(json.dumps({"keys": [jwk]}))}}}
  tenants: [{{id: acme}}]
  backends: [{{name: llm, endpoints: ["llm.invalid:8000"]}}]
  routes:
    - {{path: /v1/chat/completions, kind: openai}}
""")
    st = make_stack(cfg, workers=1, simulate=True, agent=False)
    st.start()
    yield st
    st.stop()


def token(key, **claims) -> str:
    """A token signed by `key`; a claim given as None is left out."""
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "tenant": "acme", "iat": now, "exp": now + 600}
    base.update(claims)
    return jwt.encode({k: v for k, v in base.items() if v is not None}, key, algorithm="RS256",
                      headers={"kid": "k1"})


def post(stack, tok: str, **headers) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json=CHAT,
                      headers={"authorization": f"Bearer {tok}", **headers}, timeout=10)


def refused_by_envoy(r: httpx.Response, status: int, reason: str) -> None:
    assert r.status_code == status, r.text
    assert 'error="invalid_token"' in r.headers["www-authenticate"]
    err = r.json()["error"]  # Envoy's own reply (local_reply_config): status, code, message, route
    assert err["status"] == status and err["code"] == f"jwt_authn_access_denied{{{reason.replace(' ', '_')}}}"
    assert err["message"] == reason and err["route"] == "v1-chat-completions"


def test_a_valid_token_passes_its_tenant(stack, key):
    r = post(stack, token(key))
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def test_an_expired_token_is_401(stack, key):
    now = int(time.time())
    refused_by_envoy(post(stack, token(key, iat=now - 900, exp=now - 300)), 401, "Jwt is expired")


def test_a_token_from_another_issuer_is_401(stack, key):
    refused_by_envoy(post(stack, token(key, iss="https://other-idp.example")), 401, "Jwt issuer is not configured")


def test_a_token_for_another_audience_is_403(stack, key):
    refused_by_envoy(post(stack, token(key, aud="someone-else")), 403, "Audiences in Jwt are not allowed")
    refused_by_envoy(post(stack, token(key, aud=None)), 403, "Audiences in Jwt are not allowed")


def test_a_token_without_the_tenant_claim_is_a_401_from_the_processor(stack, key):
    for r in (post(stack, token(key, tenant=None)),
              post(stack, token(key, tenant=None), **{"x-tenant-id": "acme"})):  # a forged header does not help
        assert r.status_code == 401, r.text
        err = r.json()["error"]  # the openai route's dialect
        assert err["code"] == "tenant_required" and err["type"] == "authentication_error" and err["status"] == 401
        assert "x-tenant-id" in err["message"] and err["route"] == "v1-chat-completions"
