"""The supervisor: workers on consecutive ports, one config generation for all of them (bundles,
acknowledged reloads, refusals logged once, restarts on the last accepted bundle), merged metrics,
the admin endpoints, `adapterctl reload` and SIGHUP to `adapterctl serve`, clean stop."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import text_format

from extproc.config.loader import load_file
from extproc.stack import free_port, free_port_block
from extproc.supervisor import STABLE_S, Supervisor, restart_delay
from tests.conftest import DATA, REPO
from tests.promtext import scrape

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: reload}
spec:
  modelRef: "qwen2.5-finance@registry.internal"
  backends:
    - {name: fake, endpoints: ["127.0.0.1:18101"]}
    - {name: petstore, kind: rest, endpoints: ["127.0.0.1:18999"]}
  routes:
    - path: "/v1/analyze"
      target: fake
      transform: |
        {"voucher": {"amount": $.output.amount, "account": $.output.account}}
    - {path: /tools/petstore, kind: tool, target: petstore, openapi: pets.yaml}
"""
BROKEN_LINE = len(CONFIG.splitlines()) + 1  # the line `nonsense: 1` is appended on


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def poll(fn, timeout: float = 30.0, interval: float = 0.1):
    """fn() until it is truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def get_config(admin: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{admin}/config", timeout=5).json()


def on_generation(admin: int, generation: int):
    """The /config answer once every worker is alive and serving `generation`, else None."""
    try:
        state = get_config(admin)
    except httpx.HTTPError:
        return None
    ok = all(w["alive"] and w["ready"] and w["generation"] == generation for w in state["workers"])
    return state if ok else None


def tool_call(port: int, name: str) -> pb.ProcessingResponse:
    """An MCP tool call through the worker's ext_proc stream; the reply to the request body."""
    headers = text_format.Parse(
        'request_headers { headers { headers { key: ":path" raw_value: "/tools/petstore" } '
        'headers { key: ":method" raw_value: "POST" } } }', pb.ProcessingRequest())
    body = pb.ProcessingRequest()
    body.request_body.body = json.dumps({"name": name, "arguments": {}}).encode()
    body.request_body.end_of_stream = True
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        replies = list(pb_grpc.ExternalProcessorStub(channel).Process(
            iter([headers, body]), metadata=(("x-adapter-route", "tools-petstore"),), timeout=10))
    return replies[-1]


@pytest.fixture
def gateway(tmp_path):
    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CONFIG)
    return cfg


def adapterctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def test_restart_delay_grows_with_crashes_in_a_row_up_to_5_s():
    assert [restart_delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


def test_workers_restart_and_stop_cleanly():
    base = free_port_block(2)
    admin = free_port()
    sup = Supervisor(str(DATA / "recorded" / "config.yaml"), "127.0.0.1", base, 2, admin, shutdown_grace=1.0)
    sup.start()
    try:
        assert [w.port for w in sup.workers] == [base, base + 1]
        assert httpx.get(f"http://127.0.0.1:{admin}/healthz").status_code == 200
        metrics = scrape(f"http://127.0.0.1:{admin}/metrics")
        assert metrics.value("adapter_processor_config_generation") == 1
        assert metrics.value("adapter_processor_streams_active") == 0
        victim = sup.workers[0].proc.pid
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (sup.workers[0].proc.pid == victim or not sup.alive()):
            time.sleep(0.1)
        assert sup.workers[0].proc.pid != victim and sup.workers[0].restarts == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and httpx.get(f"http://127.0.0.1:{admin}/healthz").status_code != 200:
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{admin}/healthz").status_code == 200
        # the back-off counts crashes in a row: again at once is the second; after a worker ran a minute
        # (its start moved back) it starts over at the first
        assert sup.workers[0].crashes == 1

        def kill_and_wait(w):
            pid = w.proc.pid
            os.kill(pid, signal.SIGKILL)
            end = time.monotonic() + 20
            while time.monotonic() < end and (w.proc.pid == pid or not w.ready):
                time.sleep(0.05)
            assert w.proc.pid != pid and w.ready

        kill_and_wait(sup.workers[0])
        assert sup.workers[0].crashes == 2 and sup.workers[0].restarts == 2
        sup.workers[0].spawned_at -= STABLE_S + 1
        kill_and_wait(sup.workers[0])
        assert sup.workers[0].crashes == 1 and sup.workers[0].restarts == 3
    finally:
        pids = sup.pids
        sup.stop()
    assert not [p for p in pids if alive(p)]


class RecordingXds:
    """Stands in for extproc.xds.XdsWriter: records each write and what the workers served then."""

    def __init__(self):
        self.sup = None
        self.writes = []

    def write(self, snap, workers):
        self.writes.append((snap.generation, workers, self.sup.worker_generations()))


def test_one_generation_for_every_worker_through_reload_refusal_and_restart(gateway, caplog):
    base, admin = free_port_block(2), free_port()
    xds = RecordingXds()
    sup = xds.sup = Supervisor(str(gateway), "127.0.0.1", base, 2, admin, shutdown_grace=1.0, xds=xds)
    sup.start()
    pids = list(sup.pids)
    try:
        first = get_config(admin)
        assert first["generation"] == 1 and first["source"] == str(gateway)
        assert [(w["generation"], w["digest"]) for w in first["workers"]] == [(1, first["digest"])] * 2
        assert first["digest"] == sup.snapshot.digest == load_file(gateway).digest

        # a valid edit: both workers move to generation 2, same digest, acknowledged before reload() returns
        valid = CONFIG.replace('"account": $.output.account', '"acct": $.output.account')
        gateway.write_text(valid)
        result = sup.reload()
        assert result.accepted and result.generation == 2 and result.errors == ""
        assert result.workers == {0: 2, 1: 2} and result.snapshot is sup.snapshot
        assert result.digest == load_file(gateway).digest != first["digest"]
        state = get_config(admin)
        assert [(w["generation"], w["digest"]) for w in state["workers"]] == [(2, result.digest)] * 2
        assert [(w.last, w.generation, w.digest) for w in sup.workers] == [("loaded", 2, result.digest)] * 2
        metrics = scrape(f"http://127.0.0.1:{admin}/metrics")
        assert metrics.series("adapter_processor_worker_config_info") == {
            (("digest", result.digest), ("generation", "2"), ("worker", str(i))): 1.0 for i in (0, 1)}
        assert metrics.value("adapter_processor_config_accepted_generation") == 2
        assert metrics.series("adapter_processor_config_reloads_total") == {
            (("result", "accepted"),): 1.0, (("result", "refused"),): 0.0}
        assert metrics.value("adapter_processor_config_generation") == 2  # the workers' own gauge still there
        assert xds.writes == [(1, 2, {0: 1, 1: 1}), (2, 2, {0: 2, 1: 2})]  # Envoy after the workers

        # a broken edit: refused once, with file:line, and no worker is told anything
        events = [w.events for w in sup.workers]
        gateway.write_text(valid + "  nonsense: 1\n")
        caplog.set_level(logging.INFO, logger="extproc.supervisor")
        refused = sup.reload()
        assert not refused.accepted and refused.generation == 2 and refused.digest == result.digest
        assert refused.snapshot is None and refused.workers == {0: 2, 1: 2}
        where = f"{gateway}:{BROKEN_LINE}: spec.nonsense: unknown field"
        assert where in refused.errors
        messages = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(messages) == 1 and messages[0].startswith(
            f"config reload refused, keeping generation 2 (digest {result.digest}):") and where in messages[0]
        assert [w.events for w in sup.workers] == events and len(xds.writes) == 2  # nobody told
        assert [w["generation"] for w in get_config(admin)["workers"]] == [2, 2]

        r = httpx.post(f"http://127.0.0.1:{admin}/reload", timeout=30)
        assert r.status_code == 409
        doc = r.json()
        assert doc["accepted"] is False and doc["generation"] == 2 and any(where in i for i in doc["issues"])
        state = get_config(admin)
        assert state["reloads"] == {"accepted": 1, "refused": 2}
        metrics = scrape(f"http://127.0.0.1:{admin}/metrics")
        assert metrics.series("adapter_processor_config_reloads_total") == {
            (("result", "accepted"),): 1.0, (("result", "refused"),): 2.0}
        assert metrics.value("adapter_processor_config_accepted_generation") == 2  # a refusal keeps it
        assert state["last_refusal"]["generation_kept"] == 2 and any(where in i for i in state["last_refusal"]["issues"])

        # the OpenAPI document changes too; a worker killed now restarts on the accepted bundle
        pets = gateway.parent / "pets.yaml"
        pets.write_text(pets.read_text().replace("listPets", "listAnimals"))
        victim = sup.workers[0].proc.pid
        os.kill(victim, signal.SIGKILL)
        state = poll(lambda: (s := on_generation(admin, 2)) and s["workers"][0]["pid"] != victim and s)
        assert state, get_config(admin)
        w0 = state["workers"][0]
        assert w0["restarts"] == 1 and w0["digest"] == result.digest and w0["pid"] == sup.workers[0].proc.pid
        pids.append(w0["pid"])
        assert not tool_call(base, "listPets").HasField("immediate_response")  # served from the bundle's copy
        unknown = tool_call(base, "listAnimals").immediate_response
        assert unknown.status.code == 404 and b"unknown_tool" in unknown.body

        # adapterctl reload: 1 while the file is broken, 0 once fixed, with each worker's generation
        out = adapterctl("reload", "--admin", f"http://127.0.0.1:{admin}")
        assert out.returncode == 1 and "refused, keeping generation 2" in out.stdout and where in out.stdout
        gateway.write_text(valid.replace("/v1/analyze", "/v1/analyze2"))
        out = adapterctl("reload", "--admin", f"http://127.0.0.1:{admin}")
        assert out.returncode == 0, out.stdout + out.stderr
        digest = load_file(gateway).digest
        assert f"worker 0: generation 3 (digest {digest})" in out.stdout
        assert f"worker 1: generation 3 (digest {digest})" in out.stdout
        assert "listAnimals" in [t.name for t in sup.snapshot.routes["tools-petstore"].tools.tools]
        assert xds.writes[-1] == (3, 2, {0: 3, 1: 3})
    finally:
        pids += sup.pids
        sup.stop()
    assert not [p for p in pids if alive(p)]


def test_a_refused_file_at_start_names_file_and_line(gateway):
    gateway.write_text(CONFIG + "  nonsense: 1\n")
    sup = Supervisor(str(gateway), "127.0.0.1", free_port_block(1), 1, free_port(), shutdown_grace=1.0)
    with pytest.raises(Exception) as e:
        sup.start()
    assert f"{gateway}:{BROKEN_LINE}: spec.nonsense" in str(e.value)
    assert sup.pids == [] and not os.path.exists(sup.bundle_root)
    out = adapterctl("reload", "--config", str(gateway), "--admin", f"http://127.0.0.1:{free_port()}")
    assert out.returncode == 1  # nothing listening: a failed check, not a traceback
    assert "Traceback" not in out.stderr


def test_sighup_to_adapterctl_serve_moves_every_worker(gateway, tmp_path):
    base, admin = free_port_block(2), free_port()
    xds = tmp_path / "xds"
    proc = subprocess.Popen([sys.executable, "-m", "extproc", "serve", str(gateway), "--workers", "2",
                             "--base-port", str(base), "--admin-port", str(admin), "--xds-dir", str(xds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    pids = [proc.pid]
    try:
        state = poll(lambda: proc.poll() is None and on_generation(admin, 1), timeout=60)
        assert state, proc.poll()
        pids += [w["pid"] for w in state["workers"]]
        assert state["digest"] in (xds / "rds.yaml").read_text()  # Envoy's routes: the workers' digest
        gateway.write_text(CONFIG.replace("/v1/analyze", "/v1/other"))
        proc.send_signal(signal.SIGHUP)
        state = poll(lambda: on_generation(admin, 2), timeout=20)
        assert state, get_config(admin)
        digest = load_file(gateway).digest
        assert state["generation"] == 2 and [w["digest"] for w in state["workers"]] == [digest, digest]
        assert [w["pid"] for w in state["workers"]] == pids[1:]  # reloaded in place, not restarted
        # written after the workers acknowledged, so it can come just after the generation shows
        routes = poll(lambda: (lambda t: t if digest in t and "/v1/other" in t else None)(
            (xds / "rds.yaml").read_text()), timeout=20)
        assert routes, (xds / "rds.yaml").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert f"config reload accepted: generation 2 (digest {digest}); workers 0=2 1=2" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert poll(lambda: not [p for p in pids if alive(p)], timeout=10)
