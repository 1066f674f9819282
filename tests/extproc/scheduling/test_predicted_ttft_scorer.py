"""Scorer `predicted-ttft-scorer`: predicted(e) = (base + slotWait * wait(e) + prefill * uncached_kb(e)) / speed(e),
score = max(0, SLO - predicted) / SLO; wait from the gateway's in-flight count against the endpoint's
slots (its label, limited by its KV cache), uncached_kb from the prefix-cache-scorer's match earlier in
the profile, and the three costs refit online from the TTFT of OK streamed requests (one pooled model)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import extproc.scheduling as scheduling
from extproc.config.loader import ConfigError, load_text
from extproc.lifecycle import Completion
from extproc.request import parse_openai
from extproc.runtime import Runtime
from extproc.scheduling import Scorer, SchedulingContext
from extproc.scheduling.predicted_ttft_scorer import PredictedTtftParameters, PredictedTtftScorer
from extproc.types import Outcome, RequestState
from tests.extproc.scheduling.conftest import E1, E2, E3, E4, POOL
from tests.extproc.scheduling.signal_fleet import built as signal_built
from tests.extproc.scheduling.signal_fleet import vllm_gateway

# E1: 2 slots; E2: 4 slots at half speed; E3: 8 slots and a 4000-token KV cache; E4: no labels
HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: predicted}
spec:
  backends:
    - name: pool
      models: [m]
      endpoints:
        - {address: "127.0.0.1:9001", labels: {max-num-seqs: "2"}}
        - {address: "127.0.0.1:9002", labels: {max-num-seqs: "4", speed: "0.5"}}
        - {address: "127.0.0.1:9003", labels: {max-num-seqs: "8", kv-tokens: "4000"}}
        - "127.0.0.1:9004"
"""

PICKER = "    - {type: max-score-picker, parameters: {fallbacks: 0}}\n"


def plugins(params: str = "{}") -> str:
    return f"    - {{name: s, type: predicted-ttft-scorer, parameters: {params}}}\n" + PICKER


PROFILE = "[{pluginRef: s}, {pluginRef: max-score-picker}]"


def built(params: str = "{}"):
    return signal_built(plugins(params), PROFILE, HEAD)


def plugin(b, name: str = "s") -> PredictedTtftScorer:
    return b.runtime.plugin(b.snap.plugins[name])


def request(prompt: str = "hi", stream: bool = True, max_tokens: int | None = None):
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return parse_openai("/v1/chat/completions", body)


def new_state(b=None, prompt: str = "hi", stream: bool = True, max_tokens: int | None = None,
              **attrs: str) -> RequestState:
    st = RequestState(snapshot=b.snap if b else None, route=b.route if b else None, started=0.0, request_id="r",
                      runtime=b.runtime if b else None)
    st.request = request(prompt, stream, max_tokens)
    st.attrs.update({k.replace("_", "-"): v for k, v in attrs.items()})
    return st


def ctx(b, st: RequestState) -> SchedulingContext:
    return SchedulingContext(st, b.backend, st.request, b.runtime, b.backend.endpoint_labels, "p")


class Ctx:
    """The part of a SchedulingContext the scorer reads, for formula tests on hand-made labels."""

    def __init__(self, req=None, labels=None, cycle=None, state=None):
        self.request = req
        self.labels = labels if labels is not None else {}
        self.cycle = cycle if cycle is not None else {}
        self.state = state


def scorer(rt: Runtime | None = None, **params) -> PredictedTtftScorer:
    return PredictedTtftScorer("s", PredictedTtftParameters(**params), rt if rt is not None else Runtime())


def load(rt: Runtime, counts: dict[str, int]) -> None:
    """The gateway's in-flight count of each endpoint becomes exactly the given number."""
    inflight = rt.inflight
    for ep, n in counts.items():
        while inflight.get(ep) < n:
            inflight.started(ep)
        while inflight.get(ep) > n:
            inflight.finished(ep)


def finish(b, st: RequestState, endpoint: str, first_upstream_byte: float | None, status: int = 200) -> None:
    """The request ends through the runtime's lifecycle, as Envoy's access log would end it."""
    st.endpoint = endpoint
    lc = b.runtime.lifecycle
    lc.start(st)
    st.completion = Completion(status=status, upstream=endpoint, first_upstream_byte=first_upstream_byte)
    lc.stream_ended(st, "end")


# --- the plugin and its defaults ---------------------------------------------------------------------

