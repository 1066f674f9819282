"""The per-worker Runtime: plugin instances live across reloads (configure, drop, rebuild), caches too."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

import extproc.scheduling as scheduling
from extproc.config.loader import load_text
from extproc.metrics import ProcessorMetrics
from extproc.runtime import Runtime
from extproc.scheduling import Parameters
from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.pinned_endpoint import PinnedEndpoint
from extproc.stream import ConfigRef, ExtProcService

HEAD = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: runtime}
spec:
  backends:
    - {name: beta, endpoints: ["127.0.0.1:9001", "127.0.0.1:9002"], models: [m2]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, targets: [beta]}
"""


def snap_with(plugins: str, generation: int = 1):
    text = HEAD + ("  plugins:\n" + plugins if plugins else "")
    return load_text(text, "rt.yaml", generation)


class FakeParameters(Parameters):
    level: int = 0


class FakePlugin:
    """Records what the runtime does to it."""

    type: ClassVar[str] = "fake"
    slot: ClassVar[str] = "picker"
    Parameters: ClassVar[type] = FakeParameters
    built: ClassVar[list] = []

    def __init__(self, name: str, params: FakeParameters, runtime: Any):
        self.name, self.params, self.runtime = name, params, runtime
        self.configured: list[tuple] = []
        self.closed = 0
        self.on_configure = None
        FakePlugin.built.append(self)

    def configure(self, old: FakeParameters, new: FakeParameters) -> None:
        self.configured.append((old, new))
        if self.on_configure is not None:
            self.on_configure()
        self.params = new

    def pick(self, state, backend, endpoints):
        return ()

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def fake(monkeypatch):
    real = scheduling.plugin_types()
    FakePlugin.built = []
    monkeypatch.setattr(scheduling, "plugin_types", lambda: MappingProxyType({**real, FakePlugin.type: FakePlugin}))
    return FakePlugin


def instances(rt: Runtime) -> dict:
    return {name: rt.plugin(ref) for name, ref in rt.installed.plugins.items()}


# --- install ---------------------------------------------------------------------------------------


def test_install_builds_each_declared_plugin_once():
    snap = snap_with("    - {name: busy, type: least-in-flight}\n"
                     "    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '127.0.0.1:9001'}}\n")
    rt = Runtime()
    rt.install(snap)
    got = instances(rt)
    assert isinstance(got["busy"], LeastInFlight) and isinstance(got["pin"], PinnedEndpoint)
    assert got["busy"].name == "busy" and got["busy"].runtime is rt
    assert got["pin"].params.endpoint == "127.0.0.1:9001"
    assert rt.installed is snap
    rt.install(snap)  # same snapshot again: nothing rebuilt
    assert instances(rt) == got and all(instances(rt)[n] is got[n] for n in got)
    # the same instance whichever snapshot's ref asks (a reload of equal text)
    again = snap_with("    - {name: busy, type: least-in-flight}\n"
                      "    - {name: pin, type: pinned-endpoint, parameters: {endpoint: '127.0.0.1:9001'}}\n", 2)
    rt.install(again)
    assert rt.plugin(again.plugins["busy"]) is got["busy"]


def test_install_builds_at_install_not_at_first_use(fake):
    rt = Runtime()
    rt.install(snap_with("    - {name: f, type: fake}\n"))
    assert len(fake.built) == 1
    rt.plugin(rt.installed.plugins["f"])
    assert len(fake.built) == 1


def test_reload_with_changed_parameters_configures_the_same_instance_keeping_state():
    rt = Runtime()
    first = snap_with("    - {name: busy, type: least-in-flight}\n")
    rt.install(first)
    inst = rt.plugin(first.plugins["busy"])
    inst.pick(None, None, ("a:1", "b:1", "c:1"))
    inst.pick(None, None, ("a:1", "b:1", "c:1"))
    rr = inst._rr
    assert rr == 2
    second = snap_with("    - {name: busy, type: least-in-flight, parameters: {fallbacks: 0}}\n", 2)
    rt.install(second)
    assert rt.plugin(second.plugins["busy"]) is inst
    assert inst.params.fallbacks == 0 and inst._rr == rr
    assert inst.pick(None, None, ("a:1", "b:1", "c:1")) == ("a:1",)  # the new parameters apply


