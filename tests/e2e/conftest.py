"""End-to-end fixtures: a real Envoy, the processor workers and the OpenAI API simulator."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extproc.stack import Stack, free_port, free_port_block, wait_http
from tests.conftest import REPO
from tests.promtext import metric_sum, parse, scrape, wait_metric  # noqa: F401  (re-exported: tests import them from here)


def make_stack(config: str, workers: int = 2, **kw) -> Stack:
    return Stack(str(config), listen_port=free_port(), admin_port=free_port(),
                 processor_base_port=free_port_block(workers), processor_admin_port=free_port(),
                 workers=workers, **kw)


@pytest.fixture
def stack_factory():
    """Start stacks on free ports; all are stopped at the end of the test."""
    started: list[Stack] = []

    def start(config, **kw) -> Stack:
        st = make_stack(config, **kw)
        started.append(st)
        return st.start()

    yield start
    for st in started:
        st.stop()


class Simulator:
    """backends/simulator_openai.py serving `model` on a free port, its further command-line `args` after
    the defaults; its process goes into `procs` (the caller stops it, e.g. test_xds_live's `procs` fixture).
    `served()` is the simulator's own count of finished requests."""

    def __init__(self, procs: list, *args: str, model: str = "m") -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.simulator_openai", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--models", model, "--log-level", "warning", *args],
                                     cwd=REPO, stdout=subprocess.DEVNULL)
        procs.append(self.proc)
        wait_http(f"{self.url}/health", 30, self.proc, "simulator")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def id(self) -> str:
        return f"127.0.0.1:{self.port}"

    def served(self) -> float:
        return scrape(f"{self.url}/metrics").total("vllm:request_success_total")
