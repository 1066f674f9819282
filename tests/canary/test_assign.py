"""canary/assign.py: the split, monotone ramps, rollback, stickiness across processes, keyless weighted
random at the GIE conformance tolerance, and trust (untrusted headers refused, forcing only when trusted)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

from canary.assign import (
    BUCKETS, Arm, JwtClaim, KeyPolicy, Move, RequestFacts, Rollout, RolloutError, TenantKey, TrustedHeader, arm_at,
    UNIT_BITS, assign, bucket, decide, extract_key, forced_arm, monotone, moves, unit,
)
from tests.conftest import REPO

KEYS = [f"user-{i}" for i in range(10_000)]


def canary_set(rollout: Rollout, arm: str = "canary") -> set[str]:
    return {k for k in KEYS if assign(rollout, k).arm == arm}


def one_canary(weight: int, name: str = "checkout-v2") -> Rollout:
    return Rollout(name, (Arm("canary", weight),))


# --------------------------------------------------------------------------------------------------
# the split


@pytest.mark.parametrize("weight", [100, 500, 1000, 2500, 5000, 9000])
@pytest.mark.parametrize("salt", ["checkout-v2", "model-2026-11", "x"])
def test_the_split_is_within_one_percentage_point_of_the_weight_over_10000_keys(weight, salt):
    r = Rollout("r", (Arm("canary", weight),), salt=salt)
    share = len(canary_set(r)) / len(KEYS)
    assert abs(share - weight / BUCKETS) <= 0.01, (salt, weight, share)


def test_several_canaries_take_cumulative_ranges_and_each_gets_its_weight():
    r = Rollout("r", (Arm("a", 1000), Arm("b", 2000), Arm("c", 500)))
    assert r.ranges() == (("a", 0, 1000), ("b", 1000, 3000), ("c", 3000, 3500), ("stable", 3500, 10_000))
    assert r.weight("stable") == 6500 and r.weight("b") == 2000
    counts = {name: 0 for name in r.arm_names}
    for k in KEYS:
        counts[assign(r, k).arm] += 1
    for name, n in counts.items():
        assert abs(n / len(KEYS) - r.weight(name) / BUCKETS) <= 0.01, (name, n)
    # the arm is exactly the range holding the key's bucket
    for k in KEYS[:500]:
        b = bucket(r.hash_salt, k)
        (arm,) = [a for a, lo, hi in r.ranges() if lo <= b < hi]
        assert assign(r, k).arm == arm == arm_at(r, b)


def test_the_edges_zero_and_everything():
    assert canary_set(one_canary(0)) == set()
    assert canary_set(one_canary(BUCKETS)) == set(KEYS)
    assert arm_at(one_canary(1), 0) == "canary" and arm_at(one_canary(1), 1) == "stable"
    assert arm_at(one_canary(BUCKETS), BUCKETS - 1) == "canary"


# --------------------------------------------------------------------------------------------------
# ramps and rollback


PLAN = [0, 100, 500, 1000, 2500, 5000, 10_000]


def test_ramps_are_monotone_every_key_in_at_5_percent_is_in_at_every_later_step():
    sets = {w: canary_set(one_canary(w)) for w in PLAN}
    for lower, higher in zip(PLAN, PLAN[1:]):
        assert sets[lower] <= sets[higher], (lower, higher)
        assert monotone(one_canary(lower), one_canary(higher))
        assert moves(one_canary(lower), one_canary(higher)) == (Move(lower, higher, "stable", "canary"),)
    assert sets[500] <= sets[1000] <= sets[2500] <= sets[5000] <= sets[10_000] == set(KEYS)


def test_a_rollback_moves_everyone_back_and_a_re_ramp_gets_the_same_keys():
    at_25 = one_canary(2500)
    back = at_25.rolled_back()
    assert back.weight("canary") == 0 and not back.allow_force
    assert canary_set(back) == set()
    assert moves(at_25, back) == (Move(0, 2500, "canary", "stable"),) and monotone(at_25, back)
    # a step down moves keys only back to stable; the keys in at w depend on w alone, not on the path
    assert canary_set(at_25.with_weight("canary", 500)) == canary_set(one_canary(500))
    assert canary_set(back.with_weight("canary", 1000)) == canary_set(one_canary(1000))


def test_with_several_canaries_moving_an_earlier_arm_is_flagged_as_not_monotone():
    r = Rollout("r", (Arm("a", 500), Arm("b", 500)))
    up_a = r.with_weight("a", 1000)
    assert moves(r, up_a) == (Move(500, 1000, "b", "a"), Move(1000, 1500, "stable", "b"))
    assert not monotone(r, up_a)  # keys of b moved to a: a step plan must refuse or log this
    up_b = r.with_weight("b", 2000)
    assert moves(r, up_b) == (Move(1000, 2500, "stable", "b"),) and monotone(r, up_b)
    assert canary_set(r, "a") <= canary_set(up_b, "a") and canary_set(r, "b") <= canary_set(up_b, "b")


def test_a_new_salt_is_a_new_rollout_not_a_step():
    with pytest.raises(RolloutError) as e:
        moves(one_canary(500), Rollout("checkout-v2", (Arm("canary", 500),), salt="other"))
    assert e.value.field == "salt"
    assert not monotone(one_canary(500), Rollout("checkout-v2", (Arm("canary", 500),), salt="other"))


def test_rollouts_with_different_salts_split_users_independently():
    a = canary_set(Rollout("a", (Arm("canary", 5000),)))
    b = canary_set(Rollout("b", (Arm("canary", 5000),)))
    overlap = len(a & b) / len(KEYS)
    assert abs(overlap - 0.25) <= 0.015, overlap  # independent halves overlap on a quarter


# --------------------------------------------------------------------------------------------------
# the same key, the same arm: every process, every replica


CHILD = """
import json, sys
from canary.assign import Arm, Rollout, assign, bucket
keys = [f"user-{i}" for i in range(2000)]
r = Rollout("checkout-v2", (Arm("canary", 1000), Arm("canary-b", 500)))
print(json.dumps({"buckets": [bucket("checkout-v2", k) for k in keys], "arms": [assign(r, k).arm for k in keys]}))
"""


@pytest.mark.parametrize("hashseed", ["0", "12345", "random"])
def test_the_same_key_gets_the_same_arm_in_another_process(hashseed):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONHASHSEED=hashseed)
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    child = json.loads(p.stdout)
    keys = KEYS[:2000]
    r = Rollout("checkout-v2", (Arm("canary", 1000), Arm("canary-b", 500)))
    assert child["buckets"] == [bucket("checkout-v2", k) for k in keys]
    assert child["arms"] == [assign(r, k).arm for k in keys]


def test_the_hash_is_pinned_changing_it_would_reassign_every_user_of_every_rollout():
    assert [bucket("rollout-a", f"user-{i}") for i in range(5)] == [5375, 2632, 1887, 3408, 3163]
    assert bucket("checkout-v2", "alice") == 1168 and bucket("", "") == 7479
    # the salt is length-prefixed: moving characters between salt and key changes the bucket
    assert bucket("ab", "c") != bucket("a", "bc")


# --------------------------------------------------------------------------------------------------
# requests without a key: weighted random


def gie_tolerance(p: float, n: int) -> float:
    """GIE's GatewayWeightedAcrossTwoInferencePools (conformance/tests/gateway_weighted_two_pools.go):
    200 requests at 70/30, the primary share within max(10 percentage points, 3 binomial sigmas)."""
    return max(0.10, 3 * math.sqrt(p * (1 - p) / n))


def test_keyless_requests_split_70_30_over_200_within_the_gie_conformance_tolerance():
    r = Rollout("pools", (Arm("secondary", 3000),), baseline="primary")
    facts = RequestFacts({"content-type": "application/json"})  # 200 identical requests, no key source matches
    policy = KeyPolicy((TrustedHeader("x-user-id"),), trusted_headers={"x-user-id"})
    rng = random.Random(20261201)
    got = [decide(r, policy, facts, rng=rng) for _ in range(200)]
    assert {a.how for a in got} == {"random"} and all(a.source is None for a in got)
    primary = sum(a.arm == "primary" for a in got) / 200
    assert abs(primary - 0.70) <= gie_tolerance(0.70, 200), primary


def test_keyless_70_30_holds_for_nearly_every_seed_not_one_lucky_one():
    r = Rollout("pools", (Arm("secondary", 3000),), baseline="primary")
    tol = gie_tolerance(0.70, 200)
    failures = 0
    for seed in range(1000):
        rng = random.Random(seed)
        primary = sum(assign(r, None, rng=rng).arm == "primary" for _ in range(200)) / 200
        failures += abs(primary - 0.70) > tol
    # the tolerance is ~3.1 sigma: about 0.2 % of runs fall outside; 1 % is a generous, still strict bound
    assert failures <= 10, failures


def test_keyless_draws_are_reproducible_with_a_seeded_rng():
    r = one_canary(3000)
    a = [assign(r, None, rng=random.Random(7)).bucket for _ in range(3)]
    assert len(set(a)) == 1
    rng1, rng2 = random.Random(7), random.Random(7)
    assert [assign(r, None, rng=rng1).arm for _ in range(50)] == [assign(r, None, rng=rng2).arm for _ in range(50)]


# --------------------------------------------------------------------------------------------------
# key sources and trust


def test_an_untrusted_header_is_refused_never_hashed():
    r = one_canary(5000)
    untrusting = KeyPolicy((TrustedHeader("x-user-id"),))  # the route trusts no header
    facts = RequestFacts({"x-user-id": "alice"})
    key = extract_key(untrusting, facts)
    assert key.key is None and key.source is None
    (reason,) = key.reasons
    assert reason.startswith("header:x-user-id: refused") and "does not trust" in reason
    assert untrusting.problems() == ["sources[0]: header 'x-user-id' is not in trusted_headers: a client could "
                                     "choose it, so it is never used as a key on this route"]
    # the client gains nothing by choosing a value: its requests are spread at random, not pinned
    arms = {decide(r, untrusting, facts, rng=random.Random(i)).arm for i in range(50)}
    assert arms == {"canary", "stable"}
    # the same header on a route that trusts it is the key
    trusting = KeyPolicy((TrustedHeader("X-User-Id"),), trusted_headers={"x-user-id"})
    assert trusting.problems() == []
    a = decide(r, trusting, facts)
    assert (a.how, a.source, a.bucket) == ("hash", "header:x-user-id", bucket("checkout-v2", "alice"))


def test_sources_are_tried_in_order_and_the_reasons_say_why_earlier_ones_gave_nothing():
    policy = KeyPolicy((TrustedHeader("x-session-id"), JwtClaim("org.id"), JwtClaim("sub"), TenantKey()),
                       trusted_headers={"x-session-id"})
    assert extract_key(policy, RequestFacts({"x-session-id": " s-1 "}, {"sub": "u"}, "acme")).key == "s-1"
    k = extract_key(policy, RequestFacts({}, {"org": {"id": 42}, "sub": "u"}, "acme"))
    assert (k.key, k.source, k.reasons) == ("42", "claim:org.id", ("header:x-session-id: absent",))
    k = extract_key(policy, RequestFacts({"x-session-id": ""}, {"org": {"id": True}, "sub": "u"}))
    assert (k.key, k.source) == ("u", "claim:sub")
    assert k.reasons == ("header:x-session-id: empty", "claim:org.id: is a bool, not a string or integer")
    k = extract_key(policy, RequestFacts({}, None, "acme"))
    assert (k.key, k.source) == ("acme", "tenant")
    assert k.reasons[1:] == ("claim:org.id: no verified JWT on this request",
                             "claim:sub: no verified JWT on this request")
    k = extract_key(policy, RequestFacts())
    assert k.key is None and k.reasons[-1] == "tenant: absent"
    # a caller that kept the client's header casing still finds it
    assert extract_key(policy, RequestFacts({"X-Session-Id": "s-2"})).key == "s-2"
    # an oversized key is refused rather than hashed
    long = KeyPolicy((TenantKey(),), max_key_len=8)
    assert "more than max_key_len 8" in extract_key(long, RequestFacts(tenant="x" * 9)).reasons[0]


def test_x_canary_forces_only_from_a_trusted_source():
    r = one_canary(0)  # at 0 %: forcing is how a tester reaches the canary before any traffic
    trusted = KeyPolicy((TrustedHeader("x-user-id"),), trusted_headers={"x-user-id", "x-canary"})
    untrusted = KeyPolicy((TrustedHeader("x-user-id"),), trusted_headers={"x-user-id"})
    facts = RequestFacts({"x-user-id": "alice", "x-canary": "true"})
    a = decide(r, trusted, facts)
    assert (a.arm, a.how, a.source, a.variant) == ("canary", "forced", "header:x-canary", "checkout-v2/canary")
    a = decide(r, untrusted, facts)
    assert (a.arm, a.how) == ("stable", "hash")
    assert a.reasons == ("header:x-canary: ignored, the route does not trust this header",)
    # after a rollback forcing is off
    a = decide(r.rolled_back(), trusted, facts)
    assert a.how == "hash" and "forcing is off" in a.reasons[-1]
    # values: false -> baseline, an arm's name -> that arm, anything else ignored
    multi = Rollout("m", (Arm("a", 0), Arm("b", 0)))
    assert forced_arm(multi, trusted, RequestFacts({"x-canary": "TRUE"})) == ("a", None)
    assert forced_arm(multi, trusted, RequestFacts({"x-canary": "b"})) == ("b", None)
    assert forced_arm(one_canary(10_000), trusted, RequestFacts({"x-canary": "false"})) == ("stable", None)
    arm, why = forced_arm(multi, trusted, RequestFacts({"x-canary": "please"}))
    assert arm is None and "neither true/false nor an arm" in why
    assert forced_arm(multi, trusted, RequestFacts({})) == (None, None)
    # from a verified JWT claim
    claims = KeyPolicy((), force=JwtClaim("canary"))
    assert forced_arm(multi, claims, RequestFacts(claims={"canary": True})) == ("a", None)
    assert forced_arm(multi, KeyPolicy((), force=None), facts) == (None, None)


# --------------------------------------------------------------------------------------------------
# validation (config-ready: the field is named)


@pytest.mark.parametrize("build, field", [
    (lambda: Rollout("r", (Arm("a", 6000), Arm("b", 5000))), "canaries"),
    (lambda: Rollout("r", (Arm("a", -1),)), "canaries[0].weight"),
    (lambda: Rollout("r", (Arm("a", True),)), "canaries[0].weight"),
    (lambda: Rollout("r", (Arm("a", 1.5),)), "canaries[0].weight"),
    (lambda: Rollout("r", (Arm("stable", 10),)), "canaries[0].name"),
    (lambda: Rollout("r", (Arm("a", 1), Arm("a", 1))), "canaries[1].name"),
    (lambda: Rollout(""), "name"),
    (lambda: Rollout("r", salt=""), "salt"),
    (lambda: one_canary(10).with_weight("nope", 5), "canaries"),
    (lambda: KeyPolicy(("x-user-id",)), "sources[0]"),
    (lambda: JwtClaim("org..id"), "claim"),
    (lambda: TrustedHeader(" "), "header"),
    (lambda: KeyPolicy((), trusted_headers="x-user-id"), "trusted_headers"),
])
def test_invalid_rollouts_and_policies_name_the_field(build, field):
    with pytest.raises(RolloutError) as e:
        build()
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_a_keyed_assignment_carries_the_keys_unit_for_the_judge_and_others_none():
    r = Rollout("ro", (Arm("canary", 3000),))
    units = set()
    for i in range(2000):
        a = assign(r, f"user-{i}")
        assert a.unit == unit("ro", f"user-{i}") and 1 <= a.unit < 2 ** UNIT_BITS
        units.add(a.unit)
    assert len(units) >= 1999  # 2,000 keys in 2**24 ids: a collision is rare (about 1 in 8 runs of keys)
    assert unit("ro", "user-1") == unit("ro", "user-1") != unit("other-salt", "user-1")
    assert assign(r, None, rng=random.Random(1)).unit is None  # keyless: each request independent
    trusted = KeyPolicy((TrustedHeader("x-user-id"),), trusted_headers={"x-user-id", "x-canary"})
    forced = decide(r, trusted, RequestFacts({"x-canary": "true", "x-user-id": "u"}))
    assert forced.how == "forced" and forced.unit is None  # a tester's requests: not a random key
    d = decide(r, trusted, RequestFacts({"x-user-id": "u"}))
    assert d.unit == unit("ro", "u") and d.source == "header:x-user-id"
