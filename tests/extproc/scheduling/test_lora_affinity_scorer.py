"""Scorer `lora-affinity-scorer`: GIE's values (running 1.0, free slot 0.8, waiting 0.6, else 0) on recorded
vLLM LoRA states, plus this plugin's own loads (loading 0.9, loaded 1.0); on-demand loading against the real
OpenAI simulator (vLLM's /v1/load_lora_adapter), off the request path."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backends.simulator_openai import SimulatorSettings, serve
from extproc.runtime import Runtime
from extproc.scheduling import Scorer
from extproc.scheduling.lora_affinity_scorer import LoraAffinityScorer, LoraAffinityScorerParameters
from extproc.scheduling.signals import scrape_targets
from tests.extproc.scheduling.conftest import E1, E2, E3, E4
from tests.extproc.scheduling.signal_fleet import SIMULATOR, VLLM, built, fleet, recorded, request_state


def test_fixture_numbers():
    v, s = recorded(VLLM), recorded(SIMULATOR)
    assert (v.lora_running, v.lora_waiting, v.max_lora) == (("finance-lora", "legal-lora"), ("sql-lora",), 4)
    assert (s.lora_running, s.lora_waiting, s.max_lora) == (("finance-lora",), ("legal-lora",), 2)


def test_is_a_bounded_scorer_that_consumes_engine_metrics():
    s = LoraAffinityScorer("lora", LoraAffinityScorerParameters(), Runtime())
    assert isinstance(s, Scorer) and s.bounded is True and s.consumes == ("engine_metrics",)
    assert s.params.load_on_demand is False and s.params.lora_paths == {}


PLUGINS = "    - {type: lora-affinity-scorer}\n    - {type: max-score-picker, parameters: {fallbacks: 0}}\n"
PROFILE = "[{pluginRef: lora-affinity-scorer}, {pluginRef: max-score-picker}]"


def lora_fleet():
    b = built(PLUGINS, PROFILE)
    # E1: vLLM, 3 adapters busy of 4 (a free slot); E2: simulator, 2 of 2 (full); E3: SGLang (no adapter names)
    fleet(b.runtime, {E1: recorded(VLLM), E2: recorded(SIMULATOR), E3: recorded("sglang_ranks", "sglang"), E4: None})
    return b, b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])


@pytest.mark.parametrize("adapter, expected", [
    ("finance-lora", {E1: 1.0, E2: 1.0, E3: 0.0, E4: 0.0}),  # running on both vLLMs
    ("legal-lora", {E1: 1.0, E2: 0.6, E3: 0.0, E4: 0.0}),  # running on E1, waiting on the full E2
    ("sql-lora", {E1: 0.8, E2: 0.0, E3: 0.0, E4: 0.0}),  # waiting on E1, but E1 has a free slot: GIE ranks that first
    ("new-lora", {E1: 0.8, E2: 0.0, E3: 0.0, E4: 0.0}),  # nowhere: a free slot on E1 only
])
def test_gie_values_on_recorded_lora_states(adapter, expected):
    b, lora = lora_fleet()
    st = request_state(b, model=adapter)
    assert lora.score(ctx_of(b, st), b.backend.endpoint_ids) == expected


def ctx_of(b, st):
    from extproc.scheduling import SchedulingContext

    return SchedulingContext(st, b.backend, st.request, b.runtime, b.backend.endpoint_labels, "p")


def test_a_base_model_request_is_neutral():
    b, lora = lora_fleet()
    for model in ("meta-llama/Llama-3.1-8B-Instruct", "llama-3-8b"):  # base models of E1 and E2's metrics
        st = request_state(b, model=model)
        assert lora.score(ctx_of(b, st), b.backend.endpoint_ids) == dict.fromkeys(b.backend.endpoint_ids, 1.0)


def test_own_loads_count_as_loaded_and_in_flight_loads_as_loading():
    b, lora = lora_fleet()
    lora.loaded[E3] = {"new-lora"}  # SGLang exports no names: only what we loaded is known
    lora.loading[(E2, "new-lora")] = object()
    st = request_state(b, model="new-lora")
    assert lora.score(ctx_of(b, st), b.backend.endpoint_ids) == {E1: 0.8, E2: 0.9, E3: 1.0, E4: 0.0}


def test_in_a_profile_the_request_goes_where_its_adapter_runs():
    b, _ = lora_fleet()
    assert {b.decide(request_state(b, model="legal-lora"))[0] for _ in range(30)} == {E1}
    assert {b.decide(request_state(b, model="finance-lora"))[0] for _ in range(60)} == {E1, E2}


# --- on-demand loading against the simulator --------------------------------------------------------------

@pytest.fixture
async def simulators():
    stops, tasks = [], []

    async def start(**kw) -> int:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        settings = SimulatorSettings(port=0, models=("base-m",), enable_lora=True, **kw)
        tasks.append(asyncio.create_task(serve(settings, stop, on_ready=lambda h, p: ready.set_result(p))))
        stops.append(stop)
        return await ready

    yield start
    for s in stops:
        s.set()
    await asyncio.gather(*tasks, return_exceptions=True)


def sim_config(ports, params: str) -> str:
    from tests.extproc.scheduling.signal_fleet import vllm_gateway

    head = ("apiVersion: adapter.ai/v1\nkind: AdapterGateway\nmetadata: {name: lora}\nspec:\n  backends:\n"
            "    - name: pool\n      kind: vllm\n      models: [base-m, fin-lora]\n      endpoints:\n"
            + "".join(f'        - "127.0.0.1:{p}"\n' for p in ports))
    return vllm_gateway("    - {type: lora-affinity-scorer, parameters: " + params + "}\n"
                        "    - {type: max-score-picker, parameters: {fallbacks: 0}}\n", PROFILE, head)


async def models_of(port: int) -> list[str]:
    async with httpx.AsyncClient() as c:
        return [m["id"] for m in (await c.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]]


async def until(predicate, what: str, deadline: float = 15.0):
    end = asyncio.get_running_loop().time() + deadline
    while not predicate():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_cold_adapter_is_loaded_on_the_picked_endpoint_and_later_requests_follow_it(simulators):
    ports = [await simulators(lora_load_ms=50), await simulators(lora_load_ms=50)]
    from tests.extproc.scheduling.conftest import build

    b = build(sim_config(ports, "{loadOnDemand: true, loraPaths: {fin-lora: /adapters/fin}}"))
    assert set(scrape_targets(b.snap)) == set(b.backend.endpoint_ids)  # the scorer consumes engine metrics
    b.runtime.start_signals()
    try:
        sig = b.runtime.signals
        await until(lambda: all(sig.sample(e) is not None for e in b.backend.endpoint_ids), "first scrapes")
        lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
        first = b.decide(request_state(b, model="fin-lora"))[0]  # both have a free slot: a tie
        assert (first, "fin-lora") in lora.loading  # started, not awaited: the decision did not wait
        await until(lambda: not lora.loading, "the load")
        assert lora.results == [(first, "fin-lora", 200)] and lora.loaded == {first: {"fin-lora"}}
        port = int(first.rsplit(":", 1)[1])
        other = next(p for p in ports if p != port)
        assert "fin-lora" in await models_of(port) and "fin-lora" not in await models_of(other)
        # from now on the adapter's requests go there (1.0 against a free slot's 0.8), and nothing more is loaded
        assert {b.decide(request_state(b, model="fin-lora"))[0] for _ in range(20)} == {first}
        await asyncio.sleep(0)
        assert not lora.loading and len(lora.results) == 1
    finally:
        await b.runtime.stop_signals()
        lora.close()


async def test_already_loaded_is_success_and_a_failure_backs_off(simulators):
    port = await simulators(lora_modules=(("fin-lora", "/preloaded/fin", "base-m"),))
    from tests.extproc.scheduling.conftest import build

    b = build(sim_config([port], "{loadOnDemand: true, retryAfter: 60, loraPaths: {fin-lora: /adapters/fin, "
                                 "base-m: /not/an/adapter}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    ep = b.backend.endpoint_ids[0]
    # no scrape: nothing known of the endpoint, the load is tried and vLLM's 400 "already loaded" is success
    b.decide(request_state(b, model="fin-lora"))
    await until(lambda: not lora.loading, "the load")
    assert lora.results == [(ep, "fin-lora", 400)] and lora.loaded == {ep: {"fin-lora"}}
    # a base model named as an adapter (no metrics say otherwise): refused with 400, backed off for 60 s
    b.decide(request_state(b, model="base-m"))
    await until(lambda: not lora.loading, "the load")
    assert lora.results[-1] == (ep, "base-m", 400) and "base-m" not in lora.loaded[ep]
    b.decide(request_state(b, model="base-m"))
    assert not lora.loading and len(lora.results) == 2
    lora.close()


async def test_without_load_on_demand_or_a_path_nothing_is_loaded(simulators):
    port = await simulators()
    from tests.extproc.scheduling.conftest import build

    for params in ("{}", "{loadOnDemand: true}"):
        b = build(sim_config([port], params))
        lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
        b.decide(request_state(b, model="fin-lora"))
        assert not lora.loading and lora.results == []
    assert "fin-lora" not in await models_of(port)


async def test_a_path_from_the_endpoint_label_wins(simulators):
    port = await simulators()
    from tests.extproc.scheduling.conftest import build

    text = sim_config([port], "{loadOnDemand: true, loraPaths: {fin-lora: /from/parameter}}").replace(
        f'- "127.0.0.1:{port}"', f'- {{address: "127.0.0.1:{port}", labels: {{lora/fin-lora: /from/label}}}}')
    b = build(text)
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    b.decide(request_state(b, model="fin-lora"))
    await until(lambda: not lora.loading, "the load")
    async with httpx.AsyncClient() as c:
        models = (await c.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]
    assert {m["id"]: m["root"] for m in models}["fin-lora"] == "/from/label"
    lora.close()


def test_built_from_config_under_its_name_with_the_workers_runtime():
    b, lora = lora_fleet()
    assert lora.name == "lora-affinity-scorer" and lora.runtime is b.runtime
    st = request_state(b, model="sql-lora")
    c = ctx_of(b, st)
    lora.score(c, b.backend.endpoint_ids)
    assert c.cycle == {("lora-affinity-scorer", "adapter"): "sql-lora"}  # what picked() reads back, under its name


async def test_close_without_a_load_has_nothing_to_close():
    lora = LoraAffinityScorer("lora", LoraAffinityScorerParameters(), Runtime())
    lora.close()  # no client was ever made (inside a running loop, where a close would be scheduled)
    assert lora._client is None


LOG = "extproc.scheduling.lora_affinity_scorer"


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOG]


async def test_a_refused_load_is_logged_with_the_engines_answer_and_already_loaded_is_not(simulators, caplog):
    import logging

    port = await simulators(lora_modules=(("fin-lora", "/preloaded/fin", "base-m"),))
    from tests.extproc.scheduling.conftest import build

    b = build(sim_config([port], "{loadOnDemand: true, loraPaths: {fin-lora: /adapters/fin, base-m: /not/an/adapter}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    ep = b.backend.endpoint_ids[0]
    with caplog.at_level(logging.WARNING, logger=LOG):
        b.decide(request_state(b, model="fin-lora"))
        await until(lambda: not lora.loading, "the load")
        assert lora.loaded == {ep: {"fin-lora"}} and warnings_of(caplog) == []  # "already been loaded": success
        b.decide(request_state(b, model="base-m"))
        await until(lambda: not lora.loading, "the load")
    (message,) = warnings_of(caplog)
    # the adapter, its path, the endpoint, the status and the engine's own words
    assert message.startswith(f"loading LoRA adapter 'base-m' (/not/an/adapter) on {ep}: HTTP 400 ")
    assert "'base-m' is a base model name, not an adapter." in message
    client = lora._client
    lora.close()
    await until(lambda: client.is_closed, "the client's close")  # scheduled on the running loop
    assert lora._client is None


async def test_a_load_slower_than_load_timeout_fails_and_is_not_retried_within_retry_after(simulators, caplog):
    import logging

    port = await simulators(lora_load_ms=2000)  # the engine takes 2 s to answer the load
    from tests.extproc.scheduling.conftest import build

    b = build(sim_config([port], "{loadOnDemand: true, loadTimeout: 0.2, retryAfter: 60, "
                                 "loraPaths: {fin-lora: /adapters/fin}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    ep = b.backend.endpoint_ids[0]
    with caplog.at_level(logging.WARNING, logger=LOG):
        b.decide(request_state(b, model="fin-lora"))
        await until(lambda: not lora.loading, "the load")
    ((_, _, status),) = lora.results
    assert lora.results == [(ep, "fin-lora", status)] and status.startswith("ReadTimeout: ")  # 0.2 s, not the 2 s
    assert lora.loaded == {} and (ep, "fin-lora") in lora.failed_until
    assert warnings_of(caplog) == [f"loading LoRA adapter 'fin-lora' (/adapters/fin) on {ep} failed: {status}"]
    b.decide(request_state(b, model="fin-lora"))
    assert not lora.loading  # backed off
    lora.close()


async def test_a_reload_applies_a_new_load_timeout_to_the_next_load(simulators):
    port = await simulators(lora_load_ms=600)
    from tests.extproc.scheduling.conftest import build

    paths = "loraPaths: {fin-lora: /adapters/fin, sql-lora: /adapters/sql}"
    text = sim_config([port], "{loadOnDemand: true, loadTimeout: 5, retryAfter: 60, " + paths + "}").replace(
        "models: [base-m, fin-lora]", "models: [base-m, fin-lora, sql-lora]")
    b = build(text)
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    ep = b.backend.endpoint_ids[0]
    b.decide(request_state(b, model="fin-lora"))
    await until(lambda: not lora.loading, "the first load")
    assert lora.results == [(ep, "fin-lora", 200)]  # 0.6 s, within 5 s; the HTTP client now exists
    b.reload(text.replace("loadTimeout: 5", "loadTimeout: 0.2"))
    assert lora.params.load_timeout == 0.2
    b.decide(request_state(b, model="sql-lora"))
    await until(lambda: not lora.loading, "the second load")
    assert lora.results[-1][:2] == (ep, "sql-lora") and str(lora.results[-1][2]).startswith("ReadTimeout")
    lora.close()


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed: connections are refused


class FakeTime:
    def __init__(self, t: float):
        self.t = t

    def monotonic(self) -> float:
        return self.t


async def test_retry_after_is_counted_from_the_failure(monkeypatch, caplog):
    import logging

    from extproc.scheduling import lora_affinity_scorer
    from tests.extproc.scheduling.conftest import build

    clock = FakeTime(100.0)
    monkeypatch.setattr(lora_affinity_scorer, "time", clock)  # the module's clock only (not the event loop's)
    b = build(sim_config([closed_port()], "{loadOnDemand: true, retryAfter: 10, loraPaths: {fin-lora: /adapters/fin}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    ep = b.backend.endpoint_ids[0]
    with caplog.at_level(logging.WARNING, logger=LOG):
        b.decide(request_state(b, model="fin-lora"))
        await until(lambda: not lora.loading, "the load")
    ((_, _, status),) = lora.results
    assert status.startswith("ConnectError: ") and lora.loaded == {}
    assert warnings_of(caplog) == [f"loading LoRA adapter 'fin-lora' (/adapters/fin) on {ep} failed: {status}"]
    assert lora.failed_until == {(ep, "fin-lora"): 110.0}  # the failure's time + retryAfter
    clock.t = 109.999
    b.decide(request_state(b, model="fin-lora"))
    assert not lora.loading  # within the 10 s
    clock.t = 110.0
    b.decide(request_state(b, model="fin-lora"))
    assert (ep, "fin-lora") in lora.loading  # the 10 s are over: asked again
    await until(lambda: not lora.loading, "the second load")
    assert len(lora.results) == 2 and lora.failed_until == {(ep, "fin-lora"): 120.0}
    lora.close()


async def test_the_last_64_results_are_kept(monkeypatch):
    from extproc.scheduling import lora_affinity_scorer
    from tests.extproc.scheduling.conftest import build

    monkeypatch.setattr(lora_affinity_scorer, "time", FakeTime(100.0))
    b = build(sim_config([closed_port()], "{loadOnDemand: true, retryAfter: 0, loraPaths: {fin-lora: /adapters/fin}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    for i in range(70):  # retryAfter 0: every decision asks again
        b.decide(request_state(b, model="fin-lora"))
        assert lora.loading
        await until(lambda: not lora.loading, "the load")
        assert len(lora.results) == min(i + 1, 64)
    lora.close()


async def test_the_load_goes_straight_to_the_endpoint_whatever_proxy_the_environment_names(simulators, monkeypatch):
    port = await simulators()
    from tests.extproc.scheduling.conftest import build

    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{closed_port()}")  # a proxy that is not there
    b = build(sim_config([port], "{loadOnDemand: true, loraPaths: {fin-lora: /adapters/fin}}"))
    lora = b.runtime.plugin(b.snap.plugins["lora-affinity-scorer"])
    b.decide(request_state(b, model="fin-lora"))
    await until(lambda: not lora.loading, "the load")
    assert lora.results == [(b.backend.endpoint_ids[0], "fin-lora", 200)]
    lora.close()
