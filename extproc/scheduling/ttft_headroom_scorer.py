"""Scorer `ttft-headroom-scorer`: predicted time to first token per endpoint, scored against the request's TTFT SLO.

What: per endpoint, a small online linear model of the TTFT it gives, fit to what it gave:
ttft_ms ~ t0 + t1 * queue + t2 * prompt_kchars, by least squares with exponential forgetting
(each older observation weighs `forgetting` times less: about 1 / (1 - forgetting) = 50 requests
of memory at 0.98), solved with a small ridge on the two slopes so that a feature that never
varied (an endpoint always idle) stays solvable. Features, taken when the request is scored:
queue = the engine's waiting + running requests from the scraped sample (`ctx.runtime.signals`,
when fresh), else the gateway's requests in flight to it (the two count the same thing from two
sides; an endpoint should keep one source, or its model mixes them); prompt_kchars = prompt
characters / 1000 (`request.prompt_text()`; no tokenizer, characters are proportional). They
are kept per candidate in `state.attrs`, and this plugin's `on_done` (registered on
`runtime.lifecycle.observers` by the `Plugin` base) fits the endpoint
that served with the TTFT Envoy reported (`state.completion.first_upstream_byte`), for OK
streaming requests only (`streamingOnly`: a non-streamed response's first byte is its last).
The SLO is the request's `x-slo-ttft-ms` header (kept at request headers, `extproc/types.HINT_HEADERS`)
when it is a positive number, else `ttftSloMs`. Bounded (`bounded = True`).
Formula: score(e) = max(0, SLO - max(0, predicted(e))) / SLO; an endpoint with fewer than
`minSamples` observations (cold) gets the neutral prior `neutralScore` (0.5).
Staleness: a model moves only when its endpoint serves; per worker, from its own requests.
Parameters: `ttftSloMs` (1000, > 0), `forgetting` (0.98, in (0, 1]), `minSamples` (8, >= 1),
`neutralScore` (0.5), `ridge` (1e-3, >= 0), `streamingOnly` (true).
Data consumed: engine samples (`consumes = ("engine_metrics",)`) or the in-flight table, the
prompt, the SLO header, each finished request's TTFT. Cost: per candidate a queue lookup and a
3-term dot product, plus the prompt's length once: about 7 us for 4 candidates on this 2-core
shared machine (timeit); per finished request one 3x3 solve, in the observer, off the decision.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin
from extproc.types import HINT_HEADERS, Outcome

SLO_HEADER = HINT_HEADERS[1]  # x-slo-ttft-ms


class TtftHeadroomScorerParameters(Parameters):
    ttft_slo_ms: float = Field(default=1000.0, alias="ttftSloMs", gt=0.0)
    forgetting: float = Field(default=0.98, gt=0.0, le=1.0)
    min_samples: int = Field(default=8, alias="minSamples", ge=1)
    neutral_score: float = Field(default=0.5, alias="neutralScore", ge=0.0, le=1.0)
    ridge: float = Field(default=1e-3, ge=0.0)
    streaming_only: bool = Field(default=True, alias="streamingOnly")


def request_slo_ms(state: Any, default: float) -> float:
    """The request's TTFT SLO: its `x-slo-ttft-ms` header (kept in `state.attrs`) when a positive finite
    number, else `default`."""
    raw = state.attrs.get(SLO_HEADER) if state is not None else None
    if raw is not None:
        try:
            v = float(raw)
        except ValueError:
            v = 0.0
        if v > 0.0 and math.isfinite(v):
            return v
    return default


def solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (3x3, Gaussian elimination with partial pivoting); None when singular."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for k in range(col, 4):
                m[r][k] -= f * m[col][k]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][k] * x[k] for k in range(r + 1, 3))) / m[r][r]
    return x


class TtftModel:
    """Exponentially weighted least squares of y on (1, queue, prompt_kchars)."""

    __slots__ = ("forgetting", "ridge", "s", "b", "n", "theta")

    def __init__(self, forgetting: float, ridge: float):
        self.forgetting, self.ridge = forgetting, ridge
        self.s = [[0.0] * 3 for _ in range(3)]  # sum of w x x^T
        self.b = [0.0] * 3  # sum of w x y
        self.n = 0  # observations (a count, not a weight)
        self.theta: list[float] | None = None

    def update(self, queue: float, kchars: float, y: float) -> None:
        lam = self.forgetting
        x = (1.0, float(queue), float(kchars))
        s, b = self.s, self.b
        for i in range(3):
            b[i] = lam * b[i] + x[i] * y
            for j in range(3):
                s[i][j] = lam * s[i][j] + x[i] * x[j]
        self.n += 1
        r = self.ridge
        a = [[s[i][j] + ((r if i else 1e-9) if i == j else 0.0) for j in range(3)] for i in range(3)]
        theta = solve3(a, b)
        if theta is not None and all(math.isfinite(t) for t in theta):
            self.theta = theta

    def predict(self, queue: float, kchars: float) -> float | None:
        t = self.theta
        return None if t is None else t[0] + t[1] * queue + t[2] * kchars


class TtftHeadroomScorer(Plugin):
    type: ClassVar[str] = "ttft-headroom-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    consumes: ClassVar[tuple[str, ...]] = ("engine_metrics",)
    Parameters: ClassVar[type] = TtftHeadroomScorerParameters

    def __init__(self, name: str, params: Any, runtime: Any):
        super().__init__(name, params, runtime)
        self.models: dict[str, TtftModel] = {}
        self.key = f"ttft-headroom:{name}"  # state.attrs key of the features scored

    def configure(self, old: Any, new: Any) -> None:
        super().configure(old, new)
        for m in self.models.values():  # the fits so far stay; new weights apply from the next update
            m.forgetting, m.ridge = new.forgetting, new.ridge

    # --- features and the SLO ----------------------------------------------------------------------

    def queue(self, ctx: Any, endpoint: str) -> float:
        signals = getattr(ctx.runtime, "signals", None)
        if signals is not None:
            sample = signals.sample(endpoint)
            if sample is not None and (sample.queue is not None or sample.running is not None) \
                    and signals.age(endpoint) <= signals.stale_after(endpoint):
                return float((sample.queue or 0) + (sample.running or 0))
        inflight = getattr(ctx.runtime, "inflight", None)
        return float(inflight.get(endpoint)) if inflight is not None else 0.0

    def slo_ms(self, state: Any) -> float:
        return request_slo_ms(state, self.params.ttft_slo_ms)

    def observe(self, endpoint: str, queue: float, kchars: float, ttft_ms: float) -> None:
        m = self.models.get(endpoint)
        if m is None:
            m = self.models[endpoint] = TtftModel(self.params.forgetting, self.params.ridge)
        m.update(queue, kchars, ttft_ms)

    def predicted_ms(self, endpoint: str, queue: float, kchars: float) -> float | None:
        """The model's TTFT for these features; None while the endpoint is cold."""
        m = self.models.get(endpoint)
        if m is None or m.n < self.params.min_samples:
            return None
        p = m.predict(queue, kchars)
        return max(0.0, p) if p is not None and math.isfinite(p) else None

    # --- the score and the learning ----------------------------------------------------------------

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        kchars = len(ctx.request.prompt_text()) / 1000.0 if ctx.request is not None else 0.0
        slo = self.slo_ms(ctx.state)
        features: dict[str, tuple[float, float]] = {}
        out = {}
        for e in candidates:
            q = self.queue(ctx, e)
            features[e] = (q, kchars)
            pred = self.predicted_ms(e, q, kchars)
            out[e] = self.params.neutral_score if pred is None else max(0.0, slo - pred) / slo
        ctx.state.attrs[self.key] = features
        return out

    def on_done(self, state: Any, outcome: Outcome) -> None:
        features = state.attrs.get(self.key)
        if not features or outcome is not Outcome.OK:
            return
        if self.params.streaming_only and not (state.request is not None and state.request.stream):
            return
        c = state.completion
        if c is None or c.first_upstream_byte is None:
            return
        endpoint = c.upstream or state.served or state.endpoint
        x = features.get(endpoint)
        if x is not None:
            self.observe(endpoint, x[0], x[1], c.first_upstream_byte * 1000.0)
