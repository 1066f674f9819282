"""The scheduling framework (extproc/scheduling/profile.py): filters in order, normalised weighted scorers,
one picker; refusals, failing plugins, explanations and the per-plugin timing metrics."""

from __future__ import annotations

import logging
import math

import orjson
import pytest

from extproc.scheduling import NoCapacity
from hypothesis import example, given, settings
from hypothesis import strategies as st

from extproc.scheduling.profile import SchedulingProfile, _add_bounded, normalise
from tests.extproc.scheduling.conftest import E1, E2, E3, E4, POOL, build, gateway

# --- normalise -------------------------------------------------------------------------------------


def test_min_max_scales_over_the_candidates():
    assert normalise({E1: 10, E2: 20, E3: 30, E4: 15}, POOL, bounded=False) == {E1: 0.0, E2: 0.5, E3: 1.0, E4: 0.25}


def test_min_max_uses_only_the_candidates_values():
    # E4's 1000 is not a candidate's: it neither stretches the range nor appears
    assert normalise({E1: 1, E2: 3, E4: 1000}, (E1, E2), bounded=False) == {E1: 0.0, E2: 1.0}


def test_min_max_negative_raw_scores():
    assert normalise({E1: -4, E2: -2, E3: 0}, (E1, E2, E3), bounded=False) == {E1: 0.0, E2: 0.5, E3: 1.0}


def test_all_equal_scores_are_one_for_everyone():
    assert normalise({E1: 7, E2: 7, E3: 7}, (E1, E2, E3), bounded=False) == {E1: 1.0, E2: 1.0, E3: 1.0}
    assert normalise({E1: 0, E2: 0}, (E1, E2), bounded=False) == {E1: 1.0, E2: 1.0}


def test_a_missing_endpoint_scores_zero():
    assert normalise({E1: 5, E2: 10}, (E1, E2, E3), bounded=False) == {E1: 0.0, E2: 1.0, E3: 0.0}
    # all present ones equal: they get 1.0, the missing one still 0
    assert normalise({E1: 5}, (E1, E2), bounded=False) == {E1: 1.0, E2: 0.0}
    assert normalise({}, (E1, E2), bounded=False) == {E1: 0.0, E2: 0.0}


def test_non_finite_or_non_numeric_scores_count_as_missing():
    raw = {E1: math.nan, E2: 2.0, E3: math.inf, E4: "x"}
    assert normalise(raw, POOL, bounded=False) == {E1: 0.0, E2: 1.0, E3: 0.0, E4: 0.0}
    assert normalise({E1: math.nan, E2: 0.4}, (E1, E2), bounded=True) == {E1: 0.0, E2: 0.4}


def test_bounded_scores_are_only_clamped():
    # min-max would make these 0, 0.5, 1; a bounded scorer keeps its own scale
    assert normalise({E1: 0.2, E2: 0.4, E3: 0.6}, (E1, E2, E3), bounded=True) == {E1: 0.2, E2: 0.4, E3: 0.6}
    assert normalise({E1: -0.5, E2: 1.5, E3: 0.5}, (E1, E2, E3, E4), bounded=True) == {
        E1: 0.0, E2: 1.0, E3: 0.5, E4: 0.0}
    # all equal stays as it is (not 1.0)
    assert normalise({E1: 0.3, E2: 0.3}, (E1, E2), bounded=True) == {E1: 0.3, E2: 0.3}


_SCORE = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.just("x"))


