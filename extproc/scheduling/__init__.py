"""Plugins of the dispatch slot, declared in the config's `plugins:` section, grouped into scheduling profiles.

What: `plugin_types()` is the explicit registry (type name -> class; no import side effects). A
plugin class has `type` (its config name), `slot`, `Parameters` (a strict pydantic model: the
config's `parameters` are validated against it at load, errors with file:line), and is built
once per worker by the `Runtime` as `cls(name, params, runtime)`; it lives across config
reloads: on a reload the runtime calls `configure(old_params, new_params)` and the plugin keeps
whatever state is still valid (the mitmproxy `configure(updated)` rule).

Slots (the llm-d / Gateway API Inference Extension endpoint-picker shape):
- `filter`: `filter(ctx, candidates) -> subset` (the endpoints that may serve this request);
- `scorer`: `score(ctx, candidates) -> {endpoint: raw score}`; the framework normalises each
  scorer's output to [0, 1] (min-max over the candidates, or only a clamp for a class with
  `bounded = True`), multiplies it by the scorer's weight and sums;
- `picker`: `pick(ctx, scored) -> (pick, fallback, ...)` from the summed scores.
Optional on any filter or scorer: `picked(ctx, endpoint)`, called by the profile after the
picker with the chosen endpoint (a learned index records where the request went: GIE's
PreRequest); `consumes` (class attribute, e.g. `("engine_metrics",)`): the signals it reads, so
the runtime scrapes engine metrics only for configs with a plugin that needs them
(`extproc/scheduling/signals.py`; read as `ctx.runtime.signals`).
A scheduling profile (`spec.schedulingProfiles`, `extproc/scheduling/profile.py`) runs filters
-> scorers -> one picker. A route names one profile, or one picker: a *standalone* picker
(`standalone = True`: `least-in-flight`, `pinned-endpoint`, which order endpoints themselves with
`pick(state, backend, endpoints)`), or a scoring picker, which then runs as a profile of its own.
```yaml
spec:
  plugins:
    - {type: label-filter, name: a100, parameters: {matchLabels: {gpu: a100}}}
    - {type: in-flight-scorer}                  # name defaults to the type
    - {type: max-score-picker, parameters: {fallbacks: 1}}
    - {name: canary-host, type: pinned-endpoint, parameters: {endpoint: "10.0.0.7:8000"}}
  schedulingProfiles:
    - name: default
      plugins: [{pluginRef: a100}, {pluginRef: in-flight-scorer, weight: 2}, {pluginRef: max-score-picker}]
  routes:
    - {path: /v1/, match: prefix, kind: openai, target: llm, plugins: [default]}
```
Without a picker or profile the processor names no endpoint and Envoy's own balancing (least
request over the cluster) chooses: the fallback of the endpoint-picker protocol.
Cost: per plugin, its own docstring says; the framework's own cost is in profile.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Iterable, Mapping, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

SLOTS = ("filter", "scorer", "picker")


class Parameters(BaseModel):
    """Base of every plugin's parameters: strict (unknown keys refused) and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Plugin:
    """What every plugin has: its name, its parameters and the worker's runtime; `configure` takes the
    new parameters (a plugin with state to keep or rebuild on a reload overrides it). A plugin that
    learns from finished requests defines `on_done(state, outcome)`: it is registered on the runtime's
    lifecycle observers when the plugin is built and removed by `close()` (which the runtime calls when
    the plugin leaves the config)."""

    standalone: ClassVar[bool] = False  # a picker that orders endpoints itself: pick(state, backend, endpoints)
    bounded: ClassVar[bool] = False  # a scorer whose raw scores are already in [0, 1]: only clamped
    consumes: ClassVar[tuple[str, ...]] = ()  # signals read ("engine_metrics": the runtime scrapes for it)

    def __init__(self, name: str, params: Any, runtime: Any):
        self.name = name
        self.params = params
        self.runtime = runtime
        on_done = getattr(self, "on_done", None)
        self._lifecycle = getattr(runtime, "lifecycle", None) if on_done is not None else None
        if self._lifecycle is not None:
            self._lifecycle.observers.append(on_done)

    def configure(self, old: Any, new: Any) -> None:
        self.params = new

    def close(self) -> None:
        lifecycle = self._lifecycle
        if lifecycle is not None and self.on_done in lifecycle.observers:  # type: ignore[attr-defined]
            lifecycle.observers.remove(self.on_done)  # type: ignore[attr-defined]


