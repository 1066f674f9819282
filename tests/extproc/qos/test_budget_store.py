"""Budget stores: the check-and-charge, reconciliation in the charged window, window roll-over, and one exact
budget for several worker processes sharing the memory store's file."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from extproc.qos.budget import Limits, window_indexes
from extproc.qos.budget_store import MemoryStore

T0 = 1_796_000_000.0  # 20 s into a minute


def limits(rpm=None, tpm=None, rpd=None, tpd=None) -> Limits:
    return Limits((rpm, tpm), (rpd, tpd))


def test_charge_admits_until_a_limit_then_names_the_window_and_unit_that_refused():
    s = MemoryStore()
    lim = limits(rpm=3, tpm=100)
    d1 = s.charge_sync("acme", lim, 40, T0)
    assert d1.admitted and d1.windows[0].requests == 1 and d1.windows[0].tokens == 40
    assert s.charge_sync("acme", lim, 40, T0).admitted
    d3 = s.charge_sync("acme", lim, 40, T0 + 1)  # 80 + 40 > 100
    assert not d3.admitted and d3.refused == (0, "tokens") and not d3.too_large
    assert d3.windows[0].tokens == 80  # a refusal charges nothing
    assert s.charge_sync("acme", lim, 20, T0 + 1).admitted  # exactly 100
    d5 = s.charge_sync("acme", lim, 0, T0 + 2)
    assert not d5.admitted and d5.refused == (0, "requests")
    # another tenant is counted apart
    assert s.charge_sync("globex", lim, 100, T0).admitted


def test_an_estimate_over_a_tokens_limit_is_too_large_even_in_an_empty_window():
    d = MemoryStore().charge_sync("acme", limits(tpm=100, tpd=1000), 101, T0)
    assert not d.admitted and d.too_large and d.refused == (0, "tokens")


def test_the_day_window_refuses_when_the_minute_has_room_and_minutes_roll_over():
    s = MemoryStore()
    lim = limits(rpm=2, rpd=3)
    assert s.charge_sync("acme", lim, 0, T0).admitted
    assert s.charge_sync("acme", lim, 0, T0).admitted
    assert s.charge_sync("acme", lim, 0, T0).refused == (0, "requests")
    nxt = T0 + 40  # the next minute, the same day
    d = s.charge_sync("acme", lim, 0, nxt)
    assert d.admitted and d.windows[0].requests == 1 and d.windows[1].requests == 3
    assert s.charge_sync("acme", lim, 0, nxt).refused == (1, "requests")


def test_reconciliation_is_exact_to_the_token_and_keeps_the_peak():
    s = MemoryStore()
    lim = limits(tpm=1000, tpd=5000)
    d = s.charge_sync("acme", lim, 300, T0)
    s.adjust_sync("acme", d.indexes, 42 - 300)  # it used 42
    m, day = s.read_sync("acme", T0)
    assert (m.tokens, m.peak, day.tokens, day.peak) == (42, 300, 42, 300)
    d2 = s.charge_sync("acme", lim, 100, T0)
    s.adjust_sync("acme", d2.indexes, 250 - 100)  # it used more than estimated
    m, _ = s.read_sync("acme", T0)
    assert (m.tokens, m.peak) == (292, 300)
    # the refund is admitted against at once: 1000 - 292 = 708 fit, 709 do not
    assert not s.charge_sync("acme", lim, 709, T0).admitted
    assert s.charge_sync("acme", lim, 708, T0).admitted


def test_a_reconciliation_after_its_window_ended_leaves_the_new_window_alone():
    s = MemoryStore()
    lim = limits(tpm=1000, tpd=5000)
    d = s.charge_sync("acme", lim, 300, T0)
    nxt = T0 + 45
    s.charge_sync("acme", lim, 10, nxt)  # the new minute starts; the slot now holds it
    s.adjust_sync("acme", d.indexes, -250)
    m, day = s.read_sync("acme", nxt)
    assert m.tokens == 10  # the new minute is untouched
    assert day.tokens == 310 - 250  # the day the request was charged in is still current
    assert window_indexes(nxt)[1] == d.indexes[1]


def _worker(directory: str, n: int, tokens: int, out) -> None:
    s = MemoryStore(directory)
    lim = limits(tpm=10_000_000, tpd=1000)
    admitted = sum(1 for _ in range(n) if s.charge_sync("acme", lim, tokens, T0).admitted)
    out.put(admitted)


def test_worker_processes_sharing_the_file_share_one_exact_budget(tmp_path):
    """4 processes each try 200 requests of 7 tokens against 1000 tokens a day: exactly 142 are admitted in
    all (1000 // 7), not 142 per process."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), 200, 7, out)) for _ in range(4)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(counts) == 1000 // 7
    _, day = MemoryStore(tmp_path).read_sync("acme", T0)
    assert (day.requests, day.tokens) == (142, 994)
