"""The intent classifier as a worker runs it: real onnxruntime inference on a model the tests train."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from extproc.intent.classifier import HEADER, IntentClassifier, IntentUnavailable, intent_of
from tests.conftest import REPO

# Measured on the shipped set: 0.902 held-out accuracy (83 of 92; docs/intent.md). The floor sits
# below it so that an honest edit of the set does not fail the suite, and well above chance (1/6).
ACCURACY_FLOOR = 0.80


@pytest.fixture(scope="module")
def clf(built_model):
    return IntentClassifier.load(built_model[0])


class Recording:
    """The real InferenceSession, recording the inputs passed to it."""

    def __init__(self, session):
        self.session = session
        self.feeds = []

    def run(self, outputs, feeds):
        self.feeds.append(feeds)
        return self.session.run(outputs, feeds)

    def get_inputs(self):
        return self.session.get_inputs()


def test_held_out_accuracy(clf, dataset_split, built_model):
    _, held = dataset_split
    right = sum(clf.classify(t)[0] == i for t, i in held)
    accuracy = right / len(held)
    print(f"\nintent classifier held-out accuracy: {accuracy:.3f} ({right}/{len(held)}), floor {ACCURACY_FLOOR}")
    assert accuracy >= ACCURACY_FLOOR
    assert accuracy == pytest.approx(built_model[1]["held_out_accuracy"], abs=1e-4)  # what intent.json states


def test_classify_returns_a_label_and_its_probability(clf, dataset_split):
    train, _ = dataset_split
    text, intent = next((t, i) for t, i in train if i == "translate")
    label, confidence = clf.classify(text)
    assert label == intent and 0 < confidence <= 1
    probs = clf.probabilities(text)
    assert set(probs) == set(clf.labels) and sum(probs.values()) == pytest.approx(1, abs=1e-5)
    assert max(probs, key=probs.get) == label and probs[label] == pytest.approx(confidence)
    assert clf.classify("")[0] in clf.labels  # empty input: the prior, no error


def test_the_header_is_used_when_it_names_a_known_intent(clf):
    text = "Translate this into French: the meeting is on Thursday."
    assert intent_of({}, text, clf) == "translate"
    assert intent_of({HEADER: "code"}, text, clf) == "code"
    assert intent_of({HEADER: " Summarize "}, text, clf) == "summarize"  # case and spaces
    assert intent_of([("X-Task-Intent", "math")], text, clf) == "math"  # header pairs, any case
    assert intent_of({HEADER: "extract"}, "", clf) == "extract"  # nothing to classify, the hint still counts
    assert intent_of({HEADER: "code"}, text, None) == "code"  # no classifier: the hint as is
    assert intent_of({HEADER: "code"}, text, None, labels=["chat"]) is None  # ...or validated by the labels given


def test_an_unknown_header_value_is_ignored_and_the_text_classified(clf):
    text = "Translate this into French: the meeting is on Thursday."
    assert intent_of({HEADER: "poetry"}, text, clf) == "translate"
    assert intent_of({HEADER: ""}, text, clf) == "translate"
    assert intent_of({HEADER: "code; drop table"}, text, clf) == "translate"


def test_no_header_and_no_classifier_or_no_text_is_none(clf):
    assert intent_of({}, "write a python function", None) is None
    assert intent_of(None, "", clf) is None
    assert intent_of(None, None, clf) is None


def test_min_confidence(clf):
    text = "Translate this into French: the meeting is on Thursday."
    _, confidence = clf.classify(text)
    assert intent_of({}, text, clf, min_confidence=confidence) == "translate"
    assert intent_of({}, text, clf, min_confidence=min(1.0, confidence + 1e-3)) is None


def test_a_1mb_prompt_is_classified_from_its_first_n_characters_only(built_model):
    clf = IntentClassifier.load(built_model[0])
    rec = clf._session = Recording(clf._session)
    head = "Write a Python function that parses a CSV file and returns a list of dicts. "
    tail = "请把下面这段话翻译成英文，语气正式一点。Translate the following into German please. "
    tail *= 20_000
    big = (head * 4 + tail)[:1_000_000]
    assert len(big) == 1_000_000 and clf.n_chars < len(head * 4)  # only the code request is read

    label, confidence = clf.classify(big)
    (feed,) = rec.feeds
    passed = list(feed["tokens"])
    assert len(passed) == clf.n_chars == 256
    assert passed == clf.tokens(big[:clf.n_chars]) == list(" ".join(big[:256].lower().split()))
    assert (label, confidence) == clf.classify(big[:clf.n_chars])
    assert label == "code"
    assert clf.classify(tail)[0] == "translate"  # what the unread part alone would have been


def test_load_without_a_built_model_says_how_to_build_it(tmp_path, built_model):
    with pytest.raises(IntentUnavailable) as e:
        IntentClassifier.load(tmp_path / "nothing")
    assert "model not built" in e.value.reason and "python -m extproc.intent.train" in e.value.reason
    assert "make setup" in str(e.value) and "intent.onnx" in e.value.reason
    only_onnx = tmp_path / "half"
    only_onnx.mkdir()
    (only_onnx / "intent.onnx").write_bytes((built_model[0] / "intent.onnx").read_bytes())
    with pytest.raises(IntentUnavailable, match="intent.json is missing"):
        IntentClassifier.load(only_onnx / "intent.onnx")
    (only_onnx / "intent.json").write_text(json.dumps(built_model[1]))
    assert IntentClassifier.load(only_onnx / "intent.onnx").labels == tuple(built_model[1]["labels"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "intent.onnx").write_bytes(b"not a model")
    (broken / "intent.json").write_text(json.dumps(built_model[1]))
    with pytest.raises(IntentUnavailable, match="cannot load"):
        IntentClassifier.load(broken)


BLOCKED = r"""
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("numpy", "onnxruntime", "onnx"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, Blocker())
from extproc.intent.classifier import IntentClassifier, IntentUnavailable, intent_of
assert intent_of({"x-task-intent": "code"}, "hello", None) == "code"
try:
    IntentClassifier.load(sys.argv[1])
except IntentUnavailable as e:
    print(e.reason)
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("numpy", "onnxruntime", "onnx")))
"""


def test_without_onnxruntime_the_module_imports_and_load_says_why(built_model):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", BLOCKED, str(built_model[0])], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    reason, loaded = p.stdout.strip().splitlines()
    assert "onnxruntime is not installed" in reason and "[ort]" in reason
    assert loaded == "[]"