def test_is_a_bounded_scorer_registered_as_predicted_ttft_scorer():
    assert scheduling.plugin_types()["predicted-ttft-scorer"] is PredictedTtftScorer
    s = scorer()
    assert isinstance(s, Scorer) and s.type == "predicted-ttft-scorer" and s.slot == "scorer" and s.bounded is True


def test_defaults_are_the_documented_ones():
    p = PredictedTtftParameters()
    assert (p.ttft_slo_ms, p.base_ms, p.prefill_ms_per_kb, p.slot_wait_ms, p.slots) == (1000.0, 30.0, 8.0, 50.0, 256)
    assert (p.slots_label, p.kv_tokens_label, p.bytes_per_token, p.speed_label) == ("max-num-seqs", "kv-tokens", 4.0,
                                                                                   "speed")
    assert (p.learn, p.min_samples, p.forgetting, p.ridge) == (True, 32, 0.995, 0.001)
    assert scorer().coefficients() == (30.0, 50.0, 8.0)  # (base, slotWait, prefill per KB) before any fit


# --- the formula -------------------------------------------------------------------------------------

def test_formula_per_candidate_from_wait_uncached_kb_and_speed():
    rt = Runtime()
    load(rt, {E1: 5, E2: 3, E3: 0, E4: 10})
    labels = {E1: {"max-num-seqs": "4"}, E2: {"max-num-seqs": "2", "speed": "0.5"}, E3: {},
              E4: {"max-num-seqs": "1"}}
    cycle = {"prefix_match": {E1: 0.5, E2: 0.0, E3: 1.0, E4: 0.25}, "prompt_bytes": 2000}  # a 2 KB prompt
    st = new_state(prompt="x" * 2000)
    s = scorer(rt)
    got = s.score(Ctx(st.request, labels, cycle, st), POOL)
    # E1: wait 5+1-4 = 2, uncached 2*(1-0.5) = 1 KB: 30 + 50*2 + 8*1 = 138 ms
    # E2: wait 3+1-2 = 2, uncached 2 KB, speed 0.5: (30 + 100 + 16) / 0.5 = 292 ms
    # E3: 256 slots (the parameter), wait 0, all cached: 30 ms
    # E4: wait 10+1-1 = 10, uncached 2*0.75 = 1.5 KB: 30 + 500 + 12 = 542 ms
    assert got == pytest.approx({E1: 0.862, E2: 0.708, E3: 0.97, E4: 0.458})
    # the features of each candidate scored, (wait, uncached_kb, speed, ahead_kb), kept for the observer
    assert st.attrs[s.key] == {E1: (2.0, 1.0, 1.0, 0.0), E2: (2.0, 2.0, 0.5, 0.0), E3: (0.0, 0.0, 1.0, 0.0),
                               E4: (10.0, 1.5, 1.0, 0.0)}
    assert s.predicted_ms(2, 1.5, 0.5) == pytest.approx((30 + 100 + 12) / 0.5)
    # the prompt's length is the one the prefix scorer left, and an endpoint it left out matched nothing
    got = s.score(Ctx(request("hi"), {}, {"prefix_match": {E1: 0.5}, "prompt_bytes": 4000}), (E1, E3))
    assert got == pytest.approx({E1: 1 - (30 + 8 * 2) / 1000, E3: 1 - (30 + 8 * 4) / 1000})


def test_predicted_past_the_slo_scores_zero_not_negative():
    rt = Runtime()
    load(rt, {E1: 30, E2: 20})
    labels = {E1: {"max-num-seqs": "1"}, E2: {"max-num-seqs": "1"}}
    got = scorer(rt).score(Ctx(request("x" * 2000), labels), (E1, E2))
    # E1: 30 + 50*30 + 8*2 = 1546 ms > 1000; E2: 30 + 50*20 + 16 = 1046 ms > 1000
    assert got == {E1: 0.0, E2: 0.0}
    load(rt, {E1: 19})  # 30 + 950 + 16 = 996 ms: just inside
    assert scorer(rt).score(Ctx(request("x" * 2000), labels), (E1,)) == pytest.approx({E1: 0.004})


def test_every_cost_parameter_enters_the_formula():
    rt = Runtime()
    load(rt, {E1: 10, E2: 3})
    s = scorer(rt, ttftSloMs=500, baseMs=100, prefillMsPerKb=20, slotWaitMs=10, slots=8)
    got = s.score(Ctx(request("x" * 4000), {E2: {"max-num-seqs": "2"}}), (E1, E2, E3))
    # E1: 8 slots, wait 10+1-8 = 3: 100 + 30 + 20*4 = 210 ms of 500
    # E2: 2 slots (its label), wait 3+1-2 = 2: 100 + 20 + 80 = 200 ms; E3: idle: 180 ms
    assert got == pytest.approx({E1: 0.58, E2: 0.6, E3: 0.64})


