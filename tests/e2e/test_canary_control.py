"""Canary control through the real Envoy, processor workers and OpenAI-API simulators: a fast plan
(steps 20 -> 50 -> 100 %, 30 samples per arm, 1 s dwell, judged every 0.5 s) on two rollouts.

- `gpt-v2` (route `chat`, arms on two identical simulators) promotes step by step to 100 % under
  keyless load, every step applied as a new generation the workers acknowledge before Envoy gets it,
  with no failed request; afterwards every request is served by the canary.
- `gpt-v3` (route `comp`) rolls back to 0 % once its canary simulator is stopped (Envoy answers 503
  for it: `backend_error`, an error in the feed), within a bounded time; afterwards every request is
  on the baseline, and `x-canary` forcing is off.
- A worker killed in between is restarted with a new feed file, which the controller reads.
- Both states survive a supervisor restart (the saved plans, not the file's 10 %).
Checked with `adapterctl canary status --json`, the `x-adapter-variant` header and the per-arm counter.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from extproc.cli import main
from extproc.stack import stop_process
from extproc.supervisor import Supervisor
from tests.e2e.conftest import wait_metric

pytestmark = pytest.mark.e2e

PLAN = {"steps": [20, 50, 100], "minSamples": 30, "dwell": "1s", "interval": "500ms",
        # the arms are separate simulator processes on a shared machine: a wide latency margin,
        # so only a real failure (errors) can fail them here
        "judge": {"latency": {"marginMs": 200}, "ttft": {"marginMs": 200}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"model": "m", "prompt": "hi", "max_tokens": 2}


def write(path: Path) -> Path:
    arms = lambda canary: [{"name": "stable", "backend": "gpt-stable"},  # noqa: E731
                           {"name": "canary", "backend": canary, "weight": 10}]
    key = {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id", "x-canary"],
           "force": {"header": "x-canary"}}
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "canary-control"},
        "spec": {
            "processor": {"stateDir": "state"},
            "backends": [{"name": n, "models": ["m"], "endpoints": [f"{n}:8000"]}
                         for n in ("gpt-stable", "gpt-canary", "gpt-broken")],
            "routes": [
                {"path": "/v1/chat/completions", "kind": "openai", "name": "chat", "targets": ["gpt-stable", "gpt-canary"]},
                {"path": "/v1/completions", "kind": "openai", "name": "comp", "targets": ["gpt-stable", "gpt-broken"]},
            ],
            "rollouts": [
                {"name": "gpt-v2", "route": "chat", "arms": arms("gpt-canary"), "key": key, "plan": PLAN},
                {"name": "gpt-v3", "route": "comp", "arms": arms("gpt-broken"), "key": key, "plan": PLAN},
            ],
        },
    }
    path.write_text(json.dumps(doc, indent=1))
    return path


def status(st, capsys) -> dict:
    code = main(["canary", "status", "--json", "--admin", st.processor_admin_url])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)["rollouts"]


class Load:
    """Keyless requests from a few threads until stopped; status codes and variants counted."""

    def __init__(self, url: str, path: str, body: dict, threads: int = 4):
        self.url, self.path, self.body = url, path, body
        self.codes: Counter = Counter()
        self.variants: Counter = Counter()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(threads)
        self._futures = [self._pool.submit(self._run) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(timeout=20) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(f"{self.url}{self.path}", json=self.body)
                    self.codes[r.status_code] += 1
                    self.variants[r.headers.get("x-adapter-variant")] += 1
                except httpx.HTTPError as e:
                    self.codes[type(e).__name__] += 1

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        self._pool.shutdown()


def wait_for(st, capsys, rollout: str, want: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        doc = status(st, capsys)[rollout]
        if (doc["plan"]["status"] == want and doc["live"]) or time.monotonic() > deadline:  # decided and applied
            return doc
        time.sleep(0.25)


def test_a_fast_plan_promotes_identical_arms_to_100_rolls_a_failing_canary_back_and_survives_a_restart(
        tmp_path, stack_factory, capsys):
    cfg = write(tmp_path / "gw.yaml")
    st = stack_factory(cfg, workers=2, simulate=True, run_dir=str(tmp_path / "run"))
    first = status(st, capsys)
    assert first["gpt-v2"]["arms"]["canary"]["weight_percent"] == 20  # the plan's first step, not the file's 10
    generation = st.supervisor.snapshot.generation

    # identical arms: promoted step by step to 100 %, no request failing on the way
    t0 = time.monotonic()
    load = Load(st.url, "/v1/chat/completions", CHAT)
    try:
        doc = wait_for(st, capsys, "gpt-v2", "completed", 40)
    finally:
        load.stop()
    took = time.monotonic() - t0
    assert doc["plan"]["status"] == "completed", (doc["plan"], doc["last_hold"], doc["verdict"])
    assert [(e["kind"], e["to_weight_bp"]) for e in doc["events"]] == [("start", 2000), ("promote", 5000),
                                                                        ("promote", 10000)]
    assert all(e["by"] == "judge" and e["evidence"]["verdict"]["verdict"] == "pass" for e in doc["events"][1:])
    assert dict(load.codes) == {200: sum(load.codes.values())}, load.codes  # 0 failed requests
    assert load.variants["gpt-v2/canary"] > 0 and load.variants["gpt-v2/stable"] > 0
    assert st.supervisor.snapshot.generation >= generation + 2  # one republish per step
    assert took < 40
    with httpx.Client(timeout=20) as client:  # at 100 %: every request on the canary
        seen = {client.post(f"{st.url}/v1/chat/completions", json=CHAT,
                            headers={"x-user-id": f"u{i}"}).headers.get("x-adapter-variant") for i in range(20)}
    assert seen == {"gpt-v2/canary"}

    # a worker restarts (SIGKILL; the supervisor starts a new process with a new feed file)
    sup = st.supervisor
    feed0 = Path(sup.feed_dir) / "canary-feed-0.bin"
    inode = feed0.stat().st_ino
    os.kill(sup.workers[0].proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not (sup.workers[0].restarts == 1 and sup.workers[0].ready and sup.alive()):
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.1)

    # the canary of gpt-v3 fails (its simulator stops: Envoy answers 503): rolled back to 0 %
    stop_process(st.simulators["gpt-broken"][0])
    t0 = time.monotonic()
    load = Load(st.url, "/v1/completions", COMP)
    try:
        doc = wait_for(st, capsys, "gpt-v3", "rolled_back", 30)
    finally:
        load.stop()
    assert doc["plan"]["status"] == "rolled_back", (doc["plan"], doc["last_hold"], doc["verdict"])
    ev = doc["events"][-1]
    assert ev["kind"] == "rollback" and ev["by"] == "judge" and ev["from_weight_bp"] == 2000
    failed = {m["metric"]: m for m in ev["evidence"]["verdict"]["metrics"] if m["verdict"] == "fail"}
    assert set(failed) == {"error"} and failed["error"]["errors_canary"] >= 30
    assert doc["arms"]["canary"]["weight_percent"] == 0 and time.monotonic() - t0 < 30
    # the restarted worker wrote a new file (it has records), and the controller read it; the file's inode
    # number is not compared: the filesystem may give the new file the deleted one's (clean-clone run 3)
    assert inode and struct.unpack_from("<Q", feed0.read_bytes(), 24)[0] > 0
    tail = sup.controller.reader._tails[feed0.name]
    assert tail.ino == feed0.stat().st_ino and tail.cursor > 0
    assert load.codes[200] > 0 and load.codes[503] > 0  # the canary's requests failed until the rollback
    url = f"{st.processor_admin_url}/metrics"  # the per-arm counter saw the canary's failures
    assert wait_metric(url, "adapter_processor_variant_requests_total", 30, route="comp", rollout="gpt-v3",
                       arm="canary", outcome="backend_error") >= 30
    with httpx.Client(timeout=20) as client:  # everyone on the baseline, forcing off
        for i in range(20):
            r = client.post(f"{st.url}/v1/completions", json=COMP, headers={"x-user-id": f"u{i}", "x-canary": "true"})
            assert r.status_code == 200 and r.headers["x-adapter-variant"] == "gpt-v3/stable"

    # a supervisor restart resumes both plans from the state directory (spec.processor.stateDir)
    assert (tmp_path / "state" / "gpt-v2.plan.json").exists()
    old = st.supervisor
    old.stop()
    st.supervisor = Supervisor(old.config_path, old.address, old.workers[0].port, len(old.workers), old.admin[1],
                               shutdown_grace=old.grace, log_level=old.log_level, endpoints=old.endpoints,
                               xds=old.xds)
    st.supervisor.start()
    after = status(st, capsys)
    assert after["gpt-v2"]["plan"]["status"] == "completed" and after["gpt-v2"]["arms"]["canary"]["weight_percent"] == 100
    assert after["gpt-v3"]["plan"]["status"] == "rolled_back" and after["gpt-v3"]["arms"]["canary"]["weight_percent"] == 0
    with httpx.Client(timeout=20) as client:
        deadline = time.monotonic() + 10
        while True:  # Envoy reconnects to the restarted workers
            r = client.post(f"{st.url}/v1/chat/completions", json=CHAT, headers={"x-user-id": "after"})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and r.headers["x-adapter-variant"] == "gpt-v2/canary"
