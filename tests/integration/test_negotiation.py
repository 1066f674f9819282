"""extproc/negotiate.py's Negotiator against a real server process: the OpenAI API simulator
(backends/simulator_openai.py), which enforces `json_schema` and sends usage in streams.

What is checked: what the probe learns, that an endpoint is probed once per worker (a second backend
on the same server, or a request, does not probe again; a health check does), that the config's
fixed parts win, and what a backend nobody answers for gets. The llama.cpp server's dialect, which
differs, is checked in tests/e2e/test_llamacpp.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from backends.dialects import PRESETS, Dialect
from extproc.config.loader import load_text
from extproc.negotiate import Negotiator
from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import REPO
from tests.promtext import scrape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def simulator():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1", "--port",
                             str(port), "--models", "m", "--log-level", "warning"], cwd=REPO,
                            stdout=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, proc, "simulator")
        yield port
    finally:
        stop_process(proc)


def snapshot(port: int, down: int):
    return load_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: n}}
spec:
  protocol: http
  backends:
    - {{name: a, endpoints: ["127.0.0.1:{port}"]}}
    - {{name: b, kind: vllm, endpoints: ["127.0.0.1:{port}"], dialect: {{priority: refused}}}}
    - {{name: fixed, endpoints: ["127.0.0.1:{port}"], dialect: {{preset: llamacpp, negotiate: false}}}}
    - {{name: down, endpoints: ["127.0.0.1:{down}"]}}
  routes:
    - {{path: /v1/, match: prefix, kind: openai, targets: [a, b, fixed, down]}}
""")


def chats(port: int) -> float:
    """Chat completions the simulator finished (the probe's structured, stream and priority requests)."""
    return scrape(f"http://127.0.0.1:{port}/metrics").total("vllm:request_success_total")


def test_what_negotiation_learns_and_how_often_it_asks(simulator):
    snap = snapshot(simulator, free_port())
    a, b, fixed, down = (snap.backends[n] for n in ("a", "b", "fixed", "down"))

    async def run():
        n = Negotiator()
        before = chats(simulator)
        assert not n.known(a) and n.dialect(a) == PRESETS["openai"]  # before: the kind's preset
        got = await n.ready(a, wait=10)
        after_a = chats(simulator)
        assert got == Dialect("json_schema", "yes", "ignored", "runtime", "openai")
        report = await n.negotiate(b, timeout=10)  # health check: this backend's endpoint probed afresh
        after_b = chats(simulator)
        assert report["source"] == "probe" and report["fixed_by_config"] == ["priority"]
        assert n.dialect(b).priority == "refused" and n.dialect(b).structured == "json_schema"
        n2 = Negotiator()
        n2.start(snap.backends.values())  # start-up: a and b share the endpoint; fixed is not probed
        await n2.ready(a, wait=10)
        await n2.ready(b, wait=10)
        after_start = chats(simulator)
        assert n2.known(fixed) and n2.dialect(fixed) == PRESETS["llamacpp"]
        assert (await n2.negotiate(fixed, timeout=1)) == {**PRESETS["llamacpp"].as_dict(), "source": "config"}
        gone = await n2.negotiate(down, timeout=5)
        assert gone["source"] == "default" and gone["endpoints"][0]["status"] == "down"
        assert n2.dialect(down) == PRESETS["openai"]
        return after_a - before, after_b - after_a, after_start - after_b

    first, health, startup = asyncio.run(run())
    assert first == 3  # structured (enforced at the first try), stream usage, priority
    assert health == 3  # probed again: fresh
    assert startup == 3  # two backends, one endpoint: probed once
