"""Stages of the request pipeline, one per file; which ones a route runs is its kind's
(`extproc/kinds.py`, the table there)."""

from __future__ import annotations

from typing import Any

from extproc.pipeline import Pipeline


def build_pipeline(route: Any) -> Pipeline:
    from extproc.kinds import kind_specs

    spec = kind_specs().get(route.kind)
    if spec is None:
        raise ValueError(f"no pipeline for route kind {route.kind!r}")
    return Pipeline(spec.stages(route))