def test_configure_gets_old_and_new_params_only_when_they_changed(fake):
    rt = Runtime()
    s1 = snap_with("    - {name: f, type: fake, parameters: {level: 1}}\n")
    rt.install(s1)
    (inst,) = fake.built
    rt.install(snap_with("    - {name: f, type: fake, parameters: {level: 1}}\n", 2))
    assert inst.configured == []  # equal parameters: nothing to reconfigure
    s3 = snap_with("    - {name: f, type: fake, parameters: {level: 2}}\n", 3)
    rt.install(s3)
    assert inst.configured == [(FakeParameters(level=1), FakeParameters(level=2))]
    assert fake.built == [inst] and inst.params is s3.plugins["f"].params
    s4 = snap_with("    - {name: f, type: fake, parameters: {level: 3}}\n", 4)
    rt.install(s4)
    assert inst.configured[-1] == (FakeParameters(level=2), FakeParameters(level=3))  # old is the last installed


def test_removed_plugin_is_dropped_and_closed(fake):
    rt = Runtime()
    rt.install(snap_with("    - {name: f, type: fake}\n    - {name: busy, type: least-in-flight}\n"))
    (inst,) = fake.built
    busy = rt.plugin(rt.installed.plugins["busy"])
    rt.install(snap_with("    - {name: busy, type: least-in-flight}\n", 2))
    assert inst.closed == 1
    assert ("f", "fake") not in rt._plugins and ("f", "fake") not in rt._params
    assert rt.plugin(rt.installed.plugins["busy"]) is busy  # the kept one is untouched
    rt.install(snap_with("", 3))
    assert inst.closed == 1 and rt._plugins == {}


def test_removed_plugin_without_close_is_just_dropped():
    rt = Runtime()
    rt.install(snap_with("    - {name: busy, type: least-in-flight}\n"))
    rt.install(snap_with("", 2))
    assert rt._plugins == {} and rt._params == {}


def test_type_change_builds_a_new_instance(fake):
    rt = Runtime()
    s1 = snap_with("    - {name: p, type: fake}\n")
    rt.install(s1)
    (old,) = fake.built
    s2 = snap_with("    - {name: p, type: least-in-flight}\n", 2)
    rt.install(s2)
    new = rt.plugin(s2.plugins["p"])
    assert isinstance(new, LeastInFlight) and old.closed == 1 and old.configured == []
    assert list(rt._plugins) == [("p", "least-in-flight")]
    # and back: a fresh fake, not the closed one
    s3 = snap_with("    - {name: p, type: fake}\n", 3)
    rt.install(s3)
    assert len(fake.built) == 2 and rt.plugin(s3.plugins["p"]) is fake.built[1] is not old


def test_renamed_plugin_is_a_new_instance(fake):
    rt = Runtime()
    rt.install(snap_with("    - {name: a, type: fake}\n"))
    rt.install(snap_with("    - {name: b, type: fake}\n", 2))
    assert len(fake.built) == 2 and fake.built[0].closed == 1 and fake.built[1].name == "b"


def test_cache_survives_installs():
    rt = Runtime()
    rt.install(snap_with("    - {name: busy, type: least-in-flight}\n"))
    c = rt.cache("model-metadata")
    c["m"] = {"inputs": []}
    rt.install(snap_with("", 2))
    assert rt.cache("model-metadata") is c and c == {"m": {"inputs": []}}
    assert rt.cache("other") is not c and rt.cache("other") == {}


def test_plugin_for_an_older_snapshot_is_built_on_first_use():
    rt = Runtime()
    old = snap_with("    - {name: busy, type: least-in-flight}\n")
    rt.install(snap_with("", 2))  # the worker moved on; a stream of the older config still asks
    inst = rt.plugin(old.plugins["busy"])
    assert isinstance(inst, LeastInFlight) and rt.plugin(old.plugins["busy"]) is inst


# --- ConfigRef + ExtProcService --------------------------------------------------------------------


def test_swap_installs_in_the_runtime_before_the_snapshot_is_current(fake):
    s1 = snap_with("    - {name: f, type: fake, parameters: {level: 1}}\n")
    ref = ConfigRef(s1)
    rt = Runtime()
    ExtProcService(ref, ProcessorMetrics(CollectorRegistry()), runtime=rt)
    assert rt.installed is s1  # the service installs the current snapshot when it starts
    (inst,) = fake.built
    seen = []
    inst.on_configure = lambda: seen.append((ref.current, rt.installed))
    s2 = snap_with("    - {name: f, type: fake, parameters: {level: 2}}\n", 2)
    assert s2.digest != s1.digest
    ref.swap(s2)
    assert seen == [(s1, s1)]  # configured while streams still saw the old snapshot
    assert ref.current is s2 and rt.installed is s2 and inst.params.level == 2
    assert ref.resolve(s1.digest) is s1 and ref.resolve(s2.digest) is s2


