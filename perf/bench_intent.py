"""Benchmark: what the task-intent classifier costs per request, in microseconds.

What it measures, in one process on one core (onnxruntime with one intra-op thread, as a worker
runs it): `IntentClassifier.classify(text)` on every held-out text of the shipped set, `--rounds`
times each (interleaved: round 1 over all texts, then round 2, ...), timed per call with
`time.perf_counter_ns`; p50, p90, p99 and mean over all calls. Beside it, the two parts of a call
(building the bounded token array alone, and `InferenceSession.run` on a prepared array), a 1 MB
prompt against its first N characters alone (the same cost: nothing past them is read), the model
load time and size. The model is trained first into a temporary directory with the defaults
(`extproc.intent.train.build`), so the figures are those of what `make setup` builds; `--model DIR`
measures another build.
Prints a table and, unless --no-write, appends a dated section to perf/RESULTS.md.

    .venv/bin/python perf/bench_intent.py              # measure and append
    .venv/bin/python perf/bench_intent.py --no-write   # print only
    .venv/bin/python perf/bench_intent.py --rounds 5   # shorter

Cost: about 10 s (training 2 s, 20 rounds over 92 texts).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import benchenv  # noqa: E402  (perf/ is this script's folder, on sys.path)

import numpy as np  # noqa: E402

from extproc.intent.classifier import IntentClassifier  # noqa: E402
from extproc.intent.train import build, load_dataset, split  # noqa: E402



def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed(fn, items, rounds: int) -> list[float]:
    """Microseconds per call of fn(item), every item `rounds` times."""
    out = []
    for _ in range(rounds):
        for x in items:
            t = time.perf_counter_ns()
            fn(x)
            out.append((time.perf_counter_ns() - t) / 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", help="a built model directory (default: train one now, into a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="do not append to perf/RESULTS.md")
    a = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model) if a.model else Path(tmp)
        if not a.model:
            t = time.perf_counter()
            meta = build(model_dir)
            train_s = time.perf_counter() - t
        else:
            import json
            meta, train_s = json.loads((model_dir / "intent.json").read_text()), None
        size_kb = (model_dir / "intent.onnx").stat().st_size / 1024
        t = time.perf_counter()
        clf = IntentClassifier.load(model_dir)
        load_ms = (time.perf_counter() - t) * 1000

    _, held = split(load_dataset())
    texts = [t for t, _ in held]
    for t in texts[:10]:  # warm-up
        clf.classify(t)
    accuracy = sum(clf.classify(t)[0] == i for t, i in held) / len(held)
    session, name = clf._session, clf._input
    arrays = [np.array(clf.tokens(t), dtype=object) for t in texts]
    big = (texts[0] + " ") * (1_000_000 // (len(texts[0]) + 1) + 1)
    rows = [
        ("classify(text): a request's whole cost", timed(clf.classify, texts, a.rounds)),
        ("  of which: bounded token array (Python + numpy)",
         timed(lambda t: np.array(clf.tokens(t), dtype=object), texts, a.rounds)),
        ("  of which: InferenceSession.run", timed(lambda x: session.run(None, {name: x}), arrays, a.rounds)),
        ("classify(1 MB prompt)", timed(clf.classify, [big], max(20, a.rounds))),
        ("classify(its first N characters alone)", timed(clf.classify, [big[:clf.n_chars]], max(20, a.rounds))),
    ]
    lens = [len(clf.tokens(t)) for t in texts]
    table = ["| what | calls | p50 µs | p90 µs | p99 µs | mean µs | max µs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, xs in rows:
        table.append(f"| {label} | {len(xs)} | {pct(xs, .5):.1f} | {pct(xs, .9):.1f} | {pct(xs, .99):.1f} | "
                     f"{statistics.fmean(xs):.1f} | {max(xs):.0f} |")
    print("\n".join(table))
    p50, p99 = pct(rows[0][1], .5), pct(rows[0][1], .99)
    summary = (f"Per request the classifier costs {p50:.0f} µs p50 and {p99:.0f} µs p99 of one core here "
               f"(held-out texts of {min(lens)} to {max(lens)} characters as read, median "
               f"{statistics.median(lens):.0f}; the bound is {clf.n_chars}); a 1 MB prompt costs "
               f"{pct(rows[3][1], .5):.0f} µs p50 against {pct(rows[4][1], .5):.0f} µs for its first {clf.n_chars} "
               f"characters alone (the classifier reads only those). Model "
               f"{size_kb:.0f} KB, loaded in {load_ms:.1f} ms; held-out accuracy {accuracy:.3f} "
               f"({len(held)} texts).")
    whole = rows[0][1]
    if statistics.fmean(whole) > pct(whole, .9):
        summary += (f" The mean is above the p90: a few calls (the slowest {max(whole) / 1000:.1f} ms) were "
                    "descheduled, the machine's other processes competing for its cores (load average above).")
    print("\n" + summary)
    if not a.no_write:
        try:
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        except OSError:
            load = "unknown"
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        trained = f"trained by the script in {train_s:.1f} s" if train_s is not None else f"from {a.model}"
        text = f"""
## {now}: bench_intent (task-intent classifier cost per request)

- Machine: {benchenv.cpu()}; kernel {platform.release()}; Python {platform.python_version()}; load average {load}
- Code: git {benchenv.git_revision()}
- Command: `python perf/bench_intent.py --rounds {a.rounds}` (one process, onnxruntime with 1 intra-op thread)
- Model: {len(meta['labels'])} intents, character 1-3-grams of the first {meta['n_chars']} characters, vocabulary
  {meta['vocabulary_size']}, logistic regression; {trained}; inputs: the {len(held)} held-out texts, each
  {a.rounds} times, interleaved.

{chr(10).join(table)}

{summary}
"""
        benchenv.append_results(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
