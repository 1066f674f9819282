"""Task intent of a request: the client's `x-task-intent` header, else a small ONNX text classifier.

What: `IntentClassifier.load(path=None)` opens `intent.onnx` and `intent.json` (built by
`python -m extproc.intent.train`, default `extproc/intent/model/`) in an onnxruntime
`InferenceSession` with one intra-op thread; `classify(text)` returns `(intent, confidence)` for
the first `n_chars` characters of the text (256 by default, recorded in intent.json), lower-cased
with runs of white space collapsed to one space, passed to the graph as a 1-D string tensor of
single characters (`tokens(text)`). The graph counts character 1- to 3-grams over a vocabulary
fixed at training time (ONNX `TfIdfVectorizer`), weights them log(1 + tf) * idf, L2-normalises,
then a multinomial logistic regression (MatMul + Add) and Softmax. `intent_of(headers, text,
classifier)` is what a scheduling filter calls: the header when it names a known intent (a routing
hint from the client, compared case-insensitively; an unknown value is ignored and the text is
classified), else the classifier's label (when its confidence reaches `min_confidence`), else None
(no classifier, nothing to classify).
Why: routing by task (code to a code model's pool, extraction to a JSON-mode pool, ...) needs a
label per request even when clients send none; a character n-gram model reads English and Chinese
alike without a tokenizer, is small enough to run in every processor worker, and reading a bounded
prefix makes its cost independent of the prompt's length (a 1 MB prompt costs what 256 characters
cost). The labelled set, its split and the held-out accuracy are in docs/intent.md and the model's
intent.json.
Cost: `classify` about 21 us p50, 43 us p99 per request on one core of an AMD EPYC (2 cores,
shared), over the held-out texts (median 50 characters as read): about 19 us is onnxruntime's
`run`, 2 us building the token array; a full 256-character input costs about 32 us, and so does a
1 MB prompt (only its first 256 characters are read). Measured by perf/bench_intent.py (its section
in perf/RESULTS.md). The model is about 160 KB; loading it takes a few milliseconds, once per worker.
onnxruntime and numpy are the optional `[ort]` extra: this module imports them only in `load`, so
the processor imports it without them and `load` raises `IntentUnavailable` with the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

HEADER = "x-task-intent"
DEFAULT_DIR = Path(__file__).resolve().parent / "model"
MODEL_FILE = "intent.onnx"
META_FILE = "intent.json"
N_CHARS = 256  # the default bound; a built model records its own in intent.json
BUILD_HINT = "run `make setup` or `python -m extproc.intent.train`"


class IntentUnavailable(Exception):
    """The classifier cannot be loaded; `reason` says why (and how to fix it)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def prepare(text: str, n_chars: int = N_CHARS) -> str:
    """The classifier's input: the first `n_chars` characters, lower-cased, white space collapsed.

    Bounded before any other work: only `text[:n_chars]` is ever read (lower-casing can lengthen a
    string, e.g. 'İ', so the result is cut again)."""
    return " ".join(text[:n_chars].lower().split())[:n_chars]


def tokens(text: str, n_chars: int = N_CHARS) -> list[str]:
    """The characters fed to the graph (at most `n_chars`)."""
    return list(prepare(text, n_chars))


class IntentClassifier:
    def __init__(self, session: Any, meta: dict[str, Any], np: Any, path: Path):
        self._session = session
        self._np = np
        self._input = session.get_inputs()[0].name
        self.meta = meta
        self.path = path
        self.labels: tuple[str, ...] = tuple(meta["labels"])
        self.n_chars: int = int(meta["n_chars"])
        self._known = frozenset(self.labels)

    @classmethod
    def load(cls, path: str | Path | None = None) -> IntentClassifier:
        """Load from a directory holding intent.onnx and intent.json, or from the .onnx file itself
        (its intent.json beside it). Raises IntentUnavailable when onnxruntime/numpy are missing or
        the model is not built."""
        p = Path(path) if path is not None else DEFAULT_DIR
        model = p if p.suffix == ".onnx" else p / MODEL_FILE
        meta_path = model.with_name(META_FILE)
        try:
            import numpy as np
            import onnxruntime as ort
        except ImportError as e:
            raise IntentUnavailable(f"intent classifier: onnxruntime is not installed ({e}); it is the "
                                    "optional extra: pip install '.[ort]'") from None
        if not model.is_file() or not meta_path.is_file():
            missing = model if not model.is_file() else meta_path
            raise IntentUnavailable(f"intent classifier: model not built ({missing} is missing); {BUILD_HINT}")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # a corrupt or foreign file: say which, do not crash the worker
            raise IntentUnavailable(f"intent classifier: cannot load {model}: {e}; {BUILD_HINT}") from None
        return cls(session, meta, np, model)

    def tokens(self, text: str) -> list[str]:
        """The bounded input actually passed to the model for `text`."""
        return tokens(text, self.n_chars)

    def probabilities(self, text: str) -> dict[str, float]:
        x = self._np.array(self.tokens(text), dtype=object)
        probs = self._session.run(None, {self._input: x})[0].reshape(-1)
        return {label: float(p) for label, p in zip(self.labels, probs)}

    def classify(self, text: str) -> tuple[str, float]:
        """(intent, confidence) of the first `n_chars` characters of `text`."""
        x = self._np.array(self.tokens(text), dtype=object)
        probs = self._session.run(None, {self._input: x})[0].reshape(-1)
        i = int(probs.argmax())
        return self.labels[i], float(probs[i])

    def known(self, intent: str) -> bool:
        return intent in self._known


def _header(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> str | None:
    if not headers:
        return None
    if isinstance(headers, Mapping):
        value = headers.get(HEADER)
        if value is not None:
            return value
        items: Iterable[tuple[str, str]] = headers.items()
    else:
        items = headers
    for name, value in items:
        if name.lower() == HEADER:
            return value
    return None


def intent_of(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None, text: str | None,
              classifier: IntentClassifier | None, labels: Iterable[str] | None = None,
              min_confidence: float = 0.0) -> str | None:
    """The request's task intent: a known `x-task-intent` header value, else the classifier's label
    for `text` (None when its confidence is below `min_confidence`), else None.

    Known labels are the classifier's; without a classifier, `labels` (when given) validates the
    header, and with neither any non-empty header value is taken as is."""
    value = _header(headers)
    if value is not None:
        hint = value.strip().lower()
        if classifier is not None:
            if classifier.known(hint):
                return hint
        elif hint and (labels is None or hint in set(labels)):
            return hint
    if classifier is None or not text:
        return None
    intent, confidence = classifier.classify(text)
    return intent if confidence >= min_confidence else None
