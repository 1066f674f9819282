"""Topic templates: placeholders are template paths; values cannot add levels or wildcards."""

from __future__ import annotations

import pytest

from extproc.iot.topics import TopicError, compile_topic
from extproc.template import MissingPathError


@pytest.mark.parametrize("source, doc, topic, flt", [
    ("plant/{$.device}/set", {"device": "b7"}, "plant/b7/set", "plant/+/set"),
    ("a/b", {}, "a/b", "a/b"),
    ("{$.site}/x/{$.zone ?? \"all\"}-z", {"site": "s1"}, "s1/x/all-z", "+/x/+"),
    ("dev/{$.n}/{$.on}", {"n": 3, "on": True}, "dev/3/true", "dev/+/+"),
    ("x/{$.d}/", {"d": "q"}, "x/q/", "x/+/"),
    ("厂/{$.设备}", {"设备": "泵1"}, "厂/泵1", "厂/+"),
])
def test_render_and_filter(source, doc, topic, flt):
    t = compile_topic(source)
    assert t.render(doc) == topic and t.filter == flt
    assert t.is_literal == ("{" not in source)


@pytest.mark.parametrize("value", ["a/b", "+", "#", "x#", "", "a\x00b", 1.5, None, {"a": 1}])
def test_a_value_that_is_not_one_topic_level_is_refused_naming_the_placeholder(value):
    with pytest.raises(TopicError) as e:
        compile_topic("plant/{$.device}/set").render({"device": value})
    assert e.value.path == "$.device"


def test_a_missing_path_without_default_is_the_template_engines_error():
    with pytest.raises(MissingPathError):
        compile_topic("plant/{$.device}/set").render({})


@pytest.mark.parametrize("source, why", [
    ("", "empty"), ("a/+/b", "wildcards"), ("a/#", "wildcards"), ("a/{device}", "must be a path"),
    ("a/{$.", "unbalanced"), ("a/{$.x}}", "unbalanced"), ("a/{$.a b}", "placeholder"),
])
def test_bad_templates_fail_at_compile(source, why):
    with pytest.raises(TopicError, match=why):
        compile_topic(source)
