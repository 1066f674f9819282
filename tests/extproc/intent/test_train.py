"""The intent classifier's build step: the labelled set, the split, training, the ONNX export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import onnx
import pytest

from extproc.intent import train as T
from extproc.intent.classifier import N_CHARS, prepare
from tests.conftest import REPO


def _cjk(text: str) -> bool:
    return any("\u4e00" <= c <= "\u9fff" for c in text)


def test_the_shipped_set_has_six_intents_of_at_least_70_texts_in_english_and_chinese():
    rows = T.load_dataset()
    per = Counter(i for _, i in rows)
    assert set(per) == {"chat", "code", "summarize", "translate", "extract", "math"}
    assert min(per.values()) >= 70, per
    for intent in per:
        texts = [t for t, i in rows if i == intent]
        zh = sum(map(_cjk, texts))
        assert 0.3 * len(texts) <= zh <= 0.7 * len(texts), (intent, zh, len(texts))  # both languages


def test_the_shipped_set_has_no_duplicates_or_near_duplicates():
    """Templated near-duplicates would put the same text on both sides of the split and inflate the
    held-out accuracy: no two texts share more than half of their character n-grams (Jaccard)."""
    rows = T.load_dataset()
    keys = [" ".join(t.lower().split()) for t, _ in rows]
    assert len(set(keys)) == len(keys)
    sets = [set(T.grams(t)) for t, _ in rows]
    worst = max((len(a & b) / len(a | b), i, j) for i, a in enumerate(sets) for j, b in enumerate(sets) if i < j)
    assert worst[0] < 0.6, (worst[0], rows[worst[1]][0], rows[worst[2]][0])


def test_the_split_is_deterministic_disjoint_and_about_a_fifth(dataset_split):
    train, held = dataset_split
    rows = T.load_dataset()
    assert T.split(rows) == (train, held)
    assert not {t for t, _ in train} & {t for t, _ in held}
    assert sorted(train + held) == sorted(rows)
    assert 0.15 <= len(held) / len(rows) <= 0.25, len(held)
    assert set(Counter(i for _, i in held)) == set(Counter(i for _, i in rows))  # every intent is tested


def test_the_split_does_not_depend_on_pythons_hash_seed(dataset_split):
    _, held = dataset_split
    code = ("import json; from extproc.intent.train import load_dataset, split; "
            "print(json.dumps([t for t, _ in split(load_dataset())[1]]))")
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(json.loads(p.stdout))
    assert outs[0] == outs[1] == [t for t, _ in held]


def test_features_read_only_the_first_n_characters():
    head = "Write a Python function. "
    assert T.grams(head + "x" * 10_000) == T.grams((head + "x" * 10_000)[:N_CHARS])
    assert sum(T.grams("abcd", max_gram=1).values()) == 4
    assert T.grams("ABC  d") == Counter({"a": 1, "b": 1, "c": 1, " ": 1, "d": 1, "ab": 1, "bc": 1, "c ": 1,
                                         " d": 1, "abc": 1, "bc ": 1, "c d": 1})
    assert len(prepare("x" * 1000 + "İ" * 1000)) == N_CHARS


def test_the_vocabulary_comes_from_the_training_split_only_and_is_bounded(dataset_split):
    train, held = dataset_split
    vocab = T.build_vocabulary([t for t, _ in train])
    assert len(vocab) == T.VOCAB and len(set(vocab)) == len(vocab)
    seen = set().union(*(T.grams(t) for t, _ in train))
    assert set(vocab) <= seen
    assert {len(g) for g in vocab} == {1, 2, 3}
    assert vocab == sorted(vocab, key=lambda g: (len(g), g))  # the ONNX pool order
    small = T.build_vocabulary([t for t, _ in train], size=100)
    assert len(small) == 100 and set(small) <= set(vocab)


def test_training_is_deterministic(dataset_split):
    train, _ = dataset_split
    a = T.train(train)
    b = T.train(train)
    assert a.vocab == b.vocab and a.labels == b.labels
    assert np.array_equal(a.idf, b.idf)
    assert np.array_equal(a.W, b.W) and np.array_equal(a.b, b.b)
    assert np.abs(a.W).max() > 0  # it learnt something


def test_the_onnx_graph_computes_the_numpy_models_probabilities(dataset_split):
    """onnxruntime running the exported graph (TfIdfVectorizer over the characters) against the
    numpy model (n-grams counted in Python) on every held-out text, and on edge inputs."""
    train, held = dataset_split
    model = T.train(train)
    texts = [t for t, _ in held] + ["", " ", "x", "工", "ab" * 5000, "\n\t混合 mixed\u00a0text " * 40]
    ref = model.predict_proba(texts)
    got = T.onnx_proba(T.to_onnx(model), texts, model.n_chars)
    assert got.shape == ref.shape == (len(texts), len(model.labels))
    assert np.abs(got - ref).max() < 1e-5
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()


def test_the_graph_is_tfidfvectorizer_over_characters_then_logistic_regression(dataset_split):
    train, _ = dataset_split
    model = T.train(train, vocab_size=300)
    m = T.to_onnx(model)
    ops = [n.op_type for n in m.graph.node]
    assert ops[0] == "TfIdfVectorizer" and ops[-1] == "Softmax" and "MatMul" in ops
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in m.graph.node[0].attribute}
    assert attrs["mode"] == b"TF" and attrs["min_gram_length"] == 1 and attrs["max_gram_length"] == 3
    pool = [s.decode() for s in attrs["pool_strings"]]
    assert all(len(s) == 1 for s in pool)
    n1, n2 = (sum(len(g) == n for g in model.vocab) for n in (1, 2))
    assert list(attrs["ngram_counts"]) == [0, n1, n1 + 2 * n2]
    assert len(pool) == sum(len(g) for g in model.vocab) and list(attrs["ngram_indexes"]) == list(range(300))
    assert m.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.STRING
    props = {p.key: p.value for p in m.metadata_props}
    assert json.loads(props["labels"]) == model.labels and props["n_chars"] == str(N_CHARS)


def test_build_writes_the_model_and_its_report(built_model, dataset_split):
    out, meta = built_model
    train, held = dataset_split
    assert (out / "intent.onnx").stat().st_size > 10_000
    on_disk = json.loads((out / "intent.json").read_text())
    assert on_disk == meta
    assert meta["labels"] == sorted(meta["per_intent"])
    assert meta["train_size"] == len(train) and meta["held_out_size"] == len(held)
    assert meta["n_chars"] == N_CHARS and meta["vocabulary_size"] == T.VOCAB
    assert meta["evaluated_with"].startswith("onnxruntime")
    cm = np.array(meta["confusion"]["matrix"])
    assert cm.sum() == len(held) and meta["held_out_accuracy"] == pytest.approx(np.trace(cm) / cm.sum(), abs=1e-4)
    assert [meta["per_intent"][label]["support"] for label in meta["labels"]] == cm.sum(axis=1).tolist()
    assert meta["dataset_size"] == sum(meta["per_intent_size"].values())


def test_train_cli_with_another_dataset(tmp_path):
    rows = [{"text": t, "intent": i} for t, i in [
        ("hello there friend", "greet"), ("good morning to you", "greet"), ("hi, how are you", "greet"),
        ("hey buddy", "greet"), ("bye for now", "leave"), ("see you later", "leave"),
        ("goodbye and take care", "leave"), ("farewell my friend", "leave")] * 3]
    for n, r in enumerate(rows):
        r["text"] += f" #{n}"
    ds = tmp_path / "mine.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = subprocess.run([sys.executable, "-m", "extproc.intent.train", "--dataset", str(ds), "--out",
                        str(tmp_path / "m"), "--vocab", "64"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    meta = json.loads((tmp_path / "m" / "intent.json").read_text())
    assert meta["labels"] == ["greet", "leave"] and meta["vocabulary_size"] == 64 and meta["dataset_size"] == 24
    assert "held-out accuracy" in p.stderr


def test_a_malformed_dataset_line_is_refused_with_its_line_number(tmp_path):
    ds = tmp_path / "bad.jsonl"
    ds.write_text('{"text": "hi", "intent": "chat"}\n{"text": "no label"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        T.load_dataset(ds)
    p = subprocess.run([sys.executable, "-m", "extproc.intent.train", "--dataset", str(ds), "--out",
                        str(tmp_path / "m")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bad.jsonl:2: expected" in p.stderr
    assert not (tmp_path / "m").exists()


def test_make_setup_builds_the_model():
    """The $(STAMP) recipe (the venv install) ends by training the model."""
    lines = (REPO / "Makefile").read_text().split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0].splitlines()
    pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    train = next(i for i, line in enumerate(lines) if "-m extproc.intent.train" in line)
    assert pip < train < len(lines) - 1 and lines[-1].strip() == "touch $@"
