"""Plugins of the dispatch slot, declared in the config's `plugins:` section and referenced per route.

What: `plugin_types()` is the explicit registry (type name -> class; no import side effects). A
plugin class has `type` (its config name), `slot` (`picker` today: chooses the endpoint and its
fallbacks among the chosen backend's endpoints), `Parameters` (a strict pydantic model: the
config's `parameters` are validated against it at load, errors with file:line), and is built
once per worker by the `Runtime` as `cls(name, params, runtime)`; it lives across config
reloads: on a reload the runtime calls `configure(old_params, new_params)` and the plugin keeps
whatever state is still valid (the mitmproxy `configure(updated)` rule).
```yaml
spec:
  plugins:
    - {name: busy-aware, type: least-in-flight}
    - {name: canary-host, type: pinned-endpoint, parameters: {endpoint: "10.0.0.7:8000"}}
  routes:
    - {path: /v1/, match: prefix, kind: openai, target: llm, plugins: [busy-aware]}
```
Without a picker the processor names no endpoint and Envoy's own balancing (least request over
the cluster) chooses: the fallback of the endpoint-picker protocol. The filter -> scorer -> picker
framework (issue "Context-aware routing") plugs its profiles into this same slot.
Cost: per plugin, its own docstring says; the dispatch point adds one call.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

SLOTS = ("picker",)


class Parameters(BaseModel):
    """Base of every plugin's parameters: strict (unknown keys refused) and frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Plugin:
    """What every plugin has: its name, its parameters and the worker's runtime; `configure` takes the
    new parameters (a plugin with state to keep or rebuild on a reload overrides it)."""

    def __init__(self, name: str, params: Any, runtime: Any):
        self.name = name
        self.params = params
        self.runtime = runtime

    def configure(self, old: Any, new: Any) -> None:
        self.params = new


@runtime_checkable
class Picker(Protocol):
    type: ClassVar[str]
    slot: ClassVar[str]

    def configure(self, old: Any, new: Any) -> None: ...

    def pick(self, state: Any, backend: Any, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        """Endpoints ("ip:port") in order of preference, first the pick; () to let Envoy choose."""
        ...


def plugin_types() -> Mapping[str, type]:
    from extproc.scheduling.least_in_flight import LeastInFlight
    from extproc.scheduling.pinned_endpoint import PinnedEndpoint

    return MappingProxyType({cls.type: cls for cls in (LeastInFlight, PinnedEndpoint)})


__all__ = ["plugin_types", "Parameters", "Picker", "Plugin", "SLOTS"]