def test_swap_calls_install_with_the_new_snapshot_before_assignment():
    s1 = snap_with("")
    ref = ConfigRef(s1)

    class Recording(Runtime):
        def install(self, snapshot):
            calls.append((snapshot, ref.current))
            super().install(snapshot)

    calls: list = []
    rt = Recording()
    ExtProcService(ref, ProcessorMetrics(CollectorRegistry()), runtime=rt)
    assert calls == [(s1, s1)]
    s2 = snap_with("    - {name: busy, type: least-in-flight}\n", 2)
    ref.swap(s2)
    assert calls[-1] == (s2, s1)
    assert isinstance(rt.plugin(s2.plugins["busy"]), LeastInFlight)


def test_service_does_not_reinstall_a_runtime_already_installed(fake):
    s1 = snap_with("    - {name: f, type: fake}\n")
    rt = Runtime()
    rt.install(s1)
    ExtProcService(ConfigRef(s1), ProcessorMetrics(CollectorRegistry()), runtime=rt)
    assert len(fake.built) == 1 and rt.installed is s1


def test_service_observer_and_release_are_lifecycle_observers():
    from extproc.stages.dispatch import release

    rt = Runtime()
    svc = ExtProcService(ConfigRef(snap_with("")), ProcessorMetrics(CollectorRegistry()), runtime=rt)
    assert rt.lifecycle.observers[0] is release and svc.observer in rt.lifecycle.observers


# --- scheduling profiles ---------------------------------------------------------------------------

PROFILED = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: runtime-profiles}
spec:
  backends:
    - name: beta
      models: [m2]
      endpoints: [{address: "127.0.0.1:9001", labels: {gpu: a100}}, "127.0.0.1:9002"]
  plugins:
PLUGINS
  schedulingProfiles:
PROFILES
  routes:
    - {path: /v1/, match: prefix, kind: openai, targets: [beta], plugins: [p]}
"""


def profiled(plugins: str, profiles: str, generation: int = 1):
    return load_text(PROFILED.replace("PLUGINS\n", plugins).replace("PROFILES\n", profiles), "rt.yaml", generation)


def test_a_reload_keeps_the_profile_and_its_plugins_and_applies_the_new_config():
    from extproc.scheduling.profile import SchedulingProfile

    rt = Runtime()
    s1 = profiled("    - {type: in-flight-scorer}\n    - {name: best, type: max-score-picker}\n",
                  "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}, {pluginRef: best}]\n")
    rt.install(s1)
    prof = rt.plugin(s1.routes["v1"].picker)
    assert isinstance(prof, SchedulingProfile) and prof.ref is s1.profiles["p"]
    picker = rt.plugin(s1.plugins["best"])
    rng = picker.rng
    scorer = rt.plugin(s1.plugins["in-flight-scorer"])
    assert prof.scorers == (("in-flight-scorer", scorer, 1.0, True),) and prof.picker == ("best", picker)
    # new weight, new picker parameters, a filter added, explain on
    s2 = profiled("    - {type: in-flight-scorer}\n    - {name: best, type: max-score-picker, parameters: {fallbacks: 0}}\n"
                  "    - {name: a100, type: label-filter, parameters: {matchLabels: {gpu: a100}}}\n",
                  "    - name: p\n      explain: true\n      plugins: [{pluginRef: a100}, "
                  "{pluginRef: in-flight-scorer, weight: 4}, {pluginRef: best}]\n", 2)
    rt.install(s2)
    assert rt.plugin(s2.routes["v1"].picker) is prof and prof.ref is s2.profiles["p"]  # the same long-lived profile
    assert rt.plugin(s2.plugins["best"]) is picker and picker.rng is rng and picker.params.fallbacks == 0
    assert prof.scorers == (("in-flight-scorer", scorer, 4.0, True),) and prof.explain is True
    assert [n for n, _ in prof.filters] == ["a100"]
    from extproc.types import RequestState

    st = RequestState(snapshot=s2, route=s2.routes["v1"], started=0.0, runtime=rt)
    backend = s2.backends["beta"]
    assert prof.pick(st, backend, backend.endpoint_ids) == ("127.0.0.1:9001",)  # filtered, no fallbacks
    assert st.attrs["decision"]["scorers"][0]["weight"] == 4.0


def test_a_reload_rebinds_a_profile_to_a_plugin_whose_type_changed():
    rt = Runtime()
    rt.install(profiled("    - {name: pick, type: max-score-picker}\n", "    - name: p\n      plugins: [{pluginRef: pick}]\n"))
    prof = rt._profiles["p"]
    s2 = profiled("    - {name: pick, type: random-picker}\n", "    - name: p\n      plugins: [{pluginRef: pick}]\n", 2)
    rt.install(s2)
    assert rt._profiles["p"] is prof and type(prof.picker[1]).__name__ == "RandomPicker"
    assert prof.picker[1] is rt.plugin(s2.plugins["pick"])


def test_removed_profiles_are_dropped_and_the_default_picker_is_kept_while_used():
    rt = Runtime()
    s1 = profiled("    - {type: in-flight-scorer}\n", "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n")
    rt.install(s1)
    prof = rt._profiles["p"]
    default = rt._plugins[("max-score-picker", "max-score-picker")]  # not in spec.plugins: the profile's default
    assert prof.picker == ("max-score-picker", default)
    rt.install(profiled("    - {type: in-flight-scorer}\n", "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n",
                        2))
    assert rt._profiles["p"] is prof and rt._plugins[("max-score-picker", "max-score-picker")] is default
    s3 = load_text(HEAD, "rt.yaml", 3)
    rt.install(s3)
    assert rt._profiles == {} and rt._plugins == {}
    # a stream of the older config still asks for it: built on first use
    again = rt.plugin(s1.routes["v1"].picker)
    assert again is not prof and again.ref is s1.profiles["p"] and rt.plugin(s1.routes["v1"].picker) is again


def test_the_service_gives_profiles_its_metrics_sink():
    rt = Runtime()
    svc = ExtProcService(ConfigRef(profiled("    - {type: in-flight-scorer}\n",
                                            "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}]\n")),
                         ProcessorMetrics(CollectorRegistry()), runtime=rt)
    assert rt.metrics_sink is svc.observer


# --- engine signals: the runtime's one scraper -------------------------------------------------------------

SIGNALS = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: signals}
spec:
  backends:
    - name: pool
      kind: vllm
      models: [m]
      endpoints: [ENDPOINTS]
    - {name: plain, endpoints: ["127.0.0.1:9101"], models: [other]}
  plugins:
PLUGINS
  schedulingProfiles:
    - name: p
      plugins: [PROFILE]
  routes:
    - {path: /v1/, match: prefix, kind: openai, targets: [pool, plain], plugins: [p]}
"""


