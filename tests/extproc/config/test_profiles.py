"""`spec.schedulingProfiles` and routes naming them: compiled into ProfileRefs, errors with file:line and paths."""

from __future__ import annotations

import pytest

from extproc.config.loader import load_text
from extproc.config.snapshot import PluginRef, ProfileRef
from extproc.scheduling.max_score_picker import MaxScorePickerParameters
from tests.extproc.config.test_plugins import issues, line

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: profiles}
spec:
  backends:
    - name: pool
      endpoints: [{address: "127.0.0.1:9001", labels: {gpu: a100}}, "127.0.0.1:9002"]
      models: [m]
  plugins:
    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}
    - {type: in-flight-scorer}
    - {name: best, type: max-score-picker, parameters: {fallbacks: 1}}
    - {name: spread, type: weighted-random-picker}
    - {name: busy, type: least-in-flight}
"""


def config(profiles: str, route_plugins: str = "[p]") -> str:
    return (HEAD + "  schedulingProfiles:\n" + profiles +
            f"  routes:\n    - {{path: /v1/, match: prefix, kind: openai, targets: [pool], plugins: {route_plugins}}}\n")


# --- valid profiles --------------------------------------------------------------------------------


def test_a_profile_compiles_its_plugins_by_slot_with_weights():
    snap = load_text(config("    - name: p\n      explain: true\n      plugins:\n        - pluginRef: a100\n"
                            "        - {pluginRef: in-flight-scorer, weight: 2.5}\n        - pluginRef: best\n"))
    prof = snap.routes["v1"].picker
    assert isinstance(prof, ProfileRef) and prof is snap.profiles["p"]
    assert prof.name == "p" and prof.explain is True and prof.implicit is False
    assert prof.filters == (snap.plugins["a100"],)
    assert prof.scorers == ((snap.plugins["in-flight-scorer"], 2.5),)
    assert prof.picker is snap.plugins["best"]


def test_plugin_name_defaults_to_its_type():
    snap = load_text(config("    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n"))
    ref = snap.plugins["in-flight-scorer"]
    assert (ref.name, ref.type, ref.slot) == ("in-flight-scorer", "in-flight-scorer", "scorer")


def test_weight_defaults_to_one_and_the_picker_to_max_score():
    snap = load_text(config("    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n"))
    prof = snap.profiles["p"]
    assert prof.scorers[0][1] == 1.0
    assert prof.picker == PluginRef("max-score-picker", "max-score-picker", "picker", MaxScorePickerParameters())


def test_a_declared_max_score_picker_is_the_default_picker():
    text = config("    - name: p\n      plugins: [{pluginRef: a100}]\n").replace(
        "    - {name: best, type: max-score-picker, parameters: {fallbacks: 1}}\n",
        "    - {type: max-score-picker, parameters: {fallbacks: 1}}\n")
    snap = load_text(text)
    assert snap.profiles["p"].picker is snap.plugins["max-score-picker"]
    assert snap.profiles["p"].picker.params.fallbacks == 1


def test_a_profile_with_no_filter_and_no_scorer_is_fine():
    snap = load_text(config("    - name: p\n      plugins: [{pluginRef: spread}]\n    - name: q\n"))
    assert snap.profiles["p"].filters == () and snap.profiles["p"].scorers == ()
    assert snap.profiles["p"].picker is snap.plugins["spread"]
    assert snap.profiles["q"].picker.type == "max-score-picker" and snap.profiles["q"].refs == (
        snap.profiles["q"].picker,)


def test_filters_and_scorers_may_interleave_filters_keep_their_order():
    text = HEAD.replace("  plugins:\n", "  plugins:\n    - {name: eu, type: label-filter, parameters: "
                        "{matchLabels: {zone: eu}}}\n") + (
        "  schedulingProfiles:\n    - name: p\n      plugins: [{pluginRef: eu}, {pluginRef: in-flight-scorer}, "
        "{pluginRef: a100}]\n  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [pool], "
        "plugins: [p]}\n")
    prof = load_text(text).profiles["p"]
    assert [f.name for f in prof.filters] == ["eu", "a100"]


def test_a_scoring_picker_named_alone_on_a_route_runs_as_its_own_profile():
    snap = load_text(config("    - name: p\n", "[spread]"))
    ref = snap.routes["v1"].picker
    assert isinstance(ref, ProfileRef) and ref.implicit and ref.name == "spread"
    assert ref.picker is snap.plugins["spread"] and ref.filters == () and ref.scorers == ()
    assert snap.profiles["spread"] is ref


def test_a_standalone_picker_on_a_route_is_kept_as_it_is():
    snap = load_text(config("    - name: p\n", "[busy]"))
    assert snap.routes["v1"].picker is snap.plugins["busy"] and "busy" not in snap.profiles


def test_declared_profiles_are_kept_when_no_route_uses_them():
    snap = load_text(config("    - name: p\n", "[]"))
    assert list(snap.profiles) == ["p"] and snap.routes["v1"].picker is None


# --- errors ----------------------------------------------------------------------------------------


def test_unknown_plugin_ref():
    text = config("    - name: p\n      plugins:\n        - {pluginRef: a100}\n        - {pluginRef: ghost}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'ghost')}: spec.schedulingProfiles[0].plugins[1].pluginRef: no "
                            "plugin named 'ghost' in spec.plugins (declared: a100, in-flight-scorer, best, spread, "
                            "busy)"]


def test_a_weight_on_a_filter_or_picker():
    text = config("    - name: p\n      plugins:\n        - {pluginRef: a100, weight: 2}\n"
                  "        - {pluginRef: best, weight: 1}\n")
    assert issues(text) == [
        f"cfg.yaml:{line(text, 'a100, weight')}: spec.schedulingProfiles[0].plugins[0].weight: only scorers have a "
        "weight; 'a100' is a filter (label-filter)",
        f"cfg.yaml:{line(text, 'best, weight')}: spec.schedulingProfiles[0].plugins[1].weight: only scorers have a "
        "weight; 'best' is a picker (max-score-picker)"]


@pytest.mark.parametrize("weight", ["0", "-1"])
def test_a_weight_must_be_positive(weight):
    text = config(f"    - name: p\n      plugins:\n        - {{pluginRef: in-flight-scorer, weight: {weight}}}\n")
    (found,) = issues(text)
    assert found == (f"cfg.yaml:{line(text, 'weight:')}: spec.schedulingProfiles[0].plugins[0].weight: Input should "
                     "be greater than 0")


def test_two_pickers():
    text = config("    - name: p\n      plugins:\n        - {pluginRef: best}\n        - {pluginRef: spread}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'pluginRef: spread')}: spec.schedulingProfiles[0].plugins[1]."
                            "pluginRef: profile already has picker 'best'; a profile has one picker"]
    text = config("    - name: p\n      plugins:\n        - {pluginRef: a100}\n        - {pluginRef: best}\n"
                  "        - {pluginRef: spread}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'pluginRef: spread')}: spec.schedulingProfiles[0].plugins[2]."
                            "pluginRef: profile already has picker 'best'; a profile has one picker"]


def test_a_picker_may_come_anywhere_in_the_list():
    # GIE accepts the picker anywhere; llm-d's sample configs list it before the scorers
    first = load_text(config("    - name: p\n      plugins:\n        - {pluginRef: best}\n        - {pluginRef: a100}\n"
                             "        - {pluginRef: in-flight-scorer, weight: 2}\n"))
    middle = load_text(config("    - name: p\n      plugins:\n        - {pluginRef: a100}\n        - {pluginRef: best}\n"
                              "        - {pluginRef: in-flight-scorer, weight: 2}\n"))
    for snap in (first, middle):
        prof = snap.profiles["p"]
        assert prof.picker is snap.plugins["best"]
        assert prof.filters == (snap.plugins["a100"],)
        assert prof.scorers == ((snap.plugins["in-flight-scorer"], 2.0),)
        assert prof.refs[-1] is snap.plugins["best"]  # it still runs last
    # still exactly one, wherever the second one is
    text = config("    - name: p\n      plugins:\n        - {pluginRef: best}\n        - {pluginRef: a100}\n"
                  "        - {pluginRef: spread}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'pluginRef: spread')}: spec.schedulingProfiles[0].plugins[2]."
                            "pluginRef: profile already has picker 'best'; a profile has one picker"]


def test_a_standalone_picker_cannot_be_a_profiles_picker():
    text = config("    - name: p\n      plugins:\n        - {pluginRef: busy}\n")
    (found,) = issues(text)
    assert found.startswith(f"cfg.yaml:{line(text, 'pluginRef: busy')}: spec.schedulingProfiles[0].plugins[0]."
                            "pluginRef: 'busy' (least-in-flight) orders endpoints by itself")


def test_a_plugin_listed_twice_in_a_profile():
    text = config("    - name: p\n      plugins:\n        - {pluginRef: in-flight-scorer}\n"
                  "        - {pluginRef: in-flight-scorer, weight: 2}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'weight: 2')}: spec.schedulingProfiles[0].plugins[1].pluginRef: "
                            "plugin 'in-flight-scorer' is already in this profile"]


def test_a_profile_name_colliding_with_a_plugin_name():
    text = config("    - name: spread\n", "[spread]")
    assert issues(text) == [f"cfg.yaml:{line(text, '- name: spread')}: spec.schedulingProfiles[0].name: profile name "
                            "'spread' is also a plugin's name in spec.plugins; routes refer to both by name: rename one"]


def test_duplicate_profile_names():
    text = config("    - name: p\n    - name: p\n")
    assert issues(text) == [f"cfg.yaml:{line(text, '- name: p', 2)}: spec.schedulingProfiles[1].name: duplicate "
                            "scheduling profile name 'p'"]


def test_profile_name_must_be_a_dns_label():
    text = config("    - name: Default\n")
    found = issues(text)
    assert found[0].startswith(f"cfg.yaml:{line(text, 'Default')}: spec.schedulingProfiles[0].name: String should")


def test_unknown_profile_field():
    text = config("    - name: p\n      picker: best\n")
    found = issues(text)
    assert found[0] == (f"cfg.yaml:{line(text, 'picker: best')}: spec.schedulingProfiles[0].picker: unknown field "
                        "(allowed: name, plugins, explain)")


def test_duplicate_default_plugin_names():
    text = HEAD.replace("    - {type: in-flight-scorer}\n", "    - {type: in-flight-scorer}\n"
                        "    - {type: in-flight-scorer}\n") + (
        "  routes:\n    - {path: /v1/, match: prefix, kind: openai, targets: [pool]}\n")
    assert issues(text) == [f"cfg.yaml:{line(text, 'type: in-flight-scorer', 1)}: spec.plugins[2].type: duplicate "
                            "plugin name 'in-flight-scorer' (a plugin without a name is named after its type: set "
                            "distinct names)"]


# --- routes naming profiles ------------------------------------------------------------------------


def test_a_route_naming_a_profile_and_a_picker():
    text = config("    - name: p\n", "[p, busy]")
    assert issues(text) == [f"cfg.yaml:{line(text, '[p, busy]')}: spec.routes[0].plugins[1]: route already has "
                            "scheduling profile 'p'; a route names one scheduling profile or one picker"]


def test_a_route_naming_two_profiles():
    text = config("    - name: p\n    - name: q\n", "[p, q]")
    (found,) = issues(text)
    assert "spec.routes[0].plugins[1]: route already has scheduling profile 'p'" in found


def test_a_route_naming_a_filter_or_scorer_directly():
    text = config("    - name: p\n", "[in-flight-scorer]")
    assert issues(text) == [f"cfg.yaml:{line(text, '[in-flight-scorer]')}: spec.routes[0].plugins[0]: "
                            "'in-flight-scorer' is a scorer: list it in a spec.schedulingProfiles entry and name that "
                            "profile here"]


def test_a_route_naming_an_unknown_profile_lists_both_kinds():
    text = config("    - name: p\n", "[ghost]")
    assert issues(text) == [f"cfg.yaml:{line(text, '[ghost]')}: spec.routes[0].plugins[0]: no plugin or scheduling "
                            "profile named 'ghost' (plugins: a100, in-flight-scorer, best, spread, busy; "
                            "schedulingProfiles: p)"]


def test_every_profile_problem_is_reported_at_once():
    text = config("    - name: p\n      plugins: [{pluginRef: ghost}]\n    - name: best\n"
                  "    - name: q\n      plugins: [{pluginRef: a100, weight: 3}]\n")
    found = issues(text)
    assert any("spec.schedulingProfiles[0].plugins[0].pluginRef: no plugin named 'ghost'" in f for f in found)
    assert any("spec.schedulingProfiles[1].name: profile name 'best'" in f for f in found)
    assert any("spec.schedulingProfiles[2].plugins[0].weight: only scorers" in f for f in found)


def test_adapterctl_validate_lists_profiles(write_config, capsys):
    from extproc.cli import main

    path = write_config(config("    - name: p\n      explain: true\n      plugins: [{pluginRef: a100}, "
                               "{pluginRef: in-flight-scorer, weight: 2}]\n"))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "route v1: /v1/* -> pool (openai, failureMode=closed, profile=p)" in out
    assert ("profile p: filters a100 -> scorers in-flight-scorer*2 -> picker max-score-picker (explain)" in out)
    assert "plugin a100: label-filter (filter) {'matchLabels': {'gpu': 'a100'}}" in out
    assert "backend pool: openai over http at 127.0.0.1:9001{gpu=a100}, 127.0.0.1:9002" in out
