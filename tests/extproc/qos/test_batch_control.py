"""The batch control loop (extproc/qos/batch_control.py) against a real ONNX Runtime server process.

The server is `python -m backends.onnxruntime` on a free port with the demo repository (real
inference), stopped by PID. Policies are the real ones; the clock is injected where lease timing
matters, the attainment comes from the server's own histogram after real requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
import httpx
import pytest

from backends.onnxruntime.models import write_demo_repository
from extproc.qos.batch_control import (BatchControlRuntime, BatchController, ControlLoop, LeaseHeld,
                                       OrtBatchingClient)
from extproc.qos.batch_policy import AimdPolicy, BatchSetting, BriefPolicy, StaticPolicy
from tests.backends.onnxruntime.conftest import Server, start_server, stop_server_process

MODEL = "fraud-mlp"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("ort-repo")
    write_demo_repository(repo)
    srv = start_server(repo, tmp_path_factory.mktemp("ort-log") / "stderr.log", "--threads", "2")
    yield srv
    stop_server_process(srv.process)


@pytest.fixture
def client(server: Server) -> Iterator[OrtBatchingClient]:
    c = OrtBatchingClient(server.base, MODEL)
    yield c
    httpx.post(f"{server.base}/admin/models/{MODEL}/batching",  # leave the model as config.yaml has it
               json={"max_batch_size": 32, "max_queue_delay_us": 1000}, timeout=5)
    c.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def infer(server: Server, n: int) -> None:
    with httpx.Client(base_url=server.base, timeout=10) as http:
        for i in range(n):
            r = http.post(f"/v2/models/{MODEL}/infer", json={
                "inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0.1 * i] * 8}]})
            assert r.status_code == 200, r.text


def test_controller_applies_the_policy_and_the_server_reports_it_back(server: Server, client) -> None:
    clock = Clock()
    ctl = BatchController(AimdPolicy(delay_us=700, start=8, hold=1, step=3, max_size=20), client,
                          slo_latency=5.0, clock=clock, lease_ms=1000)  # 5 s: every request meets it
    ctl.start()
    assert client.settings()["1"]["max_batch_size"] == 8
    infer(server, 5)
    clock.t += 0.1
    rec = ctl.tick()
    assert (rec.requests, rec.attainment) == (5, 1.0)
    assert rec.wanted == BatchSetting(11, 700) and rec.applied == BatchSetting(11, 700)
    now = client.settings()["1"]
    assert (now["max_batch_size"], now["max_queue_delay_us"], now["owner"]) == (11, 700, ctl.owner)
    meta = httpx.get(f"{server.base}/v2/models/{MODEL}", timeout=5).json()["batching"]
    assert meta["max_batch_size"] == 11  # the batcher itself took it, not only the admin view
    clock.t += 0.1
    rec = ctl.tick()  # no requests: no evidence, no change, no write (the lease is still fresh)
    assert (rec.requests, rec.attainment, rec.applied) == (0, None, None)
    ctl.stop()
    assert client.settings()["1"]["owner"] is None  # the lease was given back


def test_controller_reads_violations_from_the_servers_histogram(server: Server, client) -> None:
    clock = Clock()
    # 0.1 ms: a one-row HTTP inference takes longer than that on any machine here -> attainment 0
    ctl = BatchController(BriefPolicy(delay_us=1000), client, slo_latency=0.0001, clock=clock)
    ctl.start()
    assert client.settings()["1"]["max_batch_size"] == 32
    infer(server, 4)
    clock.t += 0.1
    rec = ctl.tick()
    assert rec.requests == 4 and rec.attainment is not None and rec.attainment < 0.7
    assert rec.applied == BatchSetting(1, 1000)  # the brief's formula, clamped to 1
    assert client.settings()["1"]["enabled"] is False
    ctl.stop()


def test_only_one_controller_acts_per_endpoint(server: Server, client) -> None:
    clock = Clock()
    # the server times the lease on its own (real) clock: 4 s, so that a slow machine's stalls between
    # a's write and the read below cannot lapse it (0.4 s did once, on a clean-clone run); the
    # injected clock steps keep the same proportions of the lease as before
    other = OrtBatchingClient(server.base, MODEL)
    try:
        a = BatchController(StaticPolicy(BatchSetting(4, 100)), client, slo_latency=0.005, clock=clock,
                            lease_ms=4000, owner="replica-a")
        b = BatchController(StaticPolicy(BatchSetting(9, 900)), other, slo_latency=0.005, clock=clock,
                            lease_ms=4000, owner="replica-b")
        a.start()
        b.start()  # refused by the server: b is a standby and writes nothing
        assert (a.acting, b.acting) == (True, False)
        for _ in range(3):
            clock.t += 1.0
            a.tick()
            assert b.tick().applied is None
        now = client.settings()["1"]
        assert (now["max_batch_size"], now["owner"]) == (4, "replica-a")
        with pytest.raises(LeaseHeld, match="held by 'replica-a'"):
            other.apply(BatchSetting(2, 0))  # an anonymous write is refused too
        a.stop()  # a gives the lease back; b takes over at its next try (one lease after its refusal)
        clock.t += 4.0
        rec = b.tick()
        assert rec.acting and rec.applied == BatchSetting(9, 900)
        assert client.settings()["1"]["owner"] == "replica-b"
        b.stop()
    finally:
        other.close()


def test_a_lapsed_lease_lets_the_standby_take_over(server: Server, client) -> None:
    other = OrtBatchingClient(server.base, MODEL)
    try:
        client.apply(BatchSetting(6, 100), owner="crashed", lease_ms=400)  # a controller that then dies
        b = BatchController(StaticPolicy(BatchSetting(7, 100)), other, slo_latency=0.005, lease_ms=400)
        b.start()
        assert not b.acting
        loop = ControlLoop(b, period=0.05)
        loop.start()  # start() again re-reads the baseline and tries the lease once more: still held
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and client.settings()["1"]["owner"] != b.owner:
            time.sleep(0.05)
        loop.stop()
        assert b.history and b.history[-1].acting
        assert client.settings()["1"]["max_batch_size"] == 7
    finally:
        other.close()


def test_runtime_refuses_a_second_controller_for_the_same_endpoint(server: Server, client) -> None:
    rt = BatchControlRuntime()
    other = OrtBatchingClient(server.base, MODEL)
    try:
        rt.add(ControlLoop(BatchController(StaticPolicy(BatchSetting(5, 100)), client, slo_latency=0.005)))
        with pytest.raises(ValueError, match="one controller per endpoint"):
            rt.add(ControlLoop(BatchController(StaticPolicy(BatchSetting(3, 100)), other, slo_latency=0.005)))
        assert client.settings()["1"]["max_batch_size"] == 5
    finally:
        rt.stop()
        other.close()


def test_bad_parameters_are_named(server: Server, client) -> None:
    with pytest.raises(ValueError, match=r"slo_latency: 7 ms is not a bucket bound .*5, 10"):
        BatchController(StaticPolicy(BatchSetting(1, 0)), client, slo_latency=0.007)
    with pytest.raises(ValueError, match="period"):
        ControlLoop(BatchController(StaticPolicy(BatchSetting(1, 0)), client, slo_latency=0.005), period=0)
    r = httpx.post(f"{server.base}/admin/models/{MODEL}/batching", json={"owner": "x", "lease_ms": -1}, timeout=5)
    assert r.status_code == 400 and "lease_ms" in r.json()["error"]


# -- spec.qos.batchControl: validated once, compiled into plans the supervisor runs ---------------------

BASE = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: q}
spec:
  backends:
    - {name: ort, kind: onnxruntime, endpoints: ["127.0.0.1:%d"], models: [fraud-mlp]}
    - {name: llm, endpoints: ["127.0.0.1:9"], models: [m]}
  routes: [{path: /v1/fraud, kind: kserve, name: fraud, target: ort, model: fraud-mlp}]
  qos:
    batchControl:
"""