def signals_config(endpoints: str, plugins: str, profile: str, generation: int = 1):
    text = (SIGNALS.replace("ENDPOINTS", endpoints).replace("PLUGINS\n", plugins).replace("PROFILE", profile))
    return load_text(text, "rt.yaml", generation)


QUEUE = ("    - {type: queue-scorer}\n", "{pluginRef: queue-scorer}")
INFLIGHT = ("    - {type: in-flight-scorer}\n", "{pluginRef: in-flight-scorer}")


def test_scrape_targets_are_the_engine_endpoints_of_routes_whose_profile_consumes_engine_metrics():
    from extproc.scheduling.signals import scrape_targets

    eps = '"127.0.0.1:9001", {address: "127.0.0.1:9002", metricsPath: /engine/metrics}, ' \
          '{address: "127.0.0.1:9003", engine: openai}, {address: "127.0.0.1:9004", engine: sglang}'
    snap = signals_config(eps, *QUEUE)
    # the openai endpoint (no metric names known) and the `plain` backend (kind openai) are not scraped
    assert scrape_targets(snap) == {"127.0.0.1:9001": ("http://127.0.0.1:9001/metrics", "vllm"),
                                    "127.0.0.1:9002": ("http://127.0.0.1:9002/engine/metrics", "vllm"),
                                    "127.0.0.1:9004": ("http://127.0.0.1:9004/metrics", "sglang")}
    assert scrape_targets(signals_config(eps, *INFLIGHT)) == {}  # no plugin needs engine metrics: no scrape
    rt = Runtime()
    rt.install(snap)
    assert set(rt.scrape_targets) == {"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9004"}
    assert not rt.signals.running  # recorded; started by the worker's loop only


def test_every_engine_signal_plugin_declares_what_it_consumes():
    from extproc.scheduling import plugin_types

    consuming = {t for t, cls in plugin_types().items() if "engine_metrics" in getattr(cls, "consumes", ())}
    assert consuming >= {"queue-scorer", "kv-cache-utilization-scorer", "saturation-filter", "health-filter",
                         "lora-affinity-scorer"}
    assert not consuming & {"in-flight-scorer", "prefix-cache-scorer", "label-filter", "max-score-picker"}