@settings(max_examples=300, deadline=None)
@given(raw=st.dictionaries(st.sampled_from(POOL + ("127.0.0.1:9999",)), _SCORE), weight=st.floats(0, 10))
@example(raw={E1: 1.0, E2: 1.5, E3: 0.5, E4: math.inf}, weight=2.0)  # the clamp's edges, every run
@example(raw={E1: 0.0, E2: -0.5, E3: math.nan, E4: 0.999}, weight=1.0)
def test_the_bounded_fast_path_adds_what_normalise_gives(raw, weight):
    """The framework's fast path for bounded scorers (explanation off) adds weight * normalise(bounded)
    into the totals, or reports that it cannot (a non-float value) and leaves the totals as they were."""
    totals = dict.fromkeys(POOL, 1.0)
    added = _add_bounded(totals, raw, POOL, weight)
    norm = normalise(raw, POOL, bounded=True)
    if all(raw.get(e) is None or raw[e].__class__ is float for e in POOL):  # non-candidates are not read
        assert added and totals == pytest.approx({e: 1.0 + weight * norm[e] for e in POOL})
    else:
        assert not added and totals == dict.fromkeys(POOL, 1.0)


# --- weights and totals ----------------------------------------------------------------------------

TWO_SCORERS = """\
    - {name: queue, type: fixed-scorer, parameters: {scores: {"127.0.0.1:9001": 0, "127.0.0.1:9002": 10, "127.0.0.1:9003": 5, "127.0.0.1:9004": 10}}}
    - {name: kv, type: bounded-fixed-scorer, parameters: {scores: {"127.0.0.1:9001": 0.9, "127.0.0.1:9002": 0.1, "127.0.0.1:9003": 0.5}}}
    - {name: best, type: max-score-picker, parameters: {fallbacks: 3}}
"""


def test_totals_are_the_weighted_sum_of_normalised_scores(test_plugins):
    b = build(gateway(TWO_SCORERS, "    - name: p\n      explain: true\n      plugins:\n"
                      "        - {pluginRef: queue, weight: 2}\n        - {pluginRef: kv, weight: 3}\n"
                      "        - {pluginRef: best}\n"))
    st = b.state()
    picks = b.decide(st)
    # queue (min-max): E1 0, E2 1, E3 0.5, E4 1; kv (bounded): 0.9, 0.1, 0.5, missing 0
    expected = {E1: 2 * 0 + 3 * 0.9, E2: 2 * 1 + 3 * 0.1, E3: 2 * 0.5 + 3 * 0.5, E4: 2 * 1 + 3 * 0}
    assert st.attrs["decision"]["total"] == pytest.approx(expected)
    assert picks == (E1, E3, E2, E4)  # 2.7, 2.5, 2.3, 2.0


def test_weights_change_the_pick(test_plugins):
    b = build(gateway(TWO_SCORERS, "    - name: p\n      plugins:\n"
                      "        - {pluginRef: queue, weight: 10}\n        - {pluginRef: kv}\n"
                      "        - {pluginRef: best}\n"))
    # queue dominates: E2 and E4 (1.0 * 10) first; E2 ahead with kv's 0.1 over E4's missing 0
    assert b.decide() == (E2, E4, E3, E1)


def test_weight_defaults_to_one(test_plugins):
    b = build(gateway(TWO_SCORERS, "    - name: p\n      explain: true\n      plugins:\n"
                      "        - {pluginRef: queue}\n        - {pluginRef: kv}\n        - {pluginRef: best}\n"))
    st = b.state()
    b.decide(st)
    assert st.attrs["decision"]["total"] == pytest.approx({E1: 0.9, E2: 1.1, E3: 1.0, E4: 1.0})
    assert [s["weight"] for s in st.attrs["decision"]["scorers"]] == [1.0, 1.0]


def test_the_default_picker_is_max_score_with_two_fallbacks(test_plugins):
    b = build(gateway(TWO_SCORERS, "    - name: p\n      plugins: [{pluginRef: kv}]\n"))
    assert b.route.picker.picker.type == "max-score-picker"
    assert b.decide() == (E1, E3, E2)  # kv: 0.9, 0.5, 0.1, then E4 (0) is left out: 1 + 2 named


# --- filters ---------------------------------------------------------------------------------------


