"""IoT adapter time without the model: the brief's goal is under 8 ms p99 per command.

What is timed, per request, on a compiled iot route (the real stage, `extproc/stages/mqtt_command.py`,
with the worker's real MQTT connection, `extproc/iot/client.py`):
- `render`: the command looked up and checked (device pattern, params JSON Schema) and its topic,
  payload and reply topic templates rendered (`command_document` + `render_command`);
- `adapter`: `MqttCommand.on_request_body` whole: render, the QoS 1 publish to a real mosquitto, the
  PUBACK and the device's reply (matched by MQTT v5 correlation data), the client's answer encoded;
  sequentially (`c1`) and with 8 commands in flight (`c8`, each one's own latency).
The device answers at once: a paho-mqtt client in its own process (tests/e2e/mosquitto.py `Device`),
so the time is the gateway's and the broker's, plus the device's turnaround in Python.
Not timed: Envoy and the ext_proc round trips (perf/bench_overhead.py measures those per kind).

    .venv/bin/python perf/bench_iot.py               # 3,000 requests per mode; JSON + RESULTS.md
    .venv/bin/python perf/bench_iot.py -n 300 --no-write

Writes perf/results/iot.json and appends a section to perf/RESULTS.md (machine, date, command, load).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402

from benchenv import REPO, append_results, cpu, git_revision  # noqa: E402
from extproc.config.loader import load_text  # noqa: E402
from extproc.iot.client import MqttClients  # noqa: E402
from extproc.stages.mqtt_command import MqttCommand, command_document, render_command  # noqa: E402
from extproc.types import HttpMessage, Phase, RequestState, Respond  # noqa: E402
from tests.e2e.iot_gateway import iot_gateway  # noqa: E402
from tests.e2e.mosquitto import Mosquitto  # noqa: E402

COMMANDS = """\
          set-temperature:
            topic: "bench/{$.device}/set"
            payload: '{"id": $.correlationId, "setpoint": {"value": $.params.celsius, "unit": "C"}, "by": $.tenant ?? "anonymous"}'
            replyTopic: "bench/{$.device}/reply"
            params: {type: object, required: [celsius], properties: {celsius: {type: number, minimum: -40, maximum: 90}}}
