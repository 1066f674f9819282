"""Filter `label-filter`: keeps the endpoints whose configured labels match `matchLabels`.

What: endpoint labels come from the config (`backends[].endpoints[]` objects: `{address, labels}`),
so a profile can restrict a route to, say, the A100 nodes or the endpoints of one model version.
Every key of `matchLabels` must be present on the endpoint with exactly that value (the Kubernetes
label-selector rule); an endpoint without labels matches nothing. When no candidate matches, the
profile refuses the request (503 `no_capacity`, 429 for sheddable requests), it does not fall back.
Formula: keep e iff for all (k, v) in matchLabels: labels(e).get(k) == v.
Parameters: `matchLabels` ({label: value}, at least one).
Data consumed: endpoint labels (`backend.endpoint_labels`, from the snapshot). Cost: a dict lookup per label per candidate.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from extproc.scheduling import Parameters, Plugin


class LabelFilterParameters(Parameters):
    match_labels: dict[str, str] = Field(alias="matchLabels", min_length=1)


class LabelFilter(Plugin):
    type: ClassVar[str] = "label-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = LabelFilterParameters

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str]:
        want = self.params.match_labels.items()
        labels = ctx.labels
        out = []
        for e in candidates:
            have = labels.get(e)
            if have and all(have.get(k) == v for k, v in want):
                out.append(e)
        return out