def test_filters_run_in_order_each_on_what_the_previous_kept(test_plugins):
    plugins = ("    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}\n"
               "    - {name: keep, type: keep-filter, parameters: {keep: ['127.0.0.1:9002', '127.0.0.1:9003', "
               "'127.0.0.1:9001', '10.9.9.9:1']}}\n")
    b = build(gateway(plugins, "    - name: p\n      explain: true\n      plugins: [{pluginRef: a100}, "
                      "{pluginRef: keep}]\n"))
    st = b.state()
    picks = b.decide(st)
    keep = b.runtime.plugin(b.snap.plugins["keep"])
    assert keep.seen == [(E1, E2)]  # the label filter ran first
    # what a filter returns is intersected with its input, in the input's order: no E3, no stranger
    assert [f["kept"] for f in st.attrs["decision"]["filters"]] == [[E1, E2], [E1, E2]]
    assert sorted(picks) == [E1, E2]


def test_filters_leaving_nothing_raise_no_capacity_naming_the_filter(test_plugins):
    plugins = ("    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}\n"
               "    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}\n")
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: a100}, {pluginRef: h100}]\n"))
    with pytest.raises(NoCapacity) as e:
        b.decide()
    assert (e.value.profile, e.value.backend, e.value.filter, e.value.candidates) == ("p", "pool", "h100", 4)
    assert e.value.sheddable is False


@pytest.mark.parametrize("priority, sheddable", [(-1, True), (-100, True), (0, False), (5, False), (None, False)])
def test_a_request_is_sheddable_when_its_priority_is_negative(test_plugins, priority, sheddable):
    plugins = "    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}\n"
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: h100}]\n"))
    with pytest.raises(NoCapacity) as e:
        b.decide(b.state(priority=priority))
    assert e.value.sheddable is sheddable and e.value.priority == priority


def test_without_a_parsed_request_nothing_is_sheddable(test_plugins):
    plugins = "    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}\n"
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: h100}]\n"))
    with pytest.raises(NoCapacity) as e:
        b.decide(b.state(request=False))
    assert e.value.sheddable is False


def test_a_profile_without_filters_and_scorers_spreads_over_every_endpoint(test_plugins):
    b = build(gateway("    - {name: any, type: max-score-picker, parameters: {fallbacks: 0}}\n",
                      "    - name: p\n      plugins: [{pluginRef: any}]\n"))
    firsts = {b.decide()[0] for _ in range(200)}
    assert firsts == set(POOL)  # all ties, broken at random


# --- failing plugins -------------------------------------------------------------------------------

SCORERS_WITH_A_FAILING_ONE = """\
    - {name: broken, type: failing-scorer}
    - {name: kv, type: bounded-fixed-scorer, parameters: {scores: {"127.0.0.1:9003": 0.8, "127.0.0.1:9001": 0.2}}}
    - {name: best, type: max-score-picker, parameters: {fallbacks: 1}}
"""


def failures(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "extproc.scheduling.profile" and "failed" in r.getMessage()]


def test_a_failing_scorer_adds_zero_is_logged_once_per_reload_and_counted(test_plugins, caplog):
    profile = ("    - name: p\n      explain: true\n      plugins:\n        - {pluginRef: broken, weight: 5}\n"
               "        - {pluginRef: kv}\n        - {pluginRef: best}\n")
    text = gateway(SCORERS_WITH_A_FAILING_ONE, profile)
    b = build(text)
    caplog.set_level(logging.ERROR, logger="extproc.scheduling.profile")
    st = b.state()
    assert b.decide(st) == (E3, E1)  # decided by kv alone
    assert st.attrs["decision"]["total"] == {E1: 0.2, E2: 0.0, E3: 0.8, E4: 0.0}
    broken = st.attrs["decision"]["scorers"][0]
    assert broken["plugin"] == "broken" and broken["failed"] is True and broken["raw"] is None
    b.decide()
    b.decide()
    (record,) = failures(caplog)
    assert "scorer 'broken' failed" in record.getMessage() and record.exc_info[1].args == ("boom",)
    s = b.samples()
    assert s.value("adapter_processor_scheduler_plugin_errors_total", profile="p", plugin="broken", slot="scorer") == 3
    assert s.value("adapter_processor_scheduler_plugin_errors_total", 0.0, profile="p", plugin="kv",
                   slot="scorer") == 0
    b.reload(text.replace("name: scheduling", "name: scheduling2"))  # a reload: logged once more
    b.decide()
    b.decide()
    assert len(failures(caplog)) == 2
    assert b.samples().value("adapter_processor_scheduler_plugin_errors_total", profile="p", plugin="broken",
                             slot="scorer") == 5


