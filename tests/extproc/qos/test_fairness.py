"""Tenant fairness within a class (extproc/qos/fairness.py, through the pool queue of extproc/qos/queue.py):
Jain's index on a synthetic mix where one tenant sends 10x its share, token weighting, weights, no banked
credit for an idle tenant, and the index's arithmetic."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from extproc.qos.fairness import FairShare, JainWindow, jain
from extproc.qos.queue import AdmissionQueue, Waiter

seq = iter(range(10 ** 9))


def push(q, tenant, tokens=100, weight=1.0, rank=1, deadline=math.inf):
    n = next(seq)
    q.push(Waiter(SimpleNamespace(attrs={}), rank, "P1", tenant, deadline, tokens, weight, 0, n, float(n)))


def served(q, n):
    out: dict[str, float] = {}
    for _ in range(n):
        w = q.pop()
        out[w.tenant] = out.get(w.tenant, 0) + w.tokens
    return out


def test_jain_arithmetic():
    assert jain([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert jain([1, 2]) == pytest.approx(9 / 10)
    assert jain([]) is None and jain([0, 0]) == 1.0


def test_noisy_tenant_at_10x_does_not_starve_the_others():
    q = AdmissionQueue()
    arrivals = []
    for i in range(300):  # arrival order: the noisy tenant's requests come 10 for every 1 of each other's
        arrivals.append("noisy")
        if i % 10 == 0:
            arrivals += ["a", "b", "c"]
    for t in arrivals:
        push(q, t)
    got = served(q, 80)  # the pool admits 80 while all four are backlogged
    assert set(got) == {"noisy", "a", "b", "c"}
    assert jain(got.values()) > 0.95
    fifo: dict[str, int] = {}
    for t in arrivals[:80]:  # what arrival order alone would have admitted
        fifo[t] = fifo.get(t, 0) + 100
    assert jain(fifo.values()) < 0.6


def test_fair_in_tokens_not_requests():
    q = AdmissionQueue()
    for _ in range(100):
        push(q, "long", tokens=1000)
        push(q, "short", tokens=100)
    got = served(q, 55)
    assert got["long"] == pytest.approx(got["short"], rel=0.25)  # about 5 long requests per 50 short ones


def test_weights_share_in_proportion():
    q = AdmissionQueue()
    for _ in range(200):
        push(q, "gold", weight=3.0)
        push(q, "std", weight=1.0)
    got = served(q, 80)
    assert got["gold"] / got["std"] == pytest.approx(3.0, rel=0.1)


def test_an_idle_tenant_banks_no_credit():
    f = FairShare()
    for _ in range(50):
        f.charge("busy", 100, 1.0)
    # "late" sent nothing for 50 requests; it starts at the class's clock, not 50 requests ahead
    assert f.key("late") == f.clock
    f.charge("late", 100, 1.0)
    assert f.key("late") >= f.key("busy")  # and now behind (or level with) the busy one


def test_priority_and_edf_still_come_first():
    q = AdmissionQueue()
    push(q, "noisy", rank=1, deadline=5)
    push(q, "noisy", rank=1, deadline=1)
    push(q, "a", rank=2)
    push(q, "b", rank=0)
    order = [(w.tenant, w.deadline) for w in (q.pop(), q.pop(), q.pop(), q.pop())]
    assert order == [("b", math.inf), ("noisy", 1), ("noisy", 5), ("a", math.inf)]


def test_jain_window_counts_waiting_tenants_that_got_nothing():
    w = JainWindow()
    w.waiting("a")
    w.waiting("b")
    w.admitted("a", 100, 1.0)
    assert w.close() == pytest.approx(0.5)
    assert w.close() is None and w.last == pytest.approx(0.5)
