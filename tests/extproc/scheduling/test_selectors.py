"""selectors.PerCandidates: a value per (candidate tuple, labels object), computed once, bounded."""

from __future__ import annotations

from extproc.scheduling.selectors import PerCandidates


def test_computes_once_per_candidate_tuple_and_labels_object():
    calls = []

    def compute(labels, cands):
        calls.append(cands)
        return [labels.get(e, {}).get("speed") for e in cands]

    cache = PerCandidates()
    labels = {"a": {"speed": "2"}}
    assert cache.get(labels, ("a", "b"), compute) == ["2", None]
    assert cache.get(labels, ("a", "b"), compute) == ["2", None]
    assert calls == [("a", "b")]
    assert cache.get(labels, ("a",), compute) == ["2"]  # another tuple: computed
    assert len(calls) == 2
    reloaded = {"a": {"speed": "3"}}  # a reload: a new labels object, even if equal keys
    assert cache.get(reloaded, ("a", "b"), compute) == ["3", None]
    assert cache.get(labels, ("a", "b"), compute) == ["2", None]  # back: computed again, not stale
    assert len(calls) == 4


def test_is_bounded_and_clear_forgets():
    n = [0]

    def compute(labels, cands):
        n[0] += 1
        return len(cands)

    cache = PerCandidates(limit=3)
    labels: dict = {}
    for k in range(5):
        cache.get(labels, ("e",) * (k + 1), compute)
    assert len(cache._found) == 3 and n[0] == 5
    cache.get(labels, ("e",) * 5, compute)  # the newest is kept
    assert n[0] == 5
    cache.get(labels, ("e",), compute)  # the oldest went
    assert n[0] == 6
    cache.clear()
    cache.get(labels, ("e",) * 5, compute)
    assert n[0] == 7
