"""The supervisor: workers on consecutive ports, merged metrics, restart of a dead worker, clean stop."""

from __future__ import annotations

import os
import signal
import time

import httpx

from extproc.stack import free_port, free_port_block
from extproc.supervisor import Supervisor
from tests.conftest import DATA


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_workers_restart_and_stop_cleanly():
    base = free_port_block(2)
    admin = free_port()
    sup = Supervisor(str(DATA / "recorded" / "config.yaml"), "127.0.0.1", base, 2, admin, shutdown_grace=1.0)
    sup.start()
    try:
        assert [w.port for w in sup.workers] == [base, base + 1]
        assert httpx.get(f"http://127.0.0.1:{admin}/healthz").status_code == 200
        metrics = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
        assert "adapter_processor_config_generation 1.0" in metrics
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
    finally:
        pids = sup.pids
        sup.stop()
    assert not [p for p in pids if alive(p)]
