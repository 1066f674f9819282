"""A worker killed while a reload is under way (issue 12: perf/soak.py's 47 unexpected 503s).

The race the soak hit: worker 0 was SIGKILLed, and a reload began before the supervisor restarted
it. The reload publishes generation 2 and waits for every worker (the restarted one included) to
serve it before it gives Envoy the new routes (workers first, Envoy second). So the restarted
worker came up on generation 2 while Envoy still routed with generation 1's digest; a worker that
never restarted still holds generation 1's snapshot, the restarted one did not and refused every
stream with 503 `config_mismatch` (the soak's httpx `LocalProtocolError`s were the same 503s, sent
while the client was still writing the body) until Envoy got generation 2.

Here the race is made deterministic, through the real Envoy 1.40 and real workers: the
supervisor's spawn lock is held from the kill until generation 2 is published (so the restart
cannot load generation 1 first), and the supervisor's xDS writer is wrapped so that, at the moment
the reload hands generation 2 to Envoy, requests on every route go through Envoy (still on
generation 1's routes) to the restarted worker (the only one) before the real writer runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from extproc.config.bundle import current_bundle, read_manifest
from tests.e2e.test_reliability import STEADY, Topology, echo, simulator, start_stack, write_config
from tests.e2e.test_xds_live import procs  # noqa: F401  (procs is a fixture)

pytestmark = pytest.mark.e2e


def health_flags(admin_url: str, cluster: str, host: str) -> str:
    for line in httpx.get(f"{admin_url}/clusters", timeout=5).text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[1] == host and parts[2] == "health_flags":
            return parts[3]
    return ""


class RequestsBeforeEnvoyUpdate:
    """The supervisor's `xds` (an object with `write(snapshot, workers)`): before the real writer
    gives Envoy the reload's routes, waits until Envoy has health-checked the restarted worker
    back in, then sends every route's request through Envoy and records the answers and what the
    processor's supervisor said about worker 0 at that moment."""

    def __init__(self, st: Any, host: str, rounds: int = 3):
        self.st, self.host, self.rounds = st, host, rounds
        self.real = st.supervisor.xds
        self.answers: list[tuple[str, int, str]] = []
        self.worker0: dict[str, Any] | None = None
        self.flags = ""

    def write(self, snap: Any, workers: int | None = None, **kw: Any) -> Any:
        st = self.st
        deadline = time.monotonic() + 15
        while (flags := health_flags(st.admin_url, "adapter_processor", self.host)) != "healthy":
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.flags = flags
        self.worker0 = st.supervisor.config_state()["workers"][0]
        with httpx.Client(timeout=10) as client:
            for _ in range(self.rounds):
                for req in STEADY:
                    r = client.request(req.method, st.url + req.path, content=req.body)
                    code = ""
                    if r.status_code != 200:
                        try:
                            code = str(r.json().get("error", {}).get("code", ""))
                        except ValueError:
                            code = r.text[:80]
                    self.answers.append((req.path, r.status_code, code))
        return self.real.write(snap, workers, **kw)


def test_a_worker_restarted_during_a_reload_serves_the_routes_envoy_still_has(tmp_path, procs, stack_factory):
    sim, echo_server = simulator(procs), echo(procs)
    base = Topology([sim.id], [echo_server.id])
    cfg = write_config(tmp_path / "gw.yaml", base)
    st = start_stack(stack_factory, cfg, workers=1)  # one worker: every stream goes to the restarted one
    sup = st.supervisor
    first = sup.snapshot
    host = f"127.0.0.1:{sup.workers[0].port}"
    probe = RequestsBeforeEnvoyUpdate(st, host)
    sup.xds = probe
    write_config(cfg, Topology(base.llm, base.echo, timeout="29s"))  # generation 2: another digest
    result: dict[str, Any] = {}
    old_pid = sup.workers[0].pid
    with sup._lock:  # the monitor spawns under it: the restart waits until generation 2 is published
        os.kill(old_pid, signal.SIGKILL)
        reload = threading.Thread(target=lambda: result.update(r=sup.reload()), daemon=True)
        reload.start()
        deadline = time.monotonic() + 10
        while read_manifest(current_bundle(sup.bundle_root))["generation"] != 2:
            assert time.monotonic() < deadline, "generation 2 was not published"
            time.sleep(0.02)
    reload.join(30)
    assert not reload.is_alive(), "the reload did not finish"
    r = result["r"]
    assert r.accepted and r.generation == 2 and r.digest != first.digest, r
    # the race happened: when the reload handed generation 2 to Envoy, worker 0 was a new process
    # serving generation 2, and Envoy had health-checked it back in (still on generation 1's routes)
    w0 = probe.worker0
    assert w0 is not None and w0["pid"] != old_pid and w0["restarts"] == 1, w0
    assert (w0["generation"], w0["digest"]) == (2, r.digest), w0
    assert probe.flags == "healthy", probe.flags
    failed = [a for a in probe.answers if a[1] != 200]
    assert len(probe.answers) == 3 * len(STEADY) and failed == [], failed
    assert not r.errors, r.errors
    # and after Envoy got generation 2, every route still answers
    with httpx.Client(timeout=10) as client:
        for req in STEADY:
            resp = client.request(req.method, st.url + req.path, content=req.body)
            assert resp.status_code == 200, (req.path, resp.status_code, resp.text)