def refusal(entries: str) -> str:
    from extproc.config.loader import ConfigError, load_text

    with pytest.raises(ConfigError) as e:
        load_text(BASE % 8000 + entries, "q.yaml")
    return str(e.value)


@pytest.mark.parametrize("entry, where, reason", [
    ("{backend: nope, model: fraud-mlp, slo: 5ms}", "spec.qos.batchControl[0].backend", "unknown backend 'nope'"),
    ("{backend: llm, model: m, slo: 5ms}", "spec.qos.batchControl[0].backend", "is of kind openai"),
    ("{backend: ort, model: other, slo: 5ms}", "spec.qos.batchControl[0].model", "does not serve model 'other'"),
    ("{backend: ort, model: fraud-mlp, slo: 7ms}", "spec.qos.batchControl[0].slo", "7 ms is not a bucket bound"),
    ("{backend: ort, model: fraud-mlp, slo: 5ms, policy: brief, brief: {low: 0.96, high: 0.95}}",
     "spec.qos.batchControl[0].brief.low", "need 0 < low <= high < 1"),
    ("{backend: ort, model: fraud-mlp, slo: 5ms, aimd: {target: 95}}", "spec.qos.batchControl[0].aimd.target",
     "less than or equal to 1"),
    ("{backend: ort, model: fraud-mlp, slo: 5ms, policy: pid}", "spec.qos.batchControl[0].policy", "static"),
])
def test_bad_batch_control_config_is_refused_at_its_field(entry: str, where: str, reason: str) -> None:
    text = refusal(f"      - {entry}\n")
    assert where in text and reason in text and "q.yaml:" in text, text


