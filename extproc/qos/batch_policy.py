"""Batch policies: from one window's SLO attainment to the next dynamic-batching setting.

What: a policy turns an `Observation` (one control window: the fraction of requests that met the
latency SLO, and how many there were) into a `BatchSetting` (`max_batch_size` rows,
`max_queue_delay_us`) for our ONNX Runtime server's dynamic batcher (backends/onnxruntime/batcher.py).
`extproc/qos/batch_control.py` calls `decide` every window (100 ms) and writes the result to the
server. Three policies, one per section below: `StaticPolicy` (the setting never changes: the
baseline), `BriefPolicy` (the brief's `updateBatchSize`, §2.4) and `AimdPolicy` (additive increase
while the SLO holds, multiplicative decrease on a violation). Policies are small state machines with
no clock and no I/O: the window is the unit of time, so tests drive them with synthetic sequences.
Windows with fewer than `min_requests` requests carry no evidence: every policy keeps its setting.
Cost: a few float operations per window (10 per second); nothing on the request path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AimdPolicy", "BatchSetting", "BriefPolicy", "Observation", "StaticPolicy", "update_batch_size",
           "POLICIES"]

MAX_BATCH = 4096  # the server's own limit (backends/onnxruntime/config.py MAX_BATCH_SIZE_LIMIT)


@dataclass(frozen=True, slots=True)
class BatchSetting:
    max_batch_size: int  # rows per session.run (1: batching off)
    max_queue_delay_us: int  # how long the oldest queued request waits for company

    def as_body(self) -> dict[str, int]:
        return {"max_batch_size": self.max_batch_size, "max_queue_delay_us": self.max_queue_delay_us}


@dataclass(frozen=True, slots=True)
class Observation:
    """One control window: `attainment` = met / requests in [0, 1] (None when requests == 0)."""

    attainment: float | None
    requests: int


def _check(cond: bool, field: str, reason: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {reason}")


# -- static ------------------------------------------------------------------------------------------


@dataclass
class StaticPolicy:
    """The baseline: the model's configured setting (config.yaml), never changed.
    Parameters: `setting`. Cost: none."""

    setting: BatchSetting
    name: str = "static"

    def initial(self) -> BatchSetting:
        return self.setting

    def decide(self, obs: Observation) -> BatchSetting:
        return self.setting


# -- the brief's updateBatchSize ---------------------------------------------------------------------


def update_batch_size(slo_ratio: float, base: int = 32, low: float = 0.9, high: float = 0.95,
                      gain: float = 5.0, boost: float = 1.5) -> int:
    """The brief's function, exactly (Go's `int(float64)` truncates toward zero, as `int()` does)::

        func updateBatchSize(sloRatio float64) int {
            base := 32
            if sloRatio < 0.9 { return int(float64(base) * (1.0 - (0.9 - sloRatio) * 5)) }
            if sloRatio > 0.95 { return int(float64(base) * 1.5) }
            return base
        }

    Unclamped: below a ratio of 0.7 it returns 0 or less (the caller clamps)."""
    if slo_ratio < low:
        return int(float(base) * (1.0 - (low - slo_ratio) * gain))
    if slo_ratio > high:
        return int(float(base) * boost)
    return base


@dataclass
class BriefPolicy:
    """The brief's `updateBatchSize` (§2.4: "the lower the SLO attainment, the smaller the batch, to
    cut tail latency"; "shrinks aggressively below 90 %, grows moderately above 95 %").

    Formula (ratio r = the window's attainment, 0..1; B = `base`):
        r < 0.9          -> size = trunc(B * (1 - (0.9 - r) * 5))   (r = 0.8: 0.5 B; r <= 0.7: 0)
        0.9 <= r <= 0.95 -> size = B
        r > 0.95         -> size = trunc(B * 1.5)
    then clamped to [`min_size`, `max_size`] (our interpretation: the brief's formula reaches 0 and
    negative sizes below r = 0.7; the server's smallest size is 1, batching off).
    The brief's function is memoryless: the size is a function of this window's ratio only, not a
    step from the previous size; the 0.9..0.95 band maps to B itself, so it is a dead band around B,
    not hysteresis. The delay (`max_queue_delay_us`) is kept at `delay_us`: the brief's "batch
    window" is its batch size (the only output of its function).
    Parameters: base 32 (rows), low 0.9, high 0.95, gain 5 (per unit of ratio), boost 1.5, min_size 1,
    max_size 4096, delay_us (the model's configured delay), min_requests 1.
    Cost: three comparisons and a multiplication per window."""

    delay_us: int
    base: int = 32
    low: float = 0.9
    high: float = 0.95
    gain: float = 5.0
    boost: float = 1.5
    min_size: int = 1
    max_size: int = MAX_BATCH
    min_requests: int = 1
    name: str = "brief"
    current: BatchSetting | None = None

    def __post_init__(self) -> None:
        _check(1 <= self.base <= MAX_BATCH, "base", f"{self.base} is outside [1, {MAX_BATCH}]")
        _check(0.0 < self.low <= self.high < 1.0, "low/high", f"need 0 < low <= high < 1, got {self.low}, {self.high}")
        _check(self.gain > 0 and self.boost >= 1.0, "gain/boost", "gain must be > 0 and boost >= 1")
        _check(1 <= self.min_size <= self.max_size <= MAX_BATCH, "min_size/max_size",
               f"need 1 <= min_size <= max_size <= {MAX_BATCH}")
        _check(0 <= self.delay_us <= 1_000_000, "delay_us", f"{self.delay_us} is outside [0, 1000000]")
        self.current = self.initial()

    def initial(self) -> BatchSetting:
        return BatchSetting(min(max(self.base, self.min_size), self.max_size), self.delay_us)

    def decide(self, obs: Observation) -> BatchSetting:
        if obs.attainment is None or obs.requests < self.min_requests:
            return self.current
        size = update_batch_size(obs.attainment, self.base, self.low, self.high, self.gain, self.boost)
        self.current = BatchSetting(min(max(size, self.min_size), self.max_size), self.delay_us)
        return self.current


# -- AIMD --------------------------------------------------------------------------------------------


@dataclass
class AimdPolicy:
    """Additive increase, multiplicative decrease of `max_batch_size` (TCP's congestion rule).

    Formula, per window with evidence (r = attainment):
        r <  target: violation. If no decrease happened in the last `cooldown` windows:
                     size = max(min_size, floor(size * factor)); the hold count restarts.
        r >= target: the SLO holds; after `hold` such windows in a row:
                     size = min(max_size, size + step), and the count restarts.
    Hysteresis: an increase needs `hold` good windows in a row (one good window after a violation is
    not enough), and a decrease is applied at most once per `cooldown` windows (a batch change takes
    effect only once the queue formed under the old one drains, so the windows right after a decrease
    still show the old violation and must not compound it). Windows without evidence change nothing
    and do not break a run. The delay is kept at `delay_us`.
    Parameters: target 0.95 (fraction of requests within the SLO latency), start (default: max_size),
    step 2 (rows per increase), factor 0.5, hold 3 windows, cooldown 3 windows, min_size 1,
    max_size 48 (the brief policy's largest), delay_us, min_requests 1.
    Cost: two comparisons and an addition or multiplication per window."""

    delay_us: int
    target: float = 0.95
    start: int | None = None
    step: int = 2
    factor: float = 0.5
    hold: int = 3
    cooldown: int = 3
    min_size: int = 1
    max_size: int = 48
    min_requests: int = 1
    name: str = "aimd"
    size: int = 0
    good: int = 0  # good windows in a row since the last change
    since_decrease: int = 1 << 30  # windows since the last decrease

    def __post_init__(self) -> None:
        _check(0.0 < self.target <= 1.0, "target", f"{self.target} is outside (0, 1]")
        _check(self.step >= 1, "step", "must be at least 1 row")
        _check(0.0 < self.factor < 1.0, "factor", f"{self.factor} is outside (0, 1)")
        _check(self.hold >= 1 and self.cooldown >= 0, "hold/cooldown", "hold >= 1, cooldown >= 0")
        _check(1 <= self.min_size <= self.max_size <= MAX_BATCH, "min_size/max_size",
               f"need 1 <= min_size <= max_size <= {MAX_BATCH}")
        _check(0 <= self.delay_us <= 1_000_000, "delay_us", f"{self.delay_us} is outside [0, 1000000]")
        start = self.max_size if self.start is None else self.start
        _check(self.min_size <= start <= self.max_size, "start", f"{start} is outside [min_size, max_size]")
        self.size = start

    def initial(self) -> BatchSetting:
        return BatchSetting(self.size, self.delay_us)

    def decide(self, obs: Observation) -> BatchSetting:
        if obs.attainment is None or obs.requests < self.min_requests:
            return BatchSetting(self.size, self.delay_us)
        self.since_decrease += 1
        if obs.attainment < self.target:
            self.good = 0
            if self.since_decrease > self.cooldown:
                self.size = max(self.min_size, math.floor(self.size * self.factor))
                self.since_decrease = 0
        else:
            self.good += 1
            if self.good >= self.hold:
                self.size = min(self.max_size, self.size + self.step)
                self.good = 0
        return BatchSetting(self.size, self.delay_us)


POLICIES = ("static", "brief", "aimd")


def make_policy(name: str, configured: BatchSetting, **params: object):
    """A fresh policy by name; `configured` is the model's setting (static's, and every delay)."""
    if name == "static":
        return StaticPolicy(configured)
    if name == "brief":
        return BriefPolicy(delay_us=configured.max_queue_delay_us, **params)
    if name == "aimd":
        return AimdPolicy(delay_us=configured.max_queue_delay_us, **params)
    raise ValueError(f"policy: unknown {name!r} (policies: {', '.join(POLICIES)})")


__all__.append("make_policy")
