"""Scorer `prefix-cache-scorer`: running CRC-32 block keys of the prompt, a per-endpoint LRU index learned
from the profile's own picks (the `picked` hook), score = matched leading blocks / blocks; the LRU bound."""

from __future__ import annotations

import zlib

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Scorer, SchedulingContext
from extproc.scheduling.prefix_cache_scorer import PrefixCacheScorer, PrefixCacheScorerParameters, block_hashes
from tests.extproc.scheduling.conftest import E1, E2, E3, E4, POOL
from tests.extproc.scheduling.signal_fleet import built, request_state

PLUGINS = ("    - {type: prefix-cache-scorer, parameters: {blockSize: 8, lruCapacityPerServer: 64}}\n"
           "    - {type: max-score-picker, parameters: {fallbacks: 0}}\n")
PROFILE = "[{pluginRef: max-score-picker}, {pluginRef: prefix-cache-scorer}]"  # the picker may come first


def ctx_for(model: str, prompt: str):
    from extproc.request import parse_openai

    req = parse_openai("/v1/completions", {"model": model, "prompt": prompt})
    return SchedulingContext(None, None, req, None, {}, "p")


def scorer(**params) -> PrefixCacheScorer:
    return PrefixCacheScorer("prefix", PrefixCacheScorerParameters(**params), Runtime())


def test_is_a_bounded_scorer_with_gie_defaults():
    s = scorer()
    assert isinstance(s, Scorer) and s.bounded is True and s.consumes == ()
    p = s.params
    assert (p.block_size, p.max_prefix_blocks_to_match, p.lru_capacity_per_server) == (64, 256, 31250)


def test_block_hashes_are_a_running_crc32_with_the_model_first_and_the_depth_above():
    h1 = 1 << 32 | zlib.crc32(b"mabcd")  # the CRC of the model name and the whole prefix
    h2 = 2 << 32 | zlib.crc32(b"mabcdefgh")
    assert block_hashes("m", "abcdefghij", 4, 100) == [h1, h2]  # "ij": a partial block, ignored
    assert block_hashes("m", b"abcdefghij", 4, 100) == [h1, h2]  # bytes as given
    assert block_hashes("m", "abcdefgh", 4, 1) == [h1]  # at most max blocks
    assert block_hashes("other", "abcdefgh", 4, 9)[0] != h1  # another model shares nothing
    assert block_hashes("m", "abc", 4, 9) == []
    # cumulative: block 2 names the whole prefix, so the same block after another prefix differs
    assert block_hashes("m", "zzzzefgh", 4, 9)[1] != h2
    # blocks are UTF-8 bytes: "é" is two, so "aéb" + "c" is one 4-byte block
    assert block_hashes("m", "a\u00e9bc", 4, 9) == [1 << 32 | zlib.crc32("ma\u00e9b".encode())]


def test_score_is_the_share_of_leading_blocks_the_endpoint_was_sent():
    s = scorer(blockSize=4)
    s.picked(ctx_for("m", "aaaabbbbcccc"), E1)
    s.picked(ctx_for("m", "aaaabbbb"), E2)
    ctx = ctx_for("m", "aaaabbbbccccdddd")
    assert s.score(ctx, (E1, E2, E3)) == {E1: 0.75, E2: 0.5, E3: 0.0}
    # the hashes were computed once for the decision, and are what picked() records
    assert ctx.cycle[("prefix", "hashes")] == block_hashes("m", "aaaabbbbccccdddd", 4, 256)
    assert s.score(ctx_for("m", "xxxxbbbbcccc"), (E1, E2)) == {E1: 0.0, E2: 0.0}  # same blocks, other prefix
    assert s.score(ctx_for("m", "aaa"), (E1, E2)) == {E1: 0.0, E2: 0.0}  # shorter than a block


def test_the_lru_is_bounded_and_evicts_a_prompts_tail_first():
    s = scorer(blockSize=2, lruCapacityPerServer=6)
    a, b = "a1a2a3a4", "b1b2b3b4"
    s.picked(ctx_for("m", a), E1)
    s.picked(ctx_for("m", b), E1)
    assert len(s.index[E1]) == 6
    # a's two deepest blocks went first: its leading half is still there, matched as a run
    assert s.score(ctx_for("m", a), (E1,)) == {E1: 0.5}
    assert s.score(ctx_for("m", b), (E1,)) == {E1: 1.0}
    s.picked(ctx_for("m", "c1c2c3c4c5c6"), E1)
    assert len(s.index[E1]) == 6 and s.score(ctx_for("m", b), (E1,)) == {E1: 0.0}


def test_a_repeated_prompt_refreshes_its_blocks():
    s = scorer(blockSize=2, lruCapacityPerServer=4)
    s.picked(ctx_for("m", "a1a2"), E1)
    s.picked(ctx_for("m", "b1b2"), E1)
    s.picked(ctx_for("m", "a1a2"), E1)  # a is the most recent now
    s.picked(ctx_for("m", "c1c2"), E1)  # evicts b, not a
    assert s.score(ctx_for("m", "a1a2"), (E1,)) == {E1: 1.0}
    assert s.score(ctx_for("m", "b1b2"), (E1,)) == {E1: 0.0}


def test_reconfigure_clears_on_a_new_block_size_and_trims_on_a_smaller_capacity():
    s = scorer(blockSize=2, lruCapacityPerServer=8)
    s.picked(ctx_for("m", "a1a2a3a4"), E1)
    s.configure(s.params, PrefixCacheScorerParameters(blockSize=2, lruCapacityPerServer=2))
    assert len(s.index[E1]) == 2 and s.score(ctx_for("m", "a1a2a3a4"), (E1,)) == {E1: 0.5}
    s.configure(s.params, PrefixCacheScorerParameters(blockSize=4, lruCapacityPerServer=2))
    assert s.index == {}


