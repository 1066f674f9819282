"""Helpers for the adapter bundle tests: a bundle directory for one llm route, built into a ZIP."""

from __future__ import annotations

import json
from pathlib import Path

from canary.bundle import build

CREATED = "2026-12-01T12:00:00Z"


def transform(tag: str) -> str:
    """A route transform that answers the model's `text` and names the bundle version in `v`."""
    return '{"summary": $.output.text, "v": "%s"}' % tag


def bundle_dir(root: Path, *, route: str = "summarize", tag: str = "one", golden_v: str | None = None,
               golden: bool = True, doc: str | None = None, extra: dict[str, bytes] | None = None) -> Path:
    """bundle.yaml with `route`'s transform, and one golden case expecting `v: golden_v` (default `tag`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "bundle.yaml").write_text(doc if doc is not None else
                                      f"routes:\n  {route}:\n    transform: '{transform(tag)}'\n")
    if golden:
        (root / "golden").mkdir(exist_ok=True)
        (root / "golden" / "basic.yaml").write_text(json.dumps({
            "route": route, "request": {"query": "hello"}, "output": {"text": "hi"},
            "response": {"summary": "hi", "v": golden_v or tag}}))
    for rel, data in (extra or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def make_bundle(tmp: Path, version: str, *, name: str = "summ", sign_key=None, **kw) -> Path:
    src = bundle_dir(tmp / f"src-{name}-{version}", **kw)
    out = tmp / f"{name}-{version}.zip"
    build(src, out, name=name, version=version, created=CREATED, sign_key=sign_key)
    return out
