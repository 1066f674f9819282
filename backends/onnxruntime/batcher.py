"""Dynamic batching: requests that arrive close together run as one ``session.run``.

What: :class:`DynamicBatcher` queues requests of one model version.  When an instance (a
``session.run`` slot; ``instances`` in config.yaml) is free, the oldest queued request waits up to
``max_queue_delay_us`` from its arrival for others; requests whose non-batch dimensions and
datatypes match it are stacked along the first dimension (FIFO) up to ``max_batch_size`` rows, run
once in the thread pool, and the outputs are sliced back per request.  A request bigger than
``max_batch_size`` runs alone (it is never split or refused); ``max_batch_size`` 1 turns batching off.
Settings are an immutable :class:`BatchingSettings` swapped whole by :meth:`DynamicBatcher.configure`;
the next batch formed uses them (a batch already waiting re-reads them when woken).
When a stacked batch fails, each of its requests is run alone, so one bad input cannot fail the
requests it was batched with.  A client that went away (its future cancelled) is dropped before
its batch runs.

Why: per-call overhead (executor hop, ORT's run setup, a GEMV instead of a GEMM) dominates small
models; stacking turns N calls into one.  Waiting on the oldest request's arrival (not on the last
arrival) bounds the delay any request adds to ``max_queue_delay_us``, as Triton's batcher does.
Cost: per request one deque append, one future and one slice per output; per batch one
``np.concatenate`` per input and one executor hop.  Delays below the event loop's timer resolution
(about 1 ms with epoll) round up to it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from .config import BatchingSettings

__all__ = ["BatchObserver", "DynamicBatcher", "QueueFull"]

log = logging.getLogger("backends.onnxruntime.batcher")

RunFn = Callable[[Mapping[str, np.ndarray]], list[np.ndarray]]


class QueueFull(RuntimeError):
    """The model's queue holds ``max_queue`` requests already (HTTP 503)."""


class BatchObserver(Protocol):
    def batch_done(self, rows: int, requests: int, queue_seconds: Sequence[float], run_seconds: float,
                   ok: bool) -> None: ...


class _NullObserver:
    def batch_done(self, rows: int, requests: int, queue_seconds: Sequence[float], run_seconds: float,
                   ok: bool) -> None:
        return None


@dataclasses.dataclass(slots=True)
class _Pending:
    feeds: Mapping[str, np.ndarray]
    rows: int
    key: tuple
    future: asyncio.Future
    enqueued: float


def _stack_key(feeds: Mapping[str, np.ndarray]) -> tuple:
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in feeds.items()))


