"""Prometheus metrics, parsed with prometheus_client's own parser, for every test folder.

What: `parse(text)` turns a text exposition into `Samples`, a mapping
{(sample name, sorted label pairs): value}; `scrape(url)` fetches and parses an HTTP endpoint;
`collect(registry)` does the same in process for a `CollectorRegistry` (the processor's
`ProcessorMetrics` lives on one; flush the servicer's `Pending` first). On `Samples`:
`value(name, **labels)` is the one sample whose label set is exactly `labels` (AssertionError when
absent, or `default`), `series(name)` is every label set of a sample name, `total(name, **labels)`
sums the samples whose labels include `labels`.
Why: substring checks on exposition text pass on a line that has extra labels, another value or a
prefix of the value (`... 1.0` matches `... 1.05`); a parser does not.
`metric_sum` and `wait_metric` keep the signatures tests/e2e/conftest.py had.
"""

from __future__ import annotations

import time
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]


class Samples(dict):
    """{(sample name, sorted (label, value) pairs): value}, as parsed from one exposition."""

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        if key in self:
            return dict.__getitem__(self, key)
        if default is not None:
            return default
        have = [dict(lab) for lab in sorted(lab for n, lab in self if n == name)]
        raise AssertionError(f"no sample {name}{labels}; that name has label sets {have}")

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every label set (sorted pairs) of sample `name`, with its value."""
        return {lab: v for (n, lab), v in self.items() if n == name}

    def label_sets(self, name: str) -> list[dict[str, str]]:
        return [dict(lab) for lab in self.series(name)]

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 when there is none)."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.items() if n == name and want <= set(lab))

    def names(self) -> set[str]:
        return {n for n, _ in self}


def parse(text: str, skip_created: bool = True) -> Samples:
    """Parse a Prometheus text exposition (`_created` samples left out unless asked for)."""
    out = Samples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if skip_created and s.name.endswith("_created"):
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"sample {key} exposed twice"
            out[key] = s.value
    return out


def families(text: str) -> dict[str, str]:
    """{family name: type} of an exposition (counters are named without `_total`)."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def scrape(url: str) -> Samples:
    """A Prometheus HTTP endpoint, fetched (it must answer 200) and parsed."""
    import httpx

    response = httpx.get(url, timeout=5)
    assert response.status_code == 200, (url, response.status_code)
    return parse(response.text)


def collect(registry, flush: Iterable = ()) -> Samples:
    """A `CollectorRegistry`, exposed as a scrape would see it and parsed. `flush`: objects with a
    `flush()` or `flush_metrics()` (a `Pending`, a servicer) called first."""
    from prometheus_client import generate_latest

    for f in flush:
        (getattr(f, "flush_metrics", None) or f.flush)()
    return parse(generate_latest(registry).decode())


def metric_sum(url: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`, scraped from `url`."""
    return scrape(url).total(name, **labels)


def wait_metric(url: str, name: str, expected: float, timeout: float = 5.0, **labels: str) -> float:
    """Poll until the metric reaches `expected` (requests are counted when Envoy's access log reports
    their end, a few tens of milliseconds after the response), or the deadline; returns the last value."""
    deadline = time.monotonic() + timeout
    value = metric_sum(url, name, **labels)
    while value < expected and time.monotonic() < deadline:
        time.sleep(0.05)
        value = metric_sum(url, name, **labels)
    return value


def wait_samples(url: str, ready, timeout: float = 5.0) -> Samples:
    """Scrape until `ready(samples)` is true or the deadline; returns the last scrape."""
    deadline = time.monotonic() + timeout
    s = scrape(url)
    while not ready(s) and time.monotonic() < deadline:
        time.sleep(0.05)
        s = scrape(url)
    return s


def settled(url: str, interval: float = 0.3, timeout: float = 5.0) -> Samples:
    """Scrape until two scrapes `interval` apart agree (longer than the workers' 250 ms flush: updates of
    requests that already ended are written), for a baseline that later counts are compared with."""
    deadline = time.monotonic() + timeout
    last = scrape(url)
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = scrape(url)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{url} did not settle within {timeout}s")

