"""`adapterctl serve FILE --record-dir DIR` behind a real Envoy: the recorded streams replay (docs/operations.md).

The setup an operator uses to capture a bug report: the OpenAI API simulator as the backend,
`adapterctl serve` with `--record-dir`, and Envoy run from `adapterctl render-envoy`. Traffic goes
through Envoy; every ProcessingRequest lands in `DIR/<route>-<request id>.txtpb`. Each recording
is then replayed, as tests/integration/ does, into a fresh servicer over real gRPC, which must
give the answers the client got live (the transformed body, the 400 for malformed JSON).
Every process is started here and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import httpx
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import text_format
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_file
from extproc.envoy_bin import find_envoy
from extproc.metrics import ProcessorMetrics
from extproc.stack import free_port, free_port_block, wait_http
from extproc.stream import ConfigRef, ExtProcService

pytestmark = pytest.mark.e2e


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def recorded_gateway(tmp_path):
    """Simulator, `adapterctl serve --record-dir`, Envoy from `render-envoy`: (gateway url, config, record dir)."""
    sim_port, listen, admin, proc_admin, base = free_port(), free_port(), free_port(), free_port(), free_port_block(1)
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: recorded}}
spec:
  modelRef: qwen2.5-finance
  listener: {{port: {listen}}}
  admin: {{port: {admin}}}
  processor: {{basePort: {base}, adminPort: {proc_admin}, workers: 1}}
  backends: [{{name: llm, endpoints: ["127.0.0.1:{sim_port}"]}}]
  routes:
    - {{path: /v1/analyze, target: llm, transform: '{{"voucher": {{"amount": $.output.amount, "account": $.output.account}}}}'}}
""")
    record_dir = tmp_path / "recorded"
    envoy_cfg = tmp_path / "envoy.yaml"
    render = subprocess.run([sys.executable, "-m", "extproc", "render-envoy", str(cfg), "-o", str(envoy_cfg)],
                            capture_output=True, text=True, timeout=60)
    assert render.returncode == 0, render.stderr
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1",
                                       "--port", str(sim_port), "--models", "qwen2.5-finance"],
                                      stdout=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{sim_port}/health", 60, procs[-1], "simulator")
        procs.append(subprocess.Popen([sys.executable, "-m", "extproc", "serve", str(cfg),
                                       "--record-dir", str(record_dir)], stdout=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{proc_admin}/healthz", 60, procs[-1], "adapterctl serve")
        procs.append(subprocess.Popen([find_envoy(), "-c", str(envoy_cfg), "--disable-hot-restart",
                                       "--concurrency", "1", "-l", "warning"]))
        wait_http(f"http://127.0.0.1:{admin}/ready", 30, procs[-1], "envoy")
        url = f"http://127.0.0.1:{listen}"
        # ready once Envoy's health check reached the worker: the processor answers the health route
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health/adapter?probe=processor", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the processor never answered through Envoy"
            time.sleep(0.1)
        yield url, cfg, record_dir
    finally:
        for p in reversed(procs):  # Envoy first, then the processor, then the backend
            _stop(p)


def _messages(path) -> list[pb.ProcessingRequest]:
    chunks = path.read_text().split("# message\n")[1:]
    return [text_format.Parse(c, pb.ProcessingRequest()) for c in chunks]


async def _replay(cfg, route: str, requests: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """The recording into a fresh servicer over real gRPC, one message at a time, as Envoy sends them."""
    svc = ExtProcService(ConfigRef(load_file(cfg)), ProcessorMetrics(CollectorRegistry()))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(
                metadata=(("x-adapter-route", route), ("x-request-id", "replay")))
            replies = []
            for req in requests:
                await call.write(req)
                reply = await call.read()
                replies.append(reply)
                if reply.HasField("immediate_response"):
                    break
            await call.done_writing()
            return replies
    finally:
        await server.stop(0)


def test_recorded_streams_replay_to_the_live_answers(recorded_gateway):
    url, cfg, record_dir = recorded_gateway
    ok = httpx.post(f"{url}/v1/analyze", json={"query": "Q3 revenue"}, headers={"x-request-id": "rec-ok"}, timeout=10)
    assert ok.status_code == 200 and set(ok.json()["voucher"]) == {"amount", "account"}
    bad = httpx.post(f"{url}/v1/analyze", content=b'{"query": ', headers={"x-request-id": "rec-bad"}, timeout=10)
    assert bad.status_code == 400

    ok_file, bad_file = record_dir / "v1-analyze-rec-ok.txtpb", record_dir / "v1-analyze-rec-bad.txtpb"
    assert ok_file.exists() and bad_file.exists(), sorted(p.name for p in record_dir.iterdir())
    ok_msgs = _messages(ok_file)
    assert [m.WhichOneof("request") for m in ok_msgs] == [
        "request_headers", "request_body", "response_headers", "response_body"]
    headers = {h.key: h.raw_value for h in ok_msgs[0].request_headers.headers.headers}
    assert headers[":path"] == b"/v1/analyze" and headers["x-request-id"] == b"rec-ok"
    assert orjson.loads(ok_msgs[1].request_body.body) == {"query": "Q3 revenue"}

    replies = asyncio.run(_replay(cfg, "v1-analyze", ok_msgs))
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers", "request_body", "response_headers", "response_body"]
    replayed = orjson.loads(replies[3].response_body.response.body_mutation.body)
    assert replayed == ok.json()  # the same backend answer, transformed again: what the client got live

    bad_msgs = _messages(bad_file)
    assert [m.WhichOneof("request") for m in bad_msgs] == ["request_headers", "request_body"]
    replies = asyncio.run(_replay(cfg, "v1-analyze", bad_msgs))
    ir = replies[-1].immediate_response
    assert ir.status.code == 400 and orjson.loads(ir.body)["error"]["code"] == bad.json()["error"]["code"]