# --- uncached kilobytes: the prefix scorer's match, else the whole prompt ------------------------------

PREFIX = "    - {type: prefix-cache-scorer, parameters: {blockSize: 250}}\n"
P1 = "".join(chr(ord("a") + i % 26) for i in range(1000))  # 4 blocks of 250 bytes
P2 = P1 + "".join(chr(ord("A") + i % 26) for i in range(1000))  # 8 blocks, the first 4 are P1's


def test_in_a_profile_the_prefix_scorers_match_makes_the_picked_endpoint_warm():
    from extproc.stages.dispatch import dispatched, prefilled

    b = signal_built(PREFIX + plugins(),
                     "[{pluginRef: prefix-cache-scorer}, {pluginRef: s}, {pluginRef: max-score-picker}]", HEAD)
    s = plugin(b)
    st1 = new_state(b, prompt=P1)
    pick = b.decide(st1)[0]
    # all idle, nothing cached: 1 KB to prefill, 30 + 8 = 38 ms; E2 at half speed 76 ms
    raw1 = st1.attrs["decision"]["scorers"][1]["raw"]
    assert raw1 == pytest.approx({E1: 0.962, E2: 0.924, E3: 0.962, E4: 0.962})
    assert pick in (E1, E3, E4)
    dispatched(st1, pick)  # as dispatch does: P1 in flight there, its 250 uncached tokens pending prefill
    assert b.runtime.inflight.loads([pick]) == {pick: (1, 250, 250)}
    st2 = new_state(b, prompt=P2)
    assert b.decide(st2) == (pick,)
    # the pick's index holds P1's 4 of P2's 8 blocks: 1 KB of 2 uncached there, 2 KB elsewhere
    # and P1, in flight there, has no first token yet: its 1 KB (250 tokens x 4 bytes) is ahead of P2's
    feats = st2.attrs[s.key]
    assert feats[pick] == pytest.approx((0.0, 1.0, 1.0, 1.0))
    assert all(feats[e][1] == pytest.approx(2.0) and feats[e][3] == 0.0 for e in POOL if e != pick)
    want = {E1: 1 - 46 / 1000, E2: 1 - 92 / 1000, E3: 1 - 46 / 1000, E4: 1 - 46 / 1000}
    want[pick] = 1 - (30 + 8 * (1 + 1)) / 1000  # 46 ms too: the prefix scorer's weight keeps it there
    assert st2.attrs["decision"]["scorers"][1]["raw"] == pytest.approx(want)
    dispatched(st2, pick)  # P2's uncached half (250 tokens) is pending there too
    assert b.runtime.inflight.loads([pick]) == {pick: (2, 750, 500)}
    # P1's first token came (the stream's first response body), P2's not yet: P2 is all cached there
    # now, and its 1 KB uncached is ahead; both still run there, so with E1's 2 slots a third waits
    # for one (wait 1, if the pick is E1): 30 + 50 x wait + 8 x 1 ms
    prefilled(st1)
    assert st1.inflight == (250, 0) and b.runtime.inflight.loads([pick]) == {pick: (2, 750, 250)}
    st3 = new_state(b, prompt=P2)
    assert b.decide(st3) == (pick,)
    wait = 1.0 if pick == E1 else 0.0
    assert st3.attrs[s.key][pick] == pytest.approx((wait, 0.0, 1.0, 1.0))
    assert st3.attrs["decision"]["scorers"][1]["raw"][pick] == pytest.approx(1 - (38 + 50 * wait) / 1000)


def test_a_prefix_scorer_later_in_the_profile_counts_nothing_as_cached():
    b = signal_built(PREFIX + plugins(),
                     "[{pluginRef: s}, {pluginRef: prefix-cache-scorer}, {pluginRef: max-score-picker}]", HEAD)
    s = plugin(b)
    pick = b.decide(new_state(b, prompt=P1))[0]
    st2 = new_state(b, prompt=P2)
    assert b.decide(st2) == (pick,)  # the prefix scorer's 0.5 still decides
    assert st2.attrs[s.key][pick][:3] == pytest.approx((0.0, 2.0, 1.0))  # but this scorer ran before it


