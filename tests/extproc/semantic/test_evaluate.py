"""The matcher's precision and recall on the labelled set: recomputed, and equal to what the docs say."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.semantic.evaluate import DEFAULT_PAIRS, evaluate_pairs, format_table

DOCS = Path(__file__).resolve().parents[3] / "docs" / "semantic.md"


@pytest.fixture(scope="module")
def evaluation():
    return evaluate_pairs(DEFAULT_PAIRS)


def documented_rows() -> dict[str, dict[str, float]]:
    """Rows of the table after the ``<!-- matcher-quality -->`` marker in docs/semantic.md."""
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("<!-- matcher-quality -->", 1)[1]
    rows = {}
    for line in section.splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("dev", "holdout", "all"):
            rows[cells[0]] = {"labelled": int(cells[1]), "gold": int(cells[2]), "proposed": int(cells[3]),
                              "correct": int(cells[4]), "precision": float(cells[5]), "recall": float(cells[6])}
    return rows


def test_set_is_large_enough(evaluation):
    totals, results = evaluation
    assert totals["all"].positives >= 60
    assert {r.split for r in results} == {"dev", "holdout"}


def test_docs_state_the_measured_precision_and_recall(evaluation):
    totals, _ = evaluation
    rows = documented_rows()
    assert set(rows) == {"dev", "holdout", "all"}, "docs/semantic.md lost its matcher-quality table"
    for split, row in rows.items():
        s = totals[split]
        assert row["precision"] == pytest.approx(s.precision, abs=0.0005), (split, format_table(totals))
        assert row["recall"] == pytest.approx(s.recall, abs=0.0005), (split, format_table(totals))
        assert (row["labelled"], row["gold"], row["proposed"], row["correct"]) == (
            s.labelled, s.positives, s.tp + s.fp, s.tp), format_table(totals)


def test_score_arithmetic(evaluation):
    totals, results = evaluation
    assert sum(r.score.tp for r in results) == totals["all"].tp
    s = totals["all"]
    assert s.precision == s.tp / (s.tp + s.fp) and s.recall == s.tp / (s.tp + s.fn)
    for r in results:
        for legacy, gold, got in r.wrong:
            assert gold != got
