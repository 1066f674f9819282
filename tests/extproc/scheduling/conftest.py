"""Shared helpers for the scheduling tests: a pool of four labelled endpoints, test plugins with
fixed or failing behaviour (real plugin classes registered through `plugin_types`, as a user's
would be), and a builder from config text to (snapshot, runtime, service, registry)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

import extproc.scheduling as scheduling
from extproc.config.loader import load_text
from extproc.metrics import ProcessorMetrics
from extproc.request import parse_openai
from extproc.runtime import Runtime
from extproc.scheduling import Parameters, Plugin
from extproc.stream import ConfigRef, ExtProcService
from extproc.types import RequestState

E1, E2, E3, E4 = "127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004"
POOL = (E1, E2, E3, E4)

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: scheduling}
spec:
  backends:
    - name: pool
      models: [m]
      endpoints:
        - {address: "127.0.0.1:9001", labels: {gpu: a100, zone: eu}}
        - {address: "127.0.0.1:9002", labels: {gpu: a100, zone: us}}
        - {address: "127.0.0.1:9003", labels: {gpu: v100, zone: eu}}
        - "127.0.0.1:9004"
"""


def gateway(plugins: str, profiles: str = "", route_plugins: str = "[p]") -> str:
    text = HEAD + "  plugins:\n" + plugins
    if profiles:
        text += "  schedulingProfiles:\n" + profiles
    return text + f"  routes:\n    - {{path: /v1/, match: prefix, kind: openai, targets: [pool], plugins: {route_plugins}}}\n"


class FixedParameters(Parameters):
    scores: dict[str, float] = {}


class FixedScorer(Plugin):
    """Raw scores from its parameters (unbounded: min-max normalised by the framework)."""

    type: ClassVar[str] = "fixed-scorer"
    slot: ClassVar[str] = "scorer"
    Parameters: ClassVar[type] = FixedParameters

    def score(self, ctx, candidates):
        return {e: v for e, v in self.params.scores.items()}


class BoundedFixedScorer(FixedScorer):
    type: ClassVar[str] = "bounded-fixed-scorer"
    bounded: ClassVar[bool] = True


class FailingParameters(Parameters):
    message: str = "boom"


class FailingScorer(Plugin):
    type: ClassVar[str] = "failing-scorer"
    slot: ClassVar[str] = "scorer"
    Parameters: ClassVar[type] = FailingParameters

    def score(self, ctx, candidates):
        raise RuntimeError(self.params.message)


class FailingFilter(Plugin):
    type: ClassVar[str] = "failing-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = FailingParameters

    def filter(self, ctx, candidates):
        raise RuntimeError(self.params.message)


class FailingPicker(Plugin):
    type: ClassVar[str] = "failing-picker"
    slot: ClassVar[str] = "picker"
    Parameters: ClassVar[type] = FailingParameters

    def pick(self, ctx, scored):
        raise RuntimeError(self.params.message)


class KeepParameters(Parameters):
    keep: list[str]


class KeepFilter(Plugin):
    """Returns its `keep` list as is (in its own order, possibly with endpoints that are not candidates);
    records the candidates it was given."""

    type: ClassVar[str] = "keep-filter"
    slot: ClassVar[str] = "filter"
    Parameters: ClassVar[type] = KeepParameters

    def __init__(self, name, params, runtime):
        super().__init__(name, params, runtime)
        self.seen: list[tuple[str, ...]] = []

    def filter(self, ctx, candidates):
        self.seen.append(candidates)
        return list(self.params.keep)


TEST_PLUGINS = (FixedScorer, BoundedFixedScorer, FailingScorer, FailingFilter, FailingPicker, KeepFilter)


@pytest.fixture
def test_plugins(monkeypatch):
    real = scheduling.plugin_types()
    monkeypatch.setattr(scheduling, "plugin_types",
                        lambda: MappingProxyType({**real, **{c.type: c for c in TEST_PLUGINS}}))


@dataclass
class Built:
    snap: Any
    runtime: Runtime
    service: ExtProcService
    registry: CollectorRegistry

    @property
    def route(self):
        return self.snap.routes["v1"]

    @property
    def backend(self):
        return self.snap.backends["pool"]

    @property
    def scheduler(self):
        return self.runtime.plugin(self.route.picker)

    def state(self, priority: int | None = None, request: bool = True, rid: str = "rid-1") -> RequestState:
        st = RequestState(snapshot=self.snap, route=self.route, started=0.0, request_id=rid, runtime=self.runtime)
        if request:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            if priority is not None:
                body["priority"] = priority
            st.request = parse_openai("/v1/chat/completions", body)
        return st

    def decide(self, state: RequestState | None = None) -> tuple[str, ...]:
        state = state if state is not None else self.state()
        return self.scheduler.pick(state, self.backend, self.backend.endpoint_ids)

    def reload(self, text: str, generation: int = 2) -> None:
        self.snap = load_text(text, "sched.yaml", generation)
        self.service.config.swap(self.snap)

    def samples(self):
        from tests.promtext import collect

        return collect(self.registry, flush=[self.service])


def build(text: str) -> Built:
    snap = load_text(text, "sched.yaml")
    rt = Runtime()
    registry = CollectorRegistry()
    svc = ExtProcService(ConfigRef(snap), ProcessorMetrics(registry), runtime=rt)
    return Built(snap, rt, svc, registry)