def test_without_a_prefix_scorer_the_whole_prompts_utf8_length_counts():
    b = built()
    s = plugin(b)
    st = new_state(b, prompt="\u00e9" * 1000)  # 1000 characters, 2000 UTF-8 bytes: 2 KB
    got = s.score(ctx(b, st), POOL)
    # E1, E3, E4 idle: 30 + 8*2 = 46 ms; E2 at half speed: 92 ms
    assert got == pytest.approx({E1: 0.954, E2: 0.908, E3: 0.954, E4: 0.954})
    assert {e: f[1] for e, f in st.attrs[s.key].items()} == pytest.approx(dict.fromkeys(POOL, 2.0))
    # no request at all (a route that parses no body): nothing to prefill
    assert scorer().score(Ctx(None, {}), (E1,)) == pytest.approx({E1: 0.97})


# --- slots: the label, the parameter, the KV cache ---------------------------------------------------

def test_the_kv_cache_label_limits_the_slots_to_the_requests_that_fit():
    rt = Runtime()
    load(rt, {E1: 7, E2: 7, E3: 3, E4: 5})
    labels = {E1: {"max-num-seqs": "8", "kv-tokens": "16000"}, E2: {"max-num-seqs": "8"},
              E3: {"max-num-seqs": "8", "kv-tokens": "1000"}, E4: {"kv-tokens": "16000"}}
    req = request("x" * 8000, max_tokens=600)  # 8000 / 4 + 600 = 2600 tokens
    got = scorer(rt).score(Ctx(req, labels), POOL)
    # E1: min(8, floor(16000 / 2600) = 6) slots, wait 7+1-6 = 2: 30 + 100 + 64 = 194 ms
    # E2: 8 slots, wait 0: 94 ms; E3: floor(1000 / 2600) = 0, at least 1 slot, wait 3: 30 + 150 + 64 = 244 ms
    # E4: min(256, 6) = 6 slots, wait 5+1-6 = 0: 94 ms
    assert got == pytest.approx({E1: 0.806, E2: 0.906, E3: 0.756, E4: 0.906})
    # at 8 bytes per token: 1000 + 600 = 1600 tokens, E1 fits 10 (its 8 slots stand), E4 10
    got = scorer(rt, bytesPerToken=8).score(Ctx(req, labels), POOL)
    assert got == pytest.approx({E1: 0.906, E2: 0.906, E3: 0.756, E4: 0.906})
    # without max_tokens: 2000 tokens, E1 fits 8
    got = scorer(rt).score(Ctx(request("x" * 8000), labels), (E1, E4))
    assert got == pytest.approx({E1: 0.906, E4: 0.906})
    load(rt, {E4: 8})  # E4: 8 slots by its cache, wait 8+1-8 = 1: 30 + 50 + 64 = 144 ms
    assert scorer(rt).score(Ctx(request("x" * 8000), labels), (E4,)) == pytest.approx({E4: 0.856})


def features(rt: Runtime, labels, **params) -> dict:
    """(wait, speed) of each labelled endpoint as the scorer records them for "hi" with max_tokens 10."""
    st = new_state(max_tokens=10)
    s = scorer(rt, **params)
    s.score(Ctx(st.request, labels, state=st), tuple(labels))
    return {e: (w, sp) for e, (w, _, sp, _) in st.attrs[s.key].items()}


@pytest.mark.parametrize("bad", ["many", "0", "-4", "inf", "nan", ""])
def test_labels_that_are_not_positive_finite_numbers_are_ignored(bad):
    rt = Runtime()
    load(rt, {E1: 3, E2: 3})
    labels = {E1: {"max-num-seqs": bad, "speed": bad, "kv-tokens": bad}, E2: {}}
    got = scorer(rt, slots=2).score(Ctx(request("hi", max_tokens=10), labels), (E1, E2))
    # both: the `slots` parameter (2), speed 1, no KV limit: wait 3+1-2 = 2, 2 bytes: 30 + 100 + 0.016 ms
    assert got == pytest.approx({E1: 1 - 130.016 / 1000, E2: 1 - 130.016 / 1000})
    assert features(rt, labels, slots=2) == {E1: (2.0, 1.0), E2: (2.0, 1.0)}


