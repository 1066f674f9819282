"""Buffered metric updates (`extproc.metrics.Pending`) write exactly what direct updates would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import LATENCY_BUCKETS, ProcessorMetrics, Pending


def samples(registry: CollectorRegistry) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_flushed_updates_equal_direct_updates():
    direct, buffered = CollectorRegistry(), CollectorRegistry()
    md, mb = ProcessorMetrics(direct), ProcessorMetrics(buffered)
    pending = Pending()
    rng = random.Random(7)
    values = [rng.choice(LATENCY_BUCKETS) for _ in range(50)] + [rng.uniform(0, 2) for _ in range(200)] + [5.0]
    for v in values:  # bucket bounds themselves, values between them and one beyond the last
        md.phase_duration.labels("r", "request_headers").observe(v)
        pending.observe(mb.phase_duration.labels("r", "request_headers"), v)
    for n in (1, 1, 3, 0.5):
        md.requests.labels("r", "ok").inc(n)
        pending.inc(mb.requests.labels("r", "ok"), n)
    assert samples(buffered) != samples(direct)  # nothing written before the flush
    pending.flush()
    assert samples(buffered) == samples(direct)
    pending.flush()  # a second flush writes nothing again
    assert samples(buffered) == samples(direct)
