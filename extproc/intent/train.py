"""Build step: train the task-intent classifier from a labelled set and export it as ONNX.

    python -m extproc.intent.train [--out DIR] [--dataset FILE] [--n-chars N] [--vocab V] [--l2 L]
    python -m extproc.intent.train --cv     # also 5-fold cross-validate L2 strengths on the training split

What: reads `{"text", "intent"}` lines (default extproc/intent/dataset.jsonl, our hand-written set),
splits them deterministically (a text is held out when blake2b("intent-split:" + text) mod 1000 <
200: about 20%, the same on every machine and run, never Python's salted `hash()`), counts the
character 1- to 3-grams of each text's first N characters (`classifier.prepare`: lower-cased,
white space collapsed; N = 256), keeps the `--vocab` (4096) n-grams found in most training texts,
weights counts log(1 + tf) * idf (smoothed idf from the training split) and L2-normalises each
row, then fits a multinomial logistic regression (softmax, L2 penalty `--l2` on the weights, bias
unpenalised) by full-batch Nesterov-accelerated gradient descent from zero: no sampling, so no
seed is needed and the same data gives the same weights. The model is exported with
`onnx.helper` as: input `tokens` (1-D string tensor, one character each) -> `TfIdfVectorizer`
(mode TF, 1..3-grams, pool_strings = the vocabulary) -> Add 1, Log, Mul idf -> ReduceL2, Max eps,
Div -> MatMul W, Add b -> Softmax -> `probabilities` [1, labels]. The n-gram counting runs inside
the graph (onnxruntime's TfIdfVectorizer handles string tokens), so serving needs only the
characters. Writes `intent.onnx` and `intent.json` (labels, N, vocabulary size, split sizes,
held-out accuracy measured with onnxruntime on the exported graph, per-intent precision and recall,
the confusion matrix, the training settings, the dataset's sha256, the date) to `--out`
(default extproc/intent/model/, a build output: .gitignore).
Why: the labels must come from data we can show (docs/intent.md states the set and its accuracy),
be rebuilt by `make setup` on any machine in seconds, and need no dependency beyond the `[ort]`
extra (numpy + onnx to build, onnxruntime to serve).
Cost: about 1.5 s for the shipped set (447 texts) on one core (4 s on a busy one): n-gram counting,
1500 gradient steps on the 355 x 355 Gram matrix, the export and the held-out evaluation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from extproc.intent.classifier import DEFAULT_DIR, META_FILE, MODEL_FILE, N_CHARS, prepare

DATASET = Path(__file__).resolve().parent / "dataset.jsonl"
MAX_GRAM = 3
VOCAB = 4096
HELD_OUT_PER_MILLE = 200
L2 = 3e-4  # chosen by `--cv` (5-fold on the training split: 1e-2 .762, 3e-3 .838, 1e-3 .869, 3e-4 .877, 1e-4 .877)
ITERATIONS = 1500
OPSET = 18
IR_VERSION = 8  # onnxruntime 1.31 reads IR <= 11; opset 18 needs IR >= 8
EPS = 1e-12


def load_dataset(path: str | Path = DATASET) -> list[tuple[str, str]]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            text, intent = obj["text"], obj["intent"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected {{\"text\": ..., \"intent\": ...}}: {e}") from None
        if not isinstance(text, str) or not isinstance(intent, str) or not text.strip() or not intent.strip():
            raise ValueError(f"{path}:{n}: text and intent must be non-empty strings")
        rows.append((text, intent.strip().lower()))
    return rows


def is_held_out(text: str, per_mille: int = HELD_OUT_PER_MILLE) -> bool:
    h = hashlib.blake2b(("intent-split:" + text).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "little") % 1000 < per_mille


def split(rows: list[tuple[str, str]], per_mille: int = HELD_OUT_PER_MILLE
          ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training, held-out), each in the dataset's order."""
    train = [r for r in rows if not is_held_out(r[0], per_mille)]
    held = [r for r in rows if is_held_out(r[0], per_mille)]
    return train, held