def test_the_label_names_are_parameters():
    rt = Runtime()
    load(rt, {E1: 2})
    labels = {E1: {"seqs": "1", "gpu-speed": "2", "max-num-seqs": "100", "speed": "0.25", "kv-tokens": "1"}}
    s = scorer(rt, slotsLabel="seqs", speedLabel="gpu-speed", kvTokensLabel=None)
    # slots 1 from `seqs` (kv-tokens no longer read), wait 2+1-1 = 2, speed 2: (30 + 100 + 0.016) / 2 ms
    assert s.score(Ctx(request("hi"), labels), (E1,)) == pytest.approx({E1: 1 - 65.008 / 1000})
    # no label names at all: the `slots` parameter, speed 1
    s = scorer(rt, slotsLabel=None, speedLabel=None, kvTokensLabel=None)
    assert s.score(Ctx(request("hi"), labels), (E1,)) == pytest.approx({E1: 1 - 30.016 / 1000})


def test_labels_from_the_config_count():
    b = built()
    s = plugin(b)
    load(b.runtime, {E1: 4, E2: 4, E3: 12, E4: 4})
    got = s.score(ctx(b, new_state(b, prompt="x" * 1000)), POOL)  # 1 KB, 250 tokens
    # E1: 2 slots, wait 3: 30 + 150 + 8 = 188 ms; E2: 4 slots, wait 1, half speed: (30 + 50 + 8) / 0.5 = 176 ms
    # E3: min(8, floor(4000 / 250) = 16) = 8 slots, wait 5: 30 + 250 + 8 = 288 ms; E4: 256 slots: 38 ms
    assert got == pytest.approx({E1: 0.812, E2: 0.824, E3: 0.712, E4: 0.962})


# --- the SLO -----------------------------------------------------------------------------------------

def test_the_slo_is_the_requests_header_when_a_positive_number_else_the_parameter():
    s = scorer()

    def score(state, sc=s):
        return sc.score(Ctx(state.request, {}, state=state), (E1,))[E1]

    # E1 idle, "hi": 30 + 8 * 0.002 = 30.016 ms
    assert score(new_state(x_slo_ttft_ms="500")) == pytest.approx(1 - 30.016 / 500)
    assert score(new_state(x_slo_ttft_ms="250.5")) == pytest.approx(1 - 30.016 / 250.5)
    assert score(new_state(x_slo_ttft_ms="20")) == 0.0  # predicted past the request's SLO
    for bad in ("0", "-5", "soon", "nan", "inf", ""):
        assert score(new_state(x_slo_ttft_ms=bad)) == pytest.approx(1 - 30.016 / 1000)
    assert score(new_state()) == pytest.approx(1 - 30.016 / 1000)
    assert score(new_state(), scorer(ttftSloMs=2000)) == pytest.approx(1 - 30.016 / 2000)
    assert score(new_state(x_slo_ttft_ms="500"), scorer(ttftSloMs=2000)) == pytest.approx(1 - 30.016 / 500)


# --- learning ----------------------------------------------------------------------------------------

def test_an_ok_streamed_request_is_learned_as_ttft_times_speed_on_wait_and_uncached_kb():
    b = built("{minSamples: 3}")
    s = plugin(b)
    assert s.on_done in b.runtime.lifecycle.observers
    load(b.runtime, {E2: 5})
    st = new_state(b, prompt="x" * 1500)
    s.score(ctx(b, st), POOL)
    assert st.attrs[s.key][E2] == pytest.approx((2.0, 1.5, 0.5, 0.0))  # E2: 4 slots, wait 5+1-4 = 2, half speed
    st.started, st.first_body = 10.0, 10.3  # the stream's TTFT, 300 ms, before Envoy's first upstream byte
    finish(b, st, E2, 0.9)
    # one observation of y = 300 * 0.5 = 150 on x = (1, 2, 1.5)
    assert s.model.n == 1 and s.model.b == pytest.approx([150.0, 300.0, 225.0])
    assert s.model.s[1][2] == pytest.approx(3.0) and s.model.s[0][0] == pytest.approx(1.0)
    # without a first body time: Envoy's first upstream byte, 200 ms; E1 idle, speed 1
    st = new_state(b, prompt="x" * 1500)
    s.score(ctx(b, st), POOL)
    finish(b, st, E1, 0.2)
    assert s.model.n == 2
    assert s.model.b == pytest.approx([0.995 * 150 + 200, 0.995 * 300 + 0, 0.995 * 225 + 1.5 * 200])


