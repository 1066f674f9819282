"""Picker `max-score-picker`: the candidate with the highest total score, ties broken at random; then the next best.

What: orders the candidates a profile's filters kept by the summed, weighted, normalised scores of
its scorers (`extproc/scheduling/profile.py`), highest first; equal totals are ordered at random
(a per-worker `random.Random` seeded from `os.urandom`, so workers do not break ties alike and a
profile without scorers spreads requests evenly). The first is the pick, the next `fallbacks`
are the endpoints Envoy tries if the pick is gone. The default picker of a profile that lists none.
Formula: order = sort by (-total(e), u_e), u_e ~ U(0, 1) per decision; names order[: 1 + fallbacks].
Parameters: `fallbacks` (int, default 2, 0 to 16): how many endpoints to name after the pick.
Data consumed: the profile's totals only. Cost: one draw per candidate and a partial selection of the
first 1 + fallbacks (`pick_ranked`, which the profile calls with its totals as a list in candidate order:
in C, `_score.rank`, when built; about 1 us for 8 with the draws), or one sort of the candidates in
Python (`pick`, given a dict of totals).
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar, Mapping

from pydantic import Field

from extproc.scheduling import Parameters, Plugin

try:  # the ranking in C (setup.py builds it; optional): the same order from the same draws
    from extproc.scheduling._score import rank as _rank
except ImportError:
    _rank = None


class MaxScorePickerParameters(Parameters):
    fallbacks: int = Field(default=2, ge=0, le=16)


class MaxScorePicker(Plugin):
    type: ClassVar[str] = "max-score-picker"
    slot: ClassVar[str] = "picker"
    Parameters: ClassVar[type] = MaxScorePickerParameters

    def __init__(self, name: str, params: MaxScorePickerParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self.rng = random.Random(int.from_bytes(os.urandom(8), "big"))  # per worker; kept across reloads

    def pick(self, ctx: Any, scored: Mapping[str, float]) -> tuple[str, ...]:
        rnd = self.rng.random
        order = sorted(scored, key=lambda e: (-scored[e], rnd()))
        return tuple(order[: 1 + self.params.fallbacks])

    def pick_ranked(self, ctx: Any, candidates: tuple[str, ...], totals: list[float]) -> tuple[str, ...]:
        """`pick(ctx, dict(zip(candidates, totals)))` for distinct candidates: the same draws, the same order."""
        if _rank is not None:
            return _rank(candidates, totals, self.rng.random, 1 + self.params.fallbacks)
        return pick_ranked_py(candidates, totals, self.rng.random, 1 + self.params.fallbacks)


def pick_ranked_py(candidates: tuple[str, ...], totals: list[float], rnd: Any, k: int) -> tuple[str, ...]:
    """The first `k` candidates by (-total, rnd()) with one draw per candidate in order: the reference of
    `_score.rank`."""
    order = sorted(range(len(candidates)), key=lambda i: (-totals[i], rnd()))
    return tuple(candidates[i] for i in order[:k])
