"""Filter `model-version-filter`: keeps the endpoints whose labels meet the requested model version's hardware constraints.

What: some model versions run only on some hardware (the brief's §2.2: v2.1 is deployed only on
TensorRT-8.6 A100 NVLink nodes; v1.9 may run degraded on a V100 single card, at 37% lower
throughput). The constraints are declared per version as label selectors over the endpoints'
configured labels (`backends[].endpoints[].labels`). The version is the request's, from its model
name (`name@version`, or `name:version` when the suffix looks like a version: `llama:2.1`); a
request that names none is checked endpoint by endpoint against the version the endpoint itself
declares in its `versionLabel` label (one version, or a comma list: each listed version's constraint
must hold), so a v2.1 deployment mislabelled onto a V100 is never used.
A version with no declared constraint (or none at all) restricts nothing. Versions compare with
a leading `v` ignored (`2.1` is `v2.1`). When nothing is left the profile refuses the request
(503 `no_capacity`, 429 for sheddable requests).
Formula: with a requested version v, keep e iff constraints[v] is absent or matches labels(e);
without, keep e iff for every v listed in labels(e)[versionLabel] constraints[v] is absent or matches (matchLabels: every pair present and equal; anyOf: one of the sets does).
Parameters: `constraints` ({version: {matchLabels: {...}} | {anyOf: [{matchLabels: {...}}, ...]}},
at least one); `versionLabel` (default `model-version`).
Worked config (the brief's constraints; the 37% throughput cost of v1.9 on a V100 is a scoring
matter, not a filter's: `score-route-scorer` gives a single card no NVLink bonus):
```yaml
- name: versions
  type: model-version-filter
  parameters:
    constraints:
      "v2.1": {matchLabels: {accelerator: a100, tensorrt: "8.6", nvlink: "true"}}
      "v1.9": {anyOf: [{matchLabels: {accelerator: a100}}, {matchLabels: {accelerator: v100}}]}
```
Data consumed: the request's model name, endpoint labels. Cost: one memoised regex match per
request, a dict lookup per label per candidate (about 5 us for 4 candidates and the brief's
config on this 2-core shared machine, timeit).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from extproc.scheduling import Parameters, Plugin
from extproc.scheduling.selectors import Selector, norm_version, request_version, versions_of


class ModelVersionFilterParameters(Parameters):
    constraints: dict[str, Selector] = Field(min_length=1)
    version_label: str = Field(default="model-version", alias="versionLabel", min_length=1)

    @field_validator("constraints")
    @classmethod
    def _distinct(cls, v: dict[str, Selector]) -> dict[str, Selector]:
        seen: dict[str, str] = {}
        for key in v:
            n = norm_version(key)
            if not n:
                raise ValueError("a version must not be empty")
            if n in seen:
                raise ValueError(f"versions {seen[n]!r} and {key!r} are the same version")
            seen[n] = key
        return v


class ModelVersionFilter(Plugin):
    type: ClassVar[str] = "model-version-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = ModelVersionFilterParameters

    def __init__(self, name: str, params: Any, runtime: Any):
        super().__init__(name, params, runtime)
        self._index(params)

    def configure(self, old: Any, new: Any) -> None:
        super().configure(old, new)
        self._index(new)

    def _index(self, params: Any) -> None:
        self._by_version = {norm_version(k): s for k, s in params.constraints.items()}

    def constraint(self, version: str | None) -> Selector | None:
        return self._by_version.get(norm_version(version)) if version else None

    def filter(self, ctx: Any, candidates: tuple[str, ...]) -> list[str] | tuple[str, ...]:
        labels = ctx.labels
        version = request_version(ctx.request)
        if version is not None:
            sel = self.constraint(version)
            return candidates if sel is None else sel.keep(labels, candidates)
        label = self.params.version_label
        out = []
        for e in candidates:
            have = labels.get(e) or {}
            if all(sel is None or sel.matches(have) for sel in map(self.constraint, versions_of(have.get(label)))):
                out.append(e)
        return out
