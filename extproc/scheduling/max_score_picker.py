"""Picker `max-score-picker`: the candidate with the highest total score, ties broken at random; then the next best.

What: orders the candidates a profile's filters kept by the summed, weighted, normalised scores of
its scorers (`extproc/scheduling/profile.py`), highest first; equal totals are ordered at random
(a per-worker `random.Random` seeded from `os.urandom`, so workers do not break ties alike and a
profile without scorers spreads requests evenly). The first is the pick, the next `fallbacks`
are the endpoints Envoy tries if the pick is gone. The default picker of a profile that lists none.
Formula: order = sort by (-total(e), u_e), u_e ~ U(0, 1) per decision; names order[: 1 + fallbacks].
Parameters: `fallbacks` (int, default 2, 0 to 16): how many endpoints to name after the pick.
Data consumed: the profile's totals only. Cost: one sort of the candidates (about 1 us for 8).
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar, Mapping

from pydantic import Field

from extproc.scheduling import Parameters, Plugin


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
