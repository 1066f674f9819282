"""Small helpers shared by the ONNX Runtime server tests: metric samples and direct ORT runs."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from prometheus_client.parser import text_string_to_metric_families


def metrics_text(base: str) -> str:
    response = httpx.get(f"{base}/metrics", timeout=5)
    assert response.status_code == 200
    return response.text


def sample(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The value of one sample (``name`` is the full sample name, e.g. ``ort_batch_size_count``)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    if default is not None:
        return default
    raise AssertionError(f"no sample {name}{labels}")


def run_direct(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run a model file with onnxruntime directly (the reference for the server's answers)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)