"""


def config(port: int) -> str:
    return iot_gateway("bench-iot", f"127.0.0.1:{port}", COMMANDS, "500ms")


BODY = b'{"device": "boiler-7", "command": "set-temperature", "params": {"celsius": 21.5}}'
DEVICE = ("import sys; from tests.e2e.mosquitto import Device; d = Device(int(sys.argv[1]), 'bench/+/set'); "
          "print('ready', flush=True); sys.stdin.read(); d.stop()")


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(xs: list[float]) -> dict:
    ms = [x * 1e3 for x in xs]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 3), "p90_ms": round(pct(ms, 90), 3),
            "p99_ms": round(pct(ms, 99), 3), "max_ms": round(max(ms), 3), "mean_ms": round(sum(ms) / len(ms), 3)}


async def measure(snap, n: int) -> dict:
    route = snap.routes["v1-devices-command"]
    runtime = types.SimpleNamespace(mqtt=MqttClients())
    runtime.mqtt.configure(snap)
    stage = MqttCommand()

    def state() -> RequestState:
        st = RequestState(snapshot=snap, route=route, started=0.0, tenant="acme", runtime=runtime, request_id="r")
        st.input_doc = orjson.loads(BODY)
        return st

    msg = HttpMessage(Phase.REQUEST_BODY, body=BODY, end_of_stream=True)

    async def one() -> float:
        t0 = time.perf_counter()
        v = await stage.on_request_body(state(), msg)
        dt_ = time.perf_counter() - t0
        if not (isinstance(v, Respond) and v.status == 200):
            raise RuntimeError(f"unexpected verdict {v}")
        return dt_

    for _ in range(200):  # warm-up: connection, SUBACK, caches
        await one()
    render = []
    doc = orjson.loads(BODY)
    for _ in range(n):
        t0 = time.perf_counter()
        cmd, d = command_document(route.iot, doc, "r", "acme", "0123456789abcdef")
        render_command(cmd, d)
        render.append(time.perf_counter() - t0)
    c1 = [await one() for _ in range(n)]
    c8: list[float] = []
    for _ in range(n // 8):
        c8 += await asyncio.gather(*(one() for _ in range(8)))
    runtime.mqtt.close()
    return {"render": summary(render), "adapter_c1": summary(c1), "adapter_c8": summary(c8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=3000, help="requests per mode")
    ap.add_argument("--no-write", action="store_true", help="print only (no JSON, no RESULTS.md)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-iot-")
    broker = Mosquitto(tmp).start()
    device = subprocess.Popen([sys.executable, "-c", DEVICE, str(broker.port)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        if device.stdout.readline().strip() != "ready":
            raise RuntimeError("the bench device did not start")
        load_before = os.getloadavg()
        started = dt.datetime.now(dt.timezone.utc)
        res = asyncio.run(measure(load_text(config(broker.port)), args.n))
        load_after = os.getloadavg()
    finally:
        device.stdin.close()
        device.wait(10)
        broker.stop()
    mosq = subprocess.run([broker_bin(), "-h"], capture_output=True, text=True).stdout.splitlines()[:1]
    out = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": cpu(), "code": git_revision(),
           "command": "python perf/bench_iot.py" + (f" -n {args.n}" if args.n != 3000 else ""),
           "broker": mosq[0] if mosq else "mosquitto", "load_average_before": [round(x, 2) for x in load_before],
           "load_average_after": [round(x, 2) for x in load_after], "goal_p99_ms": 8.0, **res}
    print(json.dumps(out, indent=2))
    if args.no_write:
        return
    (REPO / "perf" / "results").mkdir(exist_ok=True)
    (REPO / "perf" / "results" / "iot.json").write_text(json.dumps(out, indent=2) + "\n")
    rows = "\n".join(f"| {name} | {r['n']} | {r['p50_ms']} | {r['p90_ms']} | {r['p99_ms']} | {r['max_ms']} |"
                     for name, r in (("render (templates, checks)", res["render"]),
                                     ("adapter, 1 in flight", res["adapter_c1"]),
                                     ("adapter, 8 in flight", res["adapter_c8"])))
    append_results(f"""
## {out['date']}: IoT adapter time without the model (perf/bench_iot.py)

- Machine: {out['machine']}; load average {out['load_average_before'][0]} before, {out['load_average_after'][0]} after
  (other engineers' jobs ran on the machine during the measurement)
- Code: git {out['code']}
- Command: `{out['command']}`
- Broker: {out['broker']}, on 127.0.0.1 (`set_tcp_nodelay true`); the device a paho-mqtt client in its own process that
  answers at once on the MQTT v5 response topic
- Timed: the real `mqtt-command` stage (templates rendered, params schema checked, QoS 1 publish, PUBACK, reply
  matched by correlation data, answer encoded); not Envoy or the ext_proc hops (perf/bench_overhead.py)

| what | requests | p50 ms | p90 ms | p99 ms | max ms |
|---|---:|---:|---:|---:|---:|
{rows}

Goal (the brief): under 8 ms p99 adapter time: {"met" if res["adapter_c1"]["p99_ms"] < 8 else "NOT met"} with one command in flight
({res["adapter_c1"]["p99_ms"]} ms), {"met" if res["adapter_c8"]["p99_ms"] < 8 else "NOT met"} with eight ({res["adapter_c8"]["p99_ms"]} ms).
""")


def broker_bin() -> str:
    from tests.e2e.mosquitto import mosquitto_binary

    return mosquitto_binary() or "mosquitto"


if __name__ == "__main__":
    main()