def test_the_endpoint_learned_is_the_one_that_served():
    s = scorer()
    st = new_state()
    s.score(Ctx(st.request, {E1: {"speed": "2"}}, state=st), (E1, E2))
    st.endpoint, st.completion = E2, Completion(status=200, upstream=E1, first_upstream_byte=0.1)
    s.on_done(st, Outcome.OK)  # Envoy's upstream: E1, at speed 2
    assert s.model.n == 1 and s.model.b[0] == pytest.approx(200.0)
    st = new_state()
    s.score(Ctx(st.request, {E1: {"speed": "2"}}, state=st), (E1, E2))
    st.endpoint, st.served, st.first_body = E2, E1, 0.1
    s.on_done(st, Outcome.OK)  # no completion: the endpoint that answered (served), E1
    assert s.model.n == 2 and s.model.b[0] == pytest.approx(0.995 * 200 + 200)


def test_nothing_is_learned_from_failed_non_streamed_unscored_or_untimed_requests():
    b = built("{minSamples: 3}")
    s = plugin(b)

    def scored(stream=True, candidates=POOL):
        st = new_state(b, prompt="x" * 1000, stream=stream)
        s.score(ctx(b, st), candidates)
        return st

    finish(b, scored(), E1, 0.3, status=500)  # backend_error
    finish(b, scored(), E1, 0.3, status=429)  # rejected
    finish(b, scored(stream=False), E1, 0.3)  # non-streamed: its first byte is its last
    finish(b, scored(candidates=(E1, E2)), E3, 0.3)  # E3 was not among the candidates scored
    finish(b, new_state(b), E1, 0.3)  # never scored by this plugin
    finish(b, scored(), E1, None)  # no TTFT known
    assert s.model.n == 0 and s.model.theta is None
    finish(b, scored(), E1, 0.3)
    assert s.model.n == 1


@pytest.mark.parametrize("outcome", [o for o in Outcome if o is not Outcome.OK])
def test_non_ok_outcomes_are_not_learned(outcome):
    s = scorer()
    st = new_state()
    s.score(Ctx(st.request, {}, state=st), (E1,))
    st.completion = Completion(status=200, upstream=E1, first_upstream_byte=0.1)
    s.on_done(st, outcome)
    assert s.model.n == 0
    s.on_done(st, Outcome.OK)
    assert s.model.n == 1


def test_learn_false_learns_nothing_and_keeps_the_configured_costs():
    b = built("{learn: false, minSamples: 3}")
    s = plugin(b)
    for _ in range(5):
        st = new_state(b, prompt="x" * 1000)
        s.score(ctx(b, st), POOL)
        finish(b, st, E1, 0.5)
    assert s.model.n == 0 and s.coefficients() == (30.0, 50.0, 8.0)
    # a plugin that learned, reloaded with learn: false, scores on the configured costs again
    b = built("{minSamples: 3}")
    s = plugin(b)
    for w in range(4):
        for kb in (0.5, 1.0, 2.0, 4.0):
            s.model.update(w, kb, truth(w, kb))
    assert s.coefficients() == pytest.approx((50.0, 20.0, 10.0), rel=1e-3)
    b.reload(vllm_gateway(plugins("{minSamples: 3, learn: false}"), PROFILE, HEAD))
    assert plugin(b) is s and s.model.n == 16 and s.coefficients() == (30.0, 50.0, 8.0)


def truth(wait: float, kb: float) -> float:
    return 50.0 + 20.0 * wait + 10.0 * kb  # ms at speed 1: 50 ms floor, 20 ms per waiting request, 10 ms per KB


def test_the_fit_replaces_the_configured_costs_after_min_samples_and_recovers_them():
    b = built("{minSamples: 8, slots: 3}")
    s = plugin(b)
    rng = random.Random(11)
    for i in range(40):
        load(b.runtime, {e: rng.randint(0, 10) for e in POOL})
        st = new_state(b, prompt="y" * rng.randint(200, 3000))
        s.score(ctx(b, st), POOL)
        ep = POOL[i % 4]
        wait, kb, speed, _ = st.attrs[s.key][ep]
        st.started = 5.0
        st.first_body = 5.0 + truth(wait, kb) / speed / 1000.0  # what a node at `speed` takes
        finish(b, st, ep, None)
        if i == 6:  # 7 observations, minSamples 8: still the configured costs
            assert s.model.n == 7 and s.coefficients() == (30.0, 50.0, 8.0)
            assert s.predicted_ms(2, 1.0) == pytest.approx(30 + 100 + 8)
        if i == 7:
            assert s.coefficients() == pytest.approx((50.0, 20.0, 10.0), rel=1e-2)
    assert s.model.n == 40
    assert s.coefficients() == pytest.approx((50.0, 20.0, 10.0), rel=1e-3)
    # the learned costs score
    load(b.runtime, {E1: 3, E2: 0, E3: 0, E4: 0})
    got = s.score(ctx(b, new_state(b, prompt="z" * 1000)), POOL)
    # E1: wait 3+1-2 = 2: 50 + 40 + 10 = 100 ms; E2 idle at half speed: 60 / 0.5 = 120 ms; E3, E4: 60 ms
    assert got == pytest.approx({E1: 0.9, E2: 0.88, E3: 0.94, E4: 0.94}, rel=1e-4)


