"""mTLS between Envoy and the processor workers (`spec.processor.tls`, issue 12 item 7).

Certificates are made here with `cryptography`: a CA, the workers' server certificate (subject alt
name `adapter-processor`, the config's `serverName`), Envoy's client certificate, and a client
certificate of another CA. Through a real Envoy 1.40 and two workers: requests pass (ext_proc
streams, Envoy's gRPC health checks and its access-log streams, all over TLS); straight to a
worker's port, a plaintext client, a TLS client without a certificate and one with the other CA's
are refused, and one with the right certificate is served (so the refusals are the certificates').
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack import stop_process
from tests.e2e.conftest import wait_metric
from tests.e2e.test_xds_live import Echo

pytestmark = pytest.mark.e2e

SERVER_NAME = "adapter-processor"
HEALTH = "envoy.service.ext_proc.v3.ExternalProcessor"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool = False, san: str | None = None,
          client: bool = False) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    if not ca:
        usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH if client else x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(d: Path, name: str, cert, key) -> tuple[Path, Path]:
    c, k = d / f"{name}.crt", d / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = _key(), _key()
    ca = _cert("test CA", ca_key, "test CA", ca_key, ca=True)
    rogue_ca = _cert("rogue CA", rogue_key, "rogue CA", rogue_key, ca=True)
    out = {"ca": _write(d, "ca", ca, ca_key)[0]}
    k = _key()
    out["server"], out["server_key"] = _write(d, "server", _cert("worker", k, "test CA", ca_key, san=SERVER_NAME), k)
    k = _key()
    out["client"], out["client_key"] = _write(d, "envoy", _cert("envoy", k, "test CA", ca_key, client=True), k)
    k = _key()
    out["rogue"], out["rogue_key"] = _write(d, "rogue", _cert("rogue", k, "rogue CA", rogue_key, client=True), k)
    return out


@pytest.fixture(scope="module")
def stack(certs, tmp_path_factory):
    from tests.e2e.conftest import make_stack
    procs: list[subprocess.Popen] = []
    st = None
    try:
        echo = Echo()
        procs.append(echo.proc)
        cfg = tmp_path_factory.mktemp("mtls") / "gateway.yaml"
        cfg.write_text(json.dumps({
            "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "mtls"},
            "spec": {
                "processor": {"tls": {"certFile": str(certs["server"]), "keyFile": str(certs["server_key"]),
                                      "caFile": str(certs["ca"]), "clientCertFile": str(certs["client"]),
                                      "clientKeyFile": str(certs["client_key"]), "serverName": SERVER_NAME}},
                "backends": [{"name": "echo", "kind": "rest", "endpoints": [echo.id]}],
                "routes": [{"path": "/echo/", "match": "prefix", "target": "echo"},
                           {"path": "/rest", "kind": "rest", "target": "echo"}],
            }}))
        st = make_stack(str(cfg), workers=2, run_dir=str(cfg.parent / "run")).start()
        yield st
    finally:
        if st is not None:
            st.stop()
        for p in reversed(procs):
            stop_process(p)


def test_the_rendered_processor_clusters_use_mtls(stack, certs):
    from extproc.config.loader import load_file
    from extproc.envoy_render import render
    clusters = render(load_file(stack.config_path), workers=2)["static_resources"]["clusters"]
    tls = [c for c in clusters if c["name"].startswith("adapter_")]
    assert len(tls) == 3  # the processor cluster and the two access-log clusters
    for c in tls:
        ctx = c["transport_socket"]["typed_config"]
        assert ctx["sni"] == SERVER_NAME
        common = ctx["common_tls_context"]
        assert common["tls_certificates"][0]["certificate_chain"]["filename"] == str(certs["client"])
        assert common["validation_context"]["trusted_ca"]["filename"] == str(certs["ca"])


def test_requests_pass_through_envoy_over_mtls(stack):
    with httpx.Client(timeout=10) as client:
        for i in range(20):
            assert client.get(f"{stack.url}/echo/{i}").status_code == 200
            r = client.post(f"{stack.url}/rest", json={"a": i})
            assert r.status_code == 200, r.text
    # every worker healthy by Envoy's gRPC health check over TLS
    text = httpx.get(f"{stack.admin_url}/clusters", timeout=5).text
    flags = [ln for ln in text.splitlines() if ln.startswith("adapter_processor::") and "::health_flags::" in ln]
    assert len(flags) == 2 and all(ln.endswith("::healthy") for ln in flags), flags
    # the passthrough route's end came back over the TLS access-log stream (counted by the processor)
    counted = wait_metric(f"{stack.processor_admin_url}/metrics", "adapter_processor_requests_total", 20,
                          timeout=20, route="echo")
    assert counted >= 20, counted


def _check(port: int, creds: grpc.ChannelCredentials | None) -> str:
    target = f"127.0.0.1:{port}"
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    channel = grpc.secure_channel(target, creds, options) if creds is not None else grpc.insecure_channel(target)
    with channel:
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=HEALTH), timeout=5).status)
        except grpc.RpcError as e:
            return e.code().name


def test_a_client_without_the_right_certificate_is_refused(stack, certs):
    ca = certs["ca"].read_bytes()
    port = stack.supervisor.workers[0].port
    assert _check(port, None) == "UNAVAILABLE"  # plaintext h2c to a TLS port
    assert _check(port, grpc.ssl_channel_credentials(root_certificates=ca)) == "UNAVAILABLE"  # no client cert
    rogue = grpc.ssl_channel_credentials(root_certificates=ca, private_key=certs["rogue_key"].read_bytes(),
                                         certificate_chain=certs["rogue"].read_bytes())
    assert _check(port, rogue) == "UNAVAILABLE"  # a certificate of another CA
    good = grpc.ssl_channel_credentials(root_certificates=ca, private_key=certs["client_key"].read_bytes(),
                                        certificate_chain=certs["client"].read_bytes())
    assert _check(port, good) == "SERVING"


def test_an_unreadable_certificate_is_a_config_error_naming_the_field(certs, tmp_path):
    from extproc.config.loader import ConfigError, load_file
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "mtls"},
        "spec": {"processor": {"tls": {"certFile": str(certs["server"]), "keyFile": "/nonexistent/key.pem",
                                       "caFile": str(certs["ca"]), "clientCertFile": str(certs["client"]),
                                       "clientKeyFile": str(certs["client_key"])}},
                 "backends": [{"name": "echo", "kind": "rest", "endpoints": ["127.0.0.1:1"]}],
                 "routes": [{"path": "/echo/", "match": "prefix", "target": "echo"}]}}))
    with pytest.raises(ConfigError) as e:
        load_file(cfg)
    assert "spec.processor.tls.keyFile" in str(e.value) and "/nonexistent/key.pem" in str(e.value), str(e.value)


def test_a_reload_that_drops_tls_leaves_a_restarted_worker_on_mtls(stack, certs):
    """Envoy's processor cluster is in its static bootstrap: a reload cannot switch it. A worker
    restarted after a reload that drops `tls` from the file still serves mTLS (the supervisor's
    setting from its start), so Envoy still reaches it; the change needs a full restart."""
    cfg = Path(stack.config_path)
    original = cfg.read_text()
    doc = json.loads(original)
    doc["spec"]["processor"].pop("tls")
    cfg.write_text(json.dumps(doc))
    try:
        assert stack.reload().accepted
        _restarted_worker_stays_on_mtls(stack, certs)
    finally:  # the module's stack is shared: the other tests (in any order) see the file with tls again
        cfg.write_text(original)
        assert stack.reload().accepted


def _restarted_worker_stays_on_mtls(stack, certs) -> None:
    import os
    import signal
    import time
    worker = stack.supervisor.workers[0]
    old = worker.pid
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not (worker.pid != old and worker.ready):
        assert time.monotonic() < deadline, "worker 0 was not restarted"
        time.sleep(0.1)
    ca = certs["ca"].read_bytes()
    good = grpc.ssl_channel_credentials(root_certificates=ca, private_key=certs["client_key"].read_bytes(),
                                        certificate_chain=certs["client"].read_bytes())
    assert _check(worker.port, None) == "UNAVAILABLE"
    assert _check(worker.port, good) == "SERVING"
    deadline = time.monotonic() + 20  # Envoy's health check finds it again
    while True:
        text = httpx.get(f"{stack.admin_url}/clusters", timeout=5).text
        flags = [ln for ln in text.splitlines() if ln.startswith("adapter_processor::") and "::health_flags::" in ln]
        if len(flags) == 2 and all(ln.endswith("::healthy") for ln in flags):
            break
        assert time.monotonic() < deadline, flags
        time.sleep(0.2)
    with httpx.Client(timeout=10) as client:
        assert all(client.get(f"{stack.url}/echo/{i}").status_code == 200 for i in range(20))
