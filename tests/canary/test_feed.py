"""canary/feed.py: the worker's ring file and the supervisor's tail: write and read, wrap, a worker
restart, a lapped reader, and the lifecycle observer's record per outcome."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from canary.feed import FeedObserver, FeedReader, FeedWriter, variant_key
from extproc.lifecycle import Completion
from extproc.types import Outcome, RequestState


def test_records_written_are_read_once_in_order_with_their_fields(tmp_path):
    w = FeedWriter(tmp_path, worker=0, capacity=8)
    r = FeedReader(tmp_path)
    assert r.read() == []
    assert not list(tmp_path.iterdir())  # the file is created at the first record only
    k = variant_key("ro/canary")
    w.write(k, 1.5, 12.25, 3.5, False)
    w.write(k, 2.5, float("nan"), float("nan"), True)
    got = r.read()
    assert [(s.t, s.key, s.error) for s in got] == [(1.5, k, False), (2.5, k, True)]
    assert got[0].latency_ms == 12.25 and got[0].ttft_ms == 3.5
    assert math.isnan(got[1].latency_ms) and math.isnan(got[1].ttft_ms)
    assert r.read() == []  # nothing new
    w.write(k, 3.0, 1.0)
    assert [s.t for s in r.read()] == [3.0]


def test_the_ring_wraps_and_a_reader_that_fell_behind_skips_what_was_overwritten(tmp_path):
    w = FeedWriter(tmp_path, worker=0, capacity=4)
    r = FeedReader(tmp_path)
    w.write(1, 0.0)
    assert len(r.read()) == 1
    for i in range(1, 11):  # 10 more into 4 slots
        w.write(1, float(i))
    got = r.read()
    assert [s.t for s in got] == [7.0, 8.0, 9.0, 10.0]  # the last `capacity`
    assert r.dropped == 6
    assert os.path.getsize(w.path) == 32 + 4 * 32  # bounded: header + capacity slots


def test_several_workers_each_their_own_file_one_reader_sees_all(tmp_path):
    ws = [FeedWriter(tmp_path, worker=i, capacity=16) for i in range(3)]
    for i, w in enumerate(ws):
        for j in range(i + 1):
            w.write(variant_key(f"r/{i}"), float(j))
    got = FeedReader(tmp_path).read()
    assert sorted((s.key, s.t) for s in got) == sorted((variant_key(f"r/{i}"), float(j))
                                                       for i in range(3) for j in range(i + 1))


def test_a_restarted_worker_replaces_its_file_and_the_reader_drains_the_old_one_first(tmp_path):
    old = FeedWriter(tmp_path, worker=0, capacity=8)
    r = FeedReader(tmp_path)
    old.write(1, 1.0)
    assert len(r.read()) == 1
    old.write(1, 2.0)  # written, not yet read, when the worker dies
    new = FeedWriter(tmp_path, worker=0, capacity=8)  # the restarted process: a new file, count 0
    new.write(2, 3.0)
    assert [(s.key, s.t) for s in r.read()] == [(1, 2.0), (2, 3.0)]
    new.write(2, 4.0)
    assert [s.t for s in r.read()] == [4.0]


def test_records_from_another_process_are_read(tmp_path):
    code = ("import sys; from canary.feed import FeedWriter\n"
            "w = FeedWriter(sys.argv[1], worker=5)\n"
            "[w.write(7, float(i), 1.0 + i) for i in range(100)]\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    got = FeedReader(tmp_path).read()
    assert [s.t for s in got] == [float(i) for i in range(100)] and {s.key for s in got} == {7}


def test_without_a_directory_nothing_is_written(tmp_path):
    w = FeedWriter(None)
    w.write(1, 1.0)
    assert w.count == 0 and w.path is None


def test_a_foreign_or_short_file_is_ignored(tmp_path):
    (tmp_path / "canary-feed-9.bin").write_bytes(b"not a feed")
    FeedWriter(tmp_path, worker=0, capacity=4).write(1, 1.0)
    assert [s.t for s in FeedReader(tmp_path).read()] == [1.0]


class _Route:
    name = "v1"
    pipeline = None


def _state(variant: str | None, started: float, **kw) -> RequestState:
    st = RequestState(snapshot=None, route=_Route(), started=started)
    st.variant = variant
    for k, v in kw.items():
        setattr(st, k, v)
    return st


@pytest.mark.parametrize("outcome, error, timed", [
    (Outcome.OK, False, True), (Outcome.REJECTED, False, False), (Outcome.BACKEND_ERROR, True, False),
    (Outcome.TRUNCATED, True, False), (Outcome.TIMEOUT, True, False)])
def test_the_observer_writes_one_record_per_outcome_but_cancels(tmp_path, outcome, error, timed):
    obs = FeedObserver(FeedWriter(tmp_path, worker=0))
    start = time.monotonic() - 0.05
    obs(_state("ro/canary", start, completion=Completion(200, duration=0.040, first_upstream_byte=0.010)), outcome)
    [s] = FeedReader(tmp_path).read()
    assert s.key == variant_key("ro/canary") and s.error is error
    if timed:  # Envoy's duration and first upstream byte, in ms
        assert s.latency_ms == pytest.approx(40.0) and s.ttft_ms == pytest.approx(10.0)
    else:
        assert math.isnan(s.latency_ms) and math.isnan(s.ttft_ms)


def test_the_observer_skips_cancels_and_requests_without_a_variant_and_prefers_the_first_body(tmp_path):
    writer = FeedWriter(tmp_path, worker=0)
    obs = FeedObserver(writer)
    start = time.monotonic() - 0.1
    obs(_state(None, start), Outcome.OK)
    obs(_state("ro/stable", start), Outcome.CANCELLED)
    assert writer.count == 0 and not list(tmp_path.iterdir())
    obs(_state("ro/stable", start, first_body=start + 0.02), Outcome.OK)  # a streamed answer's first chunk
    [s] = FeedReader(tmp_path).read()
    assert s.ttft_ms == pytest.approx(20.0) and s.latency_ms >= 100.0  # no completion: on_done - start


def test_the_key_unit_travels_in_the_record_and_old_records_read_as_none(tmp_path):
    w = FeedWriter(tmp_path, worker=0, capacity=8)
    k = variant_key("ro/canary")
    w.write(k, 1.0, 5.0, 1.0, False, unit=0xABCDEF)
    w.write(k, 2.0, 5.0, 1.0, True, unit=1)
    w.write(k, 3.0, 5.0, 1.0, False)  # keyless: no unit (0 in the file, as records before units)
    got = FeedReader(tmp_path).read()
    assert [(s.unit, s.error) for s in got] == [(0xABCDEF, False), (1, True), (None, False)]


def test_the_observer_records_the_requests_key_unit(tmp_path):
    obs = FeedObserver(FeedWriter(tmp_path, worker=0))
    start = time.monotonic() - 0.05
    obs(_state("ro/canary", start, variant_unit=4242, completion=Completion(200, duration=0.04)), Outcome.OK)
    obs(_state("ro/canary", start, variant_unit=77), Outcome.BACKEND_ERROR)
    obs(_state("ro/canary", start), Outcome.OK)
    assert [(s.unit, s.error) for s in FeedReader(tmp_path).read()] == [(4242, False), (77, True), (None, False)]
