"""Picker `random-picker`: a uniformly random candidate, and random fallbacks; scores are ignored.

What: the baseline policy (and the way to spread over what a profile's filters kept without
ranking it). A per-worker `random.Random` seeded from `os.urandom`.
Formula: order = a uniform random sample without replacement of 1 + fallbacks candidates.
Parameters: `fallbacks` (int, default 2, 0 to 16).
Data consumed: none. Cost: one `random.sample` (under 1 us for 8 candidates).
"""

from __future__ import annotations

import os
import random
from typing import Any, ClassVar, Mapping

from pydantic import Field

from extproc.scheduling import Parameters, Plugin


class RandomPickerParameters(Parameters):
    fallbacks: int = Field(default=2, ge=0, le=16)


class RandomPicker(Plugin):
    type: ClassVar[str] = "random-picker"
    slot: ClassVar[str] = "picker"
    Parameters: ClassVar[type] = RandomPickerParameters

    def __init__(self, name: str, params: RandomPickerParameters, runtime: Any):
        super().__init__(name, params, runtime)
        self.rng = random.Random(int.from_bytes(os.urandom(8), "big"))

    def pick(self, ctx: Any, scored: Mapping[str, float]) -> tuple[str, ...]:
        candidates = list(scored)
        return tuple(self.rng.sample(candidates, min(len(candidates), 1 + self.params.fallbacks)))
