"""Policy: an adaptive concurrency limit per backend pool, driven by time to first token (gradient style).

What: how many requests a backend pool may have in flight through the gateway. The shape of Envoy's
adaptive concurrency filter and Netflix's Gradient2 limiter, fed with TTFT instead of total latency:
a streamed answer's total latency grows with its output length (a 2,000-token answer is not a sign of
overload), its first token comes after the engine queued and prefilled it, which is what grows when
too many requests are let in (the engine's `--max-num-seqs` is full and requests wait in its queue).

Formula, per batch of `samples` TTFT samples (queue time in the gateway excluded: from admission to
the first response body, streamed requests only):
    sampleRTT = mean of the batch's TTFTs
    minRTT    = the smallest sampleRTT of the last `minRttWindow` seconds (two buckets of that length: a
                minimum that forgets, so a backend that became slower for good is re-learnt), where only
                uncongested batches (peak in-flight <= max(minLimit, limit / 2)) may replace a forgotten
                minimum: congested ones can only lower it. Under sustained overload the minimum is kept
                (no ratchet from one overloaded window to the next). The price: a backend that became
                slower for good while saturated keeps a lower limit until the load eases to half the limit
                for a batch (Envoy instead pins concurrency to its minimum periodically to re-measure; with
                LLM requests holding slots for seconds of decoding that pause would cost too much)
    gradient  = clamp(tolerance * minRTT / sampleRTT, 0.5, 1)
    headroom  = sqrt(limit)                  (the queue-size term: room to probe above the current use)
                0 when the batch never used half the limit (an app-limited pool does not grow)
    new       = limit * gradient + headroom
    limit     = clamp((1 - smoothing) * limit + smoothing * new, minLimit, maxLimit)
At equilibrium limit * (1 - gradient) = sqrt(limit): sampleRTT settles at about
tolerance * minRTT / (1 - 1/sqrt(limit)), so TTFT stays within `tolerance` of its unloaded value plus
a margin that shrinks as the limit grows; above that the limit falls (by at most half of it per
batch, times the smoothing), below it grows by `smoothing * sqrt(limit)` per batch.
Parameters (`spec.qos.admission[]`): initialLimit, minLimit, maxLimit, tolerance (default 1.25, Envoy's 25 % buffer),
smoothing (0.2), samples (8), minRttWindow (30 s). `clock` is injectable (tests).
Cost: `sample` is a few float operations and an append; one update per `samples` samples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class LimiterParams:
    initial: int = 8
    min_limit: int = 1
    max_limit: int = 256
    tolerance: float = 1.25
    smoothing: float = 0.2
    samples: int = 8
    min_rtt_window: float = 30.0


class GradientLimiter:
    """One pool's limit in one worker (`limit` is what admission compares the pool's in-flight count to)."""

    __slots__ = ("params", "clock", "value", "_batch", "_batch_peak", "_mins", "_bucket", "min_rtt",
                 "last_sample_rtt", "updates")

    def __init__(self, params: LimiterParams, clock: Callable[[], float] = time.monotonic):
        self.params = params
        self.clock = clock
        self.value = float(min(max(params.initial, params.min_limit), params.max_limit))
        self._batch: list[float] = []
        self._batch_peak = 0
        self._mins: list[float] = [math.inf, math.inf]  # the previous and the current bucket's minimum
        self._bucket: int | None = None
        self.min_rtt: float | None = None
        self.last_sample_rtt: float | None = None
        self.updates = 0

    @property
    def limit(self) -> int:
        return max(self.params.min_limit, int(self.value))

    def configure(self, params: LimiterParams) -> None:
        """New parameters from a reload; the learnt limit and minRTT are kept (clamped to the new bounds)."""
        if params.initial != self.params.initial and self.updates == 0:
            self.value = float(params.initial)
        self.params = params
        self.value = float(min(max(self.value, params.min_limit), params.max_limit))

    def sample(self, ttft: float, inflight: int) -> bool:
        """One admitted request's TTFT (seconds) and the pool's in-flight count when it was admitted;
        True when the batch was full and the limit updated."""
        if ttft < 0 or not math.isfinite(ttft):
            return False
        self._batch.append(ttft)
        if inflight > self._batch_peak:
            self._batch_peak = inflight
        if len(self._batch) < self.params.samples:
            return False
        rtt = sum(self._batch) / len(self._batch)
        peak = self._batch_peak
        self._batch.clear()
        self._batch_peak = 0
        self.update(rtt, peak)
        return True

    def _min_rtt(self, rtt: float, uncongested: bool) -> float:
        bucket = int(self.clock() // self.params.min_rtt_window)
        if self._bucket is None:
            self._bucket = bucket
        elif bucket == self._bucket + 1:
            self._mins = [self._mins[1], math.inf]
        elif bucket > self._bucket + 1:
            self._mins = [math.inf, math.inf]
        self._bucket = bucket
        # a batch run with the pool congested may only lower the minimum: were it to replace a forgotten
        # one, each window would start from an overloaded TTFT and the limit would ratchet up
        if (uncongested or self.min_rtt is None or rtt < self.min_rtt) and rtt < self._mins[1]:
            self._mins[1] = rtt
        m = min(self._mins)
        if m < math.inf:
            self.min_rtt = m
        return self.min_rtt if self.min_rtt is not None else rtt

    def update(self, sample_rtt: float, peak_inflight: int) -> float:
        """The formula of the module docstring for one batch; returns the new limit value."""
        p = self.params
        limit = self.value
        min_rtt = self._min_rtt(sample_rtt, peak_inflight <= max(p.min_limit, limit / 2))
        self.last_sample_rtt = sample_rtt
        gradient = 1.0 if sample_rtt <= 0 else max(0.5, min(1.0, p.tolerance * min_rtt / sample_rtt))
        headroom = math.sqrt(limit) if peak_inflight * 2 >= limit else 0.0
        new = limit * gradient + headroom
        self.value = min(max((1 - p.smoothing) * limit + p.smoothing * new, p.min_limit), p.max_limit)
        self.updates += 1
        return self.value


__all__ = ["GradientLimiter", "LimiterParams"]
