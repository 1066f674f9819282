"""Low-latency socket options on Envoy's real upstream sockets, against the real ONNX Runtime server.

Two backends point at the same server: `ort-fast` with `lowLatency: true`, `ort-default` without. After
requests on both routes, the test takes each of Envoy's sockets connected to the server
(`pidfd_getfd`, Linux 5.6+: a duplicate of Envoy's own file descriptor, so getsockopt reads the
options Envoy set) and checks the low-latency cluster's sockets carry SO_BUSY_POLL and
TCP_FASTOPEN_CONNECT while the default cluster's do not. The options checked are those the kernel
probe allowed on this host (extproc/socket_options.py); an option the host refuses is left out of the
render, and the test then checks it is absent everywhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket

import httpx
import pytest

from backends.onnxruntime.models import write_demo_repository
from extproc import socket_options as so
from tests.backends.onnxruntime.conftest import start_server, stop_server_process
from tests.e2e.conftest import make_stack

pytestmark = pytest.mark.timeout(180)
FEATURES = [0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7, -0.8]
PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(platform.machine())


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    dup = libc.syscall(PIDFD_GETFD, pidfd, fd, 0)
    if dup < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return dup


def upstream_sockets(pid: int, port: int) -> list[dict[str, int]]:
    """Options of each socket of process `pid` connected to 127.0.0.1:`port`."""
    found = []
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
                dup = _pidfd_getfd(pidfd, int(name))
            except (FileNotFoundError, ProcessLookupError):
                continue
            s = socket.socket(fileno=dup)
            try:
                if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                    continue
                try:
                    peer = s.getpeername()
                except OSError:
                    continue
                if peer != ("127.0.0.1", port):
                    continue
                found.append({
                    "busy_poll": s.getsockopt(so.SOL_SOCKET, so.SO_BUSY_POLL),
                    "nodelay": s.getsockopt(so.IPPROTO_TCP, so.TCP_NODELAY),
                    "fastopen_connect": s.getsockopt(so.IPPROTO_TCP, so.TCP_FASTOPEN_CONNECT),
                })
            finally:
                s.close()
    finally:
        os.close(pidfd)
    return found


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("lowlatency")
    repo = root / "models"
    write_demo_repository(repo)
    server = start_server(repo, root / "ort.log")
    stack = None
    try:
        endpoint = f"127.0.0.1:{server.http_port}"
        cfg = root / "gateway.yaml"
        cfg.write_text(json.dumps({
            "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "lowlatency"},
            "spec": {
                "listener": {"lowLatency": True},
                "backends": [
                    {"name": "ort-fast", "kind": "onnxruntime", "endpoints": [endpoint], "models": ["fraud-mlp"],
                     "lowLatency": {"busyPollUs": 40}},
                    {"name": "ort-default", "kind": "onnxruntime", "endpoints": [endpoint], "models": ["fraud-mlp"]},
                ],
                "routes": [
                    {"path": "/fast/score", "kind": "tensor", "target": "ort-fast", "model": "fraud-mlp",
                     "request": '{"features": [$.features]}'},
                    {"path": "/default/score", "kind": "tensor", "target": "ort-default", "model": "fraud-mlp",
                     "request": '{"features": [$.features]}'},
                    {"path": "/v2", "match": "prefix", "kind": "kserve", "target": "ort-fast"},
                ],
            }}))
        stack = make_stack(str(cfg), workers=1, agent=False).start()
        yield stack, server
    finally:
        if stack is not None:
            stack.stop()
        stop_server_process(server.process)


def test_rendered_options_are_what_the_kernel_allows(gateway) -> None:
    stack, _ = gateway
    support = so.KernelSupport.probe()
    fast = stack.snapshot.backends["ort-fast"].socket_plan
    names = {o.name: o.int_value for o in fast.options}
    assert names.get(so.SO_BUSY_POLL) == (40 if support.busy_poll is None else None)
    assert (so.TCP_FASTOPEN_CONNECT in names) == (support.fast_open_connect is None)
    assert stack.snapshot.backends["ort-default"].socket_plan is None
    listener = stack.snapshot.listener_socket_plan
    assert (listener.tfo_queue_length > 0) == (support.fast_open_listen is None)
    assert {r for _, r in listener.skipped} == {r for r in (support.fast_open_listen,) if r}


def test_requests_work_with_every_option_on(gateway) -> None:
    stack, _ = gateway
    for path in ("/fast/score", "/default/score"):
        for _ in range(3):
            r = httpx.post(f"{stack.url}{path}", json={"features": FEATURES}, timeout=30)
            assert r.status_code == 200, r.text
            assert len(r.json()["scores"][0]) == 2
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": FEATURES}]}
    r = httpx.post(f"{stack.url}/v2/models/fraud-mlp/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.skipif(PIDFD_GETFD is None or not hasattr(os, "pidfd_open"),
                    reason="needs Linux pidfd_getfd (x86_64/aarch64, Python 3.9+) to read Envoy's sockets")
def test_envoys_upstream_sockets_carry_the_options(gateway) -> None:
    stack, server = gateway
    # one connection each, kept alive by Envoy's pool: a client connection at a time, sequential requests
    with httpx.Client(timeout=30) as client:
        for path in ("/fast/score", "/default/score"):
            assert client.post(f"{stack.url}{path}", json={"features": FEATURES}).status_code == 200
        try:
            sockets = upstream_sockets(stack.envoy_pid, server.http_port)
        except PermissionError as e:
            pytest.skip(f"pidfd_getfd on Envoy refused ({e}): needs ptrace rights over it (root or its parent)")
    support = so.KernelSupport.probe()
    assert len(sockets) >= 2, sockets  # at least one per cluster
    assert all(s["nodelay"] == 1 for s in sockets), sockets  # Envoy's default, and rendered on ort-fast
    polls = sorted({s["busy_poll"] for s in sockets})
    if support.busy_poll is None:
        assert polls == [0, 40], sockets
        fast = [s for s in sockets if s["busy_poll"] == 40]
        default = [s for s in sockets if s["busy_poll"] == 0]
        want = 1 if support.fast_open_connect is None else 0
        assert all(s["fastopen_connect"] == want for s in fast), sockets
        assert all(s["fastopen_connect"] == 0 for s in default), sockets
    else:
        assert polls == [0], sockets
