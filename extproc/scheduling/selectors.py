"""Shared pieces of the constraint filters (`model-version-filter`, `tenant-pool-filter`,
`intent-filter`) and `score-route-scorer`; not a plugin.

What: `Selector`, the parameter shape that names a set of endpoints by their configured labels:
`{matchLabels: {k: v, ...}}` (every pair must be present with exactly that value, the Kubernetes
rule; `{}` matches every endpoint, labelled or not) or `{anyOf: [{matchLabels: ...}, ...]}` (at
least one of the sets matches). `split_version(model)` reads a version off a model name:
`name@version` (anything after the last `@`), or `name:version` when what follows the last `:`
looks like a version (`v2.1`, `2.1`, `3`; so `llama3:8b` and OpenAI's `ft:...:org:id` names carry
none; memoised, model names are few). `versions_of(label)` splits an endpoint's version label (`v2.1` or `v2.1,v1.9`).
`same_version(a, b)` compares versions with an optional leading `v` ignored (`v2.1` ==
`2.1`).
Cost: a dict lookup per label per candidate; `split_version` one regex match per request.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Mapping

from pydantic import Field, model_validator

from extproc.scheduling import Parameters

_VERSION = re.compile(r"^[vV]?\d+(\.\d+)*$")


class LabelSet(Parameters):
    match_labels: dict[str, str] = Field(alias="matchLabels")


class Selector(Parameters):
    """`{matchLabels: {...}}` or `{anyOf: [{matchLabels: {...}}, ...]}`, exactly one of the two."""

    match_labels: dict[str, str] | None = Field(default=None, alias="matchLabels")
    any_of: tuple[LabelSet, ...] | None = Field(default=None, alias="anyOf", min_length=1)

    @model_validator(mode="after")
    def _one(self) -> "Selector":
        if (self.match_labels is None) == (self.any_of is None):
            raise ValueError("give exactly one of matchLabels or anyOf")
        return self

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        have = labels or {}
        if self.match_labels is not None:
            return all(have.get(k) == v for k, v in self.match_labels.items())
        return any(all(have.get(k) == v for k, v in s.match_labels.items()) for s in self.any_of or ())

    def keep(self, labels: Mapping[str, Mapping[str, str]], candidates: tuple[str, ...]) -> list[str]:
        return [e for e in candidates if self.matches(labels.get(e))]


@lru_cache(maxsize=1024)
def split_version(model: str | None) -> tuple[str | None, str | None]:
    """(name, version) of a model name; version None when the name carries none."""
    if not model:
        return model, None
    name, at, version = model.rpartition("@")
    if at and name and version:
        return name, version
    name, colon, version = model.rpartition(":")
    if colon and name and _VERSION.match(version):
        return name, version
    return model, None


def norm_version(version: str) -> str:
    v = version.strip()
    return v[1:] if len(v) > 1 and v[0] in "vV" and v[1].isdigit() else v


def same_version(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and norm_version(a) == norm_version(b)


def versions_of(value: str | None) -> tuple[str, ...]:
    """The versions an endpoint's version label lists (`v2.1` or `v2.1,v1.9`)."""
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def request_version(request: object) -> str | None:
    """The version the request asks for, from its model name (None: it names none)."""
    return split_version(getattr(request, "model", None))[1] if request is not None else None


__all__ = ["Selector", "LabelSet", "split_version", "norm_version", "same_version", "request_version",
           "versions_of"]


def positive_label(labels: Mapping[str, Mapping[str, str]], endpoint: str, name: str | None) -> float | None:
    """The endpoint's label `name` as a positive finite number, else None (absent, not a number, <= 0,
    inf or nan): how capacity, speed and KV-size labels are read."""
    if not name:
        return None
    raw = (labels.get(endpoint) or {}).get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if v > 0 and math.isfinite(v) else None



class PerCandidates:
    """A value derived from the endpoints' labels for one candidate tuple (say each candidate's capacity),
    computed once per (candidate tuple, labels object) and then reused: labels change only with a
    reload (a new labels object), and a backend's candidate tuples are few. At most `limit` tuples are
    kept (the oldest computed goes first). One per plugin instance: `get(labels, candidates, compute)`
    returns `compute(labels, candidates)`, computed at most once while the labels object is the same."""

    __slots__ = ("_found", "limit")

    def __init__(self, limit: int = 1024) -> None:
        self._found: dict[tuple[str, ...], tuple[object, object]] = {}
        self.limit = limit

    def get(self, labels, candidates, compute):
        found = self._found.get(candidates)
        if found is not None and found[0] is labels:
            return found[1]
        value = compute(labels, candidates)
        self._found[candidates] = (labels, value)
        if len(self._found) > self.limit:
            del self._found[next(iter(self._found))]
        return value

    def clear(self) -> None:
        self._found.clear()
