"""The scheduling profile's numeric loop in C (`extproc/scheduling/_score.c`) against its Python reference.

`_score.accumulate` must add exactly what `profile.accumulate_py` adds (and both what `normalise`
gives, times the weight), or decline the same inputs; `_score.rank` must order the candidates as
`max_score_picker.pick_ranked_py` does from the same draws, which is `MaxScorePicker.pick`'s order on
the dict of totals. On random fleets (random raw scores per scorer, weights, bounded or not, then a
ranking with a seeded generator) both paths give the same totals within 1e-12 and the same picks.
`_score.predict` (predicted-ttft-scorer's per-candidate formula) gives exactly `predict_py`'s scores
and features.
And the recorded decisions replay the same with the Python references in place of the C code."""

from __future__ import annotations

import math
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import extproc.scheduling.max_score_picker as msp
import extproc.scheduling.profile as prof
from extproc.scheduling.profile import accumulate_py, normalise

native = prof._native
needs_native = pytest.mark.skipif(native is None, reason="the C accelerator extproc.scheduling._score is not built "
                                  "(no C compiler at install): the Python code runs")

EPS = [f"10.0.0.{i}:8000" for i in range(1, 13)]
_PLAIN = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                   st.sampled_from([0.0, 1.0, 0.5, -0.0, 1e-300, 1e300]))
_ANY = st.one_of(_PLAIN, st.just("x"), st.just(True), st.integers(2 ** 1030, 2 ** 1040))


def _fits(v: int) -> bool:
    """An int that float() takes (the reference declines one beyond a double)."""
    try:
        float(v)
    except OverflowError:
        return False
    return True


def test_setup_builds_the_accelerator_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the accelerator cannot be built")
    assert native is not None, "extproc.scheduling._score is missing: run `make setup` (setup.py build_ext)"


def _expected(raw, cands, weight, bounded, start):
    norm = normalise(raw, cands, bounded)
    return [t + weight * norm[e] for t, e in zip(start, cands)]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(n=st.integers(0, 12), data=st.data(), weight=st.floats(0, 100), bounded=st.booleans())
def test_accumulate_py_adds_what_normalise_gives_or_declines(n, data, weight, bounded):
    cands = tuple(EPS[:n])
    raw = data.draw(st.dictionaries(st.sampled_from(EPS), _ANY))
    start = [float(i) / 3 for i in range(n)]
    acc = list(start)
    plain = all(raw.get(e) is None or raw[e].__class__ is float or raw[e].__class__ is int and _fits(raw[e])
                for e in cands)
    ok = accumulate_py(acc, raw, cands, weight, bounded)
    assert ok == plain
    if ok:
        assert acc == pytest.approx(_expected(raw, cands, weight, bounded, start), rel=0, abs=1e-12)
    else:
        assert acc == start


@needs_native
@settings(max_examples=400, deadline=None, derandomize=True)
@given(n=st.integers(0, 70), data=st.data(), weight=st.floats(0, 100), bounded=st.booleans())
def test_accumulate_in_c_equals_the_python_reference(n, data, weight, bounded):
    cands = tuple(f"e{i}" for i in range(n))
    raw = data.draw(st.dictionaries(st.sampled_from(cands) if n else st.just("zz"), _ANY))
    start = [float(i) * 0.25 for i in range(n)]
    a, b = list(start), list(start)
    ok_py = accumulate_py(a, raw, cands, weight, bounded)
    ok_c = native.accumulate(b, raw, cands, weight, bounded)
    assert ok_c == ok_py
    assert b == a  # bit for bit (same IEEE operations in the same order)


@needs_native
def test_accumulate_refuses_bad_arguments_and_declines_a_non_dict():
    with pytest.raises(TypeError):
        native.accumulate((0.0,), {}, ("a",), 1.0, True)
    with pytest.raises(ValueError):
        native.accumulate([0.0, 0.0], {}, ("a",), 1.0, True)
    with pytest.raises(TypeError):
        native.accumulate([0], {}, ("a",), 1.0, True)
    assert native.accumulate([0.0], [("a", 1.0)], ("a",), 1.0, True) is False


def _rank_dict(cands, totals, seed, k):
    """MaxScorePicker.pick's own order, on the dict of totals."""
    rnd = random.Random(seed).random
    scored = dict(zip(cands, totals))
    return tuple(sorted(scored, key=lambda e: (-scored[e], rnd()))[:k])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(n=st.integers(0, 70), data=st.data(), seed=st.integers(0, 2 ** 32), k=st.integers(0, 18))
