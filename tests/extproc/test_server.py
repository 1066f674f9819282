"""A worker's lifecycle as a real process: ready line, health, graceful drain, forced exit, start-up errors."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.stack import free_port
from tests.conftest import DATA
from tests.integration.test_servicer import recorded

CONFIG = DATA / "recorded" / "config.yaml"


def start_worker(port: int, grace: float, config=CONFIG) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "extproc", "worker", "--config", str(config), "--port", str(port),
         "--shutdown-grace", str(grace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.poll() is not None else "")


def health(channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"),
                          timeout=2).status
    except grpc.RpcError:
        return -1


@pytest.fixture
def worker_proc():
    procs = []

    def start(port, grace, config=CONFIG):
        p = start_worker(port, grace, config)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_sigterm_goes_not_serving_then_lets_open_streams_finish(worker_proc):
    port = free_port()
    proc = worker_proc(port, grace=4.0)
    wait_ready(proc)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    reqs = recorded("v1-analyze-rec-llm-ok.txtpb")
    stub = pb_grpc.ExternalProcessorStub(channel)
    import queue

    outgoing: queue.Queue = queue.Queue()
    replies = stub.Process(iter(outgoing.get, None), metadata=(("x-adapter-route", "v1-analyze"),))
    outgoing.put(reqs[0])
    next(replies)  # the stream is open and in flight
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and health(channel) == health_pb2.HealthCheckResponse.SERVING:
        time.sleep(0.05)
    assert health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    for req in reqs[1:]:  # the in-flight request completes during the grace period
        outgoing.put(req)
        reply = next(replies)
    outgoing.put(None)
    assert b"voucher" in reply.response_body.response.body_mutation.body
    assert proc.wait(10) == 0


def test_second_signal_forces_exit(worker_proc):
    port = free_port()
    proc = worker_proc(port, grace=60.0)
    wait_ready(proc)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    import queue

    outgoing: queue.Queue = queue.Queue()
    replies = pb_grpc.ExternalProcessorStub(channel).Process(iter(outgoing.get, None),
                                                             metadata=(("x-adapter-route", "v1-analyze"),))
    outgoing.put(recorded("v1-analyze-rec-llm-ok.txtpb")[0])
    next(replies)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert proc.poll() is None  # still draining: the open stream has up to 60 s
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(5) == 1
    outgoing.put(None)


def test_invalid_config_and_busy_port_fail_start_up(worker_proc, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("kind: AdapterGateway", "kind: Nope"))
    proc = worker_proc(free_port(), 1.0, bad)
    assert proc.wait(30) == 2 and "invalid config" in proc.stderr.read()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        proc = worker_proc(busy, 1.0)
        assert proc.wait(30) == 3 and "cannot bind" in proc.stderr.read()
