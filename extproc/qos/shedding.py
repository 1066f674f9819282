"""Gradual shedding of sheddable classes: a PIE-style drop-probability controller per backend pool.

What (`spec.qos.admission[].shedding: {mode: gradual}`; `mode: immediate`, the default, is the queue's
older rule: a sheddable request is refused at once when its estimated wait is over `maxWait`): a
request of a sheddable class that would have to wait (the pool is at its limit or others wait) is
refused at once with probability p(class), otherwise it joins the queue as before. The hard bounds
stay the backstop in both modes: `maxQueue`, `maxQueueBytes` (429 at once) and `maxWait` (429 after
waiting it). In gradual mode the estimated-wait rule is not applied: it is what made P2's shedding
all-or-nothing on the queue's state (perf/RESULTS.md, bench_qos).

Formula (PIE, RFC 8033, with the delay error normalised by the target so that alpha and beta have no
unit): the delay is the pool's queueing delay by Little's law, requests waiting x mean slot time /
limit (`PoolAdmission.estimate_wait(queue.count)`, 0 before any slot was released). At most every
`interval`, with `d` the delay now and `d_prev` the delay at the previous update:
    level += alpha * (d - target) / target + beta * (d - d_prev) / target,   clamped to [0, k]
where k is the number of sheddable classes. Intervals with no update (nothing arrived, no tick: the
queue was empty) are caught up at the next one, each with the delay now and no derivative term, so an
idle pool's level decays by alpha per interval. The sheddable classes, least urgent first (P2, then
P1 if listed), get
    p(class i) = min(maxProbability, clamp(level - i, 0, 1))        i = 0 for the least urgent
so P1 is shed only once P2 is shed always, and a class that is not sheddable (P0 by default) never is.

Parameters: `target` (default maxWait / 4), `interval` (default 100 ms), `alpha` (0.125), `beta`
(1.25): PIE's defaults, a delay one target over the target for a second raises the level by about 1.25;
`maxProbability` (1): the most a class is shed by the controller (below 1 a share of sheddable
requests always queue; the hard bounds still apply).
Long-lived state: `Shedder` (level, previous delay, last update) lives in the worker's
`PoolAdmission` (`Runtime.admission`) and survives reloads; `SheddingParams` is the immutable config.
Cost: per sheddable request that would wait, one comparison of the clock, at most one update (a few
float operations; a catch-up loop of at most MAX_CATCH_UP steps) and one random draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

IMMEDIATE = "immediate"
GRADUAL = "gradual"
MAX_CATCH_UP = 1000  # idle intervals caught up at once (beyond that the level has long reached 0)


@dataclass(frozen=True, slots=True)
class SheddingParams:
    mode: str = IMMEDIATE
    target: float = 0.2  # seconds of queueing delay
    interval: float = 0.1  # seconds between updates
    alpha: float = 0.125
    beta: float = 1.25
    max_probability: float = 1.0
    order: tuple[str, ...] = ()  # the sheddable classes, least urgent first

    @property
    def gradual(self) -> bool:
        return self.mode == GRADUAL


class Shedder:
    """One pool's controller: `observe(delay)` updates the level at most every interval, `shed(cls)` draws."""

    __slots__ = ("params", "clock", "rand", "level", "prev", "last", "updates")

    def __init__(self, params: SheddingParams, clock: Callable[[], float],
                 rand: Callable[[], float] | None = None):
        self.params = params
        self.clock = clock
        self.rand = rand if rand is not None else random.Random().random
        self.level = 0.0
        self.prev = 0.0
        self.last: float | None = None
        self.updates = 0

    def configure(self, params: SheddingParams) -> None:
        self.params = params
        self.level = min(self.level, float(len(params.order)))

    def observe(self, delay: float, now: float | None = None) -> float:
        """Feed the queueing delay now (seconds); returns the level."""
        p = self.params
        now = self.clock() if now is None else now
        if self.last is None:
            self.last, self.prev = now, delay
            return self.level
        steps = int((now - self.last) / p.interval + 1e-9)  # 1e-9: float drift of the interval grid
        if steps <= 0:
            return self.level
        self.last += steps * p.interval
        top = float(len(p.order))
        level = self.level + p.alpha * (delay - p.target) / p.target + p.beta * (delay - self.prev) / p.target
        level = min(top, max(0.0, level))
        for _ in range(min(steps, MAX_CATCH_UP) - 1):  # intervals nobody observed: no derivative term
            if level <= 0.0 and delay <= p.target or level >= top and delay >= p.target:
                break
            level = min(top, max(0.0, level + p.alpha * (delay - p.target) / p.target))
        self.level = level
        self.prev = delay
        self.updates += 1
        return level

    def probability(self, cls: str) -> float:
        p = self.params
        try:
            i = p.order.index(cls)
        except ValueError:
            return 0.0  # not sheddable
        return min(p.max_probability, max(0.0, min(1.0, self.level - i)))

    def shed(self, cls: str) -> bool:
        pr = self.probability(cls)
        return pr > 0.0 and self.rand() < pr


__all__ = ["SheddingParams", "Shedder", "IMMEDIATE", "GRADUAL"]
