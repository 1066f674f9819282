"""The dynamic batcher in process, with a fake ``run`` that records the batches it is given.

No test here measures time. That a batch does not wait for its delay is an ordering: the batch
loop takes it within a few turns of the event loop (`within_turns`, no sleeping: microseconds,
where the delay is a second). A test that needs a batch running holds it on a gate and waits for
the run to start."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from backends.onnxruntime.batcher import DynamicBatcher, QueueFull
from backends.onnxruntime.config import BatchingSettings

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """``run``: doubles ``x``; remembers batch sizes; fails on rows whose first value is negative."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[int] = []
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, feeds):
        x = feeds["x"]
        with self.lock:
            self.batches.append(x.shape[0])
        if self.delay:
            time.sleep(self.delay)
        if (x[:, 0] < 0).any():
            raise RuntimeError("negative input")
        return [x * 2, x.sum(axis=1)]


class GatedRecorder(Recorder):
    """A ``run`` that, once called, waits until the test opens its gate: ``entered`` is set when
    a batch is running, so a test orders events on that instead of on a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def __call__(self, feeds):
        self.entered.set()
        assert self.gate.wait(20), "the test never opened the gate"
        return super().__call__(feeds)


async def until(condition, what: str) -> None:
    """Yield to the event loop (and the pool's threads) until ``condition()`` holds; bounded."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def within_turns(condition, turns: int = 100) -> bool:
    """Whether ``condition()`` holds within ``turns`` turns of the event loop, without sleeping:
    a timer (a batch's delay) cannot fire meanwhile, so only what runs at once gets there."""
    for _ in range(turns):
        if condition():
            return True
        await asyncio.sleep(0)
    return condition()


MAX_DELAY_US = 1_000_000  # the longest max_queue_delay_us the settings allow


class Observer:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []

    def batch_done(self, rows, requests, queue_seconds, run_seconds, ok):
        self.calls.append((rows, requests, ok))


@pytest.fixture
def executor():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        yield pool


def _rows(n: int, start: float = 0.0, width: int = 3) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) + start)


async def test_requests_within_the_delay_run_as_one_batch_and_split_back(executor) -> None:
    run, observer = Recorder(), Observer()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=16, max_queue_delay_us=50_000),
                             observer=observer, name="t")
    inputs = [_rows(1 + i % 3, start=100 * i) for i in range(6)]
    results = await asyncio.gather(*(batcher.submit({"x": x}) for x in inputs))
    assert run.batches == [sum(x.shape[0] for x in inputs)]
    assert observer.calls == [(12, 6, True)]
    for x, (doubled, summed) in zip(inputs, results):
        np.testing.assert_array_equal(doubled, x * 2)
        np.testing.assert_array_equal(summed, x.sum(axis=1))
    await batcher.close()


async def test_max_batch_size_caps_rows_and_a_big_request_runs_alone(executor) -> None:
    run = Recorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=4, max_queue_delay_us=20_000), name="t")
    sizes = [1, 1, 1, 1, 1, 6, 1]
    results = await asyncio.gather(*(batcher.submit({"x": _rows(n)}) for n in sizes))
    assert all(b <= 4 or b == 6 for b in run.batches)
    assert 6 in run.batches and sum(run.batches) == sum(sizes)
    assert [r[0].shape[0] for r in results] == sizes
    await batcher.close()


async def test_full_batch_does_not_wait_for_the_delay(executor) -> None:
    run = GatedRecorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=4, max_queue_delay_us=MAX_DELAY_US))
    requests = [asyncio.ensure_future(batcher.submit({"x": _rows(1)})) for _ in range(4)]
    dispatched = lambda: batcher.queue_depth == 0 and len(batcher._running) == 1  # noqa: E731 (held at the gate)
    assert await within_turns(dispatched), "the full batch waited for its delay"
    run.gate.set()
    await asyncio.gather(*requests)
    assert run.batches == [4]
    await batcher.close()