class DynamicBatcher:
    """The queue and batch loop of one model version; create and use it inside one event loop."""

    def __init__(self, run: RunFn, executor: concurrent.futures.Executor, settings: BatchingSettings, *,
                 instances: int = 1, batchable: bool = True, max_queue: int = 4096,
                 observer: BatchObserver | None = None, name: str = "") -> None:
        self._run = run
        self._executor = executor
        self._settings = settings
        self._batchable = batchable
        self._max_queue = max_queue
        self._observer = observer or _NullObserver()
        self._name = name
        self._queue: collections.deque[_Pending] = collections.deque()
        self._slots = asyncio.Semaphore(instances)
        self._waiter: asyncio.Future | None = None
        self._running: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._closed = False

    # -- control ---------------------------------------------------------------------------------

    @property
    def settings(self) -> BatchingSettings:
        return self._settings

    @property
    def batchable(self) -> bool:
        return self._batchable

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def configure(self, settings: BatchingSettings) -> None:
        """Swap the batching settings; the batch being formed re-reads them at once."""
        self._settings = settings
        self._wake()

    async def close(self) -> None:
        """Stop: queued requests fail with ``RuntimeError``; batches already running finish."""
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        while self._queue:
            pending = self._queue.popleft()
            if not pending.future.done():
                pending.future.set_exception(RuntimeError(f"model {self._name} is unloading"))
        if self._running:
            await asyncio.wait(set(self._running), timeout=1.0)

    # -- requests --------------------------------------------------------------------------------

    async def submit(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Queue one request (every input has the same first dimension) and await its outputs."""
        if self._closed:
            raise RuntimeError(f"model {self._name} is unloading")
        if len(self._queue) >= self._max_queue:
            raise QueueFull(f"model {self._name}: {len(self._queue)} requests queued (limit {self._max_queue})")
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop(),
                                                                     name=f"batcher-{self._name}")
        rows = next(iter(feeds.values())).shape[0] if self._batchable else 1
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(feeds, rows, _stack_key(feeds), future, time.perf_counter()))
        self._wake()
        return await future

    # -- the loop --------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _sleep_until_woken(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._wake) if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _rows_ready(self) -> int:
        """Rows that could join the oldest request's batch now."""
        head = self._queue[0]
        return sum(p.rows for p in self._queue if p.key == head.key)

    async def _batch_loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                while not self._queue:
                    await self._sleep_until_woken(None)
                while True:
                    settings = self._settings
                    if settings.max_batch_size <= 1 or not self._batchable:
                        break
                    if self._rows_ready() >= settings.max_batch_size:
                        break
                    remaining = self._queue[0].enqueued + settings.max_queue_delay_us / 1e6 - time.perf_counter()
                    if remaining <= 0:
                        break
                    await self._sleep_until_woken(remaining)
                batch = self._take(self._settings)
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._execute(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _take(self, settings: BatchingSettings) -> list[_Pending]:
        while self._queue and self._queue[0].future.done():  # cancelled by a client that left
            self._queue.popleft()
        if not self._queue:
            return []
        head = self._queue.popleft()
        batch = [head]
        if settings.max_batch_size <= 1 or not self._batchable:
            return batch
        rows, kept = head.rows, collections.deque()
        while self._queue:
            pending = self._queue.popleft()
            if pending.future.done():
                continue
            if pending.key == head.key and rows + pending.rows <= settings.max_batch_size:
                batch.append(pending)
                rows += pending.rows
            else:
                kept.append(pending)
                if rows >= settings.max_batch_size:
                    break
        kept.extend(self._queue)
        self._queue = kept
        return batch

    def _timed_run(self, feeds: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], float]:
        started = time.perf_counter()
        outputs = self._run(feeds)
        return outputs, time.perf_counter() - started

    async def _execute(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        dispatched = time.perf_counter()
        queue_seconds = [dispatched - p.enqueued for p in batch]
        rows = sum(p.rows for p in batch)
        try:
            if len(batch) == 1:
                feeds = batch[0].feeds
            else:
                feeds = {name: np.concatenate([p.feeds[name] for p in batch], axis=0) for name in batch[0].feeds}
            try:
                outputs, run_seconds = await loop.run_in_executor(self._executor, self._timed_run, feeds)
            except Exception as exc:
                self._observer.batch_done(rows, len(batch), queue_seconds, time.perf_counter() - dispatched, False)
                if len(batch) == 1:
                    _settle(batch[0].future, exc)
                else:
                    await self._run_alone(batch)
                return
            self._observer.batch_done(rows, len(batch), queue_seconds, run_seconds, True)
            if len(batch) == 1:
                _settle(batch[0].future, outputs)
                return
            if any(o.ndim == 0 or o.shape[0] != rows for o in outputs):
                log.warning("model %s: an output's first dimension is not the batch's %d rows; "
                            "running the batch's requests one by one", self._name, rows)
                await self._run_alone(batch)
                return
            offset = 0
            for pending in batch:
                end = offset + pending.rows
                _settle(pending.future, [o[offset:end] for o in outputs])
                offset = end
        except BaseException as exc:  # cancelled at shutdown, or a bug: never leave a caller hanging
            for pending in batch:
                _settle(pending.future, exc if isinstance(exc, Exception) else RuntimeError("batch cancelled"))
            raise
        finally:
            self._slots.release()

    async def _run_alone(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        for pending in batch:
            if pending.future.done():
                continue
            try:
                outputs, run_seconds = await loop.run_in_executor(self._executor, self._timed_run, pending.feeds)
            except Exception as exc:
                self._observer.batch_done(pending.rows, 1, (), 0.0, False)
                _settle(pending.future, exc)
            else:
                self._observer.batch_done(pending.rows, 1, (), run_seconds, True)
                _settle(pending.future, outputs)


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