@dataclass(slots=True)
class SchedulingContext:
    """What a filter, scorer or picker knows of one decision, built once per decision by the profile.

    `request` is the parsed request (`extproc/request.InferenceRequest`: model, lora, prompt via
    `prompt_text()`, priority, tenant) or None on routes that parse no body; `labels` the
    configured labels of the backend's endpoints by id (`backend.endpoint_labels`)."""

    state: Any  # extproc.types.RequestState
    backend: Any  # extproc.config.snapshot.Backend
    request: Any  # extproc.request.InferenceRequest | None
    runtime: Any  # extproc.runtime.Runtime (in-flight table, caches)
    labels: Mapping[str, Mapping[str, str]]
    profile: str
    cycle: dict = field(default_factory=dict)  # per-decision scratch a plugin passes from score() to picked()


INFLIGHT_COUNTS = "inflight_counts"  # ctx.cycle: (candidates, their in-flight counts)
INFLIGHT_LOADS = "inflight_loads"  # ctx.cycle: (candidates, their (requests, tokens, pending prefill) in flight)
# state.attrs: the prompt tokens the picked endpoint must compute (its uncached part), set by a plugin's
# picked hook that knows what the endpoint holds (prefix-cache-scorer); dispatch counts it as the pick's
# pending prefill in the in-flight table (else the whole prompt counts)
PREFILL_ATTR = "inflight.prefill_tokens"


def inflight_loads(ctx: Any, runtime: Any, candidates: tuple[str, ...]) -> dict[str, tuple[int, int, int]]:
    """The candidates' gateway-wide (requests, tokens, pending prefill tokens) in flight, read once per
    decision (`ctx.cycle`) for every plugin that needs them (one pass over the workers' tables;
    without a decision context, e.g. a plugin called directly, a fresh read)."""
    cycle = getattr(ctx, "cycle", None)
    if cycle is None:
        return runtime.inflight.loads(candidates)
    found = cycle.get(INFLIGHT_LOADS)
    if found is None or found[0] != candidates:
        found = cycle[INFLIGHT_LOADS] = (candidates, runtime.inflight.loads(candidates))
    return found[1]


def inflight_counts(ctx: Any, runtime: Any, candidates: tuple[str, ...]) -> dict[str, int]:
    """The candidates' gateway-wide in-flight request counts: from the same one read per decision as
    `inflight_loads` (in-flight-scorer, predicted-ttft-scorer)."""
    cycle = getattr(ctx, "cycle", None)
    if cycle is None:
        return runtime.inflight.counts(candidates)
    found = cycle.get(INFLIGHT_COUNTS)
    if found is None or found[0] != candidates:
        loads = inflight_loads(ctx, runtime, candidates)
        found = cycle[INFLIGHT_COUNTS] = (candidates, {e: v[0] for e, v in loads.items()})
    return found[1]


class NoCapacity(Exception):
    """A profile's filters left no endpoint: dispatch answers 503 `no_capacity`, or 429 `overloaded`
    with Retry-After when the request is sheddable (its priority < 0, the GIE rule)."""

    def __init__(self, profile: str, backend: str, filter_name: str | None, candidates: int, sheddable: bool,
                 priority: int | None = None):
        super().__init__(f"profile {profile!r}: no endpoint of backend {backend!r} left "
                         f"after filter {filter_name!r}")
        self.profile, self.backend, self.filter = profile, backend, filter_name
        self.candidates, self.sheddable, self.priority = candidates, sheddable, priority