def grams(text: str, n_chars: int = N_CHARS, max_gram: int = MAX_GRAM) -> Counter[str]:
    """Counts of the character 1..max_gram-grams of `prepare(text)`: what TfIdfVectorizer counts."""
    s = prepare(text, n_chars)
    c: Counter[str] = Counter()
    for n in range(1, max_gram + 1):
        c.update(s[i:i + n] for i in range(len(s) - n + 1))
    return c


def build_vocabulary(texts: list[str], size: int = VOCAB, n_chars: int = N_CHARS) -> list[str]:
    """The `size` n-grams present in most texts (ties: lexicographic), ordered by length then text
    (the pool order of the ONNX op, so the feature index is the position in this list)."""
    df: Counter[str] = Counter()
    for t in texts:
        df.update(grams(t, n_chars).keys())
    top = sorted(df, key=lambda g: (-df[g], g))[:size]
    return sorted(top, key=lambda g: (len(g), g))


def counts(texts: list[str], vocab: list[str], n_chars: int = N_CHARS) -> np.ndarray:
    index = {g: i for i, g in enumerate(vocab)}
    X = np.zeros((len(texts), len(vocab)))
    for r, t in enumerate(texts):
        for g, c in grams(t, n_chars).items():
            i = index.get(g)
            if i is not None:
                X[r, i] = c
    return X


def weigh(tf: np.ndarray, idf: np.ndarray) -> np.ndarray:
    x = np.log1p(tf) * idf
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), EPS)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit(X: np.ndarray, y: np.ndarray, k: int, l2: float = L2, iterations: int = ITERATIONS
        ) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression: minimise mean cross-entropy + l2/2 |W|^2 (bias unpenalised)
    by Nesterov's accelerated gradient from zero, step 1/L with L = (1 + max |x|^2)/2 + l2 (a bound
    on the Hessian for rows with the bias column).

    From zero every iterate of W lies in the row space of X, W = X^T A, so the descent runs on A
    (n x k) with the Gram matrix K = X X^T: the same iterates as on W (d x k), at n/d of the cost
    per step (here 355 texts against 4096 features)."""
    n, d = X.shape
    Y = np.eye(k)[y]
    K = X @ X.T
    A = np.zeros((n, k))
    b = np.zeros(k)
    Am, bm = A.copy(), b.copy()  # the look-ahead point
    step = 1.0 / (0.5 * (1.0 + float(np.diag(K).max(initial=0.0))) + l2)
    for t in range(1, iterations + 1):
        G = (softmax(K @ Am + bm) - Y) / n  # the gradient of W is X^T G + l2 W
        A_next = Am - step * (G + l2 * Am)
        b_next = bm - step * G.sum(axis=0)
        mom = (t - 1) / (t + 2)
        Am = A_next + mom * (A_next - A)
        bm = b_next + mom * (b_next - b)
        A, b = A_next, b_next
    return X.T @ A, b


@dataclass
class Model:
    labels: list[str]
    vocab: list[str]
    idf: np.ndarray
    W: np.ndarray
    b: np.ndarray
    n_chars: int = N_CHARS
    l2: float = L2
    iterations: int = ITERATIONS

    def features(self, texts: list[str]) -> np.ndarray:
        return weigh(counts(texts, self.vocab, self.n_chars), self.idf)

    def predict_proba(self, texts: list[str]) -> np.ndarray:
        """The numpy model's probabilities (float64): what the ONNX graph computes in float32."""
        return softmax(self.features(texts) @ self.W + self.b)

    def predict(self, texts: list[str]) -> list[str]:
        return [self.labels[i] for i in self.predict_proba(texts).argmax(axis=1)]


def train(rows: list[tuple[str, str]], n_chars: int = N_CHARS, vocab_size: int = VOCAB, l2: float = L2,
          iterations: int = ITERATIONS, labels: list[str] | None = None) -> Model:
    texts = [t for t, _ in rows]
    labels = labels or sorted({i for _, i in rows})
    y = np.array([labels.index(i) for _, i in rows])
    vocab = build_vocabulary(texts, vocab_size, n_chars)
    tf = counts(texts, vocab, n_chars)
    df = (tf > 0).sum(axis=0)
    idf = np.log((1 + len(texts)) / (1 + df)) + 1.0
    W, b = fit(weigh(tf, idf), y, len(labels), l2, iterations)
    return Model(labels, vocab, idf, W, b, n_chars, l2, iterations)