def test_repeated_prompts_stick_to_the_endpoint_that_served_them_first():
    b = built(PLUGINS, PROFILE)
    system = "You are a careful financial analyst. " * 4
    first = {q: b.decide(request_state(b, content=system + q))[0] for q in ("q1?", "q2?", "q3?")}
    assert set(first.values()) == {first["q1?"]}
    # every later request with that system prompt goes where the first one went: the shared prefix
    # scores 1 block short of full there and 0 elsewhere
    for i in range(20):
        pick = b.decide(request_state(b, content=system + f"another question {i}"))[0]
        assert pick == first["q1?"]
    # an unrelated prompt has no affinity: ties, spread at random
    assert {b.decide(request_state(b, content=f"{i:04d}{i:04d} unrelated"))[0] for i in range(60)} == set(POOL)


def test_the_profile_records_the_pick_and_explains_the_scores():
    b = built(PLUGINS, PROFILE)
    st = request_state(b, content="0123456789abcdef")  # 2 blocks of 8
    pick = b.decide(st)[0]
    prefix = b.runtime.plugin(b.snap.plugins["prefix-cache-scorer"])
    assert list(prefix.index) == [pick] and len(prefix.index[pick]) == 2
    st2 = request_state(b, content="0123456789abcdef")
    assert b.decide(st2) == (pick,)
    raw = st2.attrs["decision"]["scorers"][0]["raw"]
    assert raw == {e: (1.0 if e == pick else 0.0) for e in (E1, E2, E3, E4)}


def test_a_reload_keeps_the_index():
    b = built(PLUGINS, PROFILE)
    pick = b.decide(request_state(b, content="0123456789abcdef"))[0]
    from tests.extproc.scheduling.signal_fleet import vllm_gateway

    b.reload(vllm_gateway(PLUGINS.replace("fallbacks: 0", "fallbacks: 1"), PROFILE))
    assert b.decide(request_state(b, content="0123456789abcdef"))[0] == pick


@pytest.mark.parametrize("n", [1, 3])
def test_the_picked_hook_gets_the_first_pick_only(n):
    b = built(PLUGINS.replace("fallbacks: 0", f"fallbacks: {n}"), PROFILE)
    picks = b.decide(request_state(b, content="0123456789abcdef"))
    prefix = b.runtime.plugin(b.snap.plugins["prefix-cache-scorer"])
    assert len(picks) == n + 1 and list(prefix.index) == [picks[0]]


# --- the index sized from each endpoint's KV-cache label ----------------------------------------------

def labelled_ctx(model: str, prompt: str, labels: dict):
    c = ctx_for(model, prompt)
    c.labels = labels
    return c


def test_capacity_label_sizes_each_endpoints_index_from_its_kv_tokens():
    # blockSize 2 bytes, 4 bytes per token: E1's 3 tokens hold 6 blocks, E2's 1 token 2 blocks;
    # E3 has no (usable) label: lruCapacityPerServer
    s = scorer(blockSize=2, lruCapacityPerServer=5, capacityLabel="kv-tokens")
    labels = {E1: {"kv-tokens": "3"}, E2: {"kv-tokens": "1"}, E3: {"kv-tokens": "lots"}}
    for e in (E1, E2, E3):
        s.picked(labelled_ctx("m", "a1a2a3a4a5a6a7a8", labels), e)  # 8 blocks
    assert {e: len(s.index[e]) for e in (E1, E2, E3)} == {E1: 6, E2: 2, E3: 5}
    # the newest are the leading blocks (recorded deepest first): each still matches its leading run
    assert s.score(labelled_ctx("m", "a1a2a3a4a5a6a7a8", labels), (E1, E2, E3)) == {E1: 6 / 8, E2: 2 / 8, E3: 5 / 8}
    assert s.capacity(labels, E1) == 6 and s.capacity(labels, E4) == 5
    assert scorer(blockSize=64, capacityLabel="kv-tokens").capacity({E1: {"kv-tokens": "1"}}, E1) == 1  # at least 1


def test_capacity_label_follows_a_reload_of_the_labels_and_bytes_per_token():
    s = scorer(blockSize=2, capacityLabel="kv-tokens")
    assert s.capacity({E1: {"kv-tokens": "3"}}, E1) == 6
    assert s.capacity({E1: {"kv-tokens": "5"}}, E1) == 10  # a new labels object: read again
    s.picked(labelled_ctx("m", "a1a2a3a4a5a6a7a8", {E1: {"kv-tokens": "5"}}), E1)
    assert len(s.index[E1]) == 8
    s.configure(s.params, PrefixCacheScorerParameters(blockSize=2, capacityLabel="kv-tokens", bytesPerToken=1))
    assert len(s.index[E1]) == 2  # 5 tokens x 1 byte / 2 bytes per block, trimmed at once


def test_without_a_capacity_label_the_label_is_ignored():
    s = scorer(blockSize=2, lruCapacityPerServer=3)
    s.picked(labelled_ctx("m", "a1a2a3a4a5a6a7a8", {E1: {"kv-tokens": "100"}}), E1)
    assert len(s.index[E1]) == 3


@pytest.mark.parametrize("params", [{"capacityLabel": ""}, {"bytesPerToken": 0}, {"bytesPerToken": float("nan")}])
def test_bad_capacity_parameters_are_refused(params):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        PrefixCacheScorerParameters(**params)
