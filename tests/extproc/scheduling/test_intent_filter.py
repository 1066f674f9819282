"""Filter `intent-filter`: task intent (the x-task-intent header, else the ONNX classifier) -> endpoint pool."""

from __future__ import annotations

import logging

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.intent_filter import IntentFilter, IntentFilterParameters
from extproc.types import HINT_HEADERS
from tests.extproc.scheduling.fleet import A185, FLEET, G0, G1, built, ctx, fleet, plugin, state

INTENTS = "intents: {code: {matchLabels: {pool: code}}, chat: {matchLabels: {pool: shared}}, math: {matchLabels: {pool: none}}}"
NO_MODEL = "/nonexistent/intent-model"


def intents(extra: str = "", classifier: str = f"modelPath: {NO_MODEL}"):
    params = ", ".join(p for p in (INTENTS, classifier, extra) if p)
    return built(f"    - {{name: f, type: intent-filter, parameters: {{{params}}}}}\n"
                 "    - {type: random-picker, parameters: {fallbacks: 4}}\n",
                 "[{pluginRef: f}, {pluginRef: random-picker}]")


def kept(b, **kw):
    st = state(b, **kw)
    out = set(plugin(b, "f").filter(ctx(b, st), FLEET))
    return out, st.attrs.get("task_intent")


def test_is_a_filter():
    p = IntentFilterParameters(intents={"code": {"matchLabels": {"pool": "code"}}})
    assert isinstance(IntentFilter("f", p, None), Filter)


def test_the_header_names_the_pool():
    b = intents()
    assert kept(b, x_task_intent="code") == ({A185}, "code")
    assert kept(b, x_task_intent="  Chat ") == ({G1}, "chat")  # case and white space do not matter


def test_no_intent_or_one_without_a_pool_keeps_the_default_or_everyone():
    b = intents()
    assert kept(b) == (set(FLEET), None)
    assert kept(b, x_task_intent="poetry") == (set(FLEET), None)  # unknown: ignored (no classifier here)
    b = intents("default: {matchLabels: {pool: gold}}")
    assert kept(b) == ({G0}, None) and kept(b, x_task_intent="poetry") == ({G0}, None)
    assert kept(b, x_task_intent="code") == ({A185}, "code")


def test_a_pool_with_no_endpoint_refuses():
    b = intents()
    with pytest.raises(NoCapacity) as e:
        b.decide(state(b, x_task_intent="math"))
    assert e.value.filter == "f"


def test_a_missing_classifier_is_logged_once_and_never_fails_a_request(caplog):
    b = intents()
    with caplog.at_level(logging.WARNING, logger="extproc.scheduling.intent_filter"):
        for _ in range(3):
            assert kept(b, prompt="def f(x): return x  # fix this python function") == (set(FLEET), None)
            assert kept(b, x_task_intent="code")[1] == "code"
    warnings = [r for r in caplog.records if r.name == "extproc.scheduling.intent_filter"]
    message = warnings[0].getMessage() if warnings else ""
    assert len(warnings) == 1 and (NO_MODEL in message or "classifier module unavailable" in message)
    f = plugin(b, "f")
    assert f.unavailable is not None and "x-task-intent header only" in warnings[0].getMessage()


def test_with_the_classifier_off_nothing_is_loaded():
    b = intents(classifier="classifier: false")
    assert kept(b, prompt="please fix this python traceback") == (set(FLEET), None)
    assert plugin(b, "f").unavailable is None


def _classifier_or_skip():
    try:
        from extproc.intent.classifier import IntentClassifier, IntentUnavailable
    except ImportError as e:
        pytest.skip(f"no intent classifier module: {e}")
    try:
        return IntentClassifier.load()
    except IntentUnavailable as e:
        pytest.skip(e.reason)


CODE_PROMPT = "My Python script fails with KeyError: 'id' in line 12 of parse.py, how do I fix the dict lookup?"


def test_without_a_header_the_classifier_decides(caplog):
    clf = _classifier_or_skip()
    assert clf.classify(CODE_PROMPT)[0] == "code"
    b = intents(classifier="")
    with caplog.at_level(logging.WARNING, logger="extproc.scheduling.intent_filter"):
        assert kept(b, prompt=CODE_PROMPT) == ({A185}, "code")
    assert not [r for r in caplog.records if r.name == "extproc.scheduling.intent_filter"]
    assert kept(b, prompt=CODE_PROMPT, x_task_intent="chat") == ({G1}, "chat")  # the header wins
    assert kept(b, prompt=CODE_PROMPT, x_task_intent="poetry") == ({A185}, "code")  # unknown header: classified
    assert plugin(b, "f").unavailable is None


