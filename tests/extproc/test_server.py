"""A worker's lifecycle as a real process: ready line, health, graceful drain, forced exit, start-up errors,
and the bundle protocol (ready/loaded/refused lines on stdout)."""

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


def start_worker(port: int, grace: float, config=CONFIG, bundle_root=None) -> subprocess.Popen:
    source = ["--bundle-root", str(bundle_root)] if bundle_root else ["--config", str(config)]
    return subprocess.Popen(
        [sys.executable, "-m", "extproc", "worker", *source, "--port", str(port),
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

    def start(port, grace, config=CONFIG, bundle_root=None):
        p = start_worker(port, grace, config, bundle_root)
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
    deadline = time.monotonic() + 10  # the first signal handled: health goes NOT_SERVING, the drain begins
    while health(channel) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline and proc.poll() is None, "the worker did not start draining"
        time.sleep(0.02)
    assert proc.poll() is None  # still draining: the open stream has up to 60 s
    proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 1  # at once: a drain that ran its 60 s out would exit 0 (and hit the test's timeout)
    outgoing.put(None)
    channel.close()


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


def lines(proc: subprocess.Popen) -> "queue.Queue[str]":
    """The worker's stdout lines, read on a thread (a test never blocks on a silent worker)."""
    import queue
    import threading

    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    return q


def test_bundle_worker_says_ready_loaded_and_refused(worker_proc, tmp_path):
    import json
    import os
    import queue
    import shutil

    from extproc.config.bundle import CURRENT, publish

    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CONFIG.read_text())
    root = tmp_path / "bundles"
    first = publish(root, cfg, 1)
    port = free_port()
    proc = worker_proc(port, 1.0, bundle_root=root)
    out = lines(proc)
    assert out.get(timeout=30) == f"ready 127.0.0.1:{port} generation=1 digest={first.digest}"
    proc.send_signal(signal.SIGHUP)  # the same bundle: acknowledged again, nothing reloaded
    assert out.get(timeout=10) == f"loaded generation=1 digest={first.digest}"
    cfg.write_text(CONFIG.read_text().replace("/v1/chat/completions", "/v1/other"))
    second = publish(root, cfg, 2)
    cfg.write_text("broken: [")  # the worker never reads the file: only the bundle
    proc.send_signal(signal.SIGHUP)
    assert out.get(timeout=10) == f"loaded generation=2 digest={second.digest}"
    broken = root / f"3-{'0' * 16}"
    shutil.copytree(second.path, broken)
    (broken / "config.yaml").unlink()
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps(dict(manifest, generation=3, digest="0" * 16)))
    os.symlink(broken.name, root / "next")
    os.replace(root / "next", root / CURRENT)
    proc.send_signal(signal.SIGHUP)
    line = out.get(timeout=10)
    assert line.startswith("refused generation=3: bundle ") and "cannot read config.yaml" in line, line
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # still serving generation 2
    with pytest.raises(queue.Empty):
        out.get(timeout=0.5)  # one line per event
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    # a worker that starts on a bundle it cannot load says so and exits 2 (its supervisor reports why)
    proc = worker_proc(free_port(), 1.0, bundle_root=root)
    out = lines(proc)
    assert out.get(timeout=30).startswith("refused generation=3: bundle ")
    assert proc.wait(30) == 2