def test_rank_equals_the_pickers_sort_on_the_dict(n, data, seed, k):
    cands = tuple(f"e{i}" for i in range(n))
    # few distinct totals so ties are common: the draws must break them the same way
    totals = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.5, 2.5000000000000004, -0.0, 13.0]), min_size=n,
                                max_size=n))
    want = _rank_dict(cands, totals, seed, k)
    assert msp.pick_ranked_py(cands, totals, random.Random(seed).random, k) == want
    if native is not None:
        r = random.Random(seed)
        assert native.rank(cands, totals, r.random, k) == want
        r2 = random.Random(seed)
        for _ in range(n):  # the C code drew exactly one number per candidate
            r2.random()
        assert r.random() == r2.random()


@needs_native
def test_rank_refuses_bad_arguments_and_passes_a_failing_draw_on():
    with pytest.raises(TypeError):
        native.rank(["a"], [0.0], random.random, 1)
    with pytest.raises(ValueError):
        native.rank(("a",), [0.0, 1.0], random.random, 1)

    def boom():
        raise RuntimeError("draw")

    with pytest.raises(RuntimeError):
        native.rank(("a", "b"), [0.0, 1.0], boom, 1)
    assert native.rank(("a", "b"), [0.0, 1.0], random.random, 0) == ()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(n=st.integers(1, 12), data=st.data(), seed=st.integers(0, 2 ** 32))
def test_random_fleets_give_the_same_totals_and_pick_either_way(n, data, seed):
    """A profile's scorers on a random fleet: totals via C (when built) and via Python, against totals via
    `normalise` on a dict (the framework's explained path); the same picks from the same draws."""
    cands = tuple(EPS[:n])
    scorers = data.draw(st.lists(st.tuples(st.dictionaries(st.sampled_from(cands), _PLAIN),
                                           st.floats(0, 10), st.booleans()), max_size=6))
    want = dict.fromkeys(cands, 0.0)
    py = [0.0] * n
    c = [0.0] * n
    for raw, w, bounded in scorers:
        norm = normalise(raw, cands, bounded)
        for e in cands:
            want[e] += w * norm[e]
        assert accumulate_py(py, raw, cands, w, bounded)
        if native is not None:
            assert native.accumulate(c, raw, cands, w, bounded)
    for got in ([py, c] if native is not None else [py]):
        assert all(abs(g - want[e]) <= 1e-12 for g, e in zip(got, cands))
        assert msp.pick_ranked_py(cands, got, random.Random(seed).random, 3) == _rank_dict(
            cands, [want[e] for e in cands], seed, 3)
    assert all(math.isfinite(v) for v in py)


_POS = st.floats(0.01, 1e5, allow_nan=False)


@needs_native
@settings(max_examples=400, deadline=None, derandomize=True)
@given(n=st.integers(0, 12), data=st.data(), prompt_kb=st.floats(0, 64), request_tokens=st.floats(0, 40000),
       coeffs=st.tuples(st.floats(0, 500), st.floats(0, 500), st.floats(0, 100)), slo=st.floats(1, 1e4))
def test_predicted_ttft_formula_in_c_equals_the_python_reference(n, data, prompt_kb, request_tokens, coeffs, slo):
    from extproc.scheduling.predicted_ttft_scorer import predict_py

    cands = tuple(EPS[:n])
    facts = [(data.draw(st.floats(1, 512)), data.draw(st.floats(0.05, 4)), data.draw(st.none() | _POS))
             for _ in cands]
    loads = {e: (data.draw(st.integers(0, 40)), data.draw(st.integers(0, 10 ** 6)), data.draw(st.integers(0, 10 ** 5)))
             for e in cands}
    match = data.draw(st.dictionaries(st.sampled_from(EPS), st.sampled_from([0.0, 1.0, 0.25]) | st.floats(0, 1)))
    args = (cands, facts, loads, match, prompt_kb, request_tokens, 0.004, *coeffs, slo)
    want = predict_py(*args)
    got = native.predict(*args)
    assert got == want  # the same floats, in the same order
    assert [list(d) for d in got] == [list(d) for d in want]


@needs_native
def test_predict_refuses_bad_arguments():
    with pytest.raises(TypeError):
        native.predict(("a",), [(1.0, 1.0)], {"a": (0, 0, 0)}, {}, 1.0, 1.0, 0.004, 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(KeyError):
        native.predict(("a",), [(1.0, 1.0, None)], {}, {}, 1.0, 1.0, 0.004, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("policy", ["adapter-gateway", "epp-default"])
def test_recorded_decisions_replay_the_same_with_the_python_references(policy, monkeypatch, tmp_path):
    import json

    from tests.extproc.scheduling.test_decision_replay import FIXTURE, replay

    monkeypatch.setattr(prof, "accumulate", accumulate_py)
    monkeypatch.setattr(msp, "_rank", None)
    import extproc.scheduling.predicted_ttft_scorer as pts

    monkeypatch.setattr(pts, "_native", None)
    rec = json.loads(FIXTURE.read_text())
    got = replay(rec["profiles"][policy]["config"], rec["inputs"], False, str(tmp_path))
    assert [d.get("picks") for d in got] == [d.get("picks") for d in rec["profiles"][policy]["decisions"]]
