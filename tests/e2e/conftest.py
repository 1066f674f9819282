"""End-to-end fixtures: a real Envoy, the processor workers and the OpenAI API simulator."""

from __future__ import annotations

import pytest

from extproc.stack import Stack, free_port, free_port_block


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


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus endpoint, parsed: {(sample name, sorted labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in scrape(url).items() if n == name and want <= set(lab))


def wait_metric(url: str, name: str, expected: float, timeout: float = 5.0, **labels: str) -> float:
    """Poll until the metric reaches `expected` (requests are counted when Envoy's access log reports
    their end, a few tens of milliseconds after the response), or the deadline; returns the last value."""
    import time

    deadline = time.monotonic() + timeout
    value = metric_sum(url, name, **labels)
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric_sum(url, name, **labels)
    return value