async def test_batching_off_runs_each_request_alone(executor) -> None:
    run = Recorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=1, max_queue_delay_us=50_000))
    await asyncio.gather(*(batcher.submit({"x": _rows(2)}) for _ in range(5)))
    assert run.batches == [2] * 5
    await batcher.close()


async def test_configure_takes_effect_for_the_batch_being_formed(executor) -> None:
    run = Recorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=8, max_queue_delay_us=MAX_DELAY_US))
    first = asyncio.ensure_future(batcher.submit({"x": _rows(1)}))
    assert await within_turns(lambda: batcher._waiter is not None), "the batch loop is not waiting for company"
    assert batcher.queue_depth == 1 and not first.done()  # waiting for company for up to a second
    batcher.configure(BatchingSettings(max_batch_size=8, max_queue_delay_us=0))
    assert await within_turns(lambda: batcher.queue_depth == 0), "the waiting batch did not re-read its settings"
    await first
    assert run.batches == [1] and batcher.settings.max_queue_delay_us == 0
    await batcher.close()


async def test_incompatible_shapes_are_not_stacked(executor) -> None:
    run = Recorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=16, max_queue_delay_us=30_000))
    results = await asyncio.gather(batcher.submit({"x": _rows(1, width=3)}), batcher.submit({"x": _rows(1, width=5)}),
                                   batcher.submit({"x": _rows(2, width=3)}))
    assert sorted(run.batches) == [1, 3]
    assert [r[0].shape for r in results] == [(1, 3), (1, 5), (2, 3)]
    await batcher.close()


async def test_a_failing_request_does_not_fail_its_batch_mates(executor) -> None:
    run, observer = Recorder(), Observer()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=8, max_queue_delay_us=30_000),
                             observer=observer)
    good, bad, good2 = _rows(1, start=1), -_rows(1, start=1), _rows(2, start=5)
    results = await asyncio.gather(batcher.submit({"x": good}), batcher.submit({"x": bad}),
                                   batcher.submit({"x": good2}), return_exceptions=True)
    np.testing.assert_array_equal(results[0][0], good * 2)
    assert isinstance(results[1], RuntimeError)
    np.testing.assert_array_equal(results[2][0], good2 * 2)
    assert run.batches == [4, 1, 1, 2]  # the stacked run, then each request alone
    assert observer.calls[0] == (4, 3, False)
    await batcher.close()


async def test_cancelled_request_is_dropped_and_queue_limit_gives_queue_full(executor) -> None:
    run = GatedRecorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=1, max_queue_delay_us=0), max_queue=2)
    busy = asyncio.ensure_future(batcher.submit({"x": _rows(1)}))
    await until(run.entered.is_set, "the first request running")
    leaving = asyncio.ensure_future(batcher.submit({"x": _rows(1, start=9)}))
    staying = asyncio.ensure_future(batcher.submit({"x": _rows(1, start=3)}))
    await until(lambda: batcher.queue_depth == 2, "both requests queued")
    with pytest.raises(QueueFull):
        await batcher.submit({"x": _rows(1)})
    leaving.cancel()
    run.gate.set()
    await asyncio.gather(busy, staying)
    assert run.batches == [1, 1]  # the cancelled request never ran
    await batcher.close()


async def test_close_fails_queued_requests_and_lets_the_running_batch_finish(executor) -> None:
    run = GatedRecorder()
    batcher = DynamicBatcher(run, executor, BatchingSettings(max_batch_size=1))
    running = asyncio.ensure_future(batcher.submit({"x": _rows(1)}))
    await until(run.entered.is_set, "the first request running")
    queued = asyncio.ensure_future(batcher.submit({"x": _rows(1)}))
    await until(lambda: batcher.queue_depth == 1, "the second request queued")
    closing = asyncio.ensure_future(batcher.close())
    with pytest.raises(RuntimeError, match="unloading"):
        await queued
    assert not closing.done() and not running.done()  # close waits for the batch that is running
    run.gate.set()
    await closing
    np.testing.assert_array_equal((await running)[0], _rows(1) * 2)
    assert run.batches == [1]
    with pytest.raises(RuntimeError, match="unloading"):
        await batcher.submit({"x": _rows(1)})
