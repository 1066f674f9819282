"""What a pick counts in the gateway-wide in-flight table (extproc/stages/dispatch.py): `dispatched` adds the
request with its estimated tokens (prompt characters / 4 + max_tokens) and prefill tokens (the uncached
part a prefix scorer left in PREFILL_ATTR, else the whole prompt); `prefilled` (the stream's first response
body) takes the prefill back once; `release` (the lifecycle observer) takes back whatever is left."""

from __future__ import annotations

from extproc.request import parse_openai
from extproc.runtime import Runtime
from extproc.scheduling import PREFILL_ATTR
from extproc.stages.dispatch import dispatched, prefilled, release
from extproc.types import Outcome, RequestState

EP = "10.0.0.5:8000"


def state(prompt: str = "x" * 400, max_tokens: int | None = 50) -> RequestState:
    rt = Runtime()
    st = RequestState(snapshot=None, route=None, started=0.0, runtime=rt)
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    st.request = parse_openai("/v1/chat/completions", body)
    return st


def test_dispatched_counts_prompt_plus_max_tokens_and_the_whole_prompt_as_prefill():
    st = state()
    dispatched(st, EP)
    assert st.endpoint == EP and st.inflight == (150, 100)  # 400 chars = 100 tokens, + 50
    assert st.runtime.inflight.loads([EP]) == {EP: (1, 150, 100)}


def test_a_prefix_scorers_estimate_is_the_prefill():
    st = state()
    st.attrs[PREFILL_ATTR] = 30
    dispatched(st, EP)
    assert st.inflight == (150, 30) and st.runtime.inflight.loads([EP]) == {EP: (1, 150, 30)}


def test_prefilled_once_then_release_takes_the_rest():
    st = state(max_tokens=None)
    dispatched(st, EP)
    prefilled(st)
    assert st.inflight == (100, 0) and st.runtime.inflight.loads([EP]) == {EP: (1, 100, 0)}
    prefilled(st)  # a second body changes nothing
    assert st.runtime.inflight.loads([EP]) == {EP: (1, 100, 0)}
    release(st, Outcome.OK)
    assert st.inflight is None and st.runtime.inflight.loads([EP]) == {EP: (0, 0, 0)}


def test_release_without_a_first_token_takes_the_prefill_too():
    st = state()
    dispatched(st, EP)
    release(st, Outcome.CANCELLED)
    assert st.runtime.inflight.loads([EP]) == {EP: (0, 0, 0)}


def test_without_a_pick_nothing_is_counted_or_released():
    st = state()
    prefilled(st)
    release(st, Outcome.OK)
    assert st.runtime.inflight.loads([EP]) == {EP: (0, 0, 0)} and st.inflight is None
    # a request without a parsed body (a headers-only route) counts one request and no tokens
    bare = RequestState(snapshot=None, route=None, started=0.0, runtime=Runtime())
    dispatched(bare, EP)
    assert bare.inflight == (0, 0) and bare.runtime.inflight.loads([EP]) == {EP: (1, 0, 0)}


def test_prefix_cache_scorer_leaves_the_uncached_share_of_the_picks_prompt():
    from types import SimpleNamespace

    from extproc.scheduling.prefix_cache_scorer import PrefixCacheScorer, PrefixCacheScorerParameters

    s = PrefixCacheScorer("p", PrefixCacheScorerParameters(blockSize=100), Runtime())
    st = state(prompt="a" * 400)
    ctx = SimpleNamespace(state=st, request=st.request, cycle={}, labels={})
    s.score(ctx, (EP, "10.0.0.6:8000"))
    s.picked(ctx, EP)
    assert st.attrs[PREFILL_ATTR] == 100  # nothing cached yet: the whole 100-token prompt
    st2 = state(prompt="a" * 200 + "b" * 200)
    ctx2 = SimpleNamespace(state=st2, request=st2.request, cycle={}, labels={})
    assert s.score(ctx2, (EP,)) == {EP: 0.5}
    s.picked(ctx2, EP)
    assert st2.attrs[PREFILL_ATTR] == 50  # half of it is cached there