def test_two_controllers_for_one_model_are_refused() -> None:
    text = refusal("      - {backend: ort, model: fraud-mlp, slo: 5ms}\n"
                   "      - {backend: ort, model: fraud-mlp, slo: 10ms, policy: aimd}\n")
    assert "spec.qos.batchControl[1]" in text and "one controller per endpoint and model" in text, text


def test_plans_from_a_compiled_config_drive_the_server(server: Server, client) -> None:
    from extproc.config.loader import load_text
    from extproc.qos.batch_control import plans_from

    snap = load_text(BASE % server.http_port + "      - {backend: ort, model: fraud-mlp, slo: 5s, policy: aimd,"
                     " period: 50ms, aimd: {start: 6, step: 1, hold: 1, maxSize: 40}}\n", "q.yaml")
    plans = plans_from(snap.spec.spec.qos, snap.backends)
    assert len(plans) == 1 and plans[0].base_url == server.base and plans[0].period == 0.05
    rt = BatchControlRuntime()
    try:
        rt.configure(plans)
        assert client.settings()["1"]["max_batch_size"] == 6  # the plan's start, delay from the server (1000)
        infer(server, 20)  # each 50 ms window with requests meets 5 s: +1 per window
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and client.settings()["1"]["max_batch_size"] == 6:
            time.sleep(0.05)
        now = client.settings()["1"]
        assert now["max_batch_size"] > 6 and now["max_queue_delay_us"] == 1000
        assert now["owner"] == f"{rt.owner}-ort"
        loop = next(iter(rt.loops.values()))
        rt.configure(plans)  # a reload with the same plan keeps the loop (and the policy's state)
        assert next(iter(rt.loops.values())) is loop
        assert rt.status()[0]["policy"] == "aimd" and rt.status()[0]["acting"] is True
        rt.configure(())  # a reload without it stops it and gives the lease back
        assert rt.loops == {} and client.settings()["1"]["owner"] is None
    finally:
        rt.stop()


def test_the_supervisor_runs_the_declared_controller_and_a_reload_removes_it(server: Server, client,
                                                                              tmp_path) -> None:
    from extproc.stack import free_port, free_port_block
    from extproc.supervisor import Supervisor

    head = BASE % server.http_port
    config = tmp_path / "gw.yaml"
    config.write_text(head + "      - {backend: ort, model: fraud-mlp, slo: 5ms, policy: static}\n")
    sup = Supervisor(str(config), "127.0.0.1", free_port_block(1), 1, free_port(), shutdown_grace=1.0,
                     state_dir=str(tmp_path / "state"))
    sup.start()
    try:
        owner = client.settings()["1"]["owner"]
        assert owner is not None and owner.startswith("gateway-") and owner.endswith("-ort")
        state = sup.config_state()["batch_control"]
        assert [(s["server"], s["model"], s["policy"], s["acting"]) for s in state] == [
            (server.base, MODEL, "static", True)]
        with pytest.raises(LeaseHeld):  # a second gateway's controller (or an operator) is refused
            client.apply(BatchSetting(2, 0))
        config.write_text(head.replace("    batchControl:\n", "    window: 100ms\n"))
        assert sup.reload().accepted
        assert sup.config_state()["batch_control"] == []
        assert client.settings()["1"]["owner"] is None
    finally:
        sup.stop()
