"""Precision and recall of the contract aligner on a labelled set of field pairs.

What: `evaluate_pairs(path)` reads a labelled set (tests/data/openapi/field-pairs.yaml is ours),
aligns each case with `extproc.semantic.align.align_schemas` and counts, per split and overall:

* a **true positive** when the proposed adapter field is the labelled one,
* a **false positive** when a field gets a proposal that is not its label (including a proposal
  for a field labelled "no counterpart"),
* a **false negative** for every labelled pair not proposed (unmatched, or matched wrongly),

then precision = TP / (TP + FP), recall = TP / (TP + FN). Ambiguous matches count as proposals
(the top choice), so the figures are what a person gets before reviewing the report; the number
of ambiguous flags is reported beside them.

Run ``python -m extproc.semantic.evaluate [PAIRS.yaml] [--sweep] [-v]`` to print the table that
docs/semantic.md keeps (``--sweep``: other thresholds and an exact-name baseline; ``-v``: every
disagreement); a test recomputes it and compares with the docs.

A case is ``{id, split, legacy: {spec, schema, only?}, adapter: <JSON Schema>, pairs: {legacy
dotted path: adapter dotted path | null}}``; ``spec`` is an OpenAPI file next to the pairs file,
``schema`` a name in its ``components.schemas`` (``definitions`` for Swagger 2.0) and ``only``
limits it to some top-level properties.

Cost: one spec load per distinct file (cached for the call) plus one alignment per case; about a
second for our set, most of it reading the Docker spec.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.semantic.align import Alignment, align_schemas
from extproc.semantic.openapi import Resolver, Spec, load_spec
from extproc.semantic.schemas import to_json_schema

__all__ = ["CaseResult", "Score", "evaluate_pairs", "legacy_schema", "main"]

DEFAULT_PAIRS = Path(__file__).resolve().parents[2] / "tests" / "data" / "openapi" / "field-pairs.yaml"


@dataclass
class Score:
    """Counts and ratios for one split (or all)."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    labelled: int = 0
    positives: int = 0
    ambiguous: int = 0

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    def add(self, other: Score) -> None:
        for k in ("tp", "fp", "fn", "labelled", "positives", "ambiguous"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class CaseResult:
    """One case: its score and the disagreements, for debugging the matcher."""

    id: str
    split: str
    score: Score
    wrong: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # (legacy, gold, proposed)
    alignment: Alignment | None = None


def legacy_schema(spec: Spec, name: str, only: list[str] | None = None) -> dict:
    """The self-contained JSON Schema of ``name`` in ``spec``'s components (or definitions)."""
    holder = spec.doc.get("definitions") if spec.version == "2.0" else (spec.doc.get("components") or {}).get("schemas")
    if not isinstance(holder, dict) or name not in holder:
        raise KeyError(f"{spec.source}: no schema named {name!r}")
    pointer = ("/definitions/" if spec.version == "2.0" else "/components/schemas/") + name
    schema = to_json_schema(Resolver(spec), holder[name], version=spec.version, pointer=pointer)
    if only:
        props = schema.get("properties") or {}
        missing = [o for o in only if o not in props]
        if missing:
            raise KeyError(f"{spec.source}: schema {name!r} has no properties {missing}")
        schema = {**schema, "properties": {k: props[k] for k in only}}
        if "required" in schema:
            schema["required"] = [r for r in schema["required"] if r in only]
    return schema


def _score_case(alignment: Any, gold: dict[str, Any]) -> tuple[Score, list]:
    proposed = alignment.pairs()
    ambiguous = {m.legacy.dotted for m in alignment.matches if m.ambiguous}
    s = Score()
    wrong = []
    for legacy, target in gold.items():
        got = proposed.get(legacy)
        s.labelled += 1
        if target is not None:
            s.positives += 1
        if legacy in ambiguous:
            s.ambiguous += 1
        if got is not None and got == target:
            s.tp += 1
            continue
        if got is not None:
            s.fp += 1
        if target is not None:
            s.fn += 1
        if got is not None or target is not None:
            wrong.append((legacy, target, got))
    unlabelled = set(proposed) - set(gold)
    if unlabelled:
        raise ValueError(f"proposals for unlabelled legacy fields {sorted(unlabelled)}: label every leaf")
    return s, wrong


class _Baseline:
    """Exact-name matching (lower case, separators removed), the yardstick in docs/semantic.md."""

    def __init__(self, alignment: Alignment) -> None:
        by_name: dict[str, list[str]] = {}
        for f in alignment.adapter_fields:
            by_name.setdefault(_plain(f.name), []).append(f.dotted)
        self.proposed = {f.dotted: by_name[_plain(f.name)][0] for f in alignment.legacy_fields
                         if len(by_name.get(_plain(f.name), ())) == 1}
        self.matches = ()

    def pairs(self) -> dict[str, str]:
        return self.proposed


def _plain(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def evaluate_pairs(path: str | Path = DEFAULT_PAIRS, *, min_score: float = 0.5, margin: float = 0.05,
                   baseline: bool = False) -> tuple[dict[str, Score], list[CaseResult]]:
    """``({split: Score, "all": Score}, [CaseResult])`` for the labelled set at ``path``.

    ``baseline=True`` scores exact-name matching instead of the aligner (for comparison).
    """
    path = Path(path)
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    specs: dict[str, Spec] = {}
    totals: dict[str, Score] = {"all": Score()}
    results = []
    for case in data["cases"]:
        src = case["legacy"]
        if src["spec"] not in specs:
            specs[src["spec"]] = load_spec(path.parent / src["spec"])
        legacy = legacy_schema(specs[src["spec"]], src["schema"], src.get("only"))
        alignment = align_schemas(legacy, case["adapter"], legacy_name=f"{src['spec']}#{src['schema']}",
                                  adapter_name=case["id"], legacy_root=src["schema"], adapter_root="",
                                  min_score=min_score, margin=margin)
        leaves = {f.dotted for f in alignment.legacy_fields}
        gold = {str(k): v for k, v in case["pairs"].items()}
        if leaves != set(gold):
            raise ValueError(f"case {case['id']}: labels {sorted(set(gold) ^ leaves)} do not match the legacy "
                             "schema's leaf fields")
        score, wrong = _score_case(_Baseline(alignment) if baseline else alignment, gold)
        split = case.get("split", "dev")
        totals.setdefault(split, Score()).add(score)
        totals["all"].add(score)
        results.append(CaseResult(case["id"], split, score, wrong, alignment))
    return totals, results


def format_table(totals: dict[str, Score]) -> str:
    """The Markdown table docs/semantic.md keeps (splits in a fixed order)."""
    lines = ["| split | labelled fields | gold pairs | proposed | correct | precision | recall | F1 | ambiguous flags |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for split in sorted(totals, key=lambda s: ({"dev": 0, "holdout": 1, "all": 9}.get(s, 5), s)):
        s = totals[split]
        lines.append(f"| {split} | {s.labelled} | {s.positives} | {s.tp + s.fp} | {s.tp} | {s.precision:.3f} | "
                     f"{s.recall:.3f} | {s.f1:.3f} | {s.ambiguous} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    files = [a for a in argv if not a.startswith("-")]
    path = Path(files[0]) if files else DEFAULT_PAIRS
    totals, results = evaluate_pairs(path)
    print(format_table(totals))
    if "--sweep" in argv:
        print("\n| min_score | precision | recall | F1 | proposed |\n|---:|---:|---:|---:|---:|")
        for threshold in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
            t = evaluate_pairs(path, min_score=threshold)[0]["all"]
            print(f"| {threshold} | {t.precision:.3f} | {t.recall:.3f} | {t.f1:.3f} | {t.tp + t.fp} |")
        b = evaluate_pairs(path, baseline=True)[0]["all"]
        print(f"| exact names only | {b.precision:.3f} | {b.recall:.3f} | {b.f1:.3f} | {b.tp + b.fp} |")
    if "-v" in argv or "--verbose" in argv:
        for r in results:
            for legacy, gold, got in r.wrong:
                print(f"  {r.split:7s} {r.id}: {legacy}: gold {gold}, proposed {got}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