def test_min_confidence_turns_an_unsure_label_into_no_intent():
    clf = _classifier_or_skip()
    _, confidence = clf.classify(CODE_PROMPT)
    b = intents("default: {matchLabels: {pool: gold}}", classifier="")
    assert kept(b, prompt=CODE_PROMPT) == ({A185}, "code")
    b = intents(f"default: {{matchLabels: {{pool: gold}}}}, minConfidence: {min(1.0, confidence + 1e-6)}", classifier="")
    assert kept(b, prompt=CODE_PROMPT) == ({G0}, None)


def test_a_reload_that_changes_the_model_path_reloads_the_classifier():
    b = intents()
    f = plugin(b, "f")
    kept(b)
    assert f.unavailable is not None
    b.reload(fleet(f"    - {{name: f, type: intent-filter, parameters: {{{INTENTS}, modelPath: /elsewhere}}}}\n"
                   "    - {type: random-picker, parameters: {fallbacks: 4}}\n",
                   "[{pluginRef: f}, {pluginRef: random-picker}]"))
    assert plugin(b, "f") is f and f.unavailable is None  # forgotten until the next use
    kept(b)
    assert "/elsewhere" in f.unavailable


async def test_the_stream_keeps_the_hint_headers_for_plugins_deciding_at_the_body():
    from envoy.config.core.v3 import base_pb2

    from tests.extproc.test_stream import PASSTHROUGH, run, service
    from tests.extproc.test_lifecycle import recorded

    seq = recorded(PASSTHROUGH)
    assert seq[0].WhichOneof("request") == "request_headers"
    hdrs = seq[0].request_headers.headers.headers
    hdrs.append(base_pb2.HeaderValue(key="x-task-intent", raw_value=b"code"))
    hdrs.append(base_pb2.HeaderValue(key="x-slo-ttft-ms", raw_value=b"250"))
    hdrs.append(base_pb2.HeaderValue(key="x-other", raw_value=b"1"))
    svc, _, states = service()
    await run(svc, [("x-adapter-route", "v1-chat-completions")], seq)
    attrs = states[0][0].attrs
    assert {k: attrs[k] for k in HINT_HEADERS} == {"x-task-intent": "code", "x-slo-ttft-ms": "250"}
    assert "x-other" not in attrs
    svc, _, states = service()
    await run(svc, [("x-adapter-route", "v1-chat-completions")], recorded(PASSTHROUGH))
    assert not set(HINT_HEADERS) & set(states[0][0].attrs)


