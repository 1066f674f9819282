"""A canary rollout keyed on a verified JWT claim, through the real Envoy: its jwt_authn verifies the token
and forwards the payload to the processor (`payload_in_metadata` + the ext_proc filter's
`forwarding_namespaces`), and the processor hashes the claim (`key.sources: [{claim: sub}]`).

- every user (`sub`) lands on the arm the hash says, on every request (sticky), named in `x-adapter-variant`;
- a client-sent header never stands in for the claim (no header source is configured);
- a forged token is refused by Envoy (401); a verified token without the claim has no key: weighted random.
"""

from __future__ import annotations

import json
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from canary.assign import Arm, Rollout, assign

pytestmark = pytest.mark.e2e

ISSUER = "https://idp.example"
ROLLOUT = Rollout("gpt-v2", canaries=(Arm("canary", 5000),))  # what the config below compiles into
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def token(key, sub: str | None, kid: str = "k1") -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "tenant": "acme", "iat": now, "exp": now + 600}
    if sub is not None:
        claims["sub"] = sub
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


@pytest.fixture(scope="module")
def stack(key, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    jwk.update(kid="k1", alg="RS256", use="sig")
    cfg = tmp_path_factory.mktemp("canary-jwt") / "gateway.yaml"
    cfg.write_text(json.dumps({
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "canary-jwt"},
        "spec": {
            "tenancy": {"source": "jwt", "jwt": {"issuer": ISSUER, "claim": "tenant",
                                                 "jwks": json.dumps({"keys": [jwk]})}},
            "tenants": [{"id": "acme"}],
            "backends": [{"name": "gpt-stable", "models": ["m"], "endpoints": ["gpt-stable:8000"]},
                         {"name": "gpt-canary", "models": ["m"], "endpoints": ["gpt-canary:8000"]}],
            "routes": [{"path": "/v1/", "match": "prefix", "kind": "openai", "name": "v1",
                        "targets": ["gpt-stable", "gpt-canary"]}],
            "rollouts": [{"name": "gpt-v2", "route": "v1",
                          "arms": [{"name": "stable", "backend": "gpt-stable"},
                                   {"name": "canary", "backend": "gpt-canary", "weight": 50}],
                          "key": {"sources": [{"claim": "sub"}]}}],
        },
    }))
    st = make_stack(cfg, workers=2, simulate=True, agent=False)
    st.start()
    yield st
    st.stop()


def chat(client: httpx.Client, url: str, bearer: str | None, **headers: str) -> httpx.Response:
    if bearer is not None:
        headers["authorization"] = f"Bearer {bearer}"
    return client.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)


def test_each_user_gets_the_arm_its_sub_claim_hashes_to_every_time(stack, key):
    users = [f"user-{i}" for i in range(40)]
    tokens = {u: token(key, u) for u in users}
    with httpx.Client(timeout=15) as client:
        first = {}
        for u in users:
            r = chat(client, stack.url, tokens[u])
            assert r.status_code == 200, r.text
            first[u] = r.headers["x-adapter-variant"]
        for u in users[:10]:  # sticky: again, in the other worker too, whatever a client header says
            r = chat(client, stack.url, tokens[u], **{"x-user-id": "someone-else", "x-canary": "true"})
            assert r.headers["x-adapter-variant"] == first[u]
    assert first == {u: f"gpt-v2/{assign(ROLLOUT, u).arm}" for u in users}
    assert set(first.values()) == {"gpt-v2/stable", "gpt-v2/canary"}  # both arms in use at 50 %


def test_a_forged_token_is_refused_and_a_token_without_the_claim_has_no_key(stack, key):
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    with httpx.Client(timeout=15) as client:
        assert chat(client, stack.url, token(other, "user-1")).status_code == 401  # Envoy: bad signature
        # a verified token without `sub`: no key, so weighted random (50/50): over 30 requests both arms
        # appear (all on one arm has probability 2 x 0.5^30)
        arms = set()
        for _ in range(30):
            r = chat(client, stack.url, token(key, None), **{"x-user-id": "user-1"})
            assert r.status_code == 200, r.text
            arms.add(r.headers["x-adapter-variant"])
        assert arms == {"gpt-v2/stable", "gpt-v2/canary"}