def test_a_failing_filter_keeps_every_candidate(test_plugins, caplog):
    plugins = ("    - {name: broken, type: failing-filter}\n"
               "    - {name: eu, type: label-filter, parameters: {matchLabels: {zone: eu}}}\n")
    b = build(gateway(plugins, "    - name: p\n      explain: true\n      plugins: [{pluginRef: broken}, "
                      "{pluginRef: eu}]\n"))
    caplog.set_level(logging.ERROR, logger="extproc.scheduling.profile")
    st = b.state()
    picks = b.decide(st)
    assert [f["kept"] for f in st.attrs["decision"]["filters"]] == [list(POOL), [E1, E3]]
    assert sorted(picks) == [E1, E3]
    assert b.samples().value("adapter_processor_scheduler_plugin_errors_total", profile="p", plugin="broken",
                             slot="filter") == 1
    assert len(failures(caplog)) == 1


def test_a_failing_picker_leaves_the_filtered_candidates_in_order(test_plugins, caplog):
    plugins = ("    - {name: eu, type: label-filter, parameters: {matchLabels: {zone: eu}}}\n"
               "    - {name: broken, type: failing-picker}\n")
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: eu}, {pluginRef: broken}]\n"))
    caplog.set_level(logging.ERROR, logger="extproc.scheduling.profile")
    assert b.decide() == (E1, E3)
    assert b.samples().value("adapter_processor_scheduler_plugin_errors_total", profile="p", plugin="broken",
                             slot="picker") == 1


# --- explanation -----------------------------------------------------------------------------------


def decision_lines(caplog) -> list[dict]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "extproc.scheduling.decision"]


def test_explanation_lists_candidates_filters_scores_total_and_pick(test_plugins, caplog):
    plugins = ("    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}\n" + TWO_SCORERS)
    b = build(gateway(plugins, "    - name: p\n      explain: true\n      plugins:\n        - {pluginRef: a100}\n"
                      "        - {pluginRef: queue, weight: 2}\n        - {pluginRef: kv}\n"
                      "        - {pluginRef: best}\n"))
    caplog.set_level(logging.INFO, logger="extproc.scheduling.decision")
    st = b.state(rid="req-42")
    st.token = "0-7"
    picks = b.decide(st)
    d = st.attrs["decision"]
    assert d == {
        "request_id": "req-42", "token": "0-7", "route": "v1", "backend": "pool", "model": "m", "profile": "p",
        "candidates": [E1, E2, E3, E4],
        "filters": [{"plugin": "a100", "kept": [E1, E2]}],
        "scorers": [
            {"plugin": "queue", "weight": 2.0, "bounded": False, "failed": False,
             "raw": {E1: 0, E2: 10}, "normalised": {E1: 0.0, E2: 1.0}},
            {"plugin": "kv", "weight": 1.0, "bounded": True, "failed": False,
             "raw": {E1: 0.9, E2: 0.1}, "normalised": {E1: 0.9, E2: 0.1}},
        ],
        "total": {E1: 0.9, E2: 2.1},
        "pick": E2, "fallbacks": [E1],
    }
    assert picks == (E2, E1)
    assert decision_lines(caplog) == [d]  # one JSON line per decision, the same content


def test_explanation_of_a_refusal(test_plugins, caplog):
    plugins = "    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}\n"
    b = build(gateway(plugins, "    - name: p\n      explain: true\n      plugins: [{pluginRef: h100}]\n"))
    caplog.set_level(logging.INFO, logger="extproc.scheduling.decision")
    st = b.state(priority=-1)
    with pytest.raises(NoCapacity):
        b.decide(st)
    d = st.attrs["decision"]
    assert d["filters"] == [{"plugin": "h100", "kept": []}] and d["pick"] is None and d["refused"] == "overloaded"
    assert d["scorers"] == [] and "total" not in d
    assert decision_lines(caplog) == [d]


