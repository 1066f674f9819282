"""Security end to end (issue 12 item 7), through a real Envoy 1.40 and processor workers.

- Backend error bodies: a backend that puts its internals in every error (tests/e2e/leaky_service.py:
  a source file, a line, a token) behind every route kind that adapts (llm, tensor, openai, rest, tool): the
  client keeps the status and gets a safe message, never the backend's text.
- Tenant spoofing on every route kind: with JWT tenancy, a client-sent tenancy header
  (`x-tenant-id`), the metadata key as a header (`x-adapter-tenant`) or a trusted header of another
  route never stand in for the verified claim (401 without a token; a token's own unknown tenant
  stays a 403 whatever the headers say).
- JWT edge cases through Envoy's jwt_authn: expired, wrong audience, `alg: none`, another key, a
  tampered payload.
- Envoy's admin and the processor's admin and worker ports bind to loopback by default.
- Templates cannot inject headers: a client value with CR LF in a template ends up escaped in the
  JSON body, no header appears.
- Tool routes reach only their target: a tool call whose path argument is another host's URL, or
  a traversal, is sent to the route's target with the value percent-encoded; the other server
  sees nothing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import DATA, REPO
from tests.e2e.leaky_service import LEAK
from tests.e2e.test_xds_live import Echo

pytestmark = pytest.mark.e2e

ISSUER = "https://idp.example"
AUDIENCE = "adapter-gateway"
MODEL = "qwen2.5-finance"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LEAK_BITS = ("server.cpp", "/srv/engine", "sk-secret-42")


def _service(module: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", module, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return p, port


@pytest.fixture(scope="module")
def key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def env(key, tmp_path_factory):
    from tests.e2e.conftest import make_stack
    procs: list[subprocess.Popen] = []
    st = None
    try:
        leaky, lport = _service("tests.e2e.leaky_service")
        procs.append(leaky)
        pet = subprocess.Popen([sys.executable, str(REPO / "tests" / "e2e" / "petstore_service.py"), str(free_port())])
        pport = int(pet.args[-1])
        procs.append(pet)
        other = Echo()  # a host no route names: nothing may reach it
        procs.append(other.proc)
        wait_http(f"http://127.0.0.1:{lport}/health", 20, leaky)
        wait_http(f"http://127.0.0.1:{pport}/", 20, pet)
        jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
        jwk.update(kid="k1", alg="RS256", use="sig")
        cfg = tmp_path_factory.mktemp("security") / "gateway.yaml"
        headers_doc = cfg.parent / "traced.json"  # one operation with a header parameter
        headers_doc.write_text(json.dumps({
            "openapi": "3.0.0", "info": {"title": "traced", "version": "1"}, "servers": [{"url": "/"}],
            "paths": {"/traced": {"get": {"operationId": "traced", "parameters": [
                {"name": "x-trace", "in": "header", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "ok"}}}}}}))
        cfg.write_text(json.dumps({
            "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "security"},
            "spec": {
                "modelRef": MODEL,
                "tenancy": {"source": "jwt", "jwt": {"issuer": ISSUER, "claim": "tenant", "audiences": [AUDIENCE],
                                                     "jwks": json.dumps({"keys": [jwk]})}},
                "tenants": [{"id": "acme"}],
                "backends": [
                    {"name": "leaky-llm", "kind": "openai", "endpoints": [f"127.0.0.1:{lport}"]},
                    {"name": "leaky-rest", "kind": "rest", "endpoints": [f"127.0.0.1:{lport}"]},
                    {"name": "leaky-kserve", "kind": "triton", "endpoints": [f"127.0.0.1:{lport}"]},
                    {"name": "leaky-ort", "kind": "onnxruntime", "endpoints": [f"127.0.0.1:{lport}"], "models": ["m"]},
                    {"name": "petstore", "kind": "rest", "endpoints": [f"127.0.0.1:{pport}"]},
                ],
                "routes": [
                    {"path": "/v1/analyze", "target": "leaky-llm",
                     "request": '{"messages": [{"role": "user", "content": $.query}]}',
                     "transform": '{"a": $.output}'},
                    {"path": "/v1/chat/completions", "kind": "openai", "targets": ["leaky-llm"]},
                    {"path": "/orders", "kind": "rest", "target": "leaky-rest"},
                    {"path": "/tools/leaky", "kind": "tool", "target": "leaky-rest",
                     "openapi": str(DATA / "openapi" / "petstore.yaml")},
                    {"path": "/tools/petstore", "kind": "tool", "target": "petstore",
                     "openapi": str(DATA / "openapi" / "petstore.yaml")},
                    {"path": "/tools/leaky-headers", "kind": "tool", "target": "leaky-rest",
                     "openapi": str(headers_doc)},
                    {"path": "/v1/score", "kind": "tensor", "target": "leaky-ort", "model": "m",
                     "request": '{"features": [$.features]}'},
                    {"path": "/v2", "match": "prefix", "kind": "kserve", "target": "leaky-kserve"},
                    {"path": "/pass/", "match": "prefix", "target": "leaky-rest"},
                    {"path": "/internal/", "match": "prefix", "target": "leaky-rest",
                     "policy": {"tenantHeader": "x-internal-tenant"}},
                ],
            }}))
        st = make_stack(str(cfg), workers=1, agent=False).start()
        yield {"st": st, "leaky": lport, "pet": pport, "other": other, "key": key}
    finally:
        if st is not None:
            st.stop()
        for p in reversed(procs):
            stop_process(p)


def token(key, alg: str = "RS256", **claims) -> str:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "u1", "tenant": "acme", "iat": now, "exp": now + 600}
    base.update(claims)
    doc = {k: v for k, v in base.items() if v is not None}
    if alg == "none":
        return jwt.encode(doc, None, algorithm="none", headers={"kid": "k1"})
    return jwt.encode(doc, key, algorithm=alg, headers={"kid": "k1"})


def auth(key, **claims) -> dict[str, str]:
    return {"authorization": f"Bearer {token(key, **claims)}"}


# one request per route kind: (kind, method, path, body)
KINDS = [
    ("llm", "POST", "/v1/analyze", json.dumps({"query": "q"})),
    ("openai", "POST", "/v1/chat/completions", json.dumps(CHAT)),
    ("rest", "POST", "/orders", json.dumps({"orderId": "A-1"})),
    ("tensor", "POST", "/v1/score", json.dumps({"features": [0.1, 0.2]})),
    ("tool", "POST", "/tools/leaky", json.dumps({"name": "showPetById", "arguments": {"petId": "1"}})),
    ("kserve", "POST", "/v2/models/m/infer", json.dumps({"inputs": []})),
    ("passthrough", "GET", "/pass/x", None),
]


def send(st, method, path, body, headers) -> httpx.Response:
    return httpx.request(method, st.url + path, content=body, headers={"content-type": "application/json", **headers},
                         timeout=10)


# -- backend error bodies ------------------------------------------------------------------------

@pytest.mark.parametrize("kind,method,path,body", [
    pytest.param(*k, id=k[0])
    for k in KINDS if k[0] in ("llm", "openai", "rest", "tensor")])
def test_a_backends_internals_never_reach_the_client_on_an_adapting_route(env, kind, method, path, body):
    st = env["st"]
    r = send(st, method, path, body, auth(env["key"]))
    assert r.status_code == 500, r.text  # the status is kept
    assert not any(bit in r.text for bit in LEAK_BITS), r.text
    err = r.json()["error"]
    assert "leaky" in json.dumps(err) and (err.get("code") == "backend_error" or err.get("type")), err


def test_a_tool_routes_service_error_is_a_tool_result_without_the_services_internals(env):
    st = env["st"]
    r = send(st, *next(k for k in KINDS if k[0] == "tool")[1:], auth(env["key"]))
    assert r.status_code == 200 and r.headers.get("x-adapter-tool-status") == "500", r.text
    assert not any(bit in r.text for bit in LEAK_BITS), r.text


# -- tenant spoofing -----------------------------------------------------------------------------

SPOOFS = [{"x-tenant-id": "acme"}, {"x-adapter-tenant": "acme"}, {"x-internal-tenant": "acme"},
          {"x-tenant-id": "acme", "x-adapter-tenant": "acme", "x-internal-tenant": "acme"}]


@pytest.mark.parametrize("kind,method,path,body", KINDS, ids=[k[0] for k in KINDS])
def test_client_sent_tenant_headers_are_never_trusted(env, kind, method, path, body):
    st = env["st"]
    for spoof in SPOOFS:
        r = send(st, method, path, body, spoof)  # no token
        assert r.status_code == 401, (spoof, r.status_code, r.text)
        assert "tenant" in r.text, r.text
        # a verified token of an unknown tenant stays that tenant, whatever the headers claim
        r = send(st, method, path, body, {**spoof, **auth(env["key"], tenant="mallory")})
        assert r.status_code == 403 and "mallory" in r.text, (spoof, r.status_code, r.text)
    assert env["other"].count() == 0


def test_a_route_that_trusts_a_header_takes_it_and_only_there(env):
    st = env["st"]
    r = send(st, "GET", "/internal/x", None, {"x-internal-tenant": "acme"})
    assert r.status_code == 500 and not any(bit in r.text for bit in LEAK_BITS) or r.status_code == 500, r.text
    assert send(st, "GET", "/pass/x", None, {"x-internal-tenant": "acme"}).status_code == 401


# -- JWT edge cases ------------------------------------------------------------------------------

def _other_key_token() -> str:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return token(other)


def _tampered(key) -> str:
    head, payload, sig = token(key, tenant="beta").split(".")
    forged = jwt.utils.base64url_encode(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme",
                                                    "exp": int(time.time()) + 600}).encode()).decode()
    return ".".join((head, forged, sig))


JWT_CASES = {
    # past jwt_authn's 60 s clock skew allowance
    "expired": (lambda k: token(k, exp=int(time.time()) - 600, iat=int(time.time()) - 1200), 401, "Jwt is expired"),
    "wrong-audience": (lambda k: token(k, aud="someone-else"), 403, "Audiences in Jwt are not allowed"),
    "alg-none": (lambda k: token(k, alg="none"), 401, None),
    "another-key": (lambda k: _other_key_token(), 401, "Jwt verification fails"),
    "tampered-payload": (_tampered, 401, "Jwt verification fails"),
    "hs256-with-the-public-key": (None, 401, None),
}


@pytest.mark.parametrize("case", list(JWT_CASES))
def test_bad_tokens_are_refused_by_envoy_on_every_route_kind(env, case):
    st, key = env["st"], env["key"]
    make, status, reason = JWT_CASES[case]
    if make is None:  # the classic confusion: HS256 keyed with the RSA public key's PEM
        from cryptography.hazmat.primitives import serialization
        pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        import base64, hashlib, hmac  # noqa: E401
        now = int(time.time())
        h = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT","kid":"k1"}').rstrip(b"=")
        p = base64.urlsafe_b64encode(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "tenant": "acme",
                                                 "exp": now + 600}).encode()).rstrip(b"=")
        s = base64.urlsafe_b64encode(hmac.new(pem, h + b"." + p, hashlib.sha256).digest()).rstrip(b"=")
        tok = (h + b"." + p + b"." + s).decode()
    else:
        tok = make(key)
    for kind, method, path, body in KINDS:
        r = send(st, method, path, body, {"authorization": f"Bearer {tok}", "x-tenant-id": "acme"})
        assert r.status_code == status, (kind, r.status_code, r.text)
        assert 'error="invalid_token"' in r.headers.get("www-authenticate", ""), (kind, r.headers)
        if reason:
            assert r.json()["error"]["message"] == reason, (kind, r.text)
    ok = send(st, "POST", "/v1/analyze", json.dumps({"query": "q"}), auth(key))
    assert ok.status_code == 500  # a good token passes (the leaky backend answers 500)


# -- ports on loopback ---------------------------------------------------------------------------

def _listening(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (/proc/net/tcp and tcp6)."""
    out = set()
    for f, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(f).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state = parts[1], parts[3]
            host, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                if width == 8:
                    out.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1]))
                else:
                    raw = bytes.fromhex(host)
                    out.add(socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
    return out


def test_admin_metrics_and_worker_ports_listen_on_loopback_only(env, tmp_path):
    st = env["st"]
    snap = st.snapshot
    ports = {"envoy admin": snap.admin.port, "processor admin": snap.processor.admin_port,
             "listener": snap.listener.port, **{f"worker {i}": w.port for i, w in enumerate(st.supervisor.workers)}}
    for what, port in ports.items():
        addrs = _listening(port)
        assert addrs and addrs <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, (what, port, addrs)
    from extproc.config.loader import load_file
    from extproc.envoy_render import render
    boot = render(load_file(st.config_path))
    assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    doc = json.loads(open(st.config_path).read())  # configured otherwise: rendered as configured
    doc["spec"]["admin"] = {"address": "0.0.0.0"}
    other = tmp_path / "gw.json"
    other.write_text(json.dumps(doc))
    assert render(load_file(other))["admin"]["address"]["socket_address"]["address"] == "0.0.0.0"


# -- templates and CR LF -------------------------------------------------------------------------

def test_client_values_with_cr_lf_cannot_inject_headers(env, tmp_path):
    """The llm route's request template puts the client's `query` into the backend body: CR LF and
    a header line in it stay JSON string content, and no such header reaches the backend. A tool
    call's header parameter (from the OpenAPI document) with CR LF never becomes a header line. A
    client's own header with a bare CR cannot smuggle in the tenancy header."""
    st = env["st"]
    evil = "x\r\nx-injected: yes\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n"
    r = httpx.post(st.url + "/v1/analyze", json={"query": evil}, headers=auth(env["key"]), timeout=10)
    assert r.status_code == 500 and "x-injected" not in r.headers, r.headers
    r = httpx.post(st.url + "/tools/leaky-headers", headers=auth(env["key"]), timeout=10,
                   json={"name": "traced", "arguments": {"x-trace": evil}})
    assert r.status_code in (200, 400), r.text
    seen = httpx.get(f"http://127.0.0.1:{env['leaky']}/__seen", timeout=5).json()
    assert seen and not any("smuggled" in s["request"] or "x-injected" in s["headers"] for s in seen), seen
    with socket.create_connection((st.snapshot.listener.address, st.snapshot.listener.port), timeout=10) as s:
        s.sendall(b"GET /pass/x HTTP/1.1\r\nhost: x\r\nx-a: b\rx-tenant-id: acme\r\n\r\n")
        answer = s.recv(4096)
    assert answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 401")), answer[:300]


# -- tool routes reach only their target ---------------------------------------------------------

@pytest.mark.parametrize("pet_id", ["http://127.0.0.1:{other}/steal", "//127.0.0.1:{other}/steal",
                                    "../../../../etc/passwd", "1?x=1#frag", "1\r\nhost: 127.0.0.1:{other}",
                                    "@127.0.0.1:{other}"])
def test_a_tool_call_cannot_reach_another_host(env, pet_id):
    st, other = env["st"], env["other"]
    value = pet_id.format(other=other.port)
    r = httpx.post(st.url + "/tools/petstore", json={"name": "showPetById", "arguments": {"petId": value}},
                   headers=auth(env["key"]), timeout=10)
    assert r.status_code in (200, 400), r.text  # a tool result (the service's 404), or refused
    if r.status_code == 200:
        assert r.headers["x-adapter-tool-status"] == "404", (r.headers, r.text)  # petstore: no such pet
    assert other.count() == 0
    unknown = httpx.post(st.url + "/tools/petstore", json={"name": "http://127.0.0.1/x", "arguments": {}},
                         headers=auth(env["key"]), timeout=10)
    assert unknown.status_code == 404 and other.count() == 0
