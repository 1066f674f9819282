"""perf/bench_routing.py's pure parts: the workload generator's shapes, the statistics, the JSON row schema,
the gateway configs it writes (validated by our loader). No timing, no processes."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_routing", REPO / "perf" / "bench_routing.py")
br = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_routing", br)  # dataclasses look their module up
_spec.loader.exec_module(br)


def tokens(text: str) -> int:
    return math.ceil(len(text.encode()) / br.TOKEN_BYTES)


def test_text_has_exactly_the_asked_simulator_tokens():
    rng = random.Random(0)
    for n in (1, 16, 255, 2048):
        assert tokens(br.text_of(n, rng)) == n


def test_shared_prefix_shape_groups_turns_and_lora():
    shape = br.SHAPES["shared-prefix"]
    one_epoch = shape.groups * shape.prompts_per_group * shape.turns
    reqs = br.make_requests(shape, one_epoch, salt="t")
    assert len(reqs) == one_epoch
    # every conversation has each turn once, turn 1 entirely before turn 2
    convs = {(r.group, r.conversation) for r in reqs}
    assert len(convs) == shape.groups * shape.prompts_per_group
    turns = [r.turn for r in reqs]
    assert turns == sorted(turns)
    # one system prompt per group, of system_prompt_len tokens; questions of question_len
    systems = {r.group: r.messages[0]["content"] for r in reqs}
    assert len(set(systems.values())) == shape.groups
    assert all(tokens(s) == shape.system_prompt_len for s in systems.values())
    for r in reqs:
        assert r.messages[0]["content"] == systems[r.group]
        assert tokens(r.messages[-1]["content"]) == shape.question_len
        assert len(r.messages) == 2 * r.turn  # system, (user, assistant) * (turn - 1), user
        assert r.max_tokens == shape.output_len
    # turn 2 extends turn 1 of the same conversation
    first = {(r.group, r.conversation): r for r in reqs if r.turn == 1}
    for r in reqs:
        if r.turn == 2:
            assert r.messages[:2] == first[(r.group, r.conversation)].messages
    # the first lora_groups groups ask an adapter, the others the base model
    for r in reqs:
        assert r.model == (br.LORAS[r.group % len(br.LORAS)] if r.group < shape.lora_groups else br.MODEL)
    # more requests than one epoch: new conversations, same groups
    more = br.make_requests(shape, one_epoch + 10, salt="t")
    assert len(more) == one_epoch + 10 and more[:one_epoch] == reqs
    assert {(r.group, r.conversation) for r in more[one_epoch:]}.isdisjoint(convs)


def test_prefix_sharing_ratio_high_for_shared_prefix_low_for_low_sharing():
    sp = br.make_requests(br.SHAPES["shared-prefix"], 256, salt="a")
    ls = br.make_requests(br.SHAPES["low-sharing"], 256, salt="a")
    shape = br.SHAPES["shared-prefix"]
    # ideal reuse: all but each group's first system prompt, plus turn 2's carried turn 1
    assert br.prefix_sharing_ratio(sp) > 0.8
    low = br.prefix_sharing_ratio(ls)
    pre, q = br.SHAPES["low-sharing"].system_prompt_len, br.SHAPES["low-sharing"].question_len
    assert low == pytest.approx(pre / (pre + q), abs=0.02)  # only the common preamble is shared
    # another salt shares nothing with the first one
    assert br.prefix_sharing_ratio(br.make_requests(shape, 32, salt="b")[:1] + sp[:1]) == 0.0
    assert all(r.prompt_tokens() == pre + q for r in ls)
    assert len({r.messages[1]["content"] for r in ls}) == len(ls)


def test_poisson_arrivals_rate_and_order():
    a = br.poisson_arrivals(20.0, 100.0, seed=3)
    assert a == sorted(a) and all(0 <= t < 100 for t in a)
    assert len(a) == pytest.approx(2000, rel=0.1)
    assert a == br.poisson_arrivals(20.0, 100.0, seed=3)


def test_percentile_and_histogram_quantile():
    assert br.percentile([], 50) is None
    assert br.percentile([3.0], 99) == 3.0
    assert br.percentile([1, 2, 3, 4], 50) == 2.5
    assert br.percentile(list(range(101)), 99) == 99
    assert br.percentile([10, 0, 5], 100) == 10
    # 10 observations <= 1e-5, 10 more <= 2.5e-5: the median is the first bucket's upper bound
    b = [(1e-5, 10.0), (2.5e-5, 20.0), (5e-5, 20.0), (math.inf, 20.0)]
    assert br.histogram_quantile(b, 0.5) == pytest.approx(1e-5)
    assert br.histogram_quantile(b, 0.75) == pytest.approx(1.75e-5)
    assert br.histogram_quantile([(1e-5, 0.0), (math.inf, 0.0)], 0.5) is None
    assert br.histogram_quantile([(1e-5, 0.0), (math.inf, 4.0)], 0.5) == 1e-5  # all above the last bound


def test_shares_and_capacity_weighted_share():
    counts = {"a": 30.0, "b": 10.0, "c": 0.0}
    assert br.shares(counts) == {"a": 0.75, "b": 0.25, "c": 0.0}
    assert br.shares({"a": 0.0}) == {"a": 0.0}
    # a has half the capacity (weight 2 of 4) and 75% of the requests: 1.5x its share
    assert br.max_share_over_capacity(counts, {"a": 2.0, "b": 1.0, "c": 1.0}) == pytest.approx(1.5)


def test_row_schema_and_values():
    res = [br.Result(ok=True, ttft=0.1, itls=[0.01, 0.03], tokens=10, end=11.0),
           br.Result(ok=True, ttft=0.3, itls=[0.02], tokens=10, end=12.0),
           br.Result(ok=False, status=503, end=10.5)]
    r = br.row("shared-prefix", 0.8, "oracle", res, 10.0, {"x": 3.0, "y": 1.0}, decision_p50_us=12.0)
    for k in br.ROW_KEYS:
        assert k in r
    assert r["workload"] in br.WORKLOADS and r["load"] in br.LOADS and r["policy"] in br.POLICIES
    assert r["ttft_p50_ms"] == 200.0 and r["ttft_p99_ms"] == pytest.approx(298.0)
    assert r["itl_p50_ms"] == 20.0
    assert r["output_tokens_per_s"] == 10.0  # 20 tokens from the window's start to the last end (2 s)
    assert r["success_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert r["max_endpoint_share"] == 0.75 and r["decision_p50_us"] == 12.0
    json.dumps({"rows": [r]})  # serialisable as the results file


def test_pooled_row_takes_percentiles_over_all_segments_and_tokens_over_their_summed_windows():
    a = [br.Result(ok=True, ttft=0.1, itls=[0.01], tokens=10, end=12.0)]  # window 10..12: 2 s
    b = [br.Result(ok=True, ttft=0.5, itls=[0.03], tokens=30, end=103.0),  # window 100..103: 3 s
         br.Result(ok=False, status=503, end=101.0)]
    r = br.pooled_row("shared-prefix", 0.8, "adapter-gateway", [(a, 10.0), (b, 100.0)], {"x": 1.0})
    assert r["requests"] == 3 and r["success_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert r["ttft_p50_ms"] == pytest.approx(300.0)  # over both segments' TTFTs (100 and 500 ms)
    assert r["itl_p50_ms"] == pytest.approx(20.0)
    assert r["output_tokens_per_s"] == 8.0  # 40 tokens over 2 s + 3 s, not over 10..103
    one = br.pooled_row("shared-prefix", 0.8, "adapter-gateway", [(a, 10.0)], {"x": 1.0})
    assert one == br.row("shared-prefix", 0.8, "adapter-gateway", a, 10.0, {"x": 1.0})


def test_every_policy_config_loads(tmp_path):
    from extproc.config.loader import load_file

    fleet = [(n, None, 20000 + i) for i, n in enumerate(br.FLEET)]
    assert len(fleet) >= 4 and any(n.speed == 0.5 for n in br.FLEET)
    assert len({(n.speed, n.kv_tokens) for n in br.FLEET}) > 2
    for policy in br.POLICIES:
        p = tmp_path / f"{policy}.yaml"
        p.write_text(json.dumps(br.gateway_config(policy, fleet)))
        snap = load_file(p)
        assert list(snap.backends) == ["pool"] and len(snap.backends["pool"].endpoints) == len(br.FLEET)
        route = next(iter(snap.routes.values()))
        if policy in ("round-robin", "least-request"):
            assert route.picker is None
            assert snap.backends["pool"].lb_policy == {"round-robin": "roundRobin",
                                                       "least-request": "leastRequest"}[policy]
        else:
            assert route.picker is not None
    epp = br.gateway_config("epp-default", fleet)["spec"]["schedulingProfiles"][0]["plugins"]
    assert {p["pluginRef"]: p.get("weight") for p in epp} == {
        "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3, "max-score-picker": None}