def test_no_explanation_unless_asked(test_plugins, caplog):
    b = build(gateway(TWO_SCORERS, "    - name: p\n      plugins: [{pluginRef: kv}]\n"))
    caplog.set_level(logging.INFO, logger="extproc.scheduling.decision")
    st = b.state()
    b.decide(st)
    assert "decision" not in st.attrs and decision_lines(caplog) == []


def test_explain_enables_its_logger_whatever_the_workers_level():
    logger = logging.getLogger("extproc.scheduling.decision")
    saved = logger.level
    try:
        logger.setLevel(logging.WARNING)
        build(gateway("    - {type: in-flight-scorer}\n", "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n"))
        assert logger.level == logging.WARNING  # without explain: left alone
        build(gateway("    - {type: in-flight-scorer}\n",
                      "    - name: p\n      explain: true\n      plugins: [{pluginRef: in-flight-scorer}]\n"))
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(saved)


# --- timing metrics --------------------------------------------------------------------------------


def test_every_plugin_call_and_decision_is_timed_by_profile_plugin_and_slot(test_plugins):
    plugins = ("    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}\n" + TWO_SCORERS)
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: a100}, {pluginRef: queue}, "
                      "{pluginRef: kv}, {pluginRef: best}]\n"))
    for _ in range(3):
        b.decide()
    s = b.samples()
    for plugin, slot in (("a100", "filter"), ("queue", "scorer"), ("kv", "scorer"), ("best", "picker")):
        assert s.value("adapter_processor_scheduler_plugin_duration_seconds_count", profile="p", plugin=plugin,
                       slot=slot) == 3
        assert s.value("adapter_processor_scheduler_plugin_duration_seconds_sum", profile="p", plugin=plugin,
                       slot=slot) > 0
    assert s.value("adapter_processor_scheduler_decision_duration_seconds_count", profile="p") == 3
    assert s.series("adapter_processor_scheduler_plugin_duration_seconds_count").keys() == {
        (("plugin", n), ("profile", "p"), ("slot", sl))
        for n, sl in (("a100", "filter"), ("queue", "scorer"), ("kv", "scorer"), ("best", "picker"))}
    # the decision includes its plugins: its sum is at least theirs
    plugin_sum = s.total("adapter_processor_scheduler_plugin_duration_seconds_sum", profile="p")
    assert s.value("adapter_processor_scheduler_decision_duration_seconds_sum", profile="p") >= plugin_sum


def test_a_refused_decision_is_timed_too(test_plugins):
    plugins = "    - {name: h100, type: label-filter, parameters: {matchLabels: {gpu: h100}}}\n"
    b = build(gateway(plugins, "    - name: p\n      plugins: [{pluginRef: h100}]\n"))
    with pytest.raises(NoCapacity):
        b.decide()
    s = b.samples()
    assert s.value("adapter_processor_scheduler_decision_duration_seconds_count", profile="p") == 1
    assert s.value("adapter_processor_scheduler_plugin_duration_seconds_count", profile="p", plugin="h100",
                   slot="filter") == 1


def test_without_a_metrics_sink_decisions_still_work(test_plugins):
    from extproc.config.loader import load_text
    from extproc.runtime import Runtime

    snap = load_text(gateway(TWO_SCORERS, "    - name: p\n      plugins: [{pluginRef: kv}, {pluginRef: best}]\n"))
    rt = Runtime()
    rt.install(snap)
    prof = rt.plugin(snap.routes["v1"].picker)
    assert isinstance(prof, SchedulingProfile) and rt.metrics_sink is None
    from extproc.types import RequestState

    st = RequestState(snapshot=snap, route=snap.routes["v1"], started=0.0, runtime=rt)
    backend = snap.backends["pool"]
    assert prof.pick(st, backend, backend.endpoint_ids) == (E1, E3, E2, E4)