@pytest.mark.parametrize("params, message", [
    ("{}", "spec.plugins[0].parameters.intents: required parameter is missing"),
    ("{intents: {}}", "spec.plugins[0].parameters.intents: Dictionary should have at least 1 item"),
    ("{intents: {code: {matchLabels: {pool: code}}}, header: x}", "spec.plugins[0].parameters.header: unknown parameter"),
    ("{intents: {code: {pool: code}}}", "spec.plugins[0].parameters.intents.code.pool: unknown parameter"),
    ("{intents: {code: {matchLabels: {pool: code}}}, minConfidence: 1.5}", "spec.plugins[0].parameters.minConfidence"),
    ("{intents: {code: {matchLabels: {pool: code}}}, classifier: maybe}", "spec.plugins[0].parameters.classifier"),
    ("{intents: {code: {matchLabels: {pool: code}}}, default: {anyOf: []}}", "spec.plugins[0].parameters.default.anyOf"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: f, type: intent-filter, parameters: {params}}}\n", "[{pluginRef: f}]"), "c.yaml")
    assert message in str(e.value)


# --- the classifier's part, with a stand-in for the ONNX model ------------------------------------------------
# The built model (extproc/intent/model/) is a `make setup` artefact, absent from a bare checkout (and from
# the mutation workspace, an export of HEAD), where the two tests above skip. The stand-in is loaded where
# the model would be (`IntentClassifier.load`) and answered through the real `intent_of`, so these tests
# check what the filter does with a classifier: what it asks it, with which confidence bar, and when.

class StubClassifier:
    """`classify(text)`: ("code", 0.8) when the text mentions python, else ("chat", 0.4); records its calls."""

    labels = ("code", "chat", "math")

    def __init__(self, path):
        self.path, self.texts = path, []

    def known(self, intent):
        return intent in self.labels

    def classify(self, text):
        self.texts.append(text)
        return ("code", 0.8) if "python" in text.lower() else ("chat", 0.4)


@pytest.fixture
def stub(monkeypatch):
    from extproc.intent import classifier

    loads = []

    def load(path=None):
        loads.append(StubClassifier(path))
        return loads[-1]

    monkeypatch.setattr(classifier.IntentClassifier, "load", staticmethod(load))
    return loads


def test_the_classifier_labels_the_prompt_when_no_header_names_an_intent(stub, caplog):
    b = intents(classifier="modelPath: /models/intent")
    with caplog.at_level(logging.WARNING, logger="extproc.scheduling.intent_filter"):
        assert kept(b, prompt="fix my Python loop") == ({A185}, "code")
        assert kept(b, prompt="tell me about your day") == ({G1}, "chat")  # 0.4 >= minConfidence 0
        assert kept(b, prompt="fix my Python loop", x_task_intent="chat") == ({G1}, "chat")  # the header wins
        assert kept(b, prompt="fix my Python loop", x_task_intent="poetry") == ({A185}, "code")  # unknown: classified
    (clf,) = stub  # loaded once per worker, on first use, from modelPath
    assert clf.path == "/models/intent"
    # the prompt as the request gives it; a known header is not classified
    assert clf.texts == ["fix my Python loop", "tell me about your day", "fix my Python loop"]
    f = plugin(b, "f")
    assert f.unavailable is None and f.classifier() is clf
    assert not [r for r in caplog.records if r.name == "extproc.scheduling.intent_filter"]


def test_min_confidence_is_the_bar_the_classifiers_label_must_reach(stub):
    b = intents("default: {matchLabels: {pool: gold}}, minConfidence: 0.5", classifier="")
    assert kept(b, prompt="python, please") == ({A185}, "code")  # 0.8 >= 0.5
    assert kept(b, prompt="hello there") == ({G0}, None)  # 0.4 < 0.5: no intent, the default pool
    b = intents("minConfidence: 0.8", classifier="")
    assert kept(b, prompt="python, please") == ({A185}, "code")  # reaching the bar is enough
    b = intents("minConfidence: 0.81", classifier="")
    assert kept(b, prompt="python, please") == (set(FLEET), None)


def test_a_classifier_label_is_compared_lower_cased_like_the_intents(stub, monkeypatch):
    monkeypatch.setattr(StubClassifier, "labels", ("CODE", "Chat", "math"))
    monkeypatch.setattr(StubClassifier, "classify", lambda self, text: ("CODE", 0.9))
    b = intents(classifier="")
    assert kept(b, prompt="anything") == ({A185}, "code")  # the model's "CODE" is the config's code pool


def test_nothing_to_classify_is_no_intent(stub):
    b = intents("default: {matchLabels: {pool: gold}}", classifier="")
    assert kept(b, prompt="") == ({G0}, None)  # an empty prompt
    st = state(b)
    st.request = None  # a route that parses no body
    assert set(plugin(b, "f").filter(ctx(b, st), FLEET)) == {G0} and st.attrs["task_intent"] is None
    (clf,) = stub
    assert clf.texts == []  # loaded, never asked


def test_a_missing_classifier_module_is_logged_once_under_the_filters_name(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "extproc.intent.classifier", None)  # a build without the module
    b = intents(classifier="")
    with caplog.at_level(logging.WARNING, logger="extproc.scheduling.intent_filter"):
        for _ in range(2):
            assert kept(b, prompt="python") == (set(FLEET), None)
            assert kept(b, x_task_intent="code") == ({A185}, "code")  # the header still routes
    f = plugin(b, "f")
    assert f.unavailable.startswith("intent classifier module unavailable (")
    (warning,) = [r for r in caplog.records if r.name == "extproc.scheduling.intent_filter"]
    assert warning.getMessage() == f"intent-filter 'f': {f.unavailable}; routing by the x-task-intent header only"


def test_built_from_config_under_its_name_with_the_workers_runtime():
    b = intents()
    f = plugin(b, "f")
    assert isinstance(f, IntentFilter) and f.name == "f" and f.runtime is b.runtime


def test_a_reload_applies_the_new_intents_compared_lower_cased():
    b = intents()
    f = plugin(b, "f")
    assert kept(b, x_task_intent="code") == ({A185}, "code")
    b.reload(fleet(f"    - {{name: f, type: intent-filter, parameters: {{intents: {{Code: {{matchLabels: {{pool: gold}}}}, "
                   f"Poetry: {{matchLabels: {{pool: shared}}}}}}, modelPath: {NO_MODEL}}}}}\n"
                   "    - {type: random-picker, parameters: {fallbacks: 4}}\n",
                   "[{pluginRef: f}, {pluginRef: random-picker}]"))
    assert plugin(b, "f") is f  # the same instance, reconfigured
    assert kept(b, x_task_intent="code") == ({G0}, "code")  # the key `Code`, lower-cased
    assert kept(b, x_task_intent="POETRY") == ({G1}, "poetry")
    assert kept(b, x_task_intent="chat") == (set(FLEET), None)  # gone with the old parameters
