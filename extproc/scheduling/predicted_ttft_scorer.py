"""Scorer `predicted-ttft-scorer`: each endpoint's time to first token, predicted from what the gateway knows now, against the SLO.

What: a small latency model of a continuous-batching engine (vLLM, SGLang), evaluated per candidate
from the gateway's own exact and current view, so that no decision waits for a scrape and two
decisions between scrapes do not herd onto the same endpoint:
  uncached_kb(e) = prompt_kb * (1 - match(e)): the prompt's UTF-8 kilobytes the endpoint must
      prefill; match(e) is the share of the prompt's leading blocks that endpoint's prefix index
      holds, left in `ctx.cycle` by a `prefix-cache-scorer` that runs earlier in the same profile
      (without one nothing counts as cached);
  wait(e) = max(0, inflight(e) + 1 - slots(e)): requests that will wait for a running slot ahead
      of this one (in flight gateway-wide, `extproc/datalayer/inflight.py`); slots(e) = the
      endpoint's `slotsLabel` label (vLLM's `--max-num-seqs`), else `slots`, and at most
      floor(kv_tokens(e) / request_tokens) when the endpoint's `kvTokensLabel` label gives its KV
      cache size in tokens (vLLM admits a request only while its KV blocks fit: a 16K-token cache
      runs six 2.6K-token requests, not eight), request_tokens = prompt bytes / `bytesPerToken` +
      the request's max_tokens;
  ahead_kb(e): the kilobytes still to prefill of the requests in flight to e that have no first
      token yet, gateway-wide (their prefill shares the engine's next steps: two prompts that arrive
      together are prefilled together, and the second's first token waits for both; without this
      term every prediction of an all-cold workload ties and requests pile onto the fastest nodes):
      the in-flight table's pending prefill tokens (`extproc/datalayer/inflight.py` `loads`: each
      pick adds its uncached prompt tokens, as prefix-cache-scorer estimates them, else the whole
      prompt; the stream's first response body bytes or the request's end take them back) x
      `bytesPerToken` / 1000;
  speed(e): the endpoint's relative throughput from its `speedLabel` label (default 1: an older
      GPU at half the speed is labelled 0.5);
  predicted(e) = (base + prefill * (uncached_kb(e) + ahead_kb(e)) + slotWait * wait(e)) / speed(e)   [ms].
The three costs start as configured (`baseMs`: a first decode step; `prefillMsPerKb`: prefill per
uncached kilobyte; `slotWaitMs`: how often a running slot frees, i.e. mean service time / slots)
and, with `learn: true`, are refit online once `minSamples` requests have been observed: one
model for every endpoint the plugin scores (speeds make them comparable), an exponentially
forgetting least-squares fit of ttft_ms * speed(e) on (1, wait, uncached_kb + ahead_kb) over the requests'
observed TTFT (the first response body bytes the stream saw, which engines send with the first
token; else Envoy's first upstream byte), from OK streamed requests only. A fitted coefficient
that is negative or not finite keeps its configured value (an under-determined fit, e.g. while
every request was warm, must not make prefill look free).
Score: max(0, SLO - predicted(e)) / SLO, SLO = the request's `x-slo-ttft-ms` header when a positive
number, else `ttftSloMs`. Bounded (`bounded = True`): the framework only clamps.
Why: prefix affinity and load pull in opposite directions; weighting two scores leaves the
trade-off to the weights, where the cost that decides it is time: a cold prefill on an idle node
against a wait behind a full batch on the warm one. This is the benchmark oracle's formula
(simulator-oracle-scorer) with the gateway's estimates in place of the engine's true state.
Parameters: `ttftSloMs` (1000), `baseMs` (30), `prefillMsPerKb` (8: about 33 us per token, 4 bytes
per token, an 8B model on one H100), `slotWaitMs` (50), `slots` (256, vLLM's default
`--max-num-seqs`), `slotsLabel` ("max-num-seqs"), `kvTokensLabel` ("kv-tokens"), `bytesPerToken` (4),
`speedLabel` ("speed"), `learn` (true),
`minSamples` (32), `forgetting` (0.995: about 200 requests of memory), `ridge` (0.001).
Data consumed: the prefix index match and prompt length (ctx.cycle), in-flight requests and pending
prefill tokens (gateway-wide, one read shared with the profile's other plugins), endpoint labels,
the SLO header, each finished streamed request's TTFT (this plugin's `on_done`, which the `Plugin`
base registers on the lifecycle's observers; the fit is per worker). Cost: one in-flight read for
the candidates (about 9 us for 8 endpoints when this plugin is the first to read them; shared with the
profile's later plugins) and a few multiplications per candidate: the per-candidate formula runs in C
(`_score.predict` in `_score.c`, built by setup.py; `predict_py` is the reference, used when it is not
built, and tests/extproc/scheduling/test_score_native.py checks both give the same floats), about 3 us
for 8 endpoints warm on this 2-core machine against 5 us in Python; per finished request one 3x3 solve,
in the observer, off the decision.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin, inflight_loads
from extproc.scheduling.prefix_cache_scorer import PREFIX_MATCH, PROMPT_BYTES
from extproc.scheduling.selectors import PerCandidates, positive_label
from extproc.scheduling.ttft_headroom_scorer import TtftModel, request_slo_ms
from extproc.types import Outcome

try:  # the per-candidate formula in C (setup.py builds it; optional): the same floats as predict_py
    from extproc.scheduling import _score as _native
except ImportError:
    _native = None


class PredictedTtftParameters(Parameters):
    ttft_slo_ms: float = Field(default=1000.0, alias="ttftSloMs", gt=0.0)
    base_ms: float = Field(default=30.0, alias="baseMs", ge=0.0)
    prefill_ms_per_kb: float = Field(default=8.0, alias="prefillMsPerKb", ge=0.0)
    slot_wait_ms: float = Field(default=50.0, alias="slotWaitMs", ge=0.0)
    slots: int = Field(default=256, ge=1)
    slots_label: str | None = Field(default="max-num-seqs", alias="slotsLabel")
    kv_tokens_label: str | None = Field(default="kv-tokens", alias="kvTokensLabel")
    bytes_per_token: float = Field(default=4.0, alias="bytesPerToken", gt=0.0)
    speed_label: str | None = Field(default="speed", alias="speedLabel")
    learn: bool = True
    min_samples: int = Field(default=32, alias="minSamples", ge=3)
    forgetting: float = Field(default=0.995, gt=0.0, le=1.0)
    ridge: float = Field(default=1e-3, ge=0.0)


class PredictedTtftScorer(Plugin):
    type: ClassVar[str] = "predicted-ttft-scorer"
    slot: ClassVar[str] = "scorer"
    bounded: ClassVar[bool] = True
    Parameters: ClassVar[type] = PredictedTtftParameters

    def __init__(self, name: str, params: Any, runtime: Any):
        super().__init__(name, params, runtime)
        self.model = TtftModel(params.forgetting, params.ridge)
        self.key = f"predicted-ttft:{name}"  # state.attrs: the features of each candidate scored
        self._facts = PerCandidates()  # candidate tuple -> [(slots, speed, kv tokens or None) per candidate]
        self._coefficients: tuple[Any, Any, bool, tuple[float, float, float]] | None = None  # (params, theta, usable, out)

    def configure(self, old: Any, new: Any) -> None:
        super().configure(old, new)
        self.model.forgetting, self.model.ridge = new.forgetting, new.ridge  # the fit so far stays
        self._facts.clear()

    # --- the model -----------------------------------------------------------------------------------

    def coefficients(self) -> tuple[float, float, float]:
        """(base, slotWait, prefill per KB) in ms at speed 1: the fit where it is usable, else the config
        (worked out again only when the fit, its sample count or the parameters changed)."""
        p = self.params
        t = self.model.theta
        usable = p.learn and t is not None and self.model.n >= p.min_samples
        memo = self._coefficients
        if memo is not None and memo[0] is p and memo[1] is t and memo[2] == usable:
            return memo[3]
        prior = (p.base_ms, p.slot_wait_ms, p.prefill_ms_per_kb)
        out = prior if not usable else tuple(v if math.isfinite(v) and v >= 0.0 else d for v, d in zip(t, prior))
        self._coefficients = (p, t, usable, out)
        return out  # type: ignore[return-value]

    def endpoint_facts(self, labels: Any, endpoint: str) -> tuple[float, float, float | None]:
        """(slots, speed, KV tokens or None) of an endpoint from its labels."""
        p = self.params
        slots = positive_label(labels, endpoint, p.slots_label) or float(p.slots)
        speed = positive_label(labels, endpoint, p.speed_label) or 1.0
        return slots, speed, positive_label(labels, endpoint, p.kv_tokens_label)

    def slo_ms(self, state: Any) -> float:
        return request_slo_ms(state, self.params.ttft_slo_ms)

    # --- the score and the learning ------------------------------------------------------------------

    def facts_of(self, labels: Any, candidates: tuple[str, ...]) -> list[tuple[float, float, float | None]]:
        """`endpoint_facts` of each candidate (kept per candidate tuple and labels object)."""
        return self._facts.get(labels, candidates, lambda lb, cs: [self.endpoint_facts(lb, e) for e in cs])

    def score(self, ctx: Any, candidates: tuple[str, ...]) -> dict[str, float]:
        cycle = ctx.cycle
        match = cycle.get(PREFIX_MATCH) or {}
        req = ctx.request
        prompt_bytes = cycle.get(PROMPT_BYTES)
        if prompt_bytes is None:
            prompt_bytes = len(req.prompt_text().encode()) if req is not None else 0
        prompt_kb = prompt_bytes / 1000.0
        max_tokens = (req.max_tokens or 0) if req is not None else 0
        request_tokens = prompt_bytes / self.params.bytes_per_token + max_tokens
        loads = inflight_loads(ctx, self.runtime, candidates)
        base, slot_wait, prefill = self.coefficients()
        slo = self.slo_ms(ctx.state)
        kb_per_token = self.params.bytes_per_token / 1000.0
        out, features = (_native.predict if _native is not None else predict_py)(
            candidates, self.facts_of(ctx.labels, candidates), loads, match, prompt_kb, request_tokens,
            kb_per_token, base, slot_wait, prefill, slo)
        if ctx.state is not None:
            ctx.state.attrs[self.key] = features
        return out

    def predicted_ms(self, wait: float, uncached_kb: float, speed: float = 1.0) -> float:
        base, slot_wait, prefill = self.coefficients()
        return (base + slot_wait * wait + prefill * uncached_kb) / speed

    def on_done(self, state: Any, outcome: Outcome) -> None:
        features = state.attrs.get(self.key)
        if not self.params.learn or outcome is not Outcome.OK:
            return
        if not features or state.request is None or not state.request.stream:
            return
        c = state.completion
        endpoint = (c.upstream if c is not None else None) or state.served or state.endpoint
        x = features.get(endpoint)
        if x is None:
            return
        if state.first_body is not None:
            ttft = state.first_body - state.started
        elif c is not None and c.first_upstream_byte is not None:
            ttft = c.first_upstream_byte
        else:
            return
        if ttft >= 0.0 and math.isfinite(ttft):
            wait, uncached, speed, ahead_kb = x
            self.model.update(wait, uncached + ahead_kb, ttft * 1000.0 * speed)


def predict_py(candidates: tuple[str, ...], facts: list[tuple[float, float, float | None]],
               loads: dict[str, tuple[int, int, int]], match: dict[str, float], prompt_kb: float,
               request_tokens: float, kb_per_token: float, base: float, slot_wait: float, prefill: float,
               slo: float) -> tuple[dict[str, float], dict[str, tuple[float, float, float, float]]]:
    """The per-candidate formula (the docstring's predicted(e) and score(e)): ({endpoint: score},
    {endpoint: (wait, uncached KB, speed, KB ahead)}); the reference of `_score.predict`."""
    features: dict[str, tuple[float, float, float, float]] = {}
    out: dict[str, float] = {}
    for e, (slots, speed, kv_tokens) in zip(candidates, facts):
        running, _tokens, pending_prefill = loads[e]
        kb_ahead = pending_prefill * kb_per_token
        if kv_tokens is not None and request_tokens > 0:  # min(slots, max(1, floor(kv / request tokens)))
            fit = kv_tokens // request_tokens
            if fit < 1.0:
                fit = 1.0
            if fit < slots:
                slots = fit
        wait = running + 1 - slots
        if wait < 0:
            wait = 0.0
        m = match.get(e)
        uncached = prompt_kb * (1.0 - m) if m else prompt_kb
        features[e] = (wait, uncached, speed, kb_ahead)
        headroom = slo - (base + slot_wait * wait + prefill * (uncached + kb_ahead)) / speed
        out[e] = headroom / slo if headroom > 0.0 else 0.0
    return out, features