def test_a_negative_fitted_coefficient_keeps_its_configured_value():
    s = scorer(minSamples=3)
    for w in range(4):
        for kb in (0.5, 1.0, 2.0, 4.0):
            s.model.update(w, kb, 100.0 + 20.0 * w - 5.0 * kb)  # prefill looks like a gain
    assert s.model.theta == pytest.approx([100.0, 20.0, -5.0], rel=1e-3)
    assert s.coefficients() == pytest.approx((100.0, 20.0, 8.0), rel=1e-3)  # prefill: the configured 8
    s = scorer(minSamples=3, baseMs=40)
    for w in range(4):
        for kb in (0.5, 1.0, 2.0, 4.0):
            s.model.update(w, kb, -10.0 + 20.0 * w + 5.0 * kb)
    assert s.coefficients() == pytest.approx((40.0, 20.0, 5.0), rel=1e-3)


# --- reloads and close -------------------------------------------------------------------------------

def test_a_reload_keeps_the_fit_and_applies_the_new_forgetting_and_ridge():
    b = built("{minSamples: 3}")
    s = plugin(b)
    for w in range(3):
        s.model.update(w, 1.0 + w * w, truth(w, 1.0 + w * w))
    theta, sums = list(s.model.theta), list(s.model.b)
    b.reload(vllm_gateway(plugins("{minSamples: 3, forgetting: 0.9, ridge: 0.5}"), PROFILE, HEAD))
    assert plugin(b) is s and s.model.n == 3 and s.model.theta == theta
    assert (s.model.forgetting, s.model.ridge) == (0.9, 0.5) and s.params.forgetting == 0.9
    assert b.runtime.lifecycle.observers.count(s.on_done) == 1  # not registered twice
    st = new_state(b, prompt="x" * 2000)
    s.score(ctx(b, st), POOL)
    finish(b, st, E4, 0.1)  # E4 idle: x = (1, 0, 2), y = 100
    assert s.model.b == pytest.approx([0.9 * sums[0] + 100, 0.9 * sums[1], 0.9 * sums[2] + 200])


def test_configure_rereads_the_labels():
    rt = Runtime()
    load(rt, {E1: 3})
    labels = {E1: {"max-num-seqs": "2", "seqs": "8"}}  # one labels object, scored before and after
    s = scorer(rt)
    assert s.score(Ctx(request("hi"), labels), (E1,)) == pytest.approx({E1: 1 - 130.016 / 1000})  # 2 slots, wait 2
    new = PredictedTtftParameters(slotsLabel="seqs")
    s.configure(s.params, new)
    assert s.params is new
    assert s.score(Ctx(request("hi"), labels), (E1,)) == pytest.approx({E1: 1 - 30.016 / 1000})  # 8 slots


def test_close_removes_the_lifecycle_observer():
    b = built("{minSamples: 3}")
    s = plugin(b)
    observers = b.runtime.lifecycle.observers
    assert s.on_done in observers
    s.close()
    assert s.on_done not in observers
    s.close()  # twice: nothing to remove
    st = new_state(b)
    s.score(ctx(b, st), POOL)
    finish(b, st, E1, 0.1)
    assert s.model.n == 0
    assert PredictedTtftScorer("x", PredictedTtftParameters(), None).close() is None  # no runtime, no observer


def test_a_reload_that_drops_the_plugin_closes_it():
    b = built()
    s = plugin(b)
    b.reload(vllm_gateway(PICKER, "[{pluginRef: max-score-picker}]", HEAD))
    assert s.on_done not in b.runtime.lifecycle.observers


# --- parameters --------------------------------------------------------------------------------------

