"""End-to-end fixtures: a real Envoy, the processor workers and the OpenAI API simulator."""

from __future__ import annotations

import pytest

from extproc.stack import Stack, free_port, free_port_block
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
