"""Filter `model-version-filter`: the requested version's label constraints (the brief's §2.2 example)."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.model_version_filter import ModelVersionFilter, ModelVersionFilterParameters
from extproc.scheduling.selectors import same_version, split_version, versions_of
from tests.extproc.scheduling.fleet import A185, FLEET, FLEET_HEAD, G0, G1, built, ctx, fleet, plugin, state

# the brief: v2.1 only on TensorRT-8.6 A100 NVLink nodes; v1.9 may also run on a V100 single card
BRIEF = ('{constraints: {"v2.1": {matchLabels: {accelerator: a100, tensorrt: "8.6", nvlink: "true"}}, '
         '"v1.9": {anyOf: [{matchLabels: {accelerator: a100}}, {matchLabels: {accelerator: v100}}]}}}')


def versions(params: str = BRIEF, head: str = FLEET_HEAD):
    return built(f"    - {{name: f, type: model-version-filter, parameters: {params}}}\n"
                 "    - {type: random-picker, parameters: {fallbacks: 4}}\n",
                 "[{pluginRef: f}, {pluginRef: random-picker}]", head)


def kept(b, model: str) -> set[str]:
    return set(plugin(b, "f").filter(ctx(b, state(b, model)), FLEET))


def test_is_a_filter():
    f = ModelVersionFilter("f", ModelVersionFilterParameters(constraints={"v1": {"matchLabels": {}}}), None)
    assert f.slot == "filter" and isinstance(f, Filter)


@pytest.mark.parametrize("model, split", [
    ("llama@v2.1", ("llama", "v2.1")),
    ("llama@2.1-rc1", ("llama", "2.1-rc1")),  # after @ anything goes
    ("llama:2.1", ("llama", "2.1")),
    ("llama:v3", ("llama", "v3")),
    ("org/llama@v2.1:x", ("org/llama", "v2.1:x")),  # the last @ wins over a colon
    ("llama3:8b", ("llama3:8b", None)),  # a tag, not a version
    ("ft:gpt-4o-mini:acme:7p4lURel", ("ft:gpt-4o-mini:acme:7p4lURel", None)),  # OpenAI fine-tune names
    ("llama@", ("llama@", None)), ("@v2", ("@v2", None)), (":2.1", (":2.1", None)),
    ("llama", ("llama", None)), (None, (None, None)),
])
def test_the_version_comes_from_the_model_name(model, split):
    assert split_version(model) == split


def test_versions_compare_without_the_leading_v_and_labels_may_list_several():
    assert same_version("v2.1", "2.1") and same_version("V2.1", "v2.1") and not same_version("v2.1", "v2.10")
    assert not same_version(None, "v2.1") and not same_version("v", "")
    assert versions_of(" v2.1, v1.9 ,") == ("v2.1", "v1.9") and versions_of("") == () and versions_of(None) == ()


def test_the_briefs_worked_example():
    b = versions()
    assert kept(b, "llama@v2.1") == {G0}  # only the TensorRT-8.6 A100 NVLink node
    assert kept(b, "llama:2.1") == {G0}  # the same version, written without the v
    assert kept(b, "llama@v1.9") == {G0, G1, A185}  # A100s and the V100 single card, not the unlabelled node
    assert kept(b, "llama@v3") == set(FLEET)  # a version without a constraint restricts nothing
    for _ in range(20):
        assert b.decide(state(b, "llama@v2.1")) == (G0,)


def test_without_a_requested_version_each_endpoint_meets_its_own_versions_constraints():
    head = FLEET_HEAD.replace('        - "10.0.0.4:8000"\n',
                              '        - {address: "10.0.0.4:8000", labels: {accelerator: v100, model-version: v2.1}}\n'
                              '        - {address: "10.0.0.5:8000", labels: {accelerator: v100, model-version: "v1.9,2.1"}}\n'
                              '        - {address: "10.0.0.6:8000", labels: {accelerator: t4, model-version: "v3"}}\n')
    b = versions(head=head)
    eps = b.backend.endpoint_ids
    got = set(plugin(b, "f").filter(ctx(b, state(b, "llama")), eps))
    # a v2.1 deployment on a V100 is mislabelled and dropped, as is one listing v2.1 among others;
    # v3 has no constraint
    assert got == {G0, G1, A185, "10.0.0.6:8000"}


def test_nothing_left_refuses_503_or_429_when_sheddable():
    head = FLEET_HEAD.replace('tensorrt: "8.6"', 'tensorrt: "8.5"')
    b = versions(head=head)
    with pytest.raises(NoCapacity) as e:
        b.decide(state(b, "llama@v2.1"))
    assert e.value.filter == "f" and not e.value.sheddable
    with pytest.raises(NoCapacity) as e:
        b.decide(state(b, "llama@v2.1", priority=-1))
    assert e.value.sheddable


def test_an_empty_match_labels_allows_every_endpoint_even_unlabelled_ones():
    b = versions('{constraints: {"v1.9": {matchLabels: {}}}}')
    assert kept(b, "llama@v1.9") == set(FLEET)


def test_a_reload_reindexes_the_constraints():
    b = versions()
    f = plugin(b, "f")
    b.reload(fleet('    - {name: f, type: model-version-filter, parameters: {constraints: {"2.1": {matchLabels: '
                   '{accelerator: v100}}}}}\n    - {type: random-picker, parameters: {fallbacks: 4}}\n',
                   "[{pluginRef: f}, {pluginRef: random-picker}]"))
    assert plugin(b, "f") is f and kept(b, "llama@v2.1") == {G1}


@pytest.mark.parametrize("params, message", [
    ("{}", "spec.plugins[0].parameters.constraints: required parameter is missing"),
    ("{constraints: {}}", "spec.plugins[0].parameters.constraints: Dictionary should have at least 1 item"),
    ('{constraints: {"v2.1": {matchLabels: {a: b}}}, versionlabel: x}', "spec.plugins[0].parameters.versionlabel: unknown parameter"),
    ('{constraints: {"v2.1": {matchLabels: {a: b}, match: 1}}}', "spec.plugins[0].parameters.constraints.v2.1.match: unknown parameter"),
    ('{constraints: {"v2.1": {}}}', "spec.plugins[0].parameters.constraints.v2.1: give exactly one of matchLabels or anyOf"),
    ('{constraints: {"v2.1": {matchLabels: {}, anyOf: [{matchLabels: {}}]}}}', "give exactly one of matchLabels or anyOf"),
    ('{constraints: {"v2.1": {anyOf: [{matchLabel: {a: b}}]}}}', "spec.plugins[0].parameters.constraints.v2.1.anyOf[0].matchLabel: unknown parameter"),
    ('{constraints: {"v2.1": {anyOf: []}}}', "spec.plugins[0].parameters.constraints.v2.1.anyOf"),
    ('{constraints: {"v2.1": {matchLabels: {}}, "2.1": {matchLabels: {}}}}', "versions 'v2.1' and '2.1' are the same version"),
    ('{constraints: {"v1": {matchLabels: {}}}, versionLabel: ""}', "spec.plugins[0].parameters.versionLabel"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: f, type: model-version-filter, parameters: {params}}}\n", "[{pluginRef: f}]"),
                  "c.yaml")
    assert message in str(e.value)