def to_onnx(model: Model) -> Any:
    """The ONNX graph of `model` (onnx.ModelProto), built with onnx.helper."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    by_len: list[list[str]] = [[g for g in model.vocab if len(g) == n] for n in range(1, MAX_GRAM + 1)]
    pool: list[str] = []
    starts: list[int] = []
    for gs in by_len:
        starts.append(len(pool))
        for g in gs:
            pool.extend(g)  # an n-gram is n consecutive pool items, one character each
    V, C = len(model.vocab), len(model.labels)

    def const(name: str, value: np.ndarray) -> Any:
        return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)

    inits = [const("one", np.array([1.0])), const("idf", model.idf), const("eps", np.array([EPS])),
             const("W", model.W), const("b", model.b),
             numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "row")]
    nodes = [
        helper.make_node("TfIdfVectorizer", ["tokens"], ["tf"], mode="TF", min_gram_length=1,
                         max_gram_length=MAX_GRAM, max_skip_count=0, pool_strings=pool, ngram_counts=starts,
                         ngram_indexes=list(range(V))),
        helper.make_node("Reshape", ["tf", "row"], ["tf_row"]),
        helper.make_node("Add", ["tf_row", "one"], ["tf1"]),
        helper.make_node("Log", ["tf1"], ["logtf"]),
        helper.make_node("Mul", ["logtf", "idf"], ["weighted"]),
        helper.make_node("ReduceL2", ["weighted"], ["norm"], keepdims=1),
        helper.make_node("Max", ["norm", "eps"], ["norm_eps"]),
        helper.make_node("Div", ["weighted", "norm_eps"], ["x"]),
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "intent", [helper.make_tensor_value_info("tokens", TensorProto.STRING, ["chars"])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [1, C])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                          producer_name="extproc.intent.train", doc_string="task intent: character 1-3-gram "
                          "log-tf idf, multinomial logistic regression")
    helper.set_model_props(m, {"labels": json.dumps(model.labels), "n_chars": str(model.n_chars)})
    onnx.checker.check_model(m)
    return m


def onnx_proba(onnx_model: Any, texts: list[str], n_chars: int) -> np.ndarray:
    """Probabilities from onnxruntime running the exported graph (one text per run, as served)."""
    import onnxruntime as ort

    from extproc.intent.classifier import tokens

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    s = ort.InferenceSession(onnx_model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return np.vstack([s.run(None, {"tokens": np.array(tokens(t, n_chars), dtype=object)})[0] for t in texts])


def evaluate(labels: list[str], truth: list[str], pred: list[str]) -> dict[str, Any]:
    k = len(labels)
    cm = np.zeros((k, k), dtype=int)
    for t, p in zip(truth, pred):
        cm[labels.index(t), labels.index(p)] += 1
    per = {}
    for i, label in enumerate(labels):
        tp, col, row = int(cm[i, i]), int(cm[:, i].sum()), int(cm[i, :].sum())
        per[label] = {"precision": round(tp / col, 4) if col else None, "recall": round(tp / row, 4) if row else None,
                      "support": row}
    acc = float(np.trace(cm)) / max(len(truth), 1)
    return {"accuracy": round(acc, 4), "per_intent": per,
            "confusion": {"rows": "true intent", "columns": "predicted intent", "labels": labels,
                          "matrix": cm.tolist()}}


def cross_validate(rows: list[tuple[str, str]], l2s: list[float], folds: int = 5, **kw: Any) -> dict[float, float]:
    """Mean accuracy per L2 strength over `folds` folds of `rows` (the training split: the held-out
    split is never used to choose settings). Folds by the same hash, so they are stable too."""
    labels = sorted({i for _, i in rows})
    fold = [int.from_bytes(hashlib.blake2b(("intent-fold:" + t).encode(), digest_size=8).digest(), "little") % folds
            for t, _ in rows]
    out = {}
    for l2 in l2s:
        accs = []
        for f in range(folds):
            tr = [r for r, g in zip(rows, fold) if g != f]
            te = [r for r, g in zip(rows, fold) if g == f]
            m = train(tr, l2=l2, labels=labels, **kw)
            accs.append(np.mean([p == t for p, (_, t) in zip(m.predict([t for t, _ in te]), te)]))
        out[l2] = round(float(np.mean(accs)), 4)
    return out


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def build(out: str | Path = DEFAULT_DIR, dataset: str | Path = DATASET, n_chars: int = N_CHARS,
          vocab_size: int = VOCAB, l2: float = L2, iterations: int = ITERATIONS) -> dict[str, Any]:
    """Train on the training split, export, evaluate on the held-out split; write intent.onnx and
    intent.json under `out`; return what intent.json holds."""
    t0 = time.perf_counter()
    raw = Path(dataset).read_bytes()
    rows = load_dataset(dataset)
    train_rows, held = split(rows)
    labels = sorted({i for _, i in rows})
    model = train(train_rows, n_chars, vocab_size, l2, iterations, labels)
    onnx_model = to_onnx(model)
    held_texts = [t for t, _ in held]
    try:
        proba = onnx_proba(onnx_model, held_texts, n_chars)
        evaluated = "onnxruntime (the exported graph)"
    except ImportError:
        proba = model.predict_proba(held_texts)
        evaluated = "numpy (onnxruntime not installed)"
    report = evaluate(labels, [i for _, i in held], [labels[i] for i in proba.argmax(axis=1)])
    train_acc = evaluate(labels, [i for _, i in train_rows], model.predict([t for t, _ in train_rows]))["accuracy"]
    meta = {
        "labels": labels, "n_chars": n_chars, "max_gram": MAX_GRAM, "vocabulary_size": len(model.vocab),
        "weighting": "log(1 + tf) * idf, L2-normalised", "classifier": "multinomial logistic regression",
        "l2": l2, "iterations": iterations,
        "dataset": str(dataset), "dataset_sha256": hashlib.sha256(raw).hexdigest(), "dataset_size": len(rows),
        "per_intent_size": dict(sorted(Counter(i for _, i in rows).items())),
        "split": f"held out when blake2b('intent-split:' + text) mod 1000 < {HELD_OUT_PER_MILLE}",
        "train_size": len(train_rows), "held_out_size": len(held),
        "train_accuracy": train_acc, "held_out_accuracy": report["accuracy"], "evaluated_with": evaluated,
        "per_intent": report["per_intent"], "confusion": report["confusion"],
        "train_seconds": round(time.perf_counter() - t0, 2),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / MODEL_FILE, onnx_model.SerializeToString())
    _write(out / META_FILE, (json.dumps(meta, ensure_ascii=False, indent=1) + "\n").encode("utf-8"))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.intent.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="directory for intent.onnx and intent.json")
    ap.add_argument("--dataset", default=str(DATASET), help="JSON lines {\"text\": ..., \"intent\": ...}")
    ap.add_argument("--n-chars", type=int, default=N_CHARS, help="characters of each text the model reads")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="n-grams kept (most frequent in training texts)")
    ap.add_argument("--l2", type=float, default=L2, help="L2 penalty on the weights")
    ap.add_argument("--iterations", type=int, default=ITERATIONS)
    ap.add_argument("--cv", action="store_true", help="first print 5-fold CV accuracy on the training split "
                    "for several L2 strengths")
    a = ap.parse_args(argv)
    try:
        return _run(a)
    except (OSError, ValueError) as e:
        print(f"python -m extproc.intent.train: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    if a.cv:
        train_rows, _ = split(load_dataset(a.dataset))
        for l2, acc in cross_validate(train_rows, [1e-2, 3e-3, 1e-3, 3e-4, 1e-4], n_chars=a.n_chars,
                                      vocab_size=a.vocab, iterations=a.iterations).items():
            print(f"cv l2={l2:g}: accuracy {acc:.3f}")
    meta = build(a.out, a.dataset, a.n_chars, a.vocab, a.l2, a.iterations)
    print(f"intent classifier: {meta['dataset_size']} texts ({meta['train_size']} train, {meta['held_out_size']} "
          f"held out), {len(meta['labels'])} intents, vocabulary {meta['vocabulary_size']}; held-out accuracy "
          f"{meta['held_out_accuracy']:.3f} (train {meta['train_accuracy']:.3f}); {meta['train_seconds']} s; "
          f"wrote {Path(a.out) / MODEL_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
