"""Filter `label-filter`: keeps endpoints whose configured labels include every `matchLabels` pair."""

from __future__ import annotations

import pytest

from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.label_filter import LabelFilter, LabelFilterParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4, POOL, build, gateway


def profile_with(match: str):
    return build(gateway(f"    - {{name: f, type: label-filter, parameters: {{matchLabels: {match}}}}}\n"
                         "    - {type: random-picker, parameters: {fallbacks: 3}}\n",
                         "    - name: p\n      plugins: [{pluginRef: f}, {pluginRef: random-picker}]\n"))


def test_is_a_filter():
    assert LabelFilter.slot == "filter" and isinstance(LabelFilter("f", LabelFilterParameters(matchLabels={"a": "b"}),
                                                                   None), Filter)


@pytest.mark.parametrize("match, kept", [
    ("{gpu: a100}", {E1, E2}),
    ("{gpu: a100, zone: eu}", {E1}),  # every pair must match
    ("{zone: eu}", {E1, E3}),
    ("{gpu: v100, zone: us}", set()),
])
def test_keeps_endpoints_matching_every_label(match, kept):
    b = profile_with(match)
    f = b.runtime.plugin(b.snap.plugins["f"])
    ctx_labels = b.backend.endpoint_labels
    from extproc.scheduling import SchedulingContext

    ctx = SchedulingContext(b.state(), b.backend, None, b.runtime, ctx_labels, "p")
    assert set(f.filter(ctx, POOL)) == kept
    if kept:
        assert set(b.decide()) == kept
    else:
        with pytest.raises(NoCapacity):
            b.decide()


def test_an_endpoint_without_labels_never_matches():
    b = profile_with("{gpu: a100}")
    assert b.backend.endpoint_labels[E4] == {}
    assert E4 not in {e for _ in range(50) for e in b.decide()}


def test_values_are_compared_exactly():
    b = profile_with('{gpu: "A100"}')
    with pytest.raises(NoCapacity):
        b.decide()


def test_match_labels_is_required_and_not_empty():
    from extproc.config.loader import ConfigError, load_text

    for params in ("{}", "{matchLabels: {}}"):
        with pytest.raises(ConfigError) as e:
            load_text(gateway(f"    - {{name: f, type: label-filter, parameters: {params}}}\n",
                              "    - name: p\n      plugins: [{pluginRef: f}]\n"), "c.yaml")
        assert "spec.plugins[0].parameters.matchLabels" in str(e.value)