@pytest.mark.parametrize("params, message", [
    ("{ttftSloMs: 0}", "spec.plugins[0].parameters.ttftSloMs"),
    ("{baseMs: -1}", "spec.plugins[0].parameters.baseMs"),
    ("{prefillMsPerKb: -0.5}", "spec.plugins[0].parameters.prefillMsPerKb"),
    ("{slotWaitMs: -1}", "spec.plugins[0].parameters.slotWaitMs"),
    ("{slots: 0}", "spec.plugins[0].parameters.slots"),
    ("{bytesPerToken: 0}", "spec.plugins[0].parameters.bytesPerToken"),
    ("{minSamples: 2}", "spec.plugins[0].parameters.minSamples"),
    ("{forgetting: 0}", "spec.plugins[0].parameters.forgetting"),
    ("{forgetting: 1.01}", "spec.plugins[0].parameters.forgetting"),
    ("{ridge: -0.001}", "spec.plugins[0].parameters.ridge"),
    ("{learn: maybe}", "spec.plugins[0].parameters.learn"),
    ("{sloMs: 500}", "spec.plugins[0].parameters.sloMs: unknown parameter"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(vllm_gateway(plugins(params), PROFILE, HEAD), "c.yaml")
    assert message in str(e.value)


def test_parameters_at_their_bounds_are_accepted():
    b = built("{baseMs: 0, prefillMsPerKb: 0, slotWaitMs: 0, slots: 1, minSamples: 3, forgetting: 1, ridge: 0,"
              " ttftSloMs: 0.5, bytesPerToken: 0.1, slotsLabel: null, kvTokensLabel: null, speedLabel: null}")
    p = plugin(b).params
    assert (p.base_ms, p.prefill_ms_per_kb, p.slot_wait_ms, p.slots, p.min_samples, p.forgetting, p.ridge) == \
        (0.0, 0.0, 0.0, 1, 3, 1.0, 0.0)
    assert (p.slots_label, p.kv_tokens_label, p.speed_label) == (None, None, None)
    # all costs 0: every endpoint predicts 0 ms and scores 1
    assert plugin(b).score(ctx(b, new_state(b, prompt="x" * 5000)), POOL) == dict.fromkeys(POOL, 1.0)


# --- prefills ahead: requests in flight without a first token yet (gateway-wide) -------------------

def test_prefills_ahead_are_the_in_flight_tables_pending_prefill_on_every_worker(tmp_path):
    from extproc.datalayer.inflight import InflightTable

    rt = Runtime()
    rt.inflight = InflightTable(tmp_path, 0)
    other_worker = InflightTable(tmp_path, 1)
    s = PredictedTtftScorer("s", PredictedTtftParameters(), rt)
    c = Ctx(req=None, cycle={"prompt_bytes": 2000, "prefix_match": {}},
            state=RequestState(snapshot=None, route=None, started=0.0, request_id="now", runtime=rt))
    rt.inflight.started(E1, 600, 500)  # 500 tokens x 4 bytes = 2 KB to prefill
    other_worker.started(E1, 300, 250)  # another worker's pick: 1 KB more
    got = s.score(c, (E1, E2))
    # E1: 2 in flight (slots 256: no wait), 30 + 8 * (2 + 3) = 70 ms; E2 nothing ahead: 30 + 16 = 46 ms
    assert got == pytest.approx({E1: 1 - 70 / 1000, E2: 1 - 46 / 1000})
    assert c.state.attrs[s.key][E1][3] == pytest.approx(3.0)
    other_worker.prefilled(E1, 250)  # its first token: no longer ahead of anyone
    assert s.score(Ctx(cycle=dict(c.cycle), state=c.state), (E1,)) == pytest.approx({E1: 1 - 62 / 1000})
    rt.inflight.finished(E1, 600, 500)  # the end without a first token takes its prefill back too
    assert s.score(Ctx(cycle=dict(c.cycle), state=c.state), (E1,)) == pytest.approx({E1: 1 - 46 / 1000})


def test_a_request_is_learned_with_the_prefills_that_were_ahead_of_it():
    rt = Runtime()
    s = PredictedTtftScorer("s", PredictedTtftParameters(minSamples=3), rt)
    rt.inflight.started(E2, 600, 500)  # 2 KB ahead on E2
    st = RequestState(snapshot=None, route=None, started=10.0, request_id="c", runtime=rt)
    st.request = request("q", stream=True)
    s.score(Ctx(cycle={"prompt_bytes": 2000, "prefix_match": {E1: 0.5}}, state=st), (E1, E2))
    st.endpoint = E2
    assert st.attrs[s.key][E2] == pytest.approx((0.0, 2.0, 1.0, 2.0))
    st.first_body = 10.3
    s.on_done(st, Outcome.OK)
    # learned, on x = (1, wait 0, uncached 2 + ahead 2 KB), y = 300 ms: the running sums say so
    assert s.model.n == 1
    assert s.model.b == pytest.approx([300.0, 0.0, 4.0 * 300.0])
