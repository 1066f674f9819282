"""The intent model, trained by the tests themselves into a temporary directory (once per session):
the tests never depend on `make setup` having built extproc/intent/model/."""

from __future__ import annotations

import pytest

pytest.importorskip("numpy", reason="the intent classifier is built with the [ort] extra")
pytest.importorskip("onnx", reason="the intent classifier is built with the [ort] extra")
pytest.importorskip("onnxruntime", reason="the intent classifier runs with the [ort] extra")


@pytest.fixture(scope="session")
def built_model(tmp_path_factory):
    """(directory, intent.json contents) of a model trained on the shipped set with the defaults."""
    from extproc.intent.train import build

    out = tmp_path_factory.mktemp("intent-model")
    meta = build(out)
    return out, meta


@pytest.fixture(scope="session")
def dataset_split():
    from extproc.intent.train import load_dataset, split

    return split(load_dataset())