@runtime_checkable
class Filter(Protocol):
    type: ClassVar[str]
    slot: ClassVar[str]

    def configure(self, old: Any, new: Any) -> None: ...

    def filter(self, ctx: SchedulingContext, candidates: tuple[str, ...]) -> Iterable[str]:
        """The candidates that may serve the request (a subset; the order is the framework's)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    type: ClassVar[str]
    slot: ClassVar[str]
    bounded: ClassVar[bool]

    def configure(self, old: Any, new: Any) -> None: ...

    def score(self, ctx: SchedulingContext, candidates: tuple[str, ...]) -> Mapping[str, float]:
        """Raw scores, higher is better; an endpoint left out scores 0 after normalisation."""
        ...


@runtime_checkable
class Picker(Protocol):
    type: ClassVar[str]
    slot: ClassVar[str]

    def configure(self, old: Any, new: Any) -> None: ...

    def pick(self, ctx: Any, scored: Any, *rest: Any) -> tuple[str, ...]:
        """Endpoints ("ip:port") in order of preference, first the pick; () to let Envoy choose.
        A scoring picker gets (ctx, {endpoint: summed score}); a standalone one (state, backend, endpoints)."""
        ...


def plugin_types() -> Mapping[str, type]:
    from extproc.scheduling.health_filter import HealthFilter
    from extproc.scheduling.in_flight_scorer import InFlightScorer
    from extproc.scheduling.intent_filter import IntentFilter
    from extproc.scheduling.kv_cache_utilization_scorer import KVCacheUtilizationScorer
    from extproc.scheduling.label_filter import LabelFilter
    from extproc.scheduling.least_in_flight import LeastInFlight
    from extproc.scheduling.lora_affinity_scorer import LoraAffinityScorer
    from extproc.scheduling.max_score_picker import MaxScorePicker
    from extproc.scheduling.model_version_filter import ModelVersionFilter
    from extproc.scheduling.pinned_endpoint import PinnedEndpoint
    from extproc.scheduling.predicted_ttft_scorer import PredictedTtftScorer
    from extproc.scheduling.prefix_cache_scorer import PrefixCacheScorer
    from extproc.scheduling.queue_scorer import QueueScorer
    from extproc.scheduling.random_picker import RandomPicker
    from extproc.scheduling.rtt_scorer import RttScorer
    from extproc.scheduling.saturation_filter import SaturationFilter
    from extproc.scheduling.score_route_scorer import ScoreRouteScorer
    from extproc.scheduling.share_cap_filter import ShareCapFilter
    from extproc.scheduling.simulator_oracle_scorer import SimulatorOracleScorer  # benchmark only
    from extproc.scheduling.tenant_pool_filter import TenantPoolFilter
    from extproc.scheduling.ttft_headroom_scorer import TtftHeadroomScorer
    from extproc.scheduling.weighted_random_picker import WeightedRandomPicker

    return MappingProxyType({cls.type: cls for cls in (
        LabelFilter, SaturationFilter, HealthFilter, InFlightScorer, QueueScorer, KVCacheUtilizationScorer,
        PrefixCacheScorer, LoraAffinityScorer, MaxScorePicker, WeightedRandomPicker, RandomPicker, LeastInFlight,
        PinnedEndpoint,
        ModelVersionFilter, TenantPoolFilter, IntentFilter, ScoreRouteScorer, RttScorer, TtftHeadroomScorer,
        PredictedTtftScorer, ShareCapFilter,
        SimulatorOracleScorer)})


__all__ = ["plugin_types", "Parameters", "Plugin", "SchedulingContext", "NoCapacity", "Filter", "Scorer",
           "Picker", "SLOTS", "inflight_counts", "inflight_loads", "PREFILL_ATTR"]