async def test_the_runtime_scrapes_real_servers_and_its_profiles_decide_on_what_they_serve():
    from tests.extproc.datalayer.test_scraper import BUSY_TEXT, IDLE_TEXT, MetricsServer, until
    from tests.extproc.scheduling.conftest import build  # noqa: F401 - same builder shape as the plugin tests
    from extproc.types import RequestState
    from extproc.request import parse_openai

    busy, idle = MetricsServer(BUSY_TEXT), MetricsServer(IDLE_TEXT)  # queue 3, queue 0
    rt = Runtime()
    try:
        snap = signals_config(f'"{busy.endpoint}", "{idle.endpoint}"', *QUEUE)
        rt.install(snap)
        rt.start_signals()
        assert rt.signals.running and set(rt.signals.endpoints()) == {busy.endpoint, idle.endpoint}
        await until(lambda: rt.signals.sample(busy.endpoint) and rt.signals.sample(idle.endpoint), "samples")
        assert (rt.signals.sample(busy.endpoint).queue, rt.signals.sample(idle.endpoint).queue) == (3, 0)
        prof = rt.plugin(snap.routes["v1"].picker)
        st = RequestState(snapshot=snap, route=snap.routes["v1"], started=0.0, request_id="r", runtime=rt)
        st.request = parse_openai("/v1/chat/completions", {"model": "m", "messages": []})
        backend = snap.backends["pool"]
        assert {prof.pick(st, backend, backend.endpoint_ids)[0] for _ in range(20)} == {idle.endpoint}
        # the scraper's in-flight reader is the runtime's gateway-wide table: a request there makes it busy
        assert rt.signals.interval(idle.endpoint) == 2.0
        rt.inflight.started(idle.endpoint)
        assert rt.signals.interval(idle.endpoint) == 0.2
        # a reload that keeps the endpoints keeps their samples; one with no engine-signal plugin scrapes nothing
        kept = rt.signals.sample(busy.endpoint)
        rt.install(signals_config(f'"{busy.endpoint}", "{idle.endpoint}"', *QUEUE, generation=2))
        assert rt.signals.sample(busy.endpoint) is kept
        rt.install(signals_config(f'"{busy.endpoint}", "{idle.endpoint}"', *INFLIGHT, generation=3))
        assert rt.signals.endpoints() == ()
        rt.install(signals_config(f'"{idle.endpoint}"', *QUEUE, generation=4))
        assert rt.signals.endpoints() == (idle.endpoint,)
    finally:
        await rt.stop_signals()
        busy.close()
        idle.close()
    assert not rt.signals.running


async def test_a_runtime_started_with_nothing_to_scrape_starts_its_scraper_on_the_first_install_that_has_some():
    from tests.extproc.datalayer.test_scraper import IDLE_TEXT, MetricsServer, until

    server = MetricsServer(IDLE_TEXT)
    rt = Runtime()
    try:
        rt.install(signals_config(f'"{server.endpoint}"', *INFLIGHT))
        rt.start_signals()
        assert not rt.signals.running and server.hits == 0
        rt.install(signals_config(f'"{server.endpoint}"', *QUEUE, generation=2))
        assert rt.signals.running
        await until(lambda: server.hits > 0, "a scrape")
    finally:
        await rt.stop_signals()
        server.close()


async def test_the_worker_starts_the_scraper_in_its_loop_and_stops_it_on_shutdown(tmp_path):
    import asyncio

    from extproc.server import WorkerSettings, serve
    from tests.extproc.datalayer.test_scraper import BUSY_TEXT, MetricsServer, until

    server = MetricsServer(BUSY_TEXT)  # busy: scraped every 0.2 s
    try:
        text = SIGNALS.replace("ENDPOINTS", f'"{server.endpoint}"').replace("PLUGINS\n", QUEUE[0]).replace(
            "PROFILE", QUEUE[1])
        cfg = tmp_path / "gw.yaml"
        cfg.write_text(text)
        stop, ready = asyncio.Event(), asyncio.Event()
        settings = WorkerSettings(str(cfg), "127.0.0.1", 0, drain_delay=0.0, shutdown_grace=0.5)
        task = asyncio.create_task(serve(settings, stop, ready))
        await asyncio.wait_for(ready.wait(), 30)
        await until(lambda: server.hits >= 2, "scrapes while the worker serves")
        stop.set()
        await asyncio.wait_for(task, 30)
        hits = server.hits
        await asyncio.sleep(0.6)  # three busy intervals: a scraper left running would scrape again
        assert server.hits == hits
    finally:
        server.close()
